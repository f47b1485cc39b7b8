"""A NumPy model of the Hopper kernel's data movement (``fused_wgmma``), to check it without a GPU.

It runs the kernel's algorithm block by block with the kernel's own choices — the tensor maps'
dims, strides and boxes and the TMA coordinates, the shared-memory offsets, the descriptors'
start addresses, LBO, SBO and swizzle mode exactly as the device helpers compute them, the
mbarrier parities, the P registers' packing order, the fragment indexing of the softmax and the
store (:mod:`.wgmma_layout`) — against the hardware's definitions written here from the PTX
ISA, independently of that module:

* TMA with ``SWIZZLE_128B``: a box lands row by row, 128 bytes a row, each 16-byte chunk at
  ``chunk ^ (row % 8)`` of the 1024-byte pattern (address bits 4-6 XOR bits 7-9), rows past a
  dim's end filled with zeros; the destination must be 1024-byte aligned;
* ``wgmma`` descriptors: the canonical K-major and MN-major layouts of the 128B swizzle mode (the
  ISA's "Shared Memory Matrix Layout"), read through the swizzle;
* the accumulator and A-register fragments of ``m64nNk16`` (the ISA's "Register Fragments");
* mbarrier phases (``try_wait.parity`` passes once the phase of that parity completed) and the
  expected transaction bytes against the bytes the boxes carry;
* the named barriers of the ping-pong (``bar.sync``/``bar.arrive`` with a thread count): the
  consumers' sequences of turns run to the end without a deadlock.

Split-KV (a KV cache's ``split_tasks``) runs each chunk as a block over its share of the key
tiles, places its state in the workspace by the kernel's store indexing and merges the chunks
(weights ``2^(m − max m)``, the sink once) as the merge kernel does.

fp8 inputs (``spec.q_dtype``): Q, K and V land as bytes; the producer warpgroup's transpose of
each V tile into ``Vᵀ`` runs lane by lane at the kernel's addresses (``wgmma_layout.VT_*``) with
``__byte_perm`` as CUDA defines it; the products read k32 steps of e4m3 (the A fragment of
``m64nNk32`` for 8-bit types, P's bytes in the helper's order ``p_byte``).

Products are computed in float64 from the 16-bit inputs (P rounded to 16 bits as the helper
does; fp8 inputs: to e4m3), so the model's output matches the float64 reference to the rounding
of P: a wrong address, swizzle, stride or fragment index gives a wrong row, not a small error.
"""
from __future__ import annotations

import numpy as np

from ..visibility import Visibility
from .fused import MIN_SPLIT_KEYS
from .variants import score_scale, transforms
from .wgmma_layout import (
    MODE_SWIZZLE_64B,
    MODE_SWIZZLE_128B,
    ROW_BYTES,
    VT_PERM,
    WARPGROUP,
    WG_ROWS,
    SmemPlan,
    acc_col,
    acc_row,
    cvt_dst,
    decode_desc,
    empty_parity,
    full_parity,
    p_byte,
    p_pair,
    tensor_map,
    tensor_map_gqa,
    tensor_map_packed,
    tensor_map8,
    tensor_map8_paged,
    tensor_map_paged,
    vt_eval,
    vt_texts,
)


class ModelError(AssertionError):
    """The kernel's data movement breaks a rule of the hardware it targets."""


# -- the hardware, from the ISA --------------------------------------------------------------------
def _swizzle(addr: np.ndarray, span: int = ROW_BYTES) -> np.ndarray:
    """Where the 128B swizzle (``span`` 128: address bits 4-6 XOR bits 7-9) or the 64B swizzle
    (``span`` 64: bits 4-5 XOR bits 7-8) puts byte ``addr`` of an aligned region."""
    return addr ^ (((addr >> 7) & (7 if span == ROW_BYTES else 3)) << 4)


