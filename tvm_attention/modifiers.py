"""User-written score and mask modifiers (FlexAttention's idea, compiled ahead of time).

A **score modifier** ``score_mod(score, b, h, q_idx, kv_idx)`` returns the score of query head
``h``'s row at position ``q_idx`` (bottom-right, as everywhere: ``p = i + seq_kv − seq_q``) against
key ``kv_idx`` of sequence ``b``, given the scaled (and softcapped, ALiBi-biased) ``score``. A
**mask modifier** ``mask_mod(b, h, q_idx, kv_idx)`` returns whether that key is visible; it is
joined (and) with the spec's own mask (causal, window, ``kv_start``). Both are plain Python
functions (a ``def`` or a ``lambda``) over a small vocabulary; one function body serves the
float64 NumPy reference (its arguments are broadcast arrays) and the kernel (its arguments are
TIR expressions of the tile's score, row and key), so the two cannot disagree on what it means.

The vocabulary (:data:`VOCABULARY`): arithmetic ``+ − * / // %``, comparisons, ``and or not``
(``& | ~`` on booleans), ``x if c else y``, and ``where abs min max minimum maximum exp log tanh
sqrt sigmoid floor logical_and logical_or logical_not``. Extra tensors the spec declares
(``mod_tensors``: e.g. a document id per key position) are read by name, ``doc[b, kv_idx]``; every
index into them is clamped into the tensor's extent (the kernel never reads outside it, and the
reference reads the same clamped element). Anything else (attributes, imports, calls of other
functions, loops) is refused by name when the spec is made.

Under a modifier a key whose modified score is ``−inf`` counts as hidden (FlexAttention's
convention): a row whose every score is ``−inf`` outputs zeros.

The spec records each modifier's source text (``AttentionSpec.score_mod``/``mask_mod``); it is
compiled only when a reference or a kernel is built, never by loading a manifest.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import math
import sys
import textwrap
from typing import Any, Callable

import numpy as np

from .errors import SpecError
from .tvm_internals import tir_expr_types

#: modifier kind -> its parameters (their names in the source are the user's own)
PARAMS = {"score_mod": ("score", "b", "h", "q_idx", "kv_idx"), "mask_mod": ("b", "h", "q_idx", "kv_idx")}
#: dtypes of the extra tensors a modifier may read
TENSOR_DTYPES = ("int32", "float32")
#: dim names an extra tensor's declared shape may use (besides positive ints): they size the
#: tensors validation makes; in the kernel every dim of an extra tensor is taken at call time
TENSOR_DIMS = ("batch", "heads", "kv_heads", "seq_q", "seq_kv")


# -- the vocabulary: one function per name, NumPy or TIR by its arguments ----------------------------
def _tir():
    from tvm import tirx

    return tirx


def _is_tir(*xs) -> bool:
    """Whether any of ``xs`` is a TIR expression (else all are numbers or NumPy arrays). Without
    TVM loaded there is none: the reference (NumPy) runs where TVM is not installed (a GPU
    machine's device check, a runtime-only server)."""
    if "tvm" not in sys.modules:
        return False
    return any(isinstance(x, tir_expr_types()) for x in xs)


def _dtype(x) -> str:
    x = _expr(x)
    return str(x.dtype if hasattr(x, "dtype") else x.ty)


def _expr(x):
    """A TIR comparison's Python object (``a == b`` is an ``EqualOp``) as its expression."""
    return x.asobject() if hasattr(x, "asobject") else x


def _const_like(x, other):
    tirx = _tir()
    if isinstance(x, (bool, int, float)) and not isinstance(x, np.ndarray):
        dtype = _dtype(other)
        if dtype == "bool":
            return tirx.const(bool(x), "bool")
        if isinstance(x, float) and not dtype.startswith("float"):
            return tirx.const(x, "float32")
        return tirx.const(x, dtype)
    return _expr(x)


def _number(x):
    tirx = _tir()
    if isinstance(x, (bool, np.bool_)):
        return tirx.const(bool(x), "bool")
    return tirx.const(x, "int32" if isinstance(x, (int, np.integer)) else "float32")


def _promote(a, b):
    """``a``, ``b`` as TIR expressions of one dtype (an int beside a float becomes float32)."""
    tirx = _tir()
    if not _is_tir(a) and not _is_tir(b):  # two Python numbers: constants of their own kinds
        a, b = _number(a), _number(b)
    a, b = _const_like(a, b), _const_like(b, a)
    da, db = _dtype(a), _dtype(b)
    if da != db:
        if da.startswith("float") or db.startswith("float"):
            a = a if da == "float32" else tirx.Cast("float32", a)
            b = b if db == "float32" else tirx.Cast("float32", b)
        else:
            a, b = tirx.Cast("int32", a), tirx.Cast("int32", b)
    return a, b


def _cond(x):
    """``x`` as a TIR boolean: a Python number or a non-bool expression is true when nonzero
    (NumPy's rule for where and the logical words)."""
    tirx = _tir()
    x = _expr(x)
    if isinstance(x, (bool, int, float, np.bool_, np.number)):
        return tirx.const(bool(x), "bool")
    return x if _dtype(x) == "bool" else tirx.NE(x, tirx.const(0, _dtype(x)))


def where(cond, a, b):
    if _is_tir(cond, a, b):
        return _tir().Select(_cond(cond), *_promote(a, b))
    return np.where(cond, a, b)


def _unary(numpy_fn, tir_fn):
    def fn(x):
        if _is_tir(x):
            x = _expr(x)
            return tir_fn(x)
        return numpy_fn(x)
    return fn


def _float(x):
    return x if _dtype(x) == "float32" else _tir().Cast("float32", x)


def _tir_exp(x):
    from .workloads._math import LOG2E, exp2_fast  # TIR's math: the reference runs without TVM
    tirx = _tir()
    # exp2_fast vectorizes (LLVM's exp is a libm call per lane), is exact at -inf (0) and keeps
    # NaN; its exponent field holds 2^127 at most, so past 127.49 (exp(x) > 2.4e38, a step from
    # float32's overflow) the answer is +inf
    t = _float(x) * tirx.const(LOG2E, "float32")
    return tirx.Select(t > tirx.const(127.49, "float32"), tirx.const(float("inf"), "float32"), exp2_fast(t))


def _tir_tanh(x):
    from .workloads._math import tanh_fast  # TIR's math: the reference runs without TVM
    return tanh_fast(_float(x))


def _tir_sigmoid(x):
    tirx = _tir()
    one = tirx.const(1.0, "float32")
    return one / (one + _tir_exp(-_float(x)))


abs = _unary(np.abs, lambda x: _tir().abs(x))  # noqa: A001 (the vocabulary's own abs)
exp = _unary(np.exp, _tir_exp)
log = _unary(np.log, lambda x: _tir().log(_float(x)))
tanh = _unary(np.tanh, _tir_tanh)
sqrt = _unary(np.sqrt, lambda x: _tir().sqrt(_float(x)))
floor = _unary(np.floor, lambda x: _tir().floor(_float(x)))
sigmoid = _unary(lambda x: 1.0 / (1.0 + np.exp(-x)), _tir_sigmoid)


def _binary(numpy_fn, tir_name: str, operands=None):
    """A two-argument word: NumPy's ``numpy_fn``, or TIR's ``tir_name`` over ``operands(a, b)``
    (default: one dtype, :func:`_promote`)."""
    def fn(a, b):
        if _is_tir(a, b):
            return getattr(_tir(), tir_name)(*(operands or _promote)(a, b))
        return numpy_fn(a, b)
    return fn


def _bools(a, b):
    return _cond(a), _cond(b)


minimum = _binary(np.minimum, "min")
maximum = _binary(np.maximum, "max")
logical_and = _binary(np.logical_and, "And", _bools)
logical_or = _binary(np.logical_or, "Or", _bools)


def logical_not(a):
    if _is_tir(a):
        return _tir().Not(_cond(a))
    return np.logical_not(a)


def _is_bool(x) -> bool:
    x = _expr(x)
    if isinstance(x, (bool, np.bool_)):
        return True
    if isinstance(x, np.ndarray):
        return x.dtype == np.bool_
    return _is_tir(x) and _dtype(x) == "bool"


def _and(a, b):  # ``a & b``: logical on booleans, bitwise on ints
    if _is_bool(a) and _is_bool(b):
        return logical_and(a, b)
    return _tir().bitwise_and(*_promote(a, b)) if _is_tir(a, b) else np.bitwise_and(a, b)


def _or(a, b):
    if _is_bool(a) and _is_bool(b):
        return logical_or(a, b)
    return _tir().bitwise_or(*_promote(a, b)) if _is_tir(a, b) else np.bitwise_or(a, b)


def _invert(a):
    if _is_bool(a):
        return logical_not(a)
    return _tir().bitwise_not(_expr(a)) if _is_tir(a) else np.invert(a)


def _never_zero(b, kind: str = "a modifier") -> None:
    """Refuse a divisor that is a constant zero once TVM simplifies it (``q - q``): TVM's
    constant folding fails on it deep in the build (``Check failed: … Divide by zero``).
    Literal zeros are refused when the spec is made (:func:`check_source`)."""
    from tvm.sym.analyzer import Analyzer  # TVM 0.27's arith analyzer (the reference runs without TVM)

    c = Analyzer().simplify(_expr(b))
    if isinstance(c, (_tir().IntImm, _tir().FloatImm)) and float(c.value) == 0.0:
        raise SpecError(f"{kind} divides by an expression that is always 0 ({b}); a divisor must not be "
                        "constant zero")


def _truediv(a, b):  # ``a / b``: true division, floats for ints too (NumPy's rule)
    if _is_tir(a, b):
        a, b = _promote(a, b)
        _never_zero(b)
        return _float(a) / _float(b)
    return np.true_divide(a, b)


def _int_division(a, b, floordiv: bool):
    """TIR ``a // b`` (``floordiv``) or ``a % b`` of int32 ``a``, ``b`` as NumPy computes them
    (``x // 0 == x % 0 == 0``), without the traps of x86's division: a divisor of 0, or
    −2³¹ // −1, would raise SIGFPE in the kernel. A divisor of 0 or −1 is replaced by 1 and the
    result chosen: 0, or ``−a`` (taken in int64 and cast back, so −(−2³¹) wraps as NumPy's
    does). A compiled-in divisor folds every select away."""
    tirx = _tir()
    zero, minus_one = tirx.EQ(b, tirx.const(0, "int32")), tirx.EQ(b, tirx.const(-1, "int32"))
    safe = tirx.Select(tirx.Or(zero, minus_one), tirx.const(1, "int32"), b)
    if floordiv:
        negated = tirx.Cast("int32", tirx.const(0, "int64") - tirx.Cast("int64", a))
        return tirx.Select(zero, tirx.const(0, "int32"), tirx.Select(minus_one, negated, tirx.floordiv(a, safe)))
    return tirx.Select(tirx.Or(zero, minus_one), tirx.const(0, "int32"), tirx.floormod(a, safe))


def _division(numpy_fn, floordiv: bool):
    """``a // b`` (``floordiv``) or ``a % b``: NumPy's floor division and modulo (the sign of the
    divisor), for floats as ``floor(a / b)`` and ``a − floor(a / b)·b`` (TIR has no float
    floordiv), for ints by :func:`_int_division`."""
    def fn(a, b):
        if _is_tir(a, b):
            a, b = _promote(a, b)
            if _dtype(a) == "float32":
                _never_zero(b)
                q = _tir().floor(a / b)
                return q if floordiv else a - q * b
            return _int_division(a, b, floordiv)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return numpy_fn(a, b)
    return fn


#: name -> function: what a modifier may call
VOCABULARY: dict[str, Callable] = {
    "where": where, "abs": abs, "min": minimum, "max": maximum, "minimum": minimum, "maximum": maximum,
    "exp": exp, "log": log, "tanh": tanh, "sqrt": sqrt, "sigmoid": sigmoid, "floor": floor,
    "logical_and": logical_and, "logical_or": logical_or, "logical_not": logical_not,
}
_HIDDEN = {"_and": _and, "_or": _or, "_invert": _invert, "_truediv": _truediv, "_land": logical_and,
           "_lor": logical_or, "_lnot": logical_not, "_where": where,
           "_floordiv": _division(np.floor_divide, True), "_modulo": _division(np.mod, False)}
_CONSTANTS = {"True": True, "False": False, "inf": math.inf, "pi": math.pi}


# -- source: canonical text, checks, the rewrite ---------------------------------------------------------
def source_of(fn: Any, kind: str) -> str:
    """The source text of a modifier given as a function or as text (a ``def`` or a ``lambda``),
    dedented and without decorators."""
    if isinstance(fn, str):
        text = textwrap.dedent(fn).strip()
    elif callable(fn):
        try:
            text = textwrap.dedent(inspect.getsource(fn)).strip()
        except (OSError, TypeError) as e:
            raise SpecError(f"{kind}: cannot read the source of {fn!r} ({e}); pass its text instead") from None
        if getattr(fn, "__name__", "") == "<lambda>":
            text = _lambda_text(text, kind)
    else:
        raise SpecError(f"{kind}: expected a function or its source text, got {type(fn).__name__}")
    return text


def _lambda_text(line: str, kind: str) -> str:
    # inspect gives the whole line of a lambda (``mask_mod=lambda b, h, q, kv: q >= kv,``): keep
    # the one lambda expression in it
    lambdas = []
    for start in [i for i in range(len(line)) if line.startswith("lambda", i)]:
        for end in range(len(line), start, -1):
            try:
                tree = ast.parse(line[start:end].strip(), mode="eval")
            except SyntaxError:
                continue
            if isinstance(tree.body, ast.Lambda):
                lambdas.append(line[start:end].strip())
                break
    if len(lambdas) != 1:
        raise SpecError(f"{kind}: cannot tell which lambda of {line!r} it is; pass its text instead")
    return lambdas[0]


#: The largest modifier source (characters) and the deepest nesting of its expressions (syntax
#: tree levels) a spec takes: a real modifier is a line or a few (a few hundred characters, under
#: 10 levels); past these, parsing, compiling and building it recurse without bound (a source
#: nested 100,000 deep raised MemoryError or RecursionError).
MAX_SOURCE_CHARS = 10_000
MAX_DEPTH = 64


def _function_node(text: str, kind: str):
    if len(text) > MAX_SOURCE_CHARS:
        raise SpecError(f"{kind}: the source has {len(text)} characters; a modifier may have at most "
                        f"{MAX_SOURCE_CHARS}")
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise SpecError(f"{kind}: not valid Python ({e.msg}, line {e.lineno}): {text!r}") from None
    except (RecursionError, MemoryError):
        raise SpecError(f"{kind}: nested too deeply to parse; a modifier's expressions may nest at most "
                        f"{MAX_DEPTH} levels") from None
    depth = _depth(tree)
    if depth > MAX_DEPTH:
        raise SpecError(f"{kind}: nested {depth} levels deep; a modifier's expressions may nest at most {MAX_DEPTH}")
    body = tree.body
    if len(body) == 1 and isinstance(body[0], ast.FunctionDef):
        return body[0]
    if len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Lambda):
        return body[0].value
    raise SpecError(f"{kind}: expected one function (a def or a lambda), got {text!r}")


