"""Hand-authored CPU (LLVM) schedule for the materialized baseline.

A fair baseline gets a real schedule, not naive loops: both GEMMs are register-blocked and
vectorized like the fused kernel's, and every softmax stage is vectorized along the key axis.
What it cannot avoid is its definition: S and P are seq_q × seq_kv buffers in global memory.

1. ``S_gemm``: K of one (batch, head) is copied once into a transposed ``(D, Skv)`` buffer
   (``K_t``), so the key axis is contiguous; then ``for row block: for key vector block: for d:
   for gemm_rows rows (unrolled): for keys (vector)``.
2. ``row_max``, ``row_sum``: the key axis is split into vectors and ``rfactor``-ed, so partial
   max/sum are vectors; ``softmax`` is element-wise and vectorized along keys.
3. ``PV_gemm``: ``for row block: for key: for gemm_rows rows (unrolled): for d (vector)``.
Each stage is parallel over (batch, head, rows).
"""
from __future__ import annotations

import dataclasses

from tvm import s_tir
from tvm.target import Target

from ..spec import MAX_ELEMENTS, AttentionSpec
from ..target import vector_lanes
from ..workloads import materialized_attention

from . import cpu_fused
from ._knobs import KnobError, KnobsMixin
from .family import Capabilities, never_static_decode, no_knobs_of, read_attrs, same_knobs

NAME = "materialized"
CAPABILITIES = Capabilities(label=NAME, target="cpu", layouts=("bhsd",), dtypes=("float32",), symbolic=True,
                            lse=False)


@dataclasses.dataclass(frozen=True)
class MaterializedCPUKnobs(KnobsMixin):
    FAMILY = NAME

    gemm_rows: int = 4  # query rows per register block of both GEMMs (unrolled)
    key_vectors: int = 2  # S_gemm: key vectors per register block (gemm_rows × key_vectors accumulators)
    vector_lanes: int = 16  # float32 SIMD lanes: 16 = AVX-512, 8 = AVX2



def preset(spec: AttentionSpec, target: Target) -> MaterializedCPUKnobs:
    lanes = vector_lanes(target, spec.dtype)
    d_vectors = -(-spec.head_dim // lanes)
    rows = 4 if d_vectors <= 4 else 2
    return MaterializedCPUKnobs(gemm_rows=rows, key_vectors=2, vector_lanes=lanes)


def check(knobs: MaterializedCPUKnobs, spec: AttentionSpec, target: Target) -> None:
    for name in ("gemm_rows", "key_vectors", "vector_lanes"):
        v = getattr(knobs, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise KnobError(f"{name} must be a positive int, got {v!r}")
    target_lanes = vector_lanes(target, spec.dtype)
    if knobs.vector_lanes > target_lanes or target_lanes % knobs.vector_lanes:
        raise KnobError(
            f"vector_lanes={knobs.vector_lanes} does not fit the target's {target_lanes}-lane vectors"
        )
    check_score_matrix(spec)


def check_score_matrix(spec: AttentionSpec) -> None:
    """The materialized S and P hold batch·heads·seq_q·seq_kv elements, indexed with int32."""
    n = spec.batch * spec.heads * spec.seq_q * spec.seq_kv
    if n > MAX_ELEMENTS:
        raise KnobError(
            f"the materialized score matrix has batch·heads·seq_q·seq_kv = {n} elements; kernels "
            f"index with 32-bit ints (at most {MAX_ELEMENTS}): use the fused schedule"
        )


def workload(spec: AttentionSpec, knobs: MaterializedCPUKnobs):
    return materialized_attention(spec)


def from_attrs(attrs, base: MaterializedCPUKnobs | None = None) -> MaterializedCPUKnobs:
    """``base`` (default: the dataclass's): no knob shapes the materialized workload."""
    read_attrs((), attrs, "materialized")
    return base or MaterializedCPUKnobs()


def _split_exact(sch: s_tir.Schedule, loop, extent: int, factor: int):
    """Split by ``factor`` when it divides ``extent`` (no tail predicate); else leave whole."""
    if extent % factor == 0 and extent > factor:
        return sch.split(loop, [None, factor])
    return None


def apply(sch: s_tir.Schedule, knobs: MaterializedCPUKnobs, spec: AttentionSpec) -> s_tir.Schedule:
    lanes = knobs.vector_lanes
    # Splits below are exact (no tail predicate), so only at known lengths: a symbolic length
    # counts as 1 here, which leaves its loops whole (correct at every length, just slower).
    SQ = 1 if "seq_q" in spec.dynamic else spec.seq_q
    SK = 1 if "seq_kv" in spec.dynamic else spec.seq_kv

    # Step 1. S_gemm with a transposed copy of K per (batch, head).
    s_gemm = sch.get_sblock("S_gemm")
    b, h, i, j, d = sch.get_loops(s_gemm)
    k_t = sch.cache_read(s_gemm, 1, "global")
    sch.compute_at(k_t, h)
    sch.transform_layout(k_t, ("write", 0), lambda kb, kh, kj, kd: (kb, kh, kd, kj))
    kb, kh = sch.get_loops(k_t)[:2]
    _, _, i, j, d = sch.get_loops(s_gemm)
    key_block = lanes * knobs.key_vectors
    rows = _split_exact(sch, i, SQ, knobs.gemm_rows)
    cols = _split_exact(sch, j, SK, key_block)
    if rows and cols:
        io, ii = rows
        jo, ji = cols
        jv, jl = sch.split(ji, [None, lanes])
        sch.reorder(io, jo, d, ii, jv, jl)
        sch.unroll(ii)
        sch.unroll(jv)
        sch.vectorize(jl)
    sch.parallel(sch.fuse(b, h))
    if rows and cols:
        sch.decompose_reduction(s_gemm, d)

    # Step 2. Softmax stages, vectorized along keys.
    for name in ("row_max", "row_sum"):
        blk = sch.get_sblock(name)
        b, h, i, j = sch.get_loops(blk)
        sch.parallel(sch.fuse(b, h, i))
        if SK % lanes == 0 and SK > lanes:
            jo, ji = sch.split(j, [None, lanes])
            rf = sch.rfactor(ji, 0)
            sch.vectorize(sch.get_loops(rf)[-1])
    blk = sch.get_sblock("softmax")
    b, h, i, j = sch.get_loops(blk)
    sch.parallel(sch.fuse(b, h, i))
    if SK % lanes == 0:
        jo, ji = sch.split(j, [None, lanes])
        sch.vectorize(ji)

    # Step 3. PV_gemm: rows (unrolled) × head_dim vectors, keys outside.
    pv = sch.get_sblock("PV_gemm")
    b, h, i, d, j = sch.get_loops(pv)
    rows = _split_exact(sch, i, SQ, knobs.gemm_rows)
    if rows:
        io, ii = rows
        sch.reorder(io, j, ii, d)
        sch.unroll(ii)
        sch.vectorize(d)
        sch.parallel(sch.fuse(b, h, io))
    else:
        sch.reorder(i, j, d)
        sch.vectorize(d)
        sch.parallel(sch.fuse(b, h, i))
    sch.decompose_reduction(pv, j)
    return sch


# MetaSchedule's default space tunes it: no knobs to read back from a trace
knobs_of = no_knobs_of
for_layout = same_knobs
is_static_decode = never_static_decode
