"""CUDA schedule for the materialized baseline: TVM's dlight default GPU rules.

The baseline keeps its definition (global S and P of seq_q × seq_kv per head); dlight gives each
stage a reasonable GPU schedule (matmul tiling for the GEMMs, cross-thread reductions for the
softmax), which is what a user would get from TVM without writing a schedule.
"""
from __future__ import annotations

import dataclasses

from tvm import s_tir
from tvm.target import Target

from ..spec import SUPPORTED_DTYPES, AttentionSpec
from ..workloads import materialized_attention

from ._knobs import KnobsMixin
from .family import Capabilities, never_static_decode, no_knobs_of, read_attrs, same_knobs

NAME = "materialized"
CAPABILITIES = Capabilities(label="CUDA materialized", target="cuda", layouts=("bhsd",), dtypes=SUPPORTED_DTYPES,
                            symbolic=False, lse=False)


@dataclasses.dataclass(frozen=True)
class MaterializedCUDAKnobs(KnobsMixin):
    FAMILY = "materialized (cuda)"

    rules: str = "dlight-default"  # which rule set scheduled it (the only one so far)


def preset(spec: AttentionSpec, target: Target) -> MaterializedCUDAKnobs:
    return MaterializedCUDAKnobs()


def check(knobs: MaterializedCUDAKnobs, spec: AttentionSpec, target: Target) -> None:
    """No knob to check: dlight picks its own tiles."""


def workload(spec: AttentionSpec, knobs: MaterializedCUDAKnobs):
    return materialized_attention(spec)


def from_attrs(attrs, base: MaterializedCUDAKnobs | None = None) -> MaterializedCUDAKnobs:
    """``base`` (default: the dataclass's): no knob shapes the materialized workload."""
    read_attrs((), attrs, "materialized")
    return base or MaterializedCUDAKnobs()


def apply(sch: s_tir.Schedule, knobs: MaterializedCUDAKnobs, spec: AttentionSpec,
          target: Target | None = None) -> s_tir.Schedule:
    """dlight works on modules, not schedules: returns a new Schedule over the scheduled module."""
    from tvm.s_tir import dlight as dl

    target = target or Target.current()
    if target is None:
        raise ValueError("cuda_materialized.apply needs the target (pass it, or call under `with target:`)")
    with target:
        mod = dl.ApplyDefaultSchedule(
            dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()
        )(sch.mod)
    return s_tir.Schedule(mod)


# dlight schedules it: no knobs to read back
knobs_of = no_knobs_of
for_layout = same_knobs
is_static_decode = never_static_decode
