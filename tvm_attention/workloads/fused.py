"""The fused (FlashAttention-style) PrimFunc: QKᵀ, softmax and PV share one tile.

For each (batch, head, row tile of ``block_m`` query rows) the kernel streams K/V column
tiles of ``block_n`` keys. The transposed query tile, the score tile, the running max ``m``,
the running sum ``l`` and the output accumulator live in ``local`` buffers of the
``row_tile`` block; nothing of size seq_q × seq_kv exists anywhere.

The score tile is kept transposed, ``St[block_n, block_m]`` (key-major), so that every
row-wise softmax reduction is an element-wise vector op across query rows and the QKᵀ
product broadcasts one K element against a vector of query rows; no K transpose is needed.

Online softmax, per K/V tile (``m`` and scores in log2 units: q is pre-scaled by
``scale·log2(e)`` so ``exp`` becomes ``exp2``)::

    m_new = max(m, rowmax(S))                    # row_max
    m_ref = 0 if m_new == -inf else m_new         # guard: a fully masked tile cannot make NaN
    alpha = exp2(m - m_ref)                       # online_correction
    P = exp2(S - m_ref)                           # P_exp (masked entries are exactly 0)
    l = l·alpha + rowsum(P)                       # row_sum
    acc = acc·alpha + P·V                         # PV_gemm

and finally ``O = acc / l`` (``0`` for a row the mask gives no key; NaN in gives NaN out).

Named blocks, found by name in ``schedules/``: ``row_tile`` (one per (b, h, row tile); holds the
local buffers), ``Q_load``, ``state_init``, ``acc_init``, ``kv_tile`` (one per key tile), and in
it ``S_gemm``, ``row_max``, ``online_correction``, ``max_commit``, ``P_exp``, ``row_sum``, ``PV_gemm``; then
``O_store``. Inside ``kv_tile`` each buffer has a single writer, so ``S_gemm``, ``row_max``,
``row_sum`` and ``PV_gemm`` are reductions whose ``init`` holds the correction
(``l·alpha``, ``acc·alpha``) and ``decompose_reduction`` can hoist it.
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ..spec import AttentionSpec
from ._math import LOG2E, exp2_fast, guarded, normalize, normalize_where

ENTRY = "attention"


def fused_attention(spec: AttentionSpec, block_m: int, block_n: int, decode_rows: int = 0) -> tirx.PrimFunc:
    """Build the fused PrimFunc for ``spec`` with row tile ``block_m`` and key tile ``block_n``.

    Arguments of the PrimFunc (call order) are the layout's (``tvm_attention.layouts``); bhsd:
    ``Q (B, H, Sq, D)``, ``K (B, KH, Skv, D)``, ``V (B, KH, Skv, D)``, ``O (B, H, Sq, D)``; all
    ``spec.dtype``, compact row-major. A dim in ``spec.dynamic`` is a symbolic ``T.int32`` var.

    ``decode_rows`` (bhsd with a symbolic seq_q): also emit a GQA-packed decode nest for calls
    with ``seq_q · group ≤ decode_rows`` (see :func:`_bhsd`); 0: none.
    """
    if decode_rows and spec.layout == "bhsd" and "seq_q" in spec.dynamic:
        return _bhsd(spec, block_m, block_n, decode_rows)
    return FRAMES[spec.layout](spec, block_m, block_n)


def _dim(spec: AttentionSpec, name: str):
    """A spec dim: its int, or a symbolic int32 var of that name when ``spec.dynamic`` has it."""
    return tirx.Var(name, "int32") if name in spec.dynamic else getattr(spec, name)


class _Tile:
    """Where one row tile finds its rows and keys: what a layout changes (the recurrence is the
    same for every layout). Index methods return index tuples into Q, K/V and O."""

    def __init__(self, spec, BM, BN, row0, q_len, k_len, q_index, kv_index, o_index, always_masked, valid=None,
                 pos=None, seq_q=None):
        self.spec, self.BM, self.BN = spec, BM, BN
        # pos: tile row -> query position, when a tile row is not one position (GQA packing:
        # row p is position p // group of head p % group); None: the identity
        self.pos = pos
        self.row0, self.q_len, self.k_len = row0, q_len, k_len
        self._q, self._kv, self._o = q_index, kv_index, o_index
        self.static = isinstance(k_len, int) and isinstance(q_len, int)  # lengths compiled in
        self.kv_tail = always_masked or not self.static or k_len % BN != 0
        self.masked = spec.causal or self.kv_tail
        self.valid = valid  # None, or an expr: this tile has rows (varlen's empty slots do not)
        self.seq_q = q_len if seq_q is None else seq_q  # query positions (packed rows: q_len / group)

    def n_tiles(self, nc):
        # Causal: a row tile's last row (row0 + BM - 1) sees keys up to row0 + BM - 1 + off, so
        # later tiles are entirely masked and skipped, not computed and thrown away.
        BM, BN = self.BM, self.BN
        n = nc if isinstance(self.k_len, int) else T.floordiv(self.k_len + BN - 1, BN)
        if self.spec.causal and self.pos is not None:
            off = self.k_len - self.seq_q
            n = T.max(0, T.min(n, T.floordiv(self.pos(self.row0 + BM - 1) + off + BN, BN)))
        elif self.spec.causal:
            off = self.k_len - self.q_len
            n = T.max(0, T.min(n, T.floordiv(self.row0 + BM + off + BN - 1, BN)))
        if self.valid is not None:
            n = T.Select(self.valid, n, 0)
        return n

    def q_at(self, vi, vd):
        return self._q(T.min(self.row0 + vi, self.q_len - 1), vd)

    def kv_at(self, c, vj, vd):
        # Clamp the tail tile's key index into range: those scores are masked anyway, and the
        # clamp costs one scalar min per key instead of a branch per element.
        if self.kv_tail:
            return self._kv(T.min(c * self.BN + vj, self.k_len - 1), vd)
        return self._kv(c * self.BN + vj, vd)

    def o_at(self, vi, vd):
        return self._o(self.row0 + vi, vd)

    def keep(self, vi):
        return self.row0 + vi < self.q_len

    def score(self, S, vj, vi, vc):
        # S with masked entries at -inf: keys past the sequence (tail tile) and, when causal, keys
        # right of the bottom-right diagonal. Unmasked specs read S unchanged.
        if not self.masked:
            return S[vj, vi]
        col = vc * self.BN + vj
        cond = col < self.k_len
        if self.spec.causal and self.pos is not None:
            cond = T.And(cond, col <= self.pos(self.row0 + vi) + (self.k_len - self.seq_q))
        elif self.spec.causal:
            cond = T.And(cond, col <= self.row0 + vi + (self.k_len - self.q_len))
        return T.Select(cond, S[vj, vi], T.float32(float("-inf")))

    def out(self, acc, l, vi):
        """``acc / l``, or 0 for a row the mask gives no key (see ``normalize``)."""
        row = self.row0 + vi
        if self.static:
            return normalize(acc, l, row, self.spec)
        if self.spec.causal and self.pos is not None:
            return normalize_where(acc, l, self.pos(row) + (self.k_len - self.seq_q) >= 0)
        if self.spec.causal:
            return normalize_where(acc, l, row + (self.k_len - self.q_len) >= 0)
        return normalize_where(acc, l, self.k_len > 0)


#: Block names of the tile, found by name in schedules/ (a second nest of the same function
#: carries a suffix: ``S_gemm_dec``).
TILE_BLOCKS = ("Q_load", "state_init", "acc_init", "kv_tile", "S_gemm", "row_max", "online_correction",
               "max_commit", "P_exp", "row_sum", "PV_gemm", "O_store")
#: Suffix of the GQA-packed decode nest's blocks (``row_tile_dec``, ``S_gemm_dec``...).
DECODE = "_dec"


def _tile_macro(spec: AttentionSpec, BM: int, BN: int, suffix: str = ""):
    """The per-row-tile pipeline (Q load, online softmax over key tiles, store) as a TVMScript
    macro: one piece of compute that every layout's frame calls with its own :class:`_Tile`.
    ``suffix`` is appended to every block name (a function may hold two nests of the tile)."""
    N = {n: n + suffix for n in TILE_BLOCKS}
    D = spec.head_dim
    qscale = float(spec.scale * LOG2E)
    neg_inf = T.float32(float("-inf"))

    @T.macro
    def tile(Q, K, V, O, t, nc):
        Qt = T.sblock_alloc_buffer((D, BM), "float32", scope="local")  # q tile, transposed
        S = T.sblock_alloc_buffer((BN, BM), "float32", scope="local")  # scores, key-major
        P = T.sblock_alloc_buffer((BN, BM), "float32", scope="local")  # probabilities
        m = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # running max (log2 units)
        m_new = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # max after this tile
        l = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # running sum
        alpha = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # exp2(m_old - m_new)
        acc = T.sblock_alloc_buffer((BM, D), "float32", scope="local")  # unnormalised output

        for d, i in T.grid(D, BM):
            with T.sblock(N["Q_load"]):
                vd, vi = T.axis.remap("SS", [d, i])
                Qt[vd, vi] = Q[t.q_at(vi, vd)] * T.float32(qscale)
        for i in T.serial(BM):
            with T.sblock(N["state_init"]):
                vi = T.axis.remap("S", [i])
                m[vi] = neg_inf
                l[vi] = T.float32(0)
        for i, d in T.grid(BM, D):
            with T.sblock(N["acc_init"]):
                vi, vd = T.axis.remap("SS", [i, d])
                acc[vi, vd] = T.float32(0)

        for c in T.serial(t.n_tiles(nc)):
            with T.sblock(N["kv_tile"]):
                # The key-tile loop carries m, l and acc from one tile to the next: a
                # reduction over tiles. Inside it each buffer has exactly one writer
                # block, so every stage is a proper (decomposable) reduction.
                vc = T.axis.reduce(nc, c)
                # -- S = Q·Kᵀ (scaled, log2 units) ---------------------------------------
                for j, d, i in T.grid(BN, D, BM):
                    with T.sblock(N["S_gemm"]):
                        vj, vd, vi = T.axis.remap("SRS", [j, d, i])
                        with T.init():
                            S[vj, vi] = T.float32(0)
                        S[vj, vi] = S[vj, vi] + K[t.kv_at(vc, vj, vd)] * Qt[vd, vi]
                # -- running max over the visible keys ---------------------------------
                for j, i in T.grid(BN, BM):
                    with T.sblock(N["row_max"]):
                        vj, vi = T.axis.remap("RS", [j, i])
                        with T.init():
                            m_new[vi] = m[vi]
                        m_new[vi] = T.max(m_new[vi], t.score(S, vj, vi, vc))
                # -- online correction factor; the guard keeps -inf - -inf out ----------
                for i in T.serial(BM):
                    with T.sblock(N["online_correction"]):
                        vi = T.axis.remap("S", [i])
                        alpha[vi] = exp2_fast(m[vi] - guarded(m_new[vi]))
                for i in T.serial(BM):
                    with T.sblock(N["max_commit"]):
                        vi = T.axis.remap("S", [i])
                        m[vi] = m_new[vi]
                # -- P = exp2(S - m_new); masked entries are exactly 0 -------------------
                for j, i in T.grid(BN, BM):
                    with T.sblock(N["P_exp"]):
                        vj, vi = T.axis.remap("SS", [j, i])
                        P[vj, vi] = exp2_fast(t.score(S, vj, vi, vc) - guarded(m_new[vi]))
                # -- l = l·alpha + rowsum(P) -------------------------------------------
                for j, i in T.grid(BN, BM):
                    with T.sblock(N["row_sum"]):
                        vj, vi = T.axis.remap("RS", [j, i])
                        with T.init():
                            l[vi] = l[vi] * alpha[vi]
                        l[vi] = l[vi] + P[vj, vi]
                # -- acc = acc·alpha + P·V ---------------------------------------------
                for i, j, d in T.grid(BM, BN, D):
                    with T.sblock(N["PV_gemm"]):
                        vi, vj, vd = T.axis.remap("SRS", [i, j, d])
                        with T.init():
                            acc[vi, vd] = acc[vi, vd] * alpha[vi]
                        acc[vi, vd] = acc[vi, vd] + P[vj, vi] * V[t.kv_at(vc, vj, vd)]

        for i, d in T.grid(BM, D):
            with T.sblock(N["O_store"]):
                vi, vd = T.axis.remap("SS", [i, d])
                T.where(t.keep(i))
                O[t.o_at(vi, vd)] = t.out(acc[vi, vd], l[vi], vi)

    return tile


def _bhsd(spec: AttentionSpec, block_m: int, block_n: int, decode_rows: int = 0) -> tirx.PrimFunc:
    """Dense layout: one row tile per (batch, head, block of ``block_m`` query rows).

    With ``decode_rows`` (symbolic seq_q only) the function holds a second nest, taken at run
    time when ``seq_q · group ≤ decode_rows`` (decode: one or a few new tokens per sequence). Its
    tile packs the ``group`` query heads that share a kv head (row ``p`` is position ``p //
    group`` of head ``kv_head·group + p % group``), ``decode_rows`` rows per tile, one tile per
    (batch, kv head): a decode step computes ``decode_rows`` rows per kv head instead of
    ``block_m`` per query head, and reads each K/V tile once for the whole group.
    """
    B, H, KH = _dim(spec, "batch"), spec.heads, spec.kv_heads
    SQ, SK, D = _dim(spec, "seq_q"), _dim(spec, "seq_kv"), spec.head_dim
    G = spec.group_size
    BM, BN = block_m, block_n
    NR = T.floordiv(SQ + BM - 1, BM) if not isinstance(SQ, int) else math.ceil(SQ / BM)  # row tiles
    NC = T.floordiv(SK + BN - 1, BN) if not isinstance(SK, int) else math.ceil(SK / BN)  # key tiles
    dtype = spec.dtype
    tile = _tile_macro(spec, BM, BN)

    def at(vb, vh, vr):
        return _Tile(
            spec, BM, BN, vr * BM, SQ, SK,
            q_index=lambda row, d: (vb, vh, row, d),
            kv_index=lambda key, d: (vb, vh // G, key, d),
            o_index=lambda row, d: (vb, vh, row, d),
            always_masked=False,
        )

    @T.macro
    def main_nest(Q, K, V, O):
        for b, h, r in T.grid(B, H, NR):
            with T.sblock("row_tile"):
                vb, vh, vr = T.axis.remap("SSS", [b, h, r])
                T.reads(Q[vb, vh, 0:SQ, 0:D], K[vb, vh // G, 0:SK, 0:D], V[vb, vh // G, 0:SK, 0:D])
                T.writes(O[vb, vh, 0:SQ, 0:D])
                tile(Q, K, V, O, at(vb, vh, vr), NC)

    if not decode_rows:
        @T.prim_func(s_tir=True)
        def attention(
            Q: T.Buffer((B, H, SQ, D), dtype),
            K: T.Buffer((B, KH, SK, D), dtype),
            V: T.Buffer((B, KH, SK, D), dtype),
            O: T.Buffer((B, H, SQ, D), dtype),
        ):
            T.func_attr({"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused",
                         "attn.block_m": BM, "attn.block_n": BN})
            main_nest(Q, K, V, O)

        return attention

    BD = decode_rows
    tile_dec = _tile_macro(spec, BD, BN, DECODE)

    def packed(vb, vkh):
        # One tile per (batch, kv head) holds all SQ·G packed rows: row p is position p // G of
        # query head vkh·G + p % G.
        return _Tile(
            spec, BD, BN, 0, SQ * G, SK,
            q_index=lambda p, d: (vb, vkh * G + T.floormod(p, G), T.floordiv(p, G), d),
            kv_index=lambda key, d: (vb, vkh, key, d),
            o_index=lambda p, d: (vb, vkh * G + T.floormod(p, G), T.floordiv(p, G), d),
            always_masked=True,
            pos=lambda p: T.floordiv(p, G),
            seq_q=SQ,
        )

    @T.prim_func(s_tir=True)
    def attention_with_decode(
        Q: T.Buffer((B, H, SQ, D), dtype),
        K: T.Buffer((B, KH, SK, D), dtype),
        V: T.Buffer((B, KH, SK, D), dtype),
        O: T.Buffer((B, H, SQ, D), dtype),
    ):
        T.func_attr({"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused",
                     "attn.block_m": BM, "attn.block_n": BN, "attn.decode_rows": BD})
        if SQ * G <= BD:
            for b, kh in T.grid(B, KH):
                with T.sblock("row_tile" + DECODE):
                    vb, vkh = T.axis.remap("SS", [b, kh])
                    T.reads(Q[vb, vkh * G:vkh * G + G, 0:SQ, 0:D], K[vb, vkh, 0:SK, 0:D], V[vb, vkh, 0:SK, 0:D])
                    T.writes(O[vb, vkh * G:vkh * G + G, 0:SQ, 0:D])
                    tile_dec(Q, K, V, O, packed(vb, vkh), NC)
        else:
            main_nest(Q, K, V, O)

    return attention_with_decode


def _varlen(spec: AttentionSpec, block_m: int, block_n: int) -> tirx.PrimFunc:
    """FlashAttention's packed varlen layout: ``Q (total_q, H, D)``, ``K``/``V (total_k, KH, D)``,
    ``cu_seqlens_q``/``cu_seqlens_k (batch+1,) int32``, ``O (total_q, H, D)``.

    Work is one task per (head, tile slot). Sequence ``b``'s row tiles take the slots
    ``cu_seqlens_q[b] // block_m + b + i`` (strictly increasing in ``b``, and a sequence of
    ``L`` rows needs at most ``L // block_m + 1`` of them), so the slots number at most
    ``total_q // block_m + batch`` and a task finds its sequence by a binary search on
    ``cu_seqlens_q``. Empty slots compute nothing. Heads are the outer loop, so a static split of
    the parallel loop gives every core whole heads, each with the same mix of long and short
    sequences: a batch of one 2k-token sequence and many short ones stays balanced.
    """
    H, KH, D = spec.heads, spec.kv_heads, spec.head_dim
    G = spec.group_size
    BM, BN = block_m, block_n
    TQ, TK = tirx.Var("total_q", "int32"), tirx.Var("total_k", "int32")
    # The buffer shape must be a plain var for the runtime to bind it: cu_seqlens has batch+1.
    NB1 = tirx.Var("batch_plus_1", "int32")
    NB = NB1 - 1
    NT = T.floordiv(TQ, BM) + NB  # tile slots
    NC = T.floordiv(TK + BN - 1, BN)  # bound on any sequence's key tiles
    dtype = spec.dtype
    tile = _tile_macro(spec, BM, BN)

    def at(seq, CQ, CK, vh):
        b = seq[0]
        q0, k0 = CQ[b], CK[b]
        return _Tile(
            spec, BM, BN, seq[1], CQ[b + 1] - q0, CK[b + 1] - k0,
            # max(…, 0): an empty sequence's slot clamps its (unused) row into the buffer
            q_index=lambda row, d: (T.min(q0 + T.max(row, 0), TQ - 1), vh, d),
            kv_index=lambda key, d: (k0 + key, vh // G, d),
            o_index=lambda row, d: (q0 + row, vh, d),
            always_masked=True,
            valid=seq[1] < CQ[b + 1] - q0,
        )

    @T.prim_func(s_tir=True)
    def attention(
        Q: T.Buffer((TQ, H, D), dtype),
        K: T.Buffer((TK, KH, D), dtype),
        V: T.Buffer((TK, KH, D), dtype),
        CQ: T.Buffer((NB1,), "int32"),
        CK: T.Buffer((NB1,), "int32"),
        O: T.Buffer((TQ, H, D), dtype),
    ):
        T.func_attr({"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused",
                     "attn.block_m": BM, "attn.block_n": BN})
        for h, s in T.grid(H, NT):
            with T.sblock("row_tile"):
                vh, vs = T.axis.remap("SS", [h, s])
                T.reads(Q[0:TQ, vh, 0:D], K[0:TK, vh // G, 0:D], V[0:TK, vh // G, 0:D], CQ[0:NB1], CK[0:NB1])
                T.writes(O[0:TQ, vh, 0:D])
                # seq[0]: the sequence b of slot vs; seq[1]: the tile's first row within it.
                # seq[2], seq[3]: binary-search bounds on b.
                seq = T.sblock_alloc_buffer((4,), "int32", scope="local")
                with T.sblock("seq_locate"):
                    T.reads(CQ[0:NB1])
                    T.writes(seq[0:4])
                    seq[2] = 0
                    seq[3] = NB - 1
                    for _ in T.serial(32):  # 32 halvings cover any int32 batch
                        if seq[2] < seq[3]:
                            if T.floordiv(CQ[T.floordiv(seq[2] + seq[3] + 1, 2)], BM) + T.floordiv(seq[2] + seq[3] + 1, 2) <= vs:
                                seq[2] = T.floordiv(seq[2] + seq[3] + 1, 2)
                            else:
                                seq[3] = T.floordiv(seq[2] + seq[3] + 1, 2) - 1
                    seq[0] = seq[2]
                    seq[1] = (vs - T.floordiv(CQ[seq[2]], BM) - seq[2]) * BM
                tile(Q, K, V, O, at(seq, CQ, CK, vh), NC)

    return attention


#: layout -> PrimFunc frame (the argument list and the loop over row tiles); the tile is shared.
FRAMES = {"bhsd": _bhsd, "varlen": _varlen}
