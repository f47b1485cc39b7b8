"""The fused kernel's products on Intel AMX tiles (issue 63): ``dot_bf16`` 2 (real, where the CPU
has AMX-BF16) and 3 (the same instruction sequence emulated in plain TIR, on every host).

The emulated form checks the layout and addressing of every tile load, product, transpose and
store against the float64 reference wherever the suite runs; the real form's assembly is checked
on every host (compiled for a Sapphire Rapids target) and run where the CPU has AMX."""
import dataclasses

import numpy as np
import pytest
from conftest import report
from test_halfprec import check, rounded_inputs
from tvm_attention.schedules._knobs import KnobError

from tvm_attention.artifact import kernel_of, validate_built
from tvm_attention.build import build_kernel
from tvm_attention.reference import random_inputs, reference_attention
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target, target_features

AMX_HOST = {"amx-tile", "amx-bf16"} <= target_features(resolve_target("llvm"))
needs_amx = pytest.mark.skipif(not AMX_HOST, reason="this CPU has no AMX-BF16 (grep amx_bf16 /proc/cpuinfo)")
#: a target with AMX whatever the host: the real form compiles anywhere, runs only on AMX hosts
SPR = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}
TILE = (("block_m", 64), ("block_n", 64))


def _build(spec, form, target="llvm", **knobs):
    return build_kernel(spec, target=target, knobs={"dot_bf16": form, **dict(TILE), **knobs}, cache=True)


def _check_against_reference(b, spec, seed=7, logit_scale=4.0):
    (q, k, v), exact = rounded_inputs(spec, seed=seed, logit_scale=logit_scale)
    check(spec, kernel_of(b)(q, k, v), reference_attention(spec, *exact))


# Row and key tails (113 of 64-row tiles, 203 of 64-key tiles), causal with Sq < Skv, GQA 2:1
TAILS = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=113, seq_kv=203, head_dim=64, causal=True,
                      dtype="bfloat16")


def test_the_emulated_tiles_match_the_reference_on_every_host():
    """dot_bf16=3: the AMX form's packing (q pairs, P's pairs transposed, V pairs), tile order
    and addresses, computed by plain TIR, against the float64 reference at tail tiles; its
    code holds no tile instruction (it runs anywhere)."""
    b = _build(TAILS, 3)
    assert b.audit.fused, b.audit.reasons
    asm = b.module.inspect_source("asm")
    assert "tdpbf16ps" not in asm and "ldtilecfg" not in asm
    _check_against_reference(b, TAILS)


def test_the_real_form_compiles_to_tile_instructions_on_every_host():
    """dot_bf16=2 for a Sapphire Rapids target (here, whatever the host): the assembly holds the
    tile config, loads, products, stores and release, the 16 × 16 word transposes of P, and the
    permission syscall the exported function makes before its parallel loop."""
    b = _build(TAILS, 2, target=SPR)
    asm = b.module.inspect_source("asm")
    for ins in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilezero", "tilerelease", "syscall"):
        assert ins in asm, ins
    assert "vpermt2d" in asm or "vpermi2d" in asm  # P's pairs transposed in registers
    assert "tvma_amx_permit" in str(b.lowered)
    assert b.audit.fused, b.audit.reasons


@needs_amx
@pytest.mark.parametrize("spec", [
    TAILS,
    # D=128, a short row tail, no mask; the symbolic kernel at another length than it was built at
    AttentionSpec(batch=2, heads=2, seq_q=70, seq_kv=130, head_dim=128, dtype="bfloat16"),
], ids=["tails-causal-gqa", "d128"])
def test_the_tiles_match_the_reference_where_the_cpu_has_amx(spec):
    b = _build(spec, 2)
    assert b.module.inspect_source("asm").count("tdpbf16ps") >= 8  # both products, 2 × 2 tiles each
    _check_against_reference(b, spec)


