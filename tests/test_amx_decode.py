"""The decode nests on Intel AMX tiles (issue 63): ``decode_dot`` 6 (real, where the CPU has AMX)
and 7 (the same calls emulated in plain TIR, on every host).

A decode tile holds ``group`` rows per kv head (4 for GQA 32:8), the columns of its key-major
score tile: QKᵀ reads K's rows in place (a paged cache's too, where its pages hold whole blocks
of 16 keys) against q's pairs (bf16) or quads (``qk_int8``: ``tdpbssd``), PV multiplies P rounded
to bf16 by V's pairs. Each case runs every validation case of its layout (``validate_built``:
tail tiles, empty caches, split-KV) against the float64 reference."""
import dataclasses

import pytest
from tvm_attention.schedules._knobs import KnobError

from tvm_attention.artifact import validate_built
from tvm_attention.build import build_kernel
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target, target_features

HOST = target_features(resolve_target("llvm"))
#: a target with AMX whatever the host: the real form compiles anywhere, runs only on AMX hosts
SPR = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}

GQA = AttentionSpec(batch=3, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64, causal=True, dtype="bfloat16",
                    layout="kvcache")
INT8 = dict(kv_dtype="int8", qk_int8=True)
#: the layouts and forms a decode tile takes: in place (kvcache; paged pages of 16 keys), staged
#: (pages of 8 keys), several kv heads per task, split-KV with lse, MHA's one row, a model's
#: variants together, the user's bit mask, int8 per token
CASES = {
    "kvcache": ({}, {"decode_heads": 1}),
    "kvcache-heads2-lse": (dict(return_lse=True), {"decode_heads": 2}),
    "paged16-split": (dict(layout="paged", page_size=16), {"decode_heads": 1, "split_tasks": 16}),
    "paged8-heads2": (dict(layout="paged", page_size=8), {"decode_heads": 2}),
    "mha": (dict(heads=4, kv_heads=4), {"decode_heads": 1}),
    "variants": (dict(softcap=30.0, alibi=True, sinks=True, window=(100, 0)), {"decode_heads": 1}),
    "custom-mask": (dict(custom_mask=True), {"decode_heads": 2}),
    "int8-token": (dict(INT8, kv_scale="token"), {"decode_heads": 2}),
    "int8-paged": (dict(INT8, layout="paged", page_size=16), {"decode_heads": 1}),
}


def _real(spec) -> bool:
    return {"amx-tile", "amx-int8" if spec.qk_int8 else "amx-bf16"} <= HOST


@pytest.mark.parametrize("name", list(CASES))
def test_the_decode_tiles_match_the_reference(name):
    """On the tiles where the CPU has AMX, else emulated (the same calls' addresses and packing)."""
    over, knobs = CASES[name]
    spec = dataclasses.replace(GQA, **over)
    form = 6 if _real(spec) else 7
    b = build_kernel(spec, knobs={"decode_dot": form, **knobs}, cache=True)
    assert b.knobs.decode_dot == form and b.audit.fused, b.audit.reasons
    asm = b.module.inspect_source("asm")
    product = "tdpbssd" if spec.qk_int8 else "tdpbf16ps"
    assert (product in asm) == (form == 6)
    result = validate_built(b)
    assert result.passed and result.finite, result


def test_the_emulated_decode_tiles_match_the_reference_on_every_host():
    """decode_dot=7 where the host has AMX too: the emulated form (no tile instruction) at D=128."""
    spec = dataclasses.replace(GQA, head_dim=128)
    b = build_kernel(spec, knobs={"decode_dot": 7, "dot_bf16": 3, "block_m": 64, "block_n": 64}, cache=True)
    asm = b.module.inspect_source("asm")
    assert "tdpbf16ps" not in asm and "ldtilecfg" not in asm
    result = validate_built(b)
    assert result.passed and result.finite, result


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_the_real_decode_form_compiles_to_tile_instructions_on_every_host(int8):
    """A static decode step (its decode nest alone) for a Sapphire Rapids target, whatever the host:
    the decode config, the tile loads, products and stores, and the permission the exported
    function asks for before its parallel loop (no main nest on tiles here to ask for it)."""
    spec = dataclasses.replace(GQA, **(INT8 if int8 else {}))
    b = build_kernel(spec, target=SPR, knobs={"decode_dot": 6, "decode_heads": 1}, cache=True)
    asm = b.module.inspect_source("asm")
    for ins in ("ldtilecfg", "tileloadd", "tdpbssd" if int8 else "tdpbf16ps", "tilestored", "tilerelease",
                "syscall"):
        assert ins in asm, ins
    assert "tvma_amx_d4_begin" in str(b.lowered) and "tvma_amx_permit" in str(b.lowered)


