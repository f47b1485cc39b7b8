"""The fused kernel's products on Intel AMX tiles (``dot_bf16`` 2), and their emulation (3).

AMX adds eight tile registers of up to 16 rows × 64 bytes and ``tdpbf16ps C, A, B``:
``C[m][n] += Σ_k A[m][2k]·B[k][n][0] + A[m][2k+1]·B[k][n][1]`` for a 16 × 16 float32 ``C``, a
16 × 32 bf16 ``A`` and a ``B`` of 16 rows of 16 bf16 *pairs* (the "VNNI" packing: the reduction
dim pairs up inside a row). One instruction is 8192 multiply-adds; on a Sapphire Rapids core it
runs about 14× the FMA peak (``../shared/TVM_NOTES.md``, "Intel AMX").

The tile keeps the score tile key-major (``S (BN, BM)``, as every form of the fused kernel:
the softmax stays the fp32 vector code it is), so both products read operands the bf16
dot-product form already stages (:mod:`.bf16dot`), and only P changes its layout:

* ``S = K·Qᵀ``: ``C`` = 16 keys × 16 query rows of ``S`` (row stride ``BM`` floats), ``A`` = 16
  key rows × 32 of head_dim as stored (no packing): read in place from K where consecutive
  keys' rows are one stride apart and the tile lies inside the sequence (:func:`key_stride`),
  else from the staged key tile ``Kb (BN, D)``; ``B`` = ``Qp (D/2, BM, 2)``, q's pairs along
  head_dim, made once per row tile.
* ``acc += P·V``: ``C`` = 16 query rows × 16 columns of ``acc (BM, DV)`` (row stride ``DV``
  floats), ``A`` = ``Pq (BM, BN)``, P rounded to bf16 and paired along the keys into 32-bit
  words (block ``P_pack``: ``Pb (BN/2, BM)`` words, made in 32-bit lanes in the softmax's pass,
  one key pair at a time, where the dot-product form rounds, then interleaves 16-bit halves),
  then transposed to query-major
  16 × 16 words at a time in registers (block ``P_tr``), ``B`` = ``Vt (BN/2, DV)``, V's pairs
  along the keys as 32-bit words read from the cache in one pass (block ``V_pack``, where the
  dot-product form copies the value tile, then interleaves 16-bit halves). The
  correction is lazy (``LAZY_GAP`` in ``fused.py``): ``acc`` is rescaled only in the tiles that
  move some row's reference max.

One call of the micro-kernel :data:`MM` computes a 32 × 32 block of ``C`` (four tiles: two
``A`` and two ``B`` tiles loaded per 32-deep step of the reduction, each used twice) over the
whole reduction (``ksteps`` steps), starting from zero (``S``) or from ``C`` (``accT``).

Per thread, AMX needs its tile configuration loaded (``ldtilecfg``) before the first tile
instruction: block ``tile_config`` of every row tile does it (a parallel task may run on any
pool thread), and ``tile_release`` gives the state back at the tile's end. Per process, Linux
grants the tile state only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``;
without it the first tile instruction is SIGILL): :func:`permit_prologue` makes the exported
function ask before any parallel loop and raise a ValueError if the kernel refuses, so a C++
caller needs nothing and never sees a signal. The functions are LLVM IR text (:data:`IR`,
imported with ``pragma_import_llvm``): TVM 0.27 has no AMX intrinsics; LLVM inlines them.

The emulated form (``dot_bf16`` 3) runs the same instruction sequence on plain TIR: the same
buffers, packing, tile order and addresses (element offsets and row strides computed as the real
form computes its pointers), with "tile registers" in local buffers, so that layout and
addressing are validated on any host. Its sums are float32 in another order than the hardware's:
it matches the reference, not the real form bit for bit.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T
from tvm.sym.analyzer import Analyzer

from ._math import bf16_bits, bf16_value

#: rows of a tile, and of a ``C`` tile's float32 columns
TILE = 16
#: bf16 elements of the reduction one ``tdpbf16ps`` takes (a 64-byte ``A`` row)
KSTEP = 32
#: the micro-kernel's block of ``C`` (2 × 2 tiles): block_m, block_n, head_dim and V's head_dim
#: are multiples of it
BLOCK = 32
#: ``dot_bf16`` values of the two forms
REAL, EMULATED = 2, 3

PERMIT, BEGIN, END, MM, TR = "tvma_amx_permit", "tvma_amx_begin", "tvma_amx_end", "tvma_amx_mm_bf16", "tvma_tr32_16x16"
#: rows and columns of one transpose (32-bit words)
TR_WORDS = 16


def _transpose_ir() -> str:
    """``tvma_tr32_16x16(y, ys, x, xs)``: ``y[c][r] = x[r][c]`` for a 16 × 16 block of 32-bit
    words (row strides in bytes), in four stages of two-input shuffles: stage ``b`` swaps bit
    ``b`` of the row index with bit ``b`` of the column index (64 shuffles, which LLVM lowers to
    ``vpermt2d``-class instructions, no target features of its own)."""
    lines = [f"define linkonce_odr i32 @{TR}(ptr %yb, i64 %yo, i64 %ys, ptr %xb, i64 %xo, i64 %xs) {{",
             "  %y = getelementptr i8, ptr %yb, i64 %yo", "  %x = getelementptr i8, ptr %xb, i64 %xo"]
    for r in range(TR_WORDS):
        lines += [f"  %xo{r} = mul i64 %xs, {r}", f"  %xp{r} = getelementptr i8, ptr %x, i64 %xo{r}",
                  f"  %s0_{r} = load <16 x i32>, ptr %xp{r}, align 4"]
    for st, b in enumerate((1, 2, 4, 8)):
        for r0 in (r for r in range(TR_WORDS) if not r & b):
            r1 = r0 | b
            m0 = ", ".join(f"i32 {TR_WORDS + (c & ~b) if c & b else c}" for c in range(TR_WORDS))
            m1 = ", ".join(f"i32 {TR_WORDS + c if c & b else c | b}" for c in range(TR_WORDS))
            for r, m in ((r0, m0), (r1, m1)):
                lines.append(f"  %s{st + 1}_{r} = shufflevector <16 x i32> %s{st}_{r0}, <16 x i32> %s{st}_{r1}, "
                             f"<16 x i32> <{m}>")
    for r in range(TR_WORDS):
        lines += [f"  %yo{r} = mul i64 %ys, {r}", f"  %yp{r} = getelementptr i8, ptr %y, i64 %yo{r}",
                  f"  store <16 x i32> %s4_{r}, ptr %yp{r}, align 4"]
    return "\n".join(lines + ["  ret i32 0", "}"]) + "\n"

def _cfg(tiles) -> str:
    """A palette-1 tile config (LLVM IR string bytes): ``tiles`` ``(rows, bytes per row)`` for
    tiles 0..7."""
    colsb = "".join(f"\\{c & 255:02x}\\{c >> 8:02x}" for _, c in tiles)
    rows = "".join(f"\\{r:02x}" for r, _ in tiles)
    return "\\01" + "\\00" * 15 + colsb + "\\00" * 16 + rows + "\\00" * 8


# Tile registers of the micro-kernel: C 0-3 (2 × 2), A 4-5, B 6-7. The config: palette 1, every
# tile 16 rows × 64 bytes (the only shape the kernel uses: one config for all of it).
_CFG = _cfg([(TILE, 64)] * 8)

#: what every AMX function text declares: the intrinsics and the permission (once per process)
_BASE_IR = r'''
declare void @llvm.x86.ldtilecfg(ptr)
declare void @llvm.x86.tilerelease()
declare void @llvm.x86.tilezero(i8)
declare void @llvm.x86.tileloadd64(i8, ptr, i64)
declare void @llvm.x86.tilestored64(i8, ptr, i64)
declare void @llvm.x86.tdpbf16ps(i8, i8, i8)

@tvma_amx_cfg = linkonce_odr constant [64 x i8] c"''' + _CFG + r'''", align 64
; 1: not asked yet; else what arch_prctl returned (0 granted, -errno refused). Racing writers
; store the same value.
@tvma_amx_state = linkonce_odr global i64 1, align 8

; arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18), asked once per process
define linkonce_odr i32 @tvma_amx_permit() {
entry:
  %s = load i64, ptr @tvma_amx_state, align 8
  %asked = icmp ne i64 %s, 1
  br i1 %asked, label %done, label %ask
ask:
  %r = call i64 asm sideeffect "syscall", "={rax},{rax},{rdi},{rsi},~{rcx},~{r11},~{memory}"(i64 158, i64 4131, i64 18)
  store i64 %r, ptr @tvma_amx_state, align 8
  br label %done
done:
  %v = phi i64 [%s, %entry], [%r, %ask]
  %t = trunc i64 %v to i32
  ret i32 %t
}

; the tile state given back at a task's end
define linkonce_odr i32 @tvma_amx_end() "target-features"="+amx-tile" {
  call void @llvm.x86.tilerelease()
  ret i32 0
}

'''

#: The AMX functions. linkonce_odr: a module whose nests each import it keeps one copy.
IR = _BASE_IR + r'''
; a thread's tile configuration (each row tile loads it: its task may run on any pool thread)
define linkonce_odr i32 @tvma_amx_begin() #0 {
  %p = call i32 @tvma_amx_permit()
  call void @llvm.x86.ldtilecfg(ptr @tvma_amx_cfg)
  ret i32 %p
}

; C[0:32, 0:32] (+)= A[0:32, 0:32·ksteps] · B, B in pairs: rows k/2, 32 columns of pairs. Each
; operand is its buffer's base and a byte offset; strides in bytes; C float32, A and B bf16.
; zero: start from 0 (else from C).
define linkonce_odr i32 @tvma_amx_mm_bf16(ptr %cb, i64 %co, i64 %cs, ptr %ab, i64 %ao0, i64 %as, ptr %bb, i64 %bo0,
                                          i64 %bs, i64 %ksteps, i32 %zero) #0 {
entry:
  %c = getelementptr i8, ptr %cb, i64 %co
  %a = getelementptr i8, ptr %ab, i64 %ao0
  %b = getelementptr i8, ptr %bb, i64 %bo0
  %c1 = getelementptr i8, ptr %c, i64 64
  %c16 = mul i64 %cs, 16
  %c2 = getelementptr i8, ptr %c, i64 %c16
  %c3 = getelementptr i8, ptr %c2, i64 64
  %a16 = mul i64 %as, 16
  %b16 = mul i64 %bs, 16
  %z = icmp ne i32 %zero, 0
  br i1 %z, label %clear, label %load
clear:
  call void @llvm.x86.tilezero(i8 0)
  call void @llvm.x86.tilezero(i8 1)
  call void @llvm.x86.tilezero(i8 2)
  call void @llvm.x86.tilezero(i8 3)
  br label %loop
load:
  call void @llvm.x86.tileloadd64(i8 0, ptr %c, i64 %cs)
  call void @llvm.x86.tileloadd64(i8 1, ptr %c1, i64 %cs)
  call void @llvm.x86.tileloadd64(i8 2, ptr %c2, i64 %cs)
  call void @llvm.x86.tileloadd64(i8 3, ptr %c3, i64 %cs)
  br label %loop
loop:
  %k = phi i64 [0, %clear], [0, %load], [%kn, %loop]
  %ao = mul i64 %k, 64
  %a0 = getelementptr i8, ptr %a, i64 %ao
  %a1 = getelementptr i8, ptr %a0, i64 %a16
  %bo = mul i64 %k, %b16
  %b0 = getelementptr i8, ptr %b, i64 %bo
  %b1 = getelementptr i8, ptr %b0, i64 64
  ; each operand loaded just before the first product that needs it (the other tiles' products
  ; run meanwhile): 1.05x a D=128 prefill over the four loads first (side by side, 12 rounds)
  call void @llvm.x86.tileloadd64(i8 4, ptr %a0, i64 %as)
  call void @llvm.x86.tileloadd64(i8 6, ptr %b0, i64 %bs)
  call void @llvm.x86.tdpbf16ps(i8 0, i8 4, i8 6)
  call void @llvm.x86.tileloadd64(i8 7, ptr %b1, i64 %bs)
  call void @llvm.x86.tdpbf16ps(i8 1, i8 4, i8 7)
  call void @llvm.x86.tileloadd64(i8 5, ptr %a1, i64 %as)
  call void @llvm.x86.tdpbf16ps(i8 2, i8 5, i8 6)
  call void @llvm.x86.tdpbf16ps(i8 3, i8 5, i8 7)
  %kn = add i64 %k, 1
  %more = icmp ult i64 %kn, %ksteps
  br i1 %more, label %loop, label %store
store:
  call void @llvm.x86.tilestored64(i8 0, ptr %c, i64 %cs)
  call void @llvm.x86.tilestored64(i8 1, ptr %c1, i64 %cs)
  call void @llvm.x86.tilestored64(i8 2, ptr %c2, i64 %cs)
  call void @llvm.x86.tilestored64(i8 3, ptr %c3, i64 %cs)
  ret i32 0
}
attributes #0 = { "target-features"="+amx-tile,+amx-bf16,+avx512f" }
''' + _transpose_ir()


#: ``dot_decode`` values of the decode nests' tile form, real and emulated: QKᵀ on tiles
#: (``tdpbf16ps`` for bf16 q and cache, ``tdpbssd`` for ``qk_int8``'s bytes), PV too with bf16
#: queries (an int8 cache's values widened to bf16; float32 queries keep the float32 PV)
DECODE_REAL, DECODE_EMULATED = 6, 7
#: a decode tile's most rows per kv head: the 16 rows of a tile (its columns in ``S``'s key-major tile)
DECODE_ROWS = 16


def decode_names(R: int) -> tuple[str, str, str, str]:
    """The decode functions of an ``R``-row kv head (:func:`decode_ir`): config, ``S`` on bf16,
    ``S`` on int8, ``PV``."""
    return tuple(f"tvma_amx_d{R}_{n}" for n in ("begin", "s_bf16", "s_i8", "pv"))


def decode_ir(R: int) -> str:
    """The decode nests' tile functions for ``R`` rows per kv head (1..16): ``S`` is key-major as in
    every nest, so its ``C`` tiles are 16 keys × ``R`` rows and q is the ``B`` operand, ``R``
    columns of pairs (bf16) or quads (int8); ``PV``'s ``C`` tiles are ``R`` rows × 16 columns of
    acc. One config serves both (tiles 0-1 ``S``'s C, 2 q, 3 and 7 the 16 × 64-byte operands: K
    for ``S``, V's words for ``PV``; 4-5 ``PV``'s C, 6 P), loaded by ``begin`` once per task.

    * ``s_bf16(S, so, ss, K, ko, ko1, ks, Q, qo, qs, ksteps)``: ``S[0:32, 0:R] = K[0:32,
      0:32·ksteps] · Q``, K's rows as stored (stride ``ks`` bytes; keys 16-31 from ``ko1``: a paged
      cache's next block may lie in another page), Q ``(D/2, ·, 2)`` pairs (stride ``qs``).
    * ``s_i8``: the same on int8 (``tdpbssd``, 64 of head_dim a step, Q ``(D/4, ·, 4)``), the int32
      sums then converted to float32 in place (exact: ``|Σ| ≤ 127²·head_dim < 2**24``).
    * ``pv(C, co, cs, P, po, ps, V, vo, vs, ksteps)``: ``C[0:R, 0:32] += P[0:R, 0:32·ksteps] · V``,
      V's pairs along the keys as words (stride ``vs``)."""
    begin, s_bf16, s_i8, pv = decode_names(R)
    cfg = _cfg([(16, 4 * R)] * 3 + [(16, 64)] + [(R, 64)] * 3 + [(16, 64)])

    def s_fn(name, op, attr, a_step):
        conv = []
        if op == "tdpbssd":  # the int32 sums as float32, row by row (R lanes)
            for r in range(32):
                conv += [f"  %ro{r} = mul i64 %cs, {r}", f"  %rp{r} = getelementptr i8, ptr %c, i64 %ro{r}",
                         f"  %ri{r} = load <{R} x i32>, ptr %rp{r}, align 4",
                         f"  %rf{r} = sitofp <{R} x i32> %ri{r} to <{R} x float>",
                         f"  store <{R} x float> %rf{r}, ptr %rp{r}, align 4"]
        return "\n".join([
            (f"define linkonce_odr i32 @{name}(ptr %cb, i64 %co, i64 %cs, ptr %ab, i64 %ao, i64 %ao1, i64 %as, "
             f"ptr %bb, i64 %bo, i64 %bs, i64 %ksteps) {attr} {{"),
            "entry:", "  %c = getelementptr i8, ptr %cb, i64 %co", "  %a = getelementptr i8, ptr %ab, i64 %ao",
            "  %ah = getelementptr i8, ptr %ab, i64 %ao1",
            "  %b = getelementptr i8, ptr %bb, i64 %bo", "  %c16 = mul i64 %cs, 16",
            "  %c1 = getelementptr i8, ptr %c, i64 %c16", "  %b16 = mul i64 %bs, 16",
            "  call void @llvm.x86.tilezero(i8 0)", "  call void @llvm.x86.tilezero(i8 1)", "  br label %loop",
            "loop:", "  %k = phi i64 [0, %entry], [%kn, %loop]", f"  %kao = mul i64 %k, {a_step}",
            "  %a0 = getelementptr i8, ptr %a, i64 %kao", "  %a1 = getelementptr i8, ptr %ah, i64 %kao",
            "  %kbo = mul i64 %k, %b16", "  %b0 = getelementptr i8, ptr %b, i64 %kbo",
            "  call void @llvm.x86.tileloadd64(i8 2, ptr %b0, i64 %bs)",
            "  call void @llvm.x86.tileloadd64(i8 3, ptr %a0, i64 %as)",
            f"  call void @llvm.x86.{op}(i8 0, i8 3, i8 2)",
            "  call void @llvm.x86.tileloadd64(i8 7, ptr %a1, i64 %as)",
            f"  call void @llvm.x86.{op}(i8 1, i8 7, i8 2)",
            "  %kn = add i64 %k, 1", "  %more = icmp ult i64 %kn, %ksteps",
            "  br i1 %more, label %loop, label %store", "store:",
            "  call void @llvm.x86.tilestored64(i8 0, ptr %c, i64 %cs)",
            "  call void @llvm.x86.tilestored64(i8 1, ptr %c1, i64 %cs)"] + conv + ["  ret i32 0", "}"])

    pv_fn = "\n".join([
        (f"define linkonce_odr i32 @{pv}(ptr %cb, i64 %co, i64 %cs, ptr %ab, i64 %ao, i64 %as, ptr %bb, i64 %bo, "
         "i64 %bs, i64 %ksteps) #0 {"),
        "entry:", "  %c = getelementptr i8, ptr %cb, i64 %co", "  %a = getelementptr i8, ptr %ab, i64 %ao",
        "  %b = getelementptr i8, ptr %bb, i64 %bo", "  %c1 = getelementptr i8, ptr %c, i64 64",
        "  %b16 = mul i64 %bs, 16",
        "  call void @llvm.x86.tileloadd64(i8 4, ptr %c, i64 %cs)",
        "  call void @llvm.x86.tileloadd64(i8 5, ptr %c1, i64 %cs)", "  br label %loop",
        "loop:", "  %k = phi i64 [0, %entry], [%kn, %loop]", "  %kao = mul i64 %k, 64",
        "  %a0 = getelementptr i8, ptr %a, i64 %kao", "  %kbo = mul i64 %k, %b16",
        "  %b0 = getelementptr i8, ptr %b, i64 %kbo", "  %b1 = getelementptr i8, ptr %b0, i64 64",
        "  call void @llvm.x86.tileloadd64(i8 6, ptr %a0, i64 %as)",
        "  call void @llvm.x86.tileloadd64(i8 3, ptr %b0, i64 %bs)",
        "  call void @llvm.x86.tdpbf16ps(i8 4, i8 6, i8 3)",
        "  call void @llvm.x86.tileloadd64(i8 7, ptr %b1, i64 %bs)",
        "  call void @llvm.x86.tdpbf16ps(i8 5, i8 6, i8 7)",
        "  %kn = add i64 %k, 1", "  %more = icmp ult i64 %kn, %ksteps",
        "  br i1 %more, label %loop, label %store", "store:",
        "  call void @llvm.x86.tilestored64(i8 4, ptr %c, i64 %cs)",
        "  call void @llvm.x86.tilestored64(i8 5, ptr %c1, i64 %cs)", "  ret i32 0", "}"])
    return "\n".join([
        _BASE_IR, "declare void @llvm.x86.tdpbssd(i8, i8, i8)",
        f'@tvma_amx_dcfg{R} = linkonce_odr constant [64 x i8] c"{cfg}", align 64',
        f"define linkonce_odr i32 @{begin}() #0 {{", "  %p = call i32 @tvma_amx_permit()",
        f"  call void @llvm.x86.ldtilecfg(ptr @tvma_amx_dcfg{R})", "  ret i32 %p", "}",
        s_fn(s_bf16, "tdpbf16ps", "#0", 64), s_fn(s_i8, "tdpbssd", "#1", 64), pv_fn,
        'attributes #0 = { "target-features"="+amx-tile,+amx-bf16,+avx512f" }',
        'attributes #1 = { "target-features"="+amx-tile,+amx-int8,+avx512f" }', ""])


