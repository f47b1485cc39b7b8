"""Which keys a query row sees: the one definition, used by the float64 reference, every kernel's
mask predicate, the kernels' key-tile ranges, "does this row see any key", and the pair counts.

A sequence has ``seq_q`` query rows and ``seq_kv`` keys. Row ``i`` sits at **position**
``i + offset`` among the keys, ``offset = seq_kv − seq_q`` (bottom-right alignment, as in
FlashAttention ≥ 2.1 and a decode step against a cache: the last row is the last key). A row at
position ``p`` sees key ``j`` (``0 ≤ j < seq_kv``) iff

* full attention: always;
* causal: ``j ≤ p``.

Rows at a negative position (``seq_q > seq_kv``, causal) see no key and output zeros.

The methods build their answer from ``+ − ≤ ≥ >`` alone, so one formula serves Python ints,
NumPy arrays and TIR expressions (a kernel's predicate is the same expression tree it always
was: the generated code does not depend on where the formula lives). They answer ``None`` where
nothing is hidden, so a kernel emits no mask for it. Masks beyond causal (sliding windows, a
first visible key per sequence) extend this class: every user goes through it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Visibility:
    """The mask of a spec: ``Visibility.of(spec)``."""

    causal: bool

    @classmethod
    def of(cls, spec: Any) -> "Visibility":
        return cls(causal=bool(spec.causal))

    @property
    def hides_keys(self) -> bool:
        """Whether some row may not see some key of its sequence (a kernel needs a mask)."""
        return self.causal

    # -- positions ---------------------------------------------------------------------------------
    @staticmethod
    def offset(seq_q: Any, seq_kv: Any) -> Any:
        """Row ``i`` sits at key position ``i + offset``: ``seq_kv − seq_q`` (bottom-right)."""
        return seq_kv - seq_q

    @staticmethod
    def position(row: Any, offset: Any) -> Any:
        return row + offset

    # -- predicates (TIR expressions, NumPy arrays or bools) ------------------------------------
    def sees(self, key: Any, pos: Any) -> Any | None:
        """Whether a row at ``pos`` sees ``key`` (``key`` within the sequence); None: always."""
        return key <= pos if self.causal else None

    def hides(self, key: Any, pos: Any) -> Any | None:
        """The negation of :meth:`sees`: ``key`` is hidden from a row at ``pos``; None: never."""
        return key > pos if self.causal else None

    def sees_a_key(self, pos: Any, seq_kv: Any) -> Any:
        """Whether a row at ``pos`` sees any of the sequence's ``seq_kv`` keys."""
        return pos >= 0 if self.causal else seq_kv > 0

    # -- ranges --------------------------------------------------------------------------------------
    def key_end(self, end_pos: Any) -> Any | None:
        """Rows at positions below ``end_pos`` see no key at or past this one (None: every key
        may be seen): where a row tile's key-tile loop may stop."""
        return end_pos if self.causal else None

    @staticmethod
    def tiles_to(key_end: Any, block_n: int) -> Any:
        """Key tiles of ``block_n`` keys that cover keys ``[0, key_end)``."""
        return (key_end + block_n - 1) // block_n if isinstance(key_end, (int, np.integer)) \
            else _floordiv(key_end + block_n - 1, block_n)

    # -- counts and the reference mask --------------------------------------------------------------
    def keys_seen(self, seq_q: int, seq_kv: int) -> np.ndarray:
        """``(seq_q,)`` int64: how many keys each row sees."""
        if not self.causal:
            return np.full(seq_q, seq_kv, np.int64)
        pos = self.position(np.arange(seq_q, dtype=np.int64), self.offset(seq_q, seq_kv))
        return np.clip(pos + 1, 0, seq_kv)

    def pairs(self, seq_q: int, seq_kv: int) -> int:
        """Visible (query, key) pairs of one sequence and head."""
        return int(self.keys_seen(seq_q, seq_kv).sum())

    def mask(self, seq_q: int, seq_kv: int) -> np.ndarray:
        """Boolean ``(seq_q, seq_kv)``: True where row ``i`` sees key ``j``."""
        pos = self.position(np.arange(seq_q)[:, None], self.offset(seq_q, seq_kv))
        seen = self.sees(np.arange(seq_kv)[None, :], pos)
        return np.ones((seq_q, seq_kv), bool) if seen is None else np.broadcast_to(seen, (seq_q, seq_kv)).copy()


def _floordiv(a: Any, b: int) -> Any:
    from tvm.script import tirx as T  # TVMScript's floordiv, for the kernels' symbolic bounds

    return T.floordiv(a, b)
