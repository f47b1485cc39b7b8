"""The attention backward on CUDA tensor cores (issue 65, item 6): FlashAttention-2's scheme on
``mma.sync.m16n8k16``, ldmatrix and ``cp.async``, as a TIR PrimFunc of three kernels.

1. **prep**: ``delta = rowsum(dO ∘ O)`` per query row (float32), the dQ accumulator zeroed; with
   sinks, ``dsinks`` (``−Σ p_sink·delta`` per head, added atomically); with ``grad_tensors``, the
   tensors' partials zeroed;
2. **main**: one thread block per (key tile of ``block_n = 16·warps`` keys, kv head, sequence;
   varlen: per (tile slot, kv head), the slot's sequence found on ``cu_seqlens_k``, the CPU
   backward's scheme). Warp ``w`` owns 16 keys; their K and V rows are staged once, and their dK
   and dV accumulators stay in registers while the block walks every query head of the group
   (GQA is summed here) and every query tile of ``block_m`` rows that sees the key tile (causal:
   from the diagonal on). Per query tile (Q and dO staged with ``cp.async``), in the warp's
   fragments: ``Sᵀ = K·Qᵀ``; ``Pᵀ`` from the raw product and the row's lse (the CPU backward's
   score math, ``backward._ScoreMath``: the variants' score and masks, 0 where a key is hidden
   or the row saw none, the sink joining the lse); ``dV += Pᵀ·dO`` (Pᵀ's C fragments are the A
   fragments, as the forward's P); ``dPᵀ = V·dOᵀ``; ``dSᵀ = Pᵀ ∘ (dPᵀ − delta)`` times the
   scale and the softcap's and ``score_mod``'s derivatives (a learned bias's reads scattered
   atomically); ``dK += dSᵀ·Q``. ``dS`` goes to shared memory (``block_m × block_n``, the input
   dtype), and the warps then compute the tile's ``dQ`` rows ``dS·K`` (a row group and a slice of
   ``head_dim`` columns each), added atomically into the float32 accumulator (every key tile of
   the sequence adds into the same rows);
3. **post**: ``dQ`` from the accumulator, in the input dtype.

Rows are at positions ``i + Skv − Sq`` of their sequence (bottom-right); a row with ``lse = −inf``
(no key) takes no gradient. The two workspaces, ``dq_accum`` (Q's shape) and ``delta`` (lse's),
float32, are parameters the call allocates (none of them holds a score: the audit's rule is about
the score matrix).

``emulate=True``: serial loops in place of the thread bindings, global memory for shared and
registers, the PTX instructions by their definitions in scalar TIR (``fused_mma``'s), atomics as
plain adds (the emulation runs the blocks one after another): run by LLVM on the CPU against
the float64 reference.
"""
from __future__ import annotations

import math
import types

from tvm import tirx
from tvm.script import tirx as T

from ..spec import AttentionSpec
from ..tvm_internals import fast_macros
from ._math import ssa_checked
from .fused_cuda import flat_offset
from .backward import ROWS, _clear_chain, _partials, _scatter_chain, _ScoreMath
from .fused_mma import CP_DST, SMEM_PAD, WARP, _mma_context, _mma_fragments, smem_stride

#: the library's entry function (the forward's is ``attention``)
ENTRY = "attention_backward"

ATOMIC_ADD = r"""
__device__ __forceinline__ void attn_atomic_add(void* dst, float value) { atomicAdd((float*)dst, value); }"""


def first_query_tile(key0, off, block_m: int, causal: bool):
    """The first query tile that sees key ``key0`` (a key tile's first): row ``i`` sees key ``j``
    from ``i = j − off`` on under bottom-right causality (``off = Skv − Sq``), every tile without."""
    return T.floordiv(T.max(0, key0 - off), block_m) if causal else 0


