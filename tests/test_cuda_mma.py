"""CUDA tensor-core kernel (``workloads/fused_mma.py``, ``schedules/cuda_mma.py``), offline:
builds for sm_80/sm_90 in fp16 and bf16 whose PTX runs on tensor cores without spilling, the
audit, feasibility, dispatch of ``--schedule fused``, and the algorithm on the CPU (each PTX
instruction replaced by its definition). GPU runs live in test_cuda.py / scripts/gpu_check.sh."""
import dataclasses
import functools

import numpy as np
import pytest
import tvm
from conftest import (CUDA_VARIANT_IDS, CUDA_VARIANT_SPREADS, RIGHT_WINDOW_SHAPES, assert_split_stores_guarded,
                      check_emulated_layout, check_emulated_symbolic, right_window_spec, split_kv_cases)
from test_cuda import EMULATION_TARGET, assert_split_kv

from tvm_attention.schedules import cuda_fused, cuda_mma, cuda_simt
from tvm_attention.schedules._knobs import KnobError
from tvm_attention.build import build_kernel
from tvm_attention.cuda_tools import find_nvcc, split_tasks_for
from tvm_attention.reference import random_inputs, reference_attention
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target
from tvm_attention.validate import TOLERANCES
from tvm_attention.workloads.fused_mma import fused_attention_mma

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed: no ptxas report")


@functools.lru_cache(maxsize=None)
def cuda_build(spec: AttentionSpec, arch: str, schedule: str = "fused"):
    """One CUDA build (ptxas report included) per (spec, arch, schedule) for this file: CUDA builds
    are not in the run's build cache, and two tests here check the same build."""
    return build_kernel(spec, schedule, target=resolve_target("cuda", arch=arch))


#: (arch, head_dim, dtype, causal) of the static tensor-core builds: a covering set, every value of
#: each axis and every pair of values of every two axes (the presets differ by head_dim: D=64 two
#: row groups of 64-key tiles at 230 registers, D=128 one of 32; the dtype picks the mma and the
#: conversions, with head_dim the register pressure; causal adds the diagonal tiles' masking and
#: skipping; the arch is ptxas's target and its limits). The full 16-build product:
#: ``python scripts/sweep_cuda_mma.py``.
STATIC_BUILDS = [
    ("sm_80", 64, "float16", False),
    ("sm_80", 128, "bfloat16", True),
    ("sm_90", 64, "bfloat16", True),
    ("sm_90", 128, "float16", True),
    ("sm_90", 128, "bfloat16", False),
]


def static_spec(head_dim: int, dtype: str, causal: bool) -> AttentionSpec:
    return AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=2048, head_dim=head_dim, dtype=dtype, causal=causal)