def fits(BM: int, BN: int, D: int, DV: int) -> str | None:
    """Why a tile of ``BM`` rows and ``BN`` keys, head dims ``D``/``DV``, cannot take the AMX
    form (None: it can): the micro-kernel's 32 × 32 blocks tile every dim."""
    bad = {n: v for n, v in (("block_m", BM), ("block_n", BN), ("head_dim", D), ("head_dim_v", DV)) if v % BLOCK}
    if bad:
        return "the AMX form tiles in blocks of 32: " + ", ".join(f"{n}={v}" for n, v in bad.items())
    return None


def decode_fits(spec, BM: int, BN: int, HT: int) -> str | None:
    """Why a decode tile of ``BM`` rows over ``HT`` kv heads and ``BN`` keys cannot take the
    tiles (:func:`decode_products`; None: it can): bf16 q and cache (head dims in 32s) or
    ``qk_int8`` with per-head or per-token scales (head_dim in 64s; PV on tiles with bf16 q, V's
    head dim in 32s), key tiles in 32s, at most :data:`DECODE_ROWS` rows per kv head."""
    int8 = spec.qk_int8 and getattr(spec, "kv_scale", "head") != "group"
    if not (int8 or (spec.dtype == "bfloat16" and not spec.kv_quantized)):
        return (f"multiplies bfloat16 q and cache, or qk_int8's bytes with per-head or per-token scales: "
                f"dtype={spec.dtype}, kv_dtype={spec.kv_dtype}, qk_int8={spec.qk_int8}")
    step = DECODE_KSTEP[int8]
    bad = [f"{n}={v}" for n, v, w in (("head_dim", spec.head_dim, step), ("head_dim_v", spec.v_dim, KSTEP if spec.dtype == "bfloat16" else 0),
                                      ("block_n", BN, BLOCK)) if w and v % w]
    if bad:
        return f"tiles head dims in {step}s and keys in {BLOCK}s: " + ", ".join(bad)
    if BM % HT or BM // HT > DECODE_ROWS:
        return f"takes at most {DECODE_ROWS} rows per kv head: {BM} rows over {HT} kv heads"
    return None


