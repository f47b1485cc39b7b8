"""Hand-authored CUDA tensor-core schedule for the fused kernel (``workloads/fused_mma.py``):
``--schedule fused_tc``. Its SIMT (CUDA-core) sibling is ``cuda_simt`` (``workloads/fused_cuda.py``,
``fused_simt``); ``cuda_fused`` (``--schedule fused``) picks one of the two per spec and target.

As for the SIMT kernel, the thread mapping is the algorithm (which lane holds which fragment
element, where the shuffles and barriers go), so it is written into the compute and
instantiated from these knobs; ``apply`` has nothing left to vary. The design space for tuning
is one task per feasible (warps, block_n, stages, m_tiles).

Feasibility is checked against named limits before anything is built: fp16/bf16 inputs, an
sm_80+ target (``mma.sync.m16n8k16`` with bf16, ``cp.async``, ldmatrix), head_dim a multiple
of 16 (one mma k step), threads per block, the shared memory of the K/V stages (past 48 KiB
dynamic, to the arch's opt-in limit),
and an estimate of registers per thread.

Batch, seq_q and seq_kv may be symbolic (``--batch dyn`` ...): the kernel then takes its tile from
a (row tile, head, batch) grid, masks the key tail and skips causal key tiles at run time.
"""
from __future__ import annotations

import dataclasses

from tvm import s_tir
from tvm.target import Target

from ..cuda_tools import block_shared_limit
from ..spec import AttentionSpec
from ..workloads.fused_cuda import grid_refusal
from ..workloads.fused_mma import MMA_DTYPES, fused_attention_mma, smem_stride
from ..workloads.knob_attrs import CUDA_SPLIT, FUSED_MMA

from ._knobs import KnobError, KnobsMixin
from .family import (CUDA_CALL_VARIANTS, CUDA_KV_DTYPES, CUDA_VARIANTS, LATENT_ROUTE, SPLIT_LAYOUTS, USE_CPU_FUSED, Capabilities,
                     check_split_tasks, feasible, cuda_for_layout, cuda_split_tasks, never_static_decode, read_attrs)

NAME = "fused"
#: symbolic batch, seq_q and seq_kv: a (row tile, head, batch) grid on (x, y, z), as the SIMT kernel's
CAPABILITIES = Capabilities(label="CUDA tensor-core fused", target="cuda", layouts=("bhsd", "varlen", "kvcache", "paged"), dtypes=MMA_DTYPES,
                            symbolic=True, lse=True, variants=CUDA_VARIANTS + CUDA_CALL_VARIANTS,
                            kv_dtypes=CUDA_KV_DTYPES, kv_layouts=SPLIT_LAYOUTS, head_dim_v=True, appends=True,
                            instead=f"use --schedule fused_simt, or {USE_CPU_FUSED}", routes=(LATENT_ROUTE,))
WARP = 32
MAX_REGISTERS_PER_THREAD = 255
#: registers besides the fragments (addresses, loop state, m/l, temporaries). Measured with
#: nvcc 13 (sm_80/sm_90): fragments of 96 registers (D=64, block_n=64) took 127 in all;
#: 120 (D=128, block_n=32) took 129-165.
REGISTER_OVERHEAD = 40
MIN_ARCH = 80  # mma.sync m16n8k16 with bf16, cp.async and ldmatrix .trans: Ampere and later
MAX_STAGES = 4  # cp.async.wait_group takes stages − 2 ≤ 2 in the kernel's helpers


@dataclasses.dataclass(frozen=True)
class MMAKnobs(KnobsMixin):
    FAMILY = "fused (cuda tensor cores)"

    warps: int = 4  # warps per thread block; each owns 16 query rows (block_m = 16·warps)
    block_n: int = 64  # keys per K/V tile: the score tile of a warp is 16 × block_n, in registers
    stages: int = 2  # K/V tiles in flight (cp.async pipeline depth; 1 = load, wait, compute)
    m_tiles: int = 1  # 16-row groups per warp: each K/V fragment from shared memory feeds m_tiles
    #                   mma pairs (2 halves ldmatrix traffic per mma, doubles the fragments)
    #: KV-cache layouts: split each sequence's keys until the grid has this many thread blocks
    #: (0 = never): a decode step at small batch has too few (batch · KV heads) to fill the GPU
    split_tasks: int = 0

    @property
    def block_m(self) -> int:
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        return WARP * self.warps