@needs_nvcc
@pytest.mark.parametrize("arch, head_dim, dtype, causal", STATIC_BUILDS)
def test_tensor_core_builds_offline(arch, head_dim, dtype, causal):
    """A static fp16/bf16 preset build on tensor cores (``STATIC_BUILDS``; the full product in
    ``scripts/sweep_cuda_mma.py``): no spill or local memory, the mma and ldmatrix counts of its
    tiles, cp.async and one barrier per key tile, fused, within the register estimate's margin."""
    spec = static_spec(head_dim, dtype, causal)
    built = cuda_build(spec, arch)  # fused → tensor cores here
    k = built.knobs
    assert isinstance(k, cuda_mma.MMAKnobs)
    r = built.resources
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0, r
    assert 0 < r["registers"] <= 255 and 0 < r["occupancy"] <= 1
    assert r["shared_bytes"] == cuda_mma.shared_bytes(k, spec) <= 48 * 1024
    ptx = r["ptx_instructions"]
    # per key tile: Q·Kᵀ and P·V each (block_n/16)·(head_dim/16) ldmatrix.x4, each feeding an
    # mma pair per row group of the warp
    per_tile = (k.block_n // 16) * (head_dim // 16)
    assert ptx["mma.sync"] == 4 * per_tile * k.m_tiles and ptx["ldmatrix"] == 2 * per_tile, ptx
    assert ptx["cp.async.cg"] > 0 and ptx["cp.async.wait_group"] >= 1
    assert ptx["ld.local"] == 0 and ptx["st.local"] == 0  # fragments stay in registers
    # one barrier per key tile with stages ≥ 2 (TVM's own pass once added a second: it cannot
    # tell the stage being filled from the stage being read)
    assert k.stages >= 2 and ptx["bar.sync"] == 1, ptx
    assert built.audit.fused, built.audit.format()
    scopes = {a.name: a.scope for a in built.audit.allocations}
    assert scopes["S"] == "local" and scopes["acc"] == "local" and scopes["Pf"] == "local"
    assert scopes["Ks"] == "shared" and scopes["Vs"] == "shared"
    # the registers the check estimates are within reach of what ptxas used
    assert r["registers"] <= cuda_mma.registers_estimate(k, spec) + 16


def test_fused_picks_the_kernel_by_dtype_arch_and_head_dim():
    """``fused`` takes tensor cores for fp16 and the SIMT kernel for a head_dim not a multiple of
    16, and ``fused_tc`` refuses what it cannot build by name. The other routes are built by
    test_cuda.py, each asserting the knobs' kind: float32 on sm_90 takes the SIMT kernel
    (test_symbolic_simt_builds_offline_without_spills, test_cache_simt_builds_offline_without_spills),
    and ``fused_simt`` builds a half-precision spec on it (its symbolic fp16 case, beside
    ``fused``'s tensor-core preset for the same spec)."""
    sm90 = resolve_target("cuda", arch="sm_90")
    half = static_spec(64, "float16", False)  # STATIC_BUILDS[0]'s build, on sm_80
    fp32 = AttentionSpec(batch=1, heads=2, seq_q=256, head_dim=64, dtype="float32")
    odd = AttentionSpec(batch=1, heads=2, seq_q=256, head_dim=72, dtype="bfloat16")
    assert isinstance(cuda_build(half, "sm_80").knobs, cuda_mma.MMAKnobs)
    assert isinstance(cuda_build(odd, "sm_90").knobs, cuda_simt.FlashCUDAKnobs)
    with pytest.raises(KnobError, match="builds dtype\\(s\\) float16, bfloat16, not 'float32': use --schedule fused_simt"):
        build_kernel(fp32, "fused_tc", target=sm90)
    with pytest.raises(KnobError, match="multiple of 16"):
        build_kernel(odd, "fused_tc", target=sm90)


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(block_n=128, stages=4), "shared memory .* 232448 B, the most a block may take on sm_90"),
        (dict(warps=64), "max_threads_per_block"),
        (dict(warps=3), "power of two"),
        (dict(block_n=24), "multiple of 16"),
        (dict(stages=5), "stages=5"),
        (dict(block_n=0), "positive"),
        (dict(m_tiles=3), "m_tiles=3"),
        (dict(m_tiles=2), "registers"),  # D=128: two row groups' fragments do not fit
    ],
)
def test_tensor_core_feasibility_rejects_with_named_limit(knobs, message):
    spec = AttentionSpec(batch=1, heads=8, seq_q=1024, head_dim=128, dtype="bfloat16")
    target = resolve_target("cuda", arch="sm_90")
    with pytest.raises(KnobError, match=message):
        build_kernel(spec, target=target, knobs=knobs)


def test_tensor_core_candidates_are_feasible_and_start_with_the_preset():
    spec = AttentionSpec(batch=1, heads=8, seq_q=1024, head_dim=128, dtype="float16")
    target = resolve_target("cuda", arch="sm_80")
    cands = cuda_mma.tile_candidates(spec, target)
    assert cands[0] == cuda_mma.preset(spec, target) and len(cands) == len(set(cands)) > 4
    for k in cands:
        cuda_mma.check(k, spec, target)


