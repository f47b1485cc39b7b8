"""What the call decides, on the CUDA kernels (issue 65, items 1 and 2): the user's modifiers
(``score_mod``, ``mask_mod`` and their tensors), key bounds and custom masks, through the
variants' contract hooks that ``fused_cuda.Tile`` calls (``Variants.logit``, ``sees``,
``custom``; the CPU kernel's). Emulated on the CPU against the float64 reference in every layout,
split-KV included; sm_80/sm_90 builds offline without a spill."""
import pytest
import tvm

from conftest import check_emulated_layout
from tvm_attention.build import build_kernel
from tvm_attention.cuda_tools import find_nvcc
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target
from tvm_attention.workloads.fused_cuda import fused_attention_cuda
from tvm_attention.workloads.fused_mma import fused_attention_mma

from test_cuda import EMULATION_TARGET

#: a relative bias (the issue's first modifier) read from a tensor, and a mask that hides every
#: third diagonal (no tile is all hidden or all seen)
SCORE_MOD = ("def score_mod(score, b, h, q_idx, kv_idx):\n"
             "    return score + bias[h] * (q_idx - kv_idx)\n")
MASK_MOD = "def mask_mod(b, h, q_idx, kv_idx):\n    return (q_idx - kv_idx) % 3 != 1\n"
BIAS = (("bias", "float32", ("heads",)),)

#: (layout, spec fields): each call-decided variant in a layout it serves; static and symbolic
#: bhsd, packed sequences (empty ones, one row), decode steps and a prefill chunk over mixed
#: caches (split-KV on the KV-cache layouts: the chunks' masks, then the merge)
CASES = [
    ("bhsd", dict(score_mod=SCORE_MOD, mod_tensors=BIAS, causal=True, dynamic=("batch", "seq_q", "seq_kv"))),
    ("bhsd", dict(mask_mod=MASK_MOD, key_bounds=True)),
    ("varlen", dict(custom_mask=True, causal=True)),
    ("kvcache", dict(key_bounds=True, causal=True, split=64)),
    ("paged", dict(custom_mask=True, mask_mod=MASK_MOD, causal=True, split=64)),
]
IDS = ["bhsd-score_mod", "bhsd-static-mask_mod-bounds", "varlen-custom", "kvcache-bounds-split",
       "paged-custom-mask_mod-split"]


def call_spec(layout, fields, dtype):
    fields = dict(fields)
    fields.pop("split", None)
    base = dict(batch=2, heads=4, kv_heads=2, seq_q=37, seq_kv=45, head_dim=32, dtype=dtype, layout=layout)
    if layout in ("kvcache", "paged"):
        base.update(seq_q=4, seq_kv=None, page_size=16 if layout == "paged" else None)
    return AttentionSpec(**{**base, **fields})


@pytest.mark.parametrize("layout, fields", CASES, ids=IDS)
def test_simt_kernel_takes_what_the_call_decides(layout, fields):
    """The SIMT kernel, emulated: every row against the reference on the layout's cases."""
    spec = call_spec(layout, fields, "float32")
    ex = tvm.compile(fused_attention_cuda(spec, 16, 16, 4, emulate=True, split_tasks=fields.get("split", 0)),
                     target=EMULATION_TARGET)
    check_emulated_layout(ex, spec)


@pytest.mark.parametrize("layout, fields", CASES, ids=IDS)
def test_tensor_core_kernel_takes_what_the_call_decides(layout, fields):
    """The mma.sync kernel, emulated (fp16: the mask on the accumulator fragments' rows and
    columns, the score_mod before the row max)."""
    spec = call_spec(layout, fields, "float16")
    ex = tvm.compile(fused_attention_mma(spec, 2, 16, 2, 1, emulate=True, split_tasks=fields.get("split", 0)),
                     target=EMULATION_TARGET)
    check_emulated_layout(ex, spec)


def test_a_mask_the_kernel_ignored_fails_the_check(monkeypatch):
    """The checks can fail: a tile that skips the call's masks (``Tile.call_masks`` off) gives
    rows that differ from the reference."""
    from tvm_attention.workloads import variants

    monkeypatch.setattr(variants.Variants, "masks_keys", property(lambda self: False))
    spec = call_spec("varlen", dict(custom_mask=True), "float32")
    ex = tvm.compile(fused_attention_cuda(spec, 16, 16, 4, emulate=True), target=EMULATION_TARGET)
    with pytest.raises(AssertionError):
        check_emulated_layout(ex, spec)


