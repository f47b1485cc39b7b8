"""CUDA path, offline: builds for sm_80/sm_90, ptxas resources, audit, feasibility, and the
algorithm of the CUDA compute checked on the CPU. GPU runs are marked and skip without a GPU."""
import itertools
import json
import os

import numpy as np
import pytest
import tvm
from conftest import (CUDA_VARIANT_IDS, CUDA_VARIANT_SPREADS, RIGHT_WINDOW_SHAPES, assert_split_stores_guarded, built,
                      check_emulated_layout, check_emulated_symbolic, right_window_spec, split_kv_cases)

from tvm_attention.schedules import cuda_fused, cuda_mma, cuda_simt
from tvm_attention.schedules._knobs import KnobError
from tvm_attention.artifact import export, validate_built
from tvm_attention.build import build_kernel
from tvm_attention.cli import main
from tvm_attention.cuda_tools import find_nvcc, occupancy
from tvm_attention.layouts import LAYOUTS, KernelArgumentError
from tvm_attention.loader import MAX_GRID_YZ, AttentionKernel, check_cuda_grid
from tvm_attention.reference import random_inputs, reference_attention
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import TargetError, local_cuda_arch, resolve_target
from tvm_attention.validate import TOLERANCES
from tvm_attention.workloads.fused_cuda import fused_attention_cuda

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed: no ptxas report")
needs_gpu = pytest.mark.skipif(local_cuda_arch() is None, reason="no CUDA GPU on this machine")

#: What the emulated kernels below (threads as serial loops, each PTX instruction by its definition;
#: test_cuda_mma.py's too) compile for: this host at LLVM's -O0. They check the algorithm against
#: the float64 reference, never the code LLVM makes of it, and LLVM's optimisation was most of their
#: compile (the tensor-core kernel at D=128: 2.4 s of CPU → 0.7 s; at D=32 0.6 → 0.3 s) while their
#: runs take as long (the reference's NumPy is most of a run). Builds of the product (``built``,
#: ``build_kernel``) keep their target's own level.
EMULATION_TARGET = tvm.target.Target({**resolve_target("llvm").export(), "opt-level": 0})


#: ``scripts/cuda_build_sweep.py`` sets this: the sweeps below run their whole cross product
SWEEP = os.environ.get("TVMA_CUDA_SWEEP") == "1"
#: the SIMT presets' axes (seq, arch, head_dim, dtype, causal): 32 nvcc builds, the sweep's
PRESET_AXES = ([128, 2048], ["sm_80", "sm_90"], [64, 128], ["float16", "float32"], [False, True])
#: The default run's covering set: each (dtype, head_dim) preset (``cuda_simt._PRESETS``) on
#: each arch (ptxas caps registers per arch), i.e. every triple of those three axes; seq short
#: exactly where dtype ⊕ head_dim ⊕ arch is odd and causal where dtype ⊕ head_dim is, so every
#: pair of the five axes occurs (seq × causal, seq × arch, causal × arch ...). Among them the
#: case that once took 223 registers: fp32 D=128 non-causal on sm_90 at a short length.
PRESET_CASES = [
    (2048, "sm_80", 64, "float16", False), (128, "sm_90", 64, "float16", False),
    (128, "sm_80", 128, "float16", True), (2048, "sm_90", 128, "float16", True),
    (128, "sm_80", 64, "float32", True), (2048, "sm_90", 64, "float32", True),
    (2048, "sm_80", 128, "float32", False), (128, "sm_90", 128, "float32", False),
]


@needs_nvcc
@pytest.mark.parametrize("seq, arch, head_dim, dtype, causal",
                         list(itertools.product(*PRESET_AXES)) if SWEEP else PRESET_CASES,
                         ids=lambda v: {False: "full", True: "causal"}.get(v) if isinstance(v, bool) else None)
def test_presets_compile_offline_without_spills(seq, arch, head_dim, dtype, causal):
    """The SIMT (CUDA-core) kernel; for float16 ``fused`` now builds the tensor-core one. Short
    lengths too: a small constant trip count changes what nvcc unrolls (fp32 D=128 once took 223
    registers there against the check's estimate of 140). ``PRESET_CASES`` covers the axes; the
    full 32-build cross product: ``python scripts/cuda_build_sweep.py``."""
    spec = AttentionSpec(batch=1, heads=8, seq_q=seq, head_dim=head_dim, dtype=dtype, causal=causal)
    built = build_kernel(spec, "fused_simt", target=resolve_target("cuda", arch=arch))
    r = built.resources
    assert r["arch"] == arch and r["registers"] > 0
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0, r
    assert r["registers"] <= cuda_simt.registers_estimate(built.knobs, spec), r  # the check's estimate holds
    assert 0 < r["shared_bytes"] <= 48 * 1024
    assert 0 < r["occupancy"] <= 1
    assert built.audit.fused, built.audit.format()
    scopes = {a.name: a.scope for a in built.audit.allocations}
    assert scopes["S"] == "local" and scopes["acc"] == "local"
    assert scopes.get("Ps", "shared") == "shared"  # may share another tile's memory after lowering
    src = built.module.imports[0].inspect_source()
    assert "__shfl_down_sync" in src  # row max / row sum are warp-shuffle reductions
    vec = "float4" if dtype == "float32" else "uint4"
    assert vec in src  # 16-byte K/V/Q loads
    # per key tile: K/V staged, then read; P written, then read (+1 where P reuses the K tile's
    # memory). The row sum once read P back from shared memory: a barrier per element (33 per
    # tile at fp16 D=64).
    assert src.count("__syncthreads") <= 4, src.count("__syncthreads")


