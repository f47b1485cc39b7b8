"""The protocol every schedule family implements, and the table of what each one builds.

A family is a module of ``schedules/`` (``cpu_fused``, ``cuda_mma``, ...) registered in
``tvm_attention.schedules.SCHEDULES``. It provides every member of :class:`Family` (a family without a use for
one gives the neutral answer: ``knobs_of`` None, ``for_layout`` the knobs unchanged,
``is_static_decode`` False), so callers never probe with ``hasattr``. What a family builds at
all — target, layouts, dtypes, symbolic dims, an lse output — is its :class:`Capabilities`,
checked in one place (:meth:`Capabilities.require`, called by ``tvm_attention.schedules.check``) with one
message format; ``check`` itself judges only the knobs against the hardware's limits.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any, Protocol, runtime_checkable

from tvm import s_tir, tirx
from tvm.target import Target

from ..cuda_tools import split_tasks_for
from ..layouts import in_words, layouts_where
from ..quant import KV_DTYPES
from ..spec import AttentionSpec
from ..workloads.knob_attrs import Attr, WorkloadAttrsError, read
from ..workloads.variants import CUDA_CALL_VARIANTS as _CUDA_CALL_VARIANTS
from ..workloads.variants import CUDA_VARIANTS as _CUDA_VARIANTS

from ._knobs import KnobError

#: what a family that cannot build a spec suggests instead
USE_CPU_FUSED = "use --schedule fused on a CPU (llvm) target"


#: the attention variants every CUDA kernel builds: the variants' contract says which kernels take
#: each of its hooks (workloads/variants.py); the SIMT and mma.sync kernels also what the call
#: decides (the user's modifiers, key bounds, a custom mask: CUDA_CALL_VARIANTS)
CUDA_VARIANTS = _CUDA_VARIANTS
CUDA_CALL_VARIANTS = _CUDA_CALL_VARIANTS
#: the 8-bit K/V caches both CUDA kernels read, in the KV-cache layouts (the decode kernels)
CUDA_KV_DTYPES = KV_DTYPES
#: the latent layouts (MLA) on CUDA: the MLA tensor-core kernel's (``cuda_mla``), where the other
#: CUDA kernels send them (``Capabilities.routes``)
LATENT_ROUTE = (tuple(layouts_where("latent")),
                "use --schedule fused_mla (MLA on tensor cores: float16 or bfloat16, sm_80 or later), or "
                + USE_CPU_FUSED)


#: the layouts whose CUDA grid splits each sequence's keys when the batch is small (split-KV: a
#: decode step has one thread block per (sequence, KV head) otherwise): their entries' ``can_split``
SPLIT_LAYOUTS = layouts_where("can_split")
#: the most thread blocks split-KV may aim for: a batch splits only while batch · kv_heads <
#: split_tasks, and then its (sequence, chunk) pairs on gridDim.z, batch · ceil(split_tasks /
#: (batch · kv_heads)), stay below 2 · split_tasks (gridDim.z stops at 65535)
MAX_SPLIT_TASKS = 4096


def cuda_split_tasks(spec: AttentionSpec, target: Target) -> int:
    """The CUDA presets' ``split_tasks`` knob: the grid size split-KV aims for on ``target``
    (``cuda_tools.split_tasks_for``) in the KV-cache layouts, 0 (no split) in the others."""
    return split_tasks_for(target) if spec.layout_info.can_split else 0


def check_split_tasks(knobs: Any, spec: AttentionSpec) -> None:
    """Raise :class:`KnobError` for a ``split_tasks`` knob that is no count, or that asks a layout
    without split-KV to split."""
    v = knobs.split_tasks
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise KnobError(f"split_tasks must be a non-negative int (0: no split-KV), got {v!r}")
    if v > MAX_SPLIT_TASKS:
        raise KnobError(f"split_tasks={v} > {MAX_SPLIT_TASKS}: gridDim.z counts (sequence, chunk) pairs, at most "
                        f"2 · split_tasks of them, and gridDim.z stops at 65535")
    if v and not spec.layout_info.can_split:
        raise KnobError(f"split_tasks={v}: split-KV splits the {' and '.join(SPLIT_LAYOUTS)} layouts, "
                        f"not {spec.layout!r} (use 0)")


def cuda_for_layout(knobs: Any, spec: AttentionSpec, target: Target, tuned_at: AttentionSpec | None = None) -> Any:
    """``for_layout`` of both CUDA kernels: knobs read from a record tuned at ``tuned_at``
    (default ``spec.representative()``), made fit to build ``spec``. A KV-cache spec is tuned at
    its bhsd representative (``task_mods.tuning_spec``), a layout without split-KV, so its
    record's ``split_tasks`` is 0 whatever the kvcache or paged build needs: the build takes
    ``spec``'s own, the preset's (:func:`cuda_split_tasks`, the target's grid size, which the
    tuner never varies: every task carries its preset's). A record tuned on a layout that
    splits keeps its own."""
    if (tuned_at or spec.representative()).layout_info.can_split:
        return knobs
    return dataclasses.replace(knobs, split_tasks=cuda_split_tasks(spec, target))


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a family builds: any spec outside this table is refused by name before a knob is
    looked at."""

    label: str  # how messages name the family ("materialized", "CUDA tensor-core fused")
    target: str  # "cpu" (llvm) or "cuda"
    layouts: Collection[str]  # a tuple, or a live view of the registry's names
    dtypes: tuple[str, ...]  # input/output dtypes (every family accumulates in float32)
    symbolic: bool  # batch, seq_q, seq_kv may be symbolic
    lse: bool  # writes the log-sum-exp output (--return-lse)
    instead: str = USE_CPU_FUSED  # what to use for a spec it cannot build
    #: attention variants it builds (``AttentionSpec.variants``: window, softcap, alibi, sinks,
    #: kv_start); the others are refused by name
    variants: tuple[str, ...] = ()
    #: 8-bit K/V cache dtypes it reads (``AttentionSpec.kv_dtype``); others are refused by name
    kv_dtypes: tuple[str, ...] = ()
    #: the layouts it reads an 8-bit cache in (empty: all of its layouts)
    kv_layouts: tuple[str, ...] = ()
    #: writes the call's k_new/v_new into the cache before attending (``AttentionSpec.append``)
    appends: bool = False
    #: rounds q to int8 for QKᵀ against an int8 cache (``AttentionSpec.qk_int8``)
    qk_int8: bool = False
    #: how finely it reads an 8-bit cache's scales (``AttentionSpec.kv_scale``): per kv head only,
    #: or per token and per group too
    kv_scales: tuple[str, ...] = ("head",)
    #: builds a value head size of its own (``AttentionSpec.head_dim_v`` ≠ ``head_dim``)
    head_dim_v: bool = False
    #: fp8 query dtypes it reads (``AttentionSpec.q_dtype``, with an e4m3 K/V of the same kind),
    #: and the layouts it reads them in (those replace ``kv_layouts`` for such a spec)
    q_dtypes: tuple[str, ...] = ()
    q_layouts: tuple[str, ...] = ()
    #: ``(layouts, what builds them)``: where to send a spec in a layout it does not build (the
    #: other CUDA kernels send the latent layouts to the MLA kernel), instead of ``instead``
    routes: tuple[tuple[tuple[str, ...], str], ...] = ()

    def refusal(self, spec: AttentionSpec) -> str | None:
        """Why this family cannot build ``spec`` (None: it can), in the one message format
        ``the <family> schedule <what>: <what to use instead>``."""
        if spec.return_lse and not self.lse:
            what = "does not write lse (--return-lse)"
        elif spec.layout not in self.layouts:
            what = f"builds layout(s) {', '.join(self.layouts)}, not {spec.layout!r}"
            route = next((r for layouts, r in self.routes if spec.layout in layouts), None)
            if route is not None:
                return f"the {self.label} schedule {what}: {route}"
        elif spec.dtype not in self.dtypes:
            what = f"builds dtype(s) {', '.join(self.dtypes)}, not {spec.dtype!r}"
        elif getattr(spec, "append", False) and not self.appends:
            what = "does not append k_new/v_new to the cache (append) (yet)"
        elif getattr(spec, "qk_int8", False) and not self.qk_int8:
            what = "does not round q to int8 (qk_int8) (yet)"
        elif getattr(spec, "q_dtype", None) is not None and spec.q_dtype not in self.q_dtypes:
            return (f"the {self.label} schedule does not read fp8 queries (q_dtype={spec.q_dtype!r}): the Hopper "
                    "kernel builds them (a cuda target with arch sm_90a, --schedule fused_hopper)")
        elif getattr(spec, "q_dtype", None) is not None and spec.layout not in self.q_layouts:
            what = f"reads fp8 queries (q_dtype) in the {' and '.join(self.q_layouts)} layouts, not {spec.layout!r}"
        elif getattr(spec, "kv_dtype", None) is not None and spec.kv_dtype not in self.kv_dtypes:
            what = f"does not read 8-bit K/V caches (kv_dtype={spec.kv_dtype!r}) (yet)"
        elif (getattr(spec, "kv_dtype", None) is not None and self.kv_layouts and spec.layout not in self.kv_layouts
              and getattr(spec, "q_dtype", None) is None):
            what = (f"reads 8-bit K/V caches (kv_dtype={spec.kv_dtype!r}) in the {in_words(self.kv_layouts)} "
                    f"layouts, not {spec.layout!r}")
        elif getattr(spec, "kv_dtype", None) is not None and getattr(spec, "kv_scale", "head") not in self.kv_scales:
            what = f"reads an 8-bit cache's scales per {' or '.join(self.kv_scales)}, not per {spec.kv_scale} (kv_scale) (yet)"
        elif getattr(spec, "head_dim_v", None) is not None and not self.head_dim_v:
            what = (f"takes one head size for q, k, v and o, not head_dim={spec.head_dim} with "
                    f"head_dim_v={spec.head_dim_v} (yet)")
        elif [v for v in spec.variants if v not in self.variants]:
            missing = [v for v in spec.variants if v not in self.variants]
            what = f"does not build the attention variant(s) {', '.join(missing)} (yet)"
        elif spec.dynamic and not self.symbolic:
            what = f"has no symbolic-shape build ({', '.join(spec.dynamic)} given as dyn): give static lengths, or"
        else:
            return None
        sep = " " if what.endswith(", or") else ": "
        return f"the {self.label} schedule {what}{sep}{self.instead}"

    def require(self, spec: AttentionSpec) -> None:
        """Raise :class:`KnobError` naming what this family does not build."""
        why = self.refusal(spec)
        if why is not None:
            raise KnobError(why)


@runtime_checkable
class Family(Protocol):
    """A schedule family (a module): knobs, presets, limits, the workload and its schedule."""

    NAME: str  # the schedule name it implements ("fused", "materialized", "rowcache")
    CAPABILITIES: Capabilities

    def preset(self, spec: AttentionSpec, target: Target) -> Any:
        """The default knobs (the family's frozen knob dataclass) for ``spec`` on ``target``."""

    def check(self, knobs: Any, spec: AttentionSpec, target: Target) -> None:
        """Raise :class:`KnobError` when ``knobs`` break a named hardware limit."""

    def workload(self, spec: AttentionSpec, knobs: Any) -> tirx.PrimFunc:
        """The PrimFunc (from the workload registry) these knobs schedule."""

    def apply(self, sch: s_tir.Schedule, knobs: Any, spec: AttentionSpec) -> s_tir.Schedule:
        """Schedule ``sch`` (blocks found by name); returns the Schedule to build."""

    def from_attrs(self, attrs: Any, base: Any = None) -> Any:
        """The knobs a workload's ``attn.*`` attrs record (the ones that shape it, by the
        generator's table in ``workloads/knob_attrs.py``), the others ``base``'s (default: the
        dataclass's): ``workload(spec, from_attrs(func.attrs, base))`` generates ``func`` again.
        Raises ``WorkloadAttrsError`` for attrs that are missing or malformed."""

    def knobs_of(self, sch: s_tir.Schedule, lanes: int, base: Any = None) -> Any:
        """The knobs a (tuned or hand) schedule chose, read back from its annotations; None for
        a family whose tuned traces are not points of its hand schedule (MetaSchedule's spaces)."""

    def for_layout(self, knobs: Any, spec: AttentionSpec, target: Target, tuned_at: AttentionSpec | None = None) -> Any:
        """Knobs read from a record tuned at ``tuned_at``, made fit to build ``spec``."""

    def is_static_decode(self, spec: AttentionSpec, target: Target) -> bool:
        """Whether ``spec`` builds as a decode nest alone (its audit probe keeps seq_q)."""


def read_attrs(table: tuple[Attr, ...], attrs: Any, workload: str) -> dict[str, Any]:
    """``table``'s values in a function's ``attrs`` (``knob_attrs.read``), which must be those of
    a ``workload`` workload (its ``attn.workload``); raises ``WorkloadAttrsError`` otherwise."""
    kind = str(attrs["attn.workload"]) if attrs is not None and "attn.workload" in attrs else None
    if kind != workload:
        raise WorkloadAttrsError(f"attn.workload={kind!r}: no {workload} workload")
    return read(table, attrs, workload)


# -- the neutral members, for a family that has no use for one ---------------------------------
def no_knobs_of(sch: s_tir.Schedule, lanes: int, base: Any = None) -> None:
    """``knobs_of`` of a family tuned in MetaSchedule's own space: its trace is the description."""
    return None


def same_knobs(knobs: Any, spec: AttentionSpec, target: Target, tuned_at: AttentionSpec | None = None) -> Any:
    """``for_layout`` of a family whose knobs mean the same at every layout it builds."""
    return knobs


def feasible(preset: Any, candidates, check, spec: AttentionSpec, target: Target) -> list:
    """A tuning space: ``preset`` first, then each of ``candidates`` (knob dataclasses, in order)
    that is new and that ``check(knobs, spec, target)`` accepts (a ``KnobError`` drops it)."""
    out = [preset]
    for k in candidates:
        if k in out:
            continue
        try:
            check(k, spec, target)
        except KnobError:
            continue
        out.append(k)
    return out


def never_static_decode(spec: AttentionSpec, target: Target) -> bool:
    """``is_static_decode`` of a family without decode nests."""
    return False
