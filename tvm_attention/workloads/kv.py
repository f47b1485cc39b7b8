"""Where a dense-query layout (q and o ``(B, H, Sq, D)``) keeps sequence ``b``'s keys: one class
per way of addressing K/V, named by the layout entry's ``addressing`` (``layouts.py``), so a kernel
addresses K/V through it and never branches on the layout itself. Defining a subclass registers
it under its class name (:data:`ADDRESSING`).

``X`` is the tuple of the layout's index buffers, in call order (bhsd: none; kvcache:
``(cache_seqlens,)``; paged: ``(block_table, cache_seqlens)``).
"""
from __future__ import annotations

from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from ..spec import AttentionSpec


#: ``KVLayout`` subclass name -> the class (a layout entry's ``addressing`` names one)
ADDRESSING: dict[str, type] = {}


def dim(spec: AttentionSpec, name: str):
    """``spec``'s dim ``name`` (batch, seq_q, seq_kv): its int, or a symbolic int32 var."""
    return tirx.Var(name, "int32") if name in spec.dynamic else getattr(spec, name)


class KVLayout:
    """K/V addressing of one layout. ``shape``: the K buffer's shape (V's has ``DV``, the spec's
    ``v_dim``, last); ``bound``: the keys one sequence's reads may span (the extent of its K/V
    regions)."""

    shape: tuple
    bound: Any

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        ADDRESSING[cls.__name__] = cls

    def __init__(self, spec: AttentionSpec, B, D: int):
        self.KH, self.D, self.DV = spec.kv_heads, D, spec.v_dim  # K's head dim, V's
        # keys a call appends to each sequence (spec.append: the kernel's seq_q, the rows of
        # k_new, set by the kernel that owns that var), counted in its length: cache_seqlens is
        # the length before the append
        self.new = 0

    def dim_values(self) -> dict:
        """The K/V dims of the layout entry (``layouts.py``) -> this kernel's values."""
        return {"kv_heads": self.KH}

    def length(self, X, b):
        """Keys of sequence ``b`` (an appending kernel's included)."""
        return X[-1][b] if isinstance(self.new, int) and not self.new else X[-1][b] + self.new

    def reads(self, K, V, X, b, kh, nh: int = 1) -> list:
        """The K/V (and index) regions sequence ``b``'s kv heads ``kh .. kh + nh`` read (explicit:
        the inferred ones would name the blocks' local buffers through the indirect indices)."""
        h = self._heads(kh, nh)
        return [K[b, h, 0:self.bound, 0:self.D], V[b, h, 0:self.bound, 0:self.DV]] + [x[b] for x in X]

    def index(self, X, b, kh, key, d) -> tuple:
        """The K/V index of key ``key``, column ``d`` of sequence ``b``'s kv head ``kh``."""
        return (b, kh, key, d)

    @staticmethod
    def _heads(kh, nh: int):
        return kh if nh == 1 else slice(kh, kh + nh)


class BHSD(KVLayout):
    """``K``/``V (B, KH, Skv, D)``: every sequence holds ``seq_kv`` keys."""

    def __init__(self, spec: AttentionSpec, B, D: int):
        super().__init__(spec, B, D)
        self.SK = dim(spec, "seq_kv")
        self.shape = (B, self.KH, self.SK, D)
        self.bound = self.SK

    def dim_values(self) -> dict:
        return {"kv_heads": self.KH, "seq_kv": self.SK}

    def length(self, X, b):
        return self.SK


class KVCache(KVLayout):
    """``K``/``V (B, KH, max_len, D)``; sequence ``b`` holds ``cache_seqlens[b]`` keys."""

    def __init__(self, spec: AttentionSpec, B, D: int):
        super().__init__(spec, B, D)
        self.ML = tirx.Var("max_len", "int32")
        self.shape = (B, self.KH, self.ML, D)
        self.bound = self.ML

    def dim_values(self) -> dict:
        return {"kv_heads": self.KH, "max_len": self.ML}


class Paged(KVLayout):
    """``K``/``V (num_pages, page_size, KH, D)``: key ``j`` of sequence ``b`` is row
    ``j % page_size`` of page ``block_table[b, j // page_size]``; ``cache_seqlens[b]`` keys."""

    def __init__(self, spec: AttentionSpec, B, D: int):
        super().__init__(spec, B, D)
        self.P = spec.page_size
        self.NP, self.MP = tirx.Var("num_pages", "int32"), tirx.Var("max_pages", "int32")
        self.shape = (self.NP, self.P, self.KH, D)
        self.bound = self.MP * self.P  # keys a block table row can address

    def dim_values(self) -> dict:
        return {"kv_heads": self.KH, "num_pages": self.NP, "page_size": self.P, "max_pages": self.MP}

    def reads(self, K, V, X, b, kh, nh: int = 1) -> list:
        h = self._heads(kh, nh)
        return [K[0:self.NP, 0:self.P, h, 0:self.D], V[0:self.NP, 0:self.P, h, 0:self.DV],
                X[0][b, 0:self.MP], X[1][b]]

    def index(self, X, b, kh, key, d) -> tuple:
        return (X[0][b, T.floordiv(key, self.P)], T.floormod(key, self.P), kh, d)


class LatentCache(KVCache):
    """MLA's ``kv_cache (B, max_len, D)``: one row per key for every head (kv head 0); V is the
    same buffer's first ``DV`` columns (``fused._dense_function`` aliases it)."""

    def __init__(self, spec: AttentionSpec, B, D: int):
        super().__init__(spec, B, D)
        self.shape = (B, self.ML, D)

    def reads(self, K, V, X, b, kh, nh: int = 1) -> list:
        return [K[b, 0:self.bound, 0:self.D], V[b, 0:self.bound, 0:self.DV]] + [x[b] for x in X]

    def index(self, X, b, kh, key, d) -> tuple:
        return (b, key, d)


class LatentPaged(Paged):
    """MLA's ``kv_pages (num_pages, page_size, D)``: key ``j`` of sequence ``b`` is row ``j %
    page_size`` of page ``block_table[b, j // page_size]``; V its first ``DV`` columns."""

    def __init__(self, spec: AttentionSpec, B, D: int):
        super().__init__(spec, B, D)
        self.shape = (self.NP, self.P, D)

    def reads(self, K, V, X, b, kh, nh: int = 1) -> list:
        return [K[0:self.NP, 0:self.P, 0:self.D], V[0:self.NP, 0:self.P, 0:self.DV], X[0][b, 0:self.MP], X[1][b]]

    def index(self, X, b, kh, key, d) -> tuple:
        return (X[0][b, T.floordiv(key, self.P)], T.floormod(key, self.P), d)


def kv_layout(spec: AttentionSpec, B, D: int) -> KVLayout:
    """The K/V addressing of ``spec``'s layout (its entry's ``addressing``), for batch ``B`` and
    head dim ``D``."""
    name = spec.layout_info.addressing
    if name not in ADDRESSING:
        raise ValueError(f"layout {spec.layout!r}: no K/V addressing class {name!r} in workloads.kv "
                         f"(known: {', '.join(ADDRESSING)}); a packed layout has its own frame")
    return ADDRESSING[name](spec, B, D)
