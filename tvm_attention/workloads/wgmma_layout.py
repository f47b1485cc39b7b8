"""Where the Hopper kernel's tiles live in shared memory and how ``wgmma`` reads them: one source
of truth for the kernel (``fused_wgmma``: its TMA boxes, mbarrier addresses and the descriptor
constants baked into its device helpers) and for the NumPy model that checks them offline
(``wgmma_model``). Pure Python: no TVM, no GPU.

Every tile is stored as TMA writes it with ``CU_TENSOR_MAP_SWIZZLE_128B``: 64-column slabs
(128 bytes of a 16-bit row) of ``rows × 128`` bytes, one after the other along the head dim, each
slab 1024-byte aligned; inside a slab the 16-byte chunk ``c`` of row ``r`` sits at chunk
``c ^ (r % 8)`` (:func:`swizzle128`: bits 4-6 of the byte address XOR bits 7-9). fp8 inputs at
head_dim 64 have rows of 64 bytes: their Q and K (and V's staging) take the 64B swizzle (bits 4-5
XOR bits 7-8, descriptor mode 2, ``SBO = 512``; :attr:`SmemPlan.span`).

``wgmma`` reads them through 64-bit shared-memory descriptors (PTX ISA, "Matrix Descriptor
Format": start address, leading and stride byte offsets, each ``>> 4``; the swizzle mode in bits
62-63). The canonical layouts (in 16-byte units ``T``; CUTLASS's ``make_gmma_desc``):

* K-major, 128B swizzle (Q as A, K as B of ``S = Q·Kᵀ``): ``((8, m), (T, 2)) : ((8T, SBO), (1,
  T))`` — 8 rows 128 bytes apart, groups of 8 rows ``SBO = 1024`` apart, a k16 step's 16
  elements contiguous; the next k16 step inside the same slab is the start address + 32 bytes,
  the next slab a slab further (LBO is unused: 16);
* MN-major, 128B swizzle (V as B of ``O = P·V``, transposed: V is stored ``[key][d]``): ``((T, 8,
  m), (8, k)) : ((1, T, LBO), (8T, SBO))`` — 64 head-dim columns contiguous, the next 64 one
  slab (``LBO = block_n · 128``) further, keys 128 bytes apart, groups of 8 keys ``SBO = 1024``
  apart; a k16 step (16 keys) is the start address + 2048 bytes.
"""
from __future__ import annotations

import dataclasses

#: 16-bit elements in a 128-byte swizzle atom's row: the TMA box's inner extent and a slab's width
SLAB_COLS = 64
ROW_BYTES = 128
#: 8 rows of 128 bytes: the swizzle pattern's period, the stride between core-matrix groups
GROUP_BYTES = 1024
#: rows of one warpgroup's wgmma (m64)
WG_ROWS = 64
WARPGROUP = 128
#: k16 steps in one 64-column slab (16 elements = 32 bytes each)
STEPS_PER_SLAB = SLAB_COLS // 16
MODE_SWIZZLE_128B = 1  # descriptor bits 62-63
MODE_SWIZZLE_64B = 2
TMA_SWIZZLE_128B = 3  # CUtensorMapSwizzle
TMA_SWIZZLE_64B = 2
#: a swizzle span (bytes of a row of its pattern) -> (descriptor mode, CUtensorMapSwizzle)
SWIZZLES = {128: (MODE_SWIZZLE_128B, TMA_SWIZZLE_128B), 64: (MODE_SWIZZLE_64B, TMA_SWIZZLE_64B)}


def swizzle128(addr: int) -> int:
    """The byte ``addr`` (of a 1024-byte aligned region) where the 128B swizzle puts it."""
    return addr ^ (((addr >> 7) & 7) << 4)


def encode_desc(addr: int, lbo: int, sbo: int, mode: int = MODE_SWIZZLE_128B) -> int:
    """A wgmma shared-memory descriptor (bits 0-13 start >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4,
    62-63 swizzle mode; base offset 0: every tile is 1024-byte aligned)."""
    for name, v in (("address", addr), ("lbo", lbo), ("sbo", sbo)):
        if v % 16 or not 0 <= v >> 4 < 1 << 14:
            raise ValueError(f"descriptor {name} {v} is not a multiple of 16 below 256 KiB")
    return (addr >> 4) | (lbo >> 4) << 16 | (sbo >> 4) << 32 | mode << 62


