"""Hand-authored CUDA schedule for MLA's latent layouts (``mla``, ``mla_paged``) on tensor cores
(``workloads/fused_mla.py``): ``--schedule fused_mla``, and what ``--schedule fused`` builds for a
latent layout on CUDA.

FlashMLA's work split on ``mma.sync``: the heads are the rows of the tile (each latent row read
once for ``16·row_groups`` of them, as K and as V), ``col_groups`` warps per 16 rows share each
key tile's scores (a key slice each) and its output columns (a column slice each). As for the
other CUDA kernels, the thread mapping is written into the compute and instantiated from these
knobs; ``apply`` varies nothing, and tuning is one task per feasible knob set.

Feasibility is checked against named limits before anything is built: fp16/bf16 inputs, an sm_80+
target (``mma.sync.m16n8k16``, ``cp.async``, ldmatrix), the slices whole ldmatrix tiles, the
shared memory of the Q tile, the key stages and the P tile (to the arch's opt-in limit), and an
estimate of registers per thread.
"""
from __future__ import annotations

import dataclasses

from tvm import s_tir
from tvm.target import Target

from ..cuda_tools import block_shared_limit, split_tasks_for
from ..spec import AttentionSpec
from ..workloads.fused_cuda import grid_refusal
from ..workloads.fused_mla import fused_attention_mla, mla_shared_bytes
from ..workloads.fused_mma import MMA_DTYPES
from ..workloads.knob_attrs import CUDA_SPLIT, FUSED_MLA

from ._knobs import KnobError, KnobsMixin
from .cuda_mma import MAX_REGISTERS_PER_THREAD, MAX_STAGES, MIN_ARCH, arch_number
from .family import (CUDA_CALL_VARIANTS, CUDA_KV_DTYPES, CUDA_VARIANTS, MAX_SPLIT_TASKS, USE_CPU_FUSED, Capabilities,
                     feasible, never_static_decode, read_attrs)

NAME = "fused"
LATENT_LAYOUTS = ("mla", "mla_paged")
CAPABILITIES = Capabilities(label="CUDA tensor-core MLA", target="cuda", layouts=LATENT_LAYOUTS,
                            dtypes=tuple(MMA_DTYPES), symbolic=True, lse=True, variants=CUDA_VARIANTS + CUDA_CALL_VARIANTS,
                            kv_dtypes=CUDA_KV_DTYPES, head_dim_v=True, appends=True, instead=USE_CPU_FUSED)
WARP = 32
#: registers besides the score and output fragments (the four 8-half fragments of Q, K, V and P:
#: 16; addresses, loop state, m/l, temporaries). Measured (nvcc 13, ptxas at register usage level
#: 10): 576/512 at 2 column groups, 32-key tiles (fragments of 8 + 128) took 241-247 on sm_80/sm_90
REGISTER_OVERHEAD = 110


@dataclasses.dataclass(frozen=True)
class MLAKnobs(KnobsMixin):
    FAMILY = "fused (cuda tensor cores, MLA)"

    row_groups: int = 4  # 16-row groups per block (block_m = 16·row_groups packed heads)
    col_groups: int = 2  # warps per row group: each a key slice of the scores and a column slice of O
    block_n: int = 32  # latent rows per key tile
    stages: int = 2  # key tiles in flight (cp.async pipeline depth)
    #: split each sequence's keys until the grid has this many thread blocks (0 = never)
    split_tasks: int = 0

    @property
    def block_m(self) -> int:
        return 16 * self.row_groups

    @property
    def warps(self) -> int:
        return self.row_groups * self.col_groups

    @property
    def threads(self) -> int:
        return WARP * self.warps


def shared_bytes(knobs: MLAKnobs, spec: AttentionSpec) -> int:
    return mla_shared_bytes(spec, knobs.row_groups, knobs.col_groups, knobs.block_n, knobs.stages)


def registers_estimate(knobs: MLAKnobs, spec: AttentionSpec) -> int:
    """Fragment registers per lane: the slice's scores (``block_n / col_groups / 2``) and the
    warp's output columns (``head_dim_v / col_groups / 2``), plus :data:`REGISTER_OVERHEAD`."""
    return knobs.block_n // knobs.col_groups // 2 + spec.v_dim // knobs.col_groups // 2 + REGISTER_OVERHEAD


def _fits(knobs: MLAKnobs, spec: AttentionSpec, target: Target) -> bool:
    try:
        check(knobs, spec, target)
    except KnobError:
        return False
    return True


#: the presets, first that fits: DeepSeek-V3's 576/512 at 4 row groups (64 heads a block, a decode
#: step's 128 heads in two blocks as FlashMLA's 64-row tiles) and 2 column groups (8 warps; 128
#: output registers a lane at Dv=512), 32 latent rows a tile in 2 stages: 151 KiB of shared memory
#: with the Q tile (74 KiB), inside an A100's 163 KiB (64-row tiles in 2 stages: 227 KiB, past an
#: H100's). Fewer rows where the heads are few (a tile of 16 heads for 16). Not yet timed on a GPU.
_PRESET_ORDER = (dict(row_groups=4, col_groups=2, block_n=32, stages=2),
                 dict(row_groups=4, col_groups=4, block_n=64, stages=1),
                 dict(row_groups=2, col_groups=2, block_n=32, stages=2),
                 dict(row_groups=1, col_groups=2, block_n=32, stages=2),
                 dict(row_groups=1, col_groups=1, block_n=16, stages=1))


