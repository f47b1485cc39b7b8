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

from ._math import bf16_value

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

# Tile registers of the micro-kernel: C 0-3 (2 × 2), A 4-5, B 6-7. The config: palette 1, every
# tile 16 rows × 64 bytes (the only shape the kernel uses: one config for all of it).
_CFG = "\\01" + "\\00" * 15 + "\\40\\00" * 8 + "\\00" * 16 + "\\10" * 8 + "\\00" * 8

#: The AMX functions. linkonce_odr: a module whose nests each import it keeps one copy.
IR = r'''
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

; a thread's tile configuration (each row tile loads it: its task may run on any pool thread)
define linkonce_odr i32 @tvma_amx_begin() #0 {
  %p = call i32 @tvma_amx_permit()
  call void @llvm.x86.ldtilecfg(ptr @tvma_amx_cfg)
  ret i32 %p
}

define linkonce_odr i32 @tvma_amx_end() #0 {
  call void @llvm.x86.tilerelease()
  ret i32 0
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


def fits(BM: int, BN: int, D: int, DV: int) -> str | None:
    """Why a tile of ``BM`` rows and ``BN`` keys, head dims ``D``/``DV``, cannot take the AMX
    form (None: it can): the micro-kernel's 32 × 32 blocks tile every dim."""
    bad = {n: v for n, v in (("block_m", BM), ("block_n", BN), ("head_dim", D), ("head_dim_v", DV)) if v % BLOCK}
    if bad:
        return "the AMX form tiles in blocks of 32: " + ", ".join(f"{n}={v}" for n, v in bad.items())
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


def key_stride(t, buf) -> tirx.PrimExpr | None:
    """The elements between consecutive keys' rows of ``buf`` (K or V as the tile ``t``
    addresses it) where that is one constant (bhsd, kvcache, varlen, the latent cache: then a
    tile's keys can be read in place as a tile operand), else None (a paged cache: a block-table
    lookup per page)."""
    key = tirx.Var("key", "int32")
    step = Analyzer().simplify(_flat(buf, t.kv_row(key + 1, 0)) - _flat(buf, t.kv_row(key, 0)))
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

    def staged_keys(t, vc, stride):
        # whether the key tile is staged first (K_load): always where the key rows are not evenly
        # spaced (a paged cache), else where the tile may pass the sequence's end (its clamped
        # reads); a full tile of evenly spaced rows is the A operand as stored
        if stride is None:
            return True
        full = t.full_tile(vc)
        return not full if isinstance(full, bool) else tirx.Not(full)

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


def config_macros(N: dict, real: bool):
    """Blocks ``tile_config`` and ``tile_release`` of a row tile: the tile config loaded before
    its first tile instruction and released after its last (the real form; nothing emulated)."""
    begin, end = macros(not real)[2:]

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
