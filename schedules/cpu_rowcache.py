"""CPU schedule for the row-cached two-pass family (``workloads/rowcache.py``).

The same register blocking and vectorization as the fused kernel (``cpu_fused.schedule`` with
this family's block layout): only the tile differs — the score buffer spans every key, so there
is no ``block_n`` and no key-tile loop to unroll. The design space samples the row block (one
task per ``block_m``), ``s_rows``, ``pv_rows``, ``d_unroll`` and ``parallel_chunk``.
"""
from __future__ import annotations

import dataclasses

from tvm import s_tir
from tvm.target import Target

from ..spec import AttentionSpec
from ..target import vector_lanes
from ..workloads import rowcache_attention
from ..workloads.knob_attrs import ROWCACHE

from . import cpu_fused, cpu_space
from ._knobs import KnobError, KnobsMixin
from .family import Capabilities, never_static_decode, read_attrs, same_knobs

NAME = "rowcache"
CAPABILITIES = Capabilities(label=NAME, target="cpu", layouts=("bhsd",), dtypes=("float32",), symbolic=False,
                            lse=False)
LAYOUT = cpu_fused.TileKernelLayout(
    ("row_max", "P_exp", "row_sum", "Q_load"), ("O_store",), kv_tile=False
)
BLOCK_M_VECTORS = (1, 2, 4)  # row blocks the tuner tries, in vector widths
#: The row buffers (S and P: 2·seq_kv·block_m floats) must fit this; past it the family is not
#: built (the fused kernel has no such limit).
MAX_ROW_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class RowCacheCPUKnobs(KnobsMixin):
    FAMILY = NAME

    block_m: int = 32  # query rows per row block (multiple of vector_lanes)
    s_rows: int = 4  # keys per register block of S_gemm (must divide seq_kv)
    pv_rows: int = 4  # query rows per register block of PV_gemm
    pv_cols: int = 0  # head_dim columns per PV_gemm register block (0 = all; see cpu_space.pv_columns)
    vector_lanes: int = 16
    d_unroll: int = 1
    parallel_chunk: int = 1



def _largest_divisor(n: int, limit: int) -> int:
    return max(f for f in range(1, limit + 1) if n % f == 0)


def preset(spec: AttentionSpec, target: Target) -> RowCacheCPUKnobs:
    flash = cpu_fused.preset(spec, target)
    s_rows = _largest_divisor(spec.seq_kv, flash.s_rows)
    return RowCacheCPUKnobs(block_m=flash.block_m, s_rows=s_rows, pv_rows=flash.pv_rows, pv_cols=flash.pv_cols,
                            vector_lanes=flash.vector_lanes)


def check(knobs: RowCacheCPUKnobs, spec: AttentionSpec, target: Target) -> None:
    if spec.seq_kv % knobs.s_rows:
        raise KnobError(f"s_rows={knobs.s_rows} must divide seq_kv={spec.seq_kv}")
    as_flash = cpu_fused.FlashCPUKnobs(
        block_m=knobs.block_m, block_n=knobs.s_rows, s_rows=knobs.s_rows, pv_rows=knobs.pv_rows, pv_cols=knobs.pv_cols,
        vector_lanes=knobs.vector_lanes, d_unroll=knobs.d_unroll, parallel_chunk=knobs.parallel_chunk,
    )
    cpu_fused.check(as_flash, spec, target)  # the same register limits
    row_bytes = 2 * 4 * spec.seq_kv * knobs.block_m
    if row_bytes > MAX_ROW_BYTES:
        raise KnobError(
            f"row buffers need {row_bytes} B per row block (2 × seq_kv={spec.seq_kv} × "
            f"block_m={knobs.block_m} floats) > MAX_ROW_BYTES={MAX_ROW_BYTES}: the row-cached "
            "family does not scale to this length (the fused kernel does)"
        )


def workload(spec: AttentionSpec, knobs: RowCacheCPUKnobs):
    return rowcache_attention(spec, knobs.block_m)


def from_attrs(attrs, base: RowCacheCPUKnobs | None = None) -> RowCacheCPUKnobs:
    """The knobs a row-cached workload's attrs record (``knob_attrs.ROWCACHE``: ``block_m``),
    the others ``base``'s (default: the dataclass's)."""
    return dataclasses.replace(base or RowCacheCPUKnobs(), **read_attrs(ROWCACHE, attrs, "rowcache"))


def apply(sch: s_tir.Schedule, knobs: RowCacheCPUKnobs, spec: AttentionSpec) -> s_tir.Schedule:
    return cpu_fused.schedule(sch, spec, knobs.vector_lanes, knobs, LAYOUT)


def design_space(spec: AttentionSpec, target: Target):
    lanes = vector_lanes(target, spec.dtype)

    def space_fn(sch: s_tir.Schedule) -> s_tir.Schedule:
        return cpu_fused.schedule(sch, spec, lanes, None, LAYOUT)

    return space_fn


def block_m_candidates(spec: AttentionSpec, target: Target) -> list[int]:
    lanes = vector_lanes(target, spec.dtype)
    out = [preset(spec, target).block_m]
    out += [v * lanes for v in BLOCK_M_VECTORS if v * lanes not in out]
    return [m for m in out if 2 * 4 * spec.seq_kv * m <= MAX_ROW_BYTES and cpu_space.max_s_rows(m, lanes) >= 1]


def knobs_of(sch: s_tir.Schedule, lanes: int, base=None) -> RowCacheCPUKnobs:
    values, bufs = cpu_fused.read_annotations(sch, ("s_rows", "pv_rows", "pv_cols", "d_unroll", "parallel_chunk"))
    return RowCacheCPUKnobs(block_m=int(bufs["Qt"].shape[1]), vector_lanes=lanes, **values)


for_layout = same_knobs
is_static_decode = never_static_decode
