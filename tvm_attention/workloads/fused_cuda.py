"""The fused attention PrimFunc for CUDA GPUs, threads mapped in the compute itself.

One thread block per (batch, head, row tile of ``block_m`` queries) — a flat grid for static
lengths; with symbolic batch or lengths (``spec.dynamic``) the grid is (row tile, head, batch) on
``blockIdx.x/y/z``, so no index divides by a run-time extent, and the key tail is masked at run
time (seq_kv 0 gives zero rows: a row that sees no key); in the varlen layout the grid is
(tile slot, head) and a block finds its sequence from ``cu_seqlens_q`` (:func:`varlen_grid`).
Where a block's rows, keys and output live is its :class:`Tile`, shared with ``fused_mma``.
``block_m × threads_per_row`` threads: ``threadIdx.y`` is the query row of the tile and ``threadIdx.x``
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

from ..cuda_tools import shared_scope
from ..spec import ENTRY, AttentionSpec
from ..tvm_internals import fast_macros
from ..visibility import Visibility
from ._math import LOG2E, exp2_fast, f32_to_kv, guarded, kv_to_f32, lse_of, ssa_checked
from .fused import MIN_SPLIT_KEYS, key_clamp, n_splits
from .knob_attrs import CUDA_SPLIT, FUSED_CUDA, record
from .kv import dim, kv_layout
from .variants import Variants, score_scale

VECTOR_BYTES = 16  # one 128-bit load/store per thread per step


def vector_elems(dtype: str) -> int:
    return VECTOR_BYTES // {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


def kv_byte(spec: AttentionSpec, vec, lanes: int, v):
    """Element ``v`` of an 8-bit cache's ``vec``, a vector load of ``lanes`` (4 or 8) of its
    bytes (one 32- or 64-bit load where as many byte loads were as many instructions), as the
    cache's element type for :func:`kv_reader` (float8: its bits, uint8; int8)."""
    word = T.reinterpret(f"uint{8 * lanes}", vec)
    b = T.Cast("uint8", T.shift_right(word, T.Cast(f"uint{8 * lanes}", 8 * v)))
    return T.reinterpret("int8", b) if spec.kv_dtype == "int8" else b


def kv_reader(spec: AttentionSpec):
    """``x -> value`` of one K/V element for the kernels' shared tiles (``spec.dtype``): the
    element itself, or an 8-bit cache's stored value converted (``kv_to_f32`` without
    ``KV_UNIT``, and without the head's scale: :meth:`Tile.k_scaled` and :meth:`Tile.out`
    apply both once per score and per output), exact in float16 and bfloat16."""
    if not spec.kv_quantized:
        return lambda x: x
    return lambda x: T.Cast(spec.dtype, kv_to_f32(x, spec.kv_dtype, unit=False))