def test_cuda_audit_can_fail():
    spec = AttentionSpec(batch=1, heads=2, seq_q=4096, head_dim=64, dtype="float16")
    built = build_kernel(spec, "materialized", target=resolve_target("cuda", arch="sm_90"))
    assert not built.audit.fused


@pytest.mark.parametrize(
    "knobs, message",
    [
        # past the 227 KiB a block may take on sm_90 (dynamic shared memory opted in)
        (dict(block_m=128, block_n=256, threads_per_row=4), "shared memory .* 232448 B, the most a block may take on sm_90"),
        (dict(block_m=128, block_n=16, threads_per_row=16), "max_threads_per_block"),
        (dict(block_m=4, block_n=16, threads_per_row=4), "whole number of warps"),
        (dict(threads_per_row=3), "power of two"),
        (dict(block_n=62), "multiples of threads_per_row"),
        (dict(stages=2), "only 1"),
    ],
)
def test_feasibility_rejects_with_named_limit(knobs, message):
    spec = AttentionSpec(batch=1, heads=8, seq_q=1024, head_dim=128, dtype="float16")
    target = resolve_target("cuda", arch="sm_90")
    base = cuda_simt.preset(spec, target).to_dict()
    with pytest.raises(KnobError, match=message):
        build_kernel(spec, "fused_simt", target=target, knobs={**base, **knobs})


def test_occupancy_model_by_hand():
    # 256 threads = 8 warps; 64 regs → 2048 regs/warp → 16384/block → 4 blocks by registers;
    # 45040 B smem (+1 KiB reserved) on sm_90's 228 KiB → 5; warps: 64 / 8 = 8 → 4 blocks
    occ = occupancy("sm_90", 64, 45040, 256)
    assert occ["blocks_per_sm"] == 4 and occ["occupancy"] == 0.5
    assert occ["occupancy_limited_by"] == "registers"


#: (seq_q, seq_kv, causal, dtype): every shape full and causal and in both dtypes, and every
#: (causal, dtype) pair (8 of the 16 products): the masks follow shape × causal (one key; Sq <
#: Skv with a key tail; Sq > Skv, rows before the first key; whole tiles), the preset (tile,
#: lanes, 16-byte vectors) the dtype
ALGORITHM_CASES = [(1, 1, False, "float32"), (1, 1, True, "float16"),
                   (113, 203, False, "float16"), (113, 203, True, "float32"),
                   (300, 45, False, "float32"), (300, 45, True, "float16"),
                   (96, 128, False, "float16"), (96, 128, True, "float32")]


@pytest.mark.parametrize("seq_q, seq_kv, causal, dtype", ALGORITHM_CASES,
                         ids=lambda v: {False: "full", True: "causal"}.get(v) if isinstance(v, bool) else None)
def test_cuda_algorithm_on_cpu(seq_q, seq_kv, causal, dtype):
    """The CUDA compute with serial loops in place of threads, run by LLVM: checks the tiling,
    lane mapping, masking and online correction (not races or the GPU schedule)."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=seq_q, seq_kv=seq_kv, head_dim=64,
                         dtype=dtype, causal=causal)
    target = resolve_target("cuda", arch="sm_90")
    k = cuda_simt.preset(spec, target)
    func = fused_attention_cuda(spec, k.block_m, k.block_n, k.threads_per_row, emulate=True)
    ex = tvm.compile(func, target=EMULATION_TARGET)
    q, kk, v = random_inputs(spec, seed=seq_q)
    args = [tvm.runtime.tensor(x) for x in (q, kk, v)] + [tvm.runtime.empty(spec.o_shape, dtype)]
    ex["attention"](*args)
    out = args[3].numpy().astype(np.float64)
    ref = reference_attention(spec, q, kk, v)
    atol, rtol = TOLERANCES[dtype]
    assert np.isfinite(out).all()
    assert np.allclose(out, ref, atol=atol, rtol=rtol), np.abs(out - ref).max()


ALL_DYNAMIC = ("batch", "seq_q", "seq_kv")


@pytest.mark.parametrize("dtype, causal, lse", [("float32", False, False), ("float32", True, True),
                                              ("float16", True, False)])
def test_cuda_symbolic_algorithm_on_cpu(dtype, causal, lse):
    """One symbolic SIMT kernel (batch, seq_q, seq_kv dyn; GQA 4:2), emulated, against the
    reference at every shape of ``conftest.SYMBOLIC_SHAPES``: the (row tile, head, batch) grid,
    the key tail masked at run time, bottom-right causal with Sq above and below Skv, zero rows
    for seq_kv 0."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=256, head_dim=64, dtype=dtype, causal=causal,
                         dynamic=ALL_DYNAMIC, return_lse=lse)
    k = cuda_simt.preset(spec, resolve_target("cuda", arch="sm_90"))
    check_emulated_symbolic(tvm.compile(fused_attention_cuda(spec, k.block_m, k.block_n, k.threads_per_row,
                                                             emulate=True), target=EMULATION_TARGET), spec)


