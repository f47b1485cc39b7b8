"""The one build path every room uses: spec → PrimFunc → schedule → lowering → audit → codegen."""
from __future__ import annotations

import dataclasses
from typing import Any

import tvm
from tvm import s_tir
from tvm.target import Target

from .audit import AuditReport, audit
from .lowering import LoweredModule, codegen, lower_final
from .spec import AttentionSpec
from .target import resolve_target
from .workloads.fused import ENTRY


@dataclasses.dataclass
class BuiltKernel:
    """A compiled attention kernel with everything needed to audit, run and export it."""

    spec: AttentionSpec
    schedule: str  # "fused" | "materialized"
    source: str  # "hand" (knobs) or "tuned" (a MetaSchedule trace)
    knobs: Any  # the family's knob dataclass (hand) or None
    target: Target
    lowered: LoweredModule
    module: tvm.runtime.Module
    audit: AuditReport
    entry: str = ENTRY
    trace: str | None = None
    log_dir: str | None = None  # the tuning log a tuned build came from
    record_secs: list[float] | None = None  # its measured run times there
    resources: dict[str, Any] | None = None  # CUDA: ptxas report (see cuda_tools.ptxas_report)
    selection: dict[str, Any] | None = None  # tuned vs hand timed side by side at build time


    def schedule_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"name": self.schedule, "source": self.source}
        if self.knobs is not None:
            info["family"] = type(self.knobs).__name__
            info["knobs"] = self.knobs.to_dict()
        if self.trace is not None:
            info["trace"] = self.trace
        if self.log_dir is not None:
            info["log_dir"] = self.log_dir
            info["tuned_run_secs"] = self.record_secs
        if self.selection is not None:
            info["selection"] = self.selection
        return info

    @property
    def function(self):
        return self.module[self.entry]

    def run(self, q, k, v, o) -> None:
        """Call the kernel on TVM tensors (or 64-byte-aligned NumPy arrays): writes ``o``."""
        self.function(q, k, v, o)


def build_kernel(
    spec: AttentionSpec,
    schedule: str = "fused",
    target: str | Target = "llvm",
    knobs: Any = None,
) -> BuiltKernel:
    """Build ``spec`` with the hand schedule ``schedule`` (default knobs: the target preset).

    Steps: PrimFunc from the workload registry → schedule by name → final lowering → audit →
    codegen of that same lowered IR.
    """
    from schedules import get_schedule  # schedules/ sits beside this package

    target = resolve_target(target) if not isinstance(target, Target) else target
    family = get_schedule(schedule, target)
    preset = family.preset(spec, target)
    if knobs is None:
        knobs = preset
    elif isinstance(knobs, dict):  # overrides on top of the preset
        knobs = type(preset).from_dict({**preset.to_dict(), **knobs})
    family.check(knobs, spec, target)
    sch = s_tir.Schedule(family.workload(spec, knobs))
    with target:
        sch = family.apply(sch, knobs, spec)
    return build_from_module(spec, schedule, sch.mod, target, source="hand", knobs=knobs)


def build_from_module(
    spec: AttentionSpec,
    schedule: str,
    mod: tvm.IRModule,
    target: Target,
    source: str,
    knobs: Any = None,
    trace: str | None = None,
) -> BuiltKernel:
    """Lower, audit and compile an already scheduled module."""
    from .workloads import WORKLOADS

    func = mod["main"]
    workload = str(func.attrs["attn.workload"]) if func.attrs is not None and "attn.workload" in func.attrs else schedule
    lowered = lower_final(mod, target)
    report = audit(lowered, spec, WORKLOADS[workload][1])
    module = codegen(lowered)
    built = BuiltKernel(spec, schedule, source, knobs, target, lowered, module, report, trace=trace)
    if target.kind.name == "cuda":
        built.resources = cuda_resources(built)
    return built


def cuda_resources(built: BuiltKernel) -> dict[str, Any]:
    """ptxas's report for a CUDA build (or why there is none: no nvcc here)."""
    from .cuda_tools import NvccNotFound, kernel_source, ptxas_report

    threads = None
    if built.knobs is not None and hasattr(built.knobs, "threads_per_row"):
        threads = built.knobs.block_m * built.knobs.threads_per_row
    try:
        return ptxas_report(kernel_source(built.module), str(built.target.attrs["arch"]), threads)
    except NvccNotFound as e:
        return {"unavailable": str(e)}


def build_from_record(spec: AttentionSpec, schedule: str, target: str | Target, workload, record) -> BuiltKernel:
    """Replay a tuning record's trace on its workload and build it (``source="tuned"``)."""
    target = resolve_target(target)
    sch = s_tir.Schedule(workload.mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    from schedules import get_schedule

    from .target import vector_lanes

    family = get_schedule(schedule, target)
    knobs = family.knobs_of(sch, vector_lanes(target, spec.dtype)) if hasattr(family, "knobs_of") else None
    built = build_from_module(spec, schedule, sch.mod, target, source="tuned", knobs=knobs,
                              trace=str(record.trace))
    built.record_secs = [float(x) for x in record.run_secs]
    return built
