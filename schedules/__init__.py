"""Hand-authored schedules, one module per (family, target), registered in :data:`SCHEDULES`.

``schedules/`` of the checkout is the package ``tvm_attention.schedules`` (pyproject.toml's
package-dir; from a checkout, ``tvm_attention._checkout``): it imports the compute layer relatively
(``from ..spec import``), and is imported as ``tvm_attention.schedules`` — never as a top-level
``schedules``, which any ``schedules.py`` in the user's folder would shadow.

Each module implements :class:`tvm_attention.schedules.family.Family`: ``NAME``, ``CAPABILITIES`` (what it
builds: target, layouts, dtypes, symbolic dims, lse), a frozen knob dataclass (``*Knobs``, with
``to_dict``/``from_dict``), ``preset(spec, target)``, ``check(knobs, spec, target)`` (the knobs
against named hardware limits; raises ``KnobError``), ``workload(spec, knobs)`` (the PrimFunc these
knobs schedule, and the only way one is made), ``from_attrs(attrs, base)`` (the knobs a workload's
``attn.*`` attrs record: ``workload`` makes it again), ``apply(sch, knobs, spec)`` (the schedule,
finding blocks by name; it returns the Schedule to build), ``knobs_of`` (knobs read back from a
scheduled module), ``for_layout`` and ``is_static_decode``. :func:`check` is the one place a spec
meets a family's capabilities.
"""
from __future__ import annotations


from . import (cpu_fused, cpu_materialized, cpu_rowcache, cuda_fused, cuda_hopper, cuda_materialized, cuda_mla, cuda_mma,
               cuda_simt)
from .family import Family

#: schedule name -> target family -> module
SCHEDULES: dict[str, dict[str, Family]] = {
    "fused": {"cpu": cpu_fused, "cuda": cuda_fused},  # CUDA: tensor cores where they apply
    "fused_tc": {"cuda": cuda_mma},
    "fused_simt": {"cuda": cuda_simt},
    "fused_hopper": {"cuda": cuda_hopper},
    "fused_mla": {"cuda": cuda_mla},  # the latent layouts (MLA) on tensor cores
    "materialized": {"cpu": cpu_materialized, "cuda": cuda_materialized},
    "rowcache": {"cpu": cpu_rowcache},
}


#: schedule name -> the workloads its families build (their functions' ``attn.workload``): what a
#: tuning log's records are matched by (``logs.records_for``). ``fused`` on CUDA builds the
#: tensor-core or the CUDA-core kernel, whichever applies (the MLA kernel for a latent layout).
WORKLOAD_KINDS: dict[str, tuple[str, ...]] = {
    "fused": ("fused", "fused_mma", "fused_cuda", "fused_mla"),
    "fused_tc": ("fused_mma",),
    "fused_simt": ("fused_cuda",),
    "fused_hopper": ("fused_wgmma",),
    "fused_mla": ("fused_mla",),
    "materialized": ("materialized",),
    "rowcache": ("rowcache",),
}


#: ``attn.workload`` -> the family whose ``workload(spec, from_attrs(attrs))`` generates it again
#: (``task_mods.regenerate``); both targets' materialized families build the one materialized workload
WORKLOAD_FAMILIES: dict[str, Family] = {
    "fused": cpu_fused,
    "rowcache": cpu_rowcache,
    "materialized": cpu_materialized,
    "fused_cuda": cuda_simt,
    "fused_mma": cuda_mma,
    "fused_wgmma": cuda_hopper,
    "fused_mla": cuda_mla,
}


class UnknownScheduleError(ValueError):
    pass


def target_family(target) -> str:
    kind = target.kind.name
    return {"llvm": "cpu", "c": "cpu"}.get(kind, kind)


def get_schedule(name: str, target) -> Family:
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


def check(family: Family, knobs, spec, target) -> None:
    """Whether ``family`` builds ``spec`` at all (its capabilities: one message format for every
    family), then whether ``knobs`` fit ``target``'s limits; raises ``KnobError`` naming what fails."""
    family.CAPABILITIES.require(spec)
    family.check(knobs, spec, target)