@pytest.mark.parametrize("layout, page, dtype, causal, lse", [
    ("varlen", None, "float32", False, False), ("varlen", None, "float32", True, True),
    ("varlen", None, "float16", True, False), ("kvcache", None, "float32", True, True),
    ("paged", 16, "float32", False, False), ("paged", 64, "float16", True, True),
])
def test_cuda_layouts_algorithm_on_cpu(layout, page, dtype, causal, lse):
    """The SIMT kernel in the serving layouts (GQA 4:2), emulated (``conftest.check_emulated_layout``):
    varlen, each thread block's sequence found by the binary search on cu_seqlens_q and spare
    slots computing nothing; kvcache and paged, the group's heads packed into one tile, each
    sequence's cache_seqlens read once, pages through block_table; per-sequence key tails and
    bottom-right causal, zero rows for a sequence with no key, the log-sum-exp with ``lse``.
    Small tiles give many of them."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=64, head_dim=64, dtype=dtype, causal=causal,
                         layout=layout, page_size=page, return_lse=lse)
    check_emulated_layout(tvm.compile(fused_attention_cuda(spec, 16, 16, 4, emulate=True),
                                      target=EMULATION_TARGET), spec)


@pytest.mark.parametrize("layout, page, dtype, variants", [
    ("kvcache", None, "float32", dict(causal=True, return_lse=True)),
    ("paged", 16, "float16", dict(window=(300, 0), sinks=True, alibi=True, softcap=20.0, return_lse=True)),
])
def test_cuda_split_kv_algorithm_on_cpu(layout, page, dtype, variants):
    """Split-KV in the SIMT kernel, emulated (``conftest.split_kv_cases``): each sequence's key
    tiles cut into chunks (a window's skipped tiles before the first), each chunk's state stored
    unnormalised, the merge kernel combining them (the sink once in the merged denominator,
    zeros and a log-sum-exp of -inf for a sequence with no key); a prefill chunk of several row
    tiles unsplit."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1, head_dim=64, dtype=dtype, layout=layout,
                         page_size=page, **variants)
    func = fused_attention_cuda(spec, 16, 16, 4, emulate=True, split_tasks=64)
    assert_split_stores_guarded(func)
    ex = tvm.compile(func, target=EMULATION_TARGET)
    check_emulated_layout(ex, spec, split_kv_cases(layout))


@pytest.mark.parametrize("layout, kv_dtype, dtype, split, variants", [
    ("kvcache", "float8_e4m3fn", "float32", 0, {}),
    ("paged", "int8", "float16", 64, dict(return_lse=True)),
    ("kvcache", "float8_e5m2", "float32", 64, dict(sinks=True, window=(300, 0), return_lse=True)),
])
def test_cuda_8bit_cache_algorithm_on_cpu(layout, kv_dtype, dtype, split, variants):
    """An 8-bit K/V cache in the SIMT kernel, emulated: each element converted on its way to
    shared memory (``kv_to_f32``), the KV head's ``k_scale`` folded into the scores' scale and
    ``v_scale`` into the output, once per row (after the merge, when split), against the
    reference on the dequantized cache; the layout's cases and, split, the long caches."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1, head_dim=64, dtype=dtype, causal=True, layout=layout,
                         page_size=16 if layout == "paged" else None, kv_dtype=kv_dtype, **variants)
    ex = tvm.compile(fused_attention_cuda(spec, 16, 16, 4, emulate=True, split_tasks=split),
                     target=EMULATION_TARGET)
    check_emulated_layout(ex, spec)
    if split:
        check_emulated_layout(ex, spec, split_kv_cases(layout))


@pytest.mark.parametrize("layout, kv_dtype, dtype, split", [
    ("paged", None, "float32", 64),
    ("kvcache", "int8", "float16", 0),
])
def test_cuda_append_algorithm_on_cpu(layout, kv_dtype, dtype, split):
    """Appending in the call on the SIMT kernel, emulated: a kernel of its own writes ``k_new``/
    ``v_new`` into the cache at ``cache_seqlens[b] ..`` (paged through the block table; an 8-bit
    cache quantized with its scale, bit for bit ``quantize_kv``'s), then the attention runs over
    the ``cache_seqlens[b] + seq_q`` keys (split: the merge too), against the reference on the
    appended caches, on the layout's cases (empty caches, tile and page edges, a prefill chunk)."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=4, head_dim=64, dtype=dtype, causal=True, layout=layout,
                         page_size=16 if layout == "paged" else None, kv_dtype=kv_dtype, append=True)
    ex = tvm.compile(fused_attention_cuda(spec, 16, 16, 4, emulate=True, split_tasks=split), target=EMULATION_TARGET)
    check_emulated_layout(ex, spec)


