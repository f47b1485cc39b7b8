"""Hand-authored CPU (LLVM) schedule for the fused flash-attention PrimFunc.

Step 0 picks the tile sizes (they shape the PrimFunc itself: the online softmax is written per
tile). The schedule then, finding blocks by name:

1. parallelizes over the fused (batch, head, row tile) loop;
2. register-blocks ``S_gemm`` as ``for key block: for d: for s_rows keys (unrolled): for query
   rows (vector)`` — one K element broadcast against ``block_m`` query rows, ``s_rows ×
   block_m / lanes`` accumulators held in vector registers across the ``d`` loop;
3. register-blocks ``PV_gemm`` as ``for row block: for key: for pv_rows rows (unrolled): for d
   (vector)`` — one V row reused by ``pv_rows`` query rows;
4. vectorizes every softmax stage across query rows (the score tile is key-major, so row max and
   row sum are element-wise vector ops);
5. hoists reduction inits (``acc·alpha``, ``l·alpha``, ``m_new = m``) out of their loops.

Knobs are a frozen dataclass; ``check`` rejects infeasible sets against named hardware limits
before anything is built. ``preset`` gives the per-target default.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from tvm import s_tir
from tvm.target import Target

from tvm_attention.spec import AttentionSpec
from tvm_attention.target import vector_lanes
from tvm_attention.workloads import fused_attention

NAME = "fused"


class KnobError(ValueError):
    """An infeasible knob set; the message names the knob and the limit it breaks."""


@dataclasses.dataclass(frozen=True)
class FlashCPUKnobs:
    block_m: int = 32  # BLOCK_M: query rows per row tile (row_tile); a multiple of vector_lanes
    block_n: int = 64  # BLOCK_N: keys per key tile (kv_tile)
    s_rows: int = 6  # keys per register block of S_gemm, unrolled (accumulators: s_rows·block_m/lanes)
    pv_rows: int = 4  # query rows per register block of PV_gemm, unrolled (pv_rows·head_dim/lanes)
    vector_lanes: int = 16  # float32 SIMD lanes: 16 = AVX-512, 8 = AVX2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FlashCPUKnobs":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise KnobError(f"unknown knob(s) for {NAME}: {', '.join(sorted(unknown))}")
        return cls(**d)


# -- hardware limits the feasibility check names -------------------------------------------------
VECTOR_REGISTERS = {16: 32, 8: 16, 4: 16}  # lanes -> architectural vector registers (zmm/ymm/xmm)
MAX_TILE_BYTES = 512 * 1024  # a tile's local buffers must fit well inside a 1 MiB L2


def preset(spec: AttentionSpec, target: Target) -> FlashCPUKnobs:
    """Per-target default knobs.

    Why these values (measured on a 2-core znver4, B1 H8 S1024 D64): block_m=32 gives two
    zmm vectors of query rows per key, so 6 keys make 12 accumulators + 2 q vectors; 64-key
    tiles keep S and P (8 KiB each) in L1 with the q tile; larger key tiles lost L1 residency
    and smaller ones paid the per-tile softmax overhead more often. pv_rows is the largest row
    block whose accumulators (pv_rows·D/lanes) leave room for the V row: 4 at D=64, 2 at D=128.
    """
    lanes = vector_lanes(target, spec.dtype)
    regs = VECTOR_REGISTERS.get(lanes, 16)
    block_m = 2 * lanes
    d_vectors = math.ceil(spec.head_dim / lanes)
    pv_rows = max(1, min(4, (regs - 4) // d_vectors))
    while block_m % pv_rows:
        pv_rows -= 1
    s_rows = max(1, min(6, (regs - 4) // (block_m // lanes) - 1))
    block_n = 64
    while block_n % s_rows:
        s_rows -= 1
    return FlashCPUKnobs(block_m=block_m, block_n=block_n, s_rows=s_rows, pv_rows=pv_rows, vector_lanes=lanes)


def check(knobs: FlashCPUKnobs, spec: AttentionSpec, target: Target) -> None:
    """Raise :class:`KnobError` if ``knobs`` cannot be built well for ``spec`` on ``target``."""
    lanes = knobs.vector_lanes
    for name in ("block_m", "block_n", "s_rows", "pv_rows", "vector_lanes"):
        v = getattr(knobs, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise KnobError(f"{name} must be a positive int, got {v!r}")
    target_lanes = vector_lanes(target, spec.dtype)
    if lanes > target_lanes or target_lanes % lanes:
        raise KnobError(
            f"vector_lanes={lanes} does not fit the target's {target_lanes}-lane {spec.dtype} vectors"
        )
    if knobs.block_m % lanes:
        raise KnobError(f"block_m={knobs.block_m} must be a multiple of vector_lanes={lanes}")
    if knobs.block_n % knobs.s_rows:
        raise KnobError(f"block_n={knobs.block_n} must be a multiple of s_rows={knobs.s_rows}")
    if knobs.block_m % knobs.pv_rows:
        raise KnobError(f"block_m={knobs.block_m} must be a multiple of pv_rows={knobs.pv_rows}")
    regs = VECTOR_REGISTERS.get(target_lanes, 16)
    q_vectors = knobs.block_m // lanes
    s_live = knobs.s_rows * q_vectors + q_vectors + 1
    if s_live > regs:
        raise KnobError(
            f"S_gemm register block needs {s_live} vector registers (s_rows={knobs.s_rows} × "
            f"{q_vectors} accumulators + {q_vectors} q vectors + 1 broadcast) > {regs} available"
        )
    d_vectors = math.ceil(spec.head_dim / lanes)
    pv_live = knobs.pv_rows * d_vectors + 2
    if pv_live > regs:
        raise KnobError(
            f"PV_gemm register block needs {pv_live} vector registers (pv_rows={knobs.pv_rows} × "
            f"{d_vectors} accumulators + V + broadcast) > {regs} available"
        )
    tile_bytes = 4 * (2 * spec.head_dim * knobs.block_m + 2 * knobs.block_n * knobs.block_m)
    if tile_bytes > MAX_TILE_BYTES:
        raise KnobError(
            f"tile working set {tile_bytes} B (block_m={knobs.block_m}, block_n={knobs.block_n}, "
            f"head_dim={spec.head_dim}) exceeds MAX_TILE_BYTES={MAX_TILE_BYTES}"
        )


def workload(spec: AttentionSpec, knobs: FlashCPUKnobs):
    """The PrimFunc these knobs schedule (tile sizes are part of the compute)."""
    return fused_attention(spec, knobs.block_m, knobs.block_n)


def _vectorize_rows(sch: s_tir.Schedule, loop, lanes: int) -> None:
    """Split ``loop`` into lanes-wide vectors, unroll the vector count, vectorize the lanes."""
    outer, inner = sch.split(loop, [None, lanes])
    sch.unroll(outer)
    sch.vectorize(inner)


def apply(sch: s_tir.Schedule, knobs: FlashCPUKnobs, spec: AttentionSpec | None = None) -> s_tir.Schedule:
    """Schedule the fused PrimFunc in ``sch`` (built by :func:`workload` with the same knobs)."""
    lanes = knobs.vector_lanes
    # Step 1. One parallel task per (batch, head, row tile).
    b, h, r = sch.get_loops(sch.get_sblock("row_tile"))
    sch.parallel(sch.fuse(b, h, r))

    # Step 2. S_gemm register block: keys (unrolled) × query-row vectors, d innermost-but-two.
    s_gemm = sch.get_sblock("S_gemm")
    *_, j, d, i = sch.get_loops(s_gemm)
    jo, ji = sch.split(j, [None, knobs.s_rows])
    io, ii = sch.split(i, [None, lanes])
    sch.reorder(jo, d, ji, io, ii)
    sch.unroll(ji)
    sch.unroll(io)
    sch.vectorize(ii)

    # Step 3. PV_gemm register block: query rows (unrolled) × head_dim vectors, keys outside.
    pv = sch.get_sblock("PV_gemm")
    *_, i, j, d = sch.get_loops(pv)
    io, ii = sch.split(i, [None, knobs.pv_rows])
    sch.reorder(io, j, ii, d)
    sch.unroll(ii)
    sch.vectorize(d)

    # Step 4. Softmax stages and loads/stores: vector across query rows (or head_dim).
    for name in ("row_max", "P_exp", "row_sum", "Q_load"):
        _vectorize_rows(sch, sch.get_loops(sch.get_sblock(name))[-1], lanes)
    for name in ("state_init", "online_correction", "max_commit"):
        _vectorize_rows(sch, sch.get_loops(sch.get_sblock(name))[-1], lanes)
    for name in ("acc_init", "O_store"):
        sch.vectorize(sch.get_loops(sch.get_sblock(name))[-1])

    # Step 5. Hoist reduction inits out of the loops that carry them.
    sch.decompose_reduction(s_gemm, sch.get_loops(s_gemm)[-4])  # (…, jo, d, ji, io, ii): at d
    sch.decompose_reduction(pv, sch.get_loops(pv)[-3])  # before the key loop
    for name in ("row_max", "row_sum"):
        blk = sch.get_sblock(name)
        sch.decompose_reduction(blk, sch.get_loops(blk)[-3])  # before the key loop
    return sch

