"""CPU schedule of the fused kernel's bf16 dot-product form (``dot_bf16`` knob): QKᵀ and PV on
AVX512-BF16's ``vdpbf16ps``.

``vdpbf16ps acc, a, b`` adds ``a[2l]·b[2l] + a[2l+1]·b[2l+1]`` (bf16 products, float32 sums) to
each of 16 float32 lanes ``l``: twice the multiply-adds of an fp32 FMA per instruction. The
workload (``workloads.fused._tile_macro(dot_bf16=True)``) lays the operands out for it — pairs
along the reduction dim — and spells the products on the uint16 bits of the bf16 values; this
schedule register-blocks the two products like the fp32 schedule and tensorizes their inner
(pair, 16 lanes) nests:

* ``S_gemm`` ``(key block, d pair, keys unrolled, query vectors unrolled, [pair, 16 rows])``:
  ``S[j, i:i+16] += dot(Qp[dp, i:i+16, 0:2], broadcast(K[j, 2dp:2dp+2]))`` (``DP``);
* ``PV_gemm`` ``(row block, key pair, rows unrolled, column vectors unrolled, [pair, 16 cols])``:
  ``acc[i, d:d+16] += dot(Vt[jp, d:d+16, 0:2], broadcast(P[i, 2jp:2jp+2]))`` (``DP``, the same);
* ``V_ilv``/``P_ilv`` interleave two 16-element rows into 16 pairs (``ILV``, one shuffle).

TVM's own lowering turns bf16 arithmetic into float32 (``BF16ComputeLegalize``) and cannot pass a
``<32 x bfloat>`` to the LLVM intrinsic, so the intrinsics' implementations call a three-line
LLVM IR function (``DPBF16_IR``: bitcast the two ``<16 x i32>`` operands to ``<32 x bfloat>``,
call ``llvm.x86.avx512bf16.dpbf16ps.512``) imported with ``pragma_import_llvm``; LLVM inlines it
into one instruction. Decisions are :mod:`cpu_fused`'s (``s_rows``, ``pv_rows``,
``parallel_chunk``, ``auto_unroll``), pinned to the knobs or sampled, and recorded the same way.
"""
from __future__ import annotations

from tvm import s_tir
from tvm.script import tirx as T

from ..spec import AttentionSpec
from ..tvm_internals import register_tensor_intrin
from ..workloads._math import bf16_value
from .cpu_space import (
    AUTO_UNROLL_STEPS,
    PARALLEL_CHUNKS,
    dot_pv_columns,
    has_block,
    max_pv_rows,
    max_s_rows,
    sample_choice,
    sample_tile,
    vectorize_rows,
)

L = 16  # float32 lanes of one vdpbf16ps (a zmm register)
U16, F32 = "uint16", "float32"
FEATURE = "avx512bf16"

#: ``acc + dpbf16(a, b)`` on <16 x i32> operands holding bf16 pairs; inlined by LLVM.
DPBF16_IR = r"""
define <16 x float> @tvma_dpbf16(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) #0 {
  %x = bitcast <16 x i32> %a to <32 x bfloat>
  %y = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %x, <32 x bfloat> %y)
  ret <16 x float> %r
}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
attributes #0 = { alwaysinline nounwind readnone "target-features"="+avx512bf16,+avx512f" }
"""

DP, ILV = "attn_bf16_dp", "attn_bf16_ilv"
_ILV_LANES = [x for d in range(L) for x in (d, d + L)]


def _dp(acc, a, b):
    return T.call_pure_extern("float32x16", "tvma_dpbf16", acc, a, b)


def _pair32(buf, idx):
    """The 32-bit word of bf16 ``buf[idx]`` and its neighbour (a little-endian pair)."""
    return T.reinterpret("int32", buf.vload(idx, "uint16x2"))


