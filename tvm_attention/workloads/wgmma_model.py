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

Products are computed in float64 from the 16-bit inputs (P rounded to 16 bits as the helper
does), so the model's output matches the float64 reference to the 16-bit rounding of P: a wrong
address, swizzle, stride or fragment index gives a wrong row, not a small error.
"""
from __future__ import annotations

import numpy as np

from .wgmma_layout import (
    MODE_SWIZZLE_128B,
    ROW_BYTES,
    WARPGROUP,
    WG_ROWS,
    SmemPlan,
    acc_col,
    acc_row,
    decode_desc,
    empty_parity,
    full_parity,
    p_pair,
    tensor_map,
)


class ModelError(AssertionError):
    """The kernel's data movement breaks a rule of the hardware it targets."""


# -- the hardware, from the ISA --------------------------------------------------------------------
def _swizzle(addr: np.ndarray) -> np.ndarray:
    return addr ^ (((addr >> 7) & 7) << 4)


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


class Smem:
    """A block's shared memory as 16-bit words, addressed in bytes from a 1024-aligned base."""

    def __init__(self, nbytes: int):
        self.words = np.full(nbytes // 2, 0x7E00, dtype=np.uint16)  # NaN: a read of unwritten memory shows

    def tma_box(self, dst: int, g: np.ndarray, dims, strides, box, coords, itemsize: int = 2) -> int:
        """A 3-D TMA load of ``box`` (innermost first) at ``coords`` of the tensor whose dims and
        byte strides the tensor map holds, from ``g`` (the tensor's 16-bit words, flat), into
        ``dst`` with the 128B swizzle; returns the bytes it carries."""
        if dst % 1024:
            raise ModelError(f"TMA destination {dst} is not 1024-byte aligned (128B swizzle)")
        if box[0] * itemsize != ROW_BYTES:
            raise ModelError(f"box inner extent {box[0]} × {itemsize} B is not the 128-byte swizzle span")
        if strides[0] % 16 or strides[1] % 16:
            raise ModelError(f"global strides {strides} are not multiples of 16 bytes")
        c = np.arange(box[0])[None, :]
        r = np.arange(box[1])[:, None]
        col, row, plane = coords[0] + c, coords[1] + r, coords[2]
        inside = (col < dims[0]) & (row < dims[1]) & (plane < dims[2]) & (col >= 0) & (row >= 0)
        flat = plane * strides[1] // itemsize + row * strides[0] // itemsize + col
        vals = np.where(inside, g[np.where(inside, flat, 0)], 0).astype(np.uint16)
        addr = dst + r * ROW_BYTES + c * itemsize
        self.words[_swizzle(addr) // 2] = vals
        return box[0] * box[1] * box[2] * itemsize

    def kmajor(self, desc: int, rows: int, base: int) -> np.ndarray:
        """The ``rows × 16`` operand a K-major 128B-swizzled descriptor names (words)."""
        start, _lbo, sbo, mode = decode_desc(desc)
        if mode != MODE_SWIZZLE_128B:
            raise ModelError(f"descriptor mode {mode}: the tiles are 128B-swizzled")
        start -= base  # shared addresses: this model's words start at the (1024-aligned) base
        r = np.arange(rows)[:, None]
        k = np.arange(16)[None, :]
        addr = start + r % 8 * ROW_BYTES + r // 8 * sbo + k // 8 * 16 + k % 8 * 2
        return self.words[_swizzle(addr) // 2]

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
def pingpong_turns(n_tiles: int, first_arrival: bool = True) -> list:
    """The consumers' named-barrier protocol for ``n_tiles`` key tiles (two warpgroups, barriers
    1 and 2 of 256 threads), as ``fused_wgmma``'s consumer issues it: consumer 1 arrives on
    consumer 0's barrier once (``first_arrival``: the first turn is consumer 0's); before each
    product (``S = Q·Kᵀ``, ``O += P·V``) a consumer syncs on its own barrier, after issuing it
    arrives on the other's; consumer 0 syncs once more at the end. Runs both sequences,
    round-robin, until both end; raises on a deadlock or an arrival left pending, and returns
    the order of the product issues."""
    seqs = []
    for wg in (0, 1):
        ops = [("arrive", 1)] if wg == 1 and first_arrival else []
        for j in range(n_tiles):
            for gemm in ("qk", "pv"):
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


def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, plan: SmemPlan, causal: bool, scale: float,
        dtype: str = "float16", pingpong: bool = True) -> np.ndarray:
    """The kernel's output for ``q (B, H, Sq, D)``, ``k``/``v (B, KH, Skv, D)`` (float arrays,
    rounded to ``dtype``), computed through the model; float64 ``(B, H, Sq, D)``."""
    B, H, SQ, D = q.shape
    KH, SK = k.shape[1], k.shape[2]
    G = H // KH
    BM, BN, NS = plan.block_m, plan.block_n, plan.stages
    gq, gk, gv = (to_bits(x, dtype).ravel() for x in (q, k, v))
    mq, mk = tensor_map(D, SQ, B * H, BM), tensor_map(D, SK, B * KH, BN)
    off = SK - SQ
    qscale = scale * np.log2(np.e)
    out = np.zeros((B, H, SQ, D))
    t = np.arange(WARPGROUP)[:, None]
    rs, ro = np.arange(BN // 2)[None, :], np.arange(D // 2)[None, :]
    base = 0x4400  # any 1024-aligned shared address
    for b in range(B):
        for h in range(H):
            for bx in range((SQ + BM - 1) // BM):
                row0 = bx * BM
                nt = -(-SK // BN)
                if causal:
                    nt = -(-min(SK, max(row0 + BM + off, 0)) // BN)
                if pingpong and plan.consumers == 2:
                    pingpong_turns(nt)
                sm = Smem(plan.alloc_bytes)
                full_q = Barrier(1)
                full_k = [Barrier(1) for _ in range(NS)]
                full_v = [Barrier(1) for _ in range(NS)]
                empty = [Barrier(WARPGROUP * plan.consumers) for _ in range(NS)]
                # the producer's Q
                full_q.arrive(plan.q_bytes)
                for sl in range(plan.slabs):
                    full_q.land(sm.tma_box(plan.q_slab(sl), gq, mq[0], mq[1], mq[2], (sl * 64, row0, b * H + h)))
                if not full_q.passes(0):
                    raise ModelError("Q's barrier did not complete with Q's boxes")
                state = [{"m": np.full((WARPGROUP, 2), -np.inf), "l": np.zeros((WARPGROUP, 2)),
                          "o": np.zeros((WARPGROUP, D // 2))} for _ in range(plan.consumers)]
                for j in range(nt):
                    s = j % NS
                    # the producer: stage s free (the release of tile j - NS), then K and V of tile j
                    if j >= NS and not empty[s].passes(empty_parity(j, NS)):
                        raise ModelError(f"tile {j}: the producer's wait on stage {s} would block forever")
                    if full_k[s].passes(full_parity(j, NS)):
                        raise ModelError(f"tile {j}: the consumers' wait on stage {s} passes before its K lands")
                    full_k[s].arrive(plan.kv_tile_bytes)
                    full_v[s].arrive(plan.kv_tile_bytes)
                    for sl in range(plan.slabs):
                        full_k[s].land(sm.tma_box(plan.k_tile(s) + plan.kv_slab(sl), gk, mk[0], mk[1], mk[2],
                                                  (sl * 64, j * BN, b * KH + h // G)))
                        full_v[s].land(sm.tma_box(plan.v_tile(s) + plan.kv_slab(sl), gv, mk[0], mk[1], mk[2],
                                                  (sl * 64, j * BN, b * KH + h // G)))
                    if not (full_k[s].passes(full_parity(j, NS)) and full_v[s].passes(full_parity(j, NS))):
                        raise ModelError(f"tile {j}: stage {s}'s barriers did not complete with its boxes")
                    for wg in range(plan.consumers):
                        st = state[wg]
                        wrow0 = row0 + wg * WG_ROWS
                        # S = Q·Kᵀ through the descriptors the helper builds
                        acc = np.zeros((WG_ROWS, BN))
                        for kk in range(plan.qk_steps):
                            da = plan.qk_desc_high | ((base + plan.q_rows(wg) + plan.q_step(kk)) >> 4)
                            db = plan.qk_desc_high | ((base + plan.k_tile(s) + plan.k_step(kk)) >> 4)
                            a = from_bits(sm.kmajor(da, WG_ROWS, base), dtype)
                            bk = from_bits(sm.kmajor(db, BN, base), dtype)
                            acc += a @ bk.T
                        r_, c_ = isa_acc(t, rs)
                        S = acc[r_, c_]  # the registers the hardware fills
                        # the kernel's softmax on its registers (its own fragment indexing)
                        rows = wrow0 + acc_row(t, rs)
                        keys = j * BN + acc_col(t, rs)
                        vis = keys < SK
                        if causal:
                            vis &= keys <= rows + off
                        S = np.where(vis, S, -np.inf)
                        half = rs % 4 // 2
                        mt = np.stack([np.where(half == hh, S, -np.inf).max(1) for hh in (0, 1)], 1)
                        mt = mt.reshape(WARPGROUP // 4, 4, 2).max(1).repeat(4, 0)  # the row's four lanes
                        mn = np.maximum(st["m"], mt * qscale)
                        ref = np.where(mn == -np.inf, 0.0, mn)
                        alpha = np.exp2(st["m"] - ref)
                        st["l"] *= alpha
                        st["o"] *= alpha[t, ro % 4 // 2]
                        st["m"] = mn
                        P = np.exp2(S * qscale - ref[t, half])
                        st["l"] += np.stack([np.where(half == hh, P, 0).sum(1) for hh in (0, 1)], 1)
                        # P's registers as the helper packs them, read by the hardware as A fragments
                        pw = from_bits(to_bits(P, dtype), dtype)
                        for kk in range(plan.pv_steps):
                            a = np.zeros((WG_ROWS, 16))
                            for qreg in range(4):
                                for hf in range(2):
                                    ar, ak = isa_a(t[:, 0], np.array(qreg), np.array(hf))
                                    a[ar, ak] = pw[:, 2 * p_pair(kk, qreg) + hf]
                            db = plan.pv_desc_high | ((base + plan.v_tile(s) + plan.v_step(kk)) >> 4)
                            bv = from_bits(sm.mnmajor(db, D, base), dtype)
                            o_r, o_c = isa_acc(t, ro)
                            omat = np.zeros((WG_ROWS, D))
                            omat[o_r, o_c] = st["o"]
                            omat += a @ bv
                            st["o"] = omat[o_r, o_c]
                        if j + NS < nt and empty[s].passes(empty_parity(j + NS, NS)):
                            raise ModelError(f"tile {j + NS}: the producer's wait passes before tile {j} is released")
                        for _ in range(WARPGROUP):  # every consumer thread arrives
                            empty[s].arrive()
                for wg in range(plan.consumers):
                    st = state[wg]
                    rows = row0 + wg * WG_ROWS + acc_row(t, ro)
                    cols = acc_col(t, ro)
                    lsum = st["l"].reshape(WARPGROUP // 4, 4, 2).sum(1).repeat(4, 0)
                    sees = (rows + off >= 0) if causal else np.full(rows.shape, SK > 0)
                    with np.errstate(invalid="ignore", divide="ignore"):
                        val = np.where(sees, st["o"] / lsum[t, ro % 4 // 2], 0.0)
                    keep = rows < SQ
                    out[b, h, rows[keep], np.broadcast_to(cols, rows.shape)[keep]] = val[keep]
    return out
