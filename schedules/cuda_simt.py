"""Hand-authored CUDA schedule for the SIMT (CUDA-core) fused kernel (``workloads/fused_cuda.py``):
``--schedule fused_simt``. Its tensor-core sibling is ``cuda_mma`` (``workloads/fused_mma.py``,
``fused_tc``); ``cuda_fused`` (``--schedule fused``) picks one of the two per spec and target.

On the GPU the thread mapping *is* the algorithm (which lane owns which scores and which output
columns, where the shuffles go), so it is written into the compute, instantiated from these
knobs, the way TVM's own LLM prefill kernels are; ``apply`` adds what a schedule can still vary
(unrolling of the key-tile loop). The design space for tuning is one task per feasible
(block_m, block_n, threads_per_row) and a sampled unroll depth in each.

Batch, seq_q and seq_kv may be symbolic (``--batch dyn`` ...): the kernel then takes its tile from
a (row tile, head, batch) grid and masks the key tail at run time.

Feasibility is checked against named limits before anything is built: threads per block, whole
warps, the shared memory a block may take (48 KiB static; past it dynamic, to the arch's
opt-in limit), an estimate of registers per thread, divisibility for the
16-byte vector loads.
"""
from __future__ import annotations

import dataclasses

from tvm import s_tir
from tvm.target import Target

from ..cuda_tools import block_shared_limit
from ..spec import SUPPORTED_DTYPES, AttentionSpec
from ..workloads.fused_cuda import fused_attention_cuda, grid_refusal, vector_elems
from ..workloads.knob_attrs import CUDA_SPLIT, FUSED_CUDA

from ._knobs import KnobError, KnobsMixin
from .family import (CUDA_CALL_VARIANTS, CUDA_KV_DTYPES, CUDA_VARIANTS, LATENT_ROUTE, SPLIT_LAYOUTS, Capabilities,
                     check_split_tasks, cuda_for_layout, feasible, cuda_split_tasks, never_static_decode, read_attrs)

NAME = "fused"
#: symbolic batch, seq_q and seq_kv: a (row tile, head, batch) grid on (x, y, z), so no index is
#: divided by a run-time extent (a flat grid's ``// (H·NR)`` spilled on sm_90 with seq_q symbolic)
CAPABILITIES = Capabilities(label="CUDA fused", target="cuda", layouts=("bhsd", "varlen", "kvcache", "paged"), dtypes=SUPPORTED_DTYPES,
                            symbolic=True, lse=True, variants=CUDA_VARIANTS + CUDA_CALL_VARIANTS,
                            kv_dtypes=CUDA_KV_DTYPES, kv_layouts=SPLIT_LAYOUTS, head_dim_v=True, appends=True,
                            routes=(LATENT_ROUTE,))
WARP = 32
MAX_REGISTERS_PER_THREAD = 255
#: registers a lane needs besides its scores and accumulator columns (indices, m, l, temporaries);
#: measured: ptxas reported 140 at 4 + 32 per-lane values with D=64, fp32 (so ~100 overhead).
REGISTER_OVERHEAD = 104
UNROLL_STEPS = (0, 16, 64)


@dataclasses.dataclass(frozen=True)
class FlashCUDAKnobs(KnobsMixin):
    FAMILY = "fused (cuda)"

    block_m: int = 64  # BLOCK_M: query rows per thread block (threadIdx.y)
    block_n: int = 64  # BLOCK_N: keys per K/V tile staged in shared memory
    threads_per_row: int = 4  # lanes per query row (threadIdx.x): scores and D split across them
    stages: int = 1  # K/V shared-memory pipeline depth (1: load, sync, compute)
    unroll: int = 0  # pragma_auto_unroll_max_step on the key-tile loop (0 = off)
    #: KV-cache layouts: split each sequence's keys until the grid has this many thread blocks
    #: (0 = never): a decode step at small batch has too few (batch · KV heads) to fill the GPU
    split_tasks: int = 0

    @property
    def threads(self) -> int:
        return self.block_m * self.threads_per_row