def isa_acc(thread: np.ndarray, reg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """wgmma m64nNk16's D fragment: thread ``t`` = (warp w, lane), register ``d[i·4 + j]``: row
    ``16w + lane/4 + 8·(j ≥ 2)``, column ``8i + 2·(lane % 4) + j % 2``."""
    w, lane = thread // 32, thread % 32
    i, j = reg // 4, reg % 4
    return 16 * w + lane // 4 + 8 * (j >= 2), 8 * i + 2 * (lane % 4) + j % 2


def isa_a(thread: np.ndarray, reg: np.ndarray, half: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """wgmma's A fragment from registers (16-bit, k16): ``a0..a3`` of thread ``t``: a0 row
    ``16w + lane/4``, k ``2·(lane % 4) + half``; a1 row + 8; a2 k + 8; a3 both."""
    w, lane = thread // 32, thread % 32
    return 16 * w + lane // 4 + 8 * (reg % 2), 2 * (lane % 4) + 8 * (reg // 2) + half


def isa_a8(thread: np.ndarray, reg: np.ndarray, byte: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """wgmma's A fragment from registers, 8-bit types (k32): register ``reg`` (0-3) of thread ``t``
    holds 4 elements, byte ``b`` lowest first: row ``16w + lane/4 + 8·(reg % 2)``, k ``4·(lane %
    4) + b + 16·(reg // 2)`` (as ``mma.m16n8k32``'s A for each warp's 16 rows)."""
    w, lane = thread // 32, thread % 32
    return 16 * w + lane // 4 + 8 * (reg % 2), 4 * (lane % 4) + byte + 16 * (reg // 2)


def isa_byte_perm(x: np.ndarray, y: np.ndarray, sel: int) -> np.ndarray:
    """CUDA's ``__byte_perm(x, y, s)``: result byte k is byte ``(s >> 4k) & 7`` of the 8 bytes
    ``{y, x}`` (x's bytes 0-3, y's 4-7)."""
    both = x.astype(np.uint64) | (y.astype(np.uint64) << np.uint64(32))
    out = np.zeros(np.shape(x), np.uint64)
    for k in range(4):
        b = (sel >> (4 * k)) & 7
        out |= ((both >> np.uint64(8 * b)) & np.uint64(0xFF)) << np.uint64(8 * k)
    return out.astype(np.uint32)


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """``cvt.rn.satfinite.e4m3x2.f32``'s rounding of float32 values (to nearest even, saturated
    at ±448; NaN stays NaN) as float64 values."""
    import ml_dtypes

    x = np.asarray(x, np.float32)
    sat = np.where(np.isnan(x), x, np.clip(x, -448.0, 448.0))
    return sat.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def isa_cvt8(b: np.ndarray, kv_dtype: str) -> np.ndarray:
    """The float64 value of each 8-bit cache element ``b`` (its bits, uint8) as the conversion to
    16 bits gives it (exact): e4m3fn (sign, 4 exponent bits of bias 7, 3 mantissa bits,
    subnormals, ``S.1111.111`` NaN, no inf), e5m2 (bias 15, 2 mantissa bits, inf and NaN), int8."""
    b = b.astype(np.int64)
    if kv_dtype == "int8":
        return np.where(b > 127, b - 256, b).astype(np.float64)
    ebits, mbits, bias = (4, 3, 7) if kv_dtype == "float8_e4m3fn" else (5, 2, 15)
    sign = np.where(b >> 7, -1.0, 1.0)
    e, m = (b >> mbits) & ((1 << ebits) - 1), b & ((1 << mbits) - 1)
    mag = np.where(e == 0, m * 2.0 ** (1 - bias - mbits), (1 + m / 2.0 ** mbits) * 2.0 ** (e - bias))
    if kv_dtype == "float8_e4m3fn":
        mag = np.where((e == 15) & (m == 7), np.nan, mag)
    else:
        mag = np.where(e == 31, np.where(m == 0, np.inf, np.nan), mag)
    return sign * mag


def _box_rows(g: np.ndarray, dims, strides, box, coords, itemsize: int):
    """A TMA box's elements from ``g`` (the tensor's elements, flat) as rows, in the order TMA
    lands them (dim 1 fastest, then dim 2, then 3): ``(row, column, values)``, elements past a
    dim's end (or before its start) zero."""
    c = np.arange(box[0])[None, :]
    n = np.arange(int(np.prod(box[1:])))[:, None]
    inside = (coords[0] + c < dims[0]) & (coords[0] + c >= 0)
    flat, rest = coords[0] + c, n
    for i in range(1, len(box)):
        at = coords[i] + rest % box[i]
        rest = rest // box[i]
        inside = inside & (at < dims[i]) & (at >= 0)
        flat = flat + at * (strides[i - 1] // itemsize)
    return n, c, np.where(inside, g[np.where(inside, flat, 0)], 0)


class Smem:
    """A block's shared memory as 16-bit words, addressed in bytes from a 1024-aligned base."""

    def __init__(self, nbytes: int):
        self.words = np.full(nbytes // 2, 0x7E00, dtype=np.uint16)  # NaN: a read of unwritten memory shows

    def tma_box(self, dst: int, g: np.ndarray, dims, strides, box, coords, itemsize: int = 2,
                span: int = ROW_BYTES) -> int:
        """A 3-D TMA load of ``box`` (innermost first) at ``coords`` of the tensor whose dims and
        byte strides the tensor map holds, from ``g`` (the tensor's 16-bit words, flat), into
        ``dst`` with the 128B swizzle (``span`` 64: the 64B swizzle, rows 64 bytes apart);
        returns the bytes it carries."""
        if dst % 1024:
            raise ModelError(f"TMA destination {dst} is not 1024-byte aligned (128B swizzle)")
        if box[0] * itemsize != span:
            raise ModelError(f"box inner extent {box[0]} × {itemsize} B is not the {span}-byte swizzle span")
        if any(x % 16 for x in strides):
            raise ModelError(f"global strides {strides} are not multiples of 16 bytes")
        n, c, vals = _box_rows(g, dims, strides, box, coords, itemsize)
        addr = dst + n * span + c * itemsize  # each row a span of shared memory
        if itemsize == 1:  # fp8 inputs: bytes (g holds them)
            self.words.view(np.uint8)[_swizzle(addr, span)] = vals.astype(np.uint8)
        else:
            self.words[_swizzle(addr, span) // 2] = vals.astype(np.uint16)
        return box[0] * box[1] * box[2] * itemsize

    def tma_box8(self, dst: int, g: np.ndarray, dims, strides, box, coords) -> int:
        """A TMA load of an 8-bit box without swizzle (``g``: the tensor's bytes, flat): its rows
        of ``box[0]`` bytes one after the other from ``dst``, rows past a dim's end zeros."""
        if dst % 128:
            raise ModelError(f"TMA destination {dst} is not 128-byte aligned")
        if box[0] % 16 or any(x % 16 for x in strides):
            raise ModelError(f"box row {box[0]} B or global strides {strides} are not multiples of 16 bytes")
        n, c, vals = _box_rows(g, dims, strides, box, coords, 1)
        self.words.view(np.uint8)[dst + n * box[0] + c] = vals
        return int(np.prod(box))

    def convert(self, src: int, dst: int, plan: SmemPlan, kv_dtype: str, dtype: str):
        """The converter's pass over an 8-bit tile (``hop_cvt8``): chunk ``i``'s 16 bytes at
        ``src + 16 i`` as 16-bit values, written (plain stores: the addresses carry the swizzle
        themselves) at ``wgmma_layout.cvt_dst`` of its two halves."""
        data = self.words.view(np.uint8)
        for i in range(plan.cvt_chunks):
            vals = to_bits(isa_cvt8(data[src + 16 * i: src + 16 * i + 16], kv_dtype), dtype)
            for h in (0, 1):
                a = dst + int(cvt_dst(plan, i, h))
                self.words[a // 2: a // 2 + 8] = vals[8 * h: 8 * h + 8]

    def zero_rows(self, tile: int, slab_bytes: int, slabs: int, first: int, rows: int):
        """``hop_zero_rows``: rows ``[first, rows)`` of each slab of a tile, 16 bytes at a time
        at the addresses the helper computes (through the swizzle they stay in their rows)."""
        per_row = 8 * slabs
        for i in range((rows - first) * per_row):
            a = tile + (i % per_row) // 8 * slab_bytes + (first + i // per_row) * ROW_BYTES + (i % 8) * 16
            self.words[_swizzle(np.arange(a, a + 16, 2)) // 2] = 0

    def kmajor(self, desc: int, rows: int, base: int, itemsize: int = 2) -> np.ndarray:
        """The ``rows × 16`` operand a K-major 128B-swizzled descriptor names (words); 8-bit
        (k32): ``rows × 32`` bytes."""
        start, _lbo, sbo, mode = decode_desc(desc)
        span = {MODE_SWIZZLE_128B: ROW_BYTES, MODE_SWIZZLE_64B: 64}.get(mode)
        if span is None:
            raise ModelError(f"descriptor mode {mode}: the tiles are 128B- or 64B-swizzled")
        start -= base  # shared addresses: this model's words start at the (1024-aligned) base
        r = np.arange(rows)[:, None]
        k = np.arange(32 // itemsize)[None, :]
        addr = start + r % 8 * span + r // 8 * sbo + k * itemsize  # 8 rows a core matrix group
        if itemsize == 1:
            return self.words.view(np.uint8)[_swizzle(addr, span)]
        return self.words[_swizzle(addr, span) // 2]

    def transpose8(self, src: int, dst: int, plan: SmemPlan, valid: int):
        """fp8 inputs' ``hop_vt8``: each warp instruction ``n`` of the producer warpgroup, lane by
        lane, reads 4 keys' words at ``VT_SRC`` (zero from key ``valid`` on), transposes the 4 × 4
        bytes with ``__byte_perm`` (``VT_PERM``) and writes 4 columns' words at ``VT_DST``; a
        position written twice, or a read of a word not yet landed, is a fault."""
        data = self.words.view(np.uint8)
        lane = np.arange(32)
        lo, hi, col_lo, col_hi = VT_PERM
        PG, DG, KEY, SRC, DST = vt_texts(plan)  # the kernel's texts (the 64B swizzle's at head_dim 64)
        written = np.zeros(plan.kv_tile_bytes, np.int64)
        for n in range(plan.vt_units // 32):
            pg, dg = vt_eval(plan, PG, n=n, lane=lane), vt_eval(plan, DG, n=n, lane=lane)
            w = []
            for i in range(4):
                key = vt_eval(plan, KEY, pg=pg, i=i)
                a = src + vt_eval(plan, SRC, dg=dg, key=key)
                word = np.stack([data[a + b] for b in range(4)]).astype(np.uint32)
                word = word[0] | word[1] << 8 | word[2] << 16 | word[3] << 24
                w.append(np.where(key >= valid, 0, word).astype(np.uint32))
            a01, a23 = isa_byte_perm(w[0], w[1], lo), isa_byte_perm(w[2], w[3], lo)
            b01, b23 = isa_byte_perm(w[0], w[1], hi), isa_byte_perm(w[2], w[3], hi)
            out = [isa_byte_perm(a01, a23, col_lo), isa_byte_perm(a01, a23, col_hi),
                   isa_byte_perm(b01, b23, col_lo), isa_byte_perm(b01, b23, col_hi)]
            for e in range(4):
                a = vt_eval(plan, DST, pg=pg, d=4 * dg + e)
                if np.any(a % 4):
                    raise ModelError("a transposed word's address is not 4-byte aligned")
                for b in range(4):
                    data[dst + a + b] = (out[e] >> (8 * b)) & 0xFF
                    written[a + b] += 1
        if not (written == 1).all():
            raise ModelError(f"the transpose writes {int((written == 0).sum())} bytes of V^T never and "
                             f"{int((written > 1).sum())} more than once")

    def mnmajor(self, desc: int, cols: int, base: int) -> np.ndarray:
        """The ``16 × cols`` (K × N) operand an MN-major 128B-swizzled descriptor names (words)."""
        start, lbo, sbo, mode = decode_desc(desc)
        if mode != MODE_SWIZZLE_128B:
            raise ModelError(f"descriptor mode {mode}: the tiles are 128B-swizzled")
        start -= base
        k = np.arange(16)[:, None]
        n = np.arange(cols)[None, :]
        addr = start + n % 64 * 2 + n // 64 * lbo + k % 8 * ROW_BYTES + k // 8 * sbo
        return self.words[_swizzle(addr) // 2]


class Barrier:
    """An mbarrier: phases complete when the expected arrivals and transaction bytes are in."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def passes(self, parity: int) -> bool:
        return self.phase % 2 != parity  # the phase of that parity has completed

    def arrive(self, tx: int = 0):
        self.pending -= 1
        self.tx += tx
        self._complete()

    def land(self, nbytes: int):
        self.tx -= nbytes
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count
        elif self.tx < 0:
            raise ModelError("a barrier received more bytes than were expected")


# -- 16-bit values ---------------------------------------------------------------------------------
def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return np.asarray(x, np.float16).view(np.uint16)
    f = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((f + 0x7FFF + (f >> 16 & 1)) >> 16).astype(np.uint16)  # round to nearest even


def from_bits(w: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return w.view(np.float16).astype(np.float64)
    return (w.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# -- the kernel, block by block ----------------------------------------------------------------------
def pingpong_turns(n_tiles: int, overlap: bool = False, first_arrival: bool = True) -> list:
    """The consumers' named-barrier protocol for ``n_tiles`` key tiles (two warpgroups, barriers
    1 and 2 of 256 threads), as ``fused_wgmma``'s consumer issues it: consumer 1 arrives on
    consumer 0's barrier once (``first_arrival``: the first turn is consumer 0's); before each
    product (``S = Q·Kᵀ``, ``O += P·V``) a consumer syncs on its own barrier, after issuing it
    arrives on the other's; consumer 0 syncs once more at the end. Runs both sequences,
    round-robin, until both end; raises on a deadlock or an arrival left pending, and returns
    the order of the product issues. With ``overlap`` a turn issues tile j's ``S`` and tile j − 1's
    ``P·V`` together: the first turn ``S`` alone, the last ``P·V`` alone."""
    seqs = []
    for wg in (0, 1):
        ops = [("arrive", 1)] if wg == 1 and first_arrival else []
        if overlap:
            turns = [("qk", 0)] + [(f"qk+pv{j - 1}", j) for j in range(1, n_tiles)] + [("pv", n_tiles - 1)]
            turns = turns if n_tiles else []
        else:
            turns = [(gemm, j) for j in range(n_tiles) for gemm in ("qk", "pv")]
        for gemm, j in turns:
            ops += [("sync", 1 + wg), ("issue", (wg, gemm, j)), ("arrive", 2 - wg)]
        if wg == 0:
            ops.append(("sync", 1))
        seqs.append(ops)
    arrived = {1: 0, 2: 0}  # arrivals (in warpgroups) waiting on each barrier's current phase
    pos = [0, 0]
    order = []
    while pos[0] < len(seqs[0]) or pos[1] < len(seqs[1]):
        moved = False
        for wg in (0, 1):
            if pos[wg] >= len(seqs[wg]):
                continue
            op, arg = seqs[wg][pos[wg]]
            if op == "issue":
                order.append(arg)
            elif op == "arrive":
                arrived[arg] += 1
                if arrived[arg] > 1:
                    raise ModelError(f"barrier {arg}: a second arrival before the phase completed")
            elif op == "sync":
                if arrived[arg] == 0:
                    continue  # blocked until the other warpgroup arrives
                arrived[arg] = 0
            pos[wg] += 1
            moved = True
        if not moved:
            raise ModelError(f"ping-pong deadlock at {pos} ({n_tiles} tiles)")
    if any(arrived.values()):
        raise ModelError(f"arrivals left pending at the end: {arrived}")
    return order


class _Block:
    """One thread block of the kernel: its shared memory, barriers, and each consumer's registers
    (``m``, ``l``: a thread's two rows' state; ``o``: its output registers)."""

    BASE = 0x4400  # the block's shared base: any 1024-aligned address

    def __init__(self, run: "_Run", seq: dict, h: int, row0: int, nt: int, first: int = 0):
        self.r, self.seq, self.h, self.row0, self.nt, self.first = run, seq, h, row0, nt, first
        self.b = seq["b"]
        plan, NS = run.plan, run.plan.stages
        self.sm = Smem(plan.alloc_bytes)
        self.full_q = Barrier(1)
        # an 8-bit cache's stage: full once its converters arrive; fp8 inputs' V^T, its transposers
        self.full_k = [Barrier(WARPGROUP if run.kv8 else 1) for _ in range(NS)]
        self.full_v = [Barrier(WARPGROUP if run.kv8 or run.f8 else 1) for _ in range(NS)]
        self.full8 = [Barrier(1) for _ in range(NS)]
        self.empty = [Barrier(WARPGROUP * plan.consumers) for _ in range(NS)]
        self.state = [{"m": np.full((WARPGROUP, 2), -np.inf), "l": np.zeros((WARPGROUP, 2)),
                       "o": np.zeros((WARPGROUP, run.D // 2))} for _ in range(plan.consumers)]

    def load_q(self):
        r, plan = self.r, self.r.plan
        self.full_q.arrive(plan.q_bytes)
        for sl in range(plan.slabs):
            self.full_q.land(self.sm.tma_box(plan.q_slab(sl), r.gq, *r.mq[:3],
                                             (sl * plan.slab_cols, *r.q_coord(self.seq, self.row0, self.h)),
                                             plan.itemsize, plan.span))
        if not self.full_q.passes(0):
            raise ModelError("Q's barrier did not complete with Q's boxes")

    def load_kv(self, j: int):
        """The producer's tile j: its stage free (the release of tile j − stages), K and V landed."""
        r, plan, NS = self.r, self.r.plan, self.r.plan.stages
        s = j % NS
        if j >= NS and not self.empty[s].passes(empty_parity(j, NS)):
            raise ModelError(f"tile {j}: the producer's wait on stage {s} would block forever")
        if self.full_k[s].passes(full_parity(j, NS)):
            raise ModelError(f"tile {j}: the consumers' wait on stage {s} passes before its K lands")
        if r.kv8:
            return self.load_kv8(j)
        if r.f8:
            return self.load_kv_f8(j)
        self.full_k[s].arrive(plan.kv_tile_bytes)
        self.full_v[s].arrive(plan.kv_tile_bytes)
        boxes = r.kv_boxes(self.seq, (self.first + j) * plan.block_n, self.h if r.cache else self.h // r.G)
        for sl in range(plan.slabs):
            for row, at in boxes:
                off = plan.kv_slab(sl) + row * ROW_BYTES
                self.full_k[s].land(self.sm.tma_box(plan.k_tile(s) + off, r.gk, *r.mk[:3], (sl * 64, *at)))
                self.full_v[s].land(self.sm.tma_box(plan.v_tile(s) + off, r.gv, *r.mk[:3], (sl * 64, *at)))
        if not (self.full_k[s].passes(full_parity(j, NS)) and self.full_v[s].passes(full_parity(j, NS))):
            raise ModelError(f"tile {j}: stage {s}'s barriers did not complete with its boxes")

    def load_kv8(self, j: int):
        """An 8-bit cache's tile j: its bytes landed in staging stage j % stages (one barrier, K's
        and V's bytes), then converted by the producer warpgroup's 128 threads into the 16-bit
        stage, each arriving on its full barriers."""
        r, plan, NS = self.r, self.r.plan, self.r.plan.stages
        s = j % NS
        self.full8[s].arrive(2 * plan.kv8_tile_bytes)
        boxes = r.kv_boxes(self.seq, (self.first + j) * plan.block_n, self.h)
        for row, at in boxes:
            off = row * plan.head_dim  # staging rows: head_dim bytes each
            self.full8[s].land(self.sm.tma_box8(plan.k8_tile(s) + off, r.gk, *r.mk[:3], (0, *at)))
            self.full8[s].land(self.sm.tma_box8(plan.v8_tile(s) + off, r.gv, *r.mk[:3], (0, *at)))
        if not self.full8[s].passes(full_parity(j, NS)):
            raise ModelError(f"tile {j}: staging stage {s}'s barrier did not complete with its boxes")
        self.sm.convert(plan.k8_tile(s), plan.k_tile(s), plan, r.kv8, r.dtype)
        for _ in range(WARPGROUP):
            self.full_k[s].arrive()
        self.sm.convert(plan.v8_tile(s), plan.v_tile(s), plan, r.kv8, r.dtype)
        for _ in range(WARPGROUP):
            self.full_v[s].arrive()
        if not (self.full_k[s].passes(full_parity(j, NS)) and self.full_v[s].passes(full_parity(j, NS))):
            raise ModelError(f"tile {j}: stage {s}'s barriers did not complete with its converters' arrivals")

    def load_kv_f8(self, j: int):
        """fp8 inputs' tile j: K landed in its stage, V in its staging stage (one barrier), then
        transposed into the stage's ``Vᵀ`` by the producer warpgroup's 128 threads, each arriving
        on V's full barrier; keys past a packed sequence's transposed as zeros."""
        r, plan, NS = self.r, self.r.plan, self.r.plan.stages
        s = j % NS
        key0 = (self.first + j) * plan.block_n
        self.full_k[s].arrive(plan.kv_tile_bytes)
        self.full8[s].arrive(plan.kv_tile_bytes)
        ((_, at),) = r.kv_boxes(self.seq, key0, self.h // r.G)
        for sl in range(plan.slabs):
            coords = (sl * plan.slab_cols, *at)
            self.full_k[s].land(self.sm.tma_box(plan.k_tile(s) + plan.kv_slab(sl), r.gk, *r.mk[:3], coords, 1,
                                                plan.span))
            self.full8[s].land(self.sm.tma_box(plan.vs_tile(s) + plan.kv_slab(sl), r.gv, *r.mk[:3], coords, 1,
                                               plan.span))
        if not self.full8[s].passes(full_parity(j, NS)):
            raise ModelError(f"tile {j}: V's staging barrier did not complete with its boxes")
        valid = min(self.seq["k_len"] - key0, plan.block_n) if r.packed else plan.block_n
        self.sm.transpose8(plan.vs_tile(s), plan.v_tile(s), plan, valid)
        for _ in range(WARPGROUP):
            self.full_v[s].arrive()
        if not (self.full_k[s].passes(full_parity(j, NS)) and self.full_v[s].passes(full_parity(j, NS))):
            raise ModelError(f"tile {j}: stage {s}'s barriers did not complete with its box and transposers")

    def wait_full(self, barriers, j: int, what: str):
        if not barriers[j % self.r.plan.stages].passes(full_parity(j, self.r.plan.stages)):
            raise ModelError(f"tile {j}: a consumer reads {what} before it landed")

    def qk(self, wg: int, j: int) -> np.ndarray:
        """S = Q·Kᵀ through the descriptors the helper builds: the registers the hardware fills."""
        r, plan, base = self.r, self.r.plan, self.BASE
        self.wait_full(self.full_k, j, "K")
        s = j % plan.stages
        acc = np.zeros((WG_ROWS, plan.block_n))
        for kk in range(plan.qk_steps):
            da = plan.qk_desc_high | ((base + plan.q_rows(wg) + plan.q_step(kk)) >> 4)
            db = plan.qk_desc_high | ((base + plan.k_tile(s) + plan.k_step(kk)) >> 4)
            acc += r.values(self.sm.kmajor(da, WG_ROWS, base, plan.itemsize)) @ \
                r.values(self.sm.kmajor(db, plan.block_n, base, plan.itemsize)).T
        return acc[isa_acc(r.t, r.rs)]

    def softmax(self, wg: int, j: int, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The kernel's softmax of key tile ``j`` on its registers (its own fragment indexing):
        the variants' score hook, the mask, (alpha, P)."""
        r, st = self.r, self.state[wg]
        trow = self.row0 + wg * WG_ROWS + acc_row(r.t, r.rs)
        rows, heads = r.pos(trow), r.head(self.h, trow)
        keys = j * self.r.plan.block_n + acc_col(r.t, r.rs)
        off, k_len = self.seq["k_len"] - self.seq["q_len"], self.seq["k_len"]
        if r.transforms:  # softcap, then ALiBi, in log2 units (Variants.logit)
            S = S * r.score_scale * r.k_factor(self.h)
            if r.spec.softcap is not None:
                S = np.tanh(S) * r.spec.softcap * np.log2(np.e)
            if r.slopes is not None:
                S = S - r.slopes[heads] * np.log2(np.e) * np.abs(rows + off - keys)
        sees = r.vis.sees(keys, rows + off, r.start(self.b))
        vis = keys < k_len if sees is None else (keys < k_len) & sees
        S = np.where(vis, S, -np.inf)
        half = r.rs % 4 // 2
        mt = np.stack([np.where(half == hh, S, -np.inf).max(1) for hh in (0, 1)], 1)
        mt = mt.reshape(WARPGROUP // 4, 4, 2).max(1).repeat(4, 0)  # the row's four lanes
        qscale = r.qscale if r.transforms else r.qscale * r.k_factor(self.h)
        mn = np.maximum(st["m"], mt * qscale)
        ref = np.where(mn == -np.inf, 0.0, mn)
        alpha = np.exp2(st["m"] - ref)
        st["l"] *= alpha
        st["m"] = mn
        P = np.exp2(S * qscale - ref[r.t, half])
        st["l"] += np.stack([np.where(half == hh, P, 0).sum(1) for hh in (0, 1)], 1)
        if r.f8:  # packed to e4m3 (hop_pack8)
            return alpha, to_e4m3(P)
        return alpha, from_bits(to_bits(P, r.dtype), r.dtype)  # packed to 16 bits (hop_pack)

    def rescale(self, wg: int, alpha: np.ndarray):
        self.state[wg]["o"] *= alpha[self.r.t, self.r.ro % 4 // 2]

    def pv(self, wg: int, P: np.ndarray, j: int):
        """O += P·V: P's registers as the helper packs them, read by the hardware as A fragments;
        packed, the rows past the sequence's keys zeroed first (``hop_zero_rows``)."""
        r, plan, base, st = self.r, self.r.plan, self.BASE, self.state[wg]
        self.wait_full(self.full_v, j, "V")
        key0 = (self.first + j) * plan.block_n
        if r.f8:
            return self.pv_f8(wg, P, j)
        if (r.packed or r.cache) and key0 + plan.block_n > self.seq["k_len"]:
            self.sm.zero_rows(plan.v_tile(j % plan.stages), plan.kv_slab(1), plan.slabs,
                              max(self.seq["k_len"] - key0, 0), plan.block_n)
        for kk in range(plan.pv_steps):
            a = np.zeros((WG_ROWS, 16))
            for qreg in range(4):
                for hf in range(2):
                    ar, ak = isa_a(r.t[:, 0], np.array(qreg), np.array(hf))
                    a[ar, ak] = P[:, 2 * p_pair(kk, qreg) + hf]
            db = plan.pv_desc_high | ((base + plan.v_tile(j % plan.stages) + plan.v_step(kk)) >> 4)
            omat = np.zeros((WG_ROWS, r.D))
            o_at = isa_acc(r.t, r.ro)
            omat[o_at] = st["o"]
            omat += a @ from_bits(self.sm.mnmajor(db, r.D, base), r.dtype)
            st["o"] = omat[o_at]

    def pv_f8(self, wg: int, P: np.ndarray, j: int):
        """fp8 inputs' O += P·V: P's e4m3 registers as ``hop_pack8`` packs them (``p_byte``), read
        by the hardware as k32 A fragments, times ``Vᵀ`` read K-major."""
        r, plan, base, st = self.r, self.r.plan, self.BASE, self.state[wg]
        o_at = isa_acc(r.t, r.ro)
        for kk in range(plan.pv_steps):
            a = np.zeros((WG_ROWS, 32))
            for qreg in range(4):
                for b in range(4):
                    ar, ak = isa_a8(r.t[:, 0], np.array(qreg), np.array(b))
                    a[ar, ak] = P[:, p_byte(kk, qreg, b)]
            db = plan.pv_desc_high | ((base + plan.v_tile(j % plan.stages) + plan.v_step(kk)) >> 4)
            omat = np.zeros((WG_ROWS, r.D))
            omat[o_at] = st["o"]
            omat += a @ r.values(self.sm.kmajor(db, r.D, base, 1)).T
            st["o"] = omat[o_at]

    def release(self, j: int):
        """Every thread of a consumer arrives on tile j's stage's empty barrier."""
        NS = self.r.plan.stages
        s = j % NS
        if j + NS < self.nt and self.empty[s].passes(empty_parity(j + NS, NS)):
            raise ModelError(f"tile {j + NS}: the producer's wait passes before tile {j} is released")
        for _ in range(WARPGROUP):
            self.empty[s].arrive()

    def rows_state(self, wg: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Consumer ``wg``'s registers by its 64 rows as the kernel's store indexes them (its
        ``acc_row``/``acc_col``; a row's sum over its four lanes): ``o (64, D)``, ``l``, ``m (64,)``."""
        r, st = self.r, self.state[wg]
        at = acc_row(r.t, r.ro), np.broadcast_to(acc_col(r.t, r.ro), (WARPGROUP, r.D // 2))
        halves = acc_row(r.t, np.array([[0, 2]]))  # a thread's two rows
        written = np.zeros((WG_ROWS, r.D), bool)
        written[at] = True
        if not (written.all() and np.isin(np.arange(WG_ROWS), halves).all()):
            raise ModelError("the store's fragment indexing leaves a row or column of the tile unwritten")
        o, l, m = np.zeros((WG_ROWS, r.D)), np.zeros(WG_ROWS), np.zeros(WG_ROWS)
        o[at] = st["o"]
        l[halves] = st["l"].reshape(WARPGROUP // 4, 4, 2).sum(1).repeat(4, 0)
        m[halves] = st["m"]
        return o, l, m

    def store(self, out: np.ndarray):
        for wg in range(len(self.state)):
            self.r.finish(self.seq, self.h, self.row0 + wg * WG_ROWS + np.arange(WG_ROWS), *self.rows_state(wg), out)

    def store_part(self, op: np.ndarray, st: np.ndarray, chunk: int):
        """A split-KV chunk's state (the kernel's ``store_part``): the unnormalised output and
        the rows' max and sum at ``(chunk, b, kv head, row)`` of the workspace (one row tile)."""
        for wg in range(len(self.state)):
            o, l, m = self.rows_state(wg)
            rows = wg * WG_ROWS + np.arange(WG_ROWS)  # the split tile's first row is 0
            op[chunk, self.b, self.h, rows] = o
            st[chunk, self.b, self.h, rows, 0], st[chunk, self.b, self.h, rows, 1] = m, l


class _Run:
    """The constants of one model run (shapes, tensor maps, the inputs' 16-bit words, the
    variants' arguments)."""

    def __init__(self, q, k, v, plan: SmemPlan, spec, dtype: str, alibi_slopes=None, sinks=None, kv_start=None,
                 cu_seqlens=None, cache_seqlens=None, block_table=None, k_scale=None, v_scale=None, q_scale=None):
        # fp8 inputs: q, k, v their e4m3 elements (ml_dtypes' float8), scaled per query and KV head
        self.f8 = spec.q_dtype is not None
        # an 8-bit cache: k/v are its elements (int8, or ml_dtypes' float8), scaled per KV head
        self.kv8 = None if self.f8 else spec.kv_dtype
        self.k_scale, self.v_scale, self.q_scale = k_scale, v_scale, q_scale
        isz = plan.itemsize
        self.packed = cu_seqlens is not None
        self.cache = cache_seqlens is not None  # k/v (B, KH, max_len, D): a KV head's query heads in a tile's rows
        self.paged = block_table is not None  # k/v (num_pages, page_size, KH, D)
        if self.cache:
            self.B, self.H, self.SQ, self.D = q.shape
            self.seqlens = np.asarray(cache_seqlens, np.int64)
            if self.paged:
                NP, self.PS, self.KH = k.shape[:3]
                self.bt = np.asarray(block_table, np.int64)
                self.prows = min(self.PS, plan.block_n)
                self.mk = (tensor_map8_paged(self.D, self.KH, self.PS, NP, self.prows) if self.kv8 else
                           tensor_map_paged(self.D, self.KH, self.PS, NP, self.prows))
            else:
                self.KH, ML = k.shape[1], k.shape[2]
                self.mk = (tensor_map8(self.D, ML, self.B * self.KH, plan.block_n) if self.kv8 else
                           tensor_map(self.D, ML, self.B * self.KH, plan.block_n))
            self.mq = tensor_map_gqa(self.D, self.H // self.KH, self.SQ, self.B * self.KH, plan.block_m)
        elif self.packed:  # q (total_q, H, D), k/v (total_k, KH, D)
            (TQ, self.H, self.D), (TK, self.KH) = q.shape, k.shape[:2]
            self.cq, self.ck = (np.asarray(c, np.int64) for c in cu_seqlens)
            self.B = len(self.cq) - 1
            self.mq = tensor_map_packed(self.D, TQ, self.H, plan.block_m, isz, plan.slab_cols)
            self.mk = tensor_map_packed(self.D, TK, self.KH, plan.block_n, isz, plan.slab_cols)
        else:
            self.B, self.H, self.SQ, self.D = q.shape
            self.KH, self.SK = k.shape[1], k.shape[2]
            self.mq = tensor_map(self.D, self.SQ, self.B * self.H, plan.block_m, isz, plan.slab_cols)
            self.mk = tensor_map(self.D, self.SK, self.B * self.KH, plan.block_n, isz, plan.slab_cols)
        self.G = self.H // self.KH
        self.plan, self.spec, self.dtype = plan, spec, dtype
        self.vis = Visibility.of(spec)
        self.causal = self.vis.causal
        self.slopes, self.sinks, self.starts = alibi_slopes, sinks, kv_start
        self.transforms, self.score_scale = transforms(spec), score_scale(spec)
        def as_bytes(x):  # 8-bit elements: their bytes
            return np.ascontiguousarray(x).view(np.uint8).ravel()

        self.gq = as_bytes(q) if self.f8 else to_bits(q, dtype).ravel()
        if self.f8 or self.kv8:
            self.gk, self.gv = as_bytes(k), as_bytes(v)
        else:
            self.gk, self.gv = (to_bits(x, dtype).ravel() for x in (k, v))
        self.qscale = 1.0 if self.transforms else self.score_scale
        self.t = np.arange(WARPGROUP)[:, None]
        self.rs, self.ro = np.arange(plan.block_n // 2)[None, :], np.arange(self.D // 2)[None, :]

    def start(self, b: int):
        return None if self.starts is None else int(self.starts[b])

    def k_factor(self, h: int) -> float:
        """The scales in the scores' factor of a block's head ``h``: an 8-bit cache's key scale
        (``h`` a KV head), fp8 inputs' q and key scales (``h`` a query head); 1 otherwise."""
        if self.f8:
            return float(self.q_scale[h]) * float(self.k_scale[h // self.G])
        return 1.0 if self.k_scale is None else float(self.k_scale[h])

    def values(self, x: np.ndarray) -> np.ndarray:
        """An operand's elements as float64: 16-bit words, or fp8 inputs' e4m3 bytes."""
        return isa_cvt8(x, "float8_e4m3fn") if self.f8 else from_bits(x, self.dtype)

    def q_coord(self, seq: dict, row0: int, h: int) -> tuple:
        """The kernel's TMA coordinates (past dim 0) of a block's Q box (``h``: a KV-cache tile's KV head)."""
        if self.cache:
            return 0, row0 // self.G, seq["b"] * self.KH + h
        return (h, seq["q0"] + row0) if self.packed else (row0, seq["b"] * self.H + h)

    def kv_coord(self, seq: dict, key0: int, kvh: int) -> tuple[int, int]:
        return (kvh, seq["k0"] + key0) if self.packed else (key0, seq["b"] * self.KH + kvh)

    def kv_boxes(self, seq: dict, key0: int, kvh: int) -> list:
        """A key tile's TMA boxes: (row offset in the tile, coordinates past dim 0); paged, one a
        page at its block_table entry, or page −1 past the sequence's pages (the kernel's ``kv_box``)."""
        if not self.paged:
            return [(0, self.kv_coord(seq, key0, kvh))]
        BN, PS, out = self.plan.block_n, self.PS, []
        for i in range(BN // self.prows):
            idx = key0 // PS + (i if PS < BN else 0)
            page = int(self.bt[seq["b"], idx]) if idx * PS < seq["k_len"] else -1
            out.append((i * self.prows, (kvh, key0 % PS if PS > BN else 0, page)))
        return out

    def pos(self, row):
        """A tile row's query position (a KV-cache tile: row = position · group + g)."""
        return row // self.G if self.cache else row

    def head(self, h, row):
        """A tile row's query head (``h``: the block's head, a KV-cache tile's KV head)."""
        return h * self.G + row % self.G if self.cache else np.full(np.shape(row), h)

    def blocks(self):
        """(sequence, first row) of every block with rows: bhsd each batch's row tiles; packed,
        the kernel's tile slots (sequence b's row tiles in the slots ``cq[b] // block_m + b + i``),
        each row tile of each sequence in exactly one slot."""
        BM = self.plan.block_m
        if not self.packed:
            for b in range(self.B):
                k_len = int(self.seqlens[b]) if self.cache else self.SK
                seq = {"b": b, "q0": 0, "k0": 0, "q_len": self.SQ, "k_len": k_len}
                for row0 in range(0, self.SQ * (self.G if self.cache else 1), BM):
                    yield seq, row0
            return
        seen = set()
        for slot in range(int(self.cq[-1]) // BM + self.B):
            b = max(i for i in range(self.B) if self.cq[i] // BM + i <= slot)
            row0 = (slot - int(self.cq[b]) // BM - b) * BM
            seq = {"b": b, "q0": int(self.cq[b]), "k0": int(self.ck[b]), "q_len": int(self.cq[b + 1] - self.cq[b]),
                   "k_len": int(self.ck[b + 1] - self.ck[b])}
            if row0 < seq["q_len"]:
                if (b, row0) in seen:
                    raise ModelError(f"two slots hold sequence {b}'s rows from {row0}")
                seen.add((b, row0))
                yield seq, row0
        want = {(b, r) for b in range(self.B) for r in range(0, int(self.cq[b + 1] - self.cq[b]), BM)}
        if seen != want:
            raise ModelError(f"no slot holds the row tiles {sorted(want - seen)}")

    def finish(self, seq: dict, h: int, trows: np.ndarray, o: np.ndarray, l: np.ndarray, m: np.ndarray,
               out: np.ndarray):
        """Tile rows ``trows`` of a block (``h``: its head, a KV-cache tile's KV head) from their
        unnormalised ``o (n, D)``, sums ``l`` and maxima ``m`` (log2 units): the sink in the
        denominator, zeros for a row that sees no key, stored where the rows go."""
        rows, heads = self.pos(trows), self.head(h, trows)
        if self.v_scale is not None:  # an 8-bit cache's value scale, once per output (fp8: h's KV head's)
            o = o * float(self.v_scale[h // self.G if self.f8 else h])
        if self.sinks is not None:  # the sink joins the denominator (_math.sink_terms)
            g = np.where(m == -np.inf, 0.0, m)
            sink = self.sinks[heads] * np.log2(np.e)
            top = np.maximum(g, sink)
            w, e = np.exp2(g - top), np.exp2(sink - top)
            o, l = o * w[:, None], l * w + e
        sees = np.broadcast_to(self.vis.sees_a_key(rows + seq["k_len"] - seq["q_len"], seq["k_len"],
                                                   self.start(seq["b"])), rows.shape)
        with np.errstate(invalid="ignore", divide="ignore"):
            val = np.where(sees[:, None], o / l[:, None], 0.0)
        keep = rows < seq["q_len"]
        if self.packed:
            out[seq["q0"] + rows[keep], h] = val[keep]
        else:
            out[seq["b"], heads[keep], rows[keep]] = val[keep]

    def splits(self, split_tasks: int) -> int:
        """The chunks a KV-cache step's sequences split into (``fused.n_splits``, and 1 unless a
        sequence's rows fit one row tile: ``fused_cuda.Split.active``)."""
        if not (self.cache and split_tasks):
            return 1
        ns = max(1, -(-split_tasks // (self.B * self.KH)))
        return ns if self.SQ * self.G <= self.plan.block_m else 1

    def chunk(self, nt: int, chunk: int, chunks: int) -> tuple[int, int]:
        """(first, count) of chunk ``chunk`` of a block's ``nt`` key tiles: equal shares of at
        least ``fused.MIN_SPLIT_KEYS`` keys, the chunks past the keys empty."""
        size = max(-(-MIN_SPLIT_KEYS // self.plan.block_n), -(-nt // chunks))
        return chunk * size, max(0, min(size, nt - chunk * size))

    def merge(self, op: np.ndarray, st: np.ndarray, out: np.ndarray):
        """The merge kernel: per (sequence, KV head) row, the chunks' states weighted by
        ``2^(m_s − max_s m_s)`` (a chunk that saw no key, m = −inf, weighs 0), then finished."""
        rows = np.arange(self.SQ * self.G)
        for b in range(self.B):
            seq = {"b": b, "q0": 0, "k0": 0, "q_len": self.SQ, "k_len": int(self.seqlens[b])}
            for kh in range(self.KH):
                m, l = st[:, b, kh, rows, 0], st[:, b, kh, rows, 1]
                top = m.max(0)
                w = np.exp2(m - np.where(top == -np.inf, 0.0, top))
                self.finish(seq, kh, rows, (op[:, b, kh, rows] * w[..., None]).sum(0), (l * w).sum(0), top, out)

    def tiles(self, seq: dict, row0: int) -> tuple[int, int]:
        """The block's key tiles (first, count), by the visibility's bounds (the kernel's ``tile_range``)."""
        BN, BM, vis = self.plan.block_n, self.plan.block_m, self.vis
        off, k_len = seq["k_len"] - seq["q_len"], seq["k_len"]
        begin = vis.key_begin(self.pos(row0) + off, self.start(seq["b"]))
        first = 0 if begin is None else vis.tiles_before(int(begin), BN)
        end = vis.key_end(self.pos(row0 + BM - 1) + 1 + off)
        last = -(-k_len // BN) if end is None else vis.tiles_to(min(k_len, max(int(end), 0)), BN)
        return first, max(last - first, 0)


def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, plan: SmemPlan, spec, dtype: str = "float16",
        pingpong: bool = True, overlap: bool = True, alibi_slopes=None, sinks=None, kv_start=None,
        cu_seqlens=None, cache_seqlens=None, block_table=None, split_tasks: int = 0, k_scale=None,
        v_scale=None, q_scale=None) -> np.ndarray:
    """The kernel's output for bhsd ``q (B, H, Sq, D)``, ``k``/``v (B, KH, Skv, D)``, or packed
    ``q (total_q, H, D)``, ``k``/``v (total_k, KH, D)`` with ``cu_seqlens = (cu_q, cu_k)``
    (float arrays, rounded to ``dtype``), and ``spec``'s mask and variants (their arguments as
    the call takes them), computed through the model in the kernel's order of events
    (``overlap``: tile j's S with tile j − 1's P·V, that tile's stage released after it);
    ``split_tasks``: a KV cache's split-KV (each chunk a block, its partials merged); an 8-bit
    cache (``spec.kv_dtype``): ``k``/``v`` its elements, ``k_scale``/``v_scale (kv_heads,)``;
    fp8 inputs (``spec.q_dtype``): ``q``/``k``/``v`` e4m3 elements, ``q_scale (heads,)`` too;
    float64, ``q``'s shape."""
    r = _Run(q, k, v, plan, spec, dtype, alibi_slopes, sinks, kv_start, cu_seqlens, cache_seqlens, block_table,
             k_scale, v_scale, q_scale)
    out = np.zeros(q.shape)
    chunks = r.splits(split_tasks)
    if chunks > 1:  # the workspace: NaN where no chunk wrote (the merge must not read it)
        op = np.full((chunks, r.B, r.KH, plan.block_m, r.D), np.nan)
        st = np.full((chunks, r.B, r.KH, plan.block_m, 2), np.nan)
    for (seq, row0), chunk in ((blk, c) for blk in r.blocks() for c in range(chunks)):
        first, nt = r.tiles(seq, row0)
        c0, nt = r.chunk(nt, chunk, chunks)
        first += c0
        if pingpong and plan.consumers == 2:
            pingpong_turns(nt, overlap)
        for h in range(r.KH if r.cache else r.H):  # a KV-cache tile: each KV head's query heads
            blk = _Block(r, seq, h, row0, nt, first)
            blk.load_q()
            prev = [None] * plan.consumers  # overlap: each consumer's P of the tile before
            for j in range(nt):  # loop tile j: key tile first + j
                blk.load_kv(j)
                for wg in range(plan.consumers):
                    S = blk.qk(wg, j)
                    if overlap:
                        if j:
                            blk.pv(wg, prev[wg], j - 1)
                        alpha, prev[wg] = blk.softmax(wg, first + j, S)
                        if j:
                            blk.rescale(wg, alpha)
                            blk.release(j - 1)
                    else:
                        alpha, P = blk.softmax(wg, first + j, S)
                        blk.rescale(wg, alpha)
                        blk.pv(wg, P, j)
                        blk.release(j)
            if overlap and nt:
                for wg in range(plan.consumers):
                    blk.pv(wg, prev[wg], nt - 1)
                    blk.release(nt - 1)
            if chunks > 1:
                blk.store_part(op, st, chunk)
            else:
                blk.store(out)
    if chunks > 1:
        r.merge(op, st, out)
    return out
