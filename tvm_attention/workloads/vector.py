"""The fused kernel's products on vector FMAs: ``S = Q·Kᵀ`` (:func:`s_gemm_macros`) and ``acc =
acc·alpha + P·V`` (:func:`pv_macros`) as float32 products, in the forms the CPU schedules
vectorize, and the staged operands of the decode nests' dot products (``dot_decode``: bf16 bits
for ``vdpbf16ps``, int8 bytes for VNNI's ``vpdpbusd`` and AVX2's ``vpmaddubsw``), which
``schedules/cpu_decode.py`` tensorizes: the products are spelled on the operands' float32 values,
which the intrinsics' descriptions match.

The other forms have rooms of their own: the bf16 pairs (``vdpbf16ps``, :mod:`.bf16dot`) and the
AMX tiles (:mod:`.amx`). ``fused._product_macros`` is the one interface the tile calls; each
macro takes the tile's shape ``k`` (``fused._TileShape``) and every buffer its form reads.
"""
from __future__ import annotations

import types

from tvm.script import tirx as T

from ..quant import SCALE_GROUP
from ._math import bf16_value, f32

#: llvm.prefetch's locality of the decode nests' software prefetch: 2, into L2 (``prefetcht1``).
#: One key tile ahead is 32 KiB of K/V rows per kv head (bf16, D=128, 64 keys), 256 KiB for a
#: paged tile of 8 kv heads: into L1 (3) that evicts the tile being computed (a paged bf16 step
#: 1.18-1.20x slower, one thread on a 2-core znver4), into L2 it waits there.
PF_LOCALITY = 2


