"""Hand-authored Hopper (sm_90a) schedule for the fused kernel (``workloads/fused_wgmma.py``):
``--schedule fused_hopper``. TMA into 128B-swizzled shared memory with mbarriers, ``wgmma``
products (P from registers), a producer warpgroup and one consumer warpgroup per 64 query rows,
two consumers in ping-pong.

As for the other CUDA kernels the thread mapping is the algorithm, instantiated from these knobs;
``apply`` has nothing left to vary, and the design space is one task per feasible (block_n,
stages, pingpong).

What it builds so far: the bhsd, varlen, kvcache and paged layouts, static or symbolic lengths,
float16/bfloat16, head_dim 64 or 128, causal or not, lse, the variants (window, softcap, ALiBi,
sinks, kv_start), split-KV of the KV-cache layouts (the ``mma.sync`` kernel's chunks and merge
kernel), 8-bit caches (e4m3, e5m2, int8 per KV head: landed by TMA, converted to 16 bits in
shared memory). Appending stays on the ``mma.sync`` kernel (``fused_tc``), and ``--schedule
fused`` keeps that kernel on sm_90 until a GPU run has validated this one (docs/cuda.md).
"""
from __future__ import annotations

import dataclasses
import itertools

from tvm import s_tir
from tvm.target import Target

from ..cuda_tools import block_shared_limit
from ..spec import Q_DTYPES, AttentionSpec
from ..workloads.fused_wgmma import (CONSUMER_REGS, FP8_CONSUMER_REGS, FP8_LAYOUTS, LAYOUTS, WGMMA_DTYPES,
                                     fused_attention_wgmma)
from ..workloads.knob_attrs import CUDA_SPLIT, FUSED_WGMMA
from ..workloads.wgmma_layout import WARPGROUP, WG_ROWS, SmemPlan
from ._knobs import KnobError, KnobsMixin
from .family import (CUDA_KV_DTYPES, CUDA_VARIANTS, SPLIT_LAYOUTS, Capabilities, check_split_tasks, cuda_for_layout,
                     cuda_split_tasks, feasible, never_static_decode, read_attrs)

NAME = "fused"
CAPABILITIES = Capabilities(label="CUDA Hopper (wgmma) fused", target="cuda", layouts=LAYOUTS,
                            dtypes=tuple(WGMMA_DTYPES), symbolic=True, lse=True, variants=CUDA_VARIANTS,
                            kv_dtypes=CUDA_KV_DTYPES, kv_layouts=SPLIT_LAYOUTS, q_dtypes=Q_DTYPES,
                            q_layouts=FP8_LAYOUTS, appends=True,
                            instead="use --schedule fused_tc (mma.sync) for the other layouts")
ARCH = 90  # wgmma, TMA, setmaxnreg: sm_90a (Hopper) only
HEAD_DIMS = (64, 128)  # 128-byte slabs; 256 would need 128 output registers a thread beside the scores


