"""What a spec's tuning is about, shared by ``tune`` (which writes the records) and ``build``
(which reads them): the spec whose log it is (:func:`tuning_spec`; a paged decode step is tuned as
itself, in pages: :mod:`tvm_attention.tune.paged`), the module each task measures
(:func:`task_mod`), and whether a logged workload is one ``spec`` generates
(:func:`workload_matches`)."""
from __future__ import annotations

import dataclasses

import functools
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import Target

from .schedules import WORKLOAD_FAMILIES, cpu_fused, target_family
from .spec import AttentionSpec
from .tvm_internals import normalize_mod


def tuning_spec(spec: AttentionSpec, target: Target, schedule: str = "fused") -> AttentionSpec:
    """The spec whose log ``tune`` writes and ``build`` reads for ``spec``: ``spec`` itself when
    static or a paged decode step on a CPU (tuned in pages: :mod:`tvm_attention.tune.paged`),
    else its static bhsd representative. Without ``device_checks``: a build option that adds a
    check kernel, not another attention kernel to tune."""
    if spec.device_checks:
        spec = dataclasses.replace(spec, device_checks=False)
    if not spec.dynamic:
        return spec
    if tunes_as_paged(spec, target, schedule):
        return spec
    return spec.representative()


def tunes_as_paged(spec: AttentionSpec, target: Target, schedule: str = "fused") -> bool:
    """A paged spec whose representative step is a decode step of the CPU fused kernel."""
    if not spec.layout_info.paged or schedule != "fused" or target.kind.name != "llvm":
        return False
    return cpu_fused.is_decode_step(spec, target)


def step_case(spec: AttentionSpec) -> dict[str, Any]:
    """The representative step as a case of the layout (its first validation case: ``batch``
    sequences of ``seq_q`` new tokens and ``seq_kv`` keys each)."""
    return spec.layout_info.validation_cases(spec)[0]


def arg_shapes(spec: AttentionSpec) -> list[tuple[int, ...]]:
    """The shapes of the representative step's arguments, in call order."""
    static = [tuple(a["shape"]) for a in spec.arg_specs()]
    if not any(isinstance(d, str) for shape in static for d in shape):  # every shape compiled in
        return static
    layout = spec.layout_info
    case = step_case(spec)
    values = layout.case_dims(spec, case)
    names = layout.dims(spec)
    args = layout.all_args(spec)
    # a variant argument's own dims (key bounds' positions, a modifier tensor's) are no layout
    # dim: they are what the representative inputs hold (made only for such a spec)
    own = any(isinstance(d, str) and d not in names for a in args for d in a.dims)
    inputs = layout.random_inputs(spec, case) if own else {}

    def size(a, i, d):
        if isinstance(d, int):
            return d
        if d in names:
            return values[names[d]] if isinstance(names[d], str) else names[d]
        return inputs[a.name].shape[i]

    return [tuple(size(a, i, d) for i, d in enumerate(a.dims)) for a in args]


def specialize(func: tirx.PrimFunc, spec: AttentionSpec) -> tirx.PrimFunc:
    """``func`` (``spec``'s symbolic kernel) with every symbolic dim bound to the representative
    step's value (:func:`arg_shapes`)."""
    args = spec.layout_info.all_args(spec)
    if len(args) != len(func.params):
        raise ValueError(f"{spec.short_name()}: the kernel takes {len(func.params)} arguments, the layout "
                         f"names {len(args)}")
    # the same alignment as the kernel's own buffers (specialize refuses a mismatch)
    align = int(func.attrs["attn.data_alignment"]) if func.attrs is not None and "attn.data_alignment" in func.attrs \
        else -1
    bufs = {p: tirx.decl_buffer(shape, a.dtype or spec.dtype, a.name, data_alignment=align)
            for p, a, shape in zip(func.params, args, arg_shapes(spec))}
    return func.specialize(bufs)


def normalize(func) -> tvm.IRModule:
    """``func`` as MetaSchedule keys a workload (an IRModule with one ``main``)."""
    return normalize_mod(func)  # MetaSchedule loads on first use: a build without a tuning log never needs it


@functools.lru_cache(maxsize=64)
def _paged_task_mod(spec: AttentionSpec, knobs: cpu_fused.FlashCPUKnobs) -> tvm.IRModule:
    """``task_mod`` of a paged step's fused workload, kept per process: the symbolic paged kernel
    (the step's tier and the main nest) takes ~0.4 s to parse, and ``tune`` asks for each of its
    ~20 tasks twice (the tasks, then each log record's workload, read back on the same preset)."""
    return task_mod(spec, cpu_fused.workload(spec, knobs, step_only=True))


