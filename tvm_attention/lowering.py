"""Final lowering: the IR codegen receives, kept so it can be audited and printed.

``lower_final`` repeats what ``tvm.tirx.build`` does (bind target, run the TIR pipeline, split
host/device, finalize; first a var of its own for each binding, ``ConvertSSA``) and keeps the
result; ``codegen`` then turns that same IR into a runtime module, so what we audit is what runs.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import tvm
from tvm import tirx
from tvm.target import Target
from tvm.tirx.build import split_host_device_mods, tir_to_runtime
from tvm_ffi import DLDeviceType

from .limits import MAX_ELEMENTS


@dataclasses.dataclass
class LoweredModule:
    """The final lowered IR: one host module plus a module per device target."""

    host: tvm.IRModule
    devices: dict  # Target -> IRModule
    target_host: Target
    #: the text, printed once (the build cache's store and the artifact's export both write it:
    #: printing a kernel's IR takes 10-100 ms; the modules are never changed after lowering)
    _script: str | None = dataclasses.field(default=None, repr=False, compare=False)

    def all_modules(self) -> list[tvm.IRModule]:
        return [self.host, *self.devices.values()]

    def script(self) -> str:
        if self._script is None:
            parts = [f"# host target: {self.target_host}\n", self.host.script()]
            for tgt, mod in self.devices.items():
                parts.append(f"\n# device target: {tgt}\n")
                parts.append(mod.script())
            self._script = "".join(parts)
        return self._script


@dataclasses.dataclass(frozen=True)
class ArgBounds:
    """What the exported function checks of argument ``name``'s shape, read as the caller's int64
    ``DLTensor.shape`` (:func:`with_shape_bounds`): each dim at most ``dims.get(i, MAX_ELEMENTS)``,
    the product of its dims at most :data:`MAX_ELEMENTS`."""

    name: str
    dims: Mapping[int, int] = dataclasses.field(default_factory=dict)
    why: str = ""  # what bounds ``dims`` (for the error message)
    #: the shape compiled in, a dim name where it is bound at call time: a compiled-in dim must
    #: equal it (checked here, before TVM's stride checks, which name strides for a wrong shape)
    shape: tuple = ()


def lower_final(mod: tvm.IRModule | tvm.tirx.PrimFunc, target: Target,
                arg_bounds: Sequence[ArgBounds] | None = None) -> LoweredModule:
    """Lower ``mod`` for ``target`` through the full default TIR pipeline and finalization. Every
    exported function first checks its tensors' shapes in int64 (:func:`with_shape_bounds`;
    ``arg_bounds``: the arguments' names and dim bounds, in call order)."""
    if isinstance(mod, tvm.tirx.PrimFunc):
        mod = tvm.IRModule.from_expr(mod)
    target = Target(target)
    if target.host is not None:
        target_host = Target(target.host)
    elif target.get_target_device_type() == DLDeviceType.kDLCPU:
        target_host = target
    else:
        target_host = Target("llvm")
    # a schedule may copy a Let binding (an inlined block read at two indices): one var each
    # (``workloads._math.ssa_checked``)
    mod = tvm.tirx.transform.ConvertSSA()(mod)
    mod = tvm.tirx.transform.BindTarget(target.with_host(target_host))(mod)
    pipeline, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("default")
    mod = with_shape_bounds(pipeline(mod), arg_bounds)
    host, devices = split_host_device_mods(mod)
    host = finalize_host()(host)
    devices = {t: finalize_device()(m) for t, m in devices.items()}
    return LoweredModule(host=host, devices=devices, target_host=target_host)


def codegen(lowered: LoweredModule) -> tvm.runtime.Module:
    """Generate the runtime module from already-lowered IR (no second lowering)."""
    return tir_to_runtime(lowered.host, lowered.devices, lowered.target_host)


# -- the shapes a caller passes, checked before any int32 index is formed -------------------------
_STRUCT_GET = tvm.ir.Op.get("tirx.tvm_struct_get")
#: ``tvm_struct_get`` field codes of TVM 0.27's packed-API lowering (``MakePackedAPI``): a
#: DLTensor's shape pointer, its ndim, an element of an int64 array, an argument's type index
_ARR_SHAPE, _ARR_NDIM, _INT64_ELEM, _ARG_TYPE_INDEX = 2, 4, 17, 13