#: head_dim of the emulated kernels below where head_dim is not what they check: LLVM's compile of an
#: emulated kernel (every fragment unrolled) is most of their cost and scales with it. 32 keeps two
#: k steps of Q·Kᵀ (NDC) and four output slices (NO); each layout keeps a 1-warp case whose K/V tile
#: copy takes two cp.async vectors a thread, and D=64 and D=128 stay in test_tensor_core_algorithm_on_cpu
#: (bf16: the dtype converts the fragments, whatever their number).
EMU_D = 32


@pytest.mark.parametrize(
    "seq_q, seq_kv, causal, dtype, head_dim, warps, block_n, stages, m_tiles",
    [
        # key tail, diagonal tiles, GQA, 2 row groups of 2 warps (the only case with both), 32-key
        # tiles (two n fragments a k step); at D=32 (fp16): D=64 is the next case's
        (113, 203, True, "float16", EMU_D, 2, 32, 2, 2),
        (300, 45, True, "bfloat16", 64, 1, 16, 3, 1),  # seq_q > seq_kv: rows that see no key → 0; D=64
        (96, 128, False, "bfloat16", 128, 1, 16, 1, 1),  # D=128, unpipelined
        (1, 1, True, "float16", EMU_D, 1, 16, 2, 2),  # one row, one key: 2 row groups of one warp
    ],
)
def test_tensor_core_algorithm_on_cpu(seq_q, seq_kv, causal, dtype, head_dim, warps, block_n, stages, m_tiles):
    """The tensor-core compute with serial loops in place of threads and each PTX instruction
    (ldmatrix, mma.sync, shuffles, cp.async) replaced by its definition from the PTX ISA's
    fragment layouts, run by LLVM against the float64 reference."""
    spec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
                         dtype=dtype, causal=causal)
    func = fused_attention_mma(spec, warps, block_n, stages, m_tiles, emulate=True)
    ex = tvm.compile(func, target=EMULATION_TARGET)
    q, k, v = random_inputs(spec, seed=seq_q)
    nan_row = seq_q // 2
    q[1, 1, nan_row, 3] = np.nan  # NaN in gives NaN out, in its row only
    args = [tvm.runtime.tensor(x) for x in (q, k, v)] + [tvm.runtime.empty(spec.o_shape, dtype)]
    ex["attention"](*args)
    out = args[3].numpy().astype(np.float64)
    ref = reference_attention(spec, q, k, v)
    sees_key = (not causal) or nan_row + seq_kv - seq_q >= 0
    if sees_key:
        assert np.isnan(out[1, 1, nan_row]).all()
    else:
        assert (out[1, 1, nan_row] == 0).all()
    keep = np.ones(out.shape[:3], bool)
    keep[1, 1, nan_row] = False
    atol, rtol = TOLERANCES[dtype]
    assert np.isfinite(out[keep]).all()
    assert np.allclose(out[keep], ref[keep], atol=atol, rtol=rtol), np.abs(out[keep] - ref[keep]).max()