def test_the_amx_preset_takes_the_decode_tiles_for_gqa():
    """The AMX preset (arithmetic on the target's features, whatever the host): GQA with bf16
    queries takes the tiles, 64-key tiles (the decode nest's own: ``decode_block_n``): a bf16
    cache one kv head per task (paged: every head of a page), an int8 one with ``qk_int8`` four;
    MHA, a paged int8 cache and float32 queries keep their vector forms (measured level or
    slower on tiles: ``cpu_fused.amx_decode_heads``)."""
    from tvm_attention.schedules.cpu_fused import DECODE_AMX, preset

    spr = resolve_target(SPR)
    gqa = AttentionSpec(batch=1, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, causal=True,
                        dtype="bfloat16", layout="kvcache")
    knobs = preset(gqa, spr)
    assert (knobs.decode_dot, knobs.decode_heads, knobs.decode_tile) == (DECODE_AMX, 1, 64)
    assert knobs.block_n == 128  # the prefill's key tile stays its own
    for other, heads in ((dict(layout="paged", page_size=16), 8), (INT8, 4)):
        knobs = preset(dataclasses.replace(gqa, **other), spr)
        assert (knobs.decode_dot, knobs.decode_heads, knobs.decode_tile) == (DECODE_AMX, heads, 64), other
    for other in (dict(kv_heads=32), dict(INT8, layout="paged", page_size=16), dict(INT8, dtype="float32")):
        assert preset(dataclasses.replace(gqa, **other), spr).decode_dot != DECODE_AMX, other


def test_the_decode_tiles_are_refused_by_name_where_they_cannot_run():
    avx512 = {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}
    with pytest.raises(KnobError, match="decode_dot=6 .*needs a CPU with amx-tile, amx-bf16"):
        build_kernel(GQA, target=avx512, knobs={"decode_dot": 6})
    with pytest.raises(KnobError, match="decode_dot=7 .*head dims in 32s and keys in 32s: head_dim=48"):
        build_kernel(dataclasses.replace(GQA, head_dim=48), knobs={"decode_dot": 7, "dot_bf16": 0})
    with pytest.raises(KnobError, match="decode_dot=7 .*head dims in 64s and keys in 32s: head_dim=96"):
        build_kernel(dataclasses.replace(GQA, head_dim=96, **INT8), knobs={"decode_dot": 7})
    with pytest.raises(KnobError, match="decode_dot=7 .*multiplies bfloat16 q and cache"):
        build_kernel(dataclasses.replace(GQA, dtype="float16"), knobs={"decode_dot": 7})


def test_the_decode_forms_script_times_the_presets_side_by_side(capsys, monkeypatch):
    """``scripts/decode_forms.py`` (the side-by-side table of docs/results/decode.md) at a tiny point:
    every build it names timed, its fraction of the roof and the preset-over-vectors ratio said."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "decode_forms.py"
    spec = importlib.util.spec_from_file_location("decode_forms", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "FORMS", [("bf16", "kvcache", None), ("bf16", "kvcache", script.VECTOR["bf16"])])
    built = script.build_forms()
    result = script.point(built, 1, 256, rounds=1, min_repeat_ms=1)
    assert len(built) == 2 and set(result["best_s"]) == set(built)
    assert all(0 < t < 1 for t in result["best_s"].values()) and all(g > 0 for g in result["roof_gbps"])
    assert result["ratios"]["bf16 kvcache preset over vectors"] > 0
    out = capsys.readouterr().out
    assert "== B1 x 256: stream read" in out and "preset over vectors" in out