#: The decode goal's step (GQA 32:8, batch 64, 4096 keys, D=128) with every decode feature in one
#: build of each kernel: a float8 e4m3 cache and attention variants, on tensor cores (fp16, sm_90:
#: a window, softcap, sinks, ALiBi and the log-sum-exp, as the GPU payload's paged variant build) and
#: on CUDA cores (fp32, sm_80: a first key per sequence and ALiBi). They were three builds of each
#: (8-bit, variants, lse), the tensor-core ones the slowest of this file; together they take more
#: registers than any of them alone (2026-12-07: tensor cores 204 against 164 for the 8-bit cache
#: and 168 for the variants with lse; CUDA cores 51 against 51 and 39), so no spill here is no
#: spill there.
DECODE_BUILDS = [
    ("sm_90", "float16", "paged", 16, dict(window=(4095, 0), softcap=30.0, sinks=True, alibi=True, return_lse=True)),
    ("sm_80", "float32", "kvcache", None, dict(kv_start=True, alibi=True)),
]


@needs_nvcc
@pytest.mark.parametrize("arch, dtype, layout, page, variants", DECODE_BUILDS, ids=["tc-paged", "simt-kvcache"])
def test_decode_builds_offline_without_spills(arch, dtype, layout, page, variants):
    """A float8 e4m3 cache and the variants on CUDA (tensor cores for fp16, CUDA cores for fp32),
    the decode goal's step: no spill, fused, K/V read as bytes with their scales, each variant's
    argument there exactly when it is on, the LSE output with ``return_lse``; split-KV; a BHSD
    spec with an 8-bit cache is refused by name."""
    spec = AttentionSpec(batch=64, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, dtype=dtype,
                         causal=True, layout=layout, page_size=page, kv_dtype="float8_e4m3fn", **variants)
    target = resolve_target("cuda", arch=arch)
    built = build_kernel(spec, "fused", target=target)
    assert isinstance(built.knobs, cuda_mma.MMAKnobs if dtype != "float32" else cuda_simt.FlashCUDAKnobs)
    signature = spill_free_signature(built)
    assert "uchar* __restrict__ K8" in signature and "float* __restrict__ KSC" in signature, signature
    for name, on in (("AL", "alibi"), ("SN", "sinks"), ("KS", "kv_start"), ("LSE", "return_lse")):
        assert (f"__restrict__ {name}_ptr" in signature) == (on in variants), signature  # KS_ptr, not KSC_ptr
    assert_split_kv(built, spec)
    bhsd = AttentionSpec(batch=1, heads=8, seq_q=64, head_dim=64, dtype=dtype, kv_dtype="float8_e4m3fn")
    with pytest.raises(KnobError, match="8-bit K/V caches .* in the kvcache, paged, mla and mla_paged layouts, "
                                        "not 'bhsd'"):
        build_kernel(bhsd, "fused", target=target)


def spill_free_signature(built) -> str:
    """A CUDA build's kernel signature, once it passed what every offline build here must: no
    spill, no stack frame, the fused audit."""
    r = built.resources
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0, r
    assert built.audit.fused, built.audit.format()
    src = built.module.imports[0].inspect_source()
    return src[src.index("__global__"):src.index("{", src.index("__global__"))]


@pytest.mark.parametrize("case", range(len(CUDA_VARIANT_SPREADS)), ids=CUDA_VARIANT_IDS)
def test_cuda_variants_algorithm_on_cpu(case):
    """The SIMT kernel with the attention variants, emulated: a sliding window (its key tiles
    before the window skipped, the rest masked), a logit softcap, ALiBi on each row's head
    (packed rows: the group's heads), sinks in the denominator, a first visible key per
    sequence; rows that see no key give zeros (``conftest.CUDA_VARIANT_SPREADS``; fp32, every
    other case fp16)."""
    layout, page, dynamic, variants = CUDA_VARIANT_SPREADS[case]
    spec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=37, seq_kv=45, head_dim=64, layout=layout,
                         dtype="float16" if case % 2 else "float32", page_size=page, dynamic=dynamic, **variants)
    check_emulated_layout(tvm.compile(fused_attention_cuda(spec, 16, 16, 4, emulate=True),
                                      target=EMULATION_TARGET), spec)


