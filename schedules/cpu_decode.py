"""CPU schedule of the fused kernel's packed decode nests with few rows (one new token per
sequence: ``group`` rows per kv head, 1 for MHA, 4 for 32:8 GQA).

Why a schedule of its own: the main schedule vectorizes ``S_gemm`` across query rows (one K
element broadcast against a vector of rows). With 4 rows that is a 4-lane vector per element of
K, and with 1 row a scalar: QKᵀ costs ``block_n·head_dim`` narrow FMAs per tile, each reloading
``Qt``, and a decode step that should stream K/V at memory speed is bound by those instead.
Here QKᵀ is a dot product along head_dim: each K row is read as contiguous 16-lane vectors,
multiplied into one accumulator per query row, and a shuffle-add tree turns the ``rows``
accumulators into one ``rows``-lane vector of scores (``DOT`` intrinsic, tensorized per key).

The compute is unchanged (the same blocks as every nest): only ``Qt`` is laid out row-major
(``transform_layout``) so a query row is contiguous. ``rfactor`` cannot express the dot product
here (the key-tile scope is not a stage pipeline: ``m`` is read, then written), hence the
tensor intrinsic.

``decode_dot`` (bfloat16 queries, a bfloat16 or 8-bit cache, AVX512-BF16): the workload stages q
and the keys as bf16 bits (a bf16 cache's read as they are, an 8-bit value's float32 upper half)
and the same dot product runs on ``vdpbf16ps``, 32 elements per instruction
(:func:`dot_bf16_intrinsic`). It is exact: bf16 holds every operand, and the scales multiply the
float32 scores. ``decode_dot`` 2 puts PV on ``vdpbf16ps`` too (:func:`_schedule_pv_dot`: P
rounded to bf16, V's row pairs interleaved, ``cpu_bf16``'s intrinsics).

Side by side (2-core znver4, 2 threads, H32 KH8 D128, bf16 queries, B4 4k / B1 16k), the step
over the float32 form's:

| cache | QKᵀ (1), kvcache | QKᵀ (1), paged | both (2), kvcache | both (2), paged |
|---|---|---|---|---|
| bf16 | 0.86 / 0.91 | 0.99 / 0.95 | 0.85 / 0.84 | 0.91 / 0.84 |
| int8 | 0.87 / 0.89 | 0.89 / 0.91 | 0.89 / 0.86 | 0.87 / 0.87 |
| e4m3fn | 0.89 / 0.89 | 0.93 / 0.93 | 0.93 / 0.93 | 0.96 / 0.96 |

``decode_dot`` 3 (``qk_int8``: q rounded to int8 per row, an int8 cache): QKᵀ on integer dot
products, exact, the keys read as bytes: AVX512-VNNI's ``vpdpbusd`` (:func:`_dot_i8`; the keys
staged as ``k + 128`` since it multiplies unsigned by signed bytes, the scores less ``128·Σq_i``)
or AVX2's ``vpmaddubsw`` + ``vpmaddwd`` (:func:`_dot_i8_avx2`, llama.cpp's sign trick). Against
the form without it: 0.70 / 0.72 kvcache (VNNI, bf16 queries), 0.78 / 0.77 (AVX2).

``decode_dot`` 6 (7 emulated) puts the products on AMX tiles (``workloads.amx.decode_products``):
its ``S_gemm`` and ``PV_gemm`` blocks are calls, so this schedule keeps the rest (the staged keys,
V's pair words, the softmax and the float32 PV of an int8 cache) and leaves q's pairs as they are
(:func:`_schedule_amx_qk`, :func:`_schedule_amx_pv`). The AMX preset takes it for GQA with
bfloat16 queries: a bf16 cache, or an int8 one with ``qk_int8`` on the contiguous layouts
(``cpu_fused.amx_decode_heads``, with its measurements).

The presets (``cpu_fused.preset``): a bf16 cache takes both, an 8-bit one QKᵀ (exact; PV on dots
gains nothing there, widening V is the cost). Taking an 8-bit key's upper half instead of
rounding it (three integer operations per element that changed nothing) is what made its dot
products pay: before, 0.97-1.07.

Knobs (why these values; measured on a 2-core znver4, H32 KH8 D128, B4 with a 4k cache):
``pv_rows = 4`` rows × ``pv_cols = 64`` columns of PV accumulators (16 zmm + 4 for the V
segment; 4×128 spilled, 2×64 reloaded P more often), P_exp over the fused (key, row) loop in
full 16-lane vectors as a loop (unrolled, its copies of the exp polynomial tripled the build
time).
"""
from __future__ import annotations

import dataclasses