def fused_task_mod(spec: AttentionSpec, knobs: cpu_fused.FlashCPUKnobs) -> tvm.IRModule:
    """The task module of ``cpu_fused.workload(spec, knobs)``; a symbolic spec's (a paged decode
    step, tuned as itself) with only the decode tier its step runs (``step_only``)."""
    if spec.dynamic:
        return _paged_task_mod(spec, knobs)
    return task_mod(spec, cpu_fused.workload(spec, knobs))


def task_mod(spec: AttentionSpec, func) -> tvm.IRModule:
    """The module a task of ``spec`` measures: ``func`` itself, or, for a symbolic spec tuned as
    itself (a paged decode step, :mod:`tvm_attention.tune.paged`), ``func`` specialized to its representative step."""
    if not spec.dynamic:
        return normalize(func)
    # Simplify folds the branches the step does not take (the main nest, the split or unsplit
    # form) and drops them: the task is the step's own nest, a fraction of the text to search
    # and build. Without it (TVM 0.27) generating the design space of a function
    # that holds both the split and the unsplit nest changed the task's module in place, and
    # every later candidate and replay of the task failed on the changed one.
    return tvm.s_tir.transform.StmtSimplify()(normalize(specialize(func, spec)))


def regenerate(spec: AttentionSpec, func, target: Target | None = None) -> tvm.IRModule | None:
    """The workload ``spec`` (a tuning spec: :func:`tuning_spec`) would produce for a stored
    function; None when ``func`` is no workload of ``spec``'s kernel.

    It is its family's ``workload(spec, knobs)`` (``schedules.WORKLOAD_FAMILIES`` by its
    ``attn.workload``), the function ``build`` schedules and the tuner's tasks measure, with the
    knobs its ``attn.*`` attrs record (the family's ``from_attrs``), the others ``target``'s
    preset's, the knobs the tasks are made from (a fused workload without decode tiers records
    no lane width; without ``target``: the dataclass defaults'). Attrs that are missing or
    malformed raise ``WorkloadAttrsError``, as any error in generating spec's workload does."""
    attrs = func.attrs if func.attrs is not None else {}
    family = WORKLOAD_FAMILIES.get(str(attrs["attn.workload"])) if "attn.workload" in attrs else None
    if family is None or not takes_spec_args(spec, func):
        # No workload of ours, or a record of another spec's kernel (`build --from-log` of another
        # configuration's log): its knobs were checked against that spec, not this one, and the
        # generators refuse some (a tensor-core workload of float32, decode_heads not dividing
        # kv_heads). It is not spec's workload whatever they do, so it is not generated; anything
        # that fails in generating a record of spec's own kernel is a bug, and raises.
        return None
    base = family.preset(spec, target) if target is not None and family.CAPABILITIES.target == target_family(target) \
        else None
    knobs = family.from_attrs(attrs, base)
    if family is cpu_fused:
        return fused_task_mod(spec, knobs)
    return normalize(family.workload(spec, knobs))


def takes_spec_args(spec: AttentionSpec, func) -> bool:
    """Whether ``func`` takes the arguments of ``spec``'s kernel at its tuning step, in call
    order: their dtypes and compiled-in shapes (:func:`arg_shapes`)."""
    layout = spec.layout_info
    args = layout.all_args(spec)
    if len(args) != len(func.params):
        return False
    for p, a, shape in zip(func.params, args, arg_shapes(spec)):  # in TVM 0.27 a parameter is its buffer
        dims = getattr(p, "shape", None)  # None: a scalar parameter, which no kernel of ours takes
        if dims is None or str(p.dtype) != layout.arg_dtype(spec, a):
            return False
        if not all(isinstance(d, tirx.IntImm) for d in dims) or tuple(int(d) for d in dims) != shape:
            return False
    return True


def workload_matches(spec: AttentionSpec, mod: tvm.IRModule, target: Target | None = None) -> bool:
    """True iff ``mod`` (from a log) is exactly the workload ``spec`` generates (on ``target``:
    :func:`regenerate`)."""
    mine = regenerate(spec, mod["main"], target)
    return mine is not None and tvm_ffi.structural_equal(mine, mod)