def permit_prologue(message: str) -> tirx.Stmt:
    """The exported function's first statement: AMX permission asked (once per process; a serial
    prologue, since an assert inside a parallel loop is dropped), a ValueError if refused."""
    granted = tirx.EQ(tirx.call_extern("int32", PERMIT), tirx.IntImm("int32", 0))
    return tirx.AssertStmt(granted, tvm.ir.StringImm("ValueError"), [tvm.ir.StringImm(message)])


#: the emulated tile registers' (shape, dtype): C 0-3, A 4-5, B 6-7 of the real kernel
REGS = (((4, TILE, TILE), "float32"), ((2, TILE, KSTEP), "uint16"), ((2, TILE, KSTEP), "uint16"))


def emulated_registers() -> tuple:
    """The emulated form's tile registers (:data:`REGS`), local buffers of the row tile's block
    (called where its buffers are allocated)."""
    return tuple(T.sblock_alloc_buffer(shape, dtype, scope="local") for shape, dtype in REGS)


def _unravel(buf, off):
    """``buf``'s element at flat (row-major) element offset ``off``."""
    idx, rest = [], off
    for n in reversed(list(buf.shape)):
        idx.append(T.floormod(rest, n))
        rest = T.floordiv(rest, n)
    return tuple(reversed(idx))