ALL_DYNAMIC = ("batch", "seq_q", "seq_kv")
#: every dtype, causal and not, 1 and 2 warps, and each pipeline depth: 1 (unpipelined) without
#: causal, 2 and 3 with causal key tiles skipped at run time, the prologue deeper than the tiles
#: there are at seq_kv 1 and 0 (the full-attention stages=3 case: ``scripts/sweep_cuda_mma.py``)
@pytest.mark.parametrize("dtype, causal, warps, block_n, stages", [
    ("float16", True, 2, 16, 2),
    ("bfloat16", False, 1, 16, 1),
    ("bfloat16", True, 1, 16, 3),
])
def test_tensor_core_symbolic_algorithm_on_cpu(dtype, causal, warps, block_n, stages):
    """One symbolic tensor-core kernel (batch, seq_q, seq_kv dyn; GQA 4:2), emulated, against the
    reference at every shape of ``conftest.SYMBOLIC_SHAPES``: the (row tile, head, batch) grid, the key
    tail masked and causal key tiles skipped at run time, bottom-right causal with Sq above and
    below Skv, zero rows for seq_kv 0. Small tiles (16 rows, 16 keys) keep the emulation quick
    and give many row and key tiles; the presets pass the same shapes (checked 2026-12-02). Every
    dtype x causal x stages: ``python scripts/sweep_cuda_mma.py symbolic``."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=256, head_dim=EMU_D, dtype=dtype, causal=causal,
                         dynamic=ALL_DYNAMIC)
    ex = tvm.compile(fused_attention_mma(spec, warps, block_n, stages, 1, emulate=True), target=EMULATION_TARGET)
    check_emulated_symbolic(ex, spec)


def assert_preset_code(built, spec, target) -> None:
    """A tensor-core preset build (symbolic or varlen) compiles as a static one: no spill, no
    local memory, the static build's shared memory, mma and ldmatrix counts and single barrier
    per key tile, within the register estimate's margin (a symbolic build has the static one's
    registers at lengths with a tail)."""
    k = built.knobs
    assert isinstance(k, cuda_mma.MMAKnobs) and k == cuda_mma.preset(spec, target)
    r = built.resources
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0, r
    assert r["registers"] <= cuda_mma.registers_estimate(k, spec) + 16, r
    assert r["shared_bytes"] == cuda_mma.shared_bytes(k, spec) <= 48 * 1024
    ptx = r["ptx_instructions"]
    per_tile = (k.block_n // 16) * (spec.head_dim // 16)
    assert ptx["mma.sync"] == 4 * per_tile * k.m_tiles and ptx["ldmatrix"] == 2 * per_tile, ptx
    assert ptx["bar.sync"] == 1 and ptx["ld.local"] == 0 and ptx["st.local"] == 0


@needs_nvcc
@pytest.mark.parametrize("arch, dtype, head_dim, causal, dynamic", [
    ("sm_80", "float16", 64, False, ALL_DYNAMIC),
    ("sm_90", "bfloat16", 128, True, ALL_DYNAMIC),
    ("sm_90", "float16", 64, True, ("seq_kv",)),
])
def test_symbolic_tensor_core_builds_offline_without_spills(arch, dtype, head_dim, causal, dynamic):
    """``fused`` builds a symbolic fp16/bf16 spec on tensor cores as it builds a static one: no
    spill, no local memory, the static build's shared memory, mma count and single barrier per
    key tile, within the register estimate's margin (a symbolic build has the static one's
    registers at lengths with a tail), fused by the symbolic audit, the lengths as kernel
    arguments, the (row tile, head, batch) grid; heads past gridDim.y are refused by name."""
    spec = AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1024, head_dim=head_dim, dtype=dtype, causal=causal,
                         dynamic=dynamic)
    target = resolve_target("cuda", arch=arch)
    built = build_kernel(spec, "fused", target=target)
    k = built.knobs
    assert_preset_code(built, spec, target)
    assert built.audit.fused and built.audit.probe == {"symbolic": list(dynamic)}, built.audit.format()
    src = built.module.imports[0].inspect_source()
    signature = src[src.index("__global__"):src.index("{", src.index("__global__"))]
    assert all(f"int {d}" in signature for d in dynamic), signature
    assert "blockIdx.z" in src and "blockIdx.y" in src  # the (row tile, head, batch) grid
    wide = dict(batch=1, heads=65536, kv_heads=1, seq_q=1, head_dim=head_dim, dtype=dtype)
    with pytest.raises(KnobError, match="heads=65536 > 65535.*gridDim.y"):
        cuda_mma.check(k, AttentionSpec(**wide, dynamic=dynamic), target)
    cuda_mma.check(k, AttentionSpec(**wide), target)  # static: a flat grid


@pytest.mark.parametrize("layout, page, dtype, causal, warps, stages, lse", [
    ("varlen", None, "float16", True, 2, 2, True), ("varlen", None, "bfloat16", False, 1, 3, False),
    ("kvcache", None, "float16", True, 1, 2, False), ("paged", 16, "float16", False, 2, 1, True),
    ("paged", 64, "bfloat16", True, 1, 3, False),
])
def test_tensor_core_layouts_algorithm_on_cpu(layout, page, dtype, causal, warps, stages, lse):
    """The tensor-core kernel in the serving layouts (GQA 4:2), emulated
    (``conftest.check_emulated_layout``): varlen's binary search from a slot to its sequence
    (causal: slots launched last-first) and spare slots; kvcache and paged with the group's
    heads packed into the warps' rows and cp.async rows through block_table (emulated as
    copies); per-sequence key tails, causal tile skipping and masking at run time, zero rows
    for a sequence with no key, the log-sum-exp (written by a row's first lane) with ``lse``."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=64, head_dim=EMU_D, dtype=dtype, causal=causal,
                         layout=layout, page_size=page, return_lse=lse)
    ex = tvm.compile(fused_attention_mma(spec, warps, 16, stages, 1, emulate=True), target=EMULATION_TARGET)
    check_emulated_layout(ex, spec)


