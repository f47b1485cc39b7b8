"""The derivative of a user's ``score_mod`` with respect to its score (issue 46), by forward-mode
differentiation over the modifiers' own vocabulary.

:func:`score_derivative` runs the modifier's body once more with its ``score`` a dual number
``(value, derivative)``; every word of the vocabulary (``tvm_attention.modifiers``) gets its rule,
written with the vocabulary's own functions, so one derivative serves the float64 NumPy
reference (arrays in, arrays out) and the kernel (TIR expressions in, TIR out), as the modifier
itself does:

=====================================  ============================================
``a ± b``, ``a·b``, ``a / b``          the sum, product and quotient rules
``where(c, a, b)``, ``x if c else y``  the chosen arm's derivative (``c`` is not differentiated)
``min``/``max`` (and ``minimum``…)     the chosen argument's (the first on a tie)
``abs``                                ``sign(x)`` (+1 at 0: a subgradient)
``exp log tanh sqrt sigmoid``          their derivatives
comparisons, ``and or not``            booleans: no derivative
``floor``, ``//``, ``%``, ``& | ~``    refused by name when the score reaches them (a step's
                                       derivative is 0 or undefined: almost surely not meant)
a tensor indexed by the score          refused by name
=====================================  ============================================

A derivative is a literal ``0`` until the score reaches it, so what does not depend on the score
costs nothing. The modifier's value is recomputed alongside (``(value, derivative)`` returned).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from . import modifiers as M
from .errors import SpecError

_ZERO = 0  # a derivative that does not depend on the score (folds away)


class Dual:
    """A value and its derivative by the score: NumPy arrays, TIR expressions or numbers."""

    __slots__ = ("v", "d")

    def __init__(self, v, d):
        self.v, self.d = v, d

    def __add__(self, o):
        o = _lift(o)
        return Dual(self.v + o.v, _sum(self.d, o.d))

    __radd__ = __add__

    def __sub__(self, o):
        o = _lift(o)
        return Dual(self.v - o.v, _sum(self.d, _neg(o.d)))

    def __rsub__(self, o):
        return _lift(o) - self

    def __mul__(self, o):
        o = _lift(o)
        return Dual(self.v * o.v, _sum(_mul(self.d, o.v), _mul(self.v, o.d)))

    __rmul__ = __mul__

    def __neg__(self):
        return Dual(-self.v, _neg(self.d))

    def __pos__(self):
        return self

    # comparisons compare values: a boolean has no derivative
    def __lt__(self, o):
        return self.v < _lift(o).v

    def __le__(self, o):
        return self.v <= _lift(o).v

    def __gt__(self, o):
        return self.v > _lift(o).v

    def __ge__(self, o):
        return self.v >= _lift(o).v

    def __eq__(self, o):  # noqa: D105 (a comparison, as NumPy's and TIR's)
        return self.v == _lift(o).v

    def __ne__(self, o):
        return self.v != _lift(o).v

    __hash__ = None

    def __bool__(self):
        raise SpecError("score_mod's derivative: the score is used as a Python truth value")


def _lift(x) -> Dual:
    return x if isinstance(x, Dual) else Dual(x, _ZERO)


def _is_zero(d) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and d == 0


def _typed(a, b):
    """``a``, ``b`` of one dtype where either is TIR (an int index beside a float derivative)."""
    return M._promote(a, b) if M._is_tir(a, b) else (a, b)


def _sum(a, b):
    if _is_zero(a) or _is_zero(b):
        return b if _is_zero(a) else a
    a, b = _typed(a, b)
    return a + b


def _neg(a):
    return a if _is_zero(a) else -a


def _mul(a, b):  # a derivative times a value (either side)
    if _is_zero(a) or _is_zero(b):
        return _ZERO
    a, b = _typed(a, b)
    return a * b


def _value(x):
    """A non-dual argument of a word: a Dual whose derivative is zero gives its value; one that
    carries the score is the caller's to refuse."""
    return x.v if isinstance(x, Dual) else x


def _refuse(word: str) -> Callable:
    base = {**M.VOCABULARY, **M._HIDDEN}[word]
    name = {"_floordiv": "//", "_modulo": "%", "_and": "&", "_or": "|", "_invert": "~"}.get(word, word)

    @functools.wraps(base)
    def fn(*args):
        if any(isinstance(a, Dual) and not _is_zero(a.d) for a in args):
            raise SpecError(f"score_mod's derivative: {name} of the score is a step (its derivative is 0 or "
                            "undefined); the backward refuses it: write the modifier without it")
        return base(*(_value(a) for a in args))
    return fn


