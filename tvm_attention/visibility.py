"""Which keys a query row sees: the one definition, used by the float64 reference, every kernel's
mask predicate, the kernels' key-tile ranges, "does this row see any key", and the pair counts.

A sequence has ``seq_q`` query rows and ``seq_kv`` keys. Row ``i`` sits at **position**
``p = i + offset`` among the keys, ``offset = seq_kv − seq_q`` (bottom-right alignment, as in
FlashAttention ≥ 2.1 and a decode step against a cache: the last row is the last key). A row at
position ``p`` sees key ``j`` (``0 ≤ j < seq_kv``) iff

* ``j ≤ p + right`` when ``right ≥ 0`` (causal: ``right = 0``, ``j ≤ p``);
* ``j ≥ p − left`` when ``left ≥ 0`` (a sliding window, FlashAttention's ``window_size=(left,
  right)``; ``-1`` is unbounded);
* ``j ≥ start`` when the kernel takes a first visible key per sequence (``kv_start``, left
  padding: FlashAttention's ``cache_leftpad``), a call argument the methods take as ``start``.

Full attention is ``left = right = -1`` and no start. Rows at a negative position (``seq_q >
seq_kv``, causal) see no key and output zeros, as does a row whose window holds no key (a right
bound ``R > 0``: rows at ``p < −R``, open on the left or not).

The methods build their answer from ``+ − ≤ ≥ >`` and min/max alone, so one formula serves Python
ints, NumPy arrays and TIR expressions (a kernel's predicate is the same expression tree it always
was: the generated code does not depend on where the formula lives; a mask that is off emits
nothing). They answer ``None`` where nothing is hidden, so a kernel emits no mask for it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

_PLAIN = (bool, int, np.bool_, np.integer, np.ndarray)


@dataclasses.dataclass(frozen=True)
class Visibility:
    """The mask of a spec: ``Visibility.of(spec)``. ``causal`` and ``right == 0`` are the same
    thing (either sets the other)."""

    causal: bool
    left: int = -1  # keys before p − left are hidden (-1: none)
    right: int = -1  # keys after p + right are hidden (-1: none; causal: 0)
    starts: bool = False  # a first visible key per sequence (kv_start): methods take ``start``

    def __post_init__(self) -> None:
        if self.causal and self.right == -1:
            object.__setattr__(self, "right", 0)
        if self.right == 0:
            object.__setattr__(self, "causal", True)
        if self.causal and self.right != 0:
            raise ValueError(f"causal means right = 0, got right={self.right}")

    @classmethod
    def of(cls, spec: Any) -> "Visibility":
        left, right = getattr(spec, "window", None) or (-1, -1)
        return cls(causal=bool(spec.causal), left=left, right=right, starts=bool(getattr(spec, "kv_start", False)))

    @property
    def hides_keys(self) -> bool:
        """Whether some row may not see some key of its sequence (a kernel needs a mask)."""
        return self.right >= 0 or self.left >= 0 or self.starts

    @property
    def windowed(self) -> bool:
        """Whether keys before a row's position may be hidden (a left window or a start): a row
        tile's key-tile loop may then begin past the first tile."""
        return self.left >= 0 or self.starts

    # -- positions ---------------------------------------------------------------------------------
    @staticmethod
    def offset(seq_q: Any, seq_kv: Any) -> Any:
        """Row ``i`` sits at key position ``i + offset``: ``seq_kv − seq_q`` (bottom-right)."""
        return seq_kv - seq_q

    @staticmethod
    def position(row: Any, offset: Any) -> Any:
        return row + offset

    # -- predicates (TIR expressions, NumPy arrays or bools) ------------------------------------
    def sees(self, key: Any, pos: Any, start: Any = None) -> Any | None:
        """Whether a row at ``pos`` sees ``key`` (``key`` within the sequence); None: always."""
        conds = []
        if self.right >= 0:
            conds.append(key <= pos if self.right == 0 else key <= pos + self.right)
        if self.left >= 0:
            conds.append(key >= pos - self.left)
        if self.starts and start is not None:
            conds.append(key >= start)
        return _all(conds)

    def hides(self, key: Any, pos: Any, start: Any = None) -> Any | None:
        """The negation of :meth:`sees`: ``key`` is hidden from a row at ``pos``; None: never."""
        conds = []
        if self.right >= 0:
            conds.append(key > pos if self.right == 0 else key > pos + self.right)
        if self.left >= 0:
            conds.append(key < pos - self.left)
        if self.starts and start is not None:
            conds.append(key < start)
        return _any(conds)

    def sees_a_key(self, pos: Any, seq_kv: Any, start: Any = None) -> Any:
        """Whether a row at ``pos`` sees any of the sequence's ``seq_kv`` keys: the first key it
        may see (``max(0, p − left, start)``) is at most the last (``min(seq_kv − 1, p + right)``)."""
        if not self.windowed and self.right <= 0:
            # the forms of the plain kernels (kept as they were: their code hashes do not move);
            # a right bound R > 0 takes the general form below, where a row at p < −R sees no key
            return pos >= 0 if self.causal else seq_kv > 0
        conds = [seq_kv > 0]
        if self.right >= 0:
            conds.append(pos + self.right >= 0 if self.right else pos >= 0)
        if self.left >= 0:
            conds.append(pos - self.left < seq_kv)
        if self.starts and start is not None:
            conds.append(start < seq_kv)
            if self.right >= 0:
                conds.append(start <= pos + self.right if self.right else start <= pos)
        return _all(conds)

    # -- ranges --------------------------------------------------------------------------------------
    def key_end(self, end_pos: Any) -> Any | None:
        """Rows at positions below ``end_pos`` see no key at or past this one (None: every key
        may be seen): where a row tile's key-tile loop may stop."""
        if self.right < 0:
            return None
        return end_pos if self.right == 0 else end_pos + self.right

    def key_begin(self, first_pos: Any, start: Any = None) -> Any | None:
        """Rows at positions ``first_pos`` and up see no key before this one (None: key 0 may be
        seen; the answer may be negative): where a row tile's key-tile loop may begin."""
        terms = []
        if self.left >= 0:
            terms.append(first_pos - self.left if self.left else first_pos)
        if self.starts and start is not None:
            terms.append(start)
        if not terms:
            return None
        return terms[0] if len(terms) == 1 else _max(terms[0], terms[1])

    @staticmethod
    def tiles_to(key_end: Any, block_n: int) -> Any:
        """Key tiles of ``block_n`` keys that cover keys ``[0, key_end)``."""
        return (key_end + block_n - 1) // block_n if isinstance(key_end, (int, np.integer)) \
            else _floordiv(key_end + block_n - 1, block_n)

    @staticmethod
    def tiles_before(key_begin: Any, block_n: int) -> Any:
        """Key tiles of ``block_n`` keys wholly before key ``key_begin`` (0 for a negative one)."""
        if isinstance(key_begin, (int, np.integer)):
            return max(0, key_begin // block_n)
        return _max(0, _floordiv(key_begin, block_n))

    # -- counts and the reference mask --------------------------------------------------------------
    def key_range(self, pos: Any, seq_kv: int) -> tuple[Any, Any]:
        """NumPy: ``(lo, hi)`` the first and last key a row at ``pos`` may see (before any start);
        ``lo > hi`` when none."""
        lo = np.maximum(0, pos - self.left) if self.left >= 0 else np.zeros_like(pos)
        hi = np.minimum(seq_kv - 1, pos + self.right) if self.right >= 0 else np.full_like(pos, seq_kv - 1)
        return lo, hi

    def keys_seen(self, seq_q: int, seq_kv: int) -> np.ndarray:
        """``(seq_q,)`` int64: how many keys each row sees (with no start)."""
        if not self.hides_keys:
            return np.full(seq_q, seq_kv, np.int64)
        pos = self.position(np.arange(seq_q, dtype=np.int64), self.offset(seq_q, seq_kv))
        lo, hi = self.key_range(pos, seq_kv)
        return np.clip(hi - lo + 1, 0, seq_kv)

    def pairs(self, seq_q: int, seq_kv: int) -> int:
        """Visible (query, key) pairs of one sequence and head (with no start)."""
        return int(self.keys_seen(seq_q, seq_kv).sum())

    def mask(self, seq_q: int, seq_kv: int, start: Any = None) -> np.ndarray:
        """Boolean ``(seq_q, seq_kv)``: True where row ``i`` sees key ``j`` (``start``: the
        sequence's first visible key)."""
        pos = self.position(np.arange(seq_q)[:, None], self.offset(seq_q, seq_kv))
        seen = self.sees(np.arange(seq_kv)[None, :], pos, start)
        return np.ones((seq_q, seq_kv), bool) if seen is None else np.broadcast_to(seen, (seq_q, seq_kv)).copy()


def _all(conds: list) -> Any | None:
    return _fold(conds, np.logical_and, "And")


#: ``conds`` joined by "and" (bools, NumPy arrays or TIR expressions); None for none: the one fold
#: the kernels' other masks (tvm_attention.workloads.fused: key bounds, mask_mod) join with too
all_of = _all


def _any(conds: list) -> Any | None:
    return _fold(conds, np.logical_or, "Or")


def _fold(conds: list, numpy_op, tir_op: str) -> Any | None:
    """``conds`` joined by ``numpy_op`` (bools, arrays) or TIR's ``tir_op`` (expressions); None
    for no condition."""
    if not conds:
        return None
    out = conds[0]
    for c in conds[1:]:
        plain = isinstance(out, _PLAIN) and isinstance(c, _PLAIN)
        out = numpy_op(out, c) if plain else getattr(_tir(), tir_op)(out, c)
    return out


def _max(a: Any, b: Any) -> Any:
    if isinstance(a, _PLAIN) and isinstance(b, _PLAIN):
        return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)
    return _tir().max(a, b)


def _tir():
    from tvm import tirx  # TIR's And/Or/max, for kernel expressions only (the reference needs no TVM)

    return tirx


def _floordiv(a: Any, b: int) -> Any:
    from tvm.script import tirx as T  # TVMScript's floordiv, for the kernels' symbolic bounds

    return T.floordiv(a, b)