class _Simt:
    """The shape of one SIMT kernel (``fused_attention_cuda``'s arguments): its constants and the
    helpers its macros index with. ``dims`` lists the constants in the order the macro builders
    unpack them (``DIMS`` names them)."""

    DIMS = ("B", "H", "KH", "SQ", "SK", "D", "G", "BM", "BN", "TPR", "NJ", "ND", "dtype", "VEC", "QST",
            "PST", "QIT", "KIT", "qscale", "neg_inf", "smem")

    def __init__(self, spec: AttentionSpec, block_m: int, block_n: int, threads_per_row: int, emulate: bool):
        self.spec, self.emulate = spec, emulate
        B, H, KH = dim(spec, "batch"), spec.heads, spec.kv_heads
        SQ, SK, D = dim(spec, "seq_q"), dim(spec, "seq_kv"), spec.head_dim
        G = spec.group_size
        BM, BN, TPR = block_m, block_n, threads_per_row
        NJ, ND = BN // TPR, D // TPR  # keys and head-dim columns per lane
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
        # past 48 KiB the tiles are one dynamic allocation (shared.dyn, opted in at launch)
        # V and O: head_dim_v columns (DeepSeek's unabsorbed MLA: 192 for Q and K, 128 for V)
        self.DV = DV = spec.v_dim
        self.NDV = DV // TPR  # output columns per lane
        self.VST = DV + PAD  # row stride of the V tile
        self.VIT = math.ceil(BN * DV // VEC / NT)  # vector loads per thread for each V tile
        smem = "global" if emulate else shared_scope(((BM + BN) * QST + BN * self.VST) * spec.itemsize
                                                     + BM * PST * 4)
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

    def kv_vec(self, n):
        # an 8-bit cache's elements are converted one by one (CUDA has no vector form of the
        # bit operations of kv_to_f32)
        return T.unroll(n) if self.spec.kv_quantized else self.vec(n)

    def flat(self, it, ty, tx, v):
        # Element a thread loads in a cooperative tile copy: consecutive lanes take consecutive
        # 16-byte vectors, so the loads coalesce; row = flat // D, column = flat % D.
        return ((it * self.BM + ty) * self.TPR + tx) * self.VEC + v

    def f32(self, x):
        return x if self.dtype == "float32" else T.Cast("float32", x)


def _simt_load_macros(k: _Simt):
    """The Q tile (staged once) with the state's init, and each key tile's K and V, into shared
    memory with coalesced 16-byte loads."""
    (B, H, KH, SQ, SK, D, G, BM, BN, TPR, NJ, ND, dtype, VEC, QST, PST, QIT, KIT, qscale, neg_inf,
     smem) = k.dims
    thread_y, thread_x, vec, flat, kv_vec = k.thread_y, k.thread_x, k.vec, k.flat, k.kv_vec
    kv_value = kv_reader(k.spec)
    quantized = k.spec.kv_quantized

    @T.macro
    def q_load(Q, Qs, m, l, acc, w):
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
                                    w.q_at(w.row0 + flat(it, ty, tx, v) // D, flat(it, ty, tx, v) % D)]
        for ty in thread_y(BM):
            for tx in thread_x(TPR):
                with T.sblock("state_init"):
                    T.reads()
                    T.writes()
                    m[ty, tx] = neg_inf
                    l[ty, tx] = T.float32(0)
                    for dd in T.serial(k.NDV):
                        acc[ty, tx, dd] = T.float32(0)

    DV, VST, VIT = k.DV, k.VST, k.VIT

    @T.macro
    def load(K, V, Ks, Vs, w, c, XD, XST, XIT, which):
        # -- K and V tiles into shared memory: both in one loop (``which`` "kv": equal widths),
        # or one of them ("k", "v": head_dim_v != head_dim), XD columns, row stride XST
        for ty in thread_y(BM):
            for tx in thread_x(TPR):
                for it in T.serial(XIT):
                    for v in kv_vec(VEC):
                        with T.sblock("KV_load"):
                            T.reads()
                            T.writes()
                            if flat(it, ty, tx, v) < BN * XD:
                                if quantized:  # the vector's bytes in one load, each converted
                                    if which != "v":
                                        Ks[flat(it, ty, tx, v) // XD * XST + flat(it, ty, tx, v) % XD] = kv_value(
                                            kv_byte(k.spec, K[w.kv_at(w.tile(c) * BN + flat(it, ty, tx, 0) // XD,
                                                                      T.Ramp(flat(it, ty, tx, 0) % XD, 1, VEC))], VEC, v))
                                    if which != "k":
                                        Vs[flat(it, ty, tx, v) // XD * XST + flat(it, ty, tx, v) % XD] = kv_value(
                                            kv_byte(k.spec, V[w.kv_at(w.tile(c) * BN + flat(it, ty, tx, 0) // XD,
                                                                      T.Ramp(flat(it, ty, tx, 0) % XD, 1, VEC))], VEC, v))
                                else:
                                    if which != "v":
                                        Ks[flat(it, ty, tx, v) // XD * XST
                                           + flat(it, ty, tx, v) % XD] = K[
                                            w.kv_at(w.tile(c) * BN + flat(it, ty, tx, v) // XD, flat(it, ty, tx, v) % XD)]
                                    if which != "k":
                                        Vs[flat(it, ty, tx, v) // XD * XST
                                           + flat(it, ty, tx, v) % XD] = V[
                                            w.kv_at(w.tile(c) * BN + flat(it, ty, tx, v) // XD, flat(it, ty, tx, v) % XD)]

    @T.macro
    def kv_load(K, V, Ks, Vs, w, c):
        if DV == D:
            load(K, V, Ks, Vs, w, c, D, QST, KIT, "kv")
        else:
            load(K, V, Ks, Vs, w, c, D, QST, KIT, "k")
            load(K, V, Ks, Vs, w, c, DV, VST, VIT, "v")

    return q_load, kv_load


def _simt_softmax_macro(k: _Simt):
    """One key tile's scores in registers, the row max and row sum across a row's lanes (warp
    shuffles), and P = exp2(S - m_new) into the shared P tile."""
    (B, H, KH, SQ, SK, D, G, BM, BN, TPR, NJ, ND, dtype, VEC, QST, PST, QIT, KIT, qscale, neg_inf,
     smem) = k.dims
    thread_y, thread_x, f32 = k.thread_y, k.thread_x, k.f32

    @T.macro
    def softmax(Qs, Ks, Ps, S, m, pmax, psum, m_new, l_tile, alpha, w, c):
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
                        S[ty, tx, jj] = w.masked(w.logit(S[ty, tx, jj], w.row0 + ty, w.tile(c) * BN + jj * TPR + tx),
                                                 w.row0 + ty, w.tile(c) * BN + jj * TPR + tx)
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
    (B, H, KH, SQ, SK, D, G, BM, BN, TPR, NJ, ND, dtype, VEC, QST, PST, QIT, KIT, qscale, neg_inf,
     smem) = k.dims
    thread_y, thread_x, f32 = k.thread_y, k.thread_x, k.f32
    NDV, VST = k.NDV, k.VST  # the output's columns per lane, V's row stride (head_dim_v)

    @T.macro
    def pv(Ps, Vs, acc, l, l_tile, alpha):
        # -- online correction and acc += P·V --------------------------------------
        for ty in thread_y(BM):
            for tx in thread_x(TPR):
                with T.sblock("PV_gemm"):
                    T.reads()
                    T.writes()
                    l[ty, tx] = l[ty, tx] * alpha[ty, tx] + l_tile[ty]
                    for dd in T.unroll(NDV):
                        acc[ty, tx, dd] = acc[ty, tx, dd] * alpha[ty, tx]
                    for j in T.serial(BN):
                        for dd in T.unroll(NDV):
                            acc[ty, tx, dd] = acc[ty, tx, dd] + Ps[ty * PST + j] * f32(Vs[j * VST + dd * TPR + tx])

    @T.macro
    def store(O, acc, l, m, w):
        # -- O = acc / l (0 for a row that saw no key), the row's log-sum-exp -------------
        for ty in thread_y(BM):
            for tx in thread_x(TPR):
                with T.sblock("O_store"):
                    T.reads()
                    T.writes()
                    if w.final:
                        if w.row0 + ty < w.rows:
                            for dd in T.serial(NDV):
                                O[w.o_at(w.row0 + ty, dd * TPR + tx)] = T.Cast(dtype, w.out(
                                    acc[ty, tx, dd], l[ty, tx], w.row0 + ty, m[ty, tx]))
                            if w.LSE is not None:
                                if tx == 0:  # every lane of the row holds its m and l
                                    w.LSE[w.lse_at(w.row0 + ty)] = lse_of(m[ty, tx], l[ty, tx])
                    else:  # a split-KV chunk's state for the merge kernel: every tile row (those
                        # past the step's are never read), so the workspace keeps its
                        # (batch-sized) shape: a guard would let TVM compact it to seq_q rows.
                        # An ``else``, not ``if not w.final``: ``final`` is a PrimExpr, and
                        # Python's ``not`` of it is a constant (the partials were stored by
                        # every unsplit step, past the token workspace: a crash on an H200)
                        for dd in T.serial(NDV):
                            w.split.Op[w.part_at(ty, dd * TPR + tx)] = acc[ty, tx, dd]
                        if tx == 0:
                            w.split.St[w.part_at(ty, 0)] = m[ty, tx]
                            w.split.St[w.part_at(ty, 1)] = l[ty, tx]

    return pv, store


@fast_macros  # TVMScript macro expansion without its costly stack walk, only while this generates
def fused_attention_cuda(
    spec: AttentionSpec, block_m: int, block_n: int, threads_per_row: int, emulate: bool = False,
    split_tasks: int = 0,
) -> tirx.PrimFunc:
    """Arguments (call order), all ``spec.dtype``, compact row-major: bhsd ``Q (B, H, Sq, D)``,
    ``K (B, KH, Skv, D)``, ``V (B, KH, Skv, D)``, ``O (B, H, Sq, D)``; varlen ``Q (total_q, H,
    D)``, ``K``/``V (total_k, KH, D)``, ``cu_seqlens_q``/``cu_seqlens_k (batch+1,) int32``,
    ``O (total_q, H, D)``; kvcache/paged as :data:`layouts.LAYOUTS` lists them. ``split_tasks``:
    split-KV for the KV-cache layouts (:class:`Split`)."""
    k = _Simt(spec, block_m, block_n, threads_per_row, emulate)
    (B, H, KH, SQ, SK, D, G, BM, BN, TPR, NJ, ND, dtype, VEC, QST, PST, QIT, KIT, qscale, neg_inf,
     smem) = k.dims
    q_load, kv_load = _simt_load_macros(k)
    softmax = _simt_softmax_macro(k)
    pv, store = _simt_pv_store_macros(k)

    @T.macro
    def tile(Q, K, V, O, w):
        # Shared tiles are flat with padded row strides: a 2-D (rows, D + PAD) buffer would
        # be compacted back to (rows, D), since nothing reads the padding.
        Qs = T.sblock_alloc_buffer((BM * QST,), dtype, scope=smem)
        Ks = T.sblock_alloc_buffer((BN * QST,), dtype, scope=smem)
        Vs = T.sblock_alloc_buffer((BN * k.VST,), dtype, scope=smem)
        Ps = T.sblock_alloc_buffer((BM * PST,), "float32", scope=smem)  # probabilities
        S = T.sblock_alloc_buffer((BM, TPR, NJ), "float32", scope="local")  # scores (registers)
        acc = T.sblock_alloc_buffer((BM, TPR, k.NDV), "float32", scope="local")
        m = T.sblock_alloc_buffer((BM, TPR), "float32", scope="local")  # running max, log2
        l = T.sblock_alloc_buffer((BM, TPR), "float32", scope="local")  # running sum
        pmax = T.sblock_alloc_buffer((BM, TPR), "float32", scope="local")  # lane partials
        psum = T.sblock_alloc_buffer((BM, TPR), "float32", scope="local")
        m_new = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # shuffle results
        l_tile = T.sblock_alloc_buffer((BM,), "float32", scope="local")
        alpha = T.sblock_alloc_buffer((BM, TPR), "float32", scope="local")

        q_load(Q, Qs, m, l, acc, w)
        for c in T.serial(w.n_tiles()):
            kv_load(K, V, Ks, Vs, w, c)
            softmax(Qs, Ks, Ps, S, m, pmax, psum, m_new, l_tile, alpha, w, c)
            pv(Ps, Vs, acc, l, l_tile, alpha)
        store(O, acc, l, m, w)

    attrs = {"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused_cuda",
             **record(FUSED_CUDA, block_m=BM, block_n=BN, threads_per_row=TPR)}
    return kernel_func(spec, k.block, BM, BN, (B, SQ, SK), tile, attrs, split_tasks=split_tasks, lanes=k.thread_x)


class Tile:
    """Where one thread block's tile of ``BM`` query rows lives, for both CUDA kernels: what a
    layout changes (the recurrence is the kernel's). ``q``, ``kv``, ``o`` map (row of the
    sequence, column) and (key, column) to index tuples into Q, K/V and O; ``row0`` is the
    tile's first row, ``q_len``/``k_len`` its sequence's lengths (query positions, keys): ints
    compiled in, symbolic vars, or values read at run time (varlen, the KV caches); ``valid``:
    whether the tile has rows at all (varlen's spare slots do not), None when it always has.
    ``group`` > 1 packs a KV head's query heads into the tile (GQA packing, the KV-cache
    layouts): tile row ``r`` is head ``r % group`` of the group at position ``r // group``, so
    the group shares each K/V tile, and a decode step's few positions still fill a tile.

    The attention variants: ``var`` (:class:`.variants.Variants`, :meth:`~.variants.Variants.declare`:
    the call's ``alibi_slopes``, ``sinks``, ``kv_start``, an 8-bit cache's scales; its hooks
    transform the scores and the output), ``b`` the tile's sequence (its ``kv_start``), ``head(row)`` the query
    head of a tile row (its ALiBi slope and sink). A sliding window or a start skips the key
    tiles before what the tile's first row sees: the loop's tile ``c`` is the sequence's
    ``tile(c)``.

    Split-KV (``split``, a :class:`Split`; the KV-cache layouts): the tile is chunk ``s`` of the
    ``split.active`` chunks of its key tiles, ``span = (first, count)`` of them (registers the
    grid computed once from :meth:`chunk_span`), and unless ``split.active`` is 1 (a run-time
    fact: it depends on the batch) it stores its unnormalised state at ``part(row, j)`` of the
    partials (``final`` False) for the merge kernel to combine."""

    def __init__(self, spec: AttentionSpec, BM: int, BN: int, row0, q_len, k_len, q, kv, o, valid=None,
                 group: int = 1, lse=None, var=None, b=None, head=None, split=None, span=None, part=None,
                 kv_head=None):
        self.spec, self.BM, self.BN = spec, BM, BN
        self.row0, self.q_len, self.k_len = row0, q_len, k_len
        self._q, self._kv, self._o = q, kv, o
        self.valid = valid
        self.group = group
        self.rows = q_len if group == 1 else q_len * group  # the tile rows that hold a query
        self._lse = lse  # (LSE buffer, row -> its index), when the kernel returns the log-sum-exp
        self.LSE = None if lse is None else lse[0]
        self.static = isinstance(q_len, int) and isinstance(k_len, int)  # lengths compiled in
        self.vis = vis = Visibility.of(spec)
        # query row i sits at key position i + off: bottom-right causal over the sequence's keys
        self.off = vis.offset(q_len, k_len)
        self.nc = math.ceil(k_len / BN) if isinstance(k_len, int) else T.floordiv(k_len + BN - 1, BN)
        self.kv_tail = not isinstance(k_len, int) or k_len % BN != 0  # the last key tile is partial
        self.var = var if var is not None else Variants(None)
        # the call decides what a row sees (key bounds, a custom mask, mask_mod): any score of any tile
        self.call_masks = self.var.masks_keys
        self.hides = vis.hides_keys or self.kv_tail or self.call_masks  # some score of some tile is masked
        self.head, self.b = head, b  # b: None in varlen (a block finds its sequence at run time)
        self.start = self.var.start(b)  # the sequence's first visible key
        begin = vis.key_begin(vis.position(self.pos(row0), self.off), self.start)
        lo = self.var.key_lo(b, vis.position(self.pos(row0), self.off))
        if lo is not None:  # the key bounds of the tile's first row (non-decreasing: the loader's rule)
            lo = key_clamp(lo)
            begin = lo if begin is None else T.max(begin, lo)
        self.c0 = None if begin is None else vis.tiles_before(begin, BN)  # tiles no row of it sees
        self.split, self.span, self._part = split, span, part
        self.kv_head = kv_head  # the tile's KV head (every row reads it): an 8-bit cache's scales
        # whether the tile stores O (and LSE) itself: always without a split; with one, when
        # the batch fills the GPU alone (one chunk)
        self.final = True if split is None else split.active == 1

    def pos(self, row):
        """The query position of tile row ``row``."""
        return row if self.group == 1 else T.floordiv(row, self.group)

    def tile(self, c):
        """The sequence's key tile of loop iteration ``c``."""
        t = c if self.c0 is None else c + self.c0
        return t if self.split is None else t + self.span[0]

    def n_tiles(self):
        """Key tiles the tile's rows see: past what its last row sees, and (a window, a start)
        before what its first row sees, tiles are skipped; split, those of its chunk."""
        return self._seen_tiles() if self.split is None else self.span[1]

    def chunk_span(self, s, ns):
        """``(first, count)``: the key tiles (counted from the first the rows see) of chunk ``s``
        of ``ns`` of this (unsplit) tile's (:func:`chunk_span`)."""
        return chunk_span(self._seen_tiles(), s, ns, self.BN)

    def _seen_tiles(self):
        vis = self.vis
        end = self.row0 + self.BM if self.group == 1 else self.pos(self.row0 + self.BM - 1) + 1
        key_end = vis.key_end(vis.position(end, self.off))
        hi = self.var.key_hi(self.b, vis.position(end - 1, self.off))
        if hi is not None:  # the key bounds of the tile's last row: the tiles past them are skipped
            hi = key_clamp(hi)
            key_end = hi if key_end is None else T.min(key_end, hi)
        n = self.nc if key_end is None else T.max(0, T.min(self.nc, vis.tiles_to(key_end, self.BN)))
        if self.c0 is not None:
            n = T.max(0, n - self.c0)
        return n if self.valid is None else T.Select(self.valid, n, 0)

    def needs_mask(self, c):
        """Whether loop tile ``c`` holds the key tail, a key the tile's first row does not see
        (past its diagonal or right window) or one its last row does not see (before its left
        window, or the start); None: no tile does. Where the call decides what a row sees
        (key bounds, a custom mask, mask_mod), every tile."""
        if self.call_masks:
            return T.bool(True)
        t = self.tile(c)
        cond = None
        if self.kv_tail:
            cond = t == self.nc - 1
        hidden = self.vis.hides(t * self.BN + self.BN - 1, self.vis.position(self.pos(self.row0), self.off))
        if self.vis.windowed:
            last = self.vis.position(self.pos(self.row0 + self.BM - 1), self.off)
            before = self.vis.hides(t * self.BN, last, self.start)
            hidden = before if hidden is None else T.Or(hidden, before)
        if hidden is not None:
            cond = hidden if cond is None else T.Or(cond, hidden)
        return cond

    def sees(self, row, col):
        """Whether tile row ``row`` (numbered from the sequence's first) sees key ``col``: inside
        the keys and the mask; then the call's key bounds and ``mask_mod`` at the row's key
        position, and its custom mask's bit of (query row, key) (``Variants.sees``/``custom``,
        the CPU kernel's hooks)."""
        cond = col < self.k_len
        position = self.vis.position(self.pos(row), self.off)
        seen = self.vis.sees(col, position, self.start)
        cond = cond if seen is None else T.And(cond, seen)
        if self.call_masks:
            for extra in (self.var.sees(self.b, self.head(row), position, col),
                          self.var.custom(self.b, self.pos(row), col, self.q_len, self.k_len)):
                if extra is not None:
                    cond = T.And(cond, extra)
        return cond

    def mask_bit(self, row, col):
        """Whether a custom mask's bit lets tile row ``row`` (numbered from the sequence's first)
        see key ``col`` (rows and keys clamped into the sequence: a padding row or a tail key reads
        a bit of the mask, never past it)."""
        return self.var.custom(self.b, self.pos(row), col, self.q_len, self.k_len)

    def logit(self, s, row, col):
        """Raw score ``s = q·k`` of (row, key ``col``) in the log2 units of the softmax: times
        ``variants.score_scale`` and the key scale, through the variants' score hook
        (``Variants.logit``: ``s·scale·log2 e``; softcapped, ``c·tanh(s·scale / c)·log2 e``; less
        ALiBi's ``slope·|position − key|·log2 e``)."""
        position = self.vis.position(self.pos(row), self.off)
        return self.var.logit(s * self.k_scaled(score_scale(self.spec)), lambda: self.head(row), lambda: position - col,
                              lambda: (self.b, self.head(row), position, col))

    def k_scaled(self, factor: float):
        """``factor`` (float32) times what turns a raw score of an 8-bit cache's converted keys
        into ``q·k``: the tile's KV head's ``k_scale`` and the conversion's unit
        (``Variants.k_scaled``)."""
        return self.var.k_scaled(self.kv_head, factor)

    def masked(self, s, row, col):
        """Score ``s`` of (row, key col), −inf where the row does not see the key."""
        return T.Select(self.sees(row, col), s, T.float32(float("-inf"))) if self.hides else s

    def out(self, acc, l, row, m=None, sunk=None):
        """``acc / l`` of row ``row``, 0 for a row that sees no key: static lengths decide at
        build time whether a row may see none (``normalize``); otherwise the same fact of the
        mask is a run-time predicate of the lengths (and the start). With sinks the denominator
        gains the row's head's sink (``with_sink``, from the row's running max ``m``; or ``sunk``,
        the row's ``(w, l·w + e)`` of :meth:`sink_terms`, bound once per row, ignored without
        sinks). An 8-bit cache's values are scaled here, once per output (``v_scale``,
        ``KV_UNIT``)."""
        acc = self.var.v_scaled(acc, self.kv_head)
        if sunk is None or self.var.SK is None:
            acc, l = self.var.with_sink(acc, l, m, self.head(row))
        else:
            acc, l = acc * sunk[0], sunk[1]
        return self.var.normalized(acc, l, row, self.static and self.start is None, lambda: self.vis.sees_a_key(
            self.vis.position(self.pos(row), self.off), self.k_len, self.start))

    def sink_terms(self, m, row):
        """``(w, e)`` of row ``row`` with running max ``m`` (``Variants.sink_terms``); None
        without sinks."""
        return self.var.sink_terms(m, self.head(row))

    def q_at(self, row, d):
        # rows past the sequence (a tail tile) read its last row: never stored
        return self._q(T.min(row, self.rows - 1), d)

    def kv_at(self, key, d):
        # the tail tile's keys past the last read the last key: those scores are masked
        return self._kv(T.min(key, self.k_len - 1) if self.kv_tail else key, d)

    def o_at(self, row, d):
        return self._o(row, d)

    def lse_at(self, row):
        return self._lse[1](row)

    def part_at(self, row, j):
        """Index of split-KV partial ``j`` of tile row ``row`` (``Op``: column ``j``; ``St``: 0
        the running max, 1 the row sum). A split tile is its step's only row tile (``row0`` 0):
        tile rows are the packed rows; or, where the split holds several (``Split.tiles``), one
        of them: its rows from ``row0``, modulo the workspace's ``BM · tiles`` rows (which they are
        in whenever a chunk stores them: the modulo tells TVM's buffer compaction so, which sized
        the workspace by seq_q from ``row0``'s extent through a clamp, and the fusion audit failed
        it)."""
        if self.split.tiles == 1:
            return self._part(row, j)
        return self._part(T.floormod(self.row0 + row, self.BM * self.split.tiles), j)


class Split:
    """Split-KV of a KV-cache grid: a decode step's (sequence, KV head) runs as ``active``
    thread blocks, one per chunk of its key tiles, so a small batch still fills the GPU; a merge
    kernel combines their partials. ``ns`` is :func:`fused.n_splits` of the batch (1 once
    batch · KV heads reach ``split_tasks``): the chunks a decode step takes; ``active`` is
    ``ns`` when the step's packed rows (seq_q · group) fit one row tile (``NR`` 1), else 1 (a
    prefill chunk has row tiles enough). ``Op (ns, B, KH, BM, D)``: each chunk's unnormalised
    accumulator; ``St (ns, B, KH, BM, 2)``: its running max (log2 units) and row sum. Both live
    in a workspace the function allocates (TVM's device workspace), not among its arguments,
    sized by the batch alone (no length: the fusion audit's rule), and to one KV head's tile
    when ``ns`` is 1. ``tiles`` (a compiled-in count, 1 by default): the row tiles a step may
    have and still split, each chunk's partials at its rows ``row0 + r`` (the MLA kernel: a decode
    step's 128 heads are two row tiles of 64); ``active`` is ``ns`` while ``NR ≤ tiles``."""

    def __init__(self, ns, NR, B, KH: int, BM: int, rows, D: int, Op=None, St=None, tiles: int = 1):
        self.ns, self.NR, self.B, self.KH, self.BM, self.rows, self.D = ns, NR, B, KH, BM, rows, D
        self.tiles = tiles
        self.active = T.Select(NR == 1, ns, 1) if tiles == 1 else T.Select(NR <= tiles, ns, 1)
        # a batch that needs no split keeps a token workspace (batch 512 would hold 134 MB at
        # D=128): no chunk stores a partial then
        used = [T.Select(ns > 1, ns, 1), T.Select(ns > 1, B, 1)]
        self.part_shape = (*used, KH, BM * tiles, D)
        self.state_shape = (*used, KH, BM * tiles, 2)
        self.Op, self.St = Op, St

    def bound(self, Op, St) -> "Split":
        """This split with its partials' buffers (allocated inside the kernel's script)."""
        return Split(self.ns, self.NR, self.B, self.KH, self.BM, self.rows, self.D, Op, St, self.tiles)


def chunk_span(n, s, ns, BN: int):
    """``(first, count)`` of chunk ``s`` of ``ns`` of a tile's ``n`` key tiles of ``BN`` keys
    (split-KV, both CUDA kernels): an equal share, at least :data:`fused.MIN_SPLIT_KEYS` keys,
    so the chunks past the keys are empty (truncdiv: both operands are non-negative, and floordiv
    by a run-time divisor lowers to selects)."""
    chunk = T.max(-(-MIN_SPLIT_KEYS // BN), T.truncdiv(n + ns - 1, ns))
    return s * chunk, T.max(0, T.min(chunk, n - s * chunk))


def dense_tile(spec: AttentionSpec, BM: int, BN: int, b, h, row0, SQ, SK, LSE=None, var=None) -> Tile:
    """The BHSD tile of (batch ``b``, head ``h``) from row ``row0``: Q/O ``(B, H, SQ, D)``,
    K/V ``(B, KH, SK, D)`` (``SQ``, ``SK``: the kernel's ints or vars), GQA mapping head ``h``
    to KV head ``h // group``."""
    G = spec.group_size
    return Tile(spec, BM, BN, row0, SQ, SK,
                q=lambda r, d: (b, h, r, d), kv=lambda j, d: (b, h // G, j, d), o=lambda r, d: (b, h, r, d),
                lse=None if LSE is None else (LSE, lambda r: (b, h, r)), var=var, b=b, head=lambda r: h)


def cache_tile(spec: AttentionSpec, BM: int, BN: int, b, kh, row0, SQ, k_len, kvl, X, LSE=None,
               var=None, split=None, s=None, span=None) -> Tile:
    """The KV-cache tile (kvcache, paged) of (batch ``b``, KV head ``kh``) from packed row
    ``row0``: the group's query heads packed (``Tile.group``), Q/O ``(B, H, SQ, D)``, K/V
    addressed through the kernel's layout ``kvl`` (``kv.kv_layout``: the cache rows, or
    ``block_table``'s pages; ``X`` its index buffers), ``k_len`` the sequence's
    ``cache_seqlens`` entry. ``split``: chunk ``s`` (its key tiles ``span``) of a :class:`Split`
    (the tile's partials at ``(s, b, kh, row, j)``)."""
    G = spec.group_size
    return Tile(spec, BM, BN, row0, SQ, k_len,
                q=lambda r, d: (b, kh * G + T.floormod(r, G), T.floordiv(r, G), d),
                kv=lambda j, d: kvl.index(X, b, kh, j, d),
                o=lambda r, d: (b, kh * G + T.floormod(r, G), T.floordiv(r, G), d), group=G,
                lse=None if LSE is None else (LSE, lambda r: (b, kh * G + T.floormod(r, G), T.floordiv(r, G))),
                var=var, b=b, head=lambda r: kh * G + T.floormod(r, G),
                split=split, span=span, part=None if split is None else (lambda r, j: (s, b, kh, r, j)), kv_head=kh)


def flat_offset(buf, index) -> tirx.PrimExpr:
    """Element offset of ``buf[index]`` in a compact row-major buffer (an ``access_ptr`` offset)."""
    off = index[0]
    for extent, i in zip(buf.shape[1:], index[1:]):
        off = off * extent + i
    return off


#: gridDim.y's and gridDim.z's limit: a symbolic build's heads (refused at build time, by
#: ``grid_refusal``) and batch (refused per call by the loader, which cannot import this module)
MAX_GRID_YZ = 65535


def grid_refusal(spec: AttentionSpec) -> str | None:
    """Why ``tile_grid`` cannot launch ``spec`` (None: it can): a symbolic build has one grid row
    per head on ``blockIdx.y``."""
    if spec.dynamic and spec.heads > MAX_GRID_YZ:
        return f"heads={spec.heads} > {MAX_GRID_YZ}: a symbolic build launches one grid row per head (gridDim.y)"
    return None


def kernel_func(spec: AttentionSpec, block, BM: int, BN: int, dims: tuple, tile, attrs: dict,
                reverse: bool = False, split_tasks: int = 0, lanes=None, split_tiles: int = 1) -> tirx.PrimFunc:
    """A CUDA kernel's PrimFunc (both: this one and ``fused_mma``) in ``spec``'s layout: its
    signature and its grid of thread blocks, each running the macro ``tile(Q, K, V, O, w)`` on
    its :class:`Tile` ``w``. ``block(n, axis)`` binds a grid loop (or a serial one, emulated);
    ``dims = (B, SQ, SK)`` are the kernel's batch and lengths (ints or the vars of its tiles);
    ``reverse``: the longest row tiles launch first (causal). ``split_tasks`` (the KV-cache
    layouts; 0: none): split-KV until the grid has that many thread blocks (:class:`Split`),
    the merge kernel's lanes bound by ``lanes(n)`` (threadIdx.x, or a serial loop); ``split_tiles``:
    the row tiles a split step may have (``Split.tiles``). A latent layout (MLA) takes its one
    cache as both K and V (V its first ``head_dim_v`` columns)."""
    B, SQ, SK = dims
    var = Variants.declare(spec, B, SQ, SK)
    attrs = {**attrs, **record(CUDA_SPLIT, split_tasks=split_tasks)}  # none when 0
    func, LSE = _kernel_func(spec, block, BM, BN, B, SQ, SK, tile, attrs, reverse, bool(spec.return_lse), var,
                             split_tasks, lanes, split_tiles)
    if LSE is not None or var.buffers:
        # buffers declared outside the script: the variants' arguments before O (the script's
        # last parameter), the log-sum-exp output after it
        params = list(func.params)
        params = params[:-1] + var.buffers + params[-1:] + ([LSE] if LSE is not None else [])
        func = tirx.PrimFunc(params, func.body, func.ret_type, func.attrs)
    return ssa_checked(func)


def _lse_buffer(spec: AttentionSpec, B, SQ, TQ):
    """The LSE output: ``(batch, heads, seq_q)``, or varlen's ``(heads, total_q)``."""
    shape = (spec.heads, TQ) if spec.layout_info.packed else (B, spec.heads, SQ)
    return tirx.decl_buffer(shape, "float32", "LSE")


def _kernel_func(spec, block, BM, BN, B, SQ, SK, tile, attrs, reverse, lse, var, split_tasks=0, lanes=None,
                 split_tiles=1):
    """``kernel_func``'s PrimFunc per layout and the LSE buffer its tiles write (None without
    ``lse``), neither it nor the variants' buffers yet among its parameters: parsed unchecked,
    ``kernel_func`` checks it once they are (``ssa_checked``)."""
    H, KH, D, DV = spec.heads, spec.kv_heads, spec.head_dim, spec.v_dim
    dtype = spec.dtype
    layout = spec.layout_info
    if layout.packed:
        TQ = tirx.Var("total_q", "int32")
        LSE = _lse_buffer(spec, B, SQ, TQ) if lse else None
        grid, TK, NB1 = varlen_grid(spec, block, BM, BN, tile, reverse, TQ, LSE, var)

        @T.prim_func(s_tir=True, check_well_formed=False)
        def attention_varlen(
            Q: T.Buffer((TQ, H, D), dtype),
            K: T.Buffer((TK, KH, D), dtype),
            V: T.Buffer((TK, KH, DV), dtype),
            CQ: T.Buffer((NB1,), "int32"),
            CK: T.Buffer((NB1,), "int32"),
            O: T.Buffer((TQ, H, DV), dtype),
        ):
            T.func_attr(attrs)
            grid(Q, K, V, CQ, CK, O)

        return attention_varlen, LSE
    cache = layout.is_cache
    # the signatures below: a cache's by its index arrays (K/V through its addressing class, kvl);
    # the other dense one's tile reads K/V (B, KH, Skv, D) itself
    index = tuple(a.name for a in layout.index_args)
    if index not in (("cache_seqlens",), ("block_table", "cache_seqlens")) if cache else layout.addressing != "BHSD":
        raise ValueError(f"the CUDA kernels take the bhsd, varlen, kvcache and paged layouts, not {spec.layout}")
    # a KV-cache tile packs a KV head's group (rows = positions × group): one grid row per KV head
    rows = SQ * spec.group_size if cache else SQ
    NR = math.ceil(rows / BM) if isinstance(rows, int) else T.floordiv(rows + BM - 1, BM)
    LSE = _lse_buffer(spec, B, SQ, None) if lse else None
    kvl = kv_layout(spec, B, D) if cache else None  # K/V's shape and addressing
    split = Split(n_splits(split_tasks, B, KH), NR, B, KH, BM, rows, DV, tiles=split_tiles) \
        if cache and split_tasks else None

    def at(b, h, r, k_len=None, X=(), part=None):
        # part: (chunk, Op, St, its span) of a split-KV grid
        row0 = (NR - 1 - r) * BM if reverse else r * BM
        if cache:
            if part is None:
                return cache_tile(spec, BM, BN, b, h, row0, SQ, k_len, kvl, X, LSE, var)
            s, Op, St, span = part
            return cache_tile(spec, BM, BN, b, h, row0, SQ, k_len, kvl, X, LSE, var, split.bound(Op, St), s, span)
        return dense_tile(spec, BM, BN, b, h, row0, SQ, SK, LSE, var)

    new = SQ if spec.append else 0  # an appending kernel: each sequence's keys and its new ones
    merge = None if split is None else merge_grid(spec, block, lanes, split, at, LSE, new)
    grid = tile_grid(block, B, KH if cache else H, NR, not spec.dynamic, tile, at, cache, split, merge, new)
    append = append_grid(spec, block, lanes, kvl, var, B, SQ) if spec.append else None
    if not cache:
        @T.prim_func(s_tir=True, check_well_formed=False)
        def attention(
            Q: T.Buffer((B, H, SQ, D), dtype),
            K: T.Buffer((B, KH, SK, D), dtype),
            V: T.Buffer((B, KH, SK, DV), dtype),
            O: T.Buffer((B, H, SQ, DV), dtype),
        ):
            T.func_attr(attrs)
            grid(Q, K, V, O, ())

        return attention, LSE
    KS = kvl.shape
    VS = tuple(KS[:-1]) + (DV,)  # V's: K's dims (its vars) but head_dim_v columns
    kv_dtype = spec.kv_dtype_name  # an 8-bit cache's (kv_reader converts its elements)
    fp8 = kv_dtype.startswith("float8")  # read through uint8 aliases (kv_to_f32 takes the bits)
    if layout.latent:
        return _latent_func(spec, attrs, B, SQ, kvl, grid, append), LSE
    if index == ("cache_seqlens",):
        @T.prim_func(s_tir=True, check_well_formed=False)
        def attention_kvcache(
            Q: T.Buffer((B, H, SQ, D), dtype),
            K: T.Buffer(KS, kv_dtype),
            V: T.Buffer(VS, kv_dtype),
            CS: T.Buffer((B,), "int32"),
            O: T.Buffer((B, H, SQ, DV), dtype),
        ):
            T.func_attr(attrs)
            if fp8:
                K8 = T.decl_buffer(KS, "uint8", data=K.data)
                V8 = T.decl_buffer(VS, "uint8", data=V.data)
                if append is not None:
                    append(K8, V8, (CS,))
                grid(Q, K8, V8, O, (CS,))
            else:
                if append is not None:
                    append(K, V, (CS,))
                grid(Q, K, V, O, (CS,))

        return attention_kvcache, LSE
    MP = kvl.MP  # block_table's columns

    @T.prim_func(s_tir=True, check_well_formed=False)
    def attention_paged(
        Q: T.Buffer((B, H, SQ, D), dtype),
        K: T.Buffer(KS, kv_dtype),
        V: T.Buffer(VS, kv_dtype),
        BT: T.Buffer((B, MP), "int32"),
        CS: T.Buffer((B,), "int32"),
        O: T.Buffer((B, H, SQ, DV), dtype),
    ):
        T.func_attr(attrs)
        if fp8:
            K8 = T.decl_buffer(KS, "uint8", data=K.data)
            V8 = T.decl_buffer(VS, "uint8", data=V.data)
            if append is not None:
                append(K8, V8, (BT, CS))
            grid(Q, K8, V8, O, (BT, CS))
        else:
            if append is not None:
                append(K, V, (BT, CS))
            grid(Q, K, V, O, (BT, CS))

    return attention_paged, LSE


def _latent_func(spec: AttentionSpec, attrs: dict, B, SQ, kvl, grid, append):
    """A latent layout's (MLA) signature: ``Q (B, H, Sq, D)``, the one cache ``KV`` (``mla``:
    ``(B, max_len, D)``; ``mla_paged``: ``(num_pages, page_size, D)`` with ``BT (B, max_pages)``),
    ``CS (B,)``, ``O (B, H, Sq, Dv)``. The tiles read ``KV`` as K and as V (V's columns are its
    first ``Dv``: the same bytes); float8 through a uint8 alias of it."""
    H, D, DV, dtype = spec.heads, spec.head_dim, spec.v_dim, spec.dtype
    KS, kv_dtype = kvl.shape, spec.kv_dtype_name
    fp8 = kv_dtype.startswith("float8")
    if not spec.layout_info.paged:
        @T.prim_func(s_tir=True, check_well_formed=False)
        def attention_mla(
            Q: T.Buffer((B, H, SQ, D), dtype),
            KV: T.Buffer(KS, kv_dtype),
            CS: T.Buffer((B,), "int32"),
            O: T.Buffer((B, H, SQ, DV), dtype),
        ):
            T.func_attr(attrs)
            if fp8:
                K8 = T.decl_buffer(KS, "uint8", data=KV.data)
                if append is not None:
                    append(K8, K8, (CS,))
                grid(Q, K8, K8, O, (CS,))
            else:
                if append is not None:
                    append(KV, KV, (CS,))
                grid(Q, KV, KV, O, (CS,))

        return attention_mla
    MP = kvl.MP

    @T.prim_func(s_tir=True, check_well_formed=False)
    def attention_mla_paged(
        Q: T.Buffer((B, H, SQ, D), dtype),
        KV: T.Buffer(KS, kv_dtype),
        BT: T.Buffer((B, MP), "int32"),
        CS: T.Buffer((B,), "int32"),
        O: T.Buffer((B, H, SQ, DV), dtype),
    ):
        T.func_attr(attrs)
        if fp8:
            K8 = T.decl_buffer(KS, "uint8", data=KV.data)
            if append is not None:
                append(K8, K8, (BT, CS))
            grid(Q, K8, K8, O, (BT, CS))
        else:
            if append is not None:
                append(KV, KV, (BT, CS))
            grid(Q, KV, KV, O, (BT, CS))

    return attention_mla_paged


def append_grid(spec: AttentionSpec, block, lanes, kvl, var, B, SQ):
    """The kernel that writes an appending call's ``k_new (B, KH, Sq, D)``/``v_new (.., DV)`` into
    the cache (kvcache, paged through ``block_table``: ``kvl``'s addressing) at each sequence's
    keys ``cache_seqlens[b] .. + Sq - 1``, before the attention kernels (one stream: they see its
    writes): a thread block per (new key, KV head, sequence), a lane per column. An 8-bit cache
    stores ``x / scale[kv head]`` rounded to nearest even and saturated (``f32_to_kv``: what
    ``quant.quantize_kv`` stores, bit for bit; float8 as its bits, through the kernel's uint8
    aliases); a 16-bit cache the value as it is. The macro ``append(K, V, X)``. A latent layout
    (MLA) takes ``kv_new (B, Sq, D)``: one row a new token, written once (V is its first
    columns), scaled by the cache's one ``kv_scale``."""
    KH, D, DV, kvd = spec.kv_heads, spec.head_dim, spec.v_dim, spec.kv_dtype
    KN, VN, KSC, VSC = var.KN, var.VN, var.KSC, var.VSC

    def stored(x, S, h):
        return x if kvd is None else f32_to_kv(T.Cast("float32", x) / S[h], kvd)

    if spec.layout_info.latent:
        @T.macro
        def append_latent(K, V, X):
            for bz in block(B, "z"):
                for bx in block(SQ, "x"):
                    for d in lanes(D):
                        with T.sblock("kv_append"):
                            vb, vi, vd = T.axis.remap("SSS", [bz, bx, d])
                            T.reads()
                            T.writes()
                            K[kvl.index(X, vb, 0, X[-1][vb] + vi, vd)] = stored(KN[vb, vi, vd], KSC, 0)

        return append_latent

    @T.macro
    def append(K, V, X):
        for bz in block(B, "z"):
            for by in block(KH, "y"):
                for bx in block(SQ, "x"):
                    for d in lanes(max(D, DV)):
                        with T.sblock("kv_append"):
                            vb, vh, vi, vd = T.axis.remap("SSSS", [bz, by, bx, d])
                            T.reads()
                            T.writes()
                            if vd < D:
                                K[kvl.index(X, vb, vh, X[-1][vb] + vi, vd)] = stored(KN[vb, vh, vi, vd], KSC, vh)
                            if vd < DV:
                                V[kvl.index(X, vb, vh, X[-1][vb] + vi, vd)] = stored(VN[vb, vh, vi, vd], VSC, vh)

    return append


def varlen_grid(spec: AttentionSpec, block, BM: int, BN: int, tile, reverse: bool, TQ, LSE=None, var=None):
    """FlashAttention's packed varlen layout on a (slot, head) grid on blockIdx.x/y: sequence
    ``b``'s row tiles take the slots ``cu_seqlens_q[b] // BM + b + i`` (the CPU kernel's
    numbering, ``fused._varlen``: at most ``total_q // BM + batch`` slots, strictly increasing in
    ``b``), so a thread block finds its sequence by a binary search on ``cu_seqlens_q`` and
    computes nothing in a spare slot. Returns the ``grid(Q, K, V, CQ, CK, O)`` macro and the
    vars ``total_k``, ``batch_plus_1`` of the buffers' shapes (``TQ``: ``total_q``'s, which the
    caller made for the LSE output's shape; ``LSE``: ``(heads, total_q)``, or None)."""
    H, G = spec.heads, spec.group_size
    TK = tirx.Var("total_k", "int32")
    NB1 = tirx.Var("batch_plus_1", "int32")  # a plain var: the runtime binds a shape's vars only
    NT = T.floordiv(TQ, BM) + NB1 - 1  # tile slots

    def at(seq, vh):
        q0, k0 = seq[1], seq[3]
        return Tile(spec, BM, BN, seq[0], seq[2], seq[4],
                    # max(…, 0), min(…, total_q − 1): a spare slot's (unused) row stays in the buffer
                    q=lambda r, d: (T.min(q0 + T.max(r, 0), TQ - 1), vh, d),
                    kv=lambda j, d: (k0 + j, vh // G, d), o=lambda r, d: (q0 + r, vh, d),
                    valid=seq[0] < seq[2], lse=None if LSE is None else (LSE, lambda r: (vh, q0 + r)),
                    var=var, head=lambda r: vh, b=seq[5] if var is not None and var.masks_or_mods else None)

    def slot(vs):
        return NT - 1 - vs if reverse else vs

    @T.macro
    def grid(Q, K, V, CQ, CK, O):
        for by in block(H, "y"):
            for bx in block(NT, "x"):
                with T.sblock("row_tile"):
                    vh, vs = T.axis.remap("SS", [by, bx])
                    T.reads()
                    T.writes()
                    # the tile: seq = (first row, q0, q_len, k0, k_len, b) of its sequence, in
                    # registers (every thread searches: the same few loads, cached)
                    seq = T.sblock_alloc_buffer((6,), "int32", scope="local")
                    with T.sblock("seq_locate"):
                        T.reads()
                        T.writes()
                        # binary search for the last b whose first slot is <= the slot
                        seq[0] = 0
                        seq[1] = NB1 - 2
                        for _ in T.serial(31):  # 31 halvings cover any int32 batch
                            if seq[0] < seq[1]:
                                if T.floordiv(CQ[T.floordiv(seq[0] + seq[1] + 1, 2)], BM) \
                                        + T.floordiv(seq[0] + seq[1] + 1, 2) <= slot(vs):
                                    seq[0] = T.floordiv(seq[0] + seq[1] + 1, 2)
                                else:
                                    seq[1] = T.floordiv(seq[0] + seq[1] + 1, 2) - 1
                        seq[5] = seq[0]
                        seq[3] = CK[seq[0]]
                        seq[4] = CK[seq[0] + 1] - seq[3]
                        seq[1] = CQ[seq[0]]
                        seq[2] = CQ[seq[0] + 1] - seq[1]
                        seq[0] = (slot(vs) - T.floordiv(seq[1], BM) - seq[0]) * BM
                    tile(Q, K, V, O, at(seq, vh))

    return grid, TK, NB1


def plus(x, new):
    """``x + new``, or ``x`` itself where ``new`` is the int 0 (no term for the simplifier)."""
    return x if isinstance(new, int) and new == 0 else x + new


def tile_grid(block, B, H, NR, static: bool, tile, at, cache: bool, split: Split | None = None, merge=None,
              new=0):
    """The thread blocks of a dense-query kernel (bhsd, kvcache, paged), each running the macro
    ``tile(Q, K, V, O, at(b, h, r, ...))`` on its tile: a flat grid of ``B·H·NR`` blocks for
    static lengths, a (row tile, head, batch) grid on ``blockIdx.x/y/z`` for symbolic ones (no
    index divides by a run-time extent). ``cache``: a KV-cache tile, ``H`` counts KV heads and
    the sequence's length ``cache_seqlens[b]`` (``X[-1]``) is read once into a register.
    ``split``: split-KV (the KV-cache layouts, symbolic): blockIdx.z counts (sequence, chunk)
    pairs, the partials live in a workspace, then the kernel ``merge(Op, St, O, X)`` runs.
    ``new``: the keys an appending kernel adds to each sequence's (``seq_q``; 0 otherwise)."""

    def seqlen(X, b):
        return plus(X[-1][b], new)

    NS = split.active if split is not None else 1

    @T.macro
    def chunks(Q, K, V, O, X, Op, St):
        # (batch, chunk) pairs on blockIdx.z: truncdiv/truncmod (non-negative operands)
        for bz in block(B * NS, "z"):
            for by in block(H, "y"):
                for bx in block(NR, "x"):
                    with T.sblock("row_tile"):
                        vz, vh, vr = T.axis.remap("SSS", [bz, by, bx])
                        T.reads()
                        T.writes()
                        k_len = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        # the sequence and chunk, the chunk's first tile and tile count: once, in
                        # registers (recomputed from blockIdx.z, they spilled fp32 paged on sm_90)
                        seq = T.sblock_alloc_buffer((4,), "int32", scope="local")
                        with T.sblock("seq_len"):
                            T.reads()
                            T.writes()
                            seq[0] = T.truncdiv(vz, NS)
                            seq[1] = T.truncmod(vz, NS)
                            k_len[0] = seqlen(X, seq[0])
                            seq[2] = at(seq[0], vh, vr, k_len[0], X).chunk_span(seq[1], NS)[0]
                            seq[3] = at(seq[0], vh, vr, k_len[0], X).chunk_span(seq[1], NS)[1]
                        tile(Q, K, V, O, at(seq[0], vh, vr, k_len[0], X, (seq[1], Op, St, (seq[2], seq[3]))))

    @T.macro
    def grid(Q, K, V, O, X):
        if static:
            for bx in block(B * H * NR, "x"):
                with T.sblock("row_tile"):
                    vbx = T.axis.spatial(B * H * NR, bx)
                    T.reads()
                    T.writes()
                    tile(Q, K, V, O, at(vbx // (H * NR), vbx % (H * NR) // NR, vbx % NR))
        elif split is not None:
            with T.sblock("split_kv"):
                T.reads()
                T.writes()
                Op = T.sblock_alloc_buffer(split.part_shape, "float32")
                St = T.sblock_alloc_buffer(split.state_shape, "float32")
                chunks(Q, K, V, O, X, Op, St)
                merge(Op, St, O, X)
        else:  # no guard for batch or seq_q 0 (a zero grid, a launch error): TVM's sync insertion
            # refuses a condition around the kernel; the loader answers empty calls itself
            for bz in block(B, "z"):
                for by in block(H, "y"):
                    for bx in block(NR, "x"):
                        with T.sblock("row_tile"):
                            vb, vh, vr = T.axis.remap("SSS", [bz, by, bx])
                            T.reads()
                            T.writes()
                            if cache:
                                k_len = T.sblock_alloc_buffer((1,), "int32", scope="local")
                                with T.sblock("seq_len"):
                                    T.reads()
                                    T.writes()
                                    k_len[0] = seqlen(X, vb)
                                tile(Q, K, V, O, at(vb, vh, vr, k_len[0], X))
                            else:
                                tile(Q, K, V, O, at(vb, vh, vr))

    return grid


def merge_grid(spec: AttentionSpec, block, lanes, split: Split, at, LSE=None, new=0):
    """The merge kernel of a split-KV grid: a thread block per (packed row, KV head, sequence),
    a lane per head-dim column: ``M = max_s m_s``, ``O = Σ_s acc_s·2^(m_s − M) / Σ_s
    l_s·2^(m_s − M)`` through the row's tile (``at(b, kh, 0, k_len, X)``: its output index, zeros
    for a row that sees no key, the sink once in the merged denominator), and the row's
    log-sum-exp (into ``LSE``, the kernel's, when it returns one). A chunk that saw no key has
    ``m = −inf``, ``l = 0``: weight 0. Nothing to do when the batch needed no split (``ns`` 1:
    each chunk stored its rows itself). ``new``: an appending kernel's new keys a sequence."""
    NS, B, KH, rows, D = split.active, split.B, split.KH, split.rows, split.D
    dtype = spec.dtype
    neg_inf = T.float32(float("-inf"))

    def row(b, kh, k_len, X):  # the rows' tile: where a row's output goes, how it normalises
        return at(b, kh, 0, k_len, X)


    def part_row(r):
        # r < rows <= BM (· tiles) whenever the merge runs; the min tells TVM's buffer compaction
        # so (it would size the workspace by seq_q, and the fusion audit fail it, from r's extent)
        return T.min(r, split.BM * split.tiles - 1)

    @T.macro
    def merge(Op, St, O, X):
        for bz in block(B, "z"):
            for by in block(KH, "y"):
                for bx in block(T.Select(NS > 1, rows, 1), "x"):  # one idle block per head when unsplit
                    with T.sblock("merge"):
                        vb, vkh, vr = T.axis.remap("SSS", [bz, by, bx])
                        T.reads()
                        T.writes()
                        k_len = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        mx = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        ls = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        am = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        wt = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        with T.sblock("merge_len"):
                            T.reads()
                            T.writes()
                            k_len[0] = plus(X[-1][vb], new)
                        for d in lanes(D):
                            # blocks enough a SM for 64 registers a lane: without the bound ptxas
                            # (register usage level 10) gave 64 lanes 32 and spilled 8 bytes (an
                            # 8-bit cache with sinks and lse, sm_90, both CUDA kernels)
                            with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", max(1, 1024 // D)):
                                with T.sblock("merge_row"):
                                    T.reads()
                                    T.writes()
                                    if NS > 1:
                                        mx[0] = neg_inf
                                        for sp in T.serial(NS):
                                            mx[0] = T.max(mx[0], St[sp, vb, vkh, part_row(vr), 0])
                                        ls[0] = T.float32(0)
                                        am[0] = T.float32(0)
                                        for sp in T.serial(NS):
                                            wt[0] = exp2_fast(St[sp, vb, vkh, part_row(vr), 0] - guarded(mx[0]))
                                            ls[0] = ls[0] + St[sp, vb, vkh, part_row(vr), 1] * wt[0]
                                            am[0] = am[0] + Op[sp, vb, vkh, part_row(vr), d] * wt[0]
                                        O[row(vb, vkh, k_len[0], X).o_at(vr, d)] = T.Cast(
                                            dtype, row(vb, vkh, k_len[0], X).out(am[0], ls[0], vr, mx[0]))
                                        if LSE is not None:
                                            if d == 0:
                                                LSE[row(vb, vkh, k_len[0], X).lse_at(vr)] = lse_of(mx[0], ls[0])

    return merge