def _depth(tree: ast.AST) -> int:
    """The syntax tree's levels, counted without recursion."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        stack.extend((child, d + 1) for child in ast.iter_child_nodes(node))
    return deepest


def check_source(text: str, kind: str, tensors: tuple[str, ...]) -> None:
    """Refuse, naming what is wrong, a modifier the kernel cannot compile: a source past
    ``MAX_SOURCE_CHARS`` or nested past ``MAX_DEPTH``, decorators, annotations, defaults, the
    wrong number of parameters, a name that is neither a parameter, a local, a tensor nor in the
    vocabulary, a construct outside the vocabulary, or a division by a constant zero."""
    node = _function_node(text, kind)
    args = node.args
    if isinstance(node, ast.FunctionDef):  # what the body check below does not see
        if node.decorator_list:
            raise SpecError(f"{kind}: decorators are not allowed (line {node.decorator_list[0].lineno}); pass the "
                            "plain function")
        if node.returns is not None or any(a.annotation is not None for a in args.args + args.posonlyargs
                                           + args.kwonlyargs):
            raise SpecError(f"{kind}: annotations are not allowed; parameters must be plain: "
                            f"{', '.join(PARAMS[kind])}")
        if getattr(node, "type_params", None):
            raise SpecError(f"{kind}: type parameters are not allowed")
    if args.vararg or args.kwarg or args.kwonlyargs or args.defaults or args.kw_defaults or args.posonlyargs:
        raise SpecError(f"{kind}: parameters must be plain (no defaults, *args, **kwargs or keyword-only): "
                        f"{', '.join(PARAMS[kind])}")
    names = [a.arg for a in args.args]
    if len(names) != len(PARAMS[kind]):
        raise SpecError(f"{kind} takes {len(PARAMS[kind])} parameters ({', '.join(PARAMS[kind])}), "
                        f"got {len(names)} ({', '.join(names)})")
    body = node.body if isinstance(node, ast.FunctionDef) else [ast.Return(node.body)]
    local = set(names)
    allowed = set(VOCABULARY) | set(_CONSTANTS) | set(tensors)
    for i, stmt in enumerate(body):
        last = i == len(body) - 1
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and i == 0:
            continue  # a docstring
        if isinstance(stmt, ast.Assign) and not last and all(isinstance(t, ast.Name) for t in stmt.targets):
            _check_expr(stmt.value, kind, local | allowed)
            local |= {t.id for t in stmt.targets}
            continue
        if isinstance(stmt, ast.Return) and last and stmt.value is not None:
            _check_expr(stmt.value, kind, local | allowed)
            continue
        raise SpecError(f"{kind}: line {getattr(stmt, 'lineno', '?')}: only assignments to names and a final "
                        f"return are allowed, got {ast.dump(stmt)[:60]}…")


_ALLOWED_NODES = (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Call, ast.Name, ast.Load,
                  ast.Constant, ast.Subscript, ast.Tuple, ast.operator, ast.unaryop, ast.boolop, ast.cmpop,
                  ast.expr_context)


def _check_expr(expr, kind: str, names: set[str]) -> None:
    for n in ast.walk(expr):
        if not isinstance(n, _ALLOWED_NODES) or isinstance(n, (ast.Pow, ast.MatMult, ast.LShift, ast.RShift,
                                                                 ast.Is, ast.IsNot, ast.In, ast.NotIn)):
            raise SpecError(f"{kind}: {type(n).__name__} is outside the modifiers' vocabulary "
                            f"(arithmetic, comparisons, and/or/not, x if c else y, and "
                            f"{', '.join(sorted(VOCABULARY))})")
        if isinstance(n, ast.Name) and n.id not in names:
            raise SpecError(f"{kind}: unknown name {n.id!r}; a modifier may use its parameters, the tensors the "
                            f"spec declares (mod_tensors) and {', '.join(sorted(VOCABULARY))}")
        if isinstance(n, ast.Call) and (not isinstance(n.func, ast.Name) or n.func.id not in VOCABULARY
                                        or n.keywords):
            what = n.func.id if isinstance(n.func, ast.Name) else ast.dump(n.func)[:40]
            raise SpecError(f"{kind}: calls {what}: a modifier may call only {', '.join(sorted(VOCABULARY))} "
                            "(positional arguments)")
        if isinstance(n, ast.Constant) and not isinstance(n.value, (int, float, bool)):
            raise SpecError(f"{kind}: constant {n.value!r}: only numbers and booleans")
        if isinstance(n, ast.Subscript) and not isinstance(n.value, ast.Name):
            raise SpecError(f"{kind}: only a declared tensor may be indexed")
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Div, ast.FloorDiv, ast.Mod)) \
                and _constant_value(n.right) == 0:
            raise SpecError(f"{kind}: divides by a constant zero ({ast.unparse(n)}); a divisor must not be 0")


_FOLDED = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.UAdd, ast.USub)


def _constant_value(expr) -> float | None:
    """The value of an expression of numbers and ``+ − * / // %`` alone (``0``, ``1 - 1``,
    ``-0.0``), else None (names, other operators, or arithmetic that fails)."""
    for n in ast.walk(expr):
        if isinstance(n, ast.Constant):
            if isinstance(n.value, bool) or not isinstance(n.value, (int, float)):
                return None
        elif isinstance(n, (ast.BinOp, ast.UnaryOp)):
            if not isinstance(n.op, _FOLDED):
                return None
        elif not isinstance(n, _FOLDED):
            return None
    try:
        return eval(compile(ast.Expression(expr), "<divisor>", "eval"), {"__builtins__": {}})  # noqa: S307
    except (ArithmeticError, MemoryError):
        return None


class _Rewrite(ast.NodeTransformer):
    """Python's control-flow operators as the vocabulary's calls, which build TIR as well as NumPy."""

    @staticmethod
    def _call(name, *args):
        return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        name = "_land" if isinstance(node.op, ast.And) else "_lor"
        out = node.values[0]
        for v in node.values[1:]:
            out = self._call(name, out, v)
        return out

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            return self._call("_lnot", node.operand)
        if isinstance(node.op, ast.Invert):
            return self._call("_invert", node.operand)
        return node

    def visit_IfExp(self, node):
        self.generic_visit(node)
        return self._call("_where", node.test, node.body, node.orelse)

    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) == 1:
            return node
        parts, left = [], node.left
        for op, right in zip(node.ops, node.comparators):
            parts.append(ast.Compare(left=left, ops=[op], comparators=[right]))
            left = right
        out = parts[0]
        for p in parts[1:]:
            out = self._call("_land", out, p)
        return out

    def visit_BinOp(self, node):
        self.generic_visit(node)
        op = {ast.BitAnd: "_and", ast.BitOr: "_or", ast.Div: "_truediv", ast.FloorDiv: "_floordiv",
              ast.Mod: "_modulo"}.get(type(node.op))
        return self._call(op, node.left, node.right) if op else node


@functools.lru_cache(maxsize=256)
def _code(text: str, kind: str):
    node = _function_node(text, kind)
    if isinstance(node, ast.Lambda):
        node = ast.FunctionDef(name="_mod", args=node.args, body=[ast.Return(node.body)], decorator_list=[],
                               returns=None, type_params=[])
    else:
        node.name = "_mod"
    module = ast.fix_missing_locations(ast.Module(body=[_Rewrite().visit(node)], type_ignores=[]))
    return compile(module, f"<{kind}>", "exec")


class Tensor:
    """An extra tensor as a modifier reads it: ``t[i, j]`` with every index clamped into the
    tensor's extent (NumPy array or TIR buffer)."""

    def __init__(self, name: str, data):
        self.name, self.data = name, data
        self.shape = tuple(data.shape)

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != len(self.shape):
            raise SpecError(f"mod tensor {self.name!r} has {len(self.shape)} dims, indexed with {len(idx)}")
        if isinstance(self.data, np.ndarray):
            return self.data[tuple(np.clip(np.asarray(i), 0, n - 1) for i, n in zip(idx, self.shape))]
        tirx = _tir()
        clamped = []
        for i, n in zip(idx, self.shape):
            i = _expr(i)
            i = tirx.const(i, "int32") if isinstance(i, int) else i
            clamped.append(tirx.max(tirx.const(0, "int32"), tirx.min(i, n - 1)))
        return self.data[tuple(clamped)]


