"""The fused attention PrimFunc for CUDA GPUs, threads mapped in the compute itself.

One thread block per (batch, head, row tile of ``block_m`` queries); ``block_m ×
threads_per_row`` threads: ``threadIdx.y`` is the query row of the tile and ``threadIdx.x``
(``g``, fastest) the lane within that row's group, so a row's lanes are adjacent in one warp.

Per key tile of ``block_n`` keys:

* K and V tiles are loaded cooperatively into shared memory with ``vector``-element (16-byte)
  coalesced loads; rows are padded by one vector so neither the loads nor the per-row reads hit
  the same bank; the Q tile is staged the same way once;
* lane ``g`` of row ``r`` computes scores for keys ``jj·threads_per_row + g`` into registers
  (``s``, local), keeps a partial max, then the row max is a cross-thread reduction over the
  row's lanes — TVM lowers it to warp shuffles (``__shfl_down_sync``/``__shfl_sync``);
* online correction: ``alpha = exp2(m − m_new)`` rescales the running sum and the accumulator
  (registers: lane ``g`` owns head-dim columns ``dd·threads_per_row + g``); a tile with no
  visible key cannot make NaN (the reference max is 0 while the max is −inf);
* probabilities go to a shared ``(block_m, block_n)`` tile ``P`` for the PV product (each lane
  needs its whole row), the row sum is a second shuffle reduction;
* under causal masking the key-tile loop stops at the diagonal.

Inputs may be float16/bfloat16; every product and sum accumulates in float32, the output is
stored in the input dtype. ``emulate=True`` gives the same PrimFunc with serial loops instead of
thread bindings and global instead of shared memory, which runs on the CPU (LLVM) — it checks
the algorithm and the index math, not the GPU schedule.
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ..spec import AttentionSpec
from ..visibility import Visibility
from ._math import LOG2E, exp2_fast, guarded, normalize

ENTRY = "attention"
VECTOR_BYTES = 16  # one 128-bit load/store per thread per step


def vector_elems(dtype: str) -> int:
    return VECTOR_BYTES // {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


def fused_attention_cuda(
    spec: AttentionSpec, block_m: int, block_n: int, threads_per_row: int, emulate: bool = False
) -> tirx.PrimFunc:
    """Arguments (call order): ``Q (B, H, Sq, D)``, ``K (B, KH, Skv, D)``, ``V (B, KH, Skv, D)``,
    ``O (B, H, Sq, D)``, all ``spec.dtype``, compact row-major."""
    B, H, KH = spec.batch, spec.heads, spec.kv_heads
    SQ, SK, D = spec.seq_q, spec.seq_kv, spec.head_dim
    G = spec.group_size
    BM, BN, TPR = block_m, block_n, threads_per_row
    NJ, ND = BN // TPR, D // TPR  # keys and head-dim columns per lane
    NR, NC = math.ceil(SQ / BM), math.ceil(SK / BN)
    vis = Visibility.of(spec)
    OFF = vis.offset(SQ, SK)
    kv_tail = SK % BN != 0
    masked = vis.hides_keys or kv_tail
    dtype = spec.dtype
    VEC = vector_elems(dtype)
    PAD = VEC  # one vector of padding per shared row: keeps 16-byte alignment, spreads banks
    QST = D + PAD  # row stride of the Q, K, V tiles in shared memory
    PST = BN + 4  # row stride of the P tile
    NT = BM * TPR
    QIT = math.ceil(BM * D // VEC / NT)  # vector loads per thread for the Q tile
    KIT = math.ceil(BN * D // VEC / NT)  # ... and for each K/V tile
    qscale = float(spec.scale * LOG2E)
    neg_inf = T.float32(float("-inf"))
    smem = "global" if emulate else "shared"

    def thread_y(n):
        return T.serial(n) if emulate else T.thread_binding(n, thread="threadIdx.y")

    def thread_x(n):
        return T.serial(n) if emulate else T.thread_binding(n, thread="threadIdx.x")

    def block_x(n):
        return T.serial(n) if emulate else T.thread_binding(n, thread="blockIdx.x")

    def vec(n):
        return T.serial(n) if emulate else T.vectorized(n)

    def n_tiles(r0):
        key_end = vis.key_end(vis.position(r0 + BM, OFF))  # what the tile's rows may see
        if key_end is not None:
            return T.max(0, T.min(NC, vis.tiles_to(key_end, BN)))
        return NC

    def kv_row(j):
        return T.min(j, SK - 1) if kv_tail else j

    def masked_score(s, r0, vr, col):
        if not masked:
            return s
        cond = col < SK
        seen = vis.sees(col, vis.position(r0 + vr, OFF))
        if seen is not None:
            cond = T.And(cond, seen)
        return T.Select(cond, s, neg_inf)


    # (batch, head, first row) of the tile a thread block owns. Helpers, not assignments inside
    # the script: an assignment there becomes a 1-element local buffer per variable.
    def bi(vbx):
        return vbx // (H * NR)

    def hi(vbx):
        return vbx % (H * NR) // NR

    def ri(vbx):
        return vbx % NR * BM

    def flat(it, ty, tx, v):
        # Element a thread loads in a cooperative tile copy: consecutive lanes take consecutive
        # 16-byte vectors, so the loads coalesce; row = flat // D, column = flat % D.
        return ((it * BM + ty) * TPR + tx) * VEC + v

    def f32(x):
        return x if dtype == "float32" else T.Cast("float32", x)

    @T.prim_func(s_tir=True)
    def attention(
        Q: T.Buffer((B, H, SQ, D), dtype),
        K: T.Buffer((B, KH, SK, D), dtype),
        V: T.Buffer((B, KH, SK, D), dtype),
        O: T.Buffer((B, H, SQ, D), dtype),
    ):
        T.func_attr({"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused_cuda",
                     "attn.block_m": BM, "attn.block_n": BN, "attn.threads_per_row": TPR})
        for bx in block_x(B * H * NR):
            with T.sblock("row_tile"):
                vbx = T.axis.spatial(B * H * NR, bx)
                T.reads()
                T.writes()
                # Shared tiles are flat with padded row strides: a 2-D (rows, D + PAD) buffer would
                # be compacted back to (rows, D), since nothing reads the padding.
                Qs = T.sblock_alloc_buffer((BM * QST,), dtype, scope=smem)
                Ks = T.sblock_alloc_buffer((BN * QST,), dtype, scope=smem)
                Vs = T.sblock_alloc_buffer((BN * QST,), dtype, scope=smem)
                Ps = T.sblock_alloc_buffer((BM * PST,), "float32", scope=smem)  # probabilities
                S = T.sblock_alloc_buffer((BM, TPR, NJ), "float32", scope="local")  # scores (registers)
                acc = T.sblock_alloc_buffer((BM, TPR, ND), "float32", scope="local")
                m = T.sblock_alloc_buffer((BM, TPR), "float32", scope="local")  # running max, log2
                l = T.sblock_alloc_buffer((BM, TPR), "float32", scope="local")  # running sum
                pmax = T.sblock_alloc_buffer((BM, TPR), "float32", scope="local")  # lane partials
                psum = T.sblock_alloc_buffer((BM, TPR), "float32", scope="local")
                m_new = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # shuffle results
                l_tile = T.sblock_alloc_buffer((BM,), "float32", scope="local")
                alpha = T.sblock_alloc_buffer((BM, TPR), "float32", scope="local")

                # -- stage the Q tile (coalesced 16-byte loads) ------------------------------
                for ty in thread_y(BM):
                    for tx in thread_x(TPR):
                        for it in T.serial(QIT):
                            for v in vec(VEC):
                                with T.sblock("Q_load"):
                                    T.reads()
                                    T.writes()
                                    if flat(it, ty, tx, v) < BM * D:
                                        Qs[flat(it, ty, tx, v) // D * QST
                                           + flat(it, ty, tx, v) % D] = Q[
                                            bi(vbx), hi(vbx), T.min(ri(vbx) + flat(it, ty, tx, v) // D, SQ - 1),
                                            flat(it, ty, tx, v) % D]
                for ty in thread_y(BM):
                    for tx in thread_x(TPR):
                        with T.sblock("state_init"):
                            T.reads()
                            T.writes()
                            m[ty, tx] = neg_inf
                            l[ty, tx] = T.float32(0)
                            for dd in T.serial(ND):
                                acc[ty, tx, dd] = T.float32(0)

                for c in T.serial(n_tiles(ri(vbx))):
                    # -- K and V tiles into shared memory ------------------------------------
                    for ty in thread_y(BM):
                        for tx in thread_x(TPR):
                            for it in T.serial(KIT):
                                for v in vec(VEC):
                                    with T.sblock("KV_load"):
                                        T.reads()
                                        T.writes()
                                        if flat(it, ty, tx, v) < BN * D:
                                            Ks[flat(it, ty, tx, v) // D * QST
                                               + flat(it, ty, tx, v) % D] = K[
                                                bi(vbx), hi(vbx) // G, kv_row(c * BN + flat(it, ty, tx, v) // D),
                                                flat(it, ty, tx, v) % D]
                                            Vs[flat(it, ty, tx, v) // D * QST
                                               + flat(it, ty, tx, v) % D] = V[
                                                bi(vbx), hi(vbx) // G, kv_row(c * BN + flat(it, ty, tx, v) // D),
                                                flat(it, ty, tx, v) % D]
                    # -- scores in registers, per-lane partial max -----------------------------
                    for ty in thread_y(BM):
                        for tx in thread_x(TPR):
                            with T.sblock("S_gemm"):
                                T.reads()
                                T.writes()
                                pmax[ty, tx] = m[ty, tx]
                                for jj in T.unroll(NJ):
                                    S[ty, tx, jj] = T.float32(0)
                                # d outside the lane's keys: each Q element is read once and used
                                # NJ times. With the keys outside, nvcc (sm_90) kept the whole Q row
                                # in registers for the NJ passes: 223 registers at fp32 D=128.
                                for d in T.serial(D):
                                    for jj in T.unroll(NJ):
                                        S[ty, tx, jj] = S[ty, tx, jj] + f32(Qs[ty * QST + d]) * f32(Ks[(jj * TPR + tx) * QST + d])
                                for jj in T.unroll(NJ):
                                    S[ty, tx, jj] = masked_score(
                                        S[ty, tx, jj] * T.float32(qscale), ri(vbx), ty, c * BN + jj * TPR + tx)
                                    pmax[ty, tx] = T.max(pmax[ty, tx], S[ty, tx, jj])
                    # -- row max across the row's lanes (warp shuffle) -----------------------
                    for ty in thread_y(BM):
                        for tx in thread_x(TPR):
                            with T.sblock("row_max"):
                                vy, vx = T.axis.remap("SR", [ty, tx])
                                T.reads(pmax[vy, vx])
                                T.writes(m_new[vy])
                                with T.init():
                                    m_new[vy] = T.min_value("float32")
                                m_new[vy] = T.max(m_new[vy], pmax[vy, vx])
                    # -- P = exp2(S - m_new) to shared, per-lane partial sum -----------------
                    for ty in thread_y(BM):
                        for tx in thread_x(TPR):
                            with T.sblock("P_exp"):
                                T.reads()
                                T.writes()
                                alpha[ty, tx] = exp2_fast(m[ty, tx] - guarded(m_new[ty]))
                                m[ty, tx] = m_new[ty]
                                psum[ty, tx] = T.float32(0)
                                for jj in T.unroll(NJ):
                                    # the row sum adds the register value: reading it back from
                                    # the shared tile made TVM fence every element with a
                                    # __syncthreads (33 per key tile at fp16 D=64; now 3)
                                    S[ty, tx, jj] = exp2_fast(S[ty, tx, jj] - guarded(m_new[ty]))
                                    psum[ty, tx] = psum[ty, tx] + S[ty, tx, jj]
                                    Ps[ty * PST + jj * TPR + tx] = S[ty, tx, jj]
                    for ty in thread_y(BM):
                        for tx in thread_x(TPR):
                            with T.sblock("row_sum"):
                                vy, vx = T.axis.remap("SR", [ty, tx])
                                T.reads(psum[vy, vx])
                                T.writes(l_tile[vy])
                                with T.init():
                                    l_tile[vy] = T.float32(0)
                                l_tile[vy] = l_tile[vy] + psum[vy, vx]
                    # -- online correction and acc += P·V --------------------------------------
                    for ty in thread_y(BM):
                        for tx in thread_x(TPR):
                            with T.sblock("PV_gemm"):
                                T.reads()
                                T.writes()
                                l[ty, tx] = l[ty, tx] * alpha[ty, tx] + l_tile[ty]
                                for dd in T.unroll(ND):
                                    acc[ty, tx, dd] = acc[ty, tx, dd] * alpha[ty, tx]
                                for j in T.serial(BN):
                                    for dd in T.unroll(ND):
                                        acc[ty, tx, dd] = acc[ty, tx, dd] + Ps[ty * PST + j] * f32(Vs[j * QST + dd * TPR + tx])

                # -- O = acc / l (0 for a row that saw no key) --------------------------------
                for ty in thread_y(BM):
                    for tx in thread_x(TPR):
                        with T.sblock("O_store"):
                            T.reads()
                            T.writes()
                            if ri(vbx) + ty < SQ:
                                for dd in T.serial(ND):
                                    O[bi(vbx), hi(vbx), ri(vbx) + ty, dd * TPR + tx] = T.Cast(dtype, normalize(
                                        acc[ty, tx, dd], l[ty, tx], ri(vbx) + ty, spec))

    return attention
