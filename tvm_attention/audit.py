"""Fusion audit: list every allocation in the final lowered IR and give a verdict.

"Fused" is a claim about the IR codegen sees, so we read that IR (``build.lower_final``), not the
schedule. Two forms of allocation exist there:

* ``AllocBuffer`` statements (device modules, and host IR before finalization);
* on CPU after host finalization, ``DeclBuffer`` whose ``data`` is a call to
  ``TVMBackendAllocWorkspace(dev_type, dev_id, nbytes, dtype_code, bits)``.

What fusion means: all three stages share one tile whose size is set by the tile sizes and
head_dim, never by the sequence lengths. So the verdict is ``fused`` iff

1. **no allocation grows with seq_q or seq_kv**: the build is lowered a second time, the same
   schedule at other lengths (the *probe*, ``probe_spec``: both lengths doubled; a decode
   kernel, one packed tile of query rows, keeps its ``seq_q``), and every
   allocation is compared by name with its counterpart there. A buffer whose size changed holds
   something per query row or per key (a score row, the score matrix) and fails the audit, however
   small it is at this length and whatever its scope — on CPU every ``local`` buffer is a heap
   workspace, so scope alone proves nothing;
2. the score buffers the workload names (``S``, ``P``) are allocated on chip (``local``;
   ``shared`` also counts on GPUs). At least one must be present (lowering may fold ``P`` into
   ``S``'s memory).

A **symbolic** build (``spec.dynamic``; the varlen layout) needs no probe: its IR says it. An
allocation whose size expression holds a symbolic length (``seq_q``, ``seq_kv``, ``total_q``,
``max_len``, ``num_pages``...) grows with it and fails the audit (the symbolic materialized S holds
``batch·heads·seq_q·seq_kv`` elements); a constant size cannot grow. A size that depends on the
``batch`` alone passes with a note: it holds a bounded number of tiles per sequence (split-KV
decode's partial outputs), nothing per query or key.

Where no probe could be built (the schedule does not fit the other lengths), or for a buffer the
probe does not have, the audit falls back to the size rule: no allocation may hold
``seq_q × seq_kv`` elements or more (one score matrix); the report notes it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import tvm
import tvm_ffi

from .lowering import LoweredModule
from .spec import AttentionSpec

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
    #: elements of the same buffer in the probe build at other lengths (None: no probe, or the
    #: probe has no buffer of this name)
    probe_elements: int | None = None
    #: symbolic dims its size depends on ((): a constant size), or None: not a symbolic build
    depends_on: tuple[str, ...] | None = None
    size_expr: str | None = None  # the size in elements when it is not a constant

    @property
    def grows(self) -> bool | None:
        """True if its size depends on a length; None if that is unknown (no probe)."""
        if self.depends_on is not None:
            return bool(set(self.depends_on) - BATCH_VARS)
        if self.probe_elements is None:
            return None
        return self.probe_elements != self.elements

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AuditReport:
    verdict: str  # "fused" | "not fused"
    reasons: tuple[str, ...]
    allocations: tuple[Allocation, ...]
    score_elements: int
    notes: tuple[str, ...] = ()
    probe: dict[str, Any] | None = None  # {"seq_q", "seq_kv"} of the probe build, or {"error"}

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

    def to_state(self) -> dict[str, Any]:
        """Every field as plain JSON (:meth:`from_state` gives the report back, equal): what the
        build cache stores (``to_dict`` is the manifest's view, with derived keys)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> "AuditReport":
        allocations = tuple(Allocation(**dict(a, depends_on=None if a.get("depends_on") is None
                                              else tuple(a["depends_on"]))) for a in d["allocations"])
        return cls(verdict=str(d["verdict"]), reasons=tuple(d["reasons"]), allocations=allocations,
                   score_elements=int(d["score_elements"]), notes=tuple(d["notes"]), probe=d["probe"])

    def to_dict(self) -> dict[str, Any]:
        largest = self.largest
        return {
            "verdict": self.verdict,
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "score_matrix_elements": self.score_elements,
            "largest_allocation": largest.to_dict() if largest else None,
            "bytes_by_scope": self.bytes_by_scope(),
            "allocations": [dict(a.to_dict(), grows=a.grows) for a in self.allocations],
            "probe": self.probe,
        }

    def format(self) -> str:
        symbolic = bool(self.probe and "symbolic" in self.probe)
        # Say what was allocated (the largest buffer) beside what a score matrix would be, so the
        # matrix's size does not read as an allocation.
        largest = self.largest
        biggest = (f"largest buffer {largest.name} {largest.elements if largest.elements >= 0 else 'symbolic'} "
                   f"elements ({largest.scope})" if largest else "no buffer")
        said = (f"symbolic dims: {', '.join(self.probe['symbolic'])}; {biggest}" if symbolic
                else f"{biggest}; one Sq×Skv score matrix would be {self.score_elements} elements")
        lines = [f"audit: {self.verdict.upper()}  ({said})"]
        grow_head = "grows with seq" if self.probe and "error" not in self.probe else ""
        lines.append(f"  {'buffer':<12} {'scope':<8} {'dtype':<8} {'elements':>12} {'bytes':>12}  {grow_head}")
        for a in sorted(self.allocations, key=lambda a: -a.bytes):
            if symbolic:
                grows = (f"YES: {', '.join(a.depends_on or ())}" if a.grows
                         else "no (per sequence: batch)" if a.depends_on else "no")
            else:
                grows = {True: f"YES ({a.probe_elements} at the probe)", False: "no", None: "?"}[a.grows]
            elements = a.elements if a.elements >= 0 else "symbolic"
            nbytes = a.bytes if a.bytes >= 0 else "symbolic"
            lines.append(f"  {a.name:<12} {a.scope:<8} {a.dtype:<8} {elements:>12} {nbytes:>12}  "
                         f"{grows if grow_head else ''}".rstrip())
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


#: The symbolic dims' variable names in the workloads (the layouts' symbolic dims; varlen's
#: ``batch`` enters as ``batch_plus_1``, the length of cu_seqlens).
SYMBOLIC_VARS = frozenset({"batch", "seq_q", "seq_kv", "total_q", "total_k", "batch_plus_1", "max_len",
                           "num_pages", "max_pages"})
#: Of those, the ones that count sequences, not tokens: a buffer sized by them alone holds a
#: bounded number of tiles per sequence (split-KV partials), never anything per query or key.
BATCH_VARS = frozenset({"batch", "batch_plus_1"})


def _vars_in(exprs: Iterable[Any], lets: dict[str, Any], _depth: int = 0) -> tuple[str, ...]:
    """The symbolic dims (``SYMBOLIC_VARS``) a size expression depends on, sorted. Lowering
    binds common subexpressions (``cse_v9 = batch * seq_q``) with lets: those are followed to
    their values; anything else that varies at run time is named as it is."""
    found: list[Any] = []
    inner: set[str] = set()  # vars bound inside the expression (T.Let)

    def on_let(n):
        inner.add(n.var.name)

    for e in exprs:
        if isinstance(e, tvm.tirx.Var):
            found.append(e)
        elif isinstance(e, tvm.ir.expr.Expr):
            tvm_ffi.structural_walk(e, [(tvm.tirx.Var, found.append), (tvm.tirx.Let, on_let)])
    names: set[str] = set()
    for v in found:
        if v.name in SYMBOLIC_VARS or v.name in inner:
            names.update({v.name} & SYMBOLIC_VARS)
        elif v.name in lets and _depth < 32:
            names.update(_vars_in([lets[v.name]], lets, _depth + 1))
        else:
            names.add(v.name)
    return tuple(sorted(names))


def _from_buffer(buf: Any, function: str, nbytes: int | None = None, size: Any = None,
                 lets: dict[str, Any] | None = None) -> Allocation:
    dt = tvm.DataType(str(buf.dtype))
    scalar = str(dt).split("x")[0]
    bits = dt.bits
    n = _elements_from_shape(buf.shape)
    elements = n * dt.lanes if n is not None else -1
    if nbytes is not None:
        elements = nbytes * 8 // bits
    else:
        nbytes = elements * bits // 8 if elements >= 0 else -1
    size_expr = None
    if elements < 0:
        exprs = [size] if size is not None else list(buf.shape)
        depends = _vars_in(exprs, lets or {})
        size_expr = f"grows with {' · '.join(depends)}"
    else:
        depends = ()
    return Allocation(buf.name, buf.scope(), scalar, elements, nbytes, function,
                      depends_on=depends, size_expr=size_expr)


def list_allocations(lowered: LoweredModule) -> list[Allocation]:
    """Every allocation in the final lowered IR (host and device), arguments excluded."""
    found: list[Allocation] = []
    for mod in lowered.all_modules():
        for gv, func in mod.functions.items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            fname = gv.name_hint
            lets: dict[str, Any] = {}

            def on_let(node, lets=lets):
                lets.setdefault(node.var.name, node.value)

            tvm_ffi.structural_walk(func.body, [(tvm.tirx.LetStmt, on_let), (tvm.tirx.Bind, on_let)])

            def on_alloc(node, fname=fname, lets=lets):
                found.append(_from_buffer(node.buffer, fname, lets=lets))

            def on_decl(node, fname=fname, lets=lets):
                data = node.data
                if isinstance(data, tvm.ir.Call) and getattr(data.op, "name", "") == _WORKSPACE_OP:
                    nbytes = data.args[2]
                    nb = int(nbytes) if isinstance(nbytes, tvm.tirx.IntImm) else None
                    found.append(_from_buffer(node.buffer, fname, nb, size=None if nb is not None else nbytes,
                                              lets=lets))

            tvm_ffi.structural_walk(
                func.body, [(tvm.tirx.AllocBuffer, on_alloc), (tvm.tirx.DeclBuffer, on_decl)]
            )
    return found


def probe_spec(spec: AttentionSpec, keep_seq_q: bool = False) -> AttentionSpec:
    """The spec the probe build uses: both lengths doubled (every divisibility a schedule relied
    on still holds, and any buffer sized by a length changes).

    ``keep_seq_q``: a decode kernel (one packed nest of ``seq_q · group`` rows, at most one tile)
    is probed at a doubled ``seq_kv`` only: a longer ``seq_q`` is another kernel, with other
    buffers, and this one's query rows are bounded by its tile."""
    return dataclasses.replace(spec, seq_q=spec.seq_q if keep_seq_q else 2 * spec.seq_q, seq_kv=2 * spec.seq_kv)


def _with_probe(allocs: Sequence[Allocation], probe: Sequence[Allocation]) -> list[Allocation]:
    """Pair each allocation with the probe's buffer of the same name and scope (in order, when
    a name occurs more than once)."""
    pool: dict[tuple[str, str], list[int]] = {}
    for p in probe:
        pool.setdefault((p.name, p.scope), []).append(p.elements)
    out = []
    for a in allocs:
        sizes = pool.get((a.name, a.scope))
        out.append(dataclasses.replace(a, probe_elements=sizes.pop(0) if sizes else None))
    return out


def audit(
    lowered: LoweredModule,
    spec: AttentionSpec,
    score_buffers: Sequence[str] = ("S", "P"),
    probe: Sequence[Allocation] | str | None = None,
    probe_at: AttentionSpec | None = None,
) -> AuditReport:
    """Audit ``lowered`` (the IR codegen receives) for ``spec``; see the module docstring.

    ``probe``: the allocations of the same schedule lowered at ``probe_at`` (default
    ``probe_spec(spec)``), or a string saying why there is none (then, and for ``None``, the size
    rule decides alone).
    """
    allocs = list_allocations(lowered)
    threshold = spec.score_elements()
    reasons: list[str] = []
    notes: list[str] = []
    probe_info: dict[str, Any] | None = None
    if spec.dynamic:
        return _audit_symbolic(allocs, spec, score_buffers, threshold)
    allocs = [dataclasses.replace(a, depends_on=None) for a in allocs]
    if isinstance(probe, str):
        notes.append(f"no probe build at other lengths ({probe}): size rule only")
        probe_info = {"error": probe}
    elif probe is not None:
        allocs = _with_probe(allocs, probe)
        pspec = probe_at or probe_spec(spec)
        probe_info = {"seq_q": pspec.seq_q, "seq_kv": pspec.seq_kv}
    for a in allocs:
        if a.elements < 0:
            reasons.append(f"{a.name} ({a.scope}) has a size unknown at compile time: {a.size_expr}")
        elif a.grows:
            reasons.append(
                f"{a.name} ({a.scope}, {a.bytes} B) grows with the sequence length: {a.elements} elements "
                f"at seq_q={spec.seq_q}, seq_kv={spec.seq_kv}, {a.probe_elements} at "
                f"seq_q={probe_info['seq_q']}, seq_kv={probe_info['seq_kv']}"
            )
        elif a.grows is None and a.elements >= threshold:
            reasons.append(
                f"{a.name} ({a.scope}) holds {a.elements} elements >= seq_q*seq_kv = {threshold}"
            )
    unmatched = [a.name for a in allocs if a.grows is None]
    if probe is not None and not isinstance(probe, str) and unmatched:
        notes.append(f"not in the probe build, size rule only: {', '.join(unmatched)}")
    _check_score_buffers(allocs, score_buffers, reasons, notes)
    verdict = "not fused" if reasons else "fused"
    return AuditReport(verdict, tuple(reasons), tuple(allocs), threshold, tuple(notes), probe_info)


def _audit_symbolic(allocs: list[Allocation], spec: AttentionSpec, score_buffers: Sequence[str],
                    threshold: int) -> AuditReport:
    """The audit of a build with symbolic dims: fused iff no allocation's size depends on a
    symbolic length (the batch alone is allowed, with a note)
    (and the score tile is on chip)."""
    reasons: list[str] = []
    notes = [f"symbolic build ({', '.join(spec.layout_info.symbolic_dims(spec))}): an allocation whose size "
             "depends on a symbolic length grows with it"]
    for a in allocs:
        if a.depends_on and not a.grows:
            notes.append(f"{a.name} ({a.scope}) is sized by the batch alone (a bounded number of tiles per "
                         "sequence, e.g. split-KV partials), not by any length")
        elif a.depends_on:
            reasons.append(f"{a.name} ({a.scope}) has a size that depends on the symbolic "
                           f"{', '.join(a.depends_on)}")
    _check_score_buffers(allocs, score_buffers, reasons, notes)
    verdict = "not fused" if reasons else "fused"
    return AuditReport(verdict, tuple(reasons), tuple(allocs), threshold, tuple(notes),
                       {"symbolic": spec.layout_info.symbolic_dims(spec)})


def _check_score_buffers(allocs: Sequence[Allocation], score_buffers: Sequence[str], reasons: list[str],
                         notes: list[str]) -> None:
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
