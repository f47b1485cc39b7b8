"""The fused attention PrimFunc for CUDA tensor cores (sm_80+): ``mma.sync.m16n8k16``, ldmatrix
and ``cp.async``, FlashAttention-2's work split.

One thread block per (batch, head, row tile of ``block_m = 16·m_tiles·warps`` queries) — a flat
grid for static lengths; with symbolic batch or lengths (``spec.dynamic``) the grid is (row tile,
head, batch) on ``blockIdx.x/y/z``, so no index divides by a run-time extent, and the key tail,
the row tail, the causal tile range and the rows that see no key (zeros) are run-time
conditions of the lengths; varlen: a (tile slot, head) grid, each block's sequence found from
``cu_seqlens_q`` (``fused_cuda.varlen_grid``, ``fused_cuda.Tile``). ``threadIdx.y`` is the
warp, ``threadIdx.x`` the lane. Each warp owns ``m_tiles`` groups of 16 query rows (each K/V
fragment read from shared memory feeds one mma pair per group) and keeps everything about them
in registers (PTX fragment layouts, ``g = lane / 4``, ``t = lane % 4``; per row group):

* ``Qf``: the warp's Q rows as mma A fragments, loaded once from global memory
  (``head_dim / 16`` fragments of 8 halves: rows ``g, g + 8``, columns ``2t, 2t + 1 (+8)``);
* ``S``: the score tile as ``block_n / 8`` fp32 accumulators of 4 (rows ``g, g + 8``, keys
  ``2t, 2t + 1`` of each 8-key slice), computed as ``Q·Kᵀ`` on tensor cores;
* ``acc``: the output rows as ``head_dim / 8`` accumulators of 4, fed by ``P·V``;
* ``m``, ``l``: the running max (log2 units of the scaled scores) and the lane's part of the
  running sum, for its two rows.

Per key tile of ``block_n`` keys:

* K and V tiles travel global → shared with ``cp.async`` (16 bytes per copy), ``stages`` tiles
  in flight: the copy of tile ``c + stages − 1`` is issued before tile ``c`` is computed, one
  ``__syncthreads`` per tile; shared rows are padded by 16 bytes so that ldmatrix's eight row
  addresses fall on distinct banks;
* ``S = Q·Kᵀ``: ldmatrix (x4) gives the B fragments of two 8-key slices straight from the
  row-major K tile (a row of K is a column of Kᵀ);
* online softmax on the fragments: a row's max is the max over the lane's slots, then over the
  four lanes holding the row (``__shfl_xor_sync`` 2 and 1); ``alpha = exp2(m − m_new)``
  rescales ``acc`` and ``l``; a row with no visible key yet keeps its reference max at 0, so a
  fully masked tile makes no NaN; masking (causal, key tail) runs only on tiles that need it;
* ``P`` never leaves registers: the C fragment of two adjacent 8-key slices, rounded to 16
  bits, *is* the A fragment of ``P·V`` (the layouts coincide), and ldmatrix ``.trans`` gives
  V's B fragments from the row-major V tile;
* under causal masking the key-tile loop stops at the block's diagonal, and the row tiles with
  the most work are launched first.

The row sum is reduced across a row's four lanes once, at the end. Inputs are float16 or
bfloat16 (``mma ... f32.f16.f16.f32`` / ``.bf16``); products accumulate in fp32.

``emulate=True`` gives the same PrimFunc with serial loops in place of thread bindings, global in
place of shared/local memory, and each PTX instruction replaced by its definition in scalar TIR
(the fragment layouts of the PTX ISA): run by LLVM on the CPU it checks the tiling, the
fragment index math, the online softmax across lanes and the masking, not the GPU schedule.
"""
from __future__ import annotations

import math
import types

from tvm import tirx
from tvm.script import tirx as T

from ..cuda_tools import shared_scope
from ..spec import ENTRY, AttentionSpec
from ..tvm_internals import fast_macros
from ..visibility import Visibility
from ._math import LOG2E, guarded, lse_of
from .fused_cuda import flat_offset, kernel_func, kv_byte, kv_reader
from .knob_attrs import FUSED_MMA, record
from .kv import dim
from .variants import transforms as transforms_scores

WARP = 32
MMA_DTYPES = {"float16": "f16", "bfloat16": "bf16"}
#: halves of padding per shared row: 16 bytes, so the 8 row addresses of one ldmatrix (row
#: stride D + 8 halves) hit 8 different 16-byte bank groups
SMEM_PAD = 8


#: Access mask the cp.async destinations show TVM: "r". The kernel places its own barriers
#: (one per key tile: after the wait, before the copy into the stage the previous tile read);
#: TVM's barrier pass, seeing a write to the K/V buffer, cannot tell the stage being filled from
#: the stage being read and added a second ``__syncthreads`` before every Q·Kᵀ. A CPU emulation
#: of the generated kernel with a race checker found no race without it.
CP_DST = "r"


def smem_stride(head_dim: int) -> int:
    return head_dim + SMEM_PAD