def s_gemm_macros(k):
    """``S = Q·Kᵀ`` of one key tile (scaled, log2 units) on float32 products (the bf16-pair form:
    :mod:`.bf16dot`), one macro per form: ``heads`` (each key staged for every kv head of the
    tile), ``staged`` (the key tile staged as float32 by ``K_load``), ``plain`` (K read through
    the layout's index), and ``prefetch`` (block ``KV_prefetch``, before a staged form when asked).

    ``staged``: each key tile copied into a local float32 ``Kt (block_n, D)`` (block ``K_load``)
    that ``S_gemm`` reads through plain indices. A schedule that computes QKᵀ as dot products with
    a tensor intrinsic needs that: through a layout's own index (the tail clamp reading
    ``cache_seqlens``, a block-table lookup) the K reads would name other buffers.

    ``heads`` (the decode nest's page order): the tile's ``block_m`` rows are ``HT`` kv heads'
    blocks of packed rows, and keys are staged for all of them: ``Kt (HT, D)`` one key at a time
    inside ``S_gemm``'s key loop, ``Vt (block_n, HT, D)`` per tile (:func:`pv_macros`). A paged
    cache ``(pages, page_size, kv_heads, D)`` is then read along its rows, every head of a key at
    once, instead of ``D`` elements every ``kv_heads·D``. Row ``i`` uses head ``i // R``.

    ``prefetch``: a software prefetch (``llvm.prefetch``, into L2: :data:`PF_LOCALITY`) of every
    cache line of the K and V rows of key tile ``c + prefetch`` while tile ``c`` computes (clamped
    to the last key), so the next tile streams in while this one computes: without it the core
    waits on each tile, then computes (one thread, bf16 kvcache: 9.0 GB/s where the cache in L2
    runs 16.5 and the stream reads 19.7, i.e. no overlap at all). It is issued in ``S_gemm``'s
    key loop, key ``j``'s rows with key ``j``'s dot product: a few lines per key. Issued as one
    burst at the tile's start (the first form) it cost 8-26 %: hundreds of prefetches queued at
    once stall the loads behind them. It writes nothing.

    ``k.dot_decode`` (the staged forms): ``Qt`` and ``Kt`` hold bf16 bits, the keys widened to
    bf16 as they are staged, the products spelled on their float32 values (``cpu_decode``'s
    bf16 dot product matches them)."""
    N, BM, BN, D, HT, R, prefetch, LINE_ELEMS = k.N, k.BM, k.BN, k.D, k.HT, k.R, k.prefetch, k.line_elems
    LINES = max(1, D // LINE_ELEMS)  # cache lines per K row (rows are line-aligned when D is)
    LINES_V = max(1, k.DV // LINE_ELEMS)  # per V row
    PF_LINES = max(LINES, LINES_V)

    def line(ln, n):  # line ln of a row of n lines: the last one again past its end (a repeat is free)
        return ln if n == PF_LINES else T.min(ln, n - 1)

    def kvh(h):  # the head argument of a K/V index: none for a one-head tile
        return h if HT > 1 else None

    # dot_decode: the staged keys (Kt) and Qt hold bf16 bits, exact for the caches it takes (K
    # widened to bf16, or read as its bits), read as float32 products the intrinsic's desc spells
    def operand(x):
        if k.int8_dots:  # bytes: their products and sums are exact in float32 (D <= 512)
            return f32(x)
        return bf16_value(x) if k.dot_decode else x

    def group_scaled(Ksc, h, vj, vd, product):  # dot_decode 5: each product times its group's key scale
        return Ksc[h, vj, T.floordiv(vd, SCALE_GROUP)] * product if k.group_dots else product

    @T.macro
    def kv_prefetch(K, V, t, vc, j):
        # key j's K and V rows (every head of the tile) of tile vc + prefetch, issued in the key
        # loop of S_gemm: a few lines per key, spread over the tile's compute
        for h, ln in T.grid(HT, PF_LINES):
            with T.sblock(N["KV_prefetch"]):
                vj = T.axis.spatial(BN, j)
                vh, vl = T.axis.remap("SS", [h, ln])
                T.reads(K[t.kv_ahead(vc + prefetch, vj, line(vl, LINES) * LINE_ELEMS, kvh(vh))],
                        V[t.kv_ahead(vc + prefetch, vj, line(vl, LINES_V) * LINE_ELEMS, kvh(vh))])
                T.writes()
                # (address, 0 = read, locality, 1 = data cache)
                T.evaluate(T.call_llvm_intrin(
                    "void", "llvm.prefetch.p0",
                    T.address_of(K[t.kv_ahead(vc + prefetch, vj, line(vl, LINES) * LINE_ELEMS, kvh(vh))]),
                    T.int32(0), T.int32(PF_LOCALITY), T.int32(1)))
                T.evaluate(T.call_llvm_intrin(
                    "void", "llvm.prefetch.p0",
                    T.address_of(V[t.kv_ahead(vc + prefetch, vj, line(vl, LINES_V) * LINE_ELEMS, kvh(vh))]),
                    T.int32(0), T.int32(PF_LOCALITY), T.int32(1)))

    def staged_head(heads, vi):  # the kv head of query row vi (heads: R rows each; else the one tile head)
        return T.floordiv(vi, R) if heads else 0

    def staged_row(heads, vi, vj):  # Kt's row for query row vi and key vj: its head's (heads) or the key's
        return T.floordiv(vi, R) if heads else vj

    @T.macro
    def s_gemm_key(Kt, Qt, S, j, Ksc, heads):
        # key j's scores for every query row, from its staged row: Kt (HT, D) holds key j of every
        # head (heads: the page order), or Kt (BN, D) the whole tile
        for d, i in T.grid(D, BM):
            with T.sblock(N["S_gemm"]):
                vj = T.axis.spatial(BN, j)
                vd, vi = T.axis.remap("RS", [d, i])
                with T.init():
                    S[vj, vi] = T.float32(0)
                S[vj, vi] = S[vj, vi] + group_scaled(
                    Ksc, staged_head(heads, vi), vj, vd,
                    operand(Kt[staged_row(heads, vi, vj), vd]) * operand(Qt[vd, vi]))

    @T.macro
    def s_gemm_heads(K, Kt, Qt, S, t, vc, Ksc, Kp, Vp):
        for j in T.serial(BN):
            if prefetch > 0:
                kv_prefetch(Kp, Vp, t, vc, j)
            # key j of every head: one contiguous read of a paged row, kept in L1
            for h, d in T.grid(HT, D):
                with T.sblock(N["K_load"]):
                    vj = T.axis.spatial(BN, j)
                    vh, vd = T.axis.remap("SS", [h, d])
                    Kt[vh, vd] = k.stage_key(K[t.kv_at(vc, vj, vd, vh)], Ksc, vh, vj, vd)
            s_gemm_key(Kt, Qt, S, j, Ksc, True)

    @T.macro
    def s_gemm_staged(K, Kt, Qt, S, t, vc, Ksc, Kp, Vp):
        for j, d in T.grid(BN, D):
            with T.sblock(N["K_load"]):
                vj, vd = T.axis.remap("SS", [j, d])
                Kt[vj, vd] = k.stage_key(K[t.kv_at(vc, vj, vd)], Ksc, 0, vj, vd)
        for j in T.serial(BN):
            if prefetch > 0:
                kv_prefetch(Kp, Vp, t, vc, j)
            s_gemm_key(Kt, Qt, S, j, Ksc, False)

    @T.macro
    def s_gemm(K, Qt, S, t, vc, Ksc):
        for j, d, i in T.grid(BN, D, BM):
            with T.sblock(N["S_gemm"]):
                vj, vd, vi = T.axis.remap("SRS", [j, d, i])
                with T.init():
                    S[vj, vi] = T.float32(0)
                S[vj, vi] = S[vj, vi] + k.dequant(K[t.kv_at(vc, vj, vd)], Ksc, 0, vj, vd) * Qt[vd, vi]

    return types.SimpleNamespace(prefetch=kv_prefetch, heads=s_gemm_heads, staged=s_gemm_staged, plain=s_gemm)


def pv_macros(k):
    """``acc = acc·alpha + P·V`` of one key tile on float32 products (the bf16-pair form:
    :mod:`.bf16dot`), one macro per form: ``heads`` (V staged for every kv head of the tile, as
    stored: :meth:`.fused._TileShape.vt_dtype`), ``plain`` (V read through the layout's index); and
    ``p_of``, P as PV reads it (every form's). ``D`` here is V's head dim (``DV``)."""
    N, BM, BN, D, HT, R = k.N, k.BM, k.BN, k.DV, k.HT, k.R

    def p_of(P, Vsc, vj, vi, vd=0):
        # P as PV reads it: times the key's value scale (per token; per group column vd's group:
        # a scalar per vector of one group's columns, cpu_decode.vectorize_in_groups); the row
        # sum l adds the unscaled P
        if k.token_scales:
            return P[vj, vi] * Vsc[vj, vi]
        if k.group_scales:
            return P[vj, vi] * Vsc[k.head_row(vi), vj, T.floordiv(vd, SCALE_GROUP)]
        return P[vj, vi]

    @T.macro
    def pv_gemm_heads(V, P, Vt, acc, alpha, t, vc, Vsc):
        for j, h, d in T.grid(BN, HT, D):
            with T.sblock(N["V_load"]):
                vj, vh, vd = T.axis.remap("SSS", [j, h, d])
                Vt[vj, vh, vd] = k.v_staged(V[t.kv_at(vc, vj, vd, vh)])
        for i, j, d in T.grid(BM, BN, D):
            with T.sblock(N["PV_gemm"]):
                vi, vj, vd = T.axis.remap("SRS", [i, j, d])
                with T.init():
                    acc[vi, vd] = acc[vi, vd] * alpha[vi]
                acc[vi, vd] = acc[vi, vd] + p_of(P, Vsc, vj, vi, vd) * k.v_value(Vt[vj, T.floordiv(vi, R), vd])

    @T.macro
    def pv_gemm(V, P, acc, alpha, t, vc, Vsc):
        for i, j, d in T.grid(BM, BN, D):
            with T.sblock(N["PV_gemm"]):
                vi, vj, vd = T.axis.remap("SRS", [i, j, d])
                with T.init():
                    acc[vi, vd] = acc[vi, vd] * alpha[vi]
                acc[vi, vd] = acc[vi, vd] + p_of(P, Vsc, vj, vi, vd) * k.kv(V[t.kv_at(vc, vj, vd)])

    return types.SimpleNamespace(p_of=p_of, heads=pv_gemm_heads, plain=pv_gemm)
