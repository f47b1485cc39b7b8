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
from ._math import LOG2E, exp2_fast, guarded, normalize

ENTRY = "attention"


def fused_attention(spec: AttentionSpec, block_m: int, block_n: int) -> tirx.PrimFunc:
    """Build the fused PrimFunc for ``spec`` with row tile ``block_m`` and key tile ``block_n``.

    Arguments of the PrimFunc (call order): ``Q (B, H, Sq, D)``, ``K (B, KH, Skv, D)``,
    ``V (B, KH, Skv, D)``, ``O (B, H, Sq, D)``; all ``spec.dtype``, compact row-major.
    """
    B, H, KH = spec.batch, spec.heads, spec.kv_heads
    SQ, SK, D = spec.seq_q, spec.seq_kv, spec.head_dim
    G = spec.group_size
    BM, BN = block_m, block_n
    NR = math.ceil(SQ / BM)  # row tiles
    NC = math.ceil(SK / BN)  # key tiles
    OFF = spec.kv_offset
    causal = spec.causal
    kv_tail = SK % BN != 0
    masked = causal or kv_tail
    dtype = spec.dtype
    qscale = float(spec.scale * LOG2E)
    neg_inf = T.float32(float("-inf"))

    def n_tiles(vr):
        # Causal: a row tile's last row (r0 + BM - 1) sees keys up to r0 + BM - 1 + OFF, so
        # later tiles are entirely masked and skipped, not computed and thrown away.
        if causal:
            return T.max(0, T.min(NC, T.floordiv(vr * BM + BM + OFF + BN - 1, BN)))
        return NC

    def kv_row(c, vj):
        # Clamp the tail tile's key index into range: those scores are masked anyway, and the
        # clamp costs one scalar min per key instead of a branch per element.
        if kv_tail:
            return T.min(c * BN + vj, SK - 1)
        return c * BN + vj

    def masked_score(S, vj, vi, vr, vc):
        # S with masked entries at -inf: keys past seq_kv (tail tile) and, when causal, keys
        # right of the bottom-right diagonal. Unmasked specs read S unchanged.
        if not masked:
            return S[vj, vi]
        col = vc * BN + vj
        cond = col < SK
        if causal:
            cond = T.And(cond, col <= vr * BM + vi + OFF)
        return T.Select(cond, S[vj, vi], neg_inf)


    @T.prim_func(s_tir=True)
    def attention(
        Q: T.Buffer((B, H, SQ, D), dtype),
        K: T.Buffer((B, KH, SK, D), dtype),
        V: T.Buffer((B, KH, SK, D), dtype),
        O: T.Buffer((B, H, SQ, D), dtype),
    ):
        T.func_attr({"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused",
                     "attn.block_m": BM, "attn.block_n": BN})
        for b, h, r in T.grid(B, H, NR):
            with T.sblock("row_tile"):
                vb, vh, vr = T.axis.remap("SSS", [b, h, r])
                T.reads(Q[vb, vh, 0:SQ, 0:D], K[vb, vh // G, 0:SK, 0:D], V[vb, vh // G, 0:SK, 0:D])
                T.writes(O[vb, vh, 0:SQ, 0:D])
                Qt = T.sblock_alloc_buffer((D, BM), "float32", scope="local")  # q tile, transposed
                S = T.sblock_alloc_buffer((BN, BM), "float32", scope="local")  # scores, key-major
                P = T.sblock_alloc_buffer((BN, BM), "float32", scope="local")  # probabilities
                m = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # running max (log2 units)
                m_new = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # max after this tile
                l = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # running sum
                alpha = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # exp2(m_old - m_new)
                acc = T.sblock_alloc_buffer((BM, D), "float32", scope="local")  # unnormalised output

                for d, i in T.grid(D, BM):
                    with T.sblock("Q_load"):
                        vd, vi = T.axis.remap("SS", [d, i])
                        Qt[vd, vi] = Q[vb, vh, T.min(vr * BM + vi, SQ - 1), vd] * T.float32(qscale)
                for i in T.serial(BM):
                    with T.sblock("state_init"):
                        vi = T.axis.remap("S", [i])
                        m[vi] = neg_inf
                        l[vi] = T.float32(0)
                for i, d in T.grid(BM, D):
                    with T.sblock("acc_init"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        acc[vi, vd] = T.float32(0)

                for c in T.serial(n_tiles(vr)):
                    with T.sblock("kv_tile"):
                        # The key-tile loop carries m, l and acc from one tile to the next: a
                        # reduction over tiles. Inside it each buffer has exactly one writer
                        # block, so every stage is a proper (decomposable) reduction.
                        vc = T.axis.reduce(NC, c)
                        # -- S = Q·Kᵀ (scaled, log2 units) ---------------------------------------
                        for j, d, i in T.grid(BN, D, BM):
                            with T.sblock("S_gemm"):
                                vj, vd, vi = T.axis.remap("SRS", [j, d, i])
                                with T.init():
                                    S[vj, vi] = T.float32(0)
                                S[vj, vi] = S[vj, vi] + K[vb, vh // G, kv_row(vc, vj), vd] * Qt[vd, vi]
                        # -- running max over the visible keys ---------------------------------
                        for j, i in T.grid(BN, BM):
                            with T.sblock("row_max"):
                                vj, vi = T.axis.remap("RS", [j, i])
                                with T.init():
                                    m_new[vi] = m[vi]
                                m_new[vi] = T.max(m_new[vi], masked_score(S, vj, vi, vr, vc))
                        # -- online correction factor; the guard keeps -inf - -inf out ----------
                        for i in T.serial(BM):
                            with T.sblock("online_correction"):
                                vi = T.axis.remap("S", [i])
                                alpha[vi] = exp2_fast(m[vi] - guarded(m_new[vi]))
                        for i in T.serial(BM):
                            with T.sblock("max_commit"):
                                vi = T.axis.remap("S", [i])
                                m[vi] = m_new[vi]
                        # -- P = exp2(S - m_new); masked entries are exactly 0 -------------------
                        for j, i in T.grid(BN, BM):
                            with T.sblock("P_exp"):
                                vj, vi = T.axis.remap("SS", [j, i])
                                P[vj, vi] = exp2_fast(masked_score(S, vj, vi, vr, vc) - guarded(m_new[vi]))
                        # -- l = l·alpha + rowsum(P) -------------------------------------------
                        for j, i in T.grid(BN, BM):
                            with T.sblock("row_sum"):
                                vj, vi = T.axis.remap("RS", [j, i])
                                with T.init():
                                    l[vi] = l[vi] * alpha[vi]
                                l[vi] = l[vi] + P[vj, vi]
                        # -- acc = acc·alpha + P·V ---------------------------------------------
                        for i, j, d in T.grid(BM, BN, D):
                            with T.sblock("PV_gemm"):
                                vi, vj, vd = T.axis.remap("SRS", [i, j, d])
                                with T.init():
                                    acc[vi, vd] = acc[vi, vd] * alpha[vi]
                                acc[vi, vd] = acc[vi, vd] + P[vj, vi] * V[vb, vh // G, kv_row(vc, vj), vd]

                for i, d in T.grid(BM, D):
                    with T.sblock("O_store"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        T.where(vr * BM + i < SQ)
                        O[vb, vh, vr * BM + vi, vd] = normalize(acc[vi, vd], l[vi], vr * BM + vi, spec)

    return attention