@pytest.mark.parametrize("layout, page, dtype, variants", [
    ("paged", 16, "float16", dict(causal=True, return_lse=True)),
    ("kvcache", None, "bfloat16", dict(window=(500, 0), sinks=True, kv_start=True)),
])
def test_tensor_core_split_kv_algorithm_on_cpu(layout, page, dtype, variants):
    """Split-KV in the tensor-core kernel, emulated (``conftest.split_kv_cases``): the chunks'
    cp.async pipelines start at their own first tile, their states (the row sums reduced across
    a row's lanes) go to the workspace unguarded, and the merge combines them."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1, head_dim=EMU_D, dtype=dtype, layout=layout,
                         page_size=page, **variants)
    func = fused_attention_mma(spec, 2, 16, 2, 1, emulate=True, split_tasks=64)
    assert_split_stores_guarded(func)
    ex = tvm.compile(func, target=EMULATION_TARGET)
    check_emulated_layout(ex, spec, split_kv_cases(layout))


@pytest.mark.parametrize("layout, kv_dtype, dtype, split, variants", [
    ("paged", "float8_e4m3fn", "float16", 64, dict(return_lse=True)),
    ("kvcache", "int8", "bfloat16", 0, dict(window=(300, 0), alibi=True)),
    ("paged", "float8_e5m2", "float16", 0, {}),
])
def test_tensor_core_8bit_cache_algorithm_on_cpu(layout, kv_dtype, dtype, split, variants):
    """An 8-bit K/V cache on tensor cores, emulated: the tiles converted to float16/bfloat16 on
    their way to shared memory (exact: every e4m3, e5m2 and int8 value is one), the key scale
    in the scores' one scaling, the value scale at the store or after the merge."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1, head_dim=EMU_D, dtype=dtype, causal=True, layout=layout,
                         page_size=16 if layout == "paged" else None, kv_dtype=kv_dtype, **variants)
    ex = tvm.compile(fused_attention_mma(spec, 2, 16, 2, 1, emulate=True, split_tasks=split),
                     target=EMULATION_TARGET)
    check_emulated_layout(ex, spec)
    if split:
        check_emulated_layout(ex, spec, split_kv_cases(layout))


