"""Scalar math helpers that build TIR expressions (shared by the workloads)."""
from __future__ import annotations

import math

import tvm
from tvm import tirx

from ..visibility import Visibility

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# Cephes exp2f minimax polynomial for 2**f - 1 = f·P(f) on f in [-0.5, 0.5]; max relative
# error about 2 ulp in float32. Highest degree first.
EXP2_POLY = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
)


#: A degree-4 polynomial for the same ``2**f - 1 = f·P(f)`` (a relative least-squares fit on
#: Chebyshev nodes of [-0.5, 0.5]): relative error 3.1e-6, for a ``2**x`` rounded to bfloat16
#: right after (2**-9 relative), as the AMX form's P is. Two FMAs fewer per vector: 1.02-1.03x a
#: D=128 prefill on tiles (side by side, 10 rounds), where the exponentials are ~20 % of the time.
EXP2_POLY_BF16 = (
    9.60040923526184e-3,
    5.5916977456912875e-2,
    2.4023718625386584e-1,
    6.931219847076987e-1,
)


def exp2_fast(x: tirx.PrimExpr, poly: tuple[float, ...] = EXP2_POLY) -> tirx.PrimExpr:
    """``2**x`` for float32 ``x <= 0`` built from vectorizable arithmetic (``poly``: the
    polynomial's coefficients, highest degree first; :data:`EXP2_POLY_BF16` where the result is
    rounded to bfloat16 next).

    Why not ``T.exp2``: LLVM lowers a vector ``llvm.exp2`` to one libm call per lane, which
    costs more than the two matmuls around it. This version is a range reduction plus a
    degree-6 polynomial and a bit shift, so it vectorizes to a dozen AVX-512 instructions.

    Masking relies on its behaviour at the bottom: ``x`` is clamped to -127, where the
    exponent field ``n + 127`` is 0 and the result is exactly 0.0. So ``exp2_fast(-inf) == 0``
    with no NaN and no libm call. Inputs above 0 are not expected (softmax subtracts the max).

    NaN passes through: the clamp is ``x < -127 ? -127 : x``, which is false for NaN, so a NaN
    reaches the polynomial and the result is NaN (``max(x, -127)`` would compile to
    ``x > -127 ? x : -127`` and turn NaN into 0, silently hiding a NaN in q or k).
    """
    f32 = "float32"
    lo = tirx.const(-127.0, f32)
    # The clamped argument is bound once (a Let): the polynomial reads it 15 times, and written
    # out each time the tree of a masked score grew 30-fold, which TVM's passes walked copy by copy
    # (a paged build's lowering took twice as long). A Let stays in TIR as one value; the
    # workloads make each binding's var unique (``ssa_checked``). ``x`` must hold no bfloat16
    # load: TVM's bfloat16 legalization does not look inside a Let (see ``cast_to``).
    xc = tirx.Var("xc", f32)
    n = tirx.floor(xc + tirx.const(0.5, f32))
    f = xc - n
    p = tirx.const(poly[0], f32)
    for coef in poly[1:]:
        p = p * f + tirx.const(coef, f32)
    p = p * f + tirx.const(1.0, f32)
    bits = tirx.shift_left(tirx.Cast("int32", n) + tirx.const(127, "int32"), tirx.const(23, "int32"))
    return tirx.Let(xc, tirx.Select(x < lo, lo, x), p * tirx.reinterpret(f32, bits))