# -- fragment addressing: the shared element a lane's ldmatrix row address names ---------------
def a_addr(base, stride, row0, col0, lane):
    """A (16 × 16) of a row-major tile, rows ``row0..``, columns ``col0..``."""
    return base + (row0 + lane % 8 + 8 * (lane // 8 % 2)) * stride + col0 + 8 * (lane // 16)


def b_rows(base, stride, n0, k0, lane):
    """B of two 8-wide n slices, n the tile's rows (K read as Kᵀ)."""
    return base + (n0 + lane % 8 + 8 * (lane // 16)) * stride + k0 + 8 * (lane // 8 % 2)


def b_cols(base, stride, k0, n0, lane):
    """B (ldmatrix ``.trans``) of two 8-wide n slices, k the tile's rows."""
    return base + (k0 + lane % 8 + 8 * (lane // 8 % 2)) * stride + n0 + 8 * (lane // 16)


def backward_shared_bytes(spec: AttentionSpec, warps: int, block_m: int) -> int:
    """Shared memory of a main-kernel block: K and V tiles (``16·warps`` rows), the Q and dO tiles
    (``block_m`` rows), the dS tile (``block_m × 16·warps``); rows padded by 16 bytes."""
    bn = 16 * warps
    d, dv = smem_stride(spec.head_dim), smem_stride(spec.v_dim)
    return (bn * (d + dv) + block_m * (d + dv) + block_m * (bn + SMEM_PAD)) * spec.itemsize


def _context(spec: AttentionSpec, warps: int, block_m: int, emulate: bool, wrt: tuple[str, ...] = ()):
    """The kernel's constants and helpers (``fused_mma``'s fragments and ``mma_pair``)."""
    x = _mma_fragments(_mma_context(spec, warps, 16 * warps, 1, 1, emulate))
    W, BN, BM = warps, 16 * warps, block_m
    D, DV = spec.head_dim, spec.v_dim
    RGQ = BM // 16  # the dQ product's row groups
    CGQ = W // RGQ  # ... and the warps of each (a slice of head_dim's 16-column chunks each)
    x.__dict__.update(W=W, BN=BN, BM=BM, D=D, DV=DV, RGQ=RGQ, CGQ=CGQ, ST=smem_stride(D), VST=smem_stride(DV),
                      PST=BN + SMEM_PAD, NQ=BM // 8, NKV=BN // 16, NDK=D // 8, NDV=DV // 8,
                      scale=float(spec.scale))
    # the variants: the CPU backward's score math (which keys a row sees, P from the raw product,
    # dS with the softcap's and score_mod's chain rule, the sink's denominator) over this kernel's
    # own dims, and their arguments' buffers (declared here, made parameters by backward_mma)
    rows = ROWS[spec.layout](spec, x.BN, BM)
    if spec.layout == "bhsd":  # this kernel's own dims (ints, or the vars of _mma_context)
        rows.B, rows.SQ, rows.SKV, rows.bound_rows = x.B, x.SQ, x.SK, x.B
        rows.qs, rows.ks, rows.vs = (x.B, x.H, x.SQ, D), (x.B, x.KH, x.SK, D), (x.B, x.KH, x.SK, DV)
        rows.os, rows.ls = (x.B, x.H, x.SQ, DV), (x.B, x.H, x.SQ)
    f32 = "float32"
    x.__dict__.update(
        rows=rows, varlen=spec.layout == "varlen",
        sm=_ScoreMath(spec, rows, wrt), raw=spec.softcap is not None or spec.score_mod is not None, wrt=wrt,
        SL=tirx.decl_buffer((x.H,), f32, "SL") if spec.alibi else None,
        SKB=tirx.decl_buffer((x.H,), f32, "SK") if spec.sinks else None,
        KST=tirx.decl_buffer((x.B,), "int32", "KST") if spec.kv_start else None,
        DSK=tirx.decl_buffer((x.H,), f32, "DSK") if spec.sinks else None)
    # with grad_tensors: each differentiated tensor's d_<name>_partials (H, elements), a row a
    # query head (the CPU backward's outputs, summed by the call), added into atomically here
    x.parts = _partials(spec, x.sm, wrt)
    return x


def _helpers(spec: AttentionSpec, warps: int, block_m: int, emulate: bool, wrt: tuple[str, ...] = ()):
    """Every constant, addressing function and fragment macro of one backward kernel, by name
    (the stage builders below unpack what each uses)."""
    x = _context(spec, warps, block_m, emulate, wrt)
    (B, H, KH, SQ, SK, D, DV, G, W, BN, BM, RGQ, CGQ, ST, VST, PST, NQ, NKV, NDK, NDV, dtype, EMU) = (
        x.B, x.H, x.KH, x.SQ, x.SK, x.D, x.DV, x.G, x.W, x.BN, x.BM, x.RGQ, x.CGQ, x.ST, x.VST, x.PST, x.NQ, x.NKV,
        x.NDK, x.NDV, x.dtype, x.EMU)
    call, ix, fshape, fscope, mma_pair = x.call, x.ix, x.fshape, x.fscope, x.mma_pair
    thread_x, thread_y, block = x.thread_x, x.thread_y, x.block
    causal = x.causal
    rows = x.rows  # before the macros: a macro binds the names it reads where it is defined
    NTHR = W * WARP
    smem = "global" if EMU else "shared.dyn"
    # the dS tile apart, in static shared memory: TVM's barrier pass sees the dynamic tiles as one
    # merged buffer, so dS's stores there looked like writes over Q's and K's ldmatrix reads and it
    # added a barrier before them; apart, the kernel's own barriers order them (three a query tile)
    small = "global" if EMU else "shared"
    NKT = (SK + BN - 1) // BN if isinstance(SK, int) else T.floordiv(SK + BN - 1, BN)  # key tiles
    # prep/post: a block per 64 rows of each (sequence, head); varlen: of the packed rows, one "sequence"
    NB, NROWS = (1, x.rows.TQ) if x.varlen else (B, SQ)
    WRT = bool(wrt)
    NRT = (NROWS + 63) // 64 if isinstance(NROWS, int) else T.floordiv(NROWS + 63, 64)
    off = SK - SQ  # row i sits at key position i + off

    def atomic_add(buf, index, value):
        return T.cuda.func_call("attn_atomic_add", buf.access_ptr("rw", offset=flat_offset(buf, index)), value,
                                source_code=ATOMIC_ADD)

    @T.macro
    def lds_a(Af, a_off, buf, base, stride, row0, col0, ty, tx):
        if EMU:
            for s in T.unroll(8):
                Af[ty, tx, a_off + s] = buf[base + (row0 + tx // 4 + 8 * (s // 2 % 2)) * stride + col0 + 2 * (tx % 4)
                                            + s % 2 + 8 * (s // 4)]
        else:
            T.evaluate(call("attn_ldsm_x4", Af.access_ptr("w", offset=a_off),
                            buf.access_ptr("r", offset=a_addr(base, stride, row0, col0, tx))))

    @T.macro
    def lds_b_rows(Bf, buf, base, stride, n0, k0, ty, tx):
        if EMU:
            for i in T.unroll(4):
                for e in T.unroll(2):
                    Bf[ty, tx, i * 2 + e] = buf[b_rows(base, stride, n0, k0, i * 8 + tx // 4) + 2 * (tx % 4) + e]
        else:
            T.evaluate(call("attn_ldsm_x4", Bf.access_ptr("w"),
                            buf.access_ptr("r", offset=b_rows(base, stride, n0, k0, tx))))

    @T.macro
    def lds_b_cols(Bf, buf, base, stride, k0, n0, ty, tx):
        if EMU:
            for i in T.unroll(4):
                for e in T.unroll(2):
                    Bf[ty, tx, i * 2 + e] = buf[b_cols(base, stride, k0, n0, i * 8 + 2 * (tx % 4) + e) + tx // 4]
        else:
            T.evaluate(call("attn_ldsm_x4_trans", Bf.access_ptr("w"),
                            buf.access_ptr("r", offset=b_cols(base, stride, k0, n0, tx))))

    @T.macro
    def stage(S, X, keys, seq, hd, r0, nrows, width, stride, limit, ty, tx):
        # rows r0.. of the sequence's head ``hd`` of X (its keys: K, V; else its rows: Q, dO) into
        # the shared tile S (row stride ``stride``), 16 bytes a copy (rows past ``limit`` read its
        # last: never used)
        for it in T.unroll(math.ceil(nrows * width // 8 / NTHR)):
            if it * NTHR + ty * WARP + tx < nrows * width // 8:
                if EMU:
                    for v in T.serial(8):
                        S[(it * NTHR + ty * WARP + tx) // (width // 8) * stride
                          + (it * NTHR + ty * WARP + tx) % (width // 8) * 8 + v] = X[
                            (rows.k if keys else rows.q)(
                                seq[0], hd, T.min(r0 + (it * NTHR + ty * WARP + tx) // (width // 8), limit - 1),
                                (it * NTHR + ty * WARP + tx) % (width // 8) * 8 + v)]
                else:
                    T.evaluate(call("attn_cp_async16", S.access_ptr(
                        CP_DST, offset=(it * NTHR + ty * WARP + tx) // (width // 8) * stride
                        + (it * NTHR + ty * WARP + tx) % (width // 8) * 8), X.access_ptr("r", offset=flat_offset(
                            X, (rows.k if keys else rows.q)(
                                seq[0], hd, T.min(r0 + (it * NTHR + ty * WARP + tx) // (width // 8), limit - 1),
                                (it * NTHR + ty * WARP + tx) % (width // 8) * 8)))))

    @T.macro
    def sync():
        if not EMU:
            T.tvm_storage_sync("shared")

    @T.macro
    def landed(ty, tx):
        if not EMU:
            T.evaluate(call("attn_cp_commit"))
            T.evaluate(call("attn_cp_wait0"))

    def row_at(seq, qt, first, tx, k):  # the sequence's query row of a score slot, clamped into its rows
        return T.min((first[0] + qt) * BM + row_of(tx, k), seq[3] - 1)

    def key_at(seq, ty, tx, k):  # ... and its key, clamped into its keys (the hooks index by both)
        return T.min(seq[2] + key_of(ty, tx, k), seq[4] - 1)


    def q_at(seq, hd, i, d):  # q, o, do, dq, dq_accum: the layout's index of a row's column
        return rows.q(seq[0], hd, i, d)

    def l_at(seq, hd, i):  # lse, delta
        return rows.lse(seq[0], hd, i)

    def key_of(ty, tx, k):  # tile key of a score slot (the warp's 16 keys are its rows)
        return ty * 16 + tx // 4 + 8 * (k % 4 // 2)

    def row_of(tx, k):  # tile query row of a score slot (its columns)
        return k // 4 * 8 + 2 * (tx % 4) + k % 2

    h = types.SimpleNamespace(**{**vars(x), **{k: v for k, v in locals().items() if k != "x"}})
    h.rows_product, h.cols_product = _products(h)
    h.scatter = None
    if wrt:  # the CPU backward's chain of the reads' scatters, atomically (emulated: plain adds)
        probe = [tirx.Var(n, d) for n, d in (("u", "float32"), ("b", "int32"), ("h", "int32"), ("p", "int32"),
                                             ("j", "int32"))]
        h.scatter = _scatter_chain(x.sm, x.parts, len(x.sm.d_score(*probe)[2]), None if EMU else atomic_add)
    h.clear_parts = _clear_chain(list(x.parts.values()))
    return h


def _products(h):
    """The two forms of the fragments' products: ``rows_product`` (the warp's 16 rows of a tile
    times another tile's rows, transposed) and ``cols_product`` (a C fragment as A times a tile's
    columns, ldmatrix ``.trans``)."""
    (BM, lds_a, lds_b_cols, lds_b_rows, mma_pair, NQ, thread_x, thread_y, W) = \
        (h.BM, h.lds_a, h.lds_b_cols, h.lds_b_rows, h.mma_pair, h.NQ, h.thread_x, h.thread_y, h.W)

    @T.macro
    def rows_product(C, Af, Bf, A, astride, Bs, depth):
        # C (the warp's 16 tile rows of A × the tile's BM rows of Bs) = A · Bsᵀ over ``depth``
        # columns: A's fragment per 16-deep step, Bs's (ldmatrix, rows as n) per 16 of its rows.
        # Each ldmatrix in a thread loop of its own: emulated, an mma reads its fragments from
        # every lane, all of which must have loaded them
        for dk in T.serial(depth // 16):
            for ty in thread_y(W):
                for tx in thread_x(WARP):
                    with T.sblock("A_ldmatrix"):
                        T.reads()
                        T.writes()
                        lds_a(Af, 0, A, 0, astride, ty * 16, dk * 16, ty, tx)
            for np in T.unroll(NQ // 2):
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("B_ldmatrix"):
                            T.reads()
                            T.writes()
                            lds_b_rows(Bf, Bs, 0, astride, np * 16, dk * 16, ty, tx)
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("rows_mma"):
                            T.reads()
                            T.writes()
                            mma_pair(C, np * 8, Af, 0, Bf, ty, tx)

    @T.macro
    def cols_product(C, Pf, Bf, Bs, bstride, width):
        # C (the warp's 16 keys × ``width`` columns) += Pf (its C fragments as A: keys × the
        # tile's BM rows) · Bs (BM rows × width, ldmatrix .trans)
        for kk in T.serial(BM // 16):
            for dp in T.unroll(width // 16):
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("B_ldmatrix_trans"):
                            T.reads()
                            T.writes()
                            lds_b_cols(Bf, Bs, 0, bstride, kk * 16, dp * 16, ty, tx)
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("cols_mma"):
                            T.reads()
                            T.writes()
                            mma_pair(C, dp * 8, Pf, kk * 8, Bf, ty, tx)

    # a block's sequence in registers, ``seq``: (sequence, kv head, first key, its rows, its keys)

    return rows_product, cols_product


def _prep_post(h):
    """The first kernel (``delta = rowsum(dO ∘ O)``, the accumulator zeroed) and the last (``dQ =
    accumulator · scale``)."""
    (atomic_add, block, clear_parts, D, DSK, dtype, DV, EMU, H, NB, NROWS, NRT, rows, SKB, sm, thread_x, WRT) = \
        (h.atomic_add, h.block, h.clear_parts, h.D, h.DSK, h.dtype, h.DV, h.EMU, h.H, h.NB, h.NROWS, h.NRT, h.rows,
         h.SKB, h.sm, h.thread_x, h.WRT)

    @T.macro
    def prep(O, DO, LSE, delta, dq_accum):
        # -- prep: delta = rowsum(dO ∘ O), the accumulator zeroed; with sinks, dsinks zeroed
        # first, then each row's −p_sink·delta added into its head's (atomically)
        if SKB is not None:
            for h in thread_x(H):
                with T.sblock("dsinks_zero"):
                    vh = T.axis.spatial(H, h)
                    T.reads()
                    T.writes()
                    DSK[vh] = T.float32(0)
        if WRT:  # each query head's row of the tensors' partials
            for h in thread_x(H):
                with T.sblock("partials_zero"):
                    vh = T.axis.spatial(H, h)
                    T.reads()
                    T.writes()
                    clear_parts(vh)
        for bz in block(NB, "z"):
            for by in block(H, "y"):
                for bx in block(NRT, "x"):
                    for r in thread_x(64):
                        with T.sblock("prep"):
                            vb, vh, vr, vi = T.axis.remap("SSSS", [bz, by, bx, r])
                            T.reads()
                            T.writes()
                            if vr * 64 + vi < NROWS:
                                delta[rows.lse(vb, vh, vr * 64 + vi)] = T.float32(0)
                                for d in T.serial(DV):
                                    delta[rows.lse(vb, vh, vr * 64 + vi)] = delta[rows.lse(vb, vh, vr * 64 + vi)] \
                                        + T.Cast("float32", DO[rows.q(vb, vh, vr * 64 + vi, d)]) \
                                        * T.Cast("float32", O[rows.q(vb, vh, vr * 64 + vi, d)])
                                for d in T.serial(D):
                                    dq_accum[rows.q(vb, vh, vr * 64 + vi, d)] = T.float32(0)
                                if SKB is not None:  # dsink_h = −Σ p_sink·delta over the head's rows
                                    if EMU:
                                        DSK[vh] = DSK[vh] - T.exp(SKB[vh] - sm.row_lse(
                                            LSE[rows.lse(vb, vh, vr * 64 + vi)], SKB[vh])) \
                                            * delta[rows.lse(vb, vh, vr * 64 + vi)]
                                    else:
                                        T.evaluate(atomic_add(DSK, (vh,), T.float32(0) - T.exp(SKB[vh] - sm.row_lse(
                                            LSE[rows.lse(vb, vh, vr * 64 + vi)], SKB[vh]))
                                            * delta[rows.lse(vb, vh, vr * 64 + vi)]))

    @T.macro
    def post(DQ, dq_accum):
        # -- post: dQ = the accumulator (dS carries the scale: _ScoreMath.grad) --------------------
        for bz in block(NB, "z"):
            for by in block(H, "y"):
                for bx in block(NRT, "x"):
                    for r in thread_x(64):
                        with T.sblock("post"):
                            vb, vh, vr, vi = T.axis.remap("SSSS", [bz, by, bx, r])
                            T.reads()
                            T.writes()
                            if vr * 64 + vi < NROWS:
                                for d in T.serial(D):
                                    DQ[rows.q(vb, vh, vr * 64 + vi, d)] = T.Cast(
                                        dtype, dq_accum[rows.q(vb, vh, vr * 64 + vi, d)])

    return prep, post


def _query_tile(h):
    """One query tile of a key tile's block: Q and dO staged, ``Sᵀ``, ``Pᵀ``, ``dV``, ``dPᵀ``, ``dSᵀ``,
    ``dK``, then dS through shared memory for the tile's dQ rows, added atomically."""
    (atomic_add, BM, CGQ, cols_product, D, dtype, DV, EMU, G, ix, key_at, key_of, KST, l_at, landed, lds_a,
     lds_b_cols, mma_pair, NKV, NQ, off, PST, q_at, raw, RGQ, row_at, row_of, rows_product, scatter, SKB, SL, sm,
     ST, stage, sync, thread_x, thread_y, VST, W, WRT) = \
        (h.atomic_add, h.BM, h.CGQ, h.cols_product, h.D, h.dtype, h.DV, h.EMU, h.G, h.ix, h.key_at, h.key_of, h.KST,
         h.l_at, h.landed, h.lds_a, h.lds_b_cols, h.mma_pair, h.NKV, h.NQ, h.off, h.PST, h.q_at, h.raw, h.RGQ,
         h.row_at, h.row_of, h.rows_product, h.scatter, h.SKB, h.SL, h.sm, h.ST, h.stage, h.sync, h.thread_x,
         h.thread_y, h.VST, h.W, h.WRT)

    @T.macro
    def query_tile(Q, DO, LSE, delta, dq_accum, Ks, Vs, Qs, Ds, Ss, Af, Bf, S, Sr, dP, Pf, Sa, dK, dV, dQ, first, seq,
                   g, qt):
        # no barrier before these copies: every warp read the last tile's Q and dO before the
        # barrier after its dS (the race checker: one here was never needed), and its dS reads
        # end before the barrier after these copies land, which the next dS stores follow
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("q_load"):
                    T.reads()
                    T.writes()
                    stage(Qs, Q, False, seq, seq[1] * G + g, (first[0] + qt) * BM, BM, D, ST, seq[3], ty, tx)
                    stage(Ds, DO, False, seq, seq[1] * G + g, (first[0] + qt) * BM, BM, DV, VST, seq[3], ty, tx)
                    landed(ty, tx)
        sync()
        # Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: the warp's 16 keys × the tile's rows
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("S_init"):
                    T.reads()
                    T.writes()
                    for k in T.unroll(NQ * 4):
                        S[ix(ty, tx, k)] = T.float32(0)
                        dP[ix(ty, tx, k)] = T.float32(0)
        rows_product(S, Af, Bf, Ks, ST, Qs, D)
        rows_product(dP, Af, Bf, Vs, VST, Ds, DV)
        # Pᵀ, dV += Pᵀ·dO, dSᵀ = Pᵀ ∘ (dPᵀ − delta), dK += dSᵀ·Q, dS to Ss
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("P_exp"):
                    T.reads()
                    T.writes()
                    for k in T.unroll(NQ * 4):
                        if raw:  # the raw product, for dS's chain rule (softcap, score_mod)
                            Sr[ix(ty, tx, k)] = S[ix(ty, tx, k)]
                        # P from the raw product: the variants' score and masks, the row's lse
                        # (+inf for a row that saw no key; with sinks, the sink joins it)
                        S[ix(ty, tx, k)] = sm.prob(
                            S[ix(ty, tx, k)], sm.row_lse(LSE[l_at(seq, seq[1] * G + g, row_at(seq, qt, first, tx, k))],
                                                         None if SKB is None else SKB[seq[1] * G + g]),
                            T.And((first[0] + qt) * BM + row_of(tx, k) < seq[3], seq[2] + key_of(ty, tx, k) < seq[4]),
                            row_at(seq, qt, first, tx, k), key_at(seq, ty, tx, k),
                            None if SL is None else SL[seq[1] * G + g], None if KST is None else KST[seq[0]], seq[0],
                            seq[1] * G + g)
                        Pf[ix(ty, tx, k)] = T.Cast(dtype, S[ix(ty, tx, k)])
        cols_product(dV, Pf, Bf, Ds, VST, DV)
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("dS"):
                    T.reads()
                    T.writes()
                    for k in T.unroll(NQ * 4):
                        if WRT:  # dT = P ∘ (dP − delta), times each tensor read's derivative, scattered
                            if S[ix(ty, tx, k)] != T.float32(0):
                                scatter(seq[1] * G + g, S[ix(ty, tx, k)] * (dP[ix(ty, tx, k)] - delta[
                                    l_at(seq, seq[1] * G + g, row_at(seq, qt, first, tx, k))]),
                                    sm._score(Sr[ix(ty, tx, k)], row_at(seq, qt, first, tx, k), key_at(seq, ty, tx, k),
                                              None if SL is None else SL[seq[1] * G + g], seq[0]),
                                    seq[0], seq[1] * G + g, row_at(seq, qt, first, tx, k) + sm.off(seq[0]),
                                    key_at(seq, ty, tx, k))
                        # dS on the raw product: P ∘ (dP − delta), times the scale and the
                        # softcap's and score_mod's derivatives (_ScoreMath.grad)
                        dP[ix(ty, tx, k)] = sm.grad(
                            S[ix(ty, tx, k)],
                            dP[ix(ty, tx, k)] - delta[l_at(seq, seq[1] * G + g, row_at(seq, qt, first, tx, k))],
                            Sr[ix(ty, tx, k)], row_at(seq, qt, first, tx, k), key_at(seq, ty, tx, k),
                            None if SL is None else SL[seq[1] * G + g], seq[0], seq[1] * G + g)
                        Pf[ix(ty, tx, k)] = T.Cast(dtype, dP[ix(ty, tx, k)])
                        Ss[row_of(tx, k) * PST + key_of(ty, tx, k)] = Pf[ix(ty, tx, k)]
        cols_product(dK, Pf, Bf, Qs, ST, D)
        sync()  # dS complete
        # dQ rows (a row group and a slice of 16-column chunks a warp) += dS·K
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("dS_frag"):
                    T.reads()
                    T.writes()
                    for kk in T.unroll(NKV):
                        lds_a(Sa, kk * 8, Ss, 0, PST, ty % RGQ * 16, kk * 16, ty, tx)
        for dc in T.serial(D // 16 // CGQ):
            for ty in thread_y(W):
                for tx in thread_x(WARP):
                    with T.sblock("dQ_init"):
                        T.reads()
                        T.writes()
                        for s in T.unroll(8):
                            dQ[ix(ty, tx, s)] = T.float32(0)
            for kk in T.unroll(NKV):
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("K_ldmatrix"):
                            T.reads()
                            T.writes()
                            lds_b_cols(Bf, Ks, 0, ST, kk * 16, (dc * CGQ + ty // RGQ) * 16, ty, tx)
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("dQ_mma"):
                            T.reads()
                            T.writes()
                            mma_pair(dQ, 0, Sa, kk * 8, Bf, ty, tx)
            for ty in thread_y(W):
                for tx in thread_x(WARP):
                    with T.sblock("dQ_add"):
                        T.reads()
                        T.writes()
                        for s in T.unroll(8):
                            if (first[0] + qt) * BM + ty % RGQ * 16 + tx // 4 + 8 * (s % 4 // 2) < seq[3]:
                                if EMU:
                                    dq_accum[q_at(seq, seq[1] * G + g, (first[0] + qt) * BM + ty % RGQ * 16
                                                  + tx // 4 + 8 * (s % 4 // 2),
                                                  (dc * CGQ + ty // RGQ) * 16 + s // 4 * 8 + 2 * (tx % 4) + s % 2)] = \
                                        dq_accum[q_at(seq, seq[1] * G + g, (first[0] + qt) * BM + ty % RGQ * 16
                                                      + tx // 4 + 8 * (s % 4 // 2),
                                                      (dc * CGQ + ty // RGQ) * 16 + s // 4 * 8 + 2 * (tx % 4) + s % 2)] \
                                        + dQ[ty, tx, s]
                                else:
                                    T.evaluate(atomic_add(dq_accum, q_at(
                                        seq, seq[1] * G + g, (first[0] + qt) * BM + ty % RGQ * 16
                                        + tx // 4 + 8 * (s % 4 // 2),
                                        (dc * CGQ + ty // RGQ) * 16 + s // 4 * 8 + 2 * (tx % 4) + s % 2), dQ[s]))

    return query_tile


def _key_tile(h):
    """A key tile's block: K and V staged, its warps' dK and dV over every query head of the group
    and every query tile that sees the tile, then stored (dS carried the scale)."""
    (BM, BN, causal, D, dtype, DV, fscope, fshape, G, ix, key_of, landed, NDK, NDV, NKV, NQ, PST, raw, rows, SK,
     small, smem, SQ, ST, stage, thread_x, thread_y, varlen, VST, W) = \
        (h.BM, h.BN, h.causal, h.D, h.dtype, h.DV, h.fscope, h.fshape, h.G, h.ix, h.key_of, h.landed, h.NDK, h.NDV,
         h.NKV, h.NQ, h.PST, h.raw, h.rows, h.SK, h.small, h.smem, h.SQ, h.ST, h.stage, h.thread_x, h.thread_y,
         h.varlen, h.VST, h.W)
    query_tile = _query_tile(h)

    @T.macro
    def key_tile(Q, K, V, DO, LSE, delta, dq_accum, DK, DV_, vb, vkh, vt):
        # vb, vkh, vt: the grid's (bhsd: sequence, kv head, key tile; varlen: 0, kv head, tile slot)
        Ks = T.sblock_alloc_buffer((BN * ST,), dtype, scope=smem)
        Vs = T.sblock_alloc_buffer((BN * VST,), dtype, scope=smem)
        Qs = T.sblock_alloc_buffer((BM * ST,), dtype, scope=smem)
        Ds = T.sblock_alloc_buffer((BM * VST,), dtype, scope=smem)  # dO's rows
        Ss = T.sblock_alloc_buffer((BM * PST,), dtype, scope=small)  # dS (rows × keys)
        Af = T.sblock_alloc_buffer(fshape(8), dtype, scope=fscope)
        Bf = T.sblock_alloc_buffer(fshape(8), dtype, scope=fscope)
        S = T.sblock_alloc_buffer(fshape(NQ * 4), "float32", scope=fscope)  # Sᵀ, then Pᵀ
        # the raw Sᵀ kept beside Pᵀ where dS's chain rule reads it (softcap, score_mod)
        Sr = T.meta_var(T.sblock_alloc_buffer(fshape(NQ * 4), "float32", scope=fscope) if raw else S)
        dP = T.sblock_alloc_buffer(fshape(NQ * 4), "float32", scope=fscope)  # dPᵀ, then dSᵀ
        Pf = T.sblock_alloc_buffer(fshape(NQ * 4), dtype, scope=fscope)  # Pᵀ, then dSᵀ, as A
        Sa = T.sblock_alloc_buffer(fshape(NKV * 8), dtype, scope=fscope)  # dS rows, as A
        dK = T.sblock_alloc_buffer(fshape(NDK * 4), "float32", scope=fscope)
        dV = T.sblock_alloc_buffer(fshape(NDV * 4), "float32", scope=fscope)
        dQ = T.sblock_alloc_buffer(fshape(8), "float32", scope=fscope)
        first = T.sblock_alloc_buffer((1,), "int32", scope="local")  # the first query tile
        # the block's sequence, kv head, first key, rows and keys (varlen: its slot's, found by a
        # binary search on cu_seqlens_k, the CPU backward's slot scheme)
        seq = T.sblock_alloc_buffer((5,), "int32", scope="local")
        with T.sblock("kv_stage"):
            T.reads()
            T.writes()
            if varlen:
                rows.locate(seq, vkh * rows.k_slots + vt, True)
                seq[3] = rows.len_q(seq[0])
                seq[4] = rows.len_k(seq[0])
            else:
                seq[0] = vb
                seq[1] = vkh
                seq[2] = vt * BN
                seq[3] = SQ
                seq[4] = SK
            # a slot past its sequence's keys (varlen) has no query tile to walk
            first[0] = T.Select(seq[2] < seq[4], first_query_tile(seq[2], seq[4] - seq[3], BM, causal),
                                T.floordiv(seq[3] + BM - 1, BM))
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("kv_load"):
                    T.reads()
                    T.writes()
                    stage(Ks, K, True, seq, seq[1], seq[2], BN, D, ST, seq[4], ty, tx)
                    stage(Vs, V, True, seq, seq[1], seq[2], BN, DV, VST, seq[4], ty, tx)
                    landed(ty, tx)  # waited here: no copy is left in flight whatever the loops run
                    for k in T.unroll(NDK * 4):
                        dK[ix(ty, tx, k)] = T.float32(0)
                    for k in T.unroll(NDV * 4):
                        dV[ix(ty, tx, k)] = T.float32(0)
        for g in T.serial(G):
            for qt in T.serial(T.max(0, T.floordiv(seq[3] + BM - 1, BM) - first[0])):
                query_tile(Q, DO, LSE, delta, dq_accum, Ks, Vs, Qs, Ds, Ss, Af, Bf, S, Sr, dP, Pf, Sa, dK, dV,
                           dQ, first, seq, g, qt)
        # dK·scale and dV of the warp's keys
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("kv_store"):
                    T.reads()
                    T.writes()
                    for k in T.unroll(NDK * 4):
                        if seq[2] + key_of(ty, tx, k) < seq[4]:
                            DK[rows.k(seq[0], seq[1], seq[2] + key_of(ty, tx, k), k // 4 * 8 + 2 * (tx % 4) + k % 2)] = \
                                T.Cast(dtype, dK[ix(ty, tx, k)])
                    for k in T.unroll(NDV * 4):
                        if seq[2] + key_of(ty, tx, k) < seq[4]:
                            DV_[rows.k(seq[0], seq[1], seq[2] + key_of(ty, tx, k), k // 4 * 8 + 2 * (tx % 4) + k % 2)] = \
                                T.Cast(dtype, dV[ix(ty, tx, k)])

    return key_tile


@fast_macros  # TVMScript macro expansion without its costly stack walk, only while this generates
def backward_mma(spec: AttentionSpec, warps: int = 4, block_m: int = 64, emulate: bool = False,
                 grad_tensors: tuple[str, ...] = ()) -> tirx.PrimFunc:
    """The backward of the BHSD ``spec`` (float16 or bfloat16). Parameters (call order): ``Q (B, H,
    Sq, D)``, ``K (B, KH, Skv, D)``, ``V (B, KH, Skv, Dv)``, ``O (B, H, Sq, Dv)``, ``LSE (B, H, Sq)``
    float32 (the forward's, natural log), ``DO (B, H, Sq, Dv)``; the variants' arguments (the CPU
    backward's names: ``SL`` alibi_slopes, ``SK`` sinks ``(H,)``, ``KST`` kv_start ``(B,)``; key
    bounds, the custom mask and the modifiers' tensors by their names); outputs ``DQ``, ``DK``,
    ``DV_`` (the shapes of Q, K, V), with sinks ``DSK`` dsinks ``(H,)``, with ``grad_tensors``
    ``d_<name>_partials (H, elements)`` (each query head's share); workspaces ``dq_accum
    (B, H, Sq, D)``, ``delta (B, H, Sq)`` float32. ``warps``: 16 keys each (``block_n =
    16·warps``); ``block_m``: query rows per tile, a multiple of 16 whose row groups divide the
    warps."""
    if spec.layout not in ("bhsd", "varlen") or spec.dtype not in ("float16", "bfloat16"):
        raise ValueError("the CUDA backward takes float16/bfloat16 bhsd and varlen specs")
    if block_m % 16 or warps % (block_m // 16):
        raise ValueError(f"block_m={block_m}: a multiple of 16 whose row groups ({block_m // 16}) divide warps={warps}")
    h = _helpers(spec, warps, block_m, emulate, tuple(grad_tensors))
    (B, block, D, dtype, DV, H, KH, NKT, SK, SQ) = (h.B, h.block, h.D, h.dtype, h.DV, h.H, h.KH, h.NKT, h.SK, h.SQ)
    R = h.rows
    # varlen's cu_seqlens, then the variants' arguments after do; dsinks after dv (the CPU backward's order)
    inputs = list(R.params) + [b for b in (h.SL, h.SKB, h.KST) if b is not None] + h.sm.extra.params
    outputs = ([h.DSK] if h.DSK is not None else []) + [h.parts[n] for n in grad_tensors]
    prep, post = _prep_post(h)
    key_tile = _key_tile(h)

    @T.prim_func(s_tir=True, check_well_formed=False)
    def attention_backward(
        Q: T.Buffer(R.qs, dtype), K: T.Buffer(R.ks, dtype), V: T.Buffer(R.vs, dtype), O: T.Buffer(R.os, dtype),
        LSE: T.Buffer(R.ls, "float32"), DO: T.Buffer(R.os, dtype), DQ: T.Buffer(R.qs, dtype),
        DK: T.Buffer(R.ks, dtype), DV_: T.Buffer(R.vs, dtype), dq_accum: T.Buffer(R.qs, "float32"),
        delta: T.Buffer(R.ls, "float32"),
    ):
        T.func_attr({"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "backward_mma",
                     "attn.warps": warps, "attn.block_m": block_m})
        prep(O, DO, LSE, delta, dq_accum)
        # -- main: a block per (key tile, kv head, sequence) ------------------------------------
        for bz in block(1 if h.varlen else B, "z"):  # varlen: (tile slot, kv head)
            for by in block(KH, "y"):
                for bx in block(R.k_slots if h.varlen else NKT, "x"):
                    with T.sblock("key_tile"):
                        vb, vkh, vt = T.axis.remap("SSS", [bz, by, bx])
                        T.reads()
                        T.writes()
                        key_tile(Q, K, V, DO, LSE, delta, dq_accum, DK, DV_, vb, vkh, vt)
        post(DQ, dq_accum)

    params = list(attention_backward.params)  # Q K V O LSE DO, DQ DK DV_, dq_accum delta
    params = params[:6] + inputs + params[6:9] + outputs + params[9:]
    return ssa_checked(tirx.PrimFunc(params, attention_backward.body, attention_backward.ret_type,
                                     attention_backward.attrs))
