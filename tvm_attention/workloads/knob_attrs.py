"""The ``attn.*`` attrs a workload generator records the knobs that shaped it in: one table per
generator, written once here. The generator writes its function's attrs with :func:`record`; a
tuning log's stored function is read back with :func:`read` (through its family's
``from_attrs``, beside the knob dataclass in ``schedules/``) into knobs, and generated again from
them with the family's ``workload(spec, knobs)`` (``task_mods.regenerate``).

An entry names the generator argument, which is also the knob (the fused CPU kernel's
``stage_k_below`` is its ``vector_lanes``: ``cpu_fused.from_attrs``); the attr is ``attn.<name>``,
an int, or a list of ints. An argument at its ``omit`` value is not written, and reads back as it.

The attrs are part of a workload's structural hash, which is how MetaSchedule's database and
log matching know a record's workload: a committed tuning log is recognised only while every
key and value stays as it is, and the audit's lowered text prints them in this order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Attr:
    """One recorded generator argument."""

    name: str  # the generator's argument (and the knob it comes from); the attr is attn.<name>
    omit: int | None = None  # the value left unwritten (read back when absent); None: always written
    many: bool = False  # a sequence of ints, written as a list (the decode tiers' row counts)

    @property
    def key(self) -> str:
        return f"attn.{self.name}"


#: the fused CPU kernel (``fused.fused_attention``): its tiles, then (after ``attn.data_alignment``)
#: its product form
FUSED_TILE = (Attr("block_m"), Attr("block_n"))
FUSED_FORM = (Attr("dot_bf16", omit=0),)
FUSED = FUSED_TILE + FUSED_FORM
#: ... and, only when it has decode tiers, what shapes them (``decode_heads``: the kv heads per
#: task its staged tiers take, 1 when none is staged)
FUSED_DECODE = (Attr("decode_rows", many=True), Attr("split_tasks"), Attr("stage_k_below"), Attr("prefetch", omit=0),
                Attr("decode_heads", omit=1), Attr("decode_dot", omit=0), Attr("decode_block_n", omit=0))
#: the row-cached kernel (``rowcache.rowcache_attention``)
ROWCACHE = (Attr("block_m"),)
#: the CUDA SIMT kernel (``fused_cuda.fused_attention_cuda``)
FUSED_CUDA = (Attr("block_m"), Attr("block_n"), Attr("threads_per_row"))
#: the CUDA tensor-core kernel (``fused_mma.fused_attention_mma``)
FUSED_MMA = (Attr("warps"), Attr("block_n"), Attr("stages"), Attr("m_tiles"))
#: the MLA tensor-core kernel (``fused_mla.fused_attention_mla``)
FUSED_MLA = (Attr("row_groups"), Attr("col_groups"), Attr("block_n"), Attr("stages"))
#: the Hopper kernel (``fused_wgmma.fused_attention_wgmma``)
FUSED_WGMMA = (Attr("block_m"), Attr("block_n"), Attr("stages"), Attr("pingpong"), Attr("overlap"))
#: both CUDA kernels' split-KV (``fused_cuda.kernel_func``), after their own
CUDA_SPLIT = (Attr("split_tasks", omit=0),)


class WorkloadAttrsError(ValueError):
    """A stored workload whose ``attn.*`` attrs are missing or malformed: a corrupt log record,
    never "not this spec's workload"."""


def record(table: Sequence[Attr], **values: Any) -> dict[str, Any]:
    """The attrs of ``values`` (one per entry of ``table``, by name), in ``table``'s order."""
    out: dict[str, Any] = {}
    for a in table:
        v = values[a.name]
        v = [int(x) for x in v] if a.many else int(v)
        if a.omit is None or v != a.omit:
            out[a.key] = v
    return out


def read(table: Sequence[Attr], attrs: Mapping[str, Any], workload: str) -> dict[str, Any]:
    """``table``'s values in ``attrs`` (a function's attrs) by name: ints, tuples of ints for a
    list. Raises :class:`WorkloadAttrsError` naming the attr that is missing or not an int."""
    out: dict[str, Any] = {}
    for a in table:
        if a.key not in attrs:
            if a.omit is None:
                raise WorkloadAttrsError(f"a {workload} workload's attrs have no {a.key} (a corrupt log record?)")
            out[a.name] = a.omit
            continue
        v = attrs[a.key]
        if a.many:
            if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or not v:
                raise WorkloadAttrsError(f"{a.key}={v!r} of a {workload} workload is no list of ints")
            out[a.name] = tuple(_int(x, a, workload) for x in v)
        else:
            out[a.name] = _int(v, a, workload)
    return out


def _int(v: Any, a: Attr, workload: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise WorkloadAttrsError(f"{a.key}={v!r} of a {workload} workload is no int")
    return int(v)