def _cuda_sources(dtype: str) -> dict[str, str]:
    """Device helpers by name, one source each: TVM emits a helper's source once per name."""
    ab = MMA_DTYPES[dtype]
    out = {
        "attn_cp_async16": r"""
__device__ __forceinline__ void attn_cp_async16(void* smem, const void* gmem) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(gmem));
}""",
        "attn_cp_commit": r"""
__device__ __forceinline__ void attn_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }""",
        "attn_mma": r"""
__device__ __forceinline__ void attn_mma(void* c, const void* a, const void* b) {
  // fragments are 16-bit arrays in TVM; memcpy reads them as 32-bit registers without the
  // type punning that strict aliasing forbids (nvcc removes the copies)
  float* C = (float*)c;
  unsigned A[4], B[2];
  memcpy(A, a, 16);
  memcpy(B, b, 8);
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.AB.AB.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(C[0]), "+f"(C[1]), "+f"(C[2]), "+f"(C[3])
               : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B[0]), "r"(B[1]));
}""".replace("AB", ab),
    }
    for n in range(3):
        out[f"attn_cp_wait{n}"] = (
            f"\n__device__ __forceinline__ void attn_cp_wait{n}() "
            f"{{ asm volatile(\"cp.async.wait_group {n};\\n\" ::); }}")
    for name, trans in (("attn_ldsm_x4", ""), ("attn_ldsm_x4_trans", ".trans")):
        out[name] = r"""
__device__ __forceinline__ void NAME(void* dst, const void* smem) {
  unsigned d[4];
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4TRANS.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(s));
  memcpy(dst, d, 16);
}""".replace("NAME", name).replace("TRANS", trans)
    return out


def _mma_context(spec: AttentionSpec, warps: int, block_n: int, stages: int, m_tiles: int, emulate: bool):
    """Every constant, index helper and device-call macro of one tensor-core kernel, by name (the
    builders below unpack what each stage of the kernel uses)."""
    if spec.dtype not in MMA_DTYPES:
        raise ValueError(f"tensor-core kernel takes float16 or bfloat16, not {spec.dtype}")
    B, H, KH = dim(spec, "batch"), spec.heads, spec.kv_heads
    SQ, SK, D = dim(spec, "seq_q"), dim(spec, "seq_kv"), spec.head_dim
    G = spec.group_size
    W, BN, NS, MT = warps, block_n, stages, m_tiles
    BM = 16 * MT * W  # a warp owns MT groups of 16 rows: each K/V fragment feeds MT mma pairs
    NT = BN // 8  # 8-key slices of the score tile (one m16n8 accumulator each)
    DV = spec.v_dim  # V's and O's columns (head_dim_v; DeepSeek's unabsorbed MLA: 128 against 192)
    NDC = D // 16  # 16-wide chunks of head_dim: the k steps of Q·Kᵀ
    NO = DV // 8  # 8-wide slices of head_dim_v: the output accumulators
    causal = Visibility.of(spec).causal
    dtype = spec.dtype
    ST = smem_stride(D)
    TILE = BN * ST  # elements of one staged K (or V) tile
    VPR = D // 8  # 16-byte vectors per K/V row
    NTHR = W * WARP
    LIT = math.ceil(BN * VPR / NTHR)  # cp.async copies per thread per tile (of K, and of V)
    # V's own tile where head_dim_v differs: its stride, size, vectors per row, copies per thread
    VST, VPRV = smem_stride(DV), DV // 8
    VTILE = BN * VST
    LITV = math.ceil(BN * VPRV / NTHR)
    qscale = float(spec.scale * LOG2E)
    neg_inf = T.float32(float("-inf"))
    srcs = _cuda_sources(dtype)

    def call(name, *args):
        return T.cuda.func_call(name, *args, source_code=srcs[name])
    EMU = emulate
    # past 48 KiB the stages are one dynamic allocation (shared.dyn, opted in at launch)
    smem = "global" if EMU else shared_scope(NS * (TILE + VTILE) * spec.itemsize)
    fscope = "global" if EMU else "local"

    def fshape(n):
        # per-lane fragments: on the GPU one local array per thread; emulated, one per lane
        return (W, WARP, n) if EMU else (n,)

    def ix(ty, tx, k):
        return (ty, tx, k) if EMU else (k,)

    def thread_y(n):
        return T.serial(n) if EMU else T.thread_binding(n, thread="threadIdx.y")

    def thread_x(n):
        return T.serial(n) if EMU else T.thread_binding(n, thread="threadIdx.x")

    def block(n, axis="x"):
        return T.serial(n) if EMU else T.thread_binding(n, thread=f"blockIdx.{axis}")

    # a custom mask: a warp skips the products and the softmax of a key tile whose bits are all
    # 0 for its rows (``live``: its lanes' flag, slot 1 the warp's); without one, no condition
    # (a Python True: the kernel's code is unchanged)
    cmask = spec.custom_mask

    def alive(live, ty, tx):
        return True if live is None else live[ix(ty, tx, 1)] > T.float32(0)

    return types.SimpleNamespace(**locals())