def register() -> None:
    """Register ``DP`` and ``ILV`` (once per process): at the first bf16 dot-product schedule, or
    when a tuning log names them (``logs``). Not at import: parsing their four TVMScript
    definitions took ~0.9-1.3 s of every process that imports the schedules, most of which
    never schedule a bf16 kernel (a tune's workers, the CLI, the tests' subprocesses)."""
    if _registered:
        return
    # One dot-product intrinsic serves both products: ``acc[0:16] += Σ_t x[t] · y[0, 0:16, t]``
    # with the pair ``x`` broadcast (S_gemm: a K pair against 16 query rows of Qp; PV_gemm: a P
    # pair against 16 columns of Vt).
    @T.prim_func(s_tir=True)
    def dp_desc(a: T.handle, b: T.handle, c: T.handle):
        X = T.match_buffer(a, (2,), U16, offset_factor=1, scope="local")
        Y = T.match_buffer(b, (1, L, 2), U16, offset_factor=1, scope="local")
        A = T.match_buffer(c, (L,), F32, offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(A[0:L], X[0:2], Y[0, 0:L, 0:2])
            T.writes(A[0:L])
            for t, i in T.grid(2, L):  # loop order: the schedule's; iter order: the block's
                with T.sblock("update"):
                    vi, vt = T.axis.remap("SR", [i, t])
                    A[vi] = A[vi] + bf16_value(X[vt]) * bf16_value(Y[0, vi, vt])

    @T.prim_func(s_tir=True)
    def dp_impl(a: T.handle, b: T.handle, c: T.handle):
        X = T.match_buffer(a, (2,), U16, offset_factor=1, scope="local")
        Y = T.match_buffer(b, (1, L, 2), U16, offset_factor=1, scope="local")
        A = T.match_buffer(c, (L,), F32, offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(A[0:L], X[0:2], Y[0, 0:L, 0:2])
            T.writes(A[0:L])
            A[T.ramp(0, 1, L)] = _dp(A[T.ramp(0, 1, L)], T.reinterpret("int32x16", Y.vload([0, 0, 0], "uint16x32")),
                                     T.Broadcast(_pair32(X, [0]), L))

    @T.prim_func(s_tir=True)
    def ilv_desc(a: T.handle, b: T.handle):
        X = T.match_buffer(a, (2, L), U16, offset_factor=1, scope="local")
        Y = T.match_buffer(b, (1, L, 2), U16, offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(X[0:2, 0:L])
            T.writes(Y[0, 0:L, 0:2])
            for t, d in T.grid(2, L):
                with T.sblock("update"):
                    vd, vt = T.axis.remap("SS", [d, t])
                    Y[0, vd, vt] = X[vt, vd]

    @T.prim_func(s_tir=True)
    def ilv_impl(a: T.handle, b: T.handle):
        X = T.match_buffer(a, (2, L), U16, offset_factor=1, scope="local")
        Y = T.match_buffer(b, (1, L, 2), U16, offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(X[0:2, 0:L])
            T.writes(Y[0, 0:L, 0:2])
            Y[0, 0, T.ramp(0, 1, 2 * L)] = T.Shuffle([X.vload([0, 0], "uint16x16"), X.vload([1, 0], "uint16x16")],
                                                      _ILV_LANES)

    for name, desc, impl in ((DP, dp_desc, dp_impl), (ILV, ilv_desc, ilv_impl)):
        register_tensor_intrin(name, desc, impl)  # once per process (this module may load twice)
    _registered.append(True)


_registered: list[bool] = []  # non-empty once this process registered DP and ILV


def supports(spec: AttentionSpec, features: set[str]) -> bool:
    """Whether ``spec`` can take the bf16 dot-product form on a CPU with ``features``."""
    return (spec.dtype == "bfloat16" and not spec.kv_quantized and FEATURE in features and "avx512f" in features
            and spec.head_dim % L == 0 and spec.v_dim % L == 0)


def schedule(sch: s_tir.Schedule, spec: AttentionSpec, knobs=None, suffix: str = "") -> s_tir.Schedule:
    """Schedule the dot_bf16 main nest (blocks ``*<suffix>``): with ``knobs`` every decision is
    pinned (the hand schedule), with None sampled (the design space), as ``cpu_fused.schedule``."""
    row_tile = sch.get_sblock("row_tile" + suffix)
    bufs = {b.name: b for b in sch.get(row_tile).alloc_buffers}
    block_n, block_m = (int(x) for x in bufs["S"].shape)
    D, DV = spec.head_dim, spec.v_dim  # QKᵀ's head dim, PV's
    pin = knobs is not None
    register()

    def blk(name):
        return sch.get_sblock(name + suffix)

    stage_copies(sch, blk, D, DV)

    # S_gemm (j, dp, i, t) -> (jo, dp, ji, io, [t, ii]): s_rows keys × query vectors of
    # accumulators across the d-pair loop, one vdpbf16ps per (key, query vector, d pair).
    s_gemm = blk("S_gemm")
    j, dp, i, t = sch.get_loops(s_gemm)[-4:]
    s_rows = sample_tile(sch, j, block_n, knobs.s_rows if pin else None, max_s_rows(block_m, L))
    jo, ji = sch.split(j, s_rows)
    io, ii = sch.split(i, [None, L])
    sch.reorder(jo, dp, ji, io, t, ii)
    init = sch.decompose_reduction(s_gemm, dp)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.tensorize(t, DP)
    sch.unroll(ji)
    sch.unroll(io)

    interleave_pairs(sch, blk, block_m)

    # PV_gemm (i, jp, d, t) -> (io, [dc,] jp, ii, do, [t, di]): pv_rows rows × pv_cols/16 column
    # vectors; the column block as the preset's (cpu_space.dot_pv_columns): not sampled
    pv = blk("PV_gemm")
    i, jp, d, t = sch.get_loops(pv)[-4:]
    pv_cols = (knobs.pv_cols or DV) if pin else dot_pv_columns(DV, L)
    pv_rows = sample_tile(sch, i, block_m, knobs.pv_rows if pin else None, max_pv_rows(pv_cols, L))
    io, ii = sch.split(i, pv_rows)
    if pv_cols < DV:
        dc, d = sch.split(d, [None, pv_cols])
        do, di = sch.split(d, [None, L])
        sch.reorder(io, dc, jp, ii, do, t, di)
    else:
        do, di = sch.split(d, [None, L])
        sch.reorder(io, jp, ii, do, t, di)
    sch.tensorize(t, DP)
    sch.unroll(ii)
    sch.unroll(do)

    vectorize_softmax(sch, blk, suffix)
    return parallel_rows(sch, row_tile, blk, knobs, {"s_rows": s_rows[1], "pv_rows": pv_rows[1],
                                                      "pv_cols": pv_cols if pv_cols < DV else 0, "d_unroll": 1},
                         DPBF16_IR)


# -- what the bf16 dot-product and the AMX schedules (cpu_amx) share --------------------------

def _vec(sch: s_tir.Schedule, loop, extent: int, lanes: int) -> None:
    if extent > lanes:
        outer, loop = sch.split(loop, [None, lanes])
        sch.unroll(outer)
    sch.vectorize(loop)


def stage_copies(sch: s_tir.Schedule, blk, D: int, DV: int) -> None:
    """The key and value tiles' bits copied by rows (``K_load``/``V_load``; ``D``/``DV`` 0: no
    such copy, the AMX form reads whole key tiles in place where it can and packs V's pairs
    itself); q's pairs (``Q_load``) once per row tile.
    ``blk(name)``: the nest's block."""
    if D:
        _vec(sch, sch.get_loops(blk("K_load"))[-1], D, 32)
    if DV:
        _vec(sch, sch.get_loops(blk("V_load"))[-1], DV, 32)
    sch.unroll(sch.get_loops(blk("Q_load"))[-1])


def interleave_pairs(sch: s_tir.Schedule, blk, block_m: int) -> None:
    """Pairs of V rows and of P rows (keys 2jp, 2jp+1) interleaved, 16 columns per shuffle
    (:data:`ILV`); P rounded to bf16 in vectors across its rows."""
    for name in ("V_ilv", "P_ilv"):
        b = blk(name)
        jp, x, t = sch.get_loops(b)[-3:]
        xo, xi = sch.split(x, [None, L])
        sch.reorder(jp, xo, t, xi)
        sch.tensorize(t, ILV)
    _vec(sch, sch.get_loops(blk("P_round"))[-1], block_m, L)


#: the softmax's blocks vectorized across query rows (``score_mod``: a variant's, when present;
#: ``max_ref``: the AMX form's lazy reference)
SOFTMAX_ROWS = ("row_max", "P_exp", "row_sum", "state_init", "max_ref", "online_correction", "max_commit",
                "score_mod")


def vectorize_softmax(sch: s_tir.Schedule, blk, suffix: str) -> None:
    """The softmax stages across query rows, as the fp32 schedule; the accumulator's init and the
    store along its rows. (acc_rescale reads what it writes, not a complete block: vectorize
    refuses it; its loop is a plain contiguous scale that LLVM vectorizes itself.)"""
    for name in SOFTMAX_ROWS:
        if name not in ("score_mod", "max_ref") or has_block(sch, name + suffix):
            vectorize_rows(sch, sch.get_loops(blk(name))[-1], L)
    for name in ("acc_init", "O_store"):
        sch.vectorize(sch.get_loops(blk(name))[-1])
    for name in ("row_max", "row_sum"):
        b = blk(name)
        sch.decompose_reduction(b, sch.get_loops(b)[-3])


def parallel_rows(sch: s_tir.Schedule, row_tile, blk, knobs, recorded: dict, import_llvm: str | None):
    """The key-tile loop's unrolling (``auto_unroll``) and the row tiles' parallel chunks
    (``parallel_chunk``), pinned to ``knobs`` or sampled (None); ``recorded`` and both decisions
    annotated on ``row_tile`` as ``attn.*`` (what ``cpu_fused.knobs_of`` reads back);
    ``import_llvm``: LLVM IR the key-tile loop imports."""
    pin = knobs is not None
    c_loop = sch.get_loops(blk("kv_tile"))[-1]
    unroll = sample_choice(sch, AUTO_UNROLL_STEPS, knobs.auto_unroll if pin else None)
    sch.annotate(c_loop, "pragma_auto_unroll_max_step", unroll)
    sch.annotate(c_loop, "pragma_unroll_explicit", 1)
    if import_llvm:
        sch.annotate(c_loop, "pragma_import_llvm", import_llvm)
    for key, value in (*recorded.items(), ("auto_unroll", unroll)):
        sch.annotate(row_tile, f"attn.{key}", value)
    fused = sch.fuse(*sch.get_loops(row_tile))
    chunk = sample_choice(sch, PARALLEL_CHUNKS, knobs.parallel_chunk if pin else None)
    outer, _ = sch.split(fused, [None, chunk])
    sch.parallel(outer)
    sch.annotate(row_tile, "attn.parallel_chunk", chunk)
    return sch