@dataclasses.dataclass(frozen=True)
class HopperKnobs(KnobsMixin):
    FAMILY = "fused (cuda hopper)"

    block_m: int = 128  # query rows per block: one consumer warpgroup per 64 (wgmma's m64)
    block_n: int = 128  # keys per K/V tile: wgmma's N of S = Q·Kᵀ and its k extent for P·V
    stages: int = 2  # K/V tiles in flight (TMA, one full and one empty mbarrier a stage)
    pingpong: int = 1  # two consumers take turns to issue their products (1) or issue freely (0)
    #: tile j's S = Q·Kᵀ issued with tile j − 1's P·V, the softmax under that product (1; needs
    #: 2 stages: V of tile j − 1 is read while K of tile j lands), or each tile in turn (0)
    overlap: int = 1
    #: split-KV of a KV-cache decode step (fused_cuda.Split): the grid size its chunks aim for
    #: (the target's, ``family.cuda_split_tasks``; 0: none)
    split_tasks: int = 0

    @property
    def threads(self) -> int:
        return WARPGROUP * (1 + self.block_m // WG_ROWS)


#: FlashAttention-3's forward tiles for 16-bit inputs: 128 query rows in two consumer warpgroups
#: in ping-pong, each overlapping its softmax with its next product, and 128-key tiles, two stages (D=128: 160 KiB of shared memory; D=64: 80 KiB, room for a
#: third stage the search may take). Not yet timed on a GPU.
_PRESETS = {64: {"block_m": 128, "block_n": 128, "stages": 2}, 128: {"block_m": 128, "block_n": 128, "stages": 2}}


def arch_number(target: Target) -> int:
    arch = str(target.attrs.get("arch", ""))
    try:
        return int(arch.split("_")[1].rstrip("a"))
    except (IndexError, ValueError):
        return 0


def supports(spec: AttentionSpec, target: Target) -> bool:
    """Whether this kernel builds ``spec`` on ``target``."""
    return (arch_number(target) == ARCH and spec.head_dim in HEAD_DIMS and CAPABILITIES.refusal(spec) is None)


def plan(knobs: HopperKnobs, spec: AttentionSpec) -> SmemPlan:
    f8 = spec.q_dtype is not None  # fp8 inputs: bytes, V transposed (else an 8-bit cache converted)
    return SmemPlan(spec.head_dim, knobs.block_m, knobs.block_n, knobs.stages, 1 if f8 else spec.itemsize,
                    kv8=spec.kv_dtype is not None and not f8, vt8=f8)


def shared_bytes(knobs: HopperKnobs, spec: AttentionSpec) -> int:
    """The dynamic shared memory: Q, the K and V stages, the mbarriers and 1 KiB to align."""
    return plan(knobs, spec).alloc_bytes


#: a consumer's registers besides its fragments (addresses, row state, loop, the packing of P).
#: Measured with nvcc 13 (sm_90a, setmaxnreg 240): fragments of 160 (D=128, block_n=128) and 176
#: (D=64, block_n=192) built without a spill; 196 (D=128, block_n=176) spilled 72 bytes
REGISTER_OVERHEAD = 56
#: the widest key tile of the overlapped form: nvcc 13 spilled 360-760 bytes at 176 and 192 keys
#: (D=64, one or two consumers), none at 128
OVERLAP_MAX_BLOCK_N = 128


def registers_estimate(knobs: HopperKnobs, spec: AttentionSpec) -> int:
    """A consumer thread's fragments: scores block_n/2, P block_n/4 (16-bit pairs; fp8 inputs:
    block_n/8, e4m3 quads), output head_dim/2, plus :data:`REGISTER_OVERHEAD`."""
    p = knobs.block_n // (8 if spec.q_dtype else 4)
    return knobs.block_n // 2 + p + spec.head_dim // 2 + REGISTER_OVERHEAD


#: a KV-cache step whose rows (seq_q · group) fit one warpgroup: one consumer (the second's 64
#: rows would be empty) without ping-pong, and a stage more in flight for the memory-bound read
#: (D=128: 3 stages are 208 KiB of shared memory; D=64: 4 are 136 KiB). Not yet timed on a GPU.
_DECODE = {64: {"block_m": 64, "block_n": 128, "stages": 4, "pingpong": 0},
           128: {"block_m": 64, "block_n": 128, "stages": 3, "pingpong": 0}}
#: an 8-bit cache (any step): one consumer (the producer warpgroup converts each landed tile to 16
#: bits, with the registers a second consumer would need), each stage with its 8-bit staging
#: (D=128: 2 stages are 209 KiB; D=64: 4 are 201 KiB)
_KV8 = {64: {"block_m": 64, "block_n": 128, "stages": 4, "pingpong": 0},
        128: {"block_m": 64, "block_n": 128, "stages": 2, "pingpong": 0}}
#: fp8 inputs (head_dim 128: a row of 128 bytes is one slab; 64: rows of 64 bytes, the 64B swizzle):
#: the 16-bit tiles, each stage with its V staging and V^T (D=128: 113 KiB at 2 stages; D=64: 57
#: KiB); the producer warpgroup transposes V with 56 registers beside the two consumers' 224. Not
#: yet timed on a GPU.
_FP8 = {64: {"block_m": 128, "block_n": 128, "stages": 2}, 128: {"block_m": 128, "block_n": 128, "stages": 2}}


def preset(spec: AttentionSpec, target: Target) -> HopperKnobs:
    table = _FP8 if spec.q_dtype else _KV8 if spec.kv_dtype else \
        _DECODE if spec.layout_info.is_cache and spec.seq_q * spec.group_size <= WG_ROWS else _PRESETS
    return HopperKnobs(**table.get(spec.head_dim, table[128]), split_tasks=cuda_split_tasks(spec, target))


def check(knobs: HopperKnobs, spec: AttentionSpec, target: Target) -> None:
    if arch_number(target) != ARCH:
        raise KnobError(f"the Hopper kernel needs sm_90 (wgmma, TMA, setmaxnreg: sm_90a), not {target.attrs.get('arch')}")
    if spec.layout_info.is_cache and WG_ROWS % spec.group_size:
        raise KnobError(f"group size {spec.group_size} (heads / kv_heads): a KV-cache tile packs a KV head's query "
                        f"heads into a warpgroup's {WG_ROWS} rows, so it must divide {WG_ROWS}")
    if spec.layout == "paged" and (spec.page_size % 8 or (spec.page_size % knobs.block_n
                                                          and knobs.block_n % spec.page_size)):
        raise KnobError(f"page_size={spec.page_size} with block_n={knobs.block_n}: TMA loads a page (or a key tile's "
                        "share of one) as whole 8-row swizzle groups, so pages must be a multiple of 8 that tiles "
                        "block_n or is tiled by it")
    if spec.head_dim not in HEAD_DIMS:
        raise KnobError(f"head_dim={spec.head_dim}: the Hopper kernel builds head_dim "
                        f"{' or '.join(map(str, HEAD_DIMS))} (128-byte swizzled slabs of 64)")
    if spec.q_dtype and (spec.head_dim not in _FP8 or knobs.block_n != 128):
        raise KnobError(f"fp8 inputs (q_dtype) take head_dim {' or '.join(map(str, _FP8))} and block_n=128 (the "
                        f"swizzle's rows; V^T's rows are a tile's 128 keys), got head_dim={spec.head_dim}, "
                        f"block_n={knobs.block_n}")
    for name in ("block_m", "block_n", "stages"):
        v = getattr(knobs, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise KnobError(f"{name} must be a positive int, got {v!r}")
    check_split_tasks(knobs, spec)
    for name in ("pingpong", "overlap"):
        if getattr(knobs, name) not in (0, 1):
            raise KnobError(f"{name} must be 0 or 1, got {getattr(knobs, name)!r}")
    if knobs.overlap and knobs.stages < 2:
        raise KnobError("overlap needs stages >= 2 (tile j − 1's V is read while tile j's K lands)")
    if knobs.overlap and knobs.block_n > OVERLAP_MAX_BLOCK_N:
        raise KnobError(f"overlap with block_n={knobs.block_n} > {OVERLAP_MAX_BLOCK_N}: tile j's scores and tile "
                        f"j − 1's P do not fit the consumers' registers beside the output (it spilled)")
    if knobs.block_m not in (64, 128):
        raise KnobError(f"block_m={knobs.block_m}: one or two consumer warpgroups of 64 rows (64 or 128)")
    if knobs.pingpong and knobs.block_m != 128:
        raise KnobError("pingpong takes two consumer warpgroups (block_m=128)")
    if spec.kv_dtype and not spec.q_dtype and knobs.block_m != WG_ROWS:
        raise KnobError(f"an 8-bit cache ({spec.kv_dtype}) takes block_m={WG_ROWS}: the producer warpgroup converts "
                        "its tiles with the registers a second consumer warpgroup would take")
    if knobs.block_n % 16 or not 16 <= knobs.block_n <= 256:
        raise KnobError(f"block_n={knobs.block_n} must be a multiple of 16 in [16, 256] (wgmma m64nNk16)")
    smem = shared_bytes(knobs, spec)
    limit = block_shared_limit(target)
    if smem > limit:
        raise KnobError(f"shared memory {smem} B (Q, {knobs.stages} stage(s) of {knobs.block_n}-key K and V tiles) "
                        f"> {limit} B, the most a block may take on {target.attrs.get('arch')}")
    regs, most = registers_estimate(knobs, spec), FP8_CONSUMER_REGS if spec.q_dtype else CONSUMER_REGS
    if regs > most:
        raise KnobError(f"about {regs} registers per consumer thread > the {most} setmaxnreg gives it")


def workload(spec: AttentionSpec, knobs: HopperKnobs):
    return fused_attention_wgmma(spec, knobs.block_m, knobs.block_n, knobs.stages, bool(knobs.pingpong),
                                 bool(knobs.overlap), knobs.split_tasks)


def apply(sch: s_tir.Schedule, knobs: HopperKnobs, spec: AttentionSpec) -> s_tir.Schedule:
    return sch


def design_space(spec: AttentionSpec, target: Target):
    def space_fn(sch: s_tir.Schedule) -> s_tir.Schedule:
        return sch

    return space_fn


def tile_candidates(spec: AttentionSpec, target: Target) -> list[HopperKnobs]:
    """Feasible (block_m, block_n, stages, pingpong, overlap) for tuning, the preset first."""
    return feasible(preset(spec, target),
                    (HopperKnobs(block_m=bm, block_n=bn, stages=ns, pingpong=pp, overlap=ov,
                                 split_tasks=preset(spec, target).split_tasks)
                     for bm, pp in ((128, 1), (128, 0), (64, 0))
                     for bn, ns, ov in itertools.product((64, 128, 176, 192), (2, 3, 4), (1, 0))),
                    check, spec, target)


def from_attrs(attrs, base: HopperKnobs | None = None) -> HopperKnobs:
    return dataclasses.replace(base or HopperKnobs(), **read_attrs(FUSED_WGMMA + CUDA_SPLIT, attrs, "fused_wgmma"))


def workload_knobs(func) -> HopperKnobs:
    return from_attrs(func.attrs)


def knobs_of(sch: s_tir.Schedule, lanes: int = 0, base=None) -> HopperKnobs:
    return workload_knobs(sch.mod["main"])


def for_layout(knobs: HopperKnobs, spec: AttentionSpec, target: Target, tuned_at: AttentionSpec | None = None):
    """Knobs tuned at ``tuned_at`` made fit to build ``spec``: its split-KV grid
    (``family.cuda_for_layout``); an 8-bit cache, tuned at its 16-bit bhsd representative, takes
    one consumer and room for its staging tiles: the tuned tile where it fits so, else the preset."""
    knobs = cuda_for_layout(knobs, spec, target, tuned_at)
    if spec.q_dtype:  # fp8 inputs: the tuned tile where it builds them, else the preset
        try:
            check(knobs, spec, target)
        except KnobError:
            return preset(spec, target)
    elif spec.kv_dtype:
        knobs = dataclasses.replace(knobs, block_m=WG_ROWS, pingpong=0)
        try:
            check(knobs, spec, target)
        except KnobError:
            return preset(spec, target)
    return knobs


is_static_decode = never_static_decode