def tanh_fast(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``tanh(x)`` for float32 ``x`` from :func:`exp2_fast` (vectorizable; LLVM would call libm per
    lane): ``t = 2^(−2·log2(e)·|x|) ∈ [0, 1]``, ``tanh|x| = (1 − t) / (1 + t)``, the sign of ``x``
    restored. Absolute error about 1e-7 (the softcapped logit ``c·tanh(x/c)`` then within
    ``c``·1e-7); ±inf give ±1, NaN stays NaN (``|NaN|`` and the select keep it)."""
    f32 = "float32"
    t = tirx.Var("t", f32)  # bound once, as in exp2_fast
    r = (tirx.const(1.0, f32) - t) / (tirx.const(1.0, f32) + t)
    return tirx.Let(t, exp2_fast(tirx.abs(x) * tirx.const(-2.0 * LOG2E, f32)),
                    tirx.Select(x < tirx.const(0.0, f32), -r, r))


def ssa_checked(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with a var of its own for every binding, checked well-formed.

    :func:`exp2_fast` binds its argument with a Let, and an expression built once may be used
    twice (``with_sink``'s weight scales both ``acc`` and ``l``; a user's score_mod may reuse a
    value), which binds one var in two places. ``ConvertSSA`` renames each later binding; the
    workloads parse their scripts unchecked and check here instead, once every parameter is
    in place. Scheduling can copy a binding again (an inlined block read at two indices), so
    lowering renames once more (``lowering.lower_final``)."""
    mod = tvm.tirx.transform.ConvertSSA()(tvm.IRModule({"main": func}))
    tvm.s_tir.analysis.verify_well_formed(mod)  # what T.prim_func checks of a script
    return mod["main"]


def with_sink(acc: tirx.PrimExpr, l: tirx.PrimExpr, m: tirx.PrimExpr, sink: tirx.PrimExpr):
    """``(acc', l')`` whose ratio is the output of a row with an attention sink: its denominator
    gains ``2^(sink − m)`` (``sink`` in the log2 units of the running max ``m``), both scaled by
    ``2^(g − top)``, ``top = max(g, sink)``, ``g = guarded(m)``, so no exponent is positive."""
    w, e = sink_terms(m, sink)
    return acc * w, l * w + e


def sink_terms(m: tirx.PrimExpr, sink: tirx.PrimExpr):
    """``(w, e)`` of :func:`with_sink`: the row's weight ``2^(g − top)`` and its sink's term
    ``2^(sink − top)``, so that ``(acc·w, l·w + e)`` is the row with its sink. A kernel that writes
    many outputs of one row computes them once per row (each is a polynomial, ``exp2_fast``)."""
    g = guarded(m)
    top = tirx.max(g, sink)
    return exp2_fast(g - top), exp2_fast(sink - top)


def guarded(mx: tirx.PrimExpr) -> tirx.PrimExpr:
    """The reference max for a row's exponentials: ``mx``, or 0 while the row has seen no
    visible key (``mx == -inf``), so ``exp2(-inf - ref)`` is 0 rather than ``exp2(-inf + inf)``
    = NaN."""
    neg_inf = tirx.const(float("-inf"), "float32")
    return tirx.Select(mx == neg_inf, tirx.const(0.0, "float32"), mx)


def normalize(acc: tirx.PrimExpr, l: tirx.PrimExpr, row: tirx.PrimExpr, spec) -> tirx.PrimExpr:
    """The output ``acc / l`` of query row ``row``, or 0 for a row that sees no key.

    Whether a row sees a key is a fact of the mask (``Visibility.sees_a_key``), not of ``l``: ``l`` is also 0 when every visible score overflowed to -inf, and NaN
    when an input was NaN; those rows must come out NaN (``0/0``, ``x/NaN``), as in the float64
    reference and torch, so that a zero row keeps meaning one thing: it saw no key.
    """
    vis = Visibility.of(spec)
    off = vis.offset(spec.seq_q, spec.seq_kv)
    if vis.hides_keys and off < 0:  # static lengths: only then may a row see no key
        return tirx.Select(vis.sees_a_key(vis.position(row, off), spec.seq_kv), acc / l, tirx.const(0.0, "float32"))
    return acc / l


def normalize_where(acc: tirx.PrimExpr, l: tirx.PrimExpr, sees_key: tirx.PrimExpr) -> tirx.PrimExpr:
    """``acc / l`` where ``sees_key`` (a fact of the mask and the lengths, known only at run time
    for symbolic lengths), else 0; NaN passes through as in :func:`normalize`."""
    return tirx.Select(sees_key, acc / l, tirx.const(0.0, "float32"))


def normalize_seen(acc: tirx.PrimExpr, l: tirx.PrimExpr, keys_sum: tirx.PrimExpr) -> tirx.PrimExpr:
    """``acc / l``, or 0 where the keys' sum ``keys_sum`` is 0: under user modifiers (a mask on
    data, a score that may be -inf) a row saw no key when every score it met was -inf. The test
    is ``== 0`` (ordered): a NaN sum is not 0, so NaN passes through to the output."""
    return tirx.Select(keys_sum == tirx.const(0.0, "float32"), tirx.const(0.0, "float32"), acc / l)


def lse_of(m: tirx.PrimExpr, l: tirx.PrimExpr) -> tirx.PrimExpr:
    """A row's natural log-sum-exp from the online state: ``m`` (running max, log2 units of the
    scaled scores) and ``l`` (sum of ``2**(s - guarded(m))``): ``(guarded(m) + log2(l))·ln 2``.
    A row that saw no key has ``l = 0``: ``-inf``; NaN passes through."""
    return (guarded(m) + tirx.log2(l)) * tirx.const(LN2, "float32")


def f32(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``x`` as float32 (a load of a half-precision input; a float32 one unchanged, so float32
    kernels are exactly what they were)."""
    dtype = str(x.dtype if hasattr(x, "dtype") else x.ty)  # a buffer load in TVMScript: .ty
    return x if dtype == "float32" else tirx.Cast("float32", x)


def cast_to(buf, x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``x`` (float32) rounded to ``buf``'s dtype for a store (unchanged for float32).

    bfloat16 is rounded here (:func:`bf16_bits`, nearest even) from ``x`` bound once. TVM would
    legalize a bfloat16 cast into the same integer rounding, writing ``x`` out twice; a Let
    inside ``x`` (``exp2_fast``'s, a sink's weight) then bound one var twice, which its
    vectorizer refuses. ``x`` holds no bfloat16 load: TVM 0.27's ``BF16ComputeLegalize`` leaves
    a Let's value as it is, and would not widen it."""
    dtype = str(buf.dtype)
    if dtype == "float32":
        return x
    if dtype != "bfloat16":
        return tirx.Cast(dtype, x)
    v = tirx.Var("o", "float32")
    return tirx.reinterpret("bfloat16", tirx.Let(v, x, bf16_bits(v)))


def bf16_value(bits: tirx.PrimExpr) -> tirx.PrimExpr:
    """The float32 value of bfloat16 ``bits`` (uint16): the upper half of a float32. How the
    bf16 dot-product blocks spell their operands (the tensor intrinsics' descriptions match it)."""
    return tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("uint32", bits), tirx.const(16, "uint32")))