from tvm import s_tir, tirx
from tvm.script import tirx as T

from ..quant import SCALE_GROUP
from ..spec import AttentionSpec
from ..tvm_internals import fast_macros, register_tensor_intrin

from ..workloads._math import bf16_value, f32
from . import cpu_bf16
from .cpu_space import has_block

F32 = "float32"
BF16_LANES = 16  # float32 lanes of a vdpbf16ps (AVX-512 only)
#: float32 lanes of the dot product's vectors: 16 (a zmm, AVX-512) or 8 (a ymm, AVX2)
DOT_LANES = (16, 8)


@dataclasses.dataclass(frozen=True)
class DotDecodeKnobs:
    """Decisions of :func:`schedule` (derived from the main knobs by ``cpu_fused``:
    :func:`for_lanes`)."""

    pv_rows: int = 4  # PV_gemm rows per register block (unrolled)
    pv_cols: int = 64  # head_dim columns per PV_gemm register block (0 = all)
    lanes: int = 16  # float32 lanes of every vector (DOT_LANES)


def for_lanes(lanes: int) -> DotDecodeKnobs:
    """The decode nest's PV register block for ``lanes``-wide vectors: accumulators in half the
    vector registers — AVX-512 4 rows × 64 columns (16 of 32 zmm), AVX2 2 rows × 32 columns
    (8 of 16 ymm; 4 × 32 would leave no register for V and P).

    Why on AVX2 (``mcpu`` znver3 code on a 2-core znver4, H32 KH8 D128 fp32 kvcache, 2 threads,
    ms at B1 4k / B1 16k / B4 4k, one run): before this nest took AVX2 (one 8-row vector,
    scheduled as the main nest) 2.66 / 11.5 / 10.3 ms; dot products with 4 × 16 1.85 / 6.99 /
    8.51, with 2 × 32 1.78 / 6.66 / 7.84, against the AVX-512 build's 1.52 / 6.26 / 7.59; a
    one-row block over all of head_dim 2.09 / 9.37 / 13.0."""
    return DotDecodeKnobs(pv_rows=4 if lanes == 16 else 2, pv_cols=64 if lanes == 16 else 4 * lanes, lanes=lanes)


def supports(spec: AttentionSpec, rows: int, lanes: int) -> bool:
    """Whether a ``rows``-row decode nest can take the dot-product schedule: AVX-512 or AVX2
    lanes (:data:`DOT_LANES`), head_dim (and V's) a multiple of them, and a power-of-two row count up to
    one vector (the shuffle tree pairs accumulators)."""
    return (lanes in DOT_LANES and spec.head_dim % lanes == 0 and spec.v_dim % lanes == 0 and 1 <= rows <= lanes
            and rows & (rows - 1) == 0)


def _lane(v: int) -> tirx.IntImm:
    return tirx.IntImm("int32", v)