def preset(spec: AttentionSpec, target: Target) -> MLAKnobs:
    split = split_tasks_for(target)
    rows = spec.seq_q * spec.group_size if not spec.dynamic else spec.group_size
    for k in _PRESET_ORDER:
        knobs = MLAKnobs(**k, split_tasks=split)
        if 16 * k["row_groups"] // 2 >= rows and k["row_groups"] > 1:
            continue  # half the tile would be empty rows: a smaller one first
        if _fits(knobs, spec, target):
            return knobs
    return MLAKnobs(**_PRESET_ORDER[-1], split_tasks=split)


def check(knobs: MLAKnobs, spec: AttentionSpec, target: Target) -> None:
    CAPABILITIES.require(spec)  # also through ``--schedule fused``, whose table is the union
    arch = arch_number(target)
    if arch < MIN_ARCH:
        raise KnobError(f"the MLA tensor-core kernel needs sm_{MIN_ARCH} or later (mma.sync m16n8k16, cp.async), "
                        f"not {target.attrs.get('arch')}")
    for name in ("row_groups", "col_groups", "block_n", "stages"):
        v = getattr(knobs, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise KnobError(f"{name} must be a positive int, got {v!r}")
    if spec.head_dim % 16:
        raise KnobError(f"head_dim={spec.head_dim} must be a multiple of 16 (one mma k step)")
    if knobs.block_n % (16 * knobs.col_groups):
        raise KnobError(f"block_n={knobs.block_n} must be a multiple of 16 · col_groups={16 * knobs.col_groups} "
                        "(each warp's key slice is whole 16-key ldmatrix tiles)")
    if spec.v_dim % (16 * knobs.col_groups):
        raise KnobError(f"head_dim_v={spec.v_dim} must be a multiple of 16 · col_groups={16 * knobs.col_groups} "
                        "(each warp's output columns are whole 16-column ldmatrix tiles)")
    if knobs.stages > MAX_STAGES:
        raise KnobError(f"stages={knobs.stages} > {MAX_STAGES} (cp.async groups in flight)")
    max_threads = int(target.attrs["max_threads_per_block"])
    if knobs.threads > max_threads:
        raise KnobError(f"32 × row_groups × col_groups = {knobs.threads} threads > "
                        f"max_threads_per_block={max_threads}")
    smem, max_smem = shared_bytes(knobs, spec), block_shared_limit(target)
    if smem > max_smem:
        raise KnobError(f"shared memory {smem} B (the Q tile, {knobs.stages} stage(s) of {knobs.block_n} latent rows, "
                        f"the P tile) > {max_smem} B, the most a block may take on {target.attrs.get('arch')}")
    regs = registers_estimate(knobs, spec)
    if regs > MAX_REGISTERS_PER_THREAD:
        raise KnobError(f"about {regs} registers per thread (the slice's scores and output columns + "
                        f"{REGISTER_OVERHEAD}) > {MAX_REGISTERS_PER_THREAD}: it would spill (more col_groups)")
    regs_per_block = int(target.attrs["registers_per_block"])
    if regs * knobs.threads > regs_per_block:
        raise KnobError(f"{regs} registers × {knobs.threads} threads > registers_per_block={regs_per_block}")
    v = knobs.split_tasks
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_SPLIT_TASKS:
        raise KnobError(f"split_tasks must be an int in [0, {MAX_SPLIT_TASKS}] (0: no split-KV), got {v!r}")
    why = grid_refusal(spec)
    if why is not None:
        raise KnobError(why)


def workload(spec: AttentionSpec, knobs: MLAKnobs):
    return fused_attention_mla(spec, knobs.row_groups, knobs.col_groups, knobs.block_n, knobs.stages,
                               split_tasks=knobs.split_tasks)


def apply(sch: s_tir.Schedule, knobs: MLAKnobs, spec: AttentionSpec) -> s_tir.Schedule:
    return sch


def design_space(spec: AttentionSpec, target: Target):
    def space_fn(sch: s_tir.Schedule) -> s_tir.Schedule:
        return sch

    return space_fn


def tile_candidates(spec: AttentionSpec, target: Target) -> list[MLAKnobs]:
    """Feasible (row_groups, col_groups, block_n, stages) for tuning, the preset first."""
    hand = preset(spec, target)
    return feasible(hand, (MLAKnobs(row_groups=r, col_groups=c, block_n=bn, stages=ns, split_tasks=hand.split_tasks)
                           for r in (1, 2, 4, 8) for c in (1, 2, 4) for bn in (16, 32, 64) for ns in (1, 2, 3)),
                    check, spec, target)


def from_attrs(attrs, base: MLAKnobs | None = None) -> MLAKnobs:
    """The knobs an MLA workload's attrs record (``knob_attrs.FUSED_MLA`` and ``CUDA_SPLIT``)."""
    return dataclasses.replace(base or MLAKnobs(), **read_attrs(FUSED_MLA + CUDA_SPLIT, attrs, "fused_mla"))


def workload_knobs(func) -> MLAKnobs:
    return from_attrs(func.attrs)


def knobs_of(sch: s_tir.Schedule, lanes: int = 0, base=None) -> MLAKnobs:
    return workload_knobs(sch.mod["main"])  # the schedule varies nothing: the workload is the knobs


def for_layout(knobs: MLAKnobs, spec: AttentionSpec, target: Target, tuned_at: AttentionSpec | None = None) -> MLAKnobs:
    """A record's knobs as they are (the latent layouts are tuned as themselves)."""
    return knobs


is_static_decode = never_static_decode
