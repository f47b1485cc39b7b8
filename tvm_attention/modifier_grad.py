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

Derivatives are forward-mode over several seeds at once: the score, and (``wrt``) each read of a
float tensor that takes a gradient (a learned bias); a seed a value does not depend on is absent
from its derivatives, so it costs nothing. The modifier's value is recomputed alongside.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from . import modifiers as M
from .errors import SpecError

class Dual:
    """A value and its derivatives: ``d`` maps each seed (``"score"``, or a tensor read site
    ``(name, k)``) to the derivative by it (NumPy arrays, TIR expressions or numbers); a seed
    absent from ``d`` is a zero derivative, so what does not depend on a seed costs nothing."""

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
        return Dual(self.v * o.v, _sum(_scale(self.d, o.v), _scale(o.d, self.v)))

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
    return x if isinstance(x, Dual) else Dual(x, {})


def _typed(a, b):
    """``a``, ``b`` of one dtype where either is TIR (an int index beside a float derivative)."""
    return M._promote(a, b) if M._is_tir(a, b) else (a, b)


def _add(a, b):
    a, b = _typed(a, b)
    return a + b


def _times(a, b):
    a, b = _typed(a, b)
    return a * b


def _sum(a: dict, b: dict) -> dict:
    return {k: _add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}


def _neg(a: dict) -> dict:
    return {k: -x for k, x in a.items()}


def _scale(a: dict, v) -> dict:  # every derivative times a value
    return {k: _times(x, v) for k, x in a.items()}


def _where(c, a: dict, b: dict) -> dict:
    return {k: M.where(c, a.get(k, 0.0), b.get(k, 0.0)) for k in {**a, **b}}


def _value(x):
    """A non-dual argument of a word: a Dual whose derivative is zero gives its value; one that
    carries the score is the caller's to refuse."""
    return x.v if isinstance(x, Dual) else x


def _refuse(word: str) -> Callable:
    base = {**M.VOCABULARY, **M._HIDDEN}[word]
    name = {"_floordiv": "//", "_modulo": "%", "_and": "&", "_or": "|", "_invert": "~"}.get(word, word)

    @functools.wraps(base)
    def fn(*args):
        if any(isinstance(a, Dual) and a.d for a in args):
            raise SpecError(f"score_mod's derivative: {name} of the score is a step (its derivative is 0 or "
                            "undefined); the backward refuses it: write the modifier without it")
        return base(*(_value(a) for a in args))
    return fn


def _truediv(a, b):
    a, b = _lift(a), _lift(b)
    v = M._truediv(a.v, b.v)
    # (a / b)' = a' / b − b'·v / b
    d = _sum({k: M._truediv(x, b.v) for k, x in a.d.items()}, _neg({k: M._truediv(_times(x, v), b.v)
                                                                   for k, x in b.d.items()}))
    return Dual(v, d)


def _choose(c, a, b):
    a, b = _lift(a), _lift(b)
    c = _value(c)
    return Dual(M.where(c, a.v, b.v), _where(c, a.d, b.d))


def _chooser(base: Callable, first_wins: Callable) -> Callable:
    def fn(a, b):
        a, b = _lift(a), _lift(b)
        return Dual(base(a.v, b.v), _where(first_wins(a.v, b.v), a.d, b.d))
    return fn


def _unary(base: Callable, rule: Callable) -> Callable:
    """``base`` on values; ``rule(x, y)`` its derivative at ``x`` (``y = base(x)``)."""
    def fn(x):
        if not isinstance(x, Dual):
            return base(x)
        y = base(x.v)
        return Dual(y, _scale(x.d, rule(x.v, y)) if x.d else {})
    return fn


_minimum = _chooser(M.minimum, lambda a, b: a <= b)
_maximum = _chooser(M.maximum, lambda a, b: a >= b)

#: the vocabulary's words over duals (the module's table)
WORDS: dict[str, Callable] = {
    "where": _choose, "_where": _choose, "min": _minimum, "minimum": _minimum, "max": _maximum, "maximum": _maximum,
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
    """A modifier's tensor over duals: indexed by the score, refused; with ``sites`` (a list),
    each read is a seed of its own, ``(name, k)``, whose clamped index ``sites`` records."""

    def __init__(self, name: str, data, sites: list | None = None):
        super().__init__(name, data)
        self.sites = sites

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, Dual) and i.d for i in idx):
            raise SpecError(f"score_mod's derivative: tensor {self.name!r} is indexed by the score; the backward "
                            "refuses it")
        idx = tuple(_value(i) for i in idx)
        v = super().__getitem__(idx)
        if self.sites is None:
            return v
        seed = (self.name, len(self.sites))
        self.sites.append((seed, _clamped(idx, self.shape)))
        return Dual(v, {seed: 1.0})


def _clamped(idx: tuple, shape: tuple) -> tuple:
    """The element a read takes (``modifiers.Tensor`` clamps every index into the extent)."""
    if M._is_tir(*idx) or not all(isinstance(n, int) for n in shape):
        tirx = M._tir()
        return tuple(tirx.max(tirx.const(0, "int32"), tirx.min(M._expr(i) if not isinstance(i, int)
                                                                else tirx.const(i, "int32"), n - 1))
                     for i, n in zip(idx, shape))
    return tuple(np.clip(np.asarray(i), 0, n - 1) for i, n in zip(idx, shape))


def score_derivative(text: str, tensors: dict[str, Any], wrt: tuple[str, ...] = ()) -> Callable:
    """``fn(score, b, h, q_idx, kv_idx) -> (value, d value / d score, reads)`` of the ``score_mod``
    source ``text`` over ``tensors`` (name -> NumPy array or TIR buffer): NumPy arrays or TIR
    expressions, as :func:`tvm_attention.modifiers.instantiate`'s. The derivative is a number, an
    array or an expression (0 where the result does not depend on the score). ``reads``: for each
    read of a tensor named in ``wrt``, ``(name, index, d value / d read)`` (the index clamped as
    the read takes it). A word whose derivative is a step (the module's table) raises
    :class:`SpecError` naming it."""
    scope = {**M.VOCABULARY, **M._HIDDEN, **WORDS, **M._CONSTANTS, "__builtins__": {}}
    sites: list = []
    scope.update({n: _Tensor(n, t, sites if n in wrt else None) for n, t in tensors.items()})
    exec(M._code(text, "score_mod"), scope)  # noqa: S102 (the spec's own modifier, checked by check_source)
    fn = scope["_mod"]

    def call(score, b, h, q_idx, kv_idx):
        sites.clear()
        out = _lift(fn(Dual(score, {"score": 1.0}), b, h, q_idx, kv_idx))
        reads = [(seed[0], idx, M._expr(out.d.get(seed, 0.0))) for seed, idx in sites]
        return M._expr(out.v), M._expr(out.d.get("score", 0)), reads
    return call