@pytest.mark.parametrize("layout, seq_q, seq_kv", RIGHT_WINDOW_SHAPES, ids=[c[0] for c in RIGHT_WINDOW_SHAPES])
def test_cuda_right_window_rows_without_a_key_on_cpu(layout, seq_q, seq_kv):
    """A window open on the left and bounded on the right in the SIMT kernel, emulated: a row at
    p < −R sees no key and gives zeros and an lse of −inf (it gave NaN: the row's "sees a key"
    test ignored R), with the lengths compiled in and at run time."""
    spec = right_window_spec(layout, seq_q, seq_kv, "float32")
    check_emulated_layout(tvm.compile(fused_attention_cuda(spec, 16, 16, 4, emulate=True),
                                      target=EMULATION_TARGET), spec)


@needs_nvcc
@pytest.mark.parametrize("arch, dtype, head_dim, causal, lse", [("sm_80", "float32", 64, True, False),
                                                                ("sm_80", "float32", 128, False, True)])
def test_varlen_simt_builds_offline_without_spills(arch, dtype, head_dim, causal, lse):
    """A varlen float32 build (``fused`` takes the SIMT kernel): no spill on sm_80, the static
    build's shared tiles, fused by the symbolic audit, cu_seqlens and the lengths the grid needs
    as arguments, a (slot, head) grid; with ``--return-lse`` the LSE output among them (the
    tensor-core kernel's: test_decode_builds_offline_without_spills). (On sm_90 ptxas caps these
    presets' registers lower and spills 4-12 bytes, with lse or without: docs/cuda.md.)"""
    spec = AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1024, head_dim=head_dim, dtype=dtype, causal=causal,
                         layout="varlen", return_lse=lse)
    built = build_kernel(spec, "fused", target=resolve_target("cuda", arch=arch))
    assert isinstance(built.knobs, cuda_simt.FlashCUDAKnobs)
    r = built.resources
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0, r
    assert 0 < r["shared_bytes"] <= cuda_simt.shared_bytes(built.knobs, spec) <= 48 * 1024
    assert built.audit.fused and built.audit.probe == {"symbolic": ["total_q", "total_k", "batch"]}
    src = built.module.imports[0].inspect_source()
    signature = src[src.index("__global__"):src.index("{", src.index("__global__"))]
    # the index arrays and the dims the grid needs (total_k only sizes K and V)
    assert all(p in signature for p in ("int* __restrict__ CQ", "int* __restrict__ CK", "int batch_plus_1",
                                        "int total_q")), signature
    assert ("float* __restrict__ LSE" in signature) == lse, signature
    assert "blockIdx.y" in src and "blockIdx.z" not in src  # (slot, head)


@needs_nvcc
@pytest.mark.parametrize("arch, dtype, head_dim, causal, dynamic", [
    ("sm_80", "float32", 64, False, ALL_DYNAMIC),
    ("sm_90", "float32", 128, True, ALL_DYNAMIC),
    ("sm_90", "float16", 128, True, ALL_DYNAMIC),
    ("sm_80", "bfloat16", 64, True, ("seq_kv",)),
])
def test_symbolic_simt_builds_offline_without_spills(arch, dtype, head_dim, causal, dynamic):
    """A symbolic SIMT build compiles as the static one does: no spill, under the register
    estimate, the same shared tiles, fused by the symbolic audit, the lengths as kernel
    arguments. ``fused`` builds float32 on it; a symbolic half-precision spec it routes to the
    tensor-core kernel (test_cuda_mma.py), so that one is built here as ``fused_simt``."""
    spec = AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1024, head_dim=head_dim, dtype=dtype, causal=causal,
                         dynamic=dynamic)
    target = resolve_target("cuda", arch=arch)
    built = build_kernel(spec, "fused" if dtype == "float32" else "fused_simt", target=target)
    assert isinstance(built.knobs, cuda_simt.FlashCUDAKnobs)
    r = built.resources
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0, r
    assert r["registers"] <= cuda_simt.registers_estimate(built.knobs, spec), r
    assert 0 < r["shared_bytes"] <= cuda_simt.shared_bytes(built.knobs, spec) <= 48 * 1024
    assert built.audit.fused and built.audit.probe == {"symbolic": list(dynamic)}, built.audit.format()
    src = built.module.imports[0].inspect_source()
    assert "__shfl_down_sync" in src and src.count("__syncthreads") <= 4
    signature = src[src.index("__global__"):src.index("{", src.index("__global__"))]
    assert all(f"int {d}" in signature for d in dynamic), signature
    assert "blockIdx.z" in src and "blockIdx.y" in src  # the (row tile, head, batch) grid
    if dtype != "float32":  # ``fused`` would take tensor cores for it
        assert cuda_mma.supports(spec, target) and isinstance(cuda_fused.preset(spec, target), cuda_mma.MMAKnobs)