def test_tensor_core_warps_skip_the_tiles_a_mask_hides_and_the_check_can_fail(monkeypatch):
    """A custom mask's empty tiles on tensor cores: each warp scans its rows' bits of a key tile and
    skips its products and softmax where none is set (block-diagonal documents of 16 keys: a
    warp of 16 rows sees one key tile in four). The output is the reference's; a scan that finds
    nothing (every tile skipped) or reads the next tile's bits fails."""
    import numpy as np

    from tvm_attention.layouts import LAYOUTS
    from tvm_attention.masks import pack_mask
    from tvm_attention.validate import TOLERANCES
    from tvm_attention.workloads.fused_cuda import Tile

    spec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=64, seq_kv=64, head_dim=32, dtype="float16",
                         custom_mask=True)
    lay = LAYOUTS["bhsd"]
    x = lay.random_inputs(spec, lay.validation_cases(spec)[0])
    docs = np.arange(64)[:, None] // 16 == np.arange(64)[None, :] // 16
    x["custom_mask"], x["mask_indptr"] = pack_mask([docs, docs])
    ref = lay.reference_outputs(spec, x)[0]
    atol, rtol = TOLERANCES[spec.dtype]

    def run():
        ex = tvm.compile(fused_attention_mma(spec, 2, 16, 2, 1, emulate=True), target=EMULATION_TARGET)
        o = tvm.runtime.empty(x["q"].shape, spec.dtype)
        ex["attention"](*[tvm.runtime.tensor(x[a.name]) for a in lay.all_args(spec) if not a.output], o)
        return o.numpy().astype(np.float64)

    assert np.allclose(run(), ref, atol=atol, rtol=rtol)
    real = Tile.mask_bit
    for fault in (lambda self, row, col: False, lambda self, row, col: real(self, row, col + 16)):
        monkeypatch.setattr(Tile, "mask_bit", fault)
        assert not np.allclose(run(), ref, atol=atol, rtol=rtol)


def test_tuned_records_of_a_masked_spec_match_its_workload():
    """A tuning record of a spec the call masks (its function, as the tuner stores it) is that
    spec's workload again (``task_mods.workload_matches``, how build finds it): a fully static
    kernel's key bounds are ``(batch, seq_kv)``, compiled in, not a var of their own."""
    import tvm

    from tvm_attention.schedules import cuda_mma
    from tvm_attention.task_mods import workload_matches

    target = resolve_target("cuda", arch="sm_90")
    for fields in (dict(key_bounds=True, mask_mod=MASK_MOD), dict(custom_mask=True, score_mod=SCORE_MOD,
                                                                  mod_tensors=BIAS)):
        spec = AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=64, head_dim=64, dtype="float16", causal=True,
                             **fields)
        func = cuda_mma.workload(spec, cuda_mma.preset(spec, target))
        assert workload_matches(spec, tvm.IRModule({"main": func}), target), fields


def test_key_bounds_skip_tiles_and_the_check_can_fail(monkeypatch):
    """Key bounds are a block mask given at call time: a row tile's loop starts at its first
    row's ``key_lo`` and stops at its last row's ``key_hi`` (the CPU kernel's skipping). Skipping
    one tile too many (bounds read 16 keys later) fails the check."""
    from tvm.script import tirx as T

    from tvm_attention.workloads import fused_cuda

    spec = call_spec("bhsd", dict(key_bounds=True, dynamic=("batch", "seq_q", "seq_kv")), "float32")
    ex = tvm.compile(fused_attention_cuda(spec, 16, 16, 4, emulate=True), target=EMULATION_TARGET)
    check_emulated_layout(ex, spec)
    real = fused_cuda.key_clamp
    monkeypatch.setattr(fused_cuda, "key_clamp", lambda x: real(x) + T.int32(16))
    ex = tvm.compile(fused_attention_cuda(spec, 16, 16, 4, emulate=True), target=EMULATION_TARGET)
    with pytest.raises(AssertionError):
        check_emulated_layout(ex, spec)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch, dtype, layout, fields, params", [
    ("sm_90", "float16", "bhsd", dict(score_mod=SCORE_MOD, mod_tensors=BIAS, mask_mod=MASK_MOD, causal=True,
                                      custom_mask=True, dynamic=("batch", "seq_q", "seq_kv")),
     ["custom_mask", "mask_indptr", "bias", "O"]),
    ("sm_80", "float32", "paged", dict(custom_mask=True, key_bounds=True, causal=True, page_size=16),
     ["BT", "CS", "key_lo", "key_hi", "custom_mask", "mask_indptr", "O"]),
], ids=["tc-bhsd-mods", "simt-paged-masks"])
def test_builds_offline_without_spills(arch, dtype, layout, fields, params):
    """Real builds (sm_90 tensor cores with the warps' scan of a custom mask's bits, sm_80 CUDA
    cores, D=128): no spill, no stack, fused; the call's arguments in the layouts' order."""
    from tvm_attention.schedules import cuda_mma, cuda_simt

    spec = AttentionSpec(**{**dict(batch=2, heads=32, kv_heads=8, seq_q=1024 if layout == "bhsd" else 4,
                                   seq_kv=None if layout == "bhsd" else 4096, head_dim=128, dtype=dtype,
                                   layout=layout), **fields})
    built = build_kernel(spec, "fused", target=resolve_target("cuda", arch=arch))
    r = built.resources
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0 and built.audit.fused, r
    family = cuda_simt if dtype == "float32" else cuda_mma
    assert isinstance(built.knobs, type(family.preset(spec, resolve_target("cuda", arch=arch))))
    assert [p.name for p in family.workload(spec, built.knobs).params] == ["Q", "K", "V", *params]
