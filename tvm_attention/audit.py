"""Fusion audit: list every allocation in the final lowered IR and give a verdict.

"Fused" is a claim about the IR codegen sees, so we read that IR (``build.lower_final``), not the
schedule. Two forms of allocation exist there:

* ``AllocBuffer`` statements (device modules, and host IR before finalization);
* on CPU after host finalization, ``DeclBuffer`` whose ``data`` is a call to
  ``TVMBackendAllocWorkspace(dev_type, dev_id, nbytes, dtype_code, bits)``.

Verdict ``fused`` iff

1. no allocation holds ``seq_q × seq_kv`` elements or more (one score matrix), and
2. the score buffers the workload names (``S``, ``P``) are allocated in ``local`` scope
   (``shared`` also counts on GPUs) — the score tile lives in registers/L1, never in global
   memory. At least one must be present (lowering may fold ``P`` into ``S``'s memory).

For tiny specs whose whole score matrix is no larger than ``SMALL_SCORE_MATRIX`` elements a
single tile can be as big as the matrix, so rule 1 is not applied to local/shared buffers there;
the report says so.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import tvm
import tvm_ffi

from .lowering import LoweredModule
from .spec import AttentionSpec

#: Score matrices up to this many elements fit in one tile; the size rule then cannot tell a
#: tile from the matrix for on-chip buffers.
SMALL_SCORE_MATRIX = 16384
ON_CHIP_SCOPES = ("local", "shared", "shared.dyn", "local.fragment", "wmma.accumulator")
_WORKSPACE_OP = "tirx.TVMBackendAllocWorkspace"


@dataclasses.dataclass(frozen=True)
class Allocation:
    name: str
    scope: str
    dtype: str
    elements: int
    bytes: int
    function: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AuditReport:
    verdict: str  # "fused" | "not fused"
    reasons: tuple[str, ...]
    allocations: tuple[Allocation, ...]
    score_elements: int
    notes: tuple[str, ...] = ()

    @property
    def fused(self) -> bool:
        return self.verdict == "fused"

    @property
    def largest(self) -> Allocation | None:
        return max(self.allocations, key=lambda a: a.elements, default=None)

    def bytes_by_scope(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.allocations:
            out[a.scope] = out.get(a.scope, 0) + a.bytes
        return out

    def to_dict(self) -> dict[str, Any]:
        largest = self.largest
        return {
            "verdict": self.verdict,
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "score_matrix_elements": self.score_elements,
            "largest_allocation": largest.to_dict() if largest else None,
            "bytes_by_scope": self.bytes_by_scope(),
            "allocations": [a.to_dict() for a in self.allocations],
        }

    def format(self) -> str:
        lines = [f"audit: {self.verdict.upper()}  (score matrix = {self.score_elements} elements)"]
        lines.append(f"  {'buffer':<12} {'scope':<8} {'dtype':<8} {'elements':>12} {'bytes':>12}")
        for a in sorted(self.allocations, key=lambda a: -a.bytes):
            lines.append(f"  {a.name:<12} {a.scope:<8} {a.dtype:<8} {a.elements:>12} {a.bytes:>12}")
        for r in self.reasons:
            lines.append(f"  - {r}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


def _elements_from_shape(shape: Iterable[Any]) -> int | None:
    n = 1
    for s in shape:
        if not isinstance(s, (int, tvm.tirx.IntImm)):
            return None
        n *= int(s)
    return n


def _from_buffer(buf: Any, function: str, nbytes: int | None = None) -> Allocation:
    dt = tvm.DataType(str(buf.dtype))
    scalar = str(dt).split("x")[0]
    bits = dt.bits
    n = _elements_from_shape(buf.shape)
    elements = n * dt.lanes if n is not None else -1
    if nbytes is not None:
        elements = nbytes * 8 // bits
    else:
        nbytes = elements * bits // 8 if elements >= 0 else -1
    return Allocation(buf.name, buf.scope(), scalar, elements, nbytes, function)


def list_allocations(lowered: LoweredModule) -> list[Allocation]:
    """Every allocation in the final lowered IR (host and device), arguments excluded."""
    found: list[Allocation] = []
    for mod in lowered.all_modules():
        for gv, func in mod.functions.items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            fname = gv.name_hint

            def on_alloc(node, fname=fname):
                found.append(_from_buffer(node.buffer, fname))

            def on_decl(node, fname=fname):
                data = node.data
                if isinstance(data, tvm.ir.Call) and getattr(data.op, "name", "") == _WORKSPACE_OP:
                    nbytes = data.args[2]
                    nb = int(nbytes) if isinstance(nbytes, tvm.tirx.IntImm) else None
                    found.append(_from_buffer(node.buffer, fname, nb))

            tvm_ffi.structural_walk(
                func.body, [(tvm.tirx.AllocBuffer, on_alloc), (tvm.tirx.DeclBuffer, on_decl)]
            )
    return found


def audit(
    lowered: LoweredModule, spec: AttentionSpec, score_buffers: Sequence[str] = ("S", "P")
) -> AuditReport:
    """Audit ``lowered`` (the IR codegen receives) for ``spec``; see the module docstring."""
    allocs = tuple(list_allocations(lowered))
    threshold = spec.score_elements()
    small = threshold <= SMALL_SCORE_MATRIX
    reasons: list[str] = []
    notes: list[str] = []
    for a in allocs:
        if a.elements < 0:
            reasons.append(f"{a.name} ({a.scope}) has a size unknown at compile time")
        elif a.elements >= threshold:
            if small and a.scope in ON_CHIP_SCOPES:
                continue
            reasons.append(
                f"{a.name} ({a.scope}) holds {a.elements} elements >= seq_q*seq_kv = {threshold}"
            )
    if small:
        notes.append(
            f"score matrix has only {threshold} elements (<= {SMALL_SCORE_MATRIX}): one on-chip "
            "tile can be that large, so the size rule was applied to global buffers only"
        )
    by_name = {a.name: a for a in allocs}
    present = [by_name[n] for n in score_buffers if n in by_name]
    missing = [n for n in score_buffers if n not in by_name]
    if not present:
        reasons.append(f"no score buffer ({', '.join(score_buffers)}) found in the lowered IR")
    elif missing:
        # StorageRewrite may fold one buffer into another's memory (P into S in place).
        notes.append(f"score buffer(s) {', '.join(missing)} share another allocation after lowering")
    for a in present:
        if a.scope not in ON_CHIP_SCOPES:
            reasons.append(f"score buffer {a.name!r} is in {a.scope!r} scope, not on chip")
    verdict = "not fused" if reasons else "fused"
    return AuditReport(verdict, tuple(reasons), allocs, threshold, tuple(notes))