def test_cuda_loader_binds_symbolic_dims_and_answers_empty_calls():
    """The loader's CUDA path (run here on the CPU device with a CPU build of the same symbolic
    spec): the output's shape from the bound dims, a mismatch named, a call with no work answered
    without a launch (zeros; a grid of zero blocks is a launch error), a batch past gridDim.z
    refused by name."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=64, head_dim=32, causal=True, dynamic=ALL_DYNAMIC)
    b = built(spec)
    launches = []

    def function(*args):
        launches.append([tuple(a.shape) for a in args])
        b.function(*args)

    class OnCpu(AttentionKernel):
        def _cuda_device(self):
            return tvm.cpu(0)

    kernel = OnCpu(spec, function, device="cuda")
    for shape in ((2, 37, 45), (1, 5, 0), (0, 3, 7), (2, 0, 7)):
        x = LAYOUTS["bhsd"].random_inputs(spec, dict(zip(ALL_DYNAMIC, shape)), seed=1)
        n = len(launches)
        out = kernel(x["q"], x["k"], x["v"])
        assert out.shape == (shape[0], 4, shape[1], 32)
        np.testing.assert_allclose(out, reference_attention(spec, x["q"], x["k"], x["v"]), atol=1e-5, rtol=1e-5)
        assert len(launches) == n + (0 not in shape)
    assert launches == [[(2, 4, 37, 32), (2, 2, 45, 32), (2, 2, 45, 32), (2, 4, 37, 32)]]  # one launch only
    x = LAYOUTS["bhsd"].random_inputs(spec, {"batch": 2, "seq_q": 3, "seq_kv": 5}, seed=2)
    with pytest.raises(KernelArgumentError, match="k: dim 0 \\(batch\\) is 1, but q has batch=2"):
        kernel(x["q"], x["k"][:1], x["v"][:1])
    from tvm_attention.workloads import fused_cuda

    assert MAX_GRID_YZ == fused_cuda.MAX_GRID_YZ  # the loader's copy (it loads without TVM)
    check_cuda_grid(spec, {"batch": MAX_GRID_YZ})
    with pytest.raises(KernelArgumentError, match="batch=65536.*gridDim.z.*split the batch"):
        check_cuda_grid(spec, {"batch": MAX_GRID_YZ + 1})
    check_cuda_grid(AttentionSpec(batch=MAX_GRID_YZ + 1, heads=1, seq_q=1, head_dim=16), {})  # static: a flat grid


def test_cuda_loader_checks_varlen_indices_and_options():
    """The loader's CUDA path for varlen (run on the CPU device with a CPU varlen build): results
    per sequence, cu_seqlens checked by the layout's rules before any launch (a CUDA kernel
    cannot raise), FlashAttention's keywords checked as on the CPU path, an empty call answered
    without a launch, and no gridDim.z limit on the batch (varlen's grid is (slot, head))."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=64, head_dim=32, causal=True, layout="varlen")
    b = built(spec)
    launches = []

    def function(*args):
        launches.append(len(args))
        b.function(*args)

    class OnCpu(AttentionKernel):
        def _cuda_device(self):
            return tvm.cpu(0)

    kernel = OnCpu(spec, function, device="cuda")
    layout = LAYOUTS["varlen"]
    x = layout.random_inputs(spec, {"seqlens": [(3, 9), (0, 4), (17, 5)]}, seed=3)
    out = kernel(x["q"], x["k"], x["v"], cu_seqlens_q=x["cu_seqlens_q"], cu_seqlens_k=x["cu_seqlens_k"],
                 causal=True, max_seqlen_q=17)
    np.testing.assert_allclose(out, layout.reference(spec, x), atol=1e-5, rtol=1e-5)
    assert launches == [6]
    bad = x["cu_seqlens_k"].copy()
    bad[1], bad[2] = bad[2], bad[1]
    with pytest.raises(KernelArgumentError, match="cu_seqlens_k: must be non-decreasing"):
        kernel(x["q"], x["k"], x["v"], cu_seqlens_q=x["cu_seqlens_q"], cu_seqlens_k=bad)
    with pytest.raises(KernelArgumentError, match="causal=False: this artifact was built with causal=True"):
        kernel(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], causal=False)
    with pytest.raises(KernelArgumentError, match="max_seqlen_q=16 is smaller than the longest"):
        kernel(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], max_seqlen_q=16)
    with pytest.raises(KernelArgumentError, match="cu_seqlens_q: expected dtype int32"):
        kernel(x["q"], x["k"], x["v"], x["cu_seqlens_q"].astype(np.int64), x["cu_seqlens_k"])
    empty = layout.random_inputs(spec, {"seqlens": [(0, 5), (0, 0)]}, seed=4)
    assert kernel(empty["q"], empty["k"], empty["v"], empty["cu_seqlens_q"], empty["cu_seqlens_k"]).shape == (0, 4, 32)
    assert launches == [6]  # the refused and the empty calls never launched
    check_cuda_grid(spec, {"batch": MAX_GRID_YZ + 1, "total_q": 1, "total_k": 1})