@pytest.mark.parametrize("layout, kv_dtype, dtype, split, variants", [
    ("kvcache", "float8_e4m3fn", "bfloat16", 64, dict(sinks=True, return_lse=True)),
    ("paged", None, "float16", 0, {}),
])
def test_tensor_core_append_algorithm_on_cpu(layout, kv_dtype, dtype, split, variants):
    """Appending in the call on tensor cores, emulated: the append kernel (``fused_cuda.append_grid``,
    the SIMT kernel's) writes ``k_new``/``v_new`` into the cache (e4m3 as its bits, through the
    uint8 alias the tiles read), then the tiles attend over ``cache_seqlens[b] + seq_q`` keys,
    split and merged, against the reference on the appended caches."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=4, head_dim=EMU_D, dtype=dtype, causal=True, layout=layout,
                         page_size=16 if layout == "paged" else None, kv_dtype=kv_dtype, append=True, **variants)
    ex = tvm.compile(fused_attention_mma(spec, 2, 16, 2, 1, emulate=True, split_tasks=split), target=EMULATION_TARGET)
    check_emulated_layout(ex, spec)


@pytest.mark.parametrize("case", range(len(CUDA_VARIANT_SPREADS)), ids=CUDA_VARIANT_IDS)
def test_tensor_core_variants_algorithm_on_cpu(case):
    """The tensor-core kernel with the attention variants, emulated: the scores brought to log2
    units in their fragments before the row max (softcap's tanh, ALiBi per slot's row and key),
    windows and starts skipping key tiles and masking the rest, sinks at the store
    (``conftest.CUDA_VARIANT_SPREADS``; fp16, every other case bf16)."""
    layout, page, dynamic, variants = CUDA_VARIANT_SPREADS[case]
    spec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=37, seq_kv=45, head_dim=EMU_D, layout=layout,
                         dtype="bfloat16" if case % 2 else "float16", page_size=page, dynamic=dynamic, **variants)
    ex = tvm.compile(fused_attention_mma(spec, 2, 16, 2, 1, emulate=True), target=EMULATION_TARGET)
    check_emulated_layout(ex, spec)


@pytest.mark.parametrize("layout, seq_q, seq_kv", RIGHT_WINDOW_SHAPES, ids=[c[0] for c in RIGHT_WINDOW_SHAPES])
def test_tensor_core_right_window_rows_without_a_key_on_cpu(layout, seq_q, seq_kv):
    """A window open on the left and bounded on the right in the tensor-core kernel, emulated:
    a row at p < −R gives zeros and an lse of −inf, not NaN (``test_cuda``'s twin)."""
    spec = dataclasses.replace(right_window_spec(layout, seq_q, seq_kv, "float16"), head_dim=EMU_D)
    ex = tvm.compile(fused_attention_mma(spec, 2, 16, 2, 1, emulate=True), target=EMULATION_TARGET)
    check_emulated_layout(ex, spec)


@needs_nvcc
@pytest.mark.parametrize("arch, dtype, head_dim, causal", [("sm_90", "float16", 128, True),
                                                           ("sm_80", "bfloat16", 64, False)])
def test_varlen_tensor_core_builds_offline_without_spills(arch, dtype, head_dim, causal):
    """``fused`` builds a varlen fp16/bf16 spec on tensor cores as a static one
    (:func:`assert_preset_code`), fused by the symbolic audit, cu_seqlens as arguments and a
    (slot, head) grid."""
    spec = AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1024, head_dim=head_dim, dtype=dtype, causal=causal,
                         layout="varlen")
    target = resolve_target("cuda", arch=arch)
    built = build_kernel(spec, "fused", target=target)
    assert_preset_code(built, spec, target)
    assert built.audit.fused and built.audit.probe == {"symbolic": ["total_q", "total_k", "batch"]}
    src = built.module.imports[0].inspect_source()
    signature = src[src.index("__global__"):src.index("{", src.index("__global__"))]
    assert all(p in signature for p in ("int* __restrict__ CQ", "int* __restrict__ CK", "int batch_plus_1")), signature
    assert "blockIdx.y" in src and "blockIdx.z" not in src  # (slot, head)


@needs_nvcc
@pytest.mark.parametrize("arch, dtype, head_dim, layout, page", [("sm_90", "float16", 128, "paged", 16),
                                                                ("sm_80", "bfloat16", 64, "kvcache", None),
                                                                ("sm_90", "bfloat16", 64, "paged", 64)])
def test_cache_tensor_core_builds_offline_without_spills(arch, dtype, head_dim, layout, page):
    """A decode step (GQA 32:8, batch 64, 4k keys: the decode goal's shape) on tensor cores
    builds as a static kernel does (:func:`assert_preset_code`) with one row group a warp (the
    group's 4 packed rows fill one), fused, block_table and cache_seqlens as arguments, a
    (row tile, KV head, batch) grid."""
    spec = AttentionSpec(batch=64, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=head_dim, dtype=dtype,
                         causal=True, layout=layout, page_size=page)
    target = resolve_target("cuda", arch=arch)
    built = build_kernel(spec, "fused", target=target)
    assert_preset_code(built, spec, target)
    assert built.knobs.m_tiles == 1
    assert built.audit.fused, built.audit.format()
    src = built.module.imports[0].inspect_source()
    signature = src[src.index("__global__"):src.index("{", src.index("__global__"))]
    assert "int* __restrict__ CS" in signature and ("int* __restrict__ BT" in signature) == (layout == "paged")
    assert "blockIdx.z" in src and "blockIdx.y" in src
    assert_split_kv(built, spec)