#: Presets per (dtype class, head_dim), the same on sm_80 and sm_90 for now: sized by the 48 KiB
#: static shared-memory limit and by ptxas (nvcc 13), which was seen to cap registers so that about three
#: blocks fit an SM (40 at 512 threads, 80 at 256) and spills rather than exceed that.
#: fp32 D=64: 32 rows × 8 lanes (4 scores, 8 accumulator columns per lane) take 48-58 registers
#: and no spill on either arch at every length (64 rows spilled 12-20 bytes at the 40 cap).
#: fp32 D=128: 32 rows × 8 lanes (2 scores, 16 columns) take 58-66; 4 lanes took 117 (sm_80)
#: and, non-causal on sm_90, 223 (nvcc kept a whole Q row in registers while the score loop ran
#: keys outside head_dim; the loops are now the other way round).
#: Refine per arch once a GPU run has timed them.
_PRESETS = {
    ("fp32", 64): dict(block_m=32, block_n=32, threads_per_row=8),
    ("fp32", 128): dict(block_m=32, block_n=16, threads_per_row=8),
    ("half", 64): dict(block_m=64, block_n=64, threads_per_row=4),
    ("half", 128): dict(block_m=64, block_n=32, threads_per_row=4),
}


def preset(spec: AttentionSpec, target: Target) -> FlashCUDAKnobs:
    kind = "fp32" if spec.dtype == "float32" else "half"
    d = 64 if spec.head_dim <= 64 else 128
    knobs = FlashCUDAKnobs(**_PRESETS[(kind, d)])
    if spec.layout_info.is_cache and spec.seq_q * spec.group_size <= 16:
        # a decode step packs seq_q · group rows (4 at GQA 32:8): 16 rows of 16 lanes keep 256
        # threads with fewer idle rows. ptxas (sm_90, fp32 D=128, paged, split-KV): 40 registers,
        # no spill, 75 % occupancy; 32 rows of 8 lanes took 48 and spilled 16 bytes
        knobs = dataclasses.replace(knobs, block_m=16, threads_per_row=16)
    # Odd head_dims: fewer lanes per row so that head_dim (and head_dim_v) still split evenly.
    tpr = knobs.threads_per_row
    while (spec.head_dim % tpr or spec.v_dim % tpr) and tpr > 1:
        tpr //= 2
    return dataclasses.replace(knobs, threads_per_row=tpr, block_m=max(knobs.block_m, WARP // tpr),
                               split_tasks=cuda_split_tasks(spec, target))


def shared_bytes(knobs: FlashCUDAKnobs, spec: AttentionSpec) -> int:
    """Upper bound of the static shared memory: Q, K, V tiles (padded rows; V's head_dim_v wide) +
    the P tile."""
    vec = vector_elems(spec.dtype)
    stride, v_stride = spec.head_dim + vec, spec.v_dim + vec
    itemsize = spec.itemsize
    qkv = ((knobs.block_m + knobs.block_n) * stride + knobs.block_n * v_stride) * itemsize
    return qkv + knobs.block_m * (knobs.block_n + 4) * 4


def registers_estimate(knobs: FlashCUDAKnobs, spec: AttentionSpec) -> int:
    per_lane = knobs.block_n // knobs.threads_per_row + spec.v_dim // knobs.threads_per_row  # scores, outputs
    return per_lane + REGISTER_OVERHEAD


def check(knobs: FlashCUDAKnobs, spec: AttentionSpec, target: Target) -> None:
    for name in ("block_m", "block_n", "threads_per_row", "stages"):
        v = getattr(knobs, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise KnobError(f"{name} must be a positive int, got {v!r}")
    tpr = knobs.threads_per_row
    if tpr & (tpr - 1) or tpr > WARP:
        raise KnobError(f"threads_per_row={tpr} must be a power of two <= {WARP} (a row's lanes share a warp)")
    if knobs.block_n % tpr or spec.head_dim % tpr or spec.v_dim % tpr:
        raise KnobError(
            f"block_n={knobs.block_n}, head_dim={spec.head_dim} and head_dim_v={spec.v_dim} must be multiples of "
            f"threads_per_row={tpr}"
        )
    vec = vector_elems(spec.dtype)
    if spec.head_dim % vec or spec.v_dim % vec:
        raise KnobError(f"head_dim={spec.head_dim} and head_dim_v={spec.v_dim} must be multiples of {vec} "
                        f"({spec.dtype} 16-byte vectors)")
    threads = knobs.block_m * tpr
    max_threads = int(target.attrs["max_threads_per_block"])
    if threads > max_threads:
        raise KnobError(
            f"block_m × threads_per_row = {threads} threads > max_threads_per_block={max_threads}"
        )
    if threads % WARP:
        raise KnobError(f"block_m × threads_per_row = {threads} threads is not a whole number of warps")
    smem = shared_bytes(knobs, spec)
    max_smem = block_shared_limit(target)
    if smem > max_smem:
        raise KnobError(
            f"shared memory {smem} B (Q/K/V tiles of {knobs.block_m}/{knobs.block_n}/{knobs.block_n} rows "
            f"+ P tile) > {max_smem} B, the most a block may take on {target.attrs.get('arch')}"
        )
    regs = registers_estimate(knobs, spec)
    if regs > MAX_REGISTERS_PER_THREAD:
        raise KnobError(
            f"about {regs} registers per thread (block_n/threads_per_row scores + head_dim/threads_per_row "
            f"accumulators + {REGISTER_OVERHEAD}) > {MAX_REGISTERS_PER_THREAD}: it would spill"
        )
    regs_per_block = int(target.attrs["registers_per_block"])
    if regs * threads > regs_per_block:
        raise KnobError(f"{regs} registers × {threads} threads > registers_per_block={regs_per_block}")
    if knobs.stages != 1:
        raise KnobError(f"stages={knobs.stages}: only 1 (no software pipelining of K/V) is implemented")
    if knobs.unroll not in UNROLL_STEPS:
        raise KnobError(f"unroll={knobs.unroll} not in {UNROLL_STEPS}")
    check_split_tasks(knobs, spec)
    why = grid_refusal(spec)
    if why is not None:
        raise KnobError(why)


def workload(spec: AttentionSpec, knobs: FlashCUDAKnobs):
    return fused_attention_cuda(spec, knobs.block_m, knobs.block_n, knobs.threads_per_row,
                                split_tasks=knobs.split_tasks)


def _key_tile_loop(sch: s_tir.Schedule):
    """The loop over key tiles: the serial loop just above the K/V loads' thread loops."""
    loops = sch.get_loops(sch.get_sblock("KV_load"))
    # (c, ty, tx, it, v): the grid loops are outside the row_tile block, so not among them (this
    # took loops[1], threadIdx.y, until 2026-12-02: the unroll knob never reached the key loop)
    return loops[0]


def schedule(sch: s_tir.Schedule, knobs: FlashCUDAKnobs | None) -> s_tir.Schedule:
    unroll = sch.sample_categorical(
        list(UNROLL_STEPS), [1.0 / len(UNROLL_STEPS)] * len(UNROLL_STEPS),
        decision=None if knobs is None else UNROLL_STEPS.index(knobs.unroll),
    )
    c = _key_tile_loop(sch)
    sch.annotate(c, "pragma_auto_unroll_max_step", unroll)
    sch.annotate(c, "pragma_unroll_explicit", 1)
    sch.annotate(sch.get_sblock("row_tile"), "attn.unroll", unroll)
    return sch


def apply(sch: s_tir.Schedule, knobs: FlashCUDAKnobs, spec: AttentionSpec) -> s_tir.Schedule:
    return schedule(sch, knobs)


def design_space(spec: AttentionSpec, target: Target):
    def space_fn(sch: s_tir.Schedule) -> s_tir.Schedule:
        return schedule(sch, None)

    return space_fn


def tile_candidates(spec: AttentionSpec, target: Target) -> list[FlashCUDAKnobs]:
    """Feasible (block_m, block_n, threads_per_row) for tuning, the preset first."""
    hand = preset(spec, target)
    return feasible(hand, (FlashCUDAKnobs(block_m=bm, block_n=bn, threads_per_row=tpr, split_tasks=hand.split_tasks)
                           for bm in (32, 64, 128) for bn in (16, 32, 64) for tpr in (2, 4, 8)),
                    check, spec, target)


def from_attrs(attrs, base: FlashCUDAKnobs | None = None) -> FlashCUDAKnobs:
    """The knobs a SIMT workload's attrs record (``knob_attrs.FUSED_CUDA`` and ``CUDA_SPLIT``:
    all but ``unroll`` and ``stages``), the others ``base``'s (default: the dataclass's)."""
    return dataclasses.replace(base or FlashCUDAKnobs(), **read_attrs(FUSED_CUDA + CUDA_SPLIT, attrs, "fused_cuda"))


def workload_knobs(func) -> FlashCUDAKnobs:
    """The knobs :func:`workload` generated ``func`` with (:func:`from_attrs`); ``unroll``, which
    only the schedule sets, at its default."""
    return from_attrs(func.attrs)


def knobs_of(sch: s_tir.Schedule, lanes: int = 0, base=None) -> FlashCUDAKnobs:
    unroll = int(sch.get(sch.get_sblock("row_tile")).annotations["attn.unroll"])
    return dataclasses.replace(workload_knobs(sch.mod["main"]), unroll=unroll)


for_layout = cuda_for_layout
is_static_decode = never_static_decode