def _bytes(buf) -> int:
    """Bytes of one element of ``buf`` (uint16 bf16 bits, or uint32 words of two)."""
    return tvm.runtime.DataType(buf.dtype).bits // 8


def _flat(buf, index) -> tirx.PrimExpr:
    """The flat (row-major) element offset of ``buf[index]`` (int32: a kernel's buffers hold at
    most 2**31 - 1 elements, ``limits``)."""
    off = 0
    for i, n in zip(index, buf.shape):
        off = off * n + i
    return off


def _at(buf, index) -> tirx.PrimExpr:
    """The byte offset of ``buf[index]`` (int64: an element offset of a cache near 2**31
    elements passes int32 in bytes)."""
    return T.Cast("int64", _flat(buf, index)) * _bytes(buf)


def key_stride(t, buf, head=None, blocks: bool = False) -> tirx.PrimExpr | None:
    """The elements between consecutive keys' rows of ``buf`` (K or V as the tile ``t``
    addresses it; ``head``: a tile of several kv heads' first) where that is one constant (bhsd,
    kvcache, varlen, the latent cache: then a tile's keys can be read in place as a tile
    operand), else None (a paged cache: a block-table lookup per page). ``blocks``: the stride
    inside each 16-aligned block of keys (:data:`TILE`, a tile's rows) instead, which a paged
    cache whose pages hold whole blocks has (its page's rows: ``kv_heads·head_dim``)."""
    key = tirx.Var("key", "int32")
    ana = Analyzer()
    page = getattr(t.spec, "page_size", None) or 0
    if blocks and page and page % TILE == 0:  # key = page·m + 16·n + r, r < 15: one page's rows
        m, n, r = (tirx.Var(x, "int32") for x in "mnr")
        ana.bind(n, tvm.ir.Range(0, page // TILE))
        ana.bind(r, tvm.ir.Range(0, TILE - 1))
        key = page * m + TILE * n + r
    step = ana.simplify(_flat(buf, t.kv_row(key + 1, 0, head)) - _flat(buf, t.kv_row(key, 0, head)))
    return step if isinstance(step, tirx.IntImm) else None


def macros(emulate: bool):
    """``mm(C, ci, cs, A, ai, as_, B, bi, bs, ksteps, zero, regs)``: the micro-kernel on
    ``C[ci...]`` (float32, row stride ``cs`` elements), ``A[ai...]`` and the pairs ``B[bi...]``
    (bf16 bits, uint16, strides ``as_``/``bs`` elements), real (a call of :data:`MM`) or emulated
    (``regs``: the tile registers, :data:`REGS`, ignored by the real form); ``tr(Y, yi, ys, X,
    xi, xs)``, a 16 × 16 block of bf16 pairs transposed (:data:`TR`) from the uint32 words of
    ``X`` (stride ``xs`` words) to the uint16 pairs of ``Y`` (stride ``ys`` elements); and
    ``begin``/``end``, the tile config's load and release (nothing, emulated). ``B`` may also be
    uint32 words of pairs (V's, ``V_pack``; ``bs`` then in words)."""

    @T.macro
    def mm_real(C, ci, cs, A, ai, as_, B, bi, bs, ksteps, zero, regs):
        T.evaluate(T.call_extern("int32", MM, C.data, _at(C, ci), T.int64(cs * 4), A.data, _at(A, ai),
                                 T.int64(as_ * 2), B.data, _at(B, bi), T.int64(bs * _bytes(B)),
                                 T.int64(ksteps), T.int32(zero)))

    # Emulated: the tile registers in local buffers, loaded, multiplied and stored as the real
    # sequence does, at the element offsets its pointers address (flat offset + row · stride).
    @T.macro
    def mm_emulated(C, ci, cs, A, ai, as_, B, bi, bs, ksteps, zero, regs):
        tc, ta, tb = regs
        c0, a0, b0, clear = _flat(C, ci), _flat(A, ai), _flat(B, bi), bool(zero)
        for x, r, n in T.grid(4, TILE, TILE):  # C tile x: rows 16·(x // 2), columns 16·(x % 2)
            if clear:
                tc[x, r, n] = T.float32(0)
            else:
                tc[x, r, n] = C[_unravel(C, c0 + (TILE * (x // 2) + r) * cs + TILE * (x % 2) + n)]
        for k in T.serial(ksteps):
            for y, r, e in T.grid(2, TILE, KSTEP):  # A tile y: rows 16·y, 32 elements at 32·k
                ta[y, r, e] = A[_unravel(A, a0 + (TILE * y + r) * as_ + KSTEP * k + e)]
            for y, r, e in T.grid(2, TILE, KSTEP):  # B tile y: pair rows 16·k, 16 pairs at 16·y
                if _bytes(B) == 4:  # pairs as words (V_pack): element e is half e % 2 of word e // 2
                    tb[y, r, e] = T.Cast("uint16", T.bitwise_and(T.shift_right(
                        B[_unravel(B, b0 + (TILE * k + r) * bs + TILE * y + e // 2)], T.uint32(16) * T.uint32(e % 2)),
                        T.uint32(0xFFFF)))
                else:
                    tb[y, r, e] = B[_unravel(B, b0 + (TILE * k + r) * bs + KSTEP * y + e)]
            for x, m, n, p in T.grid(4, TILE, TILE, KSTEP // 2):  # tdpbf16ps C_x, A_(x//2), B_(x%2)
                tc[x, m, n] = (tc[x, m, n] + bf16_value(ta[x // 2, m, 2 * p]) * bf16_value(tb[x % 2, p, 2 * n])
                               + bf16_value(ta[x // 2, m, 2 * p + 1]) * bf16_value(tb[x % 2, p, 2 * n + 1]))
        for x, r, n in T.grid(4, TILE, TILE):
            C[_unravel(C, c0 + (TILE * (x // 2) + r) * cs + TILE * (x % 2) + n)] = tc[x, r, n]

    @T.macro
    def tr_real(Y, yi, ys, X, xi, xs):
        T.evaluate(T.call_extern("int32", TR, Y.data, _at(Y, yi), T.int64(ys * 2), X.data, _at(X, xi),
                                 T.int64(xs * 4)))

    # Emulated: word (r, c) of the block at X's offset goes to word (c, r) at Y's, its low half first
    @T.macro
    def tr_emulated(Y, yi, ys, X, xi, xs):
        y0, x0 = _flat(Y, yi), _flat(X, xi)
        for r, c, h in T.grid(TR_WORDS, TR_WORDS, 2):
            Y[_unravel(Y, y0 + c * ys + 2 * r + h)] = T.Cast(
                "uint16", T.bitwise_and(T.shift_right(X[_unravel(X, x0 + r * xs + c)], T.uint32(16 * h)),
                                        T.uint32(0xFFFF)))

    @T.macro
    def begin():
        T.evaluate(T.call_extern("int32", BEGIN))

    @T.macro
    def end():
        T.evaluate(T.call_extern("int32", END))

    @T.macro
    def nothing():
        T.evaluate(0)

    if emulate:
        return mm_emulated, tr_emulated, nothing, nothing
    return mm_real, tr_real, begin, end


def staged_keys(t, vc, stride):
    """Whether key tile ``vc`` is staged first (``K_load``): always where the key rows are not
    evenly spaced (``stride`` None: a paged cache), else where the tile may pass the sequence's
    end (its clamped reads); a full tile of evenly spaced rows is the A operand as stored."""
    if stride is None:
        return True
    full = t.full_tile(vc)
    return not full if isinstance(full, bool) else tirx.Not(full)


def tile_products(k, bf):
    """The fused tile's two products on tiles (``k``: the tile's ``_TileShape``; ``bf``: the bf16
    pair form's macros, :func:`.bf16dot.pair_macros`, whose staging the tiles read):
    ``s(Ku, Kb, Qp, S, t, vc, regs)``, ``S = K·Qᵀ``
    of one key tile, 32 keys × 32 rows per call, from the key rows as stored where they are
    evenly spaced and the tile is whole (:func:`key_stride`), else as staged (``K_load``), and q's
    pairs; ``pv(Vu, P, Pr, Pb, Pq, Vb, Vt, acc, alpha, t, vc, Vsc, regs, need)``, ``acc += P·V``,
    32 rows × 32 columns per call, from P rounded and paired into words (``P_pack``) and
    transposed to query-major ``Pq`` (block ``P_tr``, 16 × 16 words per call) and V's pairs along
    the keys as words (``V_pack``); the correction first where some row's reference moved (``need``)."""
    N, BM, BN, D, DV = k.N, k.BM, k.BN, k.D, k.DV
    mm, tr = macros(k.dot_bf16 == EMULATED)[:2]
    k_bits, rescale = bf.k_bits, bf.rescale

    @T.macro
    def s(Ku, Kb, Qp, S, t, vc, regs):
        stride = T.meta_var(key_stride(t, Ku))
        staged = T.meta_var(staged_keys(t, vc, stride))
        if staged:
            k_bits(Ku, Kb, t, vc)
        with T.sblock(N["S_gemm"]):
            T.reads(Kb[0:BN, 0:D], Qp[0:D // 2, 0:BM, 0:2])
            T.writes(S[0:BN, 0:BM])
            if staged:
                for jb, ib in T.grid(BN // BLOCK, BM // BLOCK):
                    mm(S, (jb * BLOCK, ib * BLOCK), BM, Kb, (jb * BLOCK, 0), D, Qp, (0, ib * BLOCK, 0), 2 * BM,
                       D // KSTEP, 1, regs)
            else:
                for jb, ib in T.grid(BN // BLOCK, BM // BLOCK):
                    mm(S, (jb * BLOCK, ib * BLOCK), BM, Ku, t.kv_row(t.tile(vc) * BN + jb * BLOCK, 0), stride,
                       Qp, (0, ib * BLOCK, 0), 2 * BM, D // KSTEP, 1, regs)

    @T.macro
    def pv_(Vu, P, Pr, Pb, Pq, Vb, Vt, acc, alpha, t, vc, Vsc, regs, need):
        # P's words (P_pack) come from the softmax's pass (fused._softmax_macro; misfit: no
        # cache with scales takes the tiles, so P is what PV reads; Pr and Vsc are placeholders)
        with T.sblock(N["P_tr"]):
            T.reads(Pb[0:BN // 2, 0:BM])
            T.writes(Pq[0:BM, 0:BN])
            for jb, ib in T.grid(BN // (2 * TR_WORDS), BM // TR_WORDS):
                tr(Pq, (ib * TR_WORDS, jb * 2 * TR_WORDS), BN, Pb, (jb * TR_WORDS, ib * TR_WORDS), BM)
        # V's pairs along the keys as words, read from the cache (Vb: a placeholder)
        for jp, d in T.grid(BN // 2, DV):
            with T.sblock(N["V_pack"]):
                vp, vd = T.axis.remap("SS", [jp, d])
                Vt[vp, vd] = T.bitwise_or(T.Cast("uint32", Vu[t.kv_at(vc, 2 * vp, vd)]), T.shift_left(
                    T.Cast("uint32", Vu[t.kv_at(vc, 2 * vp + 1, vd)]), T.uint32(16)))
        if need[0] > 0:  # some row's reference moved (the lazy correction)
            rescale(acc, alpha)
        with T.sblock(N["PV_gemm"]):
            T.reads(acc[0:BM, 0:DV], Pq[0:BM, 0:BN], Vt[0:BN // 2, 0:DV])
            T.writes(acc[0:BM, 0:DV])
            for ib, db in T.grid(BM // BLOCK, DV // BLOCK):
                mm(acc, (ib * BLOCK, db * BLOCK), DV, Pq, (ib * BLOCK, 0), BN, Vt, (0, db * BLOCK), DV,
                   BN // KSTEP, 0, regs)

    return s, pv_


#: head_dim elements of one decode ``S`` step: a 64-byte row of K (32 bf16, 64 int8)
DECODE_KSTEP = {False: KSTEP, True: 64}
#: elements of q in one 32-bit column of a decode ``S``'s B operand: bf16 pairs, int8 quads
DECODE_Q_PER_WORD = {False: 2, True: 4}


def decode_macros(R: int, emulate: bool, int8: bool):
    """The decode nests' tile calls for ``R`` rows per kv head (:func:`decode_ir`), real or
    emulated: ``s(S, si, ss, K, ki, ki1, ks, Q, qi, qs, ksteps)``, 32 keys of ``S`` (float32, row
    stride ``ss`` elements) from K's rows (stride ``ks``; keys 16-31 from ``ki1``) and q's pairs (bf16, uint16) or quads
    (``int8``) ``Q`` (stride ``qs`` elements), and ``pv(C, ci, cs, P, pi, ps, V, vi, vs, ksteps)``,
    32 columns of acc from P's bits (``(R, ·)`` uint16) and V's pair words (uint32). The emulated
    form reads and writes the same elements (offsets and strides as the real form's pointers),
    summing in float32 in its own order."""
    _, s_bf16, s_i8, pv_name = decode_names(R)
    per, step = DECODE_Q_PER_WORD[int8], DECODE_KSTEP[int8]

    @T.macro
    def s_real(S, si, ss, K, ki, ki1, ks, Q, qi, qs, ksteps):
        T.evaluate(T.call_extern("int32", s_i8 if int8 else s_bf16, S.data, _at(S, si), T.int64(ss * 4), K.data,
                                 _at(K, ki), _at(K, ki1), T.int64(ks * _bytes(K)), Q.data, _at(Q, qi),
                                 T.int64(qs * _bytes(Q)), T.int64(ksteps)))

    def value(x):
        return T.Cast("float32", x) if int8 else bf16_value(x)

    @T.macro
    def s_emulated(S, si, ss, K, ki, ki1, ks, Q, qi, qs, ksteps):
        s0, q0 = _flat(S, si), _flat(Q, qi)
        for x, r, n in T.grid(2, TILE, R):  # key 16·x + r, row n: Σ_e K[.][e]·q_n[e] (q's element e: row e // per)
            S[_unravel(S, s0 + (TILE * x + r) * ss + n)] = T.float32(0)
            for e in T.serial(ksteps * step):
                S[_unravel(S, s0 + (TILE * x + r) * ss + n)] = S[_unravel(S, s0 + (TILE * x + r) * ss + n)] + value(
                    K[_unravel(K, T.Select(x == 0, _flat(K, ki), _flat(K, ki1)) + r * ks + e)]) * value(
                    Q[_unravel(Q, q0 + e // per * qs + per * n + e % per)])

    @T.macro
    def pv_real(C, ci, cs, P, pi, ps, V, vi, vs, ksteps):
        T.evaluate(T.call_extern("int32", pv_name, C.data, _at(C, ci), T.int64(cs * 4), P.data, _at(P, pi),
                                 T.int64(ps * 2), V.data, _at(V, vi), T.int64(vs * 4), T.int64(ksteps)))

    @T.macro
    def pv_emulated(C, ci, cs, P, pi, ps, V, vi, vs, ksteps):
        c0, p0, v0 = _flat(C, ci), _flat(P, pi), _flat(V, vi)
        for r, n in T.grid(R, BLOCK):  # row r, column n: Σ_e P[r][e]·V[e][n] (word e // 2, half e % 2)
            for e in T.serial(ksteps * KSTEP):
                C[_unravel(C, c0 + r * cs + n)] = C[_unravel(C, c0 + r * cs + n)] + bf16_value(
                    P[_unravel(P, p0 + r * ps + e)]) * bf16_value(T.Cast("uint16", T.bitwise_and(T.shift_right(
                        V[_unravel(V, v0 + e // 2 * vs + n)], T.uint32(16) * T.Cast("uint32", e % 2)),
                        T.uint32(0xFFFF))))

    return (s_emulated, pv_emulated) if emulate else (s_real, pv_real)


def decode_products(k, rescale, kv_prefetch, p_of):
    """The decode nests' products on tiles (``k.dot_decode`` :data:`DECODE_REAL`, emulated
    :data:`DECODE_EMULATED`; ``k``: the tile's ``_TileShape``, ``BM = HT·R`` rows, ``R`` per kv
    head; ``rescale``: the bf16 pair form's correction block; ``kv_prefetch``: the staged forms'
    software prefetch of key ``j`` of the tile ``k.prefetch`` ahead):

    ``s(Ku, Kb, Qt, S, t, vc, Kp, Vp)``, ``S = K·Qᵀ`` of one key tile per kv head, 32 keys a call,
    K's rows read in place where each block of 16 keys is evenly spaced (:func:`key_stride`: a
    paged cache too, where its pages hold whole blocks) and the tile is whole, else staged
    (``K_load``, ``Kb (HT, BN, D)``: a tail tile, pages of fewer than 16 keys), against ``Qt
    (D/w, BM, w)``, q's pairs (bf16, ``w`` 2) or quads (``qk_int8``'s bytes, 4: ``tdpbssd``,
    signed by signed, so the keys need no offset), with an int8 cache the prefetch after each
    call, of its keys.

    ``pv(K, V, Vu, P, Pq, Vt, acc, alpha, t, vc, Vsc)`` (bf16 queries, ``k.amx_pv``): P (times a
    key's value scale, ``p_of``) rounded to bf16 query-major (``P_round``, ``Pq (BM, BN)``), V's
    pairs along the keys as words from the cache (``V_pack``, ``Vt (HT, BN/2, DV)``; an int8 value
    widened to bf16, exact) with the prefetch of each key pair's rows, the correction
    (``acc_rescale``), then ``acc += P·V``, 32 columns a call.

    Why the prefetch in ``V_pack``: issued after each ``S`` call (32 keys' rows at once) the
    step read 66-67 % of the stream read; spread over ``V_pack``'s pass, two keys at a time,
    74 % (block_n 128) and 77-80 % (64), side by side (2-core Sapphire Rapids VM, 2 threads, GQA
    32:8 D128 bf16 kvcache, B60 × 4k)."""
    N, BM, BN, D, DV, HT, R = k.N, k.BM, k.BN, k.D, k.DV, k.HT, k.R
    int8 = k.qk_int8
    per, step = DECODE_Q_PER_WORD[int8], DECODE_KSTEP[int8]
    s_mm, pv_mm = decode_macros(R, k.dot_decode == DECODE_EMULATED, int8)
    prefetch = k.prefetch

    def head(h):  # the head argument of a K/V index: none for a one-head tile
        return h if HT > 1 else None

    @T.macro
    def s(Ku, Kb, Qt, S, t, vc, Kp, Vp):
        stride = T.meta_var(key_stride(t, Ku, head(0), blocks=True))
        staged = T.meta_var(staged_keys(t, vc, stride))
        if staged:
            for h, j, d in T.grid(HT, BN, D):
                with T.sblock(N["K_load"]):
                    vh, vj, vd = T.axis.remap("SSS", [h, j, d])
                    Kb[vh, vj, vd] = k.stage_key(Ku[t.kv_at(vc, vj, vd, head(vh))])
        for jb in T.serial(BN // BLOCK):
            with T.sblock(N["S_gemm"]):
                T.reads(Kb[0:HT, 0:BN, 0:D], Qt[0:D // per, 0:BM, 0:per])
                T.writes(S[0:BN, 0:BM])
                for h in T.serial(HT):
                    if staged:
                        s_mm(S, (jb * BLOCK, h * R), BM, Kb, (h, jb * BLOCK, 0), (h, jb * BLOCK + TILE, 0), D, Qt,
                             (0, h * R, 0), per * BM, D // step)
                    else:
                        s_mm(S, (jb * BLOCK, h * R), BM, Ku, t.kv_row(t.tile(vc) * BN + jb * BLOCK, 0, head(h)),
                             t.kv_row(t.tile(vc) * BN + jb * BLOCK + TILE, 0, head(h)), stride, Qt, (0, h * R, 0),
                             per * BM, D // step)
            if prefetch > 0 and not k.amx_pv:  # (else V_pack's, one key pair at a time)
                for j in T.serial(BLOCK):
                    kv_prefetch(Kp, Vp, t, vc, jb * BLOCK + j)

    @T.macro
    def pv(Kp, Vp, Vu, P, Pq, Vt, acc, alpha, t, vc, Vsc):
        for i, j in T.grid(BM, BN):
            with T.sblock(N["P_round"]):
                vi, vj = T.axis.remap("SS", [i, j])
                Pq[vi, vj] = bf16_bits(p_of(P, Vsc, vj, vi))
        for jp in T.serial(BN // 2):
            if prefetch > 0:  # the next tiles' rows of this key pair, spread over the pass
                kv_prefetch(Kp, Vp, t, vc, 2 * jp)
                kv_prefetch(Kp, Vp, t, vc, 2 * jp + 1)
            for h, d in T.grid(HT, DV):
                with T.sblock(N["V_pack"]):
                    vp = T.axis.spatial(BN // 2, jp)
                    vh, vd = T.axis.remap("SS", [h, d])
                    Vt[vh, vp, vd] = T.bitwise_or(T.Cast("uint32", k.bits(Vu[t.kv_at(vc, 2 * vp, vd, head(vh))])),
                                                  T.shift_left(T.Cast("uint32", k.bits(
                                                      Vu[t.kv_at(vc, 2 * vp + 1, vd, head(vh))])), T.uint32(16)))
        rescale(acc, alpha)
        with T.sblock(N["PV_gemm"]):
            T.reads(acc[0:BM, 0:DV], Pq[0:BM, 0:BN], Vt[0:HT, 0:BN // 2, 0:DV])
            T.writes(acc[0:BM, 0:DV])
            for h, db in T.grid(HT, DV // BLOCK):
                pv_mm(acc, (h * R, db * BLOCK), DV, Pq, (h * R, 0), BN, Vt, (h, 0, db * BLOCK), DV, BN // KSTEP)

    return s, pv


def config_macros(N: dict, real: bool, rows: int = 0):
    """Blocks ``tile_config`` and ``tile_release`` of a row tile: the tile config loaded before
    its first tile instruction and released after its last (the real form; nothing emulated).
    ``rows``: a decode nest's rows per kv head (its own config, :func:`decode_ir`), else the
    micro-kernel's."""
    begin, end = macros(not real)[2:]
    if rows and real:
        begin = _decode_begin(decode_names(rows)[0])

    @T.macro
    def config():
        with T.sblock(N["tile_config"]):
            T.reads()
            T.writes()
            begin()

    @T.macro
    def release():
        with T.sblock(N["tile_release"]):
            T.reads()
            T.writes()
            end()

    return config, release


def _decode_begin(name: str):
    @T.macro
    def begin():
        T.evaluate(T.call_extern("int32", name))

    return begin