def _shuffle_tree(vecs: list, width: int):
    """One ``len(vecs)``-lane vector whose lane ``k`` is the sum of ``vecs[k]``'s ``width``
    lanes. Pairs of vectors are folded by halves (lane segments halve at every level), so no
    lane is idle until a single vector remains; then that vector is folded onto itself. Every
    intermediate is let-bound so LLVM sees each shuffle once."""
    lets = []

    def bind(e, lanes):
        v = tirx.Var(f"t{len(lets)}", f"float32x{lanes}" if lanes > 1 else F32)
        lets.append((v, e))
        return v

    seg = width  # lanes each partial sum occupies inside a vector
    cur = [bind(v, width) for v in vecs]
    while len(cur) > 1 and seg > 1:
        nxt = []
        for x, y in zip(cur[0::2], cur[1::2]):
            lo, hi = [], []
            for src in (0, 1):
                for part in range(width // seg):
                    base = src * width + part * seg
                    lo += range(base, base + seg // 2)
                    hi += range(base + seg // 2, base + seg)
            nxt.append(bind(tirx.Shuffle([x, y], [_lane(k) for k in lo])
                            + tirx.Shuffle([x, y], [_lane(k) for k in hi]), width))
        cur = nxt
        seg //= 2
    v, lanes = cur[0], width
    while seg > 1:
        lo, hi = [], []
        for part in range(lanes // seg):
            base = part * seg
            lo += range(base, base + seg // 2)
            hi += range(base + seg // 2, base + seg)
        lanes //= 2
        if lanes == 1:
            e = tirx.Shuffle([v], [_lane(lo[0])]) + tirx.Shuffle([v], [_lane(hi[0])])
        else:
            e = tirx.Shuffle([v], [_lane(k) for k in lo]) + tirx.Shuffle([v], [_lane(k) for k in hi])
        v = bind(e, lanes)
        seg //= 2
    body = v
    for var, val in reversed(lets):
        body = tirx.Let(var, val, body)
    return body


def _dot(K, Q, D: int, rows: int, lanes: int):
    """``Σ_d K[d]·Q[i, d]`` for ``i < rows`` as one ``rows``-lane expression."""
    vt = f"float32x{lanes}"
    vecs = []
    for i in range(rows):
        acc = None
        for c in range(D // lanes):
            a = K.vload([c * lanes], vt)
            b = Q.vload([i, c * lanes], vt)
            acc = a * b if acc is None else tirx.call_llvm_pure_intrin(vt, "llvm.fmuladd", a, b, acc)
        vecs.append(acc)
    return _shuffle_tree(vecs, lanes)


def dot_intrinsic(D: int, rows: int, lanes: int = 16) -> str:
    """Register (once) and name the tensor intrinsic ``S[0:rows] += K[0:D] · Q[0:rows, 0:D]``
    on ``lanes``-wide float32 vectors."""
    name = f"attn_decode_dot_d{D}_r{rows}" + ("" if lanes == 16 else f"_l{lanes}")
    return _register_dot(name, D, rows, F32, lambda x: x, lambda K, Q: _dot(K, Q, D, rows, lanes))


def _dot_bf16(K, Q, D: int, rows: int):
    """``Σ_d K[d]·Q[i, d]`` for ``i < rows`` on bf16 bits (uint16) as one ``rows``-lane
    expression: ``vdpbf16ps`` on 32 elements at a time (16 lanes, each the sum of a pair along
    d; ``cpu_bf16.DPBF16_IR``), then the shuffle tree."""
    vecs = []
    for i in range(rows):
        acc = tirx.Broadcast(tirx.const(0.0, F32), BF16_LANES)
        for c in range(D // (2 * BF16_LANES)):
            a = tirx.reinterpret("int32x16", K.vload([c * 2 * BF16_LANES], "uint16x32"))
            b = tirx.reinterpret("int32x16", Q.vload([i, c * 2 * BF16_LANES], "uint16x32"))
            acc = tirx.call_pure_extern("float32x16", "tvma_dpbf16", acc, a, b)
        vecs.append(acc)
    return _shuffle_tree(vecs, BF16_LANES)


#: AVX512-VNNI (``vpdpbusd``: 64 unsigned × signed byte products summed by fours into 16 int32)
VNNI = "avx512vnni"
I8_LANES = 64  # bytes of one vpdpbusd operand (a zmm)


def _dot_i8(K, Q, D: int, rows: int):
    """``Σ_d K[d]·Q[i, d]`` for ``i < rows`` on bytes (K unsigned, Q signed) as one ``rows``-lane
    float32 expression: ``vpdpbusd`` on 64 bytes at a time into 16 int32 lanes (exact), then the
    lanes as float32 (exact below 2**24: D <= 512) through the shuffle tree."""
    vecs = []
    for i in range(rows):
        acc = tirx.Broadcast(tirx.const(0, "int32"), BF16_LANES)
        for c in range(D // I8_LANES):
            # (TVM 0.27's LLVM takes the bytes as <64 x i8>; older ones took <16 x i32>)
            a = K.vload([c * I8_LANES], "uint8x64")
            b = Q.vload([i, c * I8_LANES], "int8x64")
            acc = tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc, a, b)
        vecs.append(tirx.Cast("float32x16", acc))
    return _shuffle_tree(vecs, BF16_LANES)


#: bytes of one AVX2 integer product operand (a ymm): ``vpmaddubsw`` then ``vpmaddwd``
I8_AVX2_BYTES = 32


def _dot_i8_avx2(K, Q, D: int, rows: int):
    """``Σ_d K[d]·Q[i, d]`` for ``i < rows`` on signed bytes (AVX2, no VNNI) as one ``rows``-lane
    float32 expression, llama.cpp's sign trick: ``vpmaddubsw(|k|, sign(q, k))`` multiplies
    ``|k|`` (unsigned, at most 128) by ``q·sign(k)`` (at most 127 in magnitude: q_i is never
    -128) and adds pairs into int16 without saturating (2·128·127 < 2**15), ``vpmaddwd`` by ones
    adds pairs of those into 8 int32 lanes; exact."""
    ones = tirx.Broadcast(tirx.const(1, "int16"), 16)
    vecs = []
    for i in range(rows):
        acc = tirx.Broadcast(tirx.const(0, "int32"), 8)
        for c in range(D // I8_AVX2_BYTES):
            k = K.vload([c * I8_AVX2_BYTES], "int8x32")
            q = Q.vload([i, c * I8_AVX2_BYTES], "int8x32")
            mag = tirx.call_llvm_pure_intrin("int8x32", "llvm.abs.v32i8", k, tirx.const(0, "bool"))
            sq = tirx.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", q, k)
            p16 = tirx.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", mag, sq)
            acc = acc + tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", p16, ones)
        vecs.append(tirx.Cast("float32x8", acc))
    return _shuffle_tree(vecs, 8)


def supports_i8(spec: AttentionSpec, rows: int, lanes: int, features: set[str]) -> bool:
    """Whether a ``rows``-row decode nest can take QKᵀ on int8 dot products (``decode_dot`` 3),
    with ``qk_int8`` (q rounded to int8, an int8 cache) and head_dim up to 512 (the sums exact in
    float32): on AVX-512 lanes with AVX512-VNNI (``vpdpbusd``, head_dim a multiple of 64), or on
    AVX2 lanes (``vpmaddubsw``, a multiple of 32)."""
    if not (supports(spec, rows, lanes) and spec.qk_int8 and spec.head_dim <= 512):
        return False
    if lanes == BF16_LANES:
        return spec.head_dim % I8_LANES == 0 and VNNI in features
    return spec.head_dim % I8_AVX2_BYTES == 0 and "avx2" in features


def dot_i8_intrinsic(D: int, rows: int, lanes: int = 16) -> str:
    """Register (once) and name ``S[0:rows] += K[0:D] · Q[0:rows, 0:D]`` on bytes: ``decode_dot``
    3's. AVX-512 (``lanes`` 16): ``vpdpbusd`` on K unsigned (``k + 128``), Q signed; AVX2
    (``lanes`` 8, name ``..._l8``): both signed, ``vpmaddubsw``'s sign trick."""
    if lanes == BF16_LANES:
        return _register_dot(f"attn_decode_i8dot_d{D}_r{rows}", D, rows, ("uint8", "int8"), f32,
                             lambda K, Q: _dot_i8(K, Q, D, rows))
    return _register_dot(f"attn_decode_i8dot_d{D}_r{rows}_l8", D, rows, "int8", f32,
                         lambda K, Q: _dot_i8_avx2(K, Q, D, rows))


def _dot_i8_groups(K, Q, Ks, D: int, rows: int, vnni: bool = False):
    """``Σ_g Ks[g]·Σ_{d in g} K[d]·Q[i, d]`` for ``i < rows`` on signed bytes: each group of
    :data:`SCALE_GROUP` bytes (one ymm) by ``vpmaddubsw``'s sign trick into 8 int32 lanes (exact),
    converted and multiplied by the group's scale into a float32 accumulator (one rounding per
    group and lane), then the shuffle tree. ``vnni`` (AVX512-VNNI with AVX512-VL): the sign
    trick's products summed by one 32-byte ``vpdpbusd`` instead of ``vpmaddubsw`` + ``vpmaddwd``
    (the same exact int32 lanes)."""
    ones = tirx.Broadcast(tirx.const(1, "int16"), 16)
    zero = tirx.Broadcast(tirx.const(0, "int32"), 8)
    vecs = []
    for i in range(rows):
        acc = tirx.Broadcast(tirx.const(0.0, F32), 8)
        for g in range(D // SCALE_GROUP):
            k = K.vload([g * SCALE_GROUP], "int8x32")
            q = Q.vload([i, g * SCALE_GROUP], "int8x32")
            mag = tirx.call_llvm_pure_intrin("int8x32", "llvm.abs.v32i8", k, tirx.const(0, "bool"))
            sq = tirx.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", q, k)
            if vnni:
                p32 = tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx512.vpdpbusd.256", zero, mag, sq)
            else:
                p16 = tirx.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", mag, sq)
                p32 = tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", p16, ones)
            acc = tirx.call_llvm_pure_intrin("float32x8", "llvm.fmuladd", tirx.Cast("float32x8", p32),
                                             tirx.Broadcast(Ks[g], 8), acc)
        vecs.append(acc)
    return _shuffle_tree(vecs, 8)


def dot_i8_group_intrinsic(D: int, rows: int, vnni: bool = False) -> str:
    """Register (once) and name ``S[0:rows] += Σ_d Ks[d // 32]·K[d]·Q[0:rows, d]`` on signed bytes
    (``decode_dot`` 5: a per-group scaled int8 cache with ``qk_int8``): each group's exact integer
    sum times its scale (:func:`_dot_i8_groups`: 32 bytes a group, AVX2's form or with ``vnni``
    (AVX-512 lanes: AVX512-VNNI and AVX512-VL) one ``vpdpbusd`` on a ymm, 0.91-0.93x AVX2's form's
    kvcache step, 0.95-1.00x paged, bit-identical: 2-core znver4, GQA 32:8 D128, bf16 queries, B4
    4k / B1 16k / B16 4k, alternated)."""
    name = f"attn_decode_i8dot_groups_d{D}_r{rows}" + ("_vnni" if vnni else "")
    if name in _REGISTERED:
        return name
    NG = D // SCALE_GROUP

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, s: T.handle, c: T.handle):
        K = T.match_buffer(a, (D,), "int8", offset_factor=1, scope="local")
        Q = T.match_buffer(b, (rows, D), "int8", offset_factor=1, scope="local")
        Ks = T.match_buffer(s, (NG,), F32, offset_factor=1, scope="local")
        S = T.match_buffer(c, (rows,), F32, offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(S[0:rows], Ks[0:NG], K[0:D], Q[0:rows, 0:D])
            T.writes(S[0:rows])
            if rows > 1:
                for d, i in T.grid(D, rows):
                    with T.sblock("update"):
                        vd, vi = T.axis.remap("RS", [d, i])
                        S[vi] = S[vi] + Ks[T.floordiv(vd, SCALE_GROUP)] * (f32(K[vd]) * f32(Q[vi, vd]))
            else:  # a unit row loop binds no row iter var (as _register_dot's)
                for d, i in T.grid(D, 1):
                    with T.sblock("update"):
                        vd = T.axis.reduce(D, d)
                        S[0] = S[0] + Ks[T.floordiv(vd, SCALE_GROUP)] * (f32(K[vd]) * f32(Q[0, vd]))

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, s: T.handle, c: T.handle):
        K = T.match_buffer(a, (D,), "int8", offset_factor=1, scope="local")
        Q = T.match_buffer(b, (rows, D), "int8", offset_factor=1, scope="local")
        Ks = T.match_buffer(s, (NG,), F32, offset_factor=1, scope="local")
        S = T.match_buffer(c, (rows,), F32, offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(S[0:rows], Ks[0:NG], K[0:D], Q[0:rows, 0:D])
            T.writes(S[0:rows])
            if rows > 1:
                S[T.Ramp(0, 1, rows)] = S.vload([0], f"float32x{rows}") + _dot_i8_groups(K, Q, Ks, D, rows, vnni)
            else:
                S[0] = S[0] + _dot_i8_groups(K, Q, Ks, D, rows, vnni)

    register_tensor_intrin(name, desc, impl)
    _REGISTERED.add(name)
    return name


def supports_bf16(spec: AttentionSpec, rows: int, lanes: int, features: set[str]) -> bool:
    """Whether a ``rows``-row decode nest can take QKᵀ on ``vdpbf16ps`` (``decode_dot``): the
    dot-product schedule on AVX-512 lanes, a CPU with AVX512-BF16, head_dim a multiple of 32 (a
    vdpbf16ps takes 32 elements), and operands bf16 holds exactly: bfloat16 queries, a bfloat16
    or 8-bit cache (float16 and float32 would be rounded), or any queries with ``qk_int8`` (their
    int8 values are exact too)."""
    return (supports(spec, rows, lanes) and lanes == BF16_LANES and spec.head_dim % (2 * BF16_LANES) == 0
            and cpu_bf16.FEATURE in features and (spec.dtype == "bfloat16" or spec.qk_int8))


def dot_bf16_intrinsic(D: int, rows: int) -> str:
    """Register (once) and name ``S[0:rows] += K[0:D] · Q[0:rows, 0:D]`` on bf16 bits (uint16):
    ``decode_dot``'s, on ``vdpbf16ps``."""
    return _register_dot(f"attn_decode_bf16dot_d{D}_r{rows}", D, rows, "uint16", bf16_value,
                         lambda K, Q: _dot_bf16(K, Q, D, rows))


@fast_macros  # TVMScript macro expansion without its costly stack walk, only while this generates
def _register_dot(name: str, D: int, rows: int, dtype, value, dot) -> str:
    """Register the dot-product intrinsic ``name`` once: operands ``K (D,)`` and ``Q (rows, D)``
    of ``dtype`` (or a pair: K's, Q's), each read as float32 by ``value`` (the description's
    spelling, which the workload's S_gemm matches), and ``dot(K, Q)`` the ``rows``-lane sum its
    implementation computes."""
    if name in _REGISTERED:
        return name
    k_dtype, q_dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        K = T.match_buffer(a, (D,), k_dtype, offset_factor=1, scope="local")
        Q = T.match_buffer(b, (rows, D), q_dtype, offset_factor=1, scope="local")
        S = T.match_buffer(c, (rows,), F32, offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(S[0:rows], K[0:D], Q[0:rows, 0:D])
            T.writes(S[0:rows])
            if rows > 1:
                for d, i in T.grid(D, rows):
                    with T.sblock("update"):
                        vd, vi = T.axis.remap("RS", [d, i])
                        S[vi] = S[vi] + value(K[vd]) * value(Q[vi, vd])
            else:  # a unit row loop binds no row iter var; tensorize matches bindings
                for d, i in T.grid(D, 1):
                    with T.sblock("update"):
                        vd = T.axis.reduce(D, d)
                        S[0] = S[0] + value(K[vd]) * value(Q[0, vd])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        K = T.match_buffer(a, (D,), k_dtype, offset_factor=1, scope="local")
        Q = T.match_buffer(b, (rows, D), q_dtype, offset_factor=1, scope="local")
        S = T.match_buffer(c, (rows,), F32, offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(S[0:rows], K[0:D], Q[0:rows, 0:D])
            T.writes(S[0:rows])
            if rows > 1:
                S[T.Ramp(0, 1, rows)] = S.vload([0], f"float32x{rows}") + dot(K, Q)
            else:
                S[0] = S[0] + dot(K, Q)

    register_tensor_intrin(name, desc, impl)  # registered already (another load of this module): checked equal
    _REGISTERED.add(name)
    return name


_REGISTERED: set[str] = set()


def _vectorize(sch: s_tir.Schedule, loop, extent: int, lanes: int, unroll: bool = True) -> None:
    if extent == 1:
        return
    if extent <= lanes:
        sch.vectorize(loop)
        return
    outer, inner = sch.split(loop, [None, lanes])
    if unroll:
        sch.unroll(outer)
    sch.vectorize(inner)


def vectorize_in_groups(sch: s_tir.Schedule, spec: AttentionSpec, loop) -> None:
    """Vectorize ``loop`` (head_dim columns of ``PV_gemm``); with per-group scales
    (``kv_scale='group'``) in vectors of one group each, so that each reads its group's scale as
    one broadcast: a vector across groups gathers it (``vpgatherdd`` per vector; a kvcache
    step 2.0-2.2x the per-head scales' on a 2-core znver4, GQA 32:8 D128)."""
    if getattr(spec, "kv_scale", "head") == "group":
        outer, loop = sch.split(loop, [None, SCALE_GROUP])
        sch.unroll(outer)
    sch.vectorize(loop)


def _schedule_pv_dot(sch: s_tir.Schedule, blk, D: int, p_elems: int, pv_rows: int, pv_cols: int) -> None:
    """PV of ``decode_dot`` 2 on ``vdpbf16ps`` (the workload's ``bf16dot.pair_macros`` forms): P
    rounded in full vectors, V's bits copied and its row pairs interleaved 16 columns per
    shuffle (``cpu_bf16.ILV``), then ``PV_gemm`` ``(row block, column block, key pair, rows
    unrolled, column vectors unrolled, [pair, 16 columns])``, one ``cpu_bf16.DP`` per (row, key
    pair, 16 columns): a P pair broadcast against 16 V pairs."""
    L = BF16_LANES
    cpu_bf16.register()
    _vectorize(sch, sch.fuse(*sch.get_loops(blk("P_round"))[-2:]), p_elems, L, unroll=False)
    _vectorize(sch, sch.get_loops(blk("V_load"))[-1], D, 2 * L)
    v_ilv = blk("V_ilv")
    d, t = sch.get_loops(v_ilv)[-2:]
    do, di = sch.split(d, [None, L])
    sch.reorder(do, t, di)
    sch.tensorize(t, cpu_bf16.ILV)
    pv = blk("PV_gemm")
    i, jp, d, t = sch.get_loops(pv)[-4:]
    io, ii = sch.split(i, [None, pv_rows])
    cols = pv_cols or D
    dc, dd = sch.split(d, [None, cols])
    dm, di = sch.split(dd, [None, L])
    sch.reorder(io, dc, jp, ii, dm, t, di)
    sch.tensorize(t, cpu_bf16.DP)
    sch.unroll(ii)
    sch.unroll(dm)


def schedule(sch: s_tir.Schedule, spec: AttentionSpec, suffix: str, knobs: DotDecodeKnobs = DotDecodeKnobs()) -> None:
    """Schedule the decode nest whose blocks carry ``suffix`` (``_dec4``, ``_dec4_split``)."""
    D, DV, L = spec.head_dim, spec.v_dim, knobs.lanes  # QKᵀ's head dim, PV's
    row_tile = sch.get_sblock("row_tile" + suffix)
    bufs = {b.name: b for b in sch.get(row_tile).alloc_buffers}
    rows, block_n = int(bufs["Qt"].shape[1]), int(bufs["S"].shape[0])
    # a tile of several kv heads (the page order): Kt (heads, D), Vt (block_n, heads, D), or
    # with PV on bf16 dots Vb (heads, block_n, D) and Vt (heads, block_n / 2, D, 2); on AMX
    # tiles (decode_dot 6/7: Kb, the staged keys) Kb (heads, block_n, D)
    amx = "Kb" in bufs
    if amx:
        heads = int(bufs["Kb"].shape[0])
    elif "Vb" in bufs:
        heads = int(bufs["Vb"].shape[0]) if len(bufs["Vb"].shape) == 3 else 1
    else:
        heads = int(bufs["Vt"].shape[1]) if "Vt" in bufs else 1
    tile_rows, rows = rows, rows // heads  # rows: per head, what one dot product computes

    def blk(name):
        return sch.get_sblock(name + suffix)

    pv_rows = max(r for r in range(1, min(knobs.pv_rows, rows) + 1) if rows % r == 0)  # in one head
    pv_cols = knobs.pv_cols if knobs.pv_cols and knobs.pv_cols < DV and DV % knobs.pv_cols == 0 else 0

    if amx:
        _schedule_amx_qk(sch, blk, suffix, D, DV)
    else:
        _schedule_dot_qk(sch, blk, suffix, bufs, spec, rows, heads, L)

    # softmax stages: vectors across rows; P_exp over the fused (key, row) loop, full vectors
    for name in ("row_max", "row_sum"):
        b = blk(name)
        j, i = sch.get_loops(b)[-2:]
        _vectorize(sch, i, tile_rows, L)
        sch.decompose_reduction(b, j)
    for name in ("online_correction", "max_commit", "state_init"):
        _vectorize(sch, sch.get_loops(blk(name))[-1], tile_rows, L)
    if has_block(sch, "scale_load" + suffix):
        # per-token scales (an 8-bit cache): one scalar load per (key, kv head), broadcast to the
        # head's rows; vectors across kv heads would gather (vpgatherdd): 1.10-1.28x the per-head
        # scales' step (2-core znver4, GQA 32:8 D128 int8 kvcache, B4 4k / B1 16k / B16 4k)
        i = sch.get_loops(blk("scale_load"))[-1]
        _vectorize(sch, sch.split(i, [heads, rows])[1] if heads > 1 else i, rows, L)
    for name in ("score_mod", "P_exp"):  # score_mod: a variant's (softcap, ALiBi), when there
        if not has_block(sch, name + suffix):
            continue
        j, i = sch.get_loops(blk(name))[-2:]
        if heads > 1:  # a multi-head tile has full vectors of rows: keep the key loop a loop
            _vectorize(sch, i, tile_rows, L)
        else:
            # a loop of full vectors, not unrolled: block_n·rows/lanes copies of the exp
            # polynomial (32 on AVX2 at 64 keys × 4 rows) were 80 % of the lowered IR; rolled, a
            # GQA 32:8 D=128 kvcache build took 7 s instead of 20 and its step ran 1-7 % faster
            # (2-core znver3, fp32/bf16/int8, B4 4k and B1 16k side by side)
            _vectorize(sch, sch.fuse(j, i), block_n * tile_rows, L, unroll=False)

    if "Pq" in bufs:  # decode_dot 6/7 with a bf16 cache: PV on tiles
        _schedule_amx_pv(sch, blk, DV)
    elif "Pb" in bufs:  # decode_dot 2: PV on vdpbf16ps too
        _schedule_pv_dot(sch, blk, DV, block_n * tile_rows, pv_rows, pv_cols)
    else:
        # PV_gemm: (row block, [column block,] key, rows unrolled, columns vectorized)
        pv = blk("PV_gemm")
        i, j, d = sch.get_loops(pv)[-3:]
        io, ii = sch.split(i, [None, pv_rows])
        if pv_cols:
            do, dd = sch.split(d, [None, pv_cols])
            sch.reorder(io, do, j, ii, dd)
            d = dd
        else:
            sch.reorder(io, j, ii, d)
        sch.unroll(ii)
        vectorize_in_groups(sch, spec, d)
        sch.decompose_reduction(pv, j)

    for name in ("acc_init", "O_store"):
        sch.vectorize(sch.get_loops(blk(name))[-1])
    outer = sch.fuse(*sch.get_loops(row_tile))
    sch.parallel(outer)
    if str(bufs["Qt"].dtype) == "uint16" and not amx:  # the LLVM function the dot product calls
        sch.annotate(outer, "pragma_import_llvm", cpu_bf16.DPBF16_IR)


def _schedule_amx_qk(sch: s_tir.Schedule, blk, suffix: str, D: int, DV: int) -> None:
    """QKᵀ of a decode nest on AMX tiles (``decode_dot`` 6/7, :func:`..workloads.amx.decode_products`):
    its ``S_gemm`` blocks are calls; the staged keys (``K_load``) copied in vectors, q's pairs or
    quads (``Q_load``, once per task) left to LLVM, the prefetch unrolled per cache line; an int8
    tile of several kv heads stages its values for the float32 PV (``V_load``) in vectors."""
    for name, n in (("K_load", D), ("V_load", DV)):
        if has_block(sch, name + suffix):
            _vectorize(sch, sch.get_loops(blk(name))[-1], n, BF16_LANES)
    if has_block(sch, "KV_prefetch" + suffix):
        sch.unroll(sch.get_loops(blk("KV_prefetch"))[-1])


def _schedule_amx_pv(sch: s_tir.Schedule, blk, DV: int) -> None:
    """PV of a decode nest on AMX tiles (bf16 queries): V's pair words in 16-lane vectors along its
    rows; ``P_round`` (P transposed to query-major, ``rows × block_n``), the correction (it reads
    what it writes: vectorize refuses it, LLVM vectorizes its contiguous loop) and the
    ``PV_gemm`` calls as they are."""
    _vectorize(sch, sch.get_loops(blk("V_pack"))[-1], DV, BF16_LANES)


def _schedule_dot_qk(sch: s_tir.Schedule, blk, suffix: str, bufs: dict, spec: AttentionSpec, rows: int,
                     heads: int, L: int) -> None:
    """QKᵀ of a decode nest as dot products along head_dim (float32, bf16 or int8: the workload's
    ``Qt`` dtype), one tensor intrinsic per key (and kv head)."""
    D, DV = spec.head_dim, spec.v_dim
    # Q: Qt laid out (rows, D), so a query row is contiguous for the dot product
    q_load = blk("Q_load")
    sch.transform_layout(q_load, ("write", 0), lambda d, i: (i, d))
    d, i = sch.get_loops(q_load)[-2:]
    sch.reorder(i, d)
    _vectorize(sch, d, D, L)

    s_gemm = blk("S_gemm")
    if heads > 1:
        # S_gemm as (key, head, d, row): one dot product per (key, head), on the key's rows of
        # every head that K_load staged just before (the workload nests it in the key loop)
        _, d, i = sch.get_loops(s_gemm)[-3:]
        h, _ = sch.split(i, [heads, rows])
        sch.reorder(h, d)
        if "Pb" not in bufs:  # (PV on bf16 dots stages its values itself: _schedule_pv_dot)
            _vectorize(sch, sch.get_loops(blk("V_load"))[-1], DV, L)

    # K_load: the key tile copied in contiguous vectors (the workload stages it: stage_k)
    _vectorize(sch, sch.get_loops(blk("K_load"))[-1], D, L)
    if has_block(sch, "KV_prefetch" + suffix):  # one prefetch per cache line of a K/V row
        sch.unroll(sch.get_loops(blk("KV_prefetch"))[-1])

    # S_gemm: init hoisted, then each key's (d, row) nest is one dot-product intrinsic
    _, d, _ = sch.get_loops(s_gemm)[-3:]
    init = sch.decompose_reduction(s_gemm, d)
    _vectorize(sch, sch.get_loops(init)[-1], rows, L)
    q_dtype = str(bufs["Qt"].dtype)  # the workload's dot_decode: 1/2 bf16 bits, 3 bytes, else float32
    bf16 = q_dtype == "uint16"
    if q_dtype == "int8" and len(bufs["Ksc"].shape if "Ksc" in bufs else ()) == 3:
        # per-group scales (decode_dot 5): AVX-512 lanes take VNNI's 32-byte form (cpu_fused.decode_dots)
        sch.tensorize(d, dot_i8_group_intrinsic(D, rows, vnni=L == BF16_LANES))
    elif q_dtype == "int8":
        sch.tensorize(d, dot_i8_intrinsic(D, rows, L))
    else:
        sch.tensorize(d, dot_bf16_intrinsic(D, rows) if bf16 else dot_intrinsic(D, rows, L))