@needs_nvcc
@pytest.mark.parametrize("arch, head_dim, knobs", [("sm_90", 128, dict(warps=4, block_n=64, stages=2, m_tiles=1)),
                                                   ("sm_80", 64, dict(warps=4, block_n=64, stages=3, m_tiles=2))])
def test_dynamic_shared_memory_past_48_kib(arch, head_dim, knobs):
    """Tiles past 48 KiB of shared memory (D=128 with 64-key tiles: 68 KiB; D=64 with three
    stages: 54 KiB) build as one dynamic allocation (TVM's runtime opts in at launch): no
    spill, one barrier per key tile, the dynamic bytes in the report and its occupancy; they
    are in the tuner's space, and an arch's own limit refuses what it cannot hold (sm_86: 99 KiB)."""
    spec = AttentionSpec(batch=1, heads=16, seq_q=4096, head_dim=head_dim, dtype="float16", causal=True)
    target = resolve_target("cuda", arch=arch)
    k = cuda_mma.MMAKnobs(**knobs)
    built = build_kernel(spec, "fused_tc", target=target, knobs=knobs)
    r = built.resources
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0, r
    assert r["shared_bytes"] == 0 and r["dynamic_shared_bytes"] == cuda_mma.shared_bytes(k, spec) > 48 * 1024
    assert r["ptx_instructions"]["bar.sync"] == 1 and built.audit.fused
    assert "extern __shared__" in built.module.imports[0].inspect_source()
    assert r["occupancy_limited_by"] in ("registers", "shared memory") and r["blocks_per_sm"] >= 1
    assert k in cuda_mma.tile_candidates(spec, target)
    wide = cuda_mma.MMAKnobs(warps=4, block_n=128, stages=3, m_tiles=1)  # 102 KiB at D=64, 204 KiB at D=128
    with pytest.raises(KnobError, match="the most a block may take on sm_86"):
        cuda_mma.check(wide, spec, resolve_target("cuda", arch="sm_86"))


