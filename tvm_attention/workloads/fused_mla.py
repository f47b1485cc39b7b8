"""Multi-head latent attention (MLA: the ``mla`` and ``mla_paged`` layouts) on CUDA tensor cores:
``mma.sync.m16n8k16``, ldmatrix and ``cp.async``, FlashMLA's work split.

A latent cache holds one row of ``head_dim`` values per token (DeepSeek-V3: 576, the 512 of
``kv_lora_rank`` and 64 of rope) that every query head reads as its key, and whose first
``head_dim_v`` (512) columns are its value. So the heads are the rows of the tile: a thread
block takes ``block_m = 16·row_groups`` packed rows of one sequence (row ``r`` is head ``r % H``
of position ``r // H``: ``fused_cuda.cache_tile``'s packing, one KV head) and reads each key
tile once for all of them, as K and as V (one ``cp.async`` copy into shared memory, one buffer).

The tensor-core kernel of ``fused_mma`` keeps a warp's Q rows and its output rows in registers;
at 576/512 they would take 144 + 256 registers a lane. Here ``warps = row_groups ·
col_groups``: warp ``w`` owns the 16 rows of row group ``w // col_groups`` and

* the scores of its **key slice**, keys ``c·block_n/col_groups ..`` of each tile (``c = w %
  col_groups``), over the whole 576-deep ``Q·Kᵀ`` (no product is computed twice), Q's A
  fragments read with ldmatrix from a Q tile staged in shared memory once (``Qs``), K's B
  fragments from the key tile;
* the **output columns** ``c·head_dim_v/col_groups ..``, its accumulators in registers, fed by
  ``P·V`` over every key of the tile: ``P`` goes through shared memory (``Ps``, the row group's
  ``16 × block_n`` probabilities in the input dtype), V's B fragments come from the same key tile
  (ldmatrix ``.trans``).

Per key tile: the copy of tile ``c + stages − 1`` in flight; ``S`` of the warp's key slice;
each warp's row maxima of its slice to shared memory (``red``), a barrier; the row's new max
from its ``col_groups`` slices (every warp of a row group computes the same one, so each keeps
its own copy of ``m``), ``alpha = exp2(m − m_new)`` rescales the warp's accumulators and its
part of the row sum, ``P = exp2(S − m_new)`` to ``Ps``, a barrier; then ``acc += P·V``. A
warp's row sum is its slice's; the slices' sums meet in ``red`` once, at the end. A fully masked
tile leaves ``m = −inf`` and its reference max guarded to 0 (no NaN); a row that sees no key
stores zeros. Masks, the variants' score hook, sinks and an 8-bit cache's scales are the
variants contract's (``fused_cuda.Tile``), as in the other CUDA kernels.

``split_tasks``: split-KV over each sequence's keys (``fused_cuda.Split``, its merge kernel), for a
step of up to ``ceil(H / block_m)`` row tiles (a decode step's 128 heads: two tiles of 64).

``emulate=True``: serial loops for the thread bindings, global memory for shared and registers,
each PTX instruction replaced by its definition in scalar TIR (``fused_mma``'s), run by LLVM on
the CPU: it checks the work split, the fragments' index math, the slices' max and sum exchange,
the masking and the merge, not the GPU schedule.
"""
from __future__ import annotations

import math
import types

from tvm import tirx
from tvm.script import tirx as T

from ..cuda_tools import shared_scope
from ..spec import ENTRY, AttentionSpec
from ..tvm_internals import fast_macros
from ._math import guarded, lse_of
from .fused_cuda import flat_offset, kernel_func
from .fused_mma import CP_DST, SMEM_PAD, WARP, _mma_context, _mma_fragments, _mma_kv_prefetch, _mma_kv_wait, \
    _mma_mask_scan, _mma_prologue, smem_stride
from .knob_attrs import FUSED_MLA, record
from .variants import transforms as transforms_scores