#: Presets per head_dim, the same on sm_80 and sm_90 for now, not yet timed on a GPU. Four warps
#: and the widest key tile whose two stages of K and V fit 48 KiB of static shared memory.
#: D=64: FlashAttention-2's tile (128 query rows, 64 keys): two row groups per warp, so a K/V
#: fragment read from shared memory feeds two mma pairs (with one, ldmatrix moves a byte of
#: shared memory per 16 tensor-core FLOPs, 512 B per warp for two m16n8k16, about the balance
#: of an A100 SM: 2048 FLOPs and 128 B of shared memory per cycle); ptxas: 230-234 registers,
#: no spill. D=128: one row group (64 rows) and 32 keys, 128-164
#: registers; two row groups spill with Q kept in registers (FlashAttention-2 re-reads Q from
#: shared memory instead). Refine per arch once a GPU run has timed them.
_PRESETS = {64: dict(warps=4, block_n=64, stages=2, m_tiles=2),
            128: dict(warps=4, block_n=32, stages=2, m_tiles=1)}


def arch_number(target: Target) -> int:
    arch = str(target.attrs.get("arch", ""))
    try:
        return int(arch.split("_")[1])
    except (IndexError, ValueError):
        return 0


def supports(spec: AttentionSpec, target: Target) -> bool:
    """Whether the tensor-core kernel builds ``spec`` on ``target`` (else the SIMT kernel does)."""
    return (spec.dtype in MMA_DTYPES and arch_number(target) >= MIN_ARCH and spec.head_dim % 16 == 0
            and spec.v_dim % 16 == 0 and spec.layout in CAPABILITIES.layouts)


def shared_bytes(knobs: MMAKnobs, spec: AttentionSpec) -> int:
    """Static shared memory: ``stages`` K and V tiles (head_dim and head_dim_v columns) with
    16-byte padded rows."""
    return knobs.stages * knobs.block_n * (smem_stride(spec.head_dim) + smem_stride(spec.v_dim)) * spec.itemsize


