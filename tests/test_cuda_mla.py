"""MLA on CUDA tensor cores (issue 65, item 4): the latent layouts (``mla``, ``mla_paged``) on the
``mma.sync`` kernel of ``workloads/fused_mla.py`` (FlashMLA's work split: the heads as the tile's
rows, each latent row read once for all of them as K and V; warps sharing a key tile's scores by
key slices and its output by column slices). Emulated on the CPU against the float64 reference
in both layouts: decode and multi-token steps, split-KV with two row tiles a step, 8-bit latent
caches, appending, the variants and what the call decides; checks that fail a kernel whose warps
ignore their row group's other slices, whose split chunks store their rows in one place, or that
ignores the call's masks; sm_80/sm_90 builds of DeepSeek-V3's 576/512 without a spill; the
families' routing and refusals."""
import pytest
import tvm

from conftest import check_emulated_layout
from tvm_attention.cuda_tools import find_nvcc
from tvm_attention.spec import AttentionSpec
from tvm_attention.workloads import fused_mla
from tvm_attention.workloads.fused_mla import fused_attention_mla

from test_cuda import EMULATION_TARGET

MASK_MOD = "def mask_mod(b, h, q_idx, kv_idx):\n    return (q_idx - kv_idx) % 3 != 1\n"

#: (layout, spec fields, split_tasks): 8 heads over a 64-wide latent row (V its first 32 columns),
#: two row groups of 16 rows and two column groups (a 16-key slice and 16 output columns a warp).
#: 40 heads: a decode step of two row tiles, split (the merge over both); 8-bit caches, appending
#: (an int8 page pool), the variants, a custom mask with a mask_mod, bf16
CASES = [
    ("mla", dict(heads=40), 64),
    ("mla_paged", dict(heads=40, return_lse=True), 64),
    ("mla", dict(kv_dtype="float8_e4m3fn"), 0),
    ("mla_paged", dict(kv_dtype="int8", append=True), 0),
    ("mla", dict(append=True, sinks=True, softcap=20.0, window=(40, 0), alibi=True, kv_start=True), 64),
    ("mla_paged", dict(custom_mask=True, mask_mod=MASK_MOD, dtype="bfloat16"), 0),
]
IDS = ["decode-2-tiles-split", "paged-lse-split", "e4m3", "paged-int8-append", "variants-split",
       "paged-custom-mask_mod-bf16"]


def mla_spec(layout, fields):
    base = dict(batch=3, heads=8, kv_heads=1, seq_q=2, seq_kv=None, head_dim=64, head_dim_v=32, dtype="float16",
                causal=True, layout=layout, scale=0.1, page_size=16 if layout == "mla_paged" else None)
    return AttentionSpec(**{**base, **fields})


def emulated(spec, split=0, row_groups=2, col_groups=2):
    return tvm.compile(fused_attention_mla(spec, row_groups, col_groups, 32, 2, emulate=True, split_tasks=split),
                       target=EMULATION_TARGET)


@pytest.mark.parametrize("layout, fields, split", CASES, ids=IDS)
def test_mla_kernel_matches_the_reference(layout, fields, split):
    """Every row of the layout's cases (mixed cache lengths, empty ones, page edges, a prefill
    chunk) against the float64 reference; a sequence with no key gives zeros."""
    spec = mla_spec(layout, fields)
    check_emulated_layout(emulated(spec, split), spec)


def test_the_checks_fail_a_wrong_kernel(monkeypatch):
    """Warps that take their own slice's row max and sum for the row's (the exchange through
    ``red`` dropped), split chunks that store a step's two row tiles in one place, and a kernel
    that ignores the call's masks each fail the reference check."""
    from tvm_attention.workloads import fused_cuda, variants

    real = fused_mla._mla_context

    def own_slice_only(*args, **kw):
        x = real(*args, **kw)
        at = x.red_at
        x.red_at = lambda ty, tx, h, c: at(ty, tx, h, x.cg(ty))
        return x

    spec = mla_spec("mla", dict(heads=40, seq_q=1))
    for target, name, fault in ((fused_mla, "_mla_context", own_slice_only),
                                (fused_cuda.Tile, "part_at", lambda self, row, j: self._part(row, j))):
        with monkeypatch.context() as m:
            m.setattr(target, name, fault)
            with pytest.raises(AssertionError):
                check_emulated_layout(emulated(spec, split=64), spec)
    masked = mla_spec("mla_paged", dict(custom_mask=True))
    monkeypatch.setattr(variants.Variants, "masks_keys", property(lambda self: False))
    with pytest.raises(AssertionError):
        check_emulated_layout(emulated(masked), masked)


DEEPSEEK = dict(batch=64, heads=128, kv_heads=1, seq_q=1, seq_kv=4096, head_dim=576, head_dim_v=512, causal=True,
                scale=0.0722)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found: the CUDA builds are compiled offline")
@pytest.mark.parametrize("arch, fields", [("sm_90", dict(layout="mla_paged", page_size=64, dtype="bfloat16")),
                                          ("sm_80", dict(layout="mla", dtype="float16", kv_dtype="float8_e4m3fn",
                                                         append=True, return_lse=True))])