def decode_desc(desc: int) -> tuple[int, int, int, int]:
    """``(start, lbo, sbo, mode)`` of a descriptor (the inverse of :func:`encode_desc`)."""
    mask = (1 << 14) - 1
    return ((desc & mask) << 4, (desc >> 16 & mask) << 4, (desc >> 32 & mask) << 4, desc >> 62 & 3)


def desc_high(lbo: int, sbo: int, mode: int = MODE_SWIZZLE_128B) -> int:
    """A descriptor without its start address: the kernel adds ``address >> 4`` at run time."""
    return encode_desc(0, lbo, sbo, mode)


@dataclasses.dataclass(frozen=True)
class SmemPlan:
    """The shared memory of one thread block (byte offsets from its 1024-aligned base):
    Q ``block_m × head_dim``, then ``stages`` K tiles and ``stages`` V tiles of ``block_n ×
    head_dim``, each as ``head_dim / 64`` slabs; with ``kv8`` (an 8-bit cache) ``stages``
    staging pairs of its K and V tiles as TMA lands them (``block_n`` rows of ``head_dim``
    bytes, unswizzled); then the mbarriers (8 bytes each): Q full, K full per stage, V full per
    stage, stage empty per stage, and with ``kv8`` staging full per stage.

    fp8 inputs (``itemsize`` 1, ``vt8``): Q and K tiles as above with 128 elements a slab row (64
    at head_dim 64, the 64B swizzle; wgmma's k32 steps are 32 bytes, as k16's are), each V tile
    as TMA lands it in a staging stage (``vs_tile``; K's layout), and the consumers' V stage
    transposed, ``Vᵀ`` (``head_dim`` rows of ``block_n`` keys, slabs of 128 keys, K-major: fp8
    wgmma reads no transposed operand), its keys in the order of P's registers
    (:data:`VT_KEY`); the staging's full barriers then."""

    head_dim: int
    block_m: int
    block_n: int
    stages: int
    itemsize: int = 2
    kv8: bool = False
    vt8: bool = False

    def __post_init__(self):
        if self.itemsize not in (1, 2) or self.vt8 != (self.itemsize == 1) or (self.kv8 and self.vt8):
            raise ValueError("the 128B-swizzled slabs hold 16-bit elements (64 a row), or fp8 inputs' (128 a row, "
                             "vt8, V transposed)")
        if self.head_dim % self.slab_cols:
            raise ValueError(f"head_dim={self.head_dim} must be a multiple of {self.slab_cols} (128-byte slabs)")
        if self.head_dim * self.itemsize < ROW_BYTES and not self.vt8:
            raise ValueError(f"head_dim={self.head_dim}: 16-bit rows of 128 bytes or more (64B swizzle: fp8 inputs')")
        if self.block_m % WG_ROWS or self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise ValueError(f"block_m={self.block_m} must be a multiple of 64 and block_n={self.block_n} "
                             "a multiple of 16 in [16, 256] (wgmma m64nNk16)")
        if self.vt8 and self.block_n % ROW_BYTES:
            raise ValueError(f"block_n={self.block_n}: fp8 inputs' Vᵀ rows are 128-byte swizzled slabs of keys, so "
                             "block_n must be a multiple of 128")

    @property
    def span(self) -> int:
        """Bytes of a row of Q's and K's swizzle pattern: 128 (the 128B swizzle), or 64 where a
        row is that short (fp8 inputs at head_dim 64: the 64B swizzle, rows 64 bytes apart, its
        16-byte chunk ``c`` of row ``r`` at ``c ^ (r / 2 % 4)``)."""
        return min(ROW_BYTES, self.head_dim * self.itemsize)

    @property
    def slab_cols(self) -> int:
        """Elements of a slab's row: 64 of 16 bits, 128 of fp8 (64 at head_dim 64): the TMA box's
        inner extent."""
        return self.span // self.itemsize

    @property
    def steps_per_slab(self) -> int:
        """k steps (32 bytes each) in a slab's row."""
        return self.span // 32

    @property
    def slabs(self) -> int:
        return self.head_dim // self.slab_cols

    @property
    def consumers(self) -> int:
        """Consumer warpgroups: one per 64 query rows."""
        return self.block_m // WG_ROWS

    @property
    def q_bytes(self) -> int:
        return self.block_m * self.head_dim * self.itemsize

    @property
    def kv_tile_bytes(self) -> int:
        return self.block_n * self.head_dim * self.itemsize

    def q_slab(self, slab: int) -> int:
        return slab * self.block_m * self.span

    def k_tile(self, stage: int) -> int:
        return self.q_bytes + stage * self.kv_tile_bytes

    def v_tile(self, stage: int) -> int:
        return self.q_bytes + (self.stages + stage) * self.kv_tile_bytes

    def kv_slab(self, slab: int) -> int:
        return slab * self.block_n * self.span

    @property
    def kv8_tile_bytes(self) -> int:
        """An 8-bit K (or V) tile as it lands: ``block_n`` rows of ``head_dim`` bytes."""
        return self.block_n * self.head_dim

    def k8_tile(self, stage: int) -> int:
        return self.q_bytes + 2 * self.stages * self.kv_tile_bytes + 2 * stage * self.kv8_tile_bytes

    def v8_tile(self, stage: int) -> int:
        return self.k8_tile(stage) + self.kv8_tile_bytes

    def vs_tile(self, stage: int) -> int:
        """fp8 inputs: V's staging tile of ``stage`` (as TMA lands it, swizzled as K's)."""
        return self.q_bytes + (2 * self.stages + stage) * self.kv_tile_bytes

    def vt_slab(self, slab: int) -> int:
        """fp8 inputs: the offset in a ``Vᵀ`` tile of its slab of keys ``128·slab ..``."""
        return slab * self.head_dim * ROW_BYTES

    @property
    def barriers(self) -> int:
        staging = 2 * self.kv8_tile_bytes if self.kv8 else self.kv_tile_bytes if self.vt8 else 0
        return self.q_bytes + self.stages * (2 * self.kv_tile_bytes + staging)

    def bar_full_q(self) -> int:
        return self.barriers

    def bar_full_k(self, stage: int) -> int:
        return self.barriers + 8 * (1 + stage)

    def bar_full_v(self, stage: int) -> int:
        return self.barriers + 8 * (1 + self.stages + stage)

    def bar_empty(self, stage: int) -> int:
        return self.barriers + 8 * (1 + 2 * self.stages + stage)

    def bar_full8(self, stage: int) -> int:
        """An 8-bit stage's K and V landed (TMA's transaction count)."""
        return self.barriers + 8 * (1 + 3 * self.stages + stage)

    @property
    def used_bytes(self) -> int:
        return self.barriers + 8 * (1 + (4 if self.kv8 or self.vt8 else 3) * self.stages)

    @property
    def vt_units(self) -> int:
        """fp8 inputs: the transpose's 4 × 4-byte blocks of a V tile (32 a warp's instruction)."""
        return self.block_n * self.head_dim // 16

    @property
    def cvt_chunks(self) -> int:
        """16-byte chunks of an 8-bit tile: each converts to two chunks of the 16-bit tile."""
        return self.kv8_tile_bytes // 16

    @property
    def alloc_bytes(self) -> int:
        """The dynamic allocation: the used bytes and 1024 of slack to align the base (dynamic
        shared memory is only 16-byte aligned)."""
        return self.used_bytes + GROUP_BYTES

    # -- the descriptors of each wgmma (start offsets; constant high bits) -------------------
    @property
    def qk_steps(self) -> int:
        """wgmma k steps of Q·Kᵀ: 32 bytes of head_dim each (k16 of 16 bits, k32 of fp8)."""
        return self.head_dim * self.itemsize // 32

    @property
    def pv_steps(self) -> int:
        return self.block_n * self.itemsize // 32

    def q_rows(self, wg):
        """Where consumer ``wg``'s 64 rows of Q start (in every slab)."""
        return wg * WG_ROWS * self.span

    def q_step(self, kk: int) -> int:
        """Start of Q's descriptor at k16 step ``kk``, relative to a consumer's rows."""
        return self.q_slab(kk // self.steps_per_slab) + kk % self.steps_per_slab * 32

    def k_step(self, kk: int) -> int:
        """Start of K's descriptor (relative to its stage's tile) at k16 step ``kk``."""
        return self.kv_slab(kk // self.steps_per_slab) + kk % self.steps_per_slab * 32

    def v_step(self, kk: int) -> int:
        """Start of V's descriptor (relative to its stage's tile) at the keys of k16 step ``kk``;
        fp8 inputs: of ``Vᵀ``'s k32 step ``kk`` (K-major, as K's)."""
        if self.vt8:
            return self.vt_slab(kk // STEPS_PER_SLAB) + kk % STEPS_PER_SLAB * 32
        return kk * 16 * ROW_BYTES

    kmajor_lbo = 16  # unused by a swizzled K-major layout (CUTLASS writes 1, in 16-byte units)
    sbo = GROUP_BYTES  # V's (MN-major) and V^T's: groups of 8 rows of 128 bytes

    @property
    def qk_sbo(self) -> int:
        """Q's and K's: groups of 8 rows of the span (1024 bytes; 512 in the 64B swizzle)."""
        return 8 * self.span

    @property
    def v_lbo(self) -> int:
        """V (MN-major): the stride between its 64-column slabs."""
        return self.block_n * ROW_BYTES

    @property
    def qk_desc_high(self) -> int:
        return desc_high(self.kmajor_lbo, self.qk_sbo, SWIZZLES[self.span][0])

    @property
    def tma_swizzle(self) -> int:
        """Q's and K's (and fp8 inputs' V staging) CUtensorMapSwizzle."""
        return SWIZZLES[self.span][1]

    @property
    def pv_desc_high(self) -> int:
        return desc_high(self.kmajor_lbo, self.sbo) if self.vt8 else desc_high(self.v_lbo, self.sbo)


# -- what the kernel's code assumes of the hardware (checked against the ISA by wgmma_model) ----
def acc_row(thread, reg):
    """The row (within the warpgroup's 64) of accumulator register ``reg`` of ``thread``: warp
    ``w`` holds rows ``16w + lane / 4`` and ``+ 8``; ints or TIR expressions."""
    return thread // 32 * 16 + thread % 32 // 4 + 8 * (reg % 4 // 2)


def acc_col(thread, reg):
    """The column of accumulator register ``reg`` of ``thread``: four registers per 8 columns,
    columns ``2·(lane % 4)`` and ``+ 1`` of each row."""
    return reg // 4 * 8 + 2 * (thread % 4) + reg % 2


def p_pair(kk: int, q: int) -> int:
    """P's A fragment: register ``q`` (0-3) of k16 step ``kk`` packs score registers ``2i`` (low
    half) and ``2i + 1`` of ``i = 4·kk + q`` (the helper's packing order)."""
    return 4 * kk + q


def p_byte(kk: int, q: int, b: int) -> int:
    """fp8 inputs: P's A fragment of k32 step ``kk``: byte ``b`` (0 lowest) of register ``q``
    (0-3) is score register ``p_byte(kk, q, b)`` rounded to e4m3 (the helper's packing order).
    The accumulator's registers, in place: ``q`` names a row half (``q % 2``) and a 16-key half
    of the step (``q // 2``), ``b`` a key pair's element (``b % 2``) and which 8 keys (``b // 2``):
    a thread's keys ``2c, 2c+1, 8+2c, 9+2c`` (c = lane % 4) of each 16, which the A fragment reads
    as k = ``4c .. 4c+3``: V's keys are stored in that order (:data:`VT_KEY`), so P needs no shuffle."""
    return 16 * kk + 8 * (q // 2) + 2 * (q % 2) + 4 * (b // 2) + b % 2


def full_parity(j, stages):
    """The phase parity a consumer waits for on key tile ``j``'s full barrier: its stage's
    ``(j // stages)``-th fill."""
    return j // stages % 2


def empty_parity(j, stages):
    """The phase parity the producer waits for on tile ``j``'s stage's empty barrier (``j >=
    stages``): the release of tile ``j − stages``."""
    return (j // stages - 1) % 2


#: Where the converter puts chunk ``i`` of an 8-bit tile (16 elements: row ``i / (head_dim / 16)``,
#: columns from ``16 · (i % (head_dim / 16))``) in the 16-bit tile, as its two 16-byte halves
#: ``h`` 0 and 1: the columns' slab, the row, and the 128B swizzle of their chunk in the row.
#: One text for both languages: the kernel's helper compiles it as C++ (unsigned ints), and
#: :func:`cvt_dst` evaluates it in Python (``/`` read as ``//``).
CVT_DST = ("(i % {cpr} / 4) * {slab_bytes} + (i / {cpr}) * 128 + "
           "((((i % {cpr}) % 4) * 2 + h) ^ ((i / {cpr}) % 8)) * 16")


#: fp8 inputs' transpose of a V tile (staging, K's swizzled layout) into ``Vᵀ`` by the producer
#: warpgroup: its warp instruction ``n`` (of ``vt_units / 32``; warp ``w`` takes ``n ≡ w mod 4``)
#: gives lane ``lane`` the 4 × 4 block of positions ``4·pg ..`` and head-dim columns ``4·dg ..``.
#: Lane ``lane`` reads key ``VT_KEY`` (``i`` 0-3) at ``VT_SRC``, and after a byte transpose
#: writes column ``d = 4·dg + e`` at ``VT_DST``. The lane mapping makes each warp's 4-byte reads
#: and writes hit 32 distinct banks (both swizzles XOR the chunk). Texts for both languages, as
#: :data:`CVT_DST` (``{dslabs}``: head_dim / 128; ``{slab_bytes}``: a staging slab; ``{vt_slab}``).
VT_PG = "32 * (n / 32 / {dslabs}) + lane"
#: ``__byte_perm`` selectors of the 4 × 4 byte transpose: words 0-1 (and 2-3) interleaved by their
#: bytes 0-1, by their bytes 2-3; then two such pairs' columns e = 0 (2) and e = 1 (3)
VT_PERM = (0x5140, 0x7362, 0x5410, 0x7632)
VT_DG = "32 * (n / 32 % {dslabs}) + (2 * (lane / 4) + lane % 2 + n) % 32"
VT_KEY = "16 * (pg / 4) + 2 * (pg % 4) + i % 2 + 8 * (i / 2)"
VT_SRC = "(dg / 32) * {slab_bytes} + key * 128 + (((dg % 32) / 4) ^ (key % 8)) * 16 + (dg % 4) * 4"
#: ... at head_dim 64 (the staging tile in the 64B swizzle: rows of 64 bytes, chunk ^ (key / 2 % 4)):
#: instruction n's 16 column groups of a row for 32 position groups (128 keys) a 16 instructions;
#: the writes stay conflict free, the reads 2-way (a warp's keys fall on 16 banks' pairs)
VT_PG64 = "32 * (n / 16) + lane"
VT_DG64 = "(2 * (lane / 4) + lane % 2 + n) % 16"
VT_SRC64 = "key * 64 + ((dg / 4) ^ (key / 2 % 4)) * 16 + (dg % 4) * 4"
VT_DST = "(pg / 32) * {vt_slab} + d * 128 + (((pg % 32) / 4) ^ (d % 8)) * 16 + (pg % 4) * 4"


def vt_text(plan: SmemPlan, text: str) -> str:
    """One of the transpose's texts with ``plan``'s constants."""
    return text.format(dslabs=plan.head_dim // ROW_BYTES, slab_bytes=plan.kv_slab(1), vt_slab=plan.vt_slab(1))


def vt_texts(plan: SmemPlan, pg=None, dg=None, key=None, src=None, dst=None) -> tuple[str, ...]:
    """The transpose's texts for ``plan`` (PG, DG, KEY, SRC, DST), each the module's unless given:
    at head_dim 64 its staging is in the 64B swizzle (:data:`VT_DG64`, :data:`VT_SRC64`)."""
    wide = plan.span == ROW_BYTES
    return (pg or (VT_PG if wide else VT_PG64), dg or (VT_DG if wide else VT_DG64), key or VT_KEY,
            src or (VT_SRC if wide else VT_SRC64), dst or VT_DST)


def vt_eval(plan: SmemPlan, text: str, **names):
    """A transpose text evaluated in Python (``/`` read as ``//``) over ``names`` (ints or arrays)."""
    return eval(vt_text(plan, text).replace("/", "//"), {}, dict(names))


def cvt_dst(plan: SmemPlan, i, h):
    """:data:`CVT_DST` evaluated in Python for chunk ``i`` and half ``h`` (ints or arrays)."""
    return eval(CVT_DST.format(cpr=plan.head_dim // 16, slab_bytes=plan.kv_slab(1)).replace("/", "//"),
                {}, {"i": i, "h": h})


def tensor_map8(cols: int, rows, planes, box_rows: int):
    """``cuTensorMapEncodeTiled``'s arguments for an 8-bit cache ``(planes, rows, cols)`` (bytes),
    viewed as ``(cols, rows, planes)``: a box is a whole row of ``cols`` bytes × ``box_rows``,
    unswizzled (the staging tile the converter reads)."""
    return ((cols, rows, planes), (cols, rows * cols), (cols, box_rows, 1), (1, 1, 1))


def tensor_map8_paged(cols: int, kv_heads: int, page_size: int, pages, box_rows: int):
    """An 8-bit page pool ``(pages, page_size, kv_heads, cols)`` viewed as ``(cols, kv_heads,
    page_size, pages)``: a box is one KV head's ``box_rows`` whole rows of a page, unswizzled."""
    return ((cols, kv_heads, page_size, pages), (cols, kv_heads * cols, page_size * kv_heads * cols),
            (cols, 1, box_rows, 1), (1, 1, 1, 1))


def tensor_map_packed(cols: int, total, heads, box_rows: int, itemsize: int = 2, box_cols: int | None = None):
    """``cuTensorMapEncodeTiled``'s arguments for a packed tensor ``(total, heads, cols)`` viewed
    as ``(cols, heads, total)`` (innermost first): a box is 128 bytes of columns (64; fp8: 128)
    of one head's ``box_rows`` rows, laid out in shared memory as a bhsd box is (a row of 128
    bytes a slab)."""
    return ((cols, heads, total), (cols * itemsize, heads * cols * itemsize),
            (box_cols or ROW_BYTES // itemsize, 1, box_rows), (1, 1, 1))


def tensor_map_gqa(cols: int, group: int, positions, planes, box_rows: int, itemsize: int = 2):
    """``cuTensorMapEncodeTiled``'s arguments for Q ``(B, H, Sq, D)`` of a KV-cache tile, viewed
    as ``(cols, group, positions, batch·kv heads)`` (innermost first): a box is 64 columns of
    ``box_rows`` rows ordered position-major (row = position · group + g), the KV head's query
    heads side by side."""
    return ((cols, group, positions, planes),
            (positions * cols * itemsize, cols * itemsize, group * positions * cols * itemsize),
            (SLAB_COLS, group, box_rows // group, 1), (1, 1, 1, 1))


def tensor_map_paged(cols: int, kv_heads: int, page_size: int, pages, box_rows: int, itemsize: int = 2):
    """``cuTensorMapEncodeTiled``'s arguments for a page pool ``(pages, page_size, kv_heads, cols)``
    viewed as ``(cols, kv_heads, page_size, pages)``: a box is 64 columns of one KV head's
    ``box_rows`` rows of one page (a page, or a key tile's share of one)."""
    return ((cols, kv_heads, page_size, pages),
            (cols * itemsize, kv_heads * cols * itemsize, page_size * kv_heads * cols * itemsize),
            (SLAB_COLS, 1, box_rows, 1), (1, 1, 1, 1))


def tensor_map(cols: int, rows, planes, box_rows: int, itemsize: int = 2, box_cols: int | None = None):
    """The arguments of ``cuTensorMapEncodeTiled`` for a tensor viewed as ``(cols, rows, planes)``
    (innermost first): dims, byte strides of dims 1 and 2, the box (128 bytes of columns: 64, or
    128 of fp8, × ``box_rows`` × 1), element strides."""
    return ((cols, rows, planes), (cols * itemsize, rows * cols * itemsize), (box_cols or ROW_BYTES // itemsize,
                                                                              box_rows, 1), (1, 1, 1))