@needs_nvcc
@pytest.mark.parametrize("arch, layout, page", [("sm_90", "paged", 16), ("sm_80", "kvcache", None)])
def test_cache_simt_builds_offline_without_spills(arch, layout, page):
    """A float32 decode step (GQA 32:8, D=128; ``fused`` takes the SIMT kernel): no spill, fused,
    the index arrays as arguments, a (row tile, KV head, batch) grid."""
    spec = AttentionSpec(batch=64, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, causal=True,
                         layout=layout, page_size=page)
    built = build_kernel(spec, "fused", target=resolve_target("cuda", arch=arch))
    assert isinstance(built.knobs, cuda_simt.FlashCUDAKnobs)
    signature = spill_free_signature(built)
    assert "int* __restrict__ CS" in signature and ("int* __restrict__ BT" in signature) == (layout == "paged")
    src = built.module.imports[0].inspect_source()
    assert "blockIdx.z" in src and "blockIdx.y" in src
    assert_split_kv(built, spec)


def assert_split_kv(built, spec) -> None:
    """A KV-cache build splits the keys of a small batch: its preset aims at two thread blocks
    per SM, its source has the merge kernel, the partials live in a workspace (not among the
    arguments) sized by the batch alone, so the symbolic audit passes."""
    from tvm_attention.cuda_tools import split_tasks_for

    assert built.knobs.split_tasks == split_tasks_for(built.target) > 0
    src = built.module.imports[0].inspect_source()
    assert "attention_kernel_1(" in src  # the merge
    assert built.audit.fused, built.audit.format()
    assert any("Op (global) is sized by the batch alone" in n for n in built.audit.notes), built.audit.notes


def emulated_cuda(spec):
    """``spec``'s SIMT CUDA kernel with serial loops in place of threads, compiled for the CPU
    (16 × 16 tiles, 4 lanes a row): the loader tests' kernel on the CPU device. It takes the CUDA
    kernel's arguments in their order and compiles in well under a second, where a CPU ``fused``
    build of a KV-cache spec took 8-9 s (the kvcache/paged/lse specs below; the symbolic and
    varlen tests above keep ``built``: test_gpu_payload.py builds those specs too)."""
    return tvm.compile(fused_attention_cuda(spec, 16, 16, 4, emulate=True), target=EMULATION_TARGET)["attention"]


def test_cuda_loader_checks_cache_indices():
    """The loader's CUDA path for the KV-cache layouts (run on the CPU device with the emulated
    CUDA kernels, ``emulated_cuda``):
    results through shuffled pages, and cache_seqlens past the cache, a block_table entry that
    is no page, or the wrong index dtype refused by name before any launch."""

    class OnCpu(AttentionKernel):
        def _cuda_device(self):
            return tvm.cpu(0)

    for layout, page in (("kvcache", None), ("paged", 16)):
        spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1, seq_kv=64, head_dim=32, causal=True,
                             layout=layout, page_size=page)
        function = emulated_cuda(spec)
        launches = []
        kernel = OnCpu(spec, lambda *a: (launches.append(1), function(*a)), device="cuda")
        lay = LAYOUTS[layout]
        names = [a.name for a in lay.all_args(spec) if not a.output]
        case = lay.validation_cases(spec)[1]
        x = lay.random_inputs(spec, case, seed=5)
        out = kernel(*[x[n] for n in names])
        np.testing.assert_allclose(out, lay.reference(spec, x), atol=1e-5, rtol=1e-5)
        bad = dict(x, cache_seqlens=x["cache_seqlens"].copy())
        bad["cache_seqlens"][2] = 10**6
        with pytest.raises(KernelArgumentError, match="cache_seqlens\\[\\d\\]=1000000"):
            kernel(*[bad[n] for n in names])
        if layout == "paged":
            bad = dict(x, block_table=x["block_table"].copy())
            bad["block_table"][7, 0] = 10**6
            with pytest.raises(KernelArgumentError, match="block_table"):
                kernel(*[bad[n] for n in names])
        with pytest.raises(KernelArgumentError, match="cache_seqlens: expected dtype int32"):
            kernel(*[x[n].astype(np.int64) if n == "cache_seqlens" else x[n] for n in names])
        assert launches == [1]