def registers_estimate(knobs: MMAKnobs, spec: AttentionSpec) -> int:
    """Fragment registers per lane (per row group: Q D/4, scores block_n/2, P block_n/4, output
    Dv/2) plus :data:`REGISTER_OVERHEAD`."""
    d, dv, n = spec.head_dim, spec.v_dim, knobs.block_n
    return knobs.m_tiles * (d // 4 + n // 2 + n // 4 + dv // 2) + REGISTER_OVERHEAD


def preset(spec: AttentionSpec, target: Target) -> MMAKnobs:
    if spec.head_dim in _PRESETS:
        knobs = MMAKnobs(**_PRESETS[spec.head_dim])
        if spec.layout_info.is_cache and spec.seq_q * spec.group_size <= 16 * knobs.warps:
            # a decode step packs its group's heads into the tile (seq_q · group rows, 4 at GQA
            # 32:8): one row group a warp already holds them all, and a second would only add
            # fragments (ptxas: 220-234 registers at D=64, 12 % occupancy, for empty rows)
            knobs = dataclasses.replace(knobs, m_tiles=1)
        return dataclasses.replace(knobs, split_tasks=cuda_split_tasks(spec, target))
    # other head dims: the widest key tile that fits (shared memory, registers)
    for bn in (64, 32, 16):
        k = MMAKnobs(warps=4, block_n=bn, stages=2)
        if (shared_bytes(k, spec) <= int(target.attrs["max_shared_memory_per_block"])
                and registers_estimate(k, spec) <= MAX_REGISTERS_PER_THREAD):
            return dataclasses.replace(k, split_tasks=cuda_split_tasks(spec, target))
    return MMAKnobs(warps=4, block_n=16, stages=1, split_tasks=cuda_split_tasks(spec, target))


def check(knobs: MMAKnobs, spec: AttentionSpec, target: Target) -> None:
    arch = arch_number(target)
    if arch < MIN_ARCH:
        raise KnobError(
            f"the tensor-core kernel needs sm_{MIN_ARCH} or later (mma.sync m16n8k16, cp.async), "
            f"not {target.attrs.get('arch')}")
    if spec.head_dim % 16:
        raise KnobError(f"head_dim={spec.head_dim} must be a multiple of 16 (one mma k step)")
    if spec.v_dim % 16:
        raise KnobError(f"head_dim_v={spec.v_dim} must be a multiple of 16 (P·V's 8-column slices go in pairs)")
    for name in ("warps", "block_n", "stages", "m_tiles"):
        v = getattr(knobs, name)
        if v <= 0:
            raise KnobError(f"{name} must be a positive int, got {v!r}")
    if knobs.warps & (knobs.warps - 1):
        raise KnobError(f"warps={knobs.warps} must be a power of two")
    if knobs.block_n % 16:
        raise KnobError(f"block_n={knobs.block_n} must be a multiple of 16 (ldmatrix loads 16 keys at a time)")
    if knobs.m_tiles > 2:
        raise KnobError(f"m_tiles={knobs.m_tiles}: 1 or 2 row groups per warp (more cannot keep their fragments in registers)")
    if knobs.stages > MAX_STAGES:
        raise KnobError(f"stages={knobs.stages} > {MAX_STAGES} (cp.async groups in flight)")
    max_threads = int(target.attrs["max_threads_per_block"])
    if knobs.threads > max_threads:
        raise KnobError(f"32 × warps = {knobs.threads} threads > max_threads_per_block={max_threads}")
    smem = shared_bytes(knobs, spec)
    max_smem = block_shared_limit(target)
    if smem > max_smem:
        raise KnobError(
            f"shared memory {smem} B ({knobs.stages} stage(s) of {knobs.block_n}-key K and V tiles) "
            f"> {max_smem} B, the most a block may take on {target.attrs.get('arch')}")
    regs = registers_estimate(knobs, spec)
    if regs > MAX_REGISTERS_PER_THREAD:
        raise KnobError(
            f"about {regs} registers per thread (fragments of Q, scores, P and output + {REGISTER_OVERHEAD}) "
            f"> {MAX_REGISTERS_PER_THREAD}: it would spill")
    regs_per_block = int(target.attrs["registers_per_block"])
    if regs * knobs.threads > regs_per_block:
        raise KnobError(f"{regs} registers × {knobs.threads} threads > registers_per_block={regs_per_block}")
    check_split_tasks(knobs, spec)
    why = grid_refusal(spec)
    if why is not None:
        raise KnobError(why)


def workload(spec: AttentionSpec, knobs: MMAKnobs):
    return fused_attention_mma(spec, knobs.warps, knobs.block_n, knobs.stages, knobs.m_tiles,
                               split_tasks=knobs.split_tasks)


def apply(sch: s_tir.Schedule, knobs: MMAKnobs, spec: AttentionSpec) -> s_tir.Schedule:
    return sch


def design_space(spec: AttentionSpec, target: Target):
    def space_fn(sch: s_tir.Schedule) -> s_tir.Schedule:
        return sch

    return space_fn


def tile_candidates(spec: AttentionSpec, target: Target) -> list[MMAKnobs]:
    """Feasible (warps, block_n, stages, m_tiles) for tuning, the preset first."""
    hand = preset(spec, target)
    return feasible(hand, (MMAKnobs(warps=w, block_n=bn, stages=ns, m_tiles=mt, split_tasks=hand.split_tasks)
                           for mt in (1, 2) for w in (2, 4, 8) for bn in (16, 32, 64, 128) for ns in (1, 2, 3)),
                    check, spec, target)


def from_attrs(attrs, base: MMAKnobs | None = None) -> MMAKnobs:
    """The knobs a tensor-core workload's attrs record (``knob_attrs.FUSED_MMA`` and
    ``CUDA_SPLIT``: every knob; ``base`` is there for the protocol)."""
    return dataclasses.replace(base or MMAKnobs(), **read_attrs(FUSED_MMA + CUDA_SPLIT, attrs, "fused_mma"))


def workload_knobs(func) -> MMAKnobs:
    """The knobs :func:`workload` generated ``func`` with (:func:`from_attrs`)."""
    return from_attrs(func.attrs)


def knobs_of(sch: s_tir.Schedule, lanes: int = 0, base=None) -> MMAKnobs:
    return workload_knobs(sch.mod["main"])  # the schedule varies nothing: the workload is the knobs


for_layout = cuda_for_layout
is_static_decode = never_static_decode