def bf16_bits(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """float32 ``x`` rounded to bfloat16 (to nearest, ties to even), as uint16 bits. A NaN stays
    a NaN (its quiet bit survives the carry); softmax probabilities are never infinite."""
    b = tirx.reinterpret("uint32", x)
    u16 = tirx.const(16, "uint32")
    rounded = b + tirx.const(0x7FFF, "uint32") + tirx.bitwise_and(tirx.shift_right(b, u16), tirx.const(1, "uint32"))
    return tirx.Cast("uint16", tirx.shift_right(rounded, u16))


def bf16_pair_word(lo: tirx.PrimExpr, hi: tirx.PrimExpr) -> tirx.PrimExpr:
    """float32 ``lo`` and ``hi`` rounded to bfloat16 as :func:`bf16_bits` does, packed into one
    uint32 word (``lo`` in the low half): a bf16 pair made in 32-bit lanes, with no 16-bit
    shuffle (the AMX form's P pairs, ``amx.tile_products``)."""
    u16, one, half = tirx.const(16, "uint32"), tirx.const(1, "uint32"), tirx.const(0x7FFF, "uint32")

    def rounded(x):  # the bf16 value in the upper half, garbage below
        b = tirx.reinterpret("uint32", x)
        return b + half + tirx.bitwise_and(tirx.shift_right(b, u16), one)

    return tirx.bitwise_or(tirx.bitwise_and(rounded(hi), tirx.const(0xFFFF0000, "uint32")),
                           tirx.shift_right(rounded(lo), u16))


def bf16_exact_bits(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """The bfloat16 bits (uint16) of a float32 ``x`` that bf16 holds exactly (an int8, e4m3 or
    e5m2 value, a bf16 input widened): its upper half, no rounding (:func:`bf16_bits` would add
    three integer operations per element that change nothing)."""
    return tirx.Cast("uint16", tirx.shift_right(tirx.reinterpret("uint32", x), tirx.const(16, "uint32")))


#: What :func:`kv_to_f32` with ``unit=False`` leaves out of an 8-bit dtype's value: a kernel folds
#: it into the scales (once per query element and output) instead of once per cache element
KV_UNIT = {"float8_e4m3fn": 256.0}


def kv_to_f32(x: tirx.PrimExpr, kv_dtype: str, unit: bool = True) -> tirx.PrimExpr:
    """The float32 value of one stored 8-bit K/V element ``x`` (before its scale), without a table
    or a libm call, in a few vector instructions:

    * ``int8``: sign-extend and convert (``x`` is the int8 element);
    * ``float8_e5m2`` (``x`` the element's bits as uint8): the upper byte of the float16 of the
      same value (5 exponent bits, bias 15, its subnormals, inf and NaN alike), so ``x << 8``
      read as float16 and widened (``vcvtph2ps``, F16C: every x86-64 CPU we target);
    * ``float8_e4m3fn``: sign-extended to 16 bits and shifted left by 7, its magnitude bits lie
      under float16's exponent field and a copy of its sign in bit 15 (``& 0xBF80`` clears the
      rest): a float16 of the value times 2^-8 (exponent bias 15 against 7; subnormals map to
      float16 subnormals), widened, then times 2^8 (``unit``: else left to the caller,
      :data:`KV_UNIT`); ``0x7F``/``0xFF`` are NaN (e4m3fn has no inf), selected apart.

    Measured (2-core znver4, one thread, GQA 32:8 D=128 decode step from L2, G elements/s):
    the integer rebias these replaced (select, shift, add, convert, or per vector) ran e4m3fn at
    4.8 and e5m2 at about the same, against int8's 7.4."""
    f16, u16 = "float16", "uint16"
    if kv_dtype == "int8":
        return tirx.Cast("float32", x)
    if kv_dtype == "float8_e5m2":
        return tirx.Cast("float32", tirx.reinterpret(f16, tirx.shift_left(tirx.Cast(u16, x), tirx.const(8, u16))))
    sx = tirx.reinterpret(u16, tirx.Cast("int16", tirx.reinterpret("int8", x)))  # sign-extended
    h = tirx.bitwise_and(tirx.shift_left(sx, tirx.const(7, u16)), tirx.const(0xBF80, u16))
    value = tirx.Cast("float32", tirx.reinterpret(f16, h))
    if unit:
        value = value * tirx.const(KV_UNIT[kv_dtype], "float32")
    nan = tirx.bitwise_and(x, tirx.const(0x7F, "uint8")) == tirx.const(0x7F, "uint8")
    return tirx.Select(nan, tirx.const(float("nan"), "float32"), value)


#: (largest finite magnitude, smallest normal, rounding shift: the float32 mantissa bits dropped)
#: of the 8-bit K/V dtypes a kernel writes (appended keys; tvm_attention.quant.QMAX)
_FP8_WRITE = {"float8_e4m3fn": (448.0, 2.0 ** -6, 20), "float8_e5m2": (57344.0, 2.0 ** -14, 21)}


def f32_to_kv(x: tirx.PrimExpr, kv_dtype: str) -> tirx.PrimExpr:
    """``x`` (float32, already divided by its scale) as a stored 8-bit K/V element, rounded to
    nearest even and saturated at the format's largest finite magnitude, exactly as
    :func:`tvm_attention.quant.quantize_kv` (NumPy's ``clip`` then ml_dtypes' cast) does; TVM's
    plain cast would wrap 500 to -0.0 in e4m3fn. float8 results are the element's bits (uint8):
    a normal number rounds float32's mantissa by adding ``2^(shift-1) - 1`` plus its last kept bit
    and rebiases the exponent; a subnormal is ``round(|x| / 2^(emin - mbits))``, rounded by adding
    2^23 in float32 (its unit in the last place is then 1); NaN stays NaN (ml_dtypes' pattern,
    or-ed with the sign). int8 (symmetric): ``round(clamp(x, ±127))`` by the 1.5·2^23 addition; an int8 cache
    has no NaN (the library refuses one in ``k_new``/``v_new`` before this runs)."""
    f32, u32 = "float32", "uint32"
    if kv_dtype == "int8":
        y = tirx.Select(x > tirx.const(127.0, f32), tirx.const(127.0, f32),
                        tirx.Select(x < tirx.const(-127.0, f32), tirx.const(-127.0, f32), x))
        return tirx.Cast("int8", tirx.Cast("int32", tirx.nearbyint(y)))  # ties to even (vroundps)
    qmax, smallest, shift = _FP8_WRITE[kv_dtype]
    mbits = 23 - shift
    bias_gap = {"float8_e4m3fn": 127 - 7, "float8_e5m2": 127 - 15}[kv_dtype]
    bits = tirx.reinterpret(u32, x)
    sign = tirx.shift_right(tirx.bitwise_and(bits, tirx.const(0x80000000, u32)), tirx.const(24, u32))
    a = tirx.reinterpret(f32, tirx.bitwise_and(bits, tirx.const(0x7FFFFFFF, u32)))
    a = tirx.Select(a > tirx.const(qmax, f32), tirx.const(qmax, f32), a)  # NaN is kept (ordered compare)
    u = tirx.reinterpret(u32, a)
    rounded = u + tirx.const((1 << (shift - 1)) - 1, u32) + tirx.bitwise_and(
        tirx.shift_right(u, tirx.const(shift, u32)), tirx.const(1, u32))
    normal = tirx.shift_right(rounded, tirx.const(shift, u32)) - tirx.const(bias_gap << mbits, u32)
    # |x| below the smallest normal: the count of the smallest subnormal, 2^(1 - bias - mbits)
    scaled = a * tirx.const(2.0 ** (mbits - math.log2(smallest)), f32) + tirx.const(8388608.0, f32)
    sub = tirx.bitwise_and(tirx.reinterpret(u32, scaled), tirx.const(0x7FFFFF, u32))
    em = tirx.Select(a < tirx.const(smallest, f32), sub, normal)
    nan = 0x7F if kv_dtype == "float8_e4m3fn" else 0x7E  # ml_dtypes' NaN of each format
    em = tirx.Select(tirx.isnan(x), tirx.const(nan, u32), em)
    return tirx.Cast("uint8", tirx.bitwise_or(em, sign))