def _truediv(a, b):
    a, b = _lift(a), _lift(b)
    v = M._truediv(a.v, b.v)
    d = _sum(M._truediv(a.d, b.v) if not _is_zero(a.d) else _ZERO,
             _neg(M._truediv(_mul(b.d, v), b.v)) if not _is_zero(b.d) else _ZERO)
    return Dual(v, d)


def _where(c, a, b):
    a, b = _lift(a), _lift(b)
    c = _value(c)
    v = M.where(c, a.v, b.v)
    if _is_zero(a.d) and _is_zero(b.d):
        return Dual(v, _ZERO)
    return Dual(v, M.where(c, 0.0 if _is_zero(a.d) else a.d, 0.0 if _is_zero(b.d) else b.d))


def _chooser(base: Callable, first_wins: Callable) -> Callable:
    def fn(a, b):
        a, b = _lift(a), _lift(b)
        v = base(a.v, b.v)
        if _is_zero(a.d) and _is_zero(b.d):
            return Dual(v, _ZERO)
        return Dual(v, M.where(first_wins(a.v, b.v), 0.0 if _is_zero(a.d) else a.d, 0.0 if _is_zero(b.d) else b.d))
    return fn


def _unary(base: Callable, rule: Callable) -> Callable:
    """``base`` on values; ``rule(x, y)`` its derivative at ``x`` (``y = base(x)``)."""
    def fn(x):
        if not isinstance(x, Dual):
            return base(x)
        y = base(x.v)
        return Dual(y, _ZERO if _is_zero(x.d) else _mul(rule(x.v, y), x.d))
    return fn


_minimum = _chooser(M.minimum, lambda a, b: a <= b)
_maximum = _chooser(M.maximum, lambda a, b: a >= b)

#: the vocabulary's words over duals (the module's table)
WORDS: dict[str, Callable] = {
    "where": _where, "_where": _where, "min": _minimum, "minimum": _minimum, "max": _maximum, "maximum": _maximum,
    "abs": _unary(M.abs, lambda x, y: M.where(x < 0, -1.0, 1.0)),
    "exp": _unary(M.exp, lambda x, y: y),
    "log": _unary(M.log, lambda x, y: M._truediv(1.0, x)),
    "tanh": _unary(M.tanh, lambda x, y: 1.0 - y * y),
    "sqrt": _unary(M.sqrt, lambda x, y: M._truediv(0.5, y)),
    "sigmoid": _unary(M.sigmoid, lambda x, y: y * (1.0 - y)),
    "_truediv": _truediv,
    **{w: _refuse(w) for w in ("floor", "_floordiv", "_modulo", "_and", "_or", "_invert")},
    **{w: (lambda base: lambda *a: base(*(_value(x) for x in a)))({**M.VOCABULARY, **M._HIDDEN}[w])
       for w in ("logical_and", "logical_or", "logical_not", "_land", "_lor", "_lnot")},
}


class _Tensor(M.Tensor):
    """A modifier's tensor over duals: indexed by the score, refused."""

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, Dual) and not _is_zero(i.d) for i in idx):
            raise SpecError(f"score_mod's derivative: tensor {self.name!r} is indexed by the score; the backward "
                            "refuses it")
        return super().__getitem__(tuple(_value(i) for i in idx))


def score_derivative(text: str, tensors: dict[str, Any]) -> Callable:
    """``fn(score, b, h, q_idx, kv_idx) -> (value, d value / d score)`` of the ``score_mod``
    source ``text`` over ``tensors`` (name -> NumPy array or TIR buffer): NumPy arrays or TIR
    expressions, as :func:`tvm_attention.modifiers.instantiate`'s. The derivative is a number, an
    array or an expression (0 where the result does not depend on the score). A word whose
    derivative is a step (the module's table) raises :class:`SpecError` naming it."""
    scope = {**M.VOCABULARY, **M._HIDDEN, **WORDS, **M._CONSTANTS, "__builtins__": {}}
    scope.update({n: _Tensor(n, t) for n, t in tensors.items()})
    exec(M._code(text, "score_mod"), scope)  # noqa: S102 (the spec's own modifier, checked by check_source)
    fn = scope["_mod"]

    def call(score, b, h, q_idx, kv_idx):
        out = _lift(fn(Dual(score, 1.0), b, h, q_idx, kv_idx))
        return M._expr(out.v), M._expr(out.d) if not isinstance(out.d, int) or isinstance(out.d, bool) else out.d
    return call
