"""Hand-authored schedules, one module per (family, target). Each module provides:

* a frozen knob dataclass (``*Knobs``) with ``to_dict``/``from_dict``;
* ``preset(spec, target)`` — the per-target default knobs;
* ``check(knobs, spec, target)`` — feasibility against named hardware limits (raises ``KnobError``);
* ``workload(spec, knobs)`` — the PrimFunc from the workload registry these knobs schedule;
* ``apply(sch, knobs, spec)`` — the schedule, finding blocks by name; it returns the Schedule to
  build (usually ``sch`` itself; module-level rule sets such as dlight return a new one).
"""
from __future__ import annotations

from types import ModuleType

from . import cpu_flash, cpu_materialized, cpu_rowcache, cuda_flash, cuda_fused, cuda_materialized, cuda_mma

#: schedule name -> target family -> module
SCHEDULES: dict[str, dict[str, ModuleType]] = {
    "fused": {"cpu": cpu_flash, "cuda": cuda_fused},  # CUDA: tensor cores where they apply
    "fused_tc": {"cuda": cuda_mma},
    "fused_simt": {"cuda": cuda_flash},
    "materialized": {"cpu": cpu_materialized, "cuda": cuda_materialized},
    "rowcache": {"cpu": cpu_rowcache},
}


class UnknownScheduleError(ValueError):
    pass


def target_family(target) -> str:
    kind = target.kind.name
    return {"llvm": "cpu", "c": "cpu"}.get(kind, kind)


def get_schedule(name: str, target) -> ModuleType:
    """The schedule module for schedule ``name`` on ``target``."""
    if name not in SCHEDULES:
        raise UnknownScheduleError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    family = target_family(target)
    by_target = SCHEDULES[name]
    if family not in by_target:
        raise UnknownScheduleError(
            f"schedule {name!r} has no {family!r} implementation; available for: {', '.join(by_target)}"
        )
    return by_target[family]