def instantiate(text: str, kind: str, tensors: dict[str, Any]) -> Callable:
    """The modifier as a Python function whose extra tensors are ``tensors`` (name -> NumPy array
    or TIR buffer, read through :class:`Tensor`)."""
    scope = {**VOCABULARY, **_HIDDEN, **_CONSTANTS, "__builtins__": {}}
    scope.update({n: Tensor(n, t) for n, t in tensors.items()})
    exec(_code(text, kind), scope)  # noqa: S102 (the spec's own modifier, checked by check_source)
    fn = scope["_mod"]

    @functools.wraps(fn)
    def call(*args):
        return _expr(fn(*args))
    return call


def digest(*parts: Any) -> str:
    """Six hex digits naming modifiers in a short name."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:6]


def check_tensors(decls: Any) -> tuple[tuple[str, str, tuple], ...]:
    """``mod_tensors`` canonical: a tuple of ``(name, dtype, dims)``; a named error otherwise."""
    if decls is None:
        return ()
    out, seen = [], set()
    if isinstance(decls, (str, dict)) or not isinstance(decls, (tuple, list)):
        raise SpecError(f"mod_tensors must be a list of (name, dtype, dims), got {decls!r}")
    for d in decls:
        if isinstance(d, dict):
            d = (d.get("name"), d.get("dtype"), d.get("dims"))
        if not isinstance(d, (tuple, list)) or len(d) != 3:
            raise SpecError(f"mod_tensors: each entry is (name, dtype, dims), got {d!r}")
        name, dtype, dims = d
        if not isinstance(name, str) or not name.isidentifier() or name in VOCABULARY or name in _CONSTANTS \
                or name.startswith("_"):
            raise SpecError(f"mod_tensors: {name!r} is not a usable name (an identifier, not a vocabulary word)")
        if name in seen:
            raise SpecError(f"mod_tensors: {name!r} declared twice")
        seen.add(name)
        if dtype not in TENSOR_DTYPES:
            raise SpecError(f"mod_tensors: {name} has dtype {dtype!r}; supported: {', '.join(TENSOR_DTYPES)}")
        if isinstance(dims, (str, int)) or not isinstance(dims, (tuple, list)) or not dims:
            raise SpecError(f"mod_tensors: {name} dims must be a non-empty list, got {dims!r}")
        for x in dims:
            ok = (isinstance(x, int) and not isinstance(x, bool) and x > 0) or x in TENSOR_DIMS
            if not ok:
                raise SpecError(f"mod_tensors: {name} dim {x!r} must be a positive int or one of "
                                f"{', '.join(TENSOR_DIMS)}")
        out.append((name, dtype, tuple(dims)))
    return tuple(out)


def tensor_dim_name(name: str, axis: int) -> str:
    """The manifest's name of an extra tensor's symbolic dim (each is taken at call time)."""
    return f"{name}_dim{axis}"