@needs_nvcc
def test_gpu_check_script_builds_both_kernels_offline(tmp_path, monkeypatch, capsys):
    """scripts/gpu_check.py's build pool, tiny: the tensor-core kernel, full and causal, exported
    artifacts with their fatbins. One dtype (bf16) and one kernel (``--kernels``): the dtype and
    kernel loops are a plain product; the same pool worker (``gpu_payload.build_job``) builds the
    CUDA-core kernel of every kind, each with its fatbin, in test_gpu_payload's fixture. One
    worker (``--jobs 1``): the pool's spawned worker is what is checked, not two builds at once,
    and each worker costs its own import of tvm (~3 s of CPU)."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gck"
    # in this process (its exit status is main's return): the pool's spawned workers build, as
    # from the command line; what main sets in the environment is put back
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--build-only", "--arch", "sm_80", "--seq", "256", "--head-dim",
                                      "64", "--dtype", "bfloat16", "--kernels", "fused_tc", "--jobs", "1", "--out", str(out)])
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvcc")
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root / "scripts"))
    import gpu_check

    assert gpu_check.main() == 0
    stdout = capsys.readouterr().out
    lines = [ln for ln in stdout.splitlines() if ln.startswith("fused_")]
    assert len(lines) == 2 and all(ln.startswith("fused_tc") for ln in lines)  # full, causal
    assert all("spills=0" in ln for ln in lines), lines
    manifests = {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/manifest.json")}
    assert len(manifests) == 2 and all(m["audit"]["verdict"] == "fused" for m in manifests.values())
    assert all(m["schedule"]["knobs"].get("m_tiles") for m in manifests.values())  # tensor cores' knobs
    # each exported with its fatbin where nvcc is
    for name, m in manifests.items():
        assert m["kernel_binary"]["arch"] == "sm_80", name
        assert (out / name / "kernel.fatbin").read_bytes()[:4] == b"\x50\xed\x55\xba"  # fatbin magic


def test_tuning_tasks_cover_the_tensor_core_space_and_regenerate():
    """One task per feasible (warps, block_n, stages, m_tiles), the preset first; a stored function of any
    task regenerates to the same workload (how build finds a tuned record for a spec). At D=128 on
    sm_86: 27 tasks (every warps, block_n and stages value, one row group: two spill; sm_90's
    larger shared memory holds 36, each one more function to generate for no other value), where
    D=64's 63 cost 20 s to generate; m_tiles=2's knobs read back from a workload: the log matching
    test."""
    from tvm_attention.task_mods import workload_matches
    from tvm_attention.tune.tasks import make_tasks

    spec = AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=1024, head_dim=128, dtype="bfloat16", causal=True)
    target = resolve_target("cuda", arch="sm_86")
    tasks = make_tasks(spec, target, "fused")
    cands = cuda_mma.tile_candidates(spec, target)
    assert [sorted({getattr(k, f) for k in cands}) for f in ("warps", "block_n", "stages")] == \
        [[2, 4, 8], [16, 32, 64, 128], [1, 2, 3]]  # every value of each knob
    assert [t.name for t in tasks] == [f"fused_w{k.warps}_n{k.block_n}_s{k.stages}_m{k.m_tiles}" for k in cands]
    for t in (tasks[0], tasks[-1]):
        assert workload_matches(spec, t.mod)
        assert not workload_matches(AttentionSpec.from_dict({**spec.to_dict(), "causal": False}), t.mod)


def test_log_matching_regenerates_with_the_family_workload(monkeypatch):
    """Log matching regenerates a CUDA record with its family's ``workload(spec, knobs)``, the
    function ``build`` schedules, with the knobs read back from the stored function (a KV-cache
    workload's ``split_tasks`` too); a record of another spec's kernel (float32: the tensor-core
    generator refuses it) is no match, without being generated; an error in generating one of
    spec's own is raised, not taken for "no match". Knobs tuned at a KV-cache spec's bhsd
    representative build it with its preset's split-KV, a record tuned on a split layout with its own."""
    from tvm_attention.task_mods import normalize, regenerate, tuning_spec, workload_matches

    target = resolve_target("cuda", arch="sm_90")
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1, seq_kv=256, head_dim=64, dtype="float16", causal=True)
    knobs = cuda_mma.preset(spec, target)
    mod = normalize(cuda_mma.workload(spec, knobs))
    assert cuda_fused.workload_knobs(mod["main"]) == knobs and workload_matches(spec, mod)
    assert regenerate(dataclasses.replace(spec, dtype="float32"), mod["main"]) is None
    paged = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1, seq_kv=256, head_dim=32, causal=True, layout="paged")
    split = cuda_simt.preset(paged, target)
    assert split.split_tasks == split_tasks_for(target) > 0
    assert cuda_fused.workload_knobs(cuda_simt.workload(paged, split)) == split

    # for_layout: the bhsd record's knobs (no split) take the KV-cache spec's own split
    for kv in (dataclasses.replace(spec, layout="kvcache"), paged):
        tuned = cuda_fused.preset(tuning_spec(kv, target), target)
        assert tuned.split_tasks == 0
        got = cuda_fused.for_layout(tuned, kv, target, tuning_spec(kv, target))
        assert got == dataclasses.replace(tuned, split_tasks=split_tasks_for(target))
        assert cuda_fused.for_layout(dataclasses.replace(tuned, split_tasks=64), kv, target, kv).split_tasks == 64

    def broken(spec, knobs):
        raise RuntimeError("a bug in the workload")

    monkeypatch.setattr(cuda_mma, "workload", broken)
    with pytest.raises(RuntimeError, match="a bug in the workload"):
        workload_matches(spec, mod)