@needs_amx
def test_the_amx_preset_runs_the_layouts_on_tiles():
    """The preset on an AMX host is the tile form (128 × 128 tiles at D=64, causal); varlen takes it too."""
    spec = AttentionSpec(batch=3, heads=2, seq_q=100, seq_kv=100, head_dim=64, dtype="bfloat16", layout="varlen",
                         causal=True)
    b = build_kernel(spec, cache=True)
    assert b.knobs.dot_bf16 == 2 and (b.knobs.block_m, b.knobs.block_n) == (128, 128)
    assert "tdpbf16ps" in b.module.inspect_source("asm")
    result = validate_built(b)
    assert result.passed, result


def test_the_amx_preset_takes_the_largest_tile_that_fits():
    """The AMX preset's tile is the first of AMX_TILES within the tile working set, whatever the
    host (the preset is arithmetic on the target's features): 256 × 128 up to D=128 (128 × 128
    under a causal mask up to 4096 rows), 128 × 64 at D=256, and 64 rows × 128 keys for MLA's 576/512 latent
    (PV's accumulator tiles loaded and stored once per 128 keys)."""
    from tvm_attention.schedules.cpu_fused import preset
    spr = resolve_target(SPR)
    mla = AttentionSpec(batch=4, heads=128, seq_q=1, seq_kv=4096, head_dim=576, head_dim_v=512, layout="mla",
                        scale=0.1, causal=True, dtype="bfloat16")
    knobs = preset(mla, spr)
    assert knobs.dot_bf16 == 2 and (knobs.block_m, knobs.block_n) == (64, 128)
    for d, causal, seq, tile in ((64, False, 113, (256, 128)), (128, False, 113, (256, 128)),
                                 (128, True, 113, (128, 128)), (128, True, 8192, (256, 128)),
                                 (256, False, 113, (128, 64))):
        knobs = preset(dataclasses.replace(TAILS, head_dim=d, causal=causal, seq_q=seq, seq_kv=seq), spr)
        assert knobs.dot_bf16 == 2 and (knobs.block_m, knobs.block_n) == tile, (d, causal, seq)


@needs_amx
@pytest.mark.parametrize("layout", ["mla", "mla_paged"])
def test_the_mla_preset_runs_on_tiles(layout):
    """The MLA preset's 64 × 128 tiles on the latent cache (contiguous and paged: pages of 16 keys
    under a 128-key tile) against the float64 reference, every validation case."""
    spec = AttentionSpec(batch=2, heads=64, seq_q=1, seq_kv=300, head_dim=576, head_dim_v=512, layout=layout,
                         scale=0.1, causal=True, dtype="bfloat16")
    b = build_kernel(spec, cache=True)
    assert b.knobs.dot_bf16 == 2 and (b.knobs.block_m, b.knobs.block_n) == (64, 128)
    result = validate_built(b)
    assert result.passed, result