def test_deepseek_builds_without_a_spill(arch, fields):
    """DeepSeek-V3's decode (128 heads, 576/512) through ``--schedule fused``: the MLA kernel at its
    preset, fused by the audit (the split workspace sized by the batch alone), no local memory,
    tensor cores (HMMA) and ldmatrix in the SASS, three barriers a key tile (the kernel's own: the
    P tile and the slices' exchange live apart from the dynamic tiles, so TVM adds none; an 8-bit
    cache's converted stores into a stage are plain stores, before which TVM adds one)."""
    from tvm_attention.build import build_kernel
    from tvm_attention.cuda_tools import kernel_source
    from tvm_attention.schedules.cuda_mla import MLAKnobs
    from tvm_attention.target import resolve_target

    b = build_kernel(AttentionSpec(**DEEPSEEK, **fields), "fused", target=resolve_target("cuda", arch=arch))
    assert isinstance(b.knobs, MLAKnobs) and (b.knobs.row_groups, b.knobs.col_groups) == (4, 2)
    assert b.audit.verdict == "fused", b.audit.reasons
    r = b.resources
    assert r["spills"] == 0 and r["registers"] <= 255 and r["sass_instructions"]["LDL"] == 0, r
    assert r["sass_instructions"]["HMMA"] > 0 and r["sass_instructions"]["LDSM"] > 0
    src = kernel_source(b.module)
    loop = src[src.index("for (int c = 0;"):]
    spec = AttentionSpec(**DEEPSEEK, **fields)
    assert loop[:loop.index("warp_reduce_sum")].count("__syncthreads") == 3 + spec.kv_quantized


def test_families_route_the_latent_layouts_and_refuse_by_name():
    """``fused`` on CUDA builds a latent spec on the MLA kernel (``fused_mla`` names it); its
    checks refuse knobs past a named limit: slices that are not whole ldmatrix tiles, more
    registers than a lane has (one column group holds 512 output columns), the shared memory of
    64-key tiles in two stages beside the 576-wide Q tile."""
    from tvm_attention.schedules import cuda_fused, cuda_mla, get_schedule
    from tvm_attention.schedules._knobs import KnobError
    from tvm_attention.target import resolve_target

    sm90 = resolve_target("cuda", arch="sm_90")
    spec = AttentionSpec(**DEEPSEEK, layout="mla_paged", page_size=64, dtype="bfloat16")
    assert get_schedule("fused_mla", sm90) is cuda_mla
    knobs = cuda_fused.preset(spec, sm90)
    assert isinstance(knobs, cuda_mla.MLAKnobs) and knobs.split_tasks > 0
    cuda_fused.check(knobs, spec, sm90)
    assert cuda_mla.tile_candidates(spec, sm90)[0] == knobs
    for over, match in ((dict(block_n=16), r"block_n=16 must be a multiple of 16 · col_groups=32"),
                        (dict(col_groups=1), r"registers per thread .* > 255"),
                        (dict(block_n=64, stages=2), r"shared memory \d+ B .* > 232448 B")):
        with pytest.raises(KnobError, match=match):
            cuda_mla.check(cuda_mla.MLAKnobs(**{**knobs.to_dict(), **over}), spec, sm90)
    # a few heads: a tile of 16 rows, not 64 (three quarters of them empty)
    small = AttentionSpec(**{**DEEPSEEK, "heads": 16}, layout="mla", dtype="float16")
    assert cuda_mla.preset(small, sm90).row_groups == 1


def test_row_groups_skip_the_tiles_a_custom_mask_hides_and_the_check_can_fail(monkeypatch):
    """A custom mask's empty tiles on the MLA kernel: the warps of a row group whose rows (heads
    of two positions) see none of a key tile's bits skip its products, softmax and P·V (position
    ``p`` of a chunk of 8 sees keys ``8p .. 8p + 7`` of 64: each row group sees one key tile of
    two). The output is the reference's; a scan that finds nothing or reads the next tile's bits
    fails."""
    import numpy as np

    from tvm_attention.layouts import LAYOUTS
    from tvm_attention.masks import pack_mask
    from tvm_attention.validate import TOLERANCES
    from tvm_attention.workloads.fused_cuda import Tile

    spec = mla_spec("mla", dict(batch=1, seq_q=8, custom_mask=True))
    lay = LAYOUTS["mla"]
    x = lay.random_inputs(spec, {"seq_q": 8, "cache_seqlens": [64], "max_len": 64})
    x["custom_mask"], x["mask_indptr"] = pack_mask([np.arange(8)[:, None] == np.arange(64)[None, :] // 8])
    ref = lay.reference_outputs(spec, x)[0]
    atol, rtol = TOLERANCES[spec.dtype]

    def run():
        ex = emulated(spec)
        o = tvm.runtime.empty(ref.shape, spec.dtype)
        ex["attention"](*[tvm.runtime.tensor(x[a.name]) for a in lay.all_args(spec) if not a.output], o)
        return o.numpy().astype(np.float64)

    assert np.allclose(run(), ref, atol=atol, rtol=rtol)
    real = Tile.mask_bit
    for fault in (lambda self, row, col: False, lambda self, row, col: real(self, row, col + 32)):
        monkeypatch.setattr(Tile, "mask_bit", fault)
        assert not np.allclose(run(), ref, atol=atol, rtol=rtol)
