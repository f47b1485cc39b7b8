"""``--schedule fused`` on CUDA: the tensor-core kernel (``cuda_mma``) where it applies — float16
or bfloat16 inputs on sm_80 or later, head_dim a multiple of 16, static or symbolic lengths — and
the SIMT kernel (``cuda_simt``) everywhere else (float32, older GPUs, odd head dims); the latent
layouts (MLA) on the MLA tensor-core kernel (``cuda_mla``). ``fused_tc``, ``fused_simt`` and
``fused_mla`` name one kernel explicitly (for comparing them side by side).

Every call is routed by what it is given: the spec and target, the knob dataclass, or the
``attn.workload`` attribute of a function (scheduled, or a tuning log's workload).
"""
from __future__ import annotations

from tvm import s_tir
from tvm.target import Target

from ..spec import AttentionSpec

import dataclasses

from . import cuda_hopper, cuda_mla, cuda_mma, cuda_simt
from .family import never_static_decode

NAME = "fused"
#: the union of its kernels' (the SIMT one builds every dtype; the MLA kernel the latent layouts,
#: whose own table ``cuda_mla.check`` holds a latent spec to)
CAPABILITIES = dataclasses.replace(cuda_simt.CAPABILITIES,
                                   layouts=tuple(cuda_simt.CAPABILITIES.layouts) + cuda_mla.LATENT_LAYOUTS,
                                   kv_layouts=tuple(cuda_simt.CAPABILITIES.kv_layouts) + cuda_mla.LATENT_LAYOUTS,
                                   routes=())


def _by_spec(spec: AttentionSpec, target: Target):
    if spec.layout_info.latent:
        return cuda_mla
    return cuda_mma if cuda_mma.supports(spec, target) else cuda_simt


def _by_knobs(knobs):
    if isinstance(knobs, cuda_hopper.HopperKnobs):
        return cuda_hopper
    if isinstance(knobs, cuda_mla.MLAKnobs):
        return cuda_mla
    return cuda_mma if isinstance(knobs, cuda_mma.MMAKnobs) else cuda_simt


#: ``attn.workload`` -> the kernel's family (a tuning log's record, a scheduled function)
_FAMILIES = {"fused_mma": cuda_mma, "fused_wgmma": cuda_hopper, "fused_mla": cuda_mla}


def preset(spec: AttentionSpec, target: Target):
    return _by_spec(spec, target).preset(spec, target)


def check(knobs, spec: AttentionSpec, target: Target) -> None:
    _by_knobs(knobs).check(knobs, spec, target)


def shared_bytes(knobs, spec: AttentionSpec) -> int:
    return _by_knobs(knobs).shared_bytes(knobs, spec)


def workload(spec: AttentionSpec, knobs):
    return _by_knobs(knobs).workload(spec, knobs)


def apply(sch: s_tir.Schedule, knobs, spec: AttentionSpec) -> s_tir.Schedule:
    return _by_knobs(knobs).apply(sch, knobs, spec)


def design_space(spec: AttentionSpec, target: Target):
    return _by_spec(spec, target).design_space(spec, target)


def tile_candidates(spec: AttentionSpec, target: Target):
    return _by_spec(spec, target).tile_candidates(spec, target)


def _by_workload(func):
    return _FAMILIES.get(str(func.attrs["attn.workload"]), cuda_simt)


def knobs_of(sch: s_tir.Schedule, lanes: int = 0, base=None):
    return _by_workload(sch.mod["main"]).knobs_of(sch, lanes, base)


def workload_knobs(func):
    """The knobs ``func`` (a workload of any of the CUDA kernels) was generated with."""
    return _by_workload(func).workload_knobs(func)


def from_attrs(attrs, base=None):
    """The knobs the attrs of a workload of either kernel record (its ``attn.workload`` says which)."""
    kind = str(attrs["attn.workload"]) if attrs is not None and "attn.workload" in attrs else None
    return _FAMILIES.get(kind, cuda_simt).from_attrs(attrs, base)


def for_layout(knobs, spec: AttentionSpec, target: Target, tuned_at: AttentionSpec | None = None):
    return _by_knobs(knobs).for_layout(knobs, spec, target, tuned_at)


is_static_decode = never_static_decode