#: a covering set of the layouts and features the fused family builds (issue 63): chunked
#: prefill into a cache with the call's keys appended, a paged cache split across tasks with
#: lse, the user's bit mask, the symbolic kernel, a model's variants together, the paged MLA
#: latent (every query head a row of one tile)
LAYOUTS = {
    "kvcache-append": dict(batch=2, heads=4, kv_heads=2, seq_q=40, seq_kv=200, head_dim=64, causal=True,
                           layout="kvcache", append=True),
    "paged-split-lse": dict(batch=1, heads=4, kv_heads=2, seq_q=33, seq_kv=400, head_dim=64, causal=True,
                            layout="paged", return_lse=True),
    "custom-mask": dict(batch=2, heads=2, seq_q=70, seq_kv=90, head_dim=64, custom_mask=True),
    "symbolic": dict(batch=2, heads=4, kv_heads=2, seq_q=100, seq_kv=150, head_dim=64, causal=True,
                     dynamic=("seq_q", "seq_kv")),
    "variants": dict(batch=1, heads=4, seq_q=70, seq_kv=90, head_dim=64, causal=True, window=(40, 0),
                     softcap=30.0, alibi=True, sinks=True),
    "mla-paged": dict(batch=2, heads=16, seq_q=2, seq_kv=200, head_dim=576, head_dim_v=512, layout="mla_paged",
                      scale=0.1, causal=True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_runs_on_the_tiles(name):
    """Each layout's every validation case (``validate_built``) against the float64 reference: on
    the tiles where the CPU has AMX, else emulated (the same tile order and addresses; an AMX host
    checks the emulated form at the row and key tails above, and saves the suite's time here)."""
    form = 2 if AMX_HOST else 3
    spec = AttentionSpec(dtype="bfloat16", **LAYOUTS[name])
    split = {"split_tasks": 4} if spec.layout == "paged" else {}
    b = _build(spec, form, **split)
    assert b.knobs.dot_bf16 == form
    assert ("tdpbf16ps" in b.module.inspect_source("asm")) == (form == 2)
    result = validate_built(b)
    assert result.passed, result


@pytest.mark.parametrize("form", [2, 3])
def test_the_lazy_correction_is_exact_when_every_tile_raises_the_max(form):
    """Scores that grow along the keys by more than LAZY_GAP per key tile: every tile moves the
    reference max of every row (acc rescaled each time); with a NaN in one query row that row
    alone is NaN."""
    if form == 2 and not AMX_HOST:
        pytest.skip("this CPU has no AMX-BF16")
    spec = AttentionSpec(batch=1, heads=1, seq_q=64, seq_kv=256, head_dim=64, dtype="bfloat16")
    q, k, v = random_inputs(spec, seed=3)
    q = np.abs(q.astype(np.float32))
    ramp = np.linspace(0.0, 6.0, spec.seq_kv, dtype=np.float32)[None, None, :, None]
    k = (np.abs(k.astype(np.float32)) * ramp).astype(k.dtype)  # q·k grows with the key index
    q = q.astype(k.dtype)
    q32 = q.astype(np.float32)
    q32[0, 0, 5, 3] = np.nan
    q = q32.astype(q.dtype)
    exact = [x.astype(np.float64) for x in (q, k, v)]
    ref = reference_attention(spec, *exact)
    out = np.asarray(kernel_of(_build(spec, form))(q, k, v)).astype(np.float64)
    assert np.isnan(out[0, 0, 5]).all() and not np.isnan(np.delete(out, 5, axis=2)).any()
    ok = np.delete(out, 5, axis=2), np.delete(ref, 5, axis=2)
    from tvm_attention.validate import TOLERANCES
    atol, rtol = TOLERANCES[spec.dtype]
    assert np.allclose(*ok, atol=atol, rtol=rtol), report(*ok)


def test_the_tile_forms_are_refused_by_name_where_they_cannot_run():
    spec = dataclasses.replace(TAILS, seq_q=64, seq_kv=64)
    avx512 = {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}
    with pytest.raises(KnobError, match="dot_bf16=2 .*needs a CPU with amx-tile, amx-bf16"):
        build_kernel(spec, target=avx512, knobs={"dot_bf16": 2, "block_m": 64})
    with pytest.raises(KnobError, match="blocks of 32: block_m=48"):
        build_kernel(spec, knobs={"dot_bf16": 3, "block_m": 48})
    with pytest.raises(KnobError, match="blocks of 32: .*head_dim=80"):
        build_kernel(dataclasses.replace(spec, head_dim=80), knobs={"dot_bf16": 3, "block_m": 64})
    with pytest.raises(KnobError, match="multiplies bfloat16 inputs"):
        build_kernel(dataclasses.replace(spec, dtype="float16"), knobs={"dot_bf16": 3, "block_m": 64})


def test_the_microkernel_script_sweeps_the_reduction_depth(capsys):
    """``scripts/amx_microkernel.py``: the micro-kernel's own rate per reduction depth, from zero
    and from C, on an AMX host (a positive rate for each); elsewhere it says why and exits 2."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "amx_microkernel.py"
    spec = importlib.util.spec_from_file_location("amx_microkernel", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rc = script.main(["--ksteps", "2", "4", "--iters", "256"])
    out, err = capsys.readouterr()
    if not AMX_HOST:
        assert rc == 2 and "no AMX-BF16" in err
        return
    assert rc == 0
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["2", "4"] and all(float(x) > 0 for r in rows for x in r[2:])
