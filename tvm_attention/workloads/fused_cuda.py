"""The fused attention PrimFunc for CUDA GPUs, threads mapped in the compute itself.

One thread block per (batch, head, row tile of ``block_m`` queries) — a flat grid for static
lengths; with symbolic batch or lengths (``spec.dynamic``) the grid is (row tile, head, batch) on
``blockIdx.x/y/z``, so no index divides by a run-time extent, and the key tail is masked at run
time (seq_kv 0 gives zero rows: a row that sees no key); ``block_m ×
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
from ._math import LOG2E, exp2_fast, guarded, normalize, normalize_where
from .kv import dim

ENTRY = "attention"
VECTOR_BYTES = 16  # one 128-bit load/store per thread per step


def vector_elems(dtype: str) -> int:
    return VECTOR_BYTES // {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


class _Simt:
    """The shape of one SIMT kernel (``fused_attention_cuda``'s arguments): its constants and the
    helpers its macros index with. ``dims`` lists the constants in the order the macro builders
    unpack them (``DIMS`` names them)."""

    DIMS = ("B", "H", "KH", "SQ", "SK", "D", "G", "BM", "BN", "TPR", "NJ", "ND", "NR", "NC", "dtype", "VEC", "QST",
            "PST", "QIT", "KIT", "qscale", "neg_inf", "smem")

    def __init__(self, spec: AttentionSpec, block_m: int, block_n: int, threads_per_row: int, emulate: bool):
        self.spec, self.emulate = spec, emulate
        B, H, KH = dim(spec, "batch"), spec.heads, spec.kv_heads
        SQ, SK, D = dim(spec, "seq_q"), dim(spec, "seq_kv"), spec.head_dim
        G = spec.group_size
        BM, BN, TPR = block_m, block_n, threads_per_row
        NJ, ND = BN // TPR, D // TPR  # keys and head-dim columns per lane
        NR = math.ceil(SQ / BM) if isinstance(SQ, int) else T.floordiv(SQ + BM - 1, BM)
        NC = math.ceil(SK / BN) if isinstance(SK, int) else T.floordiv(SK + BN - 1, BN)
        vis = Visibility.of(spec)
        OFF = vis.offset(SQ, SK)
        kv_tail = not isinstance(SK, int) or SK % BN != 0
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
        self.vis, self.OFF, self.kv_tail, self.masked = vis, OFF, kv_tail, masked
        values = locals()
        for name in self.DIMS:
            setattr(self, name, values[name])

    @property
    def dims(self) -> tuple:
        return tuple(getattr(self, name) for name in self.DIMS)

    def thread_y(self, n):
        return T.serial(n) if self.emulate else T.thread_binding(n, thread="threadIdx.y")

    def thread_x(self, n):
        return T.serial(n) if self.emulate else T.thread_binding(n, thread="threadIdx.x")

    def block(self, n, axis="x"):
        return T.serial(n) if self.emulate else T.thread_binding(n, thread=f"blockIdx.{axis}")

    def vec(self, n):
        return T.serial(n) if self.emulate else T.vectorized(n)

    def n_tiles(self, r0):
        vis = self.vis
        key_end = vis.key_end(vis.position(r0 + self.BM, self.OFF))  # what the tile's rows may see
        if key_end is not None:
            return T.max(0, T.min(self.NC, vis.tiles_to(key_end, self.BN)))
        return self.NC

    def kv_row(self, j):
        return T.min(j, self.SK - 1) if self.kv_tail else j

    def masked_score(self, s, r0, vr, col):
        if not self.masked:
            return s
        vis = self.vis
        cond = col < self.SK
        seen = vis.sees(col, vis.position(r0 + vr, self.OFF))
        if seen is not None:
            cond = T.And(cond, seen)
        return T.Select(cond, s, self.neg_inf)

    # (batch, head, first row) of the tile a thread block owns. Helpers, not assignments inside
    # the script: an assignment there becomes a 1-element local buffer per variable.
    # A symbolic build takes its tile from a 3-D grid, ``vbx = (batch, head, row tile)``
    # (blockIdx.z, .y, .x, FlashAttention-2's order): no division by a run-time extent.
    def bi(self, vbx):
        return vbx[0] if isinstance(vbx, tuple) else vbx // (self.H * self.NR)

    def hi(self, vbx):
        return vbx[1] if isinstance(vbx, tuple) else vbx % (self.H * self.NR) // self.NR

    def ri(self, vbx):
        return vbx[2] * self.BM if isinstance(vbx, tuple) else vbx % self.NR * self.BM

    def flat(self, it, ty, tx, v):
        # Element a thread loads in a cooperative tile copy: consecutive lanes take consecutive
        # 16-byte vectors, so the loads coalesce; row = flat // D, column = flat % D.
        return ((it * self.BM + ty) * self.TPR + tx) * self.VEC + v

    def f32(self, x):
        return x if self.dtype == "float32" else T.Cast("float32", x)


def _simt_load_macros(k: _Simt):
    """The Q tile (staged once) with the state's init, and each key tile's K and V, into shared
    memory with coalesced 16-byte loads."""
    (B, H, KH, SQ, SK, D, G, BM, BN, TPR, NJ, ND, NR, NC, dtype, VEC, QST, PST, QIT, KIT, qscale, neg_inf,
     smem) = k.dims
    thread_y, thread_x, vec, flat, bi, hi, ri, f32 = k.thread_y, k.thread_x, k.vec, k.flat, k.bi, k.hi, k.ri, k.f32
    G, kv_row = k.dims[6], k.kv_row

    @T.macro
    def q_load(Q, Qs, m, l, acc, vbx):
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

    @T.macro
    def kv_load(K, V, Ks, Vs, vbx, c):
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

    return q_load, kv_load


def _simt_softmax_macro(k: _Simt):
    """One key tile's scores in registers, the row max and row sum across a row's lanes (warp
    shuffles), and P = exp2(S - m_new) into the shared P tile."""
    (B, H, KH, SQ, SK, D, G, BM, BN, TPR, NJ, ND, NR, NC, dtype, VEC, QST, PST, QIT, KIT, qscale, neg_inf,
     smem) = k.dims
    thread_y, thread_x, vec, flat, bi, hi, ri, f32 = k.thread_y, k.thread_x, k.vec, k.flat, k.bi, k.hi, k.ri, k.f32
    masked_score = k.masked_score

    @T.macro
    def softmax(Qs, Ks, Ps, S, m, pmax, psum, m_new, l_tile, alpha, vbx, c):
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

    return softmax


def _simt_pv_store_macros(k: _Simt):
    """The online correction with ``acc += P·V``, and the store ``O = acc / l``."""
    (B, H, KH, SQ, SK, D, G, BM, BN, TPR, NJ, ND, NR, NC, dtype, VEC, QST, PST, QIT, KIT, qscale, neg_inf,
     smem) = k.dims
    thread_y, thread_x, vec, flat, bi, hi, ri, f32 = k.thread_y, k.thread_x, k.vec, k.flat, k.bi, k.hi, k.ri, k.f32
    spec = k.spec
    static = not spec.dynamic

    def out(acc, l, row):
        # static lengths: normalize decides at build time whether a row may see no key;
        # symbolic: the same fact of the mask, a run-time predicate of the lengths
        if static:
            return normalize(acc, l, row, spec)
        return normalize_where(acc, l, k.vis.sees_a_key(k.vis.position(row, k.OFF), SK))

    @T.macro
    def pv(Ps, Vs, acc, l, l_tile, alpha):
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

    @T.macro
    def store(O, acc, l, vbx):
        # -- O = acc / l (0 for a row that saw no key) --------------------------------
        for ty in thread_y(BM):
            for tx in thread_x(TPR):
                with T.sblock("O_store"):
                    T.reads()
                    T.writes()
                    if ri(vbx) + ty < SQ:
                        for dd in T.serial(ND):
                            O[bi(vbx), hi(vbx), ri(vbx) + ty, dd * TPR + tx] = T.Cast(dtype, out(
                                acc[ty, tx, dd], l[ty, tx], ri(vbx) + ty))

    return pv, store


def fused_attention_cuda(
    spec: AttentionSpec, block_m: int, block_n: int, threads_per_row: int, emulate: bool = False
) -> tirx.PrimFunc:
    """Arguments (call order): ``Q (B, H, Sq, D)``, ``K (B, KH, Skv, D)``, ``V (B, KH, Skv, D)``,
    ``O (B, H, Sq, D)``, all ``spec.dtype``, compact row-major."""
    k = _Simt(spec, block_m, block_n, threads_per_row, emulate)
    (B, H, KH, SQ, SK, D, G, BM, BN, TPR, NJ, ND, NR, NC, dtype, VEC, QST, PST, QIT, KIT, qscale, neg_inf,
     smem) = k.dims
    thread_y, thread_x, vec, flat, bi, hi, ri, f32 = k.thread_y, k.thread_x, k.vec, k.flat, k.bi, k.hi, k.ri, k.f32
    n_tiles = k.n_tiles
    block = k.block
    static = not spec.dynamic
    q_load, kv_load = _simt_load_macros(k)
    softmax = _simt_softmax_macro(k)
    pv, store = _simt_pv_store_macros(k)

    @T.macro
    def tile(Q, K, V, O, vbx):
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

        q_load(Q, Qs, m, l, acc, vbx)
        for c in T.serial(n_tiles(ri(vbx))):
            kv_load(K, V, Ks, Vs, vbx, c)
            softmax(Qs, Ks, Ps, S, m, pmax, psum, m_new, l_tile, alpha, vbx, c)
            pv(Ps, Vs, acc, l, l_tile, alpha)
        store(O, acc, l, vbx)

    grid = tile_grid(block, B, H, NR, static, tile)

    @T.prim_func(s_tir=True)
    def attention(
        Q: T.Buffer((B, H, SQ, D), dtype),
        K: T.Buffer((B, KH, SK, D), dtype),
        V: T.Buffer((B, KH, SK, D), dtype),
        O: T.Buffer((B, H, SQ, D), dtype),
    ):
        T.func_attr({"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused_cuda",
                     "attn.block_m": BM, "attn.block_n": BN, "attn.threads_per_row": TPR})
        grid(Q, K, V, O)

    return attention


#: gridDim.y's and gridDim.z's limit: a symbolic build's heads (refused at build time, by
#: ``grid_refusal``) and batch (refused per call by the loader, which cannot import this module)
MAX_GRID_YZ = 65535


def grid_refusal(spec: AttentionSpec) -> str | None:
    """Why ``tile_grid`` cannot launch ``spec`` (None: it can): a symbolic build has one grid row
    per head on ``blockIdx.y``."""
    if spec.dynamic and spec.heads > MAX_GRID_YZ:
        return f"heads={spec.heads} > {MAX_GRID_YZ}: a symbolic build launches one grid row per head (gridDim.y)"
    return None


def tile_grid(block, B, H, NR, static: bool, tile):
    """The thread blocks of a CUDA kernel (both: this one and ``fused_mma``), each running the
    macro ``tile(Q, K, V, O, vbx)`` on its tile: a flat grid of ``B·H·NR`` blocks for static
    lengths (``vbx`` the block index), a (row tile, head, batch) grid on ``blockIdx.x/y/z`` for
    symbolic ones (``vbx = (batch, head, row tile)``: no index divides by a run-time extent).
    ``block(n, axis)`` binds a grid loop (or a serial one, emulated)."""

    @T.macro
    def grid(Q, K, V, O):
        if static:
            for bx in block(B * H * NR, "x"):
                with T.sblock("row_tile"):
                    vbx = T.axis.spatial(B * H * NR, bx)
                    T.reads()
                    T.writes()
                    tile(Q, K, V, O, vbx)
        else:  # no guard for batch or seq_q 0 (a zero grid, a launch error): TVM's sync insertion
            # refuses a condition around the kernel; the loader answers empty calls itself
            for bz in block(B, "z"):
                for by in block(H, "y"):
                    for bx in block(NR, "x"):
                        with T.sblock("row_tile"):
                            vb, vh, vr = T.axis.remap("SSS", [bz, by, bx])
                            T.reads()
                            T.writes()
                            tile(Q, K, V, O, (vb, vh, vr))

    return grid