def _struct_get(value, field: int):
    """``(handle, index)`` when ``value`` is ``tvm_struct_get(handle, index, field)``, else None."""
    if isinstance(value, tvm.ir.Call) and value.op.same_as(_STRUCT_GET) and int(value.args[2]) == field:
        return value.args[0], int(value.args[1])
    return None


def _shape_asserts(shape_var, ndim: int, bounds: ArgBounds) -> list:
    """Asserts on a DLTensor's int64 ``shape`` (``shape_var``): each dim in ``[0, bound]``, then
    each prefix product at most MAX_ELEMENTS. One at a time, so that no product can overflow:
    when ``d0·…·dk`` is checked, ``d0·…·d(k-1)`` and ``dk`` are each at most 2³¹ − 1 already, so
    their product is below 2⁶²."""
    dims = [tirx.call_intrin("int64", "tirx.tvm_struct_get", shape_var, i, _INT64_ELEM) for i in range(ndim)]
    kind = tvm.ir.StringImm("ValueError")
    out = []
    for i, d in enumerate(dims):
        bound = bounds.dims.get(i, MAX_ELEMENTS)
        why = bounds.why if i in bounds.dims else "kernels index with 32-bit ints"
        cond = tirx.And(tirx.GE(d, tirx.IntImm("int64", 0)), tirx.LE(d, tirx.IntImm("int64", bound)))
        out.append(tirx.AssertStmt(cond, kind, [tvm.ir.StringImm(
            f"{bounds.name}: dim {i} is negative or larger than {bound} ({why})")]))
    want = "(" + ", ".join(str(x) for x in bounds.shape) + ")"
    for i, (d, x) in enumerate(zip(dims, bounds.shape)):
        if isinstance(x, int):
            out.append(tirx.AssertStmt(tirx.EQ(d, tirx.IntImm("int64", x)), kind, [tvm.ir.StringImm(
                f"{bounds.name}: dim {i} must be {x}: expected shape {want}")]))
    too_many = [tvm.ir.StringImm(f"{bounds.name}: more than {MAX_ELEMENTS} elements; kernels index with 32-bit "
                                 "ints: split the batch")]
    prod = dims[0] if dims else None
    for d in dims[1:]:
        prod = tirx.Mul(prod, d)
        out.append(tirx.AssertStmt(tirx.LE(prod, tirx.IntImm("int64", MAX_ELEMENTS)), kind, too_many))
    return out


def with_shape_bounds(mod: tvm.IRModule, arg_bounds: Sequence[ArgBounds] | None = None) -> tvm.IRModule:
    """``mod`` (after the TIR pipeline) whose exported functions check each tensor argument's
    shape as the caller passed it, in int64, right after reading it (:func:`_shape_asserts`).

    Why: TVM's argument binding casts each int64 dim to the int32 var of the kernel's shape
    (``n = int32(shape[0])``) and checks strides as int32 products; a dim of 2³¹ or more is
    truncated, and a tensor of 2³¹ elements or more wraps every flat index a kernel forms
    (``((b·KH + h)·L + j)·D + d`` in int32): the kernel then reads or writes outside the tensor.
    The asserts come before any of TVM's own checks that use the truncated values. ``arg_bounds``
    names the arguments in call order (default: their buffer names) and may bound dims further
    (a sequence length: ``spec.MAX_SEQ_LEN``).

    TVM's check that a tensor is compact (its ``strides``) passes a tensor with no element, whatever
    its strides (:func:`_any_empty_passes`): NumPy exports an empty array with strides of 0, and an
    empty tensor addresses no memory, so the kernel's own checks of the call (e.g. a ``block_table``
    entry in use when ``kv_pages`` has no page) name what is wrong instead."""
    out = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and "tirx.is_entry_func" in func.attrs:
            func = func.with_body(_bound_shapes(func.body, arg_bounds or (), {}, {}, {}))
        out[gv] = func
    return tvm.IRModule(out, attrs=mod.attrs)