def mla_shared_bytes(spec: AttentionSpec, row_groups: int, col_groups: int, block_n: int, stages: int) -> int:
    """Shared memory of one thread block: the Q tile (``16·row_groups`` rows of ``head_dim``),
    ``stages`` key tiles of ``block_n`` latent rows (K and V in one), the P tile
    (``16·row_groups × block_n`` in the input dtype) and the slices' row maxima and sums
    (float32, 16 a warp); rows padded by 16 bytes (ldmatrix's eight row addresses on distinct
    banks)."""
    bm, st = 16 * row_groups, smem_stride(spec.head_dim)
    return (bm * st + stages * block_n * st + bm * (block_n + SMEM_PAD)) * spec.itemsize \
        + 4 * 16 * row_groups * col_groups


def _mla_context(spec: AttentionSpec, row_groups: int, col_groups: int, block_n: int, stages: int, emulate: bool):
    """Every constant, index helper and copy of one MLA kernel, by name: ``fused_mma``'s fragment
    layouts and pipeline macros for ``row_groups · col_groups`` warps and key tiles of ``block_n``
    latent rows, the warps' slices, the A-fragment load (the builders below unpack what each stage
    uses)."""
    if not spec.layout_info.latent:
        raise ValueError(f"the MLA kernel takes the latent layouts (mla, mla_paged), not {spec.layout!r}")
    RG, NC, BN, NS = row_groups, col_groups, block_n, stages
    W = RG * NC
    D, DV, dtype = spec.head_dim, spec.v_dim, spec.dtype
    for name, value, unit in (("head_dim", D, 16), ("block_n", BN, 16 * NC), ("head_dim_v", DV, 16 * NC)):
        if value % unit:
            raise ValueError(f"{name}={value} must be a multiple of {unit} (16 · col_groups={NC}: a warp's slice "
                             "of keys or output columns is whole ldmatrix tiles)")
    # the fragment layouts, index helpers and copies of the tensor-core kernel: W warps, key tiles
    # of BN latent rows (x.TILE = BN · (D + pad): K's tile, which V reads too)
    x = _mma_fragments(_mma_context(spec, W, BN, NS, 1, emulate))
    EMU, call, ix, fshape, fscope = x.EMU, x.call, x.ix, x.fshape, x.fscope
    thread_x, thread_y, mma_pair, k_addr, copy = x.thread_x, x.thread_y, x.mma_pair, x.k_addr, x.copy
    B, SQ, SK = x.B, x.SQ, x.SK
    BM = 16 * RG
    BNW, DVW = BN // NC, DV // NC  # a warp's keys of a tile, its output columns
    NTW, NOW = BNW // 8, DVW // 8  # ... as 8-wide slices (one m16n8 accumulator each)
    NDC = D // 16  # k steps of Q·Kᵀ
    ST, TILE = x.ST, x.TILE  # a latent row's shared stride, one key tile's elements
    QST, PST = ST, BN + SMEM_PAD  # Q's rows, P's rows (16 bytes of padding each)
    NTHR = W * WARP
    QV = D // 8  # 16-byte vectors of a Q row
    QIT = math.ceil(BM * QV / NTHR)  # Q vectors a thread copies
    neg_inf = x.neg_inf
    # the Q tile and the key stages (past 48 KiB: one dynamic allocation); the P tile and red are
    # small and static: TVM's barrier pass sees one merged buffer of the dynamic ones, so P's
    # and red's stores there looked like writes over the ldmatrix reads of Q and K, and it added a
    # barrier before each (5 a key tile); apart, the kernel's own barriers order them (3 a tile)
    smem = "global" if EMU else shared_scope(mla_shared_bytes(spec, RG, NC, BN, NS))
    small = "global" if EMU else "shared"
    transforms = transforms_scores(spec)  # the variants' score hook has work: scores to log2 units first
    qscale = 1.0 if transforms else x.qscale

    def scaled(w):
        # the factor of a raw score (qscale, times an 8-bit cache's key scale; logit applies both)
        return T.float32(qscale) if transforms or not spec.kv_quantized else w.k_scaled(qscale)

    @T.macro
    def copy_k(Ks, Vs, K, V, w, ty, tx, stage, tile):
        # a key tile's latent rows, once: K's tile, which V reads too
        copy(Ks, Vs, K, V, w, ty, tx, stage, tile, x.VPR, ST, TILE, x.LIT, "k")

    x.copy_kv = copy_k  # what the pipeline macros below copy
    prologue, kv_wait, kv_prefetch = _mma_prologue(x), _mma_kv_wait(x), _mma_kv_prefetch(x)

    def rg(ty):  # a warp's row group
        return ty // NC

    def cg(ty):  # ... and its column group: key slice and output columns
        return ty % NC

    def row_of(ty, tx, h):  # tile row of a lane's row state h (rows g, g + 8 of its group)
        return rg(ty) * 16 + tx // 4 + 8 * h

    def key_of(ty, tx, k):  # tile key of score slot k
        return cg(ty) * BNW + k // 4 * 8 + 2 * (tx % 4) + k % 2

    def col_of(ty, tx, k):  # output column of accumulator slot k
        return cg(ty) * DVW + k // 4 * 8 + 2 * (tx % 4) + k % 2

    def red_at(ty, tx, h, c):  # a row's slot in red: the slice of column group c of its row group
        return (rg(ty) * NC + c) * 16 + tx // 4 + 8 * h

    def v_addr(buf, kk, dp, lane, ty):
        # the row lane ``lane`` gives ldmatrix .trans for V's B fragments (keys kk·16.., columns of
        # the warp's 16-wide slice pair dp): b0, b1 of slice 2dp, then of 2dp + 1
        key = kk * 16 + lane % 8 + 8 * (lane // 8 % 2)
        return buf * TILE + key * ST + cg(ty) * DVW + dp * 16 + 8 * (lane // 16)

    @T.macro
    def lds_a(Af, buf, stride, row0, col0, ty, tx):
        # the A fragment of rows row0.. and columns col0.. (16 × 16) of a row-major shared tile:
        # ldmatrix x4, lane l giving row l % 8 + 8·(l / 8 % 2), column 8·(l / 16); emulated, the
        # fragment layout (slot s: row g + 8·(s / 2 % 2), column 2t + s % 2 + 8·(s / 4))
        if EMU:
            for s in T.unroll(8):
                Af[ty, tx, s] = buf[(row0 + tx // 4 + 8 * (s // 2 % 2)) * stride + col0 + 2 * (tx % 4) + s % 2
                                    + 8 * (s // 4)]
        else:
            T.evaluate(call("attn_ldsm_x4", Af.access_ptr("w"),
                            buf.access_ptr("r", offset=(row0 + tx % 8 + 8 * (tx // 8 % 2)) * stride + col0
                                           + 8 * (tx // 16))))

    return types.SimpleNamespace(**{**vars(x), **{k: v for k, v in locals().items() if k != "x"}})


def _mla_q_stage(x):
    """The Q tile into shared memory (cp.async, the prologue's first group) and the row state's init."""
    (BM, call, EMU, ix, neg_inf, NOW, NTHR, QIT, QST, QV, thread_x, thread_y, W) = \
        (x.BM, x.call, x.EMU, x.ix, x.neg_inf, x.NOW, x.NTHR, x.QIT, x.QST, x.QV, x.thread_x, x.thread_y, x.W)

    @T.macro
    def q_stage(Q, Qs, m, l, acc, w):
        # -- the Q tile into shared memory (cp.async, in the prologue's first group), the state
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("Q_stage"):
                    T.reads()
                    T.writes()
                    for it in T.unroll(QIT):
                        # only a block with key tiles reads it (the race checker: a copy of a
                        # block with none, a chunk past its keys, was never waited for)
                        if (it * NTHR + ty * WARP + tx) < BM * QV and w.n_tiles() > 0:
                            if EMU:
                                for v in T.serial(8):
                                    Qs[(it * NTHR + ty * WARP + tx) // QV * QST + (it * NTHR + ty * WARP + tx) % QV * 8
                                       + v] = Q[w.q_at(w.row0 + (it * NTHR + ty * WARP + tx) // QV,
                                                       (it * NTHR + ty * WARP + tx) % QV * 8 + v)]
                            else:
                                T.evaluate(call(
                                    "attn_cp_async16",
                                    Qs.access_ptr(CP_DST, offset=(it * NTHR + ty * WARP + tx) // QV * QST
                                                  + (it * NTHR + ty * WARP + tx) % QV * 8),
                                    Q.access_ptr("r", offset=flat_offset(Q, w.q_at(
                                        w.row0 + (it * NTHR + ty * WARP + tx) // QV,
                                        (it * NTHR + ty * WARP + tx) % QV * 8)))))
                    if not EMU:
                        T.evaluate(call("attn_cp_commit"))
                    for h in T.unroll(2):
                        m[ix(ty, tx, h)] = neg_inf
                        l[ix(ty, tx, h)] = T.float32(0)
                    for k in T.unroll(NOW * 4):
                        acc[ix(ty, tx, k)] = T.float32(0)

    return q_stage


def _mla_qk(x):
    """``S = Q·Kᵀ`` of each warp's key slice of tile ``c``: Q's A fragment of each k step from
    the Q tile, K's B fragments per 16 keys (ldmatrix)."""
    (alive, call, cg, EMU, ix, k_addr, lds_a, mma_pair, NDC, NS, NTW, QST, rg, thread_x, thread_y, W) = \
        (x.alive, x.call, x.cg, x.EMU, x.ix, x.k_addr, x.lds_a, x.mma_pair, x.NDC, x.NS, x.NTW, x.QST, x.rg, x.thread_x,
         x.thread_y, x.W)

    @T.macro
    def qk(S, Qs, Qf, Ks, Kf, c, live):
        # -- S = Q·Kᵀ of the warp's key slice: Q's fragment of each k step once, K's per 16 keys
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("S_init"):
                    T.reads()
                    T.writes()
                    if alive(live, ty, tx):
                        for k in T.unroll(NTW * 4):
                            S[ix(ty, tx, k)] = T.float32(0)
        for dk in T.serial(NDC):
            for ty in thread_y(W):
                for tx in thread_x(WARP):
                    with T.sblock("Q_ldmatrix"):
                        T.reads()
                        T.writes()
                        if alive(live, ty, tx):
                            lds_a(Qf, Qs, QST, rg(ty) * 16, dk * 16, ty, tx)
            for np in T.unroll(NTW // 2):
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("K_ldmatrix"):
                            T.reads()
                            T.writes()
                            if alive(live, ty, tx):
                                if EMU:
                                    for i in T.unroll(4):
                                        for e in T.unroll(2):
                                            Kf[ty, tx, i * 2 + e] = Ks[k_addr(c % NS, cg(ty) * (NTW // 2) + np, dk,
                                                                              i * 8 + tx // 4) + 2 * (tx % 4) + e]
                                else:
                                    T.evaluate(call("attn_ldsm_x4", Kf.access_ptr("w"), Ks.access_ptr(
                                        "r", offset=k_addr(c % NS, cg(ty) * (NTW // 2) + np, dk, tx))))
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("QK_mma"):
                            T.reads()
                            T.writes()
                            if alive(live, ty, tx):
                                mma_pair(S, np * 8, Qf, 0, Kf, ty, tx)

    return qk


def _mla_softmax(x):
    """Tile ``c``'s scores scaled and masked, each slice's row maxima through ``red``, the row's
    new max, the online correction and ``P = exp2(S − m_new)`` into the P tile."""
    (alive, BN, cg, dtype, EMU, ix, key_of, NC, neg_inf, NOW, NTW, PST, red_at, row_of, scaled, thread_x, thread_y,
     transforms, W) = \
        (x.alive, x.BN, x.cg, x.dtype, x.EMU, x.ix, x.key_of, x.NC, x.neg_inf, x.NOW, x.NTW, x.PST, x.red_at, x.row_of,
         x.scaled, x.thread_x, x.thread_y, x.transforms, x.W)

    @T.macro
    def softmax(S, Ps, red, acc, m, l, mt, mn, w, c, live):
        # -- the slice's scores scaled and masked, its row maxima across the row's four lanes,
        # to red (the row group's other slices need them)
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("S_max"):
                    T.reads()
                    T.writes()
                    if alive(live, ty, tx):
                        if transforms:
                            for k in T.unroll(NTW * 4):
                                S[ix(ty, tx, k)] = w.logit(S[ix(ty, tx, k)], w.row0 + row_of(ty, tx, k % 4 // 2),
                                                           w.tile(c) * BN + key_of(ty, tx, k))
                        if w.hides:
                            if w.needs_mask(c):
                                for k in T.unroll(NTW * 4):
                                    S[ix(ty, tx, k)] = T.Select(
                                        w.sees(w.row0 + row_of(ty, tx, k % 4 // 2), w.tile(c) * BN + key_of(ty, tx, k)),
                                        S[ix(ty, tx, k)], neg_inf)
                        for h in T.unroll(2):
                            mt[ix(ty, tx, h)] = neg_inf
                        for k in T.unroll(NTW * 4):
                            mt[ix(ty, tx, k % 4 // 2)] = T.max(mt[ix(ty, tx, k % 4 // 2)], S[ix(ty, tx, k)])
                        for h in T.unroll(2):
                            mt[ix(ty, tx, h)] = T.max(m[ix(ty, tx, h)], mt[ix(ty, tx, h)] * scaled(w))
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("slice_max"):
                    T.reads()
                    T.writes()
                    if alive(live, ty, tx):
                        for h in T.unroll(2):
                            if EMU:
                                mn[ty, tx, h] = T.max(T.max(mt[ty, tx // 4 * 4, h], mt[ty, tx // 4 * 4 + 1, h]),
                                                      T.max(mt[ty, tx // 4 * 4 + 2, h], mt[ty, tx // 4 * 4 + 3, h]))
                            else:
                                mn[h] = T.cuda.warp_max(mt[h], 4)
                        if tx % 4 == 0:
                            for h in T.unroll(2):
                                red[red_at(ty, tx, h, cg(ty))] = mn[ix(ty, tx, h)]
        if not EMU:
            T.tvm_storage_sync("shared")
        # -- the row's new max over its slices, the online correction, P = exp2(S − m_new) to Ps
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("P_exp"):
                    T.reads()
                    T.writes()
                    if alive(live, ty, tx):
                        for h in T.unroll(2):
                            for j in T.unroll(NC):
                                mn[ix(ty, tx, h)] = T.max(mn[ix(ty, tx, h)], red[red_at(ty, tx, h, j)])
                            # alpha (in mt): a row with no visible key yet keeps m = −inf, its
                            # reference max guarded to 0
                            mt[ix(ty, tx, h)] = T.exp2(m[ix(ty, tx, h)] - guarded(mn[ix(ty, tx, h)]))
                            m[ix(ty, tx, h)] = mn[ix(ty, tx, h)]
                            l[ix(ty, tx, h)] = l[ix(ty, tx, h)] * mt[ix(ty, tx, h)]
                        for k in T.unroll(NTW * 4):
                            S[ix(ty, tx, k)] = T.exp2(S[ix(ty, tx, k)] * scaled(w)
                                                      - guarded(mn[ix(ty, tx, k % 4 // 2)]))
                            l[ix(ty, tx, k % 4 // 2)] = l[ix(ty, tx, k % 4 // 2)] + S[ix(ty, tx, k)]
                            Ps[row_of(ty, tx, k % 4 // 2) * PST + key_of(ty, tx, k)] = T.Cast(dtype, S[ix(ty, tx, k)])
                        for k in T.unroll(NOW * 4):
                            acc[ix(ty, tx, k)] = acc[ix(ty, tx, k)] * mt[ix(ty, tx, k % 4 // 2)]
        if not EMU:
            T.tvm_storage_sync("shared")

    return softmax


def _mla_pv(x):
    """``acc += P·V`` of tile ``c``: the row group's P from the P tile, V's B fragments from the
    key tile (ldmatrix ``.trans``), the warp's output columns."""
    (alive, BN, call, EMU, lds_a, mma_pair, NOW, NS, PST, rg, thread_x, thread_y, v_addr, W) = \
        (x.alive, x.BN, x.call, x.EMU, x.lds_a, x.mma_pair, x.NOW, x.NS, x.PST, x.rg, x.thread_x, x.thread_y,
         x.v_addr, x.W)

    @T.macro
    def pv(acc, Ps, Pf, Ks, Vf, c, live):
        # -- acc += P·V over every key of the tile, the warp's output columns
        for kk in T.unroll(BN // 16):
            for ty in thread_y(W):
                for tx in thread_x(WARP):
                    with T.sblock("P_ldmatrix"):
                        T.reads()
                        T.writes()
                        if alive(live, ty, tx):
                            lds_a(Pf, Ps, PST, rg(ty) * 16, kk * 16, ty, tx)
            for dp in T.unroll(NOW // 2):
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("V_ldmatrix"):
                            T.reads()
                            T.writes()
                            if alive(live, ty, tx):
                                if EMU:
                                    for i in T.unroll(4):
                                        for e in T.unroll(2):
                                            Vf[ty, tx, i * 2 + e] = Ks[
                                                v_addr(c % NS, kk, dp, i * 8 + 2 * (tx % 4) + e, ty) + tx // 4]
                                else:
                                    T.evaluate(call("attn_ldsm_x4_trans", Vf.access_ptr("w"),
                                                    Ks.access_ptr("r", offset=v_addr(c % NS, kk, dp, tx, ty))))
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("PV_mma"):
                            T.reads()
                            T.writes()
                            if alive(live, ty, tx):
                                mma_pair(acc, dp * 8, Pf, 0, Vf, ty, tx)
        if NS == 1:
            if not EMU:
                T.tvm_storage_sync("shared")  # the next tile overwrites the only buffer

    return pv


def _mla_store(x):
    """The slices' row sums through ``red``, ``O = acc / l`` of each warp's columns (0 for a row with
    no key), lse from column group 0; a split chunk's partials."""
    (cg, col_of, dtype, EMU, ix, NC, NOW, red_at, row_of, thread_x, thread_y, W) = \
        (x.cg, x.col_of, x.dtype, x.EMU, x.ix, x.NC, x.NOW, x.red_at, x.row_of, x.thread_x, x.thread_y, x.W)

    @T.macro
    def store(O, red, acc, l, ls, m, sw, sl, w):
        # -- each slice's row sums across the row's lanes, the slices' sums through red, then
        # O = acc / l of the warp's columns (0 for a row with no key), lse from column group 0
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("slice_sum"):
                    T.reads()
                    T.writes()
                    for h in T.unroll(2):
                        if EMU:
                            ls[ty, tx, h] = (l[ty, tx // 4 * 4, h] + l[ty, tx // 4 * 4 + 1, h]) + (
                                l[ty, tx // 4 * 4 + 2, h] + l[ty, tx // 4 * 4 + 3, h])
                        else:
                            ls[h] = T.cuda.warp_sum(l[h], 4)
                    if tx % 4 == 0:
                        for h in T.unroll(2):
                            red[red_at(ty, tx, h, cg(ty))] = ls[ix(ty, tx, h)]
        if not EMU:
            T.tvm_storage_sync("shared")
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("O_store"):
                    T.reads()
                    T.writes()
                    for h in T.unroll(2):
                        ls[ix(ty, tx, h)] = red[red_at(ty, tx, h, 0)]
                        for j in T.unroll(NC - 1):
                            ls[ix(ty, tx, h)] = ls[ix(ty, tx, h)] + red[red_at(ty, tx, h, j + 1)]
                    if w.final:
                        if w.var.SK is not None:  # a sink's factors once per row (Variants.sink_terms)
                            for h in T.unroll(2):
                                sw[ix(ty, tx, h)] = w.sink_terms(m[ix(ty, tx, h)], w.row0 + row_of(ty, tx, h))[0]
                                sl[ix(ty, tx, h)] = ls[ix(ty, tx, h)] * sw[ix(ty, tx, h)] + w.sink_terms(
                                    m[ix(ty, tx, h)], w.row0 + row_of(ty, tx, h))[1]
                        for k in T.unroll(NOW * 4):
                            if w.row0 + row_of(ty, tx, k % 4 // 2) < w.rows:
                                O[w.o_at(w.row0 + row_of(ty, tx, k % 4 // 2), col_of(ty, tx, k))] = T.Cast(
                                    dtype, w.out(acc[ix(ty, tx, k)], ls[ix(ty, tx, k % 4 // 2)],
                                                 w.row0 + row_of(ty, tx, k % 4 // 2), m[ix(ty, tx, k % 4 // 2)],
                                                 (sw[ix(ty, tx, k % 4 // 2)], sl[ix(ty, tx, k % 4 // 2)])))
                        if w.LSE is not None:
                            if cg(ty) == 0:
                                if tx % 4 == 0:  # the row's lanes hold the same m and sum
                                    for h in T.unroll(2):
                                        if w.row0 + row_of(ty, tx, h) < w.rows:
                                            w.LSE[w.lse_at(w.row0 + row_of(ty, tx, h))] = lse_of(
                                                m[ix(ty, tx, h)], ls[ix(ty, tx, h)])
                    else:  # a split-KV chunk's state for the merge kernel: every row of the tile
                        for k in T.unroll(NOW * 4):
                            w.split.Op[w.part_at(row_of(ty, tx, k % 4 // 2), col_of(ty, tx, k))] = acc[ix(ty, tx, k)]
                        if cg(ty) == 0:
                            if tx % 4 == 0:
                                for h in T.unroll(2):
                                    w.split.St[w.part_at(row_of(ty, tx, h), 0)] = m[ix(ty, tx, h)]
                                    w.split.St[w.part_at(row_of(ty, tx, h), 1)] = ls[ix(ty, tx, h)]

    return store


@fast_macros  # TVMScript macro expansion without its costly stack walk, only while this generates
def fused_attention_mla(spec: AttentionSpec, row_groups: int, col_groups: int, block_n: int, stages: int,
                        emulate: bool = False, split_tasks: int = 0) -> tirx.PrimFunc:
    """Arguments (call order), ``spec.dtype`` float16 or bfloat16: ``mla``: ``Q (B, H, Sq, D)``,
    ``KV (B, max_len, D)`` (an 8-bit latent cache: its dtype), ``cache_seqlens (B,)``; ``mla_paged``:
    ``Q``, ``KV (num_pages, page_size, D)``, ``block_table (B, max_pages)``, ``cache_seqlens``;
    then the variants' arguments (``layouts.variant_args``: ``kv_scale (1,)``, ``kv_new (B, Sq,
    D)``...), ``O (B, H, Sq, Dv)`` (V: the latent rows' first ``Dv`` columns), an lse output
    ``(B, H, Sq)`` with ``return_lse``. ``row_groups``: 16-row groups of the tile
    (``block_m = 16·row_groups``); ``col_groups``: warps per row group, each with a key slice of
    ``block_n / col_groups`` and ``head_dim_v / col_groups`` output columns; ``stages``: key
    tiles in flight."""
    x = _mla_context(spec, row_groups, col_groups, block_n, stages, emulate)
    (B, BM, BN, dtype, fscope, fshape, kv_prefetch, kv_wait, NC, NOW, NS, NTW, prologue, PST, QST, RG, small, smem,
     SK, SQ, thread_x, TILE, W) = \
        (x.B, x.BM, x.BN, x.dtype, x.fscope, x.fshape, x.kv_prefetch, x.kv_wait, x.NC, x.NOW, x.NS, x.NTW, x.prologue,
         x.PST, x.QST, x.RG, x.small, x.smem, x.SK, x.SQ, x.thread_x, x.TILE, x.W)
    q_stage, qk, softmax, pv, store = _mla_q_stage(x), _mla_qk(x), _mla_softmax(x), _mla_pv(x), _mla_store(x)
    cmask = x.cmask
    # a custom mask's scan: the warps of a row group scan its 16 rows (each a key tile's bits): the
    # group's warps skip its products, softmax and P·V together (copies, barriers and the other
    # groups' exchange as they are)
    mask_scan = _mma_mask_scan(x, lambda ty: x.rg(ty) * 16) if cmask else None

    @T.macro
    def tile(Q, K, V, O, w):
        Qs = T.sblock_alloc_buffer((BM * QST,), dtype, scope=smem)
        Ks = T.sblock_alloc_buffer((NS * TILE,), dtype, scope=smem)  # latent rows: K, and V's first columns
        Ps = T.sblock_alloc_buffer((BM * PST,), dtype, scope=small)  # the row groups' probabilities
        red = T.sblock_alloc_buffer((W * 16,), "float32", scope=small)  # each slice's row maxima, then sums
        Qf = T.sblock_alloc_buffer(fshape(8), dtype, scope=fscope)
        Kf = T.sblock_alloc_buffer(fshape(8), dtype, scope=fscope)
        Vf = T.sblock_alloc_buffer(fshape(8), dtype, scope=fscope)
        Pf = T.sblock_alloc_buffer(fshape(8), dtype, scope=fscope)
        S = T.sblock_alloc_buffer(fshape(NTW * 4), "float32", scope=fscope)  # the slice's scores
        acc = T.sblock_alloc_buffer(fshape(NOW * 4), "float32", scope=fscope)  # the warp's columns
        m = T.sblock_alloc_buffer(fshape(2), "float32", scope=fscope)  # rows g, g + 8: running max
        l = T.sblock_alloc_buffer(fshape(2), "float32", scope=fscope)  # lane's part of the slice's sum
        mt = T.sblock_alloc_buffer(fshape(2), "float32", scope=fscope)  # lane's max, then alpha
        mn = T.sblock_alloc_buffer(fshape(2), "float32", scope=fscope)  # the new max
        ls = T.sblock_alloc_buffer(fshape(2), "float32", scope=fscope)  # row sum
        # a custom mask: whether the tile holds a bit of the warp's row group (lane's, warp's)
        live = T.meta_var(T.sblock_alloc_buffer(fshape(2), "float32", scope=fscope) if cmask else None)

        q_stage(Q, Qs, m, l, acc, w)
        prologue(Ks, Ks, K, V, w)
        for c in T.serial(w.n_tiles()):
            kv_wait(Ks, Ks, K, V, w, c)
            kv_prefetch(Ks, Ks, K, V, w, c)
            if cmask:
                mask_scan(live, w, c)
            qk(S, Qs, Qf, Ks, Kf, c, live)
            softmax(S, Ps, red, acc, m, l, mt, mn, w, c, live)
            pv(acc, Ps, Pf, Ks, Vf, c, live)
        store(O, red, acc, l, ls, m, mt, mn, w)  # mt, mn: free after the last tile (the sink's factors)

    attrs = {"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused_mla",
             **record(FUSED_MLA, row_groups=RG, col_groups=NC, block_n=BN, stages=NS)}
    # a split step: the row tiles of one position's heads (a decode step's)
    tiles = -(-spec.group_size // BM)
    return kernel_func(spec, x.block, BM, BN, (B, SQ, SK), tile, attrs, reverse=x.causal, split_tasks=split_tasks,
                       lanes=thread_x, split_tiles=tiles)