def test_cuda_loader_passes_and_checks_variant_arguments():
    """The loader's CUDA path with variant arguments (on the CPU device, the emulated CUDA
    kernel): ALiBi
    slopes and a kv_start per sequence reach the kernel in the layout's order, and a kv_start
    past its sequence's keys is refused by name before a launch."""

    class OnCpu(AttentionKernel):
        def _cuda_device(self):
            return tvm.cpu(0)

    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1, seq_kv=64, head_dim=32, causal=True,
                         layout="kvcache", alibi=True, kv_start=True)
    function = emulated_cuda(spec)
    launches = []
    kernel = OnCpu(spec, lambda *a: (launches.append(len(a)), function(*a)), device="cuda")
    lay = LAYOUTS["kvcache"]
    names = [a.name for a in lay.all_args(spec) if not a.output]
    assert names[-2:] == ["alibi_slopes", "kv_start"]
    x = lay.random_inputs(spec, lay.validation_cases(spec)[1], seed=9)
    np.testing.assert_allclose(kernel(*[x[n] for n in names]), lay.reference(spec, x), atol=1e-5, rtol=1e-5)
    bad = dict(x, kv_start=x["kv_start"].copy())
    bad["kv_start"][1] = x["cache_seqlens"][1] + 1
    with pytest.raises(KernelArgumentError, match="kv_start"):
        kernel(*[bad[n] for n in names])
    assert launches == [len(names) + 1]


def test_cuda_loader_returns_lse():
    """The loader's CUDA path with ``return_lse`` (on the CPU device, the emulated CUDA kernel
    of the same spec): ``(o, lse)``, lse ``(batch, heads, seq_q)`` float32, -inf for rows that see no key;
    an empty call answers without a launch, its lse all -inf."""

    class OnCpu(AttentionKernel):
        def _cuda_device(self):
            return tvm.cpu(0)

    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=64, head_dim=32, causal=True, dynamic=ALL_DYNAMIC,
                         return_lse=True)
    function = emulated_cuda(spec)
    launches = []
    kernel = OnCpu(spec, lambda *a: (launches.append(len(a)), function(*a)), device="cuda")
    x = LAYOUTS["bhsd"].random_inputs(spec, {"batch": 2, "seq_q": 9, "seq_kv": 5}, seed=7)
    o, lse = kernel(x["q"], x["k"], x["v"])
    ref, ref_lse = reference_attention(spec, x["q"], x["k"], x["v"], return_lse=True)
    np.testing.assert_allclose(o, ref, atol=1e-5, rtol=1e-5)
    assert lse.shape == (2, 4, 9) and lse.dtype == np.float32 and np.isneginf(lse[:, :, :4]).all()
    np.testing.assert_allclose(lse[:, :, 4:], ref_lse[:, :, 4:], atol=1e-5, rtol=1e-5)
    x = LAYOUTS["bhsd"].random_inputs(spec, {"batch": 2, "seq_q": 3, "seq_kv": 0}, seed=7)
    o, lse = kernel(x["q"], x["k"], x["v"])
    assert not o.any() and np.isneginf(lse).all() and launches == [5]


def test_cuda_build_cli_and_inspect(tmp_path, capsys):
    out = tmp_path / "cu"
    rc = main(["build", "--batch", "1", "--heads", "4", "--seq-q", "512", "--head-dim", "64",
               "--dtype", "float16", "--causal", "--target", "cuda", "--arch", "sm_90", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "audit: FUSED" in text
    m = json.loads((out / "manifest.json").read_text())
    assert (out / "kernel.cu").read_text().count("__global__") >= 1
    assert m["target"]["kind"] == "cuda" and m["target"]["arch"] == "sm_90"
    assert m["kernel_source"] == "kernel.cu"
    if find_nvcc():
        assert m["resources"]["spills"] == 0 and "registers" in m["resources"]
        assert "registers/thread" in text
    if local_cuda_arch() is None:
        assert m["validation"]["ran"] is False and "no CUDA device" in m["validation"]["reason"]
    assert main(["inspect", str(out)]) == 0
    assert "audit:      FUSED" in capsys.readouterr().out
    if local_cuda_arch() is None:  # validating a CUDA artifact needs the device: a clear error
        assert main(["validate", str(out)]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_cuda_without_gpu_errors_are_clear(tmp_path, capsys):
    if local_cuda_arch() is not None:
        pytest.skip("this machine has a GPU")
    with pytest.raises(TargetError, match="--arch"):
        resolve_target("cuda")
    rc = main(["tune", "--batch", "1", "--heads", "2", "--seq-q", "256", "--head-dim", "64",
               "--dtype", "float16", "--target", "cuda", "--arch", "sm_90", "--trials", "4",
               "--work-dir", str(tmp_path / "log")])
    assert rc == 2 and "--rpc-tracker" in capsys.readouterr().err
    # ``validate`` of a CUDA artifact without a GPU: test_cuda_build_cli_and_inspect, on its build


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("schedule, dtype", [("fused", "float16"), ("fused", "bfloat16"), ("fused", "float32"),
                                             ("fused_simt", "float16")])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_kernel_on_gpu(schedule, dtype, causal, tmp_path):
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1000, seq_kv=1100, head_dim=64, dtype=dtype,
                         causal=causal)
    built = build_kernel(spec, schedule, target=resolve_target("cuda"))
    v = validate_built(built)
    assert v.ran and v.passed, v.format()
    export(built, tmp_path / "a", v)