def _mma_fragments(x):
    """``x`` (:func:`_mma_context`) with the fragment layouts of the PTX instructions added: which
    slot of a lane holds which row and column, the shared-memory addresses ``ldmatrix`` reads, and
    the ``copy_kv`` and ``mma_pair`` macros."""
    (BN, call, EMU, LIT, MT, NO, NT, NTHR, ST, TILE, VPR) = \
        (x.BN, x.call, x.EMU, x.LIT, x.MT, x.NO, x.NT, x.NTHR, x.ST, x.TILE, x.VPR)
    VST, VTILE, VPRV, LITV = x.VST, x.VTILE, x.VPRV, x.LITV
    QKV = x.spec.kv_quantized  # an 8-bit cache: converted on the way to shared memory
    kv_value = kv_reader(x.spec)

    def byte(vec8, v):  # element v of 8 bytes loaded as one 64-bit word
        return kv_byte(x.spec, vec8, 8, v)

    # A lane's fragments are flat arrays of MT blocks, one per 16-row group: scores S and P
    # (NT·4 slots a block), the output acc (NO·4), Q (NDC·8); the row state m, l (2 a block: rows
    # g and g + 8). ``half`` is the state index of a slot: 2·(row group) + (slot % 4) // 2.
    def s_half(k):
        return k // (NT * 4) * 2 + k % 4 // 2

    def o_half(k):
        return k // (NO * 4) * 2 + k % 4 // 2

    def row_of(ty, tx, h):
        # query row (within the block tile) of state index h
        return ty * 16 * MT + h // 2 * 16 + tx // 4 + 8 * (h % 2)

    def col_of(tx, k, n):
        # column (key, or head-dim index) of accumulator slot k in a block of n slices of 8
        return k % (n * 4) // 4 * 8 + 2 * (tx % 4) + k % 2

    def visible(w, ty, tx, k, c):
        # whether score slot k of the lane sees its key in loop tile c
        return w.sees(w.row0 + row_of(ty, tx, s_half(k)), w.tile(c) * BN + col_of(tx, k, NT))

    def logit(w, S, ty, tx, k, c):
        # score slot k in log2 units through the variants' score hook (softcap, ALiBi): Tile.logit
        return w.logit(S, w.row0 + row_of(ty, tx, s_half(k)), w.tile(c) * BN + col_of(tx, k, NT))

    def k_addr(buf, np, dk, lane):
        # row address lane ``lane`` gives ldmatrix for K: matrices (keys 0-7|8-15) × (d 0-7|8-15)
        # in the order b0, b1 of slice 2np, then b0, b1 of slice 2np + 1
        key = np * 16 + lane % 8 + 8 * (lane // 16)
        return buf * TILE + key * ST + dk * 16 + 8 * (lane // 8 % 2)

    def v_addr(buf, kk, dp, lane):
        # ... for V (transposed load): b0, b1 of head-dim slice 2dp, then of 2dp + 1
        key = kk * 16 + lane % 8 + 8 * (lane // 8 % 2)
        return buf * VTILE + key * VST + dp * 16 + 8 * (lane // 16)

    # The PTX instructions' definitions, for the emulated (CPU) build.
    def a_slot(row, k):
        return 2 * (row // 8 + 2 * (k // 8)) + k % 2

    def a_lane(row, k):
        return row % 8 * 4 + k % 8 // 2

    def b_slot(k):
        return 2 * (k // 8) + k % 2

    def vec_row(it, ty, tx, vpr=VPR):
        # K/V row (within the tile) and column of the 16-byte vector a thread copies in step
        # ``it`` (``vpr`` vectors a row): consecutive threads take consecutive vectors of a row,
        # so the loads coalesce
        return (it * NTHR + ty * WARP + tx) // vpr

    def vec_col(it, ty, tx, vpr=VPR):
        return (it * NTHR + ty * WARP + tx) % vpr * 8

    @T.macro
    def copy(Ks, Vs, K, V, w, ty, tx, stage, tile, vpr, st, xtile, lit, which):
        # this thread's part of key tile ``tile`` of K and V (``which`` "kv": equal widths) or of
        # one of them ("k", "v": head_dim_v != head_dim) into shared stage ``stage``; an 8-bit
        # cache's 8 elements are loaded and converted (synchronous stores to the stage: the
        # barrier that orders the copies orders them too)
        for it in T.unroll(lit):
            if (it * NTHR + ty * WARP + tx) < BN * vpr:
                if QKV:
                    for v in T.unroll(8):
                        if which != "v":
                            Ks[stage * xtile + vec_row(it, ty, tx, vpr) * st + vec_col(it, ty, tx, vpr) + v] = kv_value(
                                byte(K[w.kv_at(w.tile(tile) * BN + vec_row(it, ty, tx, vpr),
                                               T.Ramp(vec_col(it, ty, tx, vpr), 1, 8))], v))
                        if which != "k":
                            Vs[stage * xtile + vec_row(it, ty, tx, vpr) * st + vec_col(it, ty, tx, vpr) + v] = kv_value(
                                byte(V[w.kv_at(w.tile(tile) * BN + vec_row(it, ty, tx, vpr),
                                               T.Ramp(vec_col(it, ty, tx, vpr), 1, 8))], v))
                elif EMU:
                    for v in T.serial(8):
                        if which != "v":
                            Ks[stage * xtile + vec_row(it, ty, tx, vpr) * st + vec_col(it, ty, tx, vpr) + v] = K[
                                w.kv_at(w.tile(tile) * BN + vec_row(it, ty, tx, vpr), vec_col(it, ty, tx, vpr) + v)]
                        if which != "k":
                            Vs[stage * xtile + vec_row(it, ty, tx, vpr) * st + vec_col(it, ty, tx, vpr) + v] = V[
                                w.kv_at(w.tile(tile) * BN + vec_row(it, ty, tx, vpr), vec_col(it, ty, tx, vpr) + v)]
                else:
                    if which != "v":
                        T.evaluate(call(
                            "attn_cp_async16",
                            Ks.access_ptr(CP_DST, offset=stage * xtile + vec_row(it, ty, tx, vpr) * st
                                          + vec_col(it, ty, tx, vpr)),
                            K.access_ptr("r", offset=flat_offset(K, w.kv_at(w.tile(tile) * BN + vec_row(it, ty, tx, vpr),
                                                                              vec_col(it, ty, tx, vpr))))))
                    if which != "k":
                        T.evaluate(call(
                            "attn_cp_async16",
                            Vs.access_ptr(CP_DST, offset=stage * xtile + vec_row(it, ty, tx, vpr) * st
                                          + vec_col(it, ty, tx, vpr)),
                            V.access_ptr("r", offset=flat_offset(V, w.kv_at(w.tile(tile) * BN + vec_row(it, ty, tx, vpr),
                                                                              vec_col(it, ty, tx, vpr))))))

    @T.macro
    def copy_kv(Ks, Vs, K, V, w, ty, tx, stage, tile):
        if VPRV == VPR:
            copy(Ks, Vs, K, V, w, ty, tx, stage, tile, VPR, ST, TILE, LIT, "kv")
        else:
            copy(Ks, Vs, K, V, w, ty, tx, stage, tile, VPR, ST, TILE, LIT, "k")
            copy(Ks, Vs, K, V, w, ty, tx, stage, tile, VPRV, VST, VTILE, LITV, "v")

    @T.macro
    def mma_pair(C, c_off, A, a_off, Bf, ty, tx):
        # C[c_off : c_off + 8] (two m16n8 slices) += A fragment at a_off × the two B fragments
        # of Bf (slots 0-3 and 4-7); emulated: each lane's slots from the ISA's fragment layouts
        if EMU:
            for half in T.unroll(2):
                for k in T.unroll(4):
                    for kd in T.serial(16):
                        C[ty, tx, c_off + half * 4 + k] = C[ty, tx, c_off + half * 4 + k] + T.Cast(
                            "float32", A[ty, a_lane(tx // 4 + 8 * (k // 2), kd), a_off + a_slot(tx // 4 + 8 * (k // 2), kd)]
                        ) * T.Cast("float32", Bf[ty, (2 * (tx % 4) + k % 2) * 4 + kd % 8 // 2, half * 4 + b_slot(kd)])
        else:
            T.evaluate(call("attn_mma", C.access_ptr("rw", offset=c_off), A.access_ptr("r", offset=a_off),
                            Bf.access_ptr("r", offset=0)))
            T.evaluate(call("attn_mma", C.access_ptr("rw", offset=c_off + 4), A.access_ptr("r", offset=a_off),
                            Bf.access_ptr("r", offset=4)))
    return types.SimpleNamespace(**{**vars(x), **{k: v for k, v in locals().items() if k != 'x'}})


def _mma_q_frag(x):
    """Q fragments from global memory (once per block), and the row state's init."""
    (ix, MT, NDC, neg_inf, NO, row_of, thread_x, thread_y, W) = \
        (x.ix, x.MT, x.NDC, x.neg_inf, x.NO, x.row_of, x.thread_x, x.thread_y, x.W)

    @T.macro
    def q_frag(Qp, Qf, m, l, acc, w):
        # -- Q fragments, straight from global memory (once per block) --------------
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("Q_frag"):
                    T.reads()
                    T.writes()
                    for s in T.unroll(MT * NDC * 8):
                        Qf[ix(ty, tx, s)] = Qp[w.q_at(
                            w.row0 + row_of(ty, tx, s // (NDC * 8) * 2 + s % 8 // 2 % 2),
                            s % (NDC * 8) // 8 * 16 + 8 * (s % 8 // 2 // 2) + 2 * (tx % 4) + s % 2)]
                    for h2 in T.unroll(MT * 2):
                        m[ix(ty, tx, h2)] = neg_inf
                        l[ix(ty, tx, h2)] = T.float32(0)
                    for k in T.unroll(MT * NO * 4):
                        acc[ix(ty, tx, k)] = T.float32(0)

    return q_frag


def _mma_prologue(x):
    """The first ``stages − 1`` K/V tiles in flight."""
    (call, copy_kv, EMU, NS, thread_x, thread_y, W) = \
        (x.call, x.copy_kv, x.EMU, x.NS, x.thread_x, x.thread_y, x.W)

    @T.macro
    def prologue(Ks, Vs, K, V, w):
        # -- prologue: the first stages − 1 K/V tiles in flight --------------------
        for p in T.serial(NS - 1):
            for ty in thread_y(W):
                for tx in thread_x(WARP):
                    with T.sblock("KV_prefetch"):
                        T.reads()
                        T.writes()
                        if p < w.n_tiles():
                            copy_kv(Ks, Vs, K, V, w, ty, tx, p, p)
                        if not EMU:
                            T.evaluate(call("attn_cp_commit"))

    return prologue


def _mma_kv_wait(x):
    """Key tile ``c`` landed (this thread's copies, then everyone's)."""
    call, copy_kv, EMU, NS, thread_x, thread_y, W = x.call, x.copy_kv, x.EMU, x.NS, x.thread_x, x.thread_y, x.W

    @T.macro
    def kv_wait(Ks, Vs, K, V, w, c):
        # -- tile c landed (this thread's copies, then everyone's) ---------------
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("KV_wait"):
                    T.reads()
                    T.writes()
                    if NS == 1:
                        copy_kv(Ks, Vs, K, V, w, ty, tx, 0, c)
                        if not EMU:
                            T.evaluate(call("attn_cp_commit"))
                    if not EMU:
                        if NS <= 2:
                            T.evaluate(call("attn_cp_wait0"))
                        elif NS == 3:
                            T.evaluate(call("attn_cp_wait1"))
                        else:
                            T.evaluate(call("attn_cp_wait2"))
        if not EMU:
            T.tvm_storage_sync("shared")

    return kv_wait


def _mma_kv_prefetch(x):
    """Tile ``c + stages − 1`` into the buffer tile ``c − 1`` used."""
    (call, copy_kv, EMU, NS, thread_x, thread_y, W) = \
        (x.call, x.copy_kv, x.EMU, x.NS, x.thread_x, x.thread_y, x.W)

    @T.macro
    def kv_prefetch(Ks, Vs, K, V, w, c):
        # -- prefetch tile c + stages − 1 into the buffer tile c − 1 used ---------
        if NS > 1:
            for ty in thread_y(W):
                for tx in thread_x(WARP):
                    with T.sblock("KV_load"):
                        T.reads()
                        T.writes()
                        if c + NS - 1 < w.n_tiles():
                            copy_kv(Ks, Vs, K, V, w, ty, tx, (c + NS - 1) % NS, c + NS - 1)
                        if not EMU:
                            T.evaluate(call("attn_cp_commit"))

    return kv_prefetch


def _mma_qk_mma(x):
    """``S = Q·Kᵀ`` of tile ``c`` on tensor cores."""
    (call, EMU, ix, k_addr, mma_pair, MT, NDC, NS, NT, thread_x, thread_y, W) = \
        (x.call, x.EMU, x.ix, x.k_addr, x.mma_pair, x.MT, x.NDC, x.NS, x.NT, x.thread_x, x.thread_y, x.W)
    alive = x.alive

    @T.macro
    def qk_mma(S, Qf, Ks, Kf, c, live):
        # -- S = Q·Kᵀ on tensor cores (a warp whose rows the mask gives no key of the tile: none)
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("S_init"):
                    T.reads()
                    T.writes()
                    if alive(live, ty, tx):
                        for k in T.unroll(MT * NT * 4):
                            S[ix(ty, tx, k)] = T.float32(0)
        for np in T.unroll(NT // 2):
            for dk in T.unroll(NDC):
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("K_ldmatrix"):
                            T.reads()
                            T.writes()
                            if alive(live, ty, tx):
                                if EMU:
                                    for i in T.unroll(4):
                                        for e in T.unroll(2):
                                            Kf[ty, tx, i * 2 + e] = Ks[
                                                k_addr(c % NS, np, dk, i * 8 + tx // 4) + 2 * (tx % 4) + e]
                                else:
                                    T.evaluate(call("attn_ldsm_x4", Kf.access_ptr("w"),
                                        Ks.access_ptr("r", offset=k_addr(c % NS, np, dk, tx))))
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("QK_mma"):
                            T.reads()
                            T.writes()
                            if alive(live, ty, tx):
                                for mi in T.unroll(MT):
                                    mma_pair(S, mi * NT * 4 + np * 8, Qf, mi * NDC * 8 + dk * 8, Kf, ty, tx)

    return qk_mma


def _mma_softmax(x):
    """Tile ``c``'s scores scaled and masked, the rows' new max across their four lanes,
    ``P = exp2(S − m_new)`` and the online correction."""
    (dtype, EMU, ix, logit, MT, neg_inf, NO, NT, o_half, s_half, thread_x, thread_y, visible, W) = \
        (x.dtype, x.EMU, x.ix, x.logit, x.MT, x.neg_inf, x.NO, x.NT, x.o_half, x.s_half, x.thread_x, x.thread_y,
         x.visible, x.W)
    spec, alive = x.spec, x.alive
    transforms = transforms_scores(spec)  # the variants' score hook (Variants.logit) has work
    # the variants bring the scores to log2 units in place (logit) before the max; else the max
    # of the raw scores is scaled once (the scale is positive) and the exponent is one FFMA
    qscale = 1.0 if transforms else x.qscale

    def scaled(w):
        # the scale of the raw scores: qscale, times an 8-bit cache's key scale (logit applies
        # it with the transforms)
        return T.float32(qscale) if transforms or not spec.kv_quantized else w.k_scaled(qscale)

    @T.macro
    def softmax(S, Pf, acc, m, l, mt, mn, w, c, live):
        # -- scale, mask (only tiles that need it), the lane's row maxima -----------
        # (a warp whose rows the mask gives no key of the tile: nothing, its state unchanged)
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("S_max"):
                    T.reads()
                    T.writes()
                    if alive(live, ty, tx):
                        # the max of the raw scores, scaled once: the scale is positive, so
                        # max(s)·scale = max(s·scale), and the exponent below is one FFMA
                        if transforms:
                            for k in T.unroll(MT * NT * 4):
                                S[ix(ty, tx, k)] = logit(w, S[ix(ty, tx, k)], ty, tx, k, c)
                        if w.hides:
                            if w.needs_mask(c):
                                for k in T.unroll(MT * NT * 4):
                                    S[ix(ty, tx, k)] = T.Select(visible(w, ty, tx, k, c), S[ix(ty, tx, k)], neg_inf)
                        for h2 in T.unroll(MT * 2):
                            mt[ix(ty, tx, h2)] = neg_inf
                        for k in T.unroll(MT * NT * 4):
                            mt[ix(ty, tx, s_half(k))] = T.max(mt[ix(ty, tx, s_half(k))], S[ix(ty, tx, k)])
                        for h2 in T.unroll(MT * 2):
                            mt[ix(ty, tx, h2)] = T.max(m[ix(ty, tx, h2)], mt[ix(ty, tx, h2)] * scaled(w))
        # -- row max across the row's four lanes -------------------------------------
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("row_max"):
                    T.reads()
                    T.writes()
                    if alive(live, ty, tx):
                        for h2 in T.unroll(MT * 2):
                            if EMU:
                                mn[ty, tx, h2] = T.max(
                                    T.max(mt[ty, tx // 4 * 4, h2], mt[ty, tx // 4 * 4 + 1, h2]),
                                    T.max(mt[ty, tx // 4 * 4 + 2, h2], mt[ty, tx // 4 * 4 + 3, h2]))
                            else:
                                mn[h2] = T.cuda.warp_max(mt[h2], 4)
        # -- P = exp2(S − m_new) in registers, online correction ----------------------
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("P_exp"):
                    T.reads()
                    T.writes()
                    if alive(live, ty, tx):
                        for h2 in T.unroll(MT * 2):
                            # alpha: exp2(m − m_new), reusing mt; a row with no visible key
                            # yet has m = m_new = −inf and its reference max guarded to 0
                            mt[ix(ty, tx, h2)] = T.exp2(m[ix(ty, tx, h2)] - guarded(mn[ix(ty, tx, h2)]))
                            m[ix(ty, tx, h2)] = mn[ix(ty, tx, h2)]
                            l[ix(ty, tx, h2)] = l[ix(ty, tx, h2)] * mt[ix(ty, tx, h2)]
                        for k in T.unroll(MT * NT * 4):
                            S[ix(ty, tx, k)] = T.exp2(S[ix(ty, tx, k)] * scaled(w)
                                                      - guarded(mn[ix(ty, tx, s_half(k))]))
                            l[ix(ty, tx, s_half(k))] = l[ix(ty, tx, s_half(k))] + S[ix(ty, tx, k)]
                            Pf[ix(ty, tx, k)] = T.Cast(dtype, S[ix(ty, tx, k)])
                        for k in T.unroll(MT * NO * 4):
                            acc[ix(ty, tx, k)] = acc[ix(ty, tx, k)] * mt[ix(ty, tx, o_half(k))]

    return softmax


def _mma_pv_mma(x):
    """``acc += P·V`` of tile ``c`` on tensor cores."""
    (call, DV, EMU, mma_pair, MT, NO, NS, NT, thread_x, thread_y, v_addr, W) = \
        (x.call, x.DV, x.EMU, x.mma_pair, x.MT, x.NO, x.NS, x.NT, x.thread_x, x.thread_y, x.v_addr, x.W)
    alive = x.alive

    @T.macro
    def pv_mma(acc, Pf, Vs, Vf, c, live):
        # -- acc += P·V on tensor cores (a warp whose rows see no key of the tile: none) ----
        for kk in T.unroll(NT // 2):
            for dp in T.unroll(DV // 16):
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("V_ldmatrix"):
                            T.reads()
                            T.writes()
                            if alive(live, ty, tx):
                                if EMU:
                                    for i in T.unroll(4):
                                        for e in T.unroll(2):
                                            Vf[ty, tx, i * 2 + e] = Vs[
                                                v_addr(c % NS, kk, dp, i * 8 + 2 * (tx % 4) + e) + tx // 4]
                                else:
                                    T.evaluate(call("attn_ldsm_x4_trans", Vf.access_ptr("w"),
                                        Vs.access_ptr("r", offset=v_addr(c % NS, kk, dp, tx))))
                for ty in thread_y(W):
                    for tx in thread_x(WARP):
                        with T.sblock("PV_mma"):
                            T.reads()
                            T.writes()
                            if alive(live, ty, tx):
                                for mi in T.unroll(MT):
                                    mma_pair(acc, mi * NO * 4 + dp * 8, Pf, mi * NT * 4 + kk * 8, Vf, ty, tx)
        if NS == 1:
            if not EMU:
                T.tvm_storage_sync("shared")  # the next tile overwrites the only buffer

    return pv_mma


def _mma_mask_scan(x, first_row=None):
    """A custom mask's ``mask_scan(live, w, c)``: whether any bit of key tile ``c`` is set for a
    warp's ``16·m_tiles`` rows (FlashInfer's packed bits, ``Tile.mask_bit``), each lane scanning
    its rows (lane ``tx``: rows ``tx``, ``tx + 32`` ...) into ``live`` slot 0, then the warp's
    maximum into slot 1 (``shfl``; emulated, read from every lane): a tile the mask hides from
    all its rows costs that warp no product (the CPU kernel's skipping of empty tiles).
    ``first_row(ty)``: warp ``ty``'s first tile row (default ``ty · 16·m_tiles``; the MLA kernel's
    warps share their row group's)."""
    BN, EMU, ix, MT, thread_x, thread_y, W = x.BN, x.EMU, x.ix, x.MT, x.thread_x, x.thread_y, x.W
    R = 16 * MT  # a warp's rows
    first = first_row if first_row is not None else (lambda ty: ty * R)

    @T.macro
    def mask_scan(live, w, c):
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("mask_scan"):
                    T.reads()
                    T.writes()
                    live[ix(ty, tx, 0)] = T.float32(0)
                    for rr in T.serial((R + WARP - 1) // WARP):
                        if tx + rr * WARP < R:
                            for j in T.serial(BN):
                                if w.mask_bit(w.row0 + first(ty) + tx + rr * WARP, w.tile(c) * BN + j):
                                    live[ix(ty, tx, 0)] = T.float32(1)
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("mask_warp"):
                    T.reads()
                    T.writes()
                    if EMU:
                        live[ty, tx, 1] = T.float32(0)
                        for lane in T.serial(WARP):
                            live[ty, tx, 1] = T.max(live[ty, tx, 1], live[ty, lane, 0])
                    else:
                        live[1] = T.cuda.warp_max(live[0], WARP)

    return mask_scan


def _mma_store(x):
    """Row sums across the row's lanes, ``O = acc / l`` (0 for a row with no key)."""
    (col_of, dtype, EMU, ix, MT, NO, o_half, row_of, thread_x, thread_y, W) = \
        (x.col_of, x.dtype, x.EMU, x.ix, x.MT, x.NO, x.o_half, x.row_of, x.thread_x, x.thread_y, x.W)

    @T.macro
    def sink_rows(ls, m, sw, sl, w, ty, tx):
        # with sinks: each row's weight w and denominator l·w + e (Variants.sink_terms), once
        # per row, not in each of its outputs (two exp2 polynomials apiece, unrolled)
        for h2 in T.unroll(MT * 2):
            sw[ix(ty, tx, h2)] = w.sink_terms(m[ix(ty, tx, h2)], w.row0 + row_of(ty, tx, h2))[0]
            sl[ix(ty, tx, h2)] = ls[ix(ty, tx, h2)] * sw[ix(ty, tx, h2)] + w.sink_terms(
                m[ix(ty, tx, h2)], w.row0 + row_of(ty, tx, h2))[1]

    @T.macro
    def store(O, acc, l, ls, m, sw, sl, w):
        # -- row sums across the row's lanes, O = acc / l (0 for a row with no key) ------
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("row_sum"):
                    T.reads()
                    T.writes()
                    for h2 in T.unroll(MT * 2):
                        if EMU:
                            ls[ty, tx, h2] = (l[ty, tx // 4 * 4, h2] + l[ty, tx // 4 * 4 + 1, h2]) + (
                                l[ty, tx // 4 * 4 + 2, h2] + l[ty, tx // 4 * 4 + 3, h2])
                        else:
                            ls[h2] = T.cuda.warp_sum(l[h2], 4)
        for ty in thread_y(W):
            for tx in thread_x(WARP):
                with T.sblock("O_store"):
                    T.reads()
                    T.writes()
                    if w.final:
                        if w.var.SK is not None:
                            sink_rows(ls, m, sw, sl, w, ty, tx)
                        for k in T.unroll(MT * NO * 4):
                            if w.row0 + row_of(ty, tx, o_half(k)) < w.rows:
                                O[w.o_at(w.row0 + row_of(ty, tx, o_half(k)), col_of(tx, k, NO))] = T.Cast(
                                    dtype, w.out(acc[ix(ty, tx, k)], ls[ix(ty, tx, o_half(k))],
                                                 w.row0 + row_of(ty, tx, o_half(k)), m[ix(ty, tx, o_half(k))],
                                                 (sw[ix(ty, tx, o_half(k))], sl[ix(ty, tx, o_half(k))])))
                        if w.LSE is not None:
                            if tx % 4 == 0:  # the row's four lanes hold the same m and sum
                                for h2 in T.unroll(MT * 2):
                                    if w.row0 + row_of(ty, tx, h2) < w.rows:
                                        w.LSE[w.lse_at(w.row0 + row_of(ty, tx, h2))] = lse_of(
                                            m[ix(ty, tx, h2)], ls[ix(ty, tx, h2)])
                    else:  # a split-KV chunk's state for the merge kernel: every tile row
                        # (unguarded: a guard would let TVM compact the workspace to seq_q rows)
                        for k in T.unroll(MT * NO * 4):
                            w.split.Op[w.part_at(row_of(ty, tx, o_half(k)), col_of(tx, k, NO))] = acc[ix(ty, tx, k)]
                        if tx % 4 == 0:
                            for h2 in T.unroll(MT * 2):
                                w.split.St[w.part_at(row_of(ty, tx, h2), 0)] = m[ix(ty, tx, h2)]
                                w.split.St[w.part_at(row_of(ty, tx, h2), 1)] = ls[ix(ty, tx, h2)]

    return store


@fast_macros  # TVMScript macro expansion without its costly stack walk, only while this generates
def fused_attention_mma(
    spec: AttentionSpec, warps: int, block_n: int, stages: int, m_tiles: int = 1, emulate: bool = False,
    split_tasks: int = 0,
) -> tirx.PrimFunc:
    """Arguments (call order), all ``spec.dtype`` (float16 or bfloat16), compact row-major,
    16-byte aligned rows (``head_dim`` a multiple of 16): bhsd ``Q (B, H, Sq, D)``, ``K (B, KH,
    Skv, D)``, ``V (B, KH, Skv, D)``, ``O (B, H, Sq, D)``; varlen ``Q (total_q, H, D)``,
    ``K``/``V (total_k, KH, D)``, ``cu_seqlens_q``/``cu_seqlens_k (batch+1,) int32``,
    ``O (total_q, H, D)``; kvcache/paged as :data:`layouts.LAYOUTS` lists them. ``split_tasks``:
    split-KV for the KV-cache layouts (``fused_cuda.Split``)."""
    x = _mma_fragments(_mma_context(spec, warps, block_n, stages, m_tiles, emulate))
    (B, block, BM, BN, dtype, fscope, fshape, MT, NDC, NO, NS, NT, SK, smem, SQ, TILE, W) = \
        (x.B, x.block, x.BM, x.BN, x.dtype, x.fscope, x.fshape, x.MT, x.NDC, x.NO, x.NS, x.NT, x.SK, x.smem,
         x.SQ, x.TILE, x.W)
    q_frag = _mma_q_frag(x)
    prologue = _mma_prologue(x)
    kv_wait = _mma_kv_wait(x)
    kv_prefetch = _mma_kv_prefetch(x)
    qk_mma = _mma_qk_mma(x)
    softmax = _mma_softmax(x)
    pv_mma = _mma_pv_mma(x)
    store = _mma_store(x)
    mask_scan = _mma_mask_scan(x) if x.cmask else None

    @T.macro
    def tile(Q, K, V, O, w):
        Ks = T.sblock_alloc_buffer((NS * TILE,), dtype, scope=smem)
        Vs = T.sblock_alloc_buffer((NS * x.VTILE,), dtype, scope=smem)
        Qf = T.sblock_alloc_buffer(fshape(MT * NDC * 8), dtype, scope=fscope)
        Kf = T.sblock_alloc_buffer(fshape(8), dtype, scope=fscope)
        Vf = T.sblock_alloc_buffer(fshape(8), dtype, scope=fscope)
        S = T.sblock_alloc_buffer(fshape(MT * NT * 4), "float32", scope=fscope)  # scores
        Pf = T.sblock_alloc_buffer(fshape(MT * NT * 4), dtype, scope=fscope)  # probabilities
        acc = T.sblock_alloc_buffer(fshape(MT * NO * 4), "float32", scope=fscope)
        m = T.sblock_alloc_buffer(fshape(MT * 2), "float32", scope=fscope)  # rows g, g + 8
        l = T.sblock_alloc_buffer(fshape(MT * 2), "float32", scope=fscope)  # lane's part
        mt = T.sblock_alloc_buffer(fshape(MT * 2), "float32", scope=fscope)  # lane's tile max
        mn = T.sblock_alloc_buffer(fshape(MT * 2), "float32", scope=fscope)  # row's new max
        ls = T.sblock_alloc_buffer(fshape(MT * 2), "float32", scope=fscope)  # row sum
        # a custom mask: whether the tile holds a bit of the warp's rows (lane's, warp's)
        live = T.meta_var(T.sblock_alloc_buffer(fshape(2), "float32", scope=fscope) if x.cmask else None)

        q_frag(Q, Qf, m, l, acc, w)
        prologue(Ks, Vs, K, V, w)
        for c in T.serial(w.n_tiles()):
            kv_wait(Ks, Vs, K, V, w, c)
            kv_prefetch(Ks, Vs, K, V, w, c)
            if x.cmask:
                mask_scan(live, w, c)
            qk_mma(S, Qf, Ks, Kf, c, live)
            softmax(S, Pf, acc, m, l, mt, mn, w, c, live)
            pv_mma(acc, Pf, Vs, Vf, c, live)
        store(O, acc, l, ls, m, mt, mn, w)  # mt, mn: free after the last tile (sink_rows)

    attrs = {"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused_mma",
             **record(FUSED_MMA, warps=W, block_n=BN, stages=NS, m_tiles=MT)}
    return kernel_func(spec, block, BM, BN, (B, SQ, SK), tile, attrs, reverse=x.causal, split_tasks=split_tasks,
                       lanes=x.thread_x)