def _arg_prefix(name: str, suffix: str) -> str:
    """``"Q"`` of MakePackedAPI's ``Q.handle`` / ``Q_type_index`` (either separator)."""
    for sep in (".", "_"):
        if name.endswith(sep + suffix):
            return name[:-len(sep + suffix)]
    return name


def _stride_check_of(stmt) -> str | None:
    """The argument prefix (``"K"``) whose strides TVM's assert ``stmt`` checks (its message:
    ``"Mismatched ", "K", ".strides on argument #", ...``), else None."""
    if not isinstance(stmt, tirx.AssertStmt):
        return None
    parts = [getattr(p, "value", None) for p in stmt.message_parts]
    return parts[1] if len(parts) > 2 and parts[0] == "Mismatched " and parts[2] == ".strides on argument #" else None


def _any_empty_passes(stmt: tirx.AssertStmt, shape_var, ndim: int) -> tirx.AssertStmt:
    """TVM's strides assert ``stmt``, which also holds when a dim of the tensor (its int64
    ``shape_var``) is 0."""
    empty = [tirx.EQ(tirx.call_intrin("int64", "tirx.tvm_struct_get", shape_var, i, _INT64_ELEM),
                     tirx.IntImm("int64", 0)) for i in range(ndim)]
    cond = stmt.condition
    for e in reversed(empty):
        cond = tirx.Or(e, cond)
    return tirx.AssertStmt(cond, stmt.error_kind, list(stmt.message_parts))


def _bound_shapes(stmt, arg_bounds, index: dict, ndim: dict, shapes: dict):
    """``stmt`` with :func:`_shape_asserts` after each ``X_shape = tvm_struct_get(X_handle, 0,
    kArrShape)`` of the packed-API prologue, and each strides assert passing an empty tensor
    (:func:`_any_empty_passes`). ``index``: argument prefix -> call position (from
    ``X_type_index = tvm_struct_get(args, i, ...)``); ``ndim``: handle -> the rank TVM asserted;
    ``shapes``: argument prefix -> (its shape var, rank). Walks the prologue's statement
    sequences, attribute scopes and conditions, where MakePackedAPI puts them."""
    prefix = _stride_check_of(stmt)
    if prefix is not None and prefix in shapes:
        return _any_empty_passes(stmt, *shapes[prefix])
    if isinstance(stmt, tirx.IfThenElse):  # ``if not isnullptr(X_strides): assert ...``
        return tirx.IfThenElse(stmt.condition, _bound_shapes(stmt.then_case, arg_bounds, index, ndim, shapes),
                               None if stmt.else_case is None else
                               _bound_shapes(stmt.else_case, arg_bounds, index, ndim, shapes))
    if isinstance(stmt, tirx.SeqStmt):
        seq = []
        for s in stmt.seq:
            s = _bound_shapes(s, arg_bounds, index, ndim, shapes)
            seq.append(s)
            if isinstance(s, tirx.Bind):
                got = _struct_get(s.value, _ARG_TYPE_INDEX)
                if got is not None:
                    index[_arg_prefix(s.var.name, "type_index")] = got[1]
                got = _struct_get(s.value, _ARR_SHAPE)
                if got is not None and got[0] in ndim:
                    handle = got[0]
                    prefix = _arg_prefix(handle.name, "handle")
                    i = index.get(prefix)
                    bounds = arg_bounds[i] if i is not None and i < len(arg_bounds) else ArgBounds(prefix)
                    seq += _shape_asserts(s.var, ndim[handle], bounds)
                    shapes[prefix] = (s.var, ndim[handle])
            elif isinstance(s, tirx.AssertStmt):  # assert ndim == tvm_struct_get(X_handle, 0, kArrNDim)
                c = s.condition
                if isinstance(c, tirx.EQ) and isinstance(c.a, tirx.IntImm):
                    got = _struct_get(c.b, _ARR_NDIM)
                    if got is not None:
                        ndim[got[0]] = int(c.a)
        return tirx.SeqStmt(seq)
    if isinstance(stmt, tirx.AttrStmt):
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value,
                             _bound_shapes(stmt.body, arg_bounds, index, ndim, shapes))
    return stmt
