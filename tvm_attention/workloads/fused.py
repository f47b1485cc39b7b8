"""The fused (FlashAttention-style) PrimFunc: QKᵀ, softmax and PV share one tile.

For each (batch, head, row tile of ``block_m`` query rows) the kernel streams K/V column
tiles of ``block_n`` keys. The transposed query tile, the score tile, the running max ``m``,
the running sum ``l`` and the output accumulator live in ``local`` buffers of the
``row_tile`` block; nothing of size seq_q × seq_kv exists anywhere.

The score tile is kept transposed, ``St[block_n, block_m]`` (key-major), so that every
row-wise softmax reduction is an element-wise vector op across query rows and the QKᵀ
product broadcasts one K element against a vector of query rows; no K transpose is needed.

Online softmax, per K/V tile (``m`` and scores in log2 units: q is pre-scaled by
``scale·log2(e)`` so ``exp`` becomes ``exp2``)::

    m_new = max(m, rowmax(S))                    # row_max
    m_ref = 0 if m_new == -inf else m_new         # guard: a fully masked tile cannot make NaN
    alpha = exp2(m - m_ref)                       # online_correction
    P = exp2(S - m_ref)                           # P_exp (masked entries are exactly 0)
    l = l·alpha + rowsum(P)                       # row_sum
    acc = acc·alpha + P·V                         # PV_gemm

and finally ``O = acc / l`` (``0`` for a row the mask gives no key; NaN in gives NaN out).

Named blocks, found by name in ``schedules/``: ``row_tile`` (one per (b, h, row tile); holds the
local buffers), ``Q_load``, ``state_init``, ``acc_init``, ``kv_tile`` (one per key tile), and in
it ``S_gemm``, ``row_max``, ``online_correction``, ``max_commit``, ``P_exp``, ``row_sum``, ``PV_gemm``; then
``O_store``. Inside ``kv_tile`` each buffer has a single writer, so ``S_gemm``, ``row_max``,
``row_sum`` and ``PV_gemm`` are reductions whose ``init`` holds the correction
(``l·alpha``, ``acc·alpha``) and ``decompose_reduction`` can hoist it. Optional: ``lse_store``
(``return_lse``), ``state_store`` (split-KV partials), ``K_load`` (a staged key tile) and
``score_mod`` (a softcap or ALiBi spec: the modified scores, written to a buffer ``Sm`` of their own
that ``row_max`` and ``P_exp`` read; a window, sinks and ``kv_start`` need no block: they change
the mask, the key-tile range and the store), ``scale_load``/``group_scale_load`` (an 8-bit
cache's per-token or per-group scales of a key tile: ``_scale_macro``).

Frames (the layout entry's ``packed`` picks one): ``_dense`` for the layouts whose queries are
dense ``(B, H, Sq, D)`` (``bhsd``, ``kvcache``, ``paged``; they differ only in where keys live, the
entry's ``addressing`` class in :mod:`.kv`), with the GQA-packed decode nests and split-KV of a
symbolic seq_q; ``_varlen`` for the packed layout.
"""
from __future__ import annotations

import copy
import dataclasses
import math

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.sym.analyzer import Analyzer

from ..quant import QMAX, SCALE_GROUP
from ..spec import DATA_ALIGNMENT as A, ENTRY, MAX_SEQ_LEN, AttentionSpec
from ..tvm_internals import fast_macros
from ..visibility import Visibility
from ._math import (EXP2_POLY, EXP2_POLY_BF16, KV_UNIT, bf16_exact_bits, bf16_pair_word, bf16_value, cast_to,
                    exp2_fast, f32, f32_to_kv, guarded, kv_to_f32, lse_of, ssa_checked)
from . import amx, bf16dot, vector
from .knob_attrs import FUSED_DECODE, FUSED_FORM, FUSED_TILE, record
from .index_checks import scale_ok
from .kv import dim, kv_layout
from .variants import NO_VARIANTS, TEMPLATE_ARGS, ExtraParams, Variants, score_scale, transforms

CACHE_LINE = 64  # bytes (x86)


@fast_macros  # TVMScript macro expansion without its costly stack walk, only while this generates
def fused_attention(spec: AttentionSpec, block_m: int, block_n: int, decode_rows: tuple[int, ...] = (),
                    split_tasks: int = 0, stage_k_below: int = 0, dot_bf16: int = 0,
                    prefetch: int = 0, decode_heads: int = 1, decode_dot: int = 0,
                    decode_block_n: int = 0) -> tirx.PrimFunc:
    """Build the fused PrimFunc for ``spec`` with row tile ``block_m`` and key tile ``block_n``.

    Arguments of the PrimFunc (call order) are the layout's (``tvm_attention.layouts``); bhsd:
    ``Q (B, H, Sq, D)``, ``K (B, KH, Skv, D)``, ``V (B, KH, Skv, D)``, ``O (B, H, Sq, D)``; all
    ``spec.dtype``, compact row-major. A dim in ``spec.dynamic`` is a symbolic ``T.int32`` var.

    ``decode_rows``: row counts of GQA-packed decode nests (see :func:`_dense`). With a symbolic
    seq_q each is emitted and taken at run time for calls with ``seq_q · group ≤ rows``; with a
    static seq_q only the narrowest that holds ``seq_q · group`` rows is, and it is the whole
    kernel (none fits: the main nest alone). ``split_tasks``: the decode nests' split-KV target.
    ``dot_bf16``: the main nest's products as bf16 dot products (1, see ``_tile_macro``), on AMX
    tiles (2, :mod:`.amx`) or those emulated in plain TIR (3); bfloat16 specs only; decode nests,
    memory-bound, keep their own forms (``decode_dot``). ``prefetch``: the staged
    decode nests prefetch the K/V rows of the key tile this many tiles ahead (0 = none; see
    ``_tile_macro``). ``decode_heads``: kv heads per task of the staged decode nests (the page
    order, see :func:`_dense`). ``decode_dot``: the staged decode nests' products, 1 QKᵀ on
    bf16 operands, 2 QKᵀ and PV, 3 (``qk_int8``) QKᵀ on int8, 6/7 on AMX tiles (see
    ``_tile_macro``). ``decode_block_n``: the staged decode nests' key tile (0: ``block_n``).
    """
    if spec.layout_info.packed:
        return _varlen(spec, block_m, block_n, dot_bf16)
    if "seq_q" not in spec.dynamic:
        # a static seq_q: the shape is known, one nest: the narrowest decode tier that holds
        # the packed rows, else the main nest
        fits = [r for r in sorted(decode_rows) if spec.seq_q * spec.group_size <= r]
        decode_rows = tuple(fits[:1])
    return _dense(spec, block_m, block_n, tuple(decode_rows), split_tasks, stage_k_below, dot_bf16, prefetch,
                  decode_heads, decode_dot, decode_block_n)


def key_clamp(x):
    """A key bound (a call-time int32, any value: ``key_hi`` 2**31 − 1 for "to the end") clamped
    into ``[0, MAX_SEQ_LEN]`` before a tile range is computed from it (``x − key0``, ``x + block_n
    − 1``): no key lies outside, so which keys it admits is unchanged, and no sum can overflow."""
    return T.max(0, T.min(x, MAX_SEQ_LEN))


class _Tile:
    """Where one row tile finds its rows and keys: what a layout changes (the recurrence is the
    same for every layout). Index methods return index tuples into Q, K/V and O.

    Variants: ``var`` (:class:`.variants.Variants`), ``b`` the tile's sequence (its ``kv_start``),
    ``head(row)`` the query head of a tile row (ALiBi's slope, the sink), ``key0`` the sequence's
    key the tile numbers 0 (a split-KV chunk's first). With a left window or a start the key-tile
    loop begins at tile ``c0`` (:meth:`tile` maps the loop's tile to the sequence's)."""

    def __init__(self, spec, BM, BN, row0, q_len, k_len, q_index, kv_index, o_index, always_masked, valid=None,
                 pos=None, seq_q=None, offset=None, lse_index=None, state_index=None, heads=1,
                 var=NO_VARIANTS, b=None, head=None, key0=None, seq_keys=None):
        self.spec, self.BM, self.BN = spec, BM, BN
        # heads > 1: the tile's rows are ``heads`` blocks of BM // heads rows, one per kv head
        # (kv_index then takes the head: (key, d, head)); q_len, pos and keep apply per block
        self.heads, self.R = heads, BM // heads
        # pos: tile row -> query position, when a tile row is not one position (GQA packing:
        # row p is position p // group of head p % group); None: the identity
        self.pos = pos
        self.row0, self.q_len, self.k_len = row0, q_len, k_len
        self._q, self._kv, self._o = q_index, kv_index, o_index
        self.static = isinstance(k_len, int) and isinstance(q_len, int)  # lengths compiled in
        self.kv_tail = always_masked or not self.static or k_len % BN != 0
        self.vis = vis = Visibility.of(spec)
        self.masked = vis.hides_keys or self.kv_tail
        self.valid = valid  # None, or an expr: this tile has rows (varlen's empty slots do not)
        self.seq_q = q_len if seq_q is None else seq_q  # query positions (packed rows: q_len / group)
        # query row i sits at key position i + off (in the tile's key numbering; visibility.py):
        # bottom-right over the tile's keys by default; a split of the key range (split-KV) starts later.
        self.off = vis.offset(self.seq_q, self.k_len) if offset is None else offset
        # Bottom-right causal over the tile's own keys bounds every stored row's keys by the
        # diagonal alone: row p < seq_q sees j <= p + k_len - seq_q <= k_len - 1. The tail
        # compare (j < k_len) is then redundant, and dropping it from every score took a
        # symbolic causal build from 0.88-0.91 of the static build's speed to 1.00 (AVX2 code,
        # 16 vector registers, one thread, S=2048). Rows past seq_q (a tail row tile) may then
        # reach past k_len, but they read clamped keys (kv_at) and are never stored. A split-KV
        # range (offset given) ends before the diagonal and keeps the compare. Static lengths
        # that divide block_n keep it too: there it folds away, and the workload keeps the
        # structural hash the committed tuning logs were recorded with.
        self.diagonal_bounds_keys = vis.causal and offset is None and self.kv_tail
        self.lse_index = lse_index  # row -> index of its log-sum-exp output, or None
        # split-KV partial: row -> (index of m, index of l); O gets the unnormalised acc
        self.state_index = state_index
        self.var, self.head, self.b, self.key0 = var, head, b, key0
        # the sequence's keys (a split-KV chunk's k_len is the chunk's): a custom mask's row stride
        self.seq_keys = k_len if seq_keys is None else seq_keys
        self.masked = self.masked or var.LO is not None or var.mask_fn is not None or var.CM is not None
        start = var.start(b)
        # the first visible key in the tile's numbering (a chunk's keys start at key0)
        self.start = start if start is None or key0 is None else start - key0
        first = row0 if pos is None else pos(row0)
        begin = vis.key_begin(vis.position(first, self.off), self.start)
        lo = var.key_lo(b, self.absolute(vis.position(first, self.off)))
        if lo is not None:  # the key bounds of the tile's first row (non-decreasing: checked)
            lo = self.relative(key_clamp(lo))
            begin = lo if begin is None else T.max(begin, lo)
        # key tiles wholly before what the tile's first row sees are skipped, not masked
        self.c0 = None if begin is None else vis.tiles_before(begin, BN)

    def absolute(self, key):
        """A key (or position) of the tile's numbering in the sequence's (a split-KV chunk's
        numbering starts at ``key0``)."""
        return key if self.key0 is None else key + self.key0

    def relative(self, key):
        """A key of the sequence's numbering in the tile's."""
        return key if self.key0 is None else key - self.key0

    def tile(self, c):
        """The sequence's key tile of loop iteration ``c``."""
        return c if self.c0 is None else c + self.c0

    def row_pos(self, row):
        """The key position of tile row ``row``."""
        return self.vis.position(row if self.pos is None else self.pos(row), self.off)

    def n_tiles(self, nc):
        # Key tiles past what the tile's last row sees are entirely masked: skipped, not
        # computed and thrown away.
        BM, BN = self.BM, self.BN
        n = nc if isinstance(self.k_len, int) else T.floordiv(self.k_len + BN - 1, BN)
        end_row = self.row0 + BM if self.pos is None else self.pos(self.row0 + BM - 1) + 1  # past the last row
        key_end = self.vis.key_end(self.vis.position(end_row, self.off))
        hi = self.var.key_hi(self.b, self.absolute(self.vis.position(end_row - 1, self.off)))
        if hi is not None:  # the key bounds of the tile's last row
            hi = self.relative(key_clamp(hi))
            key_end = hi if key_end is None else T.min(key_end, hi)
        if key_end is not None:
            n = T.max(0, T.min(n, self.vis.tiles_to(key_end, BN)))
        if self.c0 is not None:
            n = T.max(0, n - self.c0)
        if self.valid is not None:
            n = T.Select(self.valid, n, 0)
        return n

    def q_at(self, vi, vd):
        if self.heads > 1:  # row0 is 0: clamp the row inside its head's block
            return self._q(T.floordiv(vi, self.R) * self.R + T.min(T.floormod(vi, self.R), self.q_len - 1), vd)
        return self._q(T.min(self.row0 + vi, self.q_len - 1), vd)

    def _kv_of(self, key, vd, head):
        return self._kv(key, vd) if head is None else self._kv(key, vd, head)

    def kv_at(self, c, vj, vd, head=None):
        # Clamp the tail tile's key index into range: those scores are masked anyway, and the
        # clamp costs one scalar min per key instead of a branch per element.
        if self.kv_tail:
            return self._kv_of(T.min(self.tile(c) * self.BN + vj, self.k_len - 1), vd, head)
        return self._kv_of(self.tile(c) * self.BN + vj, vd, head)

    def kv_row(self, key, vd, head=None):
        """The K/V index of key ``key`` (the tile numbering's, unclamped), column ``vd``."""
        return self._kv_of(key, vd, head)

    def full_tile(self, c):
        """Whether every key of tile ``c`` lies inside the sequence (True, or a condition where a
        tail tile may not): its rows can then be read in place, no clamp needed."""
        return True if not self.kv_tail else (self.tile(c) + 1) * self.BN <= self.k_len

    def kv_ahead(self, c, vj, vd, head=None):
        """K/V index of key ``vj`` of tile ``c`` (which may lie past the last), clamped to the
        last key: a prefetch address, always inside the sequence's rows (and its block table)."""
        return self._kv_of(T.max(0, T.min(self.tile(c) * self.BN + vj, self.k_len - 1)), vd, head)

    def scale_at(self, c, vj, g, head=None):
        """The index of key ``vj`` of tile ``c``'s scale in an 8-bit cache's per-token scales
        (``g`` 0) or its ``g``-th per-group scale: the key's K index without head_dim (and ``g``)."""
        if self.spec.kv_scale == "group":
            return self.kv_at(c, vj, g * SCALE_GROUP, head)[:-1] + (g,)
        return self.kv_at(c, vj, 0, head)[:-1]

    def o_at(self, vi, vd):
        return self._o(self.row0 + vi, vd)

    def keep(self, vi):
        if self.state_index is not None:
            # a split-KV partial stores every row of its tile (rows past the packed ones are
            # never merged): its workspace is then sized by the tile, not by seq_q
            return T.bool(True)
        if self.heads > 1:
            return T.floormod(vi, self.R) < self.q_len
        return self.row0 + vi < self.q_len

    def score(self, S, vj, vi, vc):
        # S with masked entries at -inf: keys past the sequence (tail tile) and keys the row does
        # not see (visibility.py). Unmasked specs read S unchanged.
        return self.masked_value(S[vj, vi], vj, vi, vc)

    def masked_value(self, x, vj, vi, vc):
        """``x`` (the score of tile row ``vi`` and key ``vj`` of tile ``vc``), or -inf where the
        key is hidden."""
        if not self.masked:
            return x
        col = self.tile(vc) * self.BN + vj
        cond = col < self.k_len
        row = self.row0 + vi if self.pos is None else self.pos(self.row0 + vi)
        seen = self.vis.sees(col, self.vis.position(row, self.off), self.start)
        if seen is not None:
            cond = seen if self.diagonal_bounds_keys else T.And(cond, seen)
        mod = self.var.sees(self.b, self.head_of(vi), self.absolute(self.vis.position(row, self.off)),
                            self.absolute(col))
        if mod is not None:
            cond = T.And(cond, mod)
        bit = self.var.custom(self.b, row, self.absolute(col), self.seq_q, self.seq_keys)  # row: the query row
        if bit is not None:
            cond = T.And(cond, bit)
        return T.Select(cond, x, T.float32(float("-inf")))

    def tile_seen(self, seen):
        """Whether loop tile's key tile is computed: True (a Python constant: no branch) without
        a custom mask, else whether a row of it may see one of its keys (``seen``, the OR of its
        bits: :meth:`mask_bits`)."""
        return True if self.var.CM is None else seen[0] != 0

    def mask_bits(self, vi, vc, x):
        """Byte ``x`` of tile row ``vi``'s custom-mask bits over the keys of tile ``vc`` (a run of
        ``min(BN, keys − first)`` bits from bit ``row·keys + first``), as an int32 with the bits
        outside the run cleared; 0 for a row past the sequence's and for a byte past the run
        (its load clamped to the run's last byte: nothing outside the sequence's bytes is
        read). The bit indices are int64 (``row·keys`` may pass 2**31)."""
        i64 = lambda v: T.Cast("int64", v)  # noqa: E731
        row = self.row0 + vi if self.pos is None else self.pos(self.row0 + vi)
        first = self.absolute(self.tile(vc) * self.BN)
        n = T.max(0, T.min(self.BN, self.seq_keys - first))  # the run's bits: the tile's keys in the sequence
        lo = i64(T.min(row, self.seq_q - 1)) * i64(self.seq_keys) + i64(first)
        hi = lo + i64(n)
        byte = T.min(T.shift_right(lo, i64(3)) + i64(x), T.shift_right(T.max(lo, hi - i64(1)), i64(3)))
        base = byte * i64(8)
        b0 = T.Cast("int32", T.max(lo, base) - base)  # the run's bits within this byte: [b0, b1)
        b1 = T.Cast("int32", T.min(hi, base + i64(8)) - base)
        bits = T.shift_right(T.Cast("int32", self.var.CM[self.var.MI[self.b] + T.Cast("int32", byte)]), b0)
        keep = T.shift_left(1, T.max(b1 - b0, 0)) - 1
        live = T.And(row < self.seq_q, T.And(T.shift_right(lo, i64(3)) + i64(x) <= T.shift_right(hi - i64(1), i64(3)),
                                              n > 0))
        return T.Select(live, T.bitwise_and(bits, keep), 0)

    def head_of(self, vi):
        """The query head of tile row ``vi`` (0 when the layout frame gives none)."""
        return 0 if self.head is None else self.head(self.row0 + vi)

    def logit(self, x, vj, vi, vc):
        """The score ``x`` (scaled: :func:`.variants.score_scale`) of tile row ``vi`` and key
        ``vj`` of tile ``vc`` through the variants' score hook (``Variants.logit``: softcap,
        ALiBi, score_mod), in log2 units."""
        row = self.row0 + vi
        key = self.tile(vc) * self.BN + vj
        return self.var.logit(x, lambda: self.head(row), lambda: self.row_pos(row) - key,
                              lambda: (self.b, self.head_of(vi), self.absolute(self.row_pos(row)), self.absolute(key)))

    def q_scaled(self, x, vi):
        """The query element ``x`` (already times the softmax scale) of tile row ``vi`` times its
        kv head's key scale (an 8-bit cache: ``q·(s·k) = (s·q)·k``, one multiply per query
        element instead of one per key element)."""
        ks = None if self.head is None else self.var.k_scale(self.head(self.row0 + vi))
        return x if ks is None else x * ks

    def out(self, acc, l, vi, keys_sum=None):
        """``acc / l``, or 0 for a row the mask gives no key (see ``normalize``); a split-KV
        partial stores ``acc`` itself (the merge normalises). Under modifiers a row saw no key
        when the keys' sum ``keys_sum`` (``l`` before a sink joins it) is 0: every score was
        -inf (``normalize_seen``)."""
        row = self.row0 + vi
        vs = None if self.head is None else self.var.v_scale(self.head(row))
        if vs is not None:  # an 8-bit cache: P·V summed the stored values; the scale is linear
            acc = acc * vs
        if self.state_index is not None:
            return acc
        return self.var.normalized(acc, l, row, self.static and self.start is None, lambda: self.sees_key(row),
                                   keys_sum)

    def sees_key(self, row):
        """Whether tile row ``row`` sees any key (a fact of the mask and the lengths)."""
        return self.vis.sees_a_key(self.row_pos(row), self.k_len, self.start)


#: Block names of the tile, found by name in schedules/ (a second nest of the same function
#: carries a suffix: ``S_gemm_dec``).
TILE_BLOCKS = ("Q_load", "state_init", "acc_init", "kv_tile", "S_gemm", "row_max", "online_correction",
               "max_commit", "P_exp", "row_sum", "PV_gemm", "O_store")
#: Blocks a tile has in some forms only (``_tile_macro``'s arguments, the spec)
OPTIONAL_BLOCKS = ("lse_store", "state_store", "K_load", "V_load", "V_ilv", "q_absmax", "q_scale", "q_sum", "P_round",
                   "P_ilv", "acc_rescale", "KV_prefetch", "score_mod", "scale_load", "group_scale_load",
                   "group_scale_load_v", "mask_tile", "tile_config", "tile_release", "P_tr", "P_pack", "V_pack",
                   "max_ref", "rescale_any")
#: Suffix of a GQA-packed decode nest's blocks, followed by its rows (``row_tile_dec4``,
#: ``S_gemm_dec16``...).
DECODE = "_dec"


def stages_half_keys(spec: AttentionSpec, dot_bf16: bool) -> bool:
    """Whether the main nest stages its key tile as float32 (``stage_k``): float16 inputs.
    ``S_gemm`` broadcasts one K element against a vector of query rows; from a float16 tile that
    is a scalar ``vcvtph2ps`` per broadcast, where the staged tile converts it once per tile, in
    vectors. bfloat16's conversion is a shift the broadcast absorbs: staging only adds the copy.
    Measured side by side (2-core znver4, B1 H8 S2048, 2 threads, GFLOP/s unstaged → staged):
    fp16 on AVX-512 D=64 180 → 188, D=128 178 → 186; fp16 on AVX2 (mcpu znver3) 175 → 177 and
    186 → 185; bf16 on AVX2 180 → 173 and 187 → 181 (fp32 there: 184, 186)."""
    return spec.dtype == "float16"


@dataclasses.dataclass(frozen=True)
class _TileShape:
    """What the pieces of one tile macro share: its block names (``N``: name -> name + suffix),
    rows ``BM``, keys ``BN``, head_dim ``D`` (V's ``DV``), kv heads ``HT`` (``R = BM // HT`` rows each), the
    scale in log2 units, the variant (``dot_bf16``, ``prefetch``, ``stats``) and the elements of
    one cache line of a K/V row."""

    N: dict
    BM: int
    BN: int
    D: int
    DV: int  # V's and O's head dim (spec.v_dim): the PV, accumulator and store loops
    HT: int
    qscale: float
    dot_bf16: int  # 0 float32 products, 1 vdpbf16ps, 2 AMX tiles, 3 AMX emulated (amx.REAL, amx.EMULATED)
    prefetch: int
    stats: str | None
    line_elems: int
    #: the variants change the scores beyond their scale (a softcap, ALiBi, the user's score_mod:
    #: ``variants.transforms``; Q is scaled by ``variants.score_scale``)
    transforms: bool = False
    #: a mask on data (mask_mod, key bounds): applied once per score in block ``score_mod``, which
    #: then holds the masked scores (row_max and P_exp would each evaluate it, and exp2_fast
    #: repeats its argument: a tree TVM's simplifier took 10x the build time over)
    mask_mod: bool = False
    #: an 8-bit cache's dtype (``spec.kv_dtype``): K/V elements are converted by ``kv_to_f32``
    #: (float8 read through uint8 aliases of K and V, see ``_dense_function``)
    kv_dtype: str | None = None
    #: the staged decode tiles' products (``_tile_macro``'s ``dot_decode``): 1 QKᵀ on bf16
    #: operands (``Qt`` and ``Kt`` hold bf16 bits, uint16), 2 PV too (P rounded to bf16, V pairs),
    #: 3/4 QKᵀ on int8 (``qk_int8``; the AVX-512 VNNI and AVX2 forms, :meth:`stage_key`)
    dot_decode: int = 0
    #: ``spec.qk_int8``: ``Qt`` holds each row rounded to int8 (as float32, as bf16 bits with
    #: ``dot_decode`` 1/2, as int8 with 3), its scale ``s_q`` in ``qs[0]`` multiplying the scores
    #: (:func:`_q_macros`)
    qk_int8: bool = False
    #: an 8-bit cache's scales per (token, kv head) (1) or per 32 elements of head_dim (``D/32``):
    #: ``spec.scale_groups``; 0 per kv head (folded into q and the output). Per token they multiply
    #: the scores (K) and P as PV reads it (V), staged per tile by block ``scale_load`` in
    #: ``Ksc``/``Vsc (BN, BM)``, laid out as S and P (a row's vector reads them as it reads S);
    #: per group the keys' elements as they are converted (``dequant``) and P per group of
    #: columns as PV reads it (block ``group_scale_load``, ``(HT, BN, groups)``): float32 QKᵀ
    #: products (no dot-product forms)
    scale_groups: int = 0
    #: V's (``spec.v_scale_groups``): per group ``DV/32``, which may differ from K's
    v_scale_groups: int = 0
    #: a bfloat16 cache (no ``kv_dtype``): a tile of several kv heads stages its values as their
    #: bits, read through a uint16 view (TVM stores a bfloat16 local buffer as float32: twice the
    #: bytes staged and read back)
    bf16_cache: bool = False
    #: bfloat16 queries: P may be rounded to bf16 for PV (the decode tiles' PV, ``amx_pv``)
    bf16_q: bool = False

    def kv(self, x):
        """The float32 value of the K/V element ``x`` as loaded: an 8-bit cache's without its scale
        and :data:`KV_UNIT` (both folded into q and the output, ``Variants.k_scale``)."""
        return f32(x) if self.kv_dtype is None else kv_to_f32(x, self.kv_dtype, unit=False)

    @property
    def raw16(self) -> bool:
        """Whether the dot products read K and V as their own bf16 bits (uint16 views of the
        bfloat16 inputs): nothing to convert. An 8-bit cache is widened instead (:meth:`bits`)."""
        return bool(self.dot_bf16 or self.dot_decode) and self.kv_dtype is None

    def bits(self, x):
        """The bf16 bits of a K/V element ``x`` read for a dot product: ``x`` itself when it was
        read through a uint16 view (:attr:`raw16`), else an 8-bit value widened (exact: bf16
        holds every int8, e4m3 and e5m2 value, so its float32 value's upper half)."""
        return x if self.raw16 else bf16_exact_bits(self.kv(x))

    @property
    def v_raw(self) -> bool:
        """Whether a tile of several kv heads stages its values as stored (converted as ``PV_gemm``
        reads them) rather than as float32: int8 and 16-bit caches (a paged int8 step 0.74-0.87×
        the float32 staging's: a quarter of the bytes staged, its widening cheap; bf16 level), not
        float8, whose conversion costs more than the staged bytes (1.06-1.10× as stored)."""
        return self.kv_dtype in (None, "int8")

    def v_staged(self, x):
        """A value element as a tile of several kv heads stages it (:attr:`v_raw`)."""
        return x if self.v_raw else self.kv(x)

    def v_value(self, x):
        """The float32 value of a staged value element."""
        if self.bf16_cache:
            return bf16_value(x)
        return self.kv(x) if self.v_raw else x

    @property
    def v_bits(self) -> bool:
        """Whether the tile reads K and V through uint16 views: its dot products' bf16 operands
        (:attr:`raw16`), or a bf16 cache's values staged as bits (:attr:`bf16_cache`)."""
        return self.raw16 or self.bf16_cache

    def vt_dtype(self, v_dtype: str) -> str:
        """The dtype of a tile of several kv heads' staged values (:attr:`v_raw`, :attr:`bf16_cache`)."""
        return "uint16" if self.bf16_cache else v_dtype if self.v_raw else "float32"

    def stage_key(self, x, Ksc=None, h=0, vj=0, vd=0):
        """A key element as ``Kt`` holds it: bf16 bits with ``dot_decode`` 1/2; with 3 (the
        integer dot product on AVX-512 VNNI, an int8 cache) ``k + 128`` as uint8, its bit pattern
        with the sign bit flipped (``vpdpbusd`` multiplies unsigned by signed bytes; the scores
        take the ``128·Σq_i`` back off); with 4 (the same on AVX2) the byte as it is; else
        float32."""
        if self.dot_decode == 3:
            return T.bitwise_xor(T.reinterpret("uint8", x), T.uint8(0x80))
        if self.int8_dots:  # AVX2's and the tiles' (tdpbssd): signed by signed
            return x
        if self.group_scales:
            return self.dequant(x, Ksc, h, vj, vd)
        return self.bits(x) if self.dot_decode else self.kv(x)

    @property
    def token_scales(self) -> bool:
        """Per-token scales: one factor per (key, kv head), on the scores and on P."""
        return self.scale_groups == 1 and self.kv_dtype is not None

    @property
    def group_scales(self) -> bool:
        """Per-group scales: each element times its group's scale as it is converted, or with
        ``dot_decode`` 5 each group's integer dot product times it (:attr:`group_dots`)."""
        return self.scale_groups > 1

    @property
    def group_dots(self) -> bool:
        """QKᵀ on int8 dot products of a per-group scaled cache (``dot_decode`` 5, ``qk_int8``):
        ``S_gemm`` adds each product times its key's group scale (``Ksc``), which the dot product
        applies once per group's integer sum (``cpu_decode``'s scaled AVX2 form, 32 bytes a group)."""
        return self.dot_decode == 5

    def head_row(self, vi):
        """The kv head of the tile (0 .. HT-1) row ``vi`` belongs to."""
        return 0 if self.HT == 1 else T.floordiv(vi, self.R)

    def dequant(self, x, Sc, h, vj, vd):
        """The float32 value of key element ``x`` (key ``vj``, column ``vd``, the tile's kv head
        ``h``): with per-group scales times its group's (``Sc``: ``Ksc``), else :meth:`kv`."""
        if self.group_scales:
            return self.kv(x) * Sc[h, vj, T.floordiv(vd, SCALE_GROUP)]
        return self.kv(x)

    @property
    def score_mod(self) -> bool:
        """Whether the tile modifies its scores (block ``score_mod``, into ``Sm``) before the
        softmax: the variants' score hook (``Variants.logit``: the softcap's tanh once per score,
        ALiBi's bias, the user's score_mod), and a mask on data (``mask_mod``)."""
        return self.transforms or self.mask_mod

    @property
    def R(self) -> int:
        return self.BM // self.HT

    @property
    def amx_decode(self) -> bool:
        """The decode nest's products on AMX tiles (``dot_decode`` 6, emulated 7:
        :func:`.amx.decode_products`): QKᵀ, and PV with bf16 queries (:attr:`amx_pv`)."""
        return self.dot_decode in (amx.DECODE_REAL, amx.DECODE_EMULATED)

    @property
    def amx_pv(self) -> bool:
        """The decode tiles' PV on tiles too: bfloat16 queries (P rounded to bf16, as ``dot_decode``
        2 does), a bf16 cache or an int8 one widened to bf16 (exact); float32 queries with an int8
        cache keep the float32 PV."""
        return self.amx_decode and self.bf16_q

    @property
    def int8_dots(self) -> bool:
        """QKᵀ on int8 products (``qk_int8``'s bytes): ``dot_decode`` 3-5, or the tiles' ``tdpbssd``."""
        return self.dot_decode in (3, 4, 5) or (self.amx_decode and self.qk_int8)

    @property
    def q_words(self) -> int:
        """The decode tiles' q operand: elements of q per 32-bit column (bf16 pairs 2, int8 quads
        4), ``Qt (D/w, BM, w)``; 0 for the forms that read ``Qt (D, BM)``."""
        return amx.DECODE_Q_PER_WORD[self.qk_int8] if self.amx_decode else 0

    def qt_at(self, vd, vi):
        """``Qt``'s index of q's element ``vd`` of row ``vi`` (:attr:`q_words`)."""
        w = self.q_words
        return (T.floordiv(vd, w), vi, T.floormod(vd, w)) if w else (vd, vi)

    @property
    def amx(self) -> bool:
        """The products on AMX tiles (:mod:`.amx`), real or emulated."""
        return self.dot_bf16 in (amx.REAL, amx.EMULATED)


#: The AMX form's lazy correction (log2 units): a row keeps its running max as the reference of P,
#: ``l`` and ``acc`` until a key tile passes it by more than this, so P stays at most 2**8 and
#: ``acc`` is rescaled only in the tiles that move some row's reference (block ``rescale_any``),
#: as FlashAttention-4 does. Exact: O = acc / l and lse = m + log2(l) take the same reference.
#: Why: with the products on tiles the correction's pass over acc (BM × DV floats each key
#: tile) was 12 % of a D=128 prefill (perf, one thread, S=2048).
LAZY_GAP = 8.0


def _lazy_state(BM: int) -> tuple:
    """The lazy correction's state (:data:`LAZY_GAP`): the rows' reference max ``(BM,)`` and
    whether acc is rescaled this tile ``(1,)``, local buffers of the row tile's block."""
    return (T.sblock_alloc_buffer((BM,), "float32", scope="local"), T.sblock_alloc_buffer((1,), "int32", scope="local"))


def _softmax_macro(k: _TileShape):
    """The online softmax over one key tile: the running max over the visible keys, the
    correction ``alpha = exp2(m_old - m_new)`` (guarded: no -inf - -inf), ``P = exp2(S - m_new)``
    (masked entries exactly 0) and ``l = l·alpha + rowsum(P)``. The AMX form (``k.amx``) takes
    the max lazily (:data:`LAZY_GAP`): ``lz = (m_ref, need)``, the reference (block ``max_ref``)
    and whether acc needs the correction (``rescale_any``); other forms pass a placeholder. It
    also makes P's pair words for the tiles' PV (``Pb``, block ``P_pack``) in the exponentials'
    own pass, one key pair at a time: ``P`` is then ``(2, BM)``, in L1 (1.045x a D=64 prefill
    against writing P whole and reading it back twice)."""
    N, BM, BN, qscale, dot_bf16 = k.N, k.BM, k.BN, k.qscale, k.dot_bf16
    score_mod, lazy = k.score_mod, k.amx
    # the AMX form rounds P to bf16 for PV: a shorter polynomial is exact enough there (l sums
    # the unrounded P, 3e-6 relative)
    P_POLY = EXP2_POLY_BF16 if k.amx else EXP2_POLY

    def scaled(t, x, vi, qs):
        # dot_bf16 and dot_decode sum unscaled products (Q keeps its exact bf16 values: no
        # pre-scaled copy), qk_int8 the integers: the scale, an 8-bit cache's key scale
        # (q_scaled) and the row's s_q (qs) come here
        if dot_bf16:
            return x * T.float32(qscale)
        if k.qk_int8 and k.dot_decode == 3:  # Σ(k + 128)·q_i: take 128·Σq_i back off
            return t.q_scaled((x - qs[1, vi]) * (T.float32(qscale) * qs[0, vi]), vi)
        if k.qk_int8:
            return t.q_scaled(x * (T.float32(qscale) * qs[0, vi]), vi)
        return t.q_scaled(x * T.float32(qscale), vi) if k.dot_decode else x

    def key_scaled(t, x, vj, vi, qs, Ksc):
        # per-token key scales multiply each score (before the mask: a hidden key's scale may
        # be anything, and its score is -inf all the same)
        if k.token_scales:
            return scaled(t, x, vi, qs) * Ksc[vj, vi]
        return scaled(t, x, vi, qs)

    def score(t, S, Sm, vj, vi, vc, qs, Ksc):
        # score_mod has already brought them to log2 units, in Sm (and masked them, k.mask_mod)
        if k.mask_mod:
            return Sm[vj, vi]
        if score_mod:
            return t.score(Sm, vj, vi, vc)
        if k.token_scales:
            return t.masked_value(key_scaled(t, S[vj, vi], vj, vi, qs, Ksc), vj, vi, vc)
        return scaled(t, t.score(S, vj, vi, vc), vi, qs)

    def modified(t, x, vj, vi, vc, qs, Ksc):
        # the score in log2 units through the variants' hook (x is q·k times score_scale, or q·k
        # unscaled from bf16 dots)
        return t.logit(key_scaled(t, x, vj, vi, qs, Ksc), vj, vi, vc)

    @T.macro
    def online_softmax(S, Sm, P, m, m_new, l, alpha, t, vc, qs, Ksc, lz, Pb):
        ref = T.meta_var(lz[0] if lazy else m_new)  # the max P is taken against (lazy: m_ref)
        if score_mod:
            # the modified scores go to a buffer of their own: every buffer of the tile keeps
            # one writer (S_gemm's S is a reduction the schedules decompose)
            for j, i in T.grid(BN, BM):
                with T.sblock(N["score_mod"]):
                    vj, vi = T.axis.remap("SS", [j, i])
                    if k.mask_mod:
                        Sm[vj, vi] = t.masked_value(modified(t, S[vj, vi], vj, vi, vc, qs, Ksc), vj, vi, vc)
                    else:
                        Sm[vj, vi] = modified(t, S[vj, vi], vj, vi, vc, qs, Ksc)
        # -- running max over the visible keys ---------------------------------
        for j, i in T.grid(BN, BM):
            with T.sblock(N["row_max"]):
                vj, vi = T.axis.remap("RS", [j, i])
                with T.init():
                    m_new[vi] = m[vi]
                m_new[vi] = T.max(m_new[vi], score(t, S, Sm, vj, vi, vc, qs, Ksc))
        if lazy:  # the reference max: the running one unless this tile passes it by LAZY_GAP
            for i in T.serial(BM):
                with T.sblock(N["max_ref"]):
                    vi = T.axis.remap("S", [i])
                    lz[0][vi] = T.Select(m_new[vi] - m[vi] <= T.float32(LAZY_GAP), m[vi], m_new[vi])
        # -- online correction factor; the guard keeps -inf - -inf out ----------
        for i in T.serial(BM):
            with T.sblock(N["online_correction"]):
                vi = T.axis.remap("S", [i])
                alpha[vi] = exp2_fast(m[vi] - guarded(ref[vi]))
        for i in T.serial(BM):
            with T.sblock(N["max_commit"]):
                vi = T.axis.remap("S", [i])
                m[vi] = ref[vi]
        if lazy:  # whether any row's reference moved (then acc is rescaled: acc_rescale)
            with T.sblock(N["rescale_any"]):
                lz[1][0] = 0
                for i in T.serial(BM):
                    lz[1][0] = T.max(lz[1][0], T.Select(alpha[i] != T.float32(1), 1, 0))
        if lazy:  # the tiles' form: one pass per key pair, P (2, BM) never leaves L1
            for jp in T.serial(BN // 2):
                for tt, i in T.grid(2, BM):
                    with T.sblock(N["P_exp"]):
                        vp, vt, vi = T.axis.remap("SSS", [jp, tt, i])
                        vj = T.meta_var(2 * vp + vt)
                        P[vt, vi] = exp2_fast(score(t, S, Sm, vj, vi, vc, qs, Ksc) - guarded(ref[vi]), P_POLY)
                for i in T.serial(BM):
                    with T.sblock(N["row_sum"]):
                        vp, vi = T.axis.remap("RS", [jp, i])
                        with T.init():
                            l[vi] = l[vi] * alpha[vi]
                        l[vi] = l[vi] + P[0, vi] + P[1, vi]
                for i in T.serial(BM):  # the pair rounded to bf16, one word (PV's operand)
                    with T.sblock(N["P_pack"]):
                        vp, vi = T.axis.remap("SS", [jp, i])
                        Pb[vp, vi] = bf16_pair_word(P[0, vi], P[1, vi])
        else:
            # -- P = exp2(S - m_new); masked entries are exactly 0 -------------------
            for j, i in T.grid(BN, BM):
                with T.sblock(N["P_exp"]):
                    vj, vi = T.axis.remap("SS", [j, i])
                    P[vj, vi] = exp2_fast(score(t, S, Sm, vj, vi, vc, qs, Ksc) - guarded(ref[vi]), P_POLY)
            # -- l = l·alpha + rowsum(P) -------------------------------------------
            for j, i in T.grid(BN, BM):
                with T.sblock(N["row_sum"]):
                    vj, vi = T.axis.remap("RS", [j, i])
                    with T.init():
                        l[vi] = l[vi] * alpha[vi]
                    l[vi] = l[vi] + P[vj, vi]

    return online_softmax


def _scale_macro(k: _TileShape, spec: AttentionSpec):
    """A key tile's scales, each times :data:`KV_UNIT` (what ``kv_to_f32(unit=False)`` leaves
    out), and as NaN when it is not a positive finite number (its rows are then NaN): per token
    block ``scale_load``, ``Ksc``/``Vsc (BN, BM)`` (each row's kv head's, laid out as S and P);
    per group block ``group_scale_load``, ``(HT, BN, groups)`` (V's groups in a block of their own,
    ``group_scale_load_v``, when ``DV`` gives V another count)."""
    N, BN, BM, HT, NG, NGV = k.N, k.BN, k.BM, k.HT, k.scale_groups, k.v_scale_groups
    unit = KV_UNIT.get(spec.kv_dtype, 1.0)

    def checked(x):
        y = T.Select(scale_ok(x), x, T.float32(float("nan")))
        return y if unit == 1.0 else y * T.float32(unit)

    def head(vh):  # the head argument of a scale index: none for a one-head tile
        return vh if HT > 1 else None

    @T.macro
    def token_scale_load(Ksc, Vsc, t, vc):
        for j, i in T.grid(BN, BM):
            with T.sblock(N["scale_load"]):
                vj, vi = T.axis.remap("SS", [j, i])
                Ksc[vj, vi] = checked(t.var.KSC[t.scale_at(vc, vj, 0, head(k.head_row(vi)))])
                Vsc[vj, vi] = checked(t.var.VSC[t.scale_at(vc, vj, 0, head(k.head_row(vi)))])

    @T.macro
    def group_scale_load(Ksc, Vsc, t, vc):
        if NG == NGV:
            for j, h, g in T.grid(BN, HT, NG):
                with T.sblock(N["group_scale_load"]):
                    vj, vh, vg = T.axis.remap("SSS", [j, h, g])
                    Ksc[vh, vj, vg] = checked(t.var.KSC[t.scale_at(vc, vj, vg, head(vh))])
                    Vsc[vh, vj, vg] = checked(t.var.VSC[t.scale_at(vc, vj, vg, head(vh))])
        else:
            for j, h, g in T.grid(BN, HT, NG):
                with T.sblock(N["group_scale_load"]):
                    vj, vh, vg = T.axis.remap("SSS", [j, h, g])
                    Ksc[vh, vj, vg] = checked(t.var.KSC[t.scale_at(vc, vj, vg, head(vh))])
            for j, h, g in T.grid(BN, HT, NGV):
                with T.sblock(N["group_scale_load_v"]):
                    vj, vh, vg = T.axis.remap("SSS", [j, h, g])
                    Vsc[vh, vj, vg] = checked(t.var.VSC[t.scale_at(vc, vj, vg, head(vh))])

    return group_scale_load if k.group_scales else token_scale_load


def _mask_any_macro(k: _TileShape):
    """Block ``mask_tile``: ``seen[0]``, the OR of a key tile's custom-mask bits over the row
    tile's rows (a tile with none set is skipped). Each row's keys of the tile are a run of at
    most ``BN`` bits, read a byte at a time, the first and last bytes masked to the run
    (:meth:`_Tile.mask_bits`)."""
    N, BM, BN = k.N, k.BM, k.BN

    @T.macro
    def mask_any(seen, t, vc):
        with T.sblock(N["mask_tile"]):
            seen[0] = 0
            for i in T.serial(BM):
                for x in T.serial(BN // 8 + 1):
                    seen[0] = T.bitwise_or(seen[0], t.mask_bits(i, vc, x))

    return mask_any


def _store_macro(k: _TileShape):
    """The tile's stores: ``O`` (normalised, rounded to the dtype; ``DV`` columns), and ``stats`` to ``X``."""
    N, BM, D, stats = k.N, k.BM, k.DV, k.stats

    def out(t, acc, l, m, vi):
        # with sinks each row's denominator gains its sink (Variants.with_sink; l stays the keys'
        # sum for lse; a split-KV partial's merge adds it); per row, so the vectorized store
        # computes it once per vector of columns
        keys_sum = l
        if stats != "partial":
            acc, l = t.var.with_sink(acc, l, m, t.head_of(vi))
        return t.out(acc, l, vi, keys_sum)

    @T.macro
    def store(O, X, acc, m, l, t):
        for i, d in T.grid(BM, D):
            with T.sblock(N["O_store"]):
                vi, vd = T.axis.remap("SS", [i, d])
                T.where(t.keep(i))
                O[t.o_at(vi, vd)] = cast_to(O, out(t, acc[vi, vd], l[vi], m[vi], vi))
        if stats == "lse":
            for i in T.serial(BM):
                with T.sblock(N["lse_store"]):
                    vi = T.axis.remap("S", [i])
                    T.where(t.keep(i))
                    X[t.lse_index(t.row0 + vi)] = lse_of(m[vi], l[vi])
        if stats == "partial":
            for i in T.serial(BM):
                with T.sblock(N["state_store"]):
                    vi = T.axis.remap("S", [i])
                    T.where(t.keep(i))
                    X[t.state_index(t.row0 + vi, 0)] = m[vi]
                    X[t.state_index(t.row0 + vi, 1)] = l[vi]

    return store


def _q_macros(k: _TileShape):
    """The tile's ``Q_load`` (the pair forms': :func:`.bf16dot.pair_macros`' ``q_pairs``):
    ``q_load`` (``Qt (D, BM)``: q scaled to log2 units, or with
    ``dot_decode`` its own bf16 bits, the scales then multiplying the scores). With ``qk_int8``,
    ``q_load`` rounds each row to int8 first (``quant.qk_int8_query``, the same float32 steps):
    ``q_absmax`` takes the row's largest magnitude into ``qs[0]`` (NaN, kept, once an element is
    NaN or infinite: the row's scores are then NaN), ``Q_load`` writes ``rint(q · (127 / a))``
    (no clamp: it cannot pass ±127, and a clamp would turn NaN into a number; as int8 with
    ``dot_decode`` 3, a NaN as 0), ``q_scale`` leaves ``s_q = a / 127`` in ``qs[0]`` for the
    scores, and with ``dot_decode`` 3 ``q_sum`` ``128·Σq_i`` in ``qs[1]`` (:meth:`_TileShape.stage_key`)."""
    N, BM, D, qscale = k.N, k.BM, k.D, k.qscale

    def nonzero(a):  # a row of zeros takes a = 1 (its q_i are 0 all the same)
        return T.Select(a == T.float32(0), T.float32(1), a)

    def bad(a, x):  # the row's max so far is NaN, or x is NaN or infinite (max() would drop a NaN)
        return T.isnan(a) | T.isnan(x) | T.isinf(x)

    def q_value(Q, t, vi, vd, qs):
        x = f32(Q[t.q_at(vi, vd)])
        return T.nearbyint(x * (T.float32(127) / nonzero(qs[0, vi]))) if k.qk_int8 else x

    @T.macro
    def q_int8_max(Q, qs, t):
        for i, d in T.grid(BM, D):
            with T.sblock(N["q_absmax"]):
                vi, vd = T.axis.remap("SR", [i, d])
                with T.init():
                    qs[0, vi] = T.float32(0)
                qs[0, vi] = T.Select(bad(qs[0, vi], f32(Q[t.q_at(vi, vd)])), T.float32(float("nan")),
                                     T.max(qs[0, vi], T.fabs(f32(Q[t.q_at(vi, vd)]))))

    @T.macro
    def q_int8_scale(Qt, qs):
        for i in T.serial(BM):
            with T.sblock(N["q_scale"]):
                vi = T.axis.remap("S", [i])
                qs[0, vi] = nonzero(qs[0, vi]) / T.float32(127)
        if k.dot_decode == 3:
            for i, d in T.grid(BM, D):
                with T.sblock(N["q_sum"]):
                    vi, vd = T.axis.remap("SR", [i, d])
                    with T.init():
                        qs[1, vi] = T.float32(0)
                    qs[1, vi] = qs[1, vi] + T.float32(128) * f32(Qt[vd, vi])

    @T.macro
    def q_load(Q, Qt, t, qs):
        if k.qk_int8:
            q_int8_max(Q, qs, t)
        for d, i in T.grid(D, BM):
            with T.sblock(N["Q_load"]):
                vd, vi = T.axis.remap("SS", [d, i])
                if k.int8_dots:  # the bytes of the integer dot product (NaN: s_q is NaN)
                    Qt[k.qt_at(vd, vi)] = T.Cast("int8", T.Select(T.isnan(q_value(Q, t, vi, vd, qs)), T.float32(0),
                                                                  q_value(Q, t, vi, vd, qs)))
                elif k.dot_decode > 0:  # q's own bits (bfloat16; q_i exact): the scales multiply the scores
                    Qt[k.qt_at(vd, vi)] = bf16_exact_bits(q_value(Q, t, vi, vd, qs))
                elif k.qk_int8:  # the integers: the scales (s_q's too) multiply the scores
                    Qt[vd, vi] = q_value(Q, t, vi, vd, qs)
                else:
                    Qt[vd, vi] = t.q_scaled(f32(Q[t.q_at(vi, vd)]) * T.float32(qscale), vi)
        if k.qk_int8:
            q_int8_scale(Qt, qs)

    return q_load


def _check_tile_args(spec: AttentionSpec, BM: int, BN: int, stage_k: bool, dot_bf16: int, prefetch: int,
                     heads: int, dot_decode: int) -> None:
    """A ValueError naming what ``_tile_macro``'s arguments ask that its forms cannot do."""
    if dot_bf16 not in (0, 1, amx.REAL, amx.EMULATED):
        raise ValueError(f"dot_bf16={dot_bf16} must be 0 (float32 products), 1 (vdpbf16ps), {amx.REAL} (AMX tiles) "
                         f"or {amx.EMULATED} (AMX emulated)")
    if dot_bf16 in (amx.REAL, amx.EMULATED) and amx.fits(BM, BN, spec.head_dim, spec.v_dim):
        raise ValueError(amx.fits(BM, BN, spec.head_dim, spec.v_dim))
    if dot_bf16 and (spec.dtype != "bfloat16" or spec.kv_quantized or spec.head_dim % 2 or BN % 2):
        raise ValueError(f"dot_bf16 needs bfloat16 inputs and an even head_dim and block_n, got {spec.dtype}, "
                         f"D={spec.head_dim}, block_n={BN}")
    if prefetch and not stage_k:
        raise ValueError("prefetch is issued by the staged (stage_k) decode tiles only")
    if dot_decode not in (0, 1, 2, 3, 4, 5, amx.DECODE_REAL, amx.DECODE_EMULATED) or (
            dot_decode in (3, 4, 5) and not spec.qk_int8):
        raise ValueError(f"dot_decode={dot_decode} must be 0, 1 (QKᵀ on bf16), 2 (QKᵀ and PV), with "
                         f"qk_int8 3/4 (QKᵀ on int8: AVX-512 VNNI's unsigned keys, AVX2's signed ones) or 5 "
                         f"(one int8 dot product per group of a per-group scaled cache), or {amx.DECODE_REAL}/"
                         f"{amx.DECODE_EMULATED} (AMX tiles, real/emulated)")
    if dot_decode in (amx.DECODE_REAL, amx.DECODE_EMULATED):
        why = amx.decode_fits(spec, BM, BN, heads)
        if why:
            raise ValueError(f"dot_decode={dot_decode}: {why}")
    if dot_decode and (not stage_k or (spec.dtype != "bfloat16" and not spec.qk_int8) or (dot_decode == 2 and BN % 2)):
        raise ValueError(f"dot_decode needs the staged decode tiles and bfloat16 queries and cache (or an 8-bit "
                         f"cache), and an even block_n for PV, got dtype={spec.dtype}, kv_dtype={spec.kv_dtype}, "
                         f"block_n={BN}")
    if (dot_decode == 5) != (bool(dot_decode) and spec.kv_quantized and spec.kv_scale == "group"):
        raise ValueError(f"dot_decode={dot_decode}: a per-group scaled cache (kv_scale='group') takes float32 "
                         "products (0) or, with qk_int8, one int8 dot product per group (5); only it takes 5")
    HT = heads
    if HT > 1 and (not stage_k or dot_bf16 or BM % HT):
        raise ValueError(f"a tile of {HT} heads needs stage_k, float32 products and block_m % heads == 0 "
                         f"(block_m={BM})")


def _tile_shape(spec: AttentionSpec, BM: int, BN: int, suffix: str, stats: str | None, dot_bf16: int, prefetch: int,
                heads: int, dot_decode: int) -> _TileShape:
    """What the pieces of a tile macro share (:class:`_TileShape`) for ``_tile_macro``'s arguments."""
    return _TileShape(
        N={n: n + suffix for n in TILE_BLOCKS + OPTIONAL_BLOCKS}, BM=BM, BN=BN, D=spec.head_dim, DV=spec.v_dim,
        HT=heads,
        # Q is scaled to the log2 units of exp2 (scale·log2(e)); with a softcap to x / c, which
        # score_mod's tanh takes (variants.score_scale)
        qscale=score_scale(spec), dot_bf16=dot_bf16, prefetch=prefetch, stats=stats,
        line_elems=CACHE_LINE // spec.kv_itemsize, transforms=transforms(spec),
        mask_mod=spec.mask_mod is not None or spec.key_bounds or spec.custom_mask, kv_dtype=spec.kv_dtype,
        dot_decode=dot_decode, qk_int8=spec.qk_int8, scale_groups=spec.scale_groups,
        v_scale_groups=spec.v_scale_groups, bf16_cache=spec.kv_dtype is None and spec.dtype == "bfloat16",
        bf16_q=spec.dtype == "bfloat16")


def _staged_buffers(k: _TileShape, stage_k: bool, kt_dtype: str, v_dtype: str, m) -> tuple:
    """The staged decode tiles' key and value buffers ``(Kt, Vb, Vt, Kb, Pq)``, local buffers of
    the row tile's block (called where its buffers are allocated; ``m``, a placeholder, for
    those a form has not, never read): a tile of several kv heads stages one key of every head
    (``Kt (HT, D)``) and its value tile (``Vt (BN, HT, DV)``, as stored or as float32:
    ``k.vt_dtype``; with PV on bf16 pairs its bits ``Vb (HT, BN, DV)`` and their pairs ``Vt``),
    a one-head tile its key tile (``Kt (BN, D)``; ``dot_decode`` 2 also ``Vb``/``Vt``). On AMX tiles
    (``k.amx_decode``) ``Kb (HT, BN, D)`` is what the keys are staged in where they are not read
    in place, ``Vt (HT, BN/2, DV)`` V's pair words and ``Pq (BM, BN)`` P query-major (PV on tiles,
    ``k.amx_pv``; float32 queries' PV takes the float32 form's value tile)."""
    HT, BM, BN, D, DV = k.HT, k.BM, k.BN, k.D, k.DV

    def buf(name, shape, dtype):  # named as the tile's own allocations are (the schedules look them up)
        return IRBuilder.name(name, T.sblock_alloc_buffer(shape, dtype, scope="local"))

    if k.amx_decode:
        Kb = buf("Kb", (HT, BN, D), kt_dtype)
        if k.amx_pv:
            return m, m, buf("Vt", (HT, BN // 2, DV), "uint32"), Kb, buf("Pq", (BM, BN), "uint16")
        return m, m, buf("Vt", (BN, HT, DV), k.vt_dtype(v_dtype)) if HT > 1 else m, Kb, m
    if stage_k and HT > 1:
        if k.dot_decode == 2:
            return (buf("Kt", (HT, D), kt_dtype), buf("Vb", (HT, BN, DV), "uint16"),
                    buf("Vt", (HT, BN // 2, DV, 2), "uint16"), m, m)
        return buf("Kt", (HT, D), kt_dtype), m, buf("Vt", (BN, HT, DV), k.vt_dtype(v_dtype)), m, m
    if stage_k and k.dot_decode == 2:
        return (buf("Kt", (BN, D), kt_dtype), buf("Vb", (BN, DV), "uint16"), buf("Vt", (BN // 2, DV, 2), "uint16"),
                m, m)
    return (buf("Kt", (BN, D), kt_dtype) if stage_k else m), m, m, m, m


def _product_macros(k: _TileShape, stage_k: bool):
    """The tile's two products in the forms its arguments chose (float32 FMAs:
    :mod:`.vector`; bf16 pairs: :func:`.bf16dot.pair_macros`; AMX
    tiles: :func:`.amx.tile_products`): ``s_product`` (``S`` of one key tile), ``pv_product``
    (``acc = acc·alpha + P·V``) and the pair forms' ``q_pairs`` (q's bits in pairs, once per row
    tile). They take every buffer a form may read; those a
    form has not are the tile's placeholders, never read."""
    sg, pv = vector.s_gemm_macros(k), vector.pv_macros(k)
    bf = bf16dot.pair_macros(k, pv.p_of)  # the bf16 pairs: vdpbf16ps's form, and what AMX's stages
    s_gemm_dot, s_gemm_heads, s_gemm_staged, s_gemm = bf.s_gemm, sg.heads, sg.staged, sg.plain
    pv_gemm_dot, pv_gemm_dot_heads, pv_gemm_heads, pv_gemm = bf.pv_gemm, bf.pv_gemm_heads, pv.heads, pv.plain
    s_gemm_amx, pv_gemm_amx = amx.tile_products(k, bf) if k.amx else (None, None)
    # the decode nests' tiles: QKᵀ, and PV with bf16 queries (float32 ones keep the float32 PV)
    s_dec_amx, pv_dec_amx = amx.decode_products(k, bf.rescale, sg.prefetch, pv.p_of) if k.amx_decode else (None, None)
    HT, AMX, DOT, raw16 = k.HT, k.amx, bool(k.dot_bf16), k.raw16
    AMX_DEC, AMX_DEC_PV = k.amx_decode, k.amx_pv
    PV_DOT = DOT or k.dot_decode == 2  # PV on bf16 pairs (Vb, Vt, Pr, Pb)

    @T.macro
    def s_product(K, V, Ku, Kb, Kt, Qp, Qt, S, t, vc, Ksc, regs):
        if AMX:
            s_gemm_amx(Ku, Kb, Qp, S, t, vc, regs)
        elif AMX_DEC:
            s_dec_amx(Ku, Kb, Qt, S, t, vc, K, V)
        elif DOT:
            s_gemm_dot(Ku, Kb, Qp, S, t, vc)
        elif stage_k and HT > 1 and raw16:
            s_gemm_heads(Ku, Kt, Qt, S, t, vc, Ksc, K, V)
        elif stage_k and HT > 1:
            s_gemm_heads(K, Kt, Qt, S, t, vc, Ksc, K, V)
        elif stage_k and raw16:
            s_gemm_staged(Ku, Kt, Qt, S, t, vc, Ksc, K, V)
        elif stage_k:
            s_gemm_staged(K, Kt, Qt, S, t, vc, Ksc, K, V)
        else:
            s_gemm(K, Qt, S, t, vc, Ksc)

    @T.macro
    def pv_product(K, V, Vu, P, Pr, Pb, Pq, Vb, Vt, acc, alpha, t, vc, Vsc, regs, need):
        if AMX:
            pv_gemm_amx(Vu, P, Pr, Pb, Pq, Vb, Vt, acc, alpha, t, vc, Vsc, regs, need)
        elif AMX_DEC_PV:
            pv_dec_amx(K, V, Vu, P, Pq, Vt, acc, alpha, t, vc, Vsc)
        elif PV_DOT and HT > 1 and raw16:
            pv_gemm_dot_heads(Vu, P, Pr, Pb, Vb, Vt, acc, alpha, t, vc, Vsc)
        elif PV_DOT and HT > 1:
            pv_gemm_dot_heads(V, P, Pr, Pb, Vb, Vt, acc, alpha, t, vc, Vsc)
        elif PV_DOT and raw16:
            pv_gemm_dot(Vu, P, Pr, Pb, Vb, Vt, acc, alpha, t, vc, Vsc)
        elif PV_DOT:
            pv_gemm_dot(V, P, Pr, Pb, Vb, Vt, acc, alpha, t, vc, Vsc)
        elif HT > 1:
            pv_gemm_heads(Vu, P, Vt, acc, alpha, t, vc, Vsc)
        else:
            pv_gemm(V, P, acc, alpha, t, vc, Vsc)

    return s_product, pv_product, bf.q_pairs


# _tile_macro's arguments. Half-precision inputs are converted to float32 as they are loaded and
# the output rounded to the dtype as it is stored: every tile buffer, the softmax state and the
# accumulators are float32. ``stats``: what the tile writes to ``X`` besides ``O``: None,
# ``"lse"`` (block ``lse_store``) or ``"partial"`` (a split-KV partial's ``m`` and ``l``, block
# ``state_store``; ``O`` gets the raw ``acc``). The forms (float32 products,
# :mod:`.vector`): ``stage_k`` stages each key tile, with a software prefetch ``prefetch``
# tiles ahead and ``heads`` kv heads per tile (the decode nest's page order); ``dot_bf16``
# (bfloat16 inputs) puts both products on bf16 dot products with float32 sums; ``dot_decode``
# (with ``stage_k``; bfloat16 queries, or ``qk_int8``'s integers, and a bfloat16 or 8-bit cache,
# exact in bf16) puts QKᵀ (1) or both products (2) there, the scales on the float32 scores; with
# ``qk_int8``, 3 (AVX-512 VNNI) and 4 (AVX2) put QKᵀ on int8 dot products. QKᵀ on bf16 or int8
# operands rounds nothing the float32 products did not; PV's rounds P to bf16. The row sum ``l``
# adds the unrounded P. ``spec.qk_int8``: :func:`_q_macros`.
def _tile_macro(spec: AttentionSpec, BM: int, BN: int, suffix: str = "", stats: str | None = None,
                stage_k: bool = False, dot_bf16: int = 0, prefetch: int = 0, heads: int = 1,
                dot_decode: int = 0):
    """The per-row-tile pipeline (Q load, online softmax over key tiles, store) as a TVMScript macro: one piece
    of compute that every layout's frame calls with its own :class:`_Tile`. ``suffix`` is appended to every
    block name (a function may hold two nests of the tile); the other arguments: the comment above."""
    _check_tile_args(spec, BM, BN, stage_k, dot_bf16, prefetch, heads, dot_decode)
    k = _tile_shape(spec, BM, BN, suffix, stats, dot_bf16, prefetch, heads, dot_decode)
    N, HT, D, DV, neg_inf = k.N, heads, spec.head_dim, spec.v_dim, T.float32(float("-inf"))
    NG, scale_load = spec.scale_groups, _scale_macro(k, spec)
    fine = NG > 0  # per-token or per-group scales (a tile's own, scale_load)
    # the key tile's scales: per (key, row), or (head, key, group), V's groups DV/32
    SC_SHAPE, VSC_SHAPE = ((BN, BM),) * 2 if k.token_scales else ((HT, BN, NG), (HT, BN, spec.v_scale_groups))
    s_product, pv_product, q_pairs = _product_macros(k, stage_k)
    (online_softmax, store), q_load = (_softmax_macro(k), _store_macro(k)), _q_macros(k)
    # Qt's and Kt's: bf16 bits for dot_decode 1/2, the signed and unsigned bytes of vpdpbusd for 3
    QT_DTYPE, KT_DTYPE = {0: ("float32",) * 2, 3: ("int8", "uint8")}.get(
        dot_decode, ("int8",) * 2 if k.int8_dots else ("uint16",) * 2)
    # the AMX form (dot_bf16 2, emulated 3): P query-major (Pq); the tile config per row tile
    # and the AMX functions' import (amx.IR) where the tiles are real
    AMX, AMX_EMU, DOT = k.amx, dot_bf16 == amx.EMULATED, bool(dot_bf16)
    # the decode nest's tiles (dot_decode 6, emulated 7): their own config, for R rows a kv head
    AMX_DEC, QW = k.amx_decode, k.q_words
    amx_config, amx_release = amx.config_macros(N, dot_bf16 == amx.REAL or dot_decode == amx.DECODE_REAL,
                                                 k.R if AMX_DEC else 0)
    KV_LOOP = ({"pragma_import_llvm": amx.IR} if dot_bf16 == amx.REAL else
               {"pragma_import_llvm": amx.decode_ir(k.R)} if dot_decode == amx.DECODE_REAL else None)
    cmask, mask_any = spec.custom_mask, _mask_any_macro(k)  # tiles whose mask bits are all 0: skipped

    @T.macro
    def tile(Q, K, V, O, t, nc, X):
        if not DOT:  # q transposed (D, BM), or the decode tiles' pairs or quads (D/w, BM, w)
            Qt = T.sblock_alloc_buffer((D // QW, BM, QW) if QW > 0 else (D, BM), QT_DTYPE, scope="local")
        S = T.sblock_alloc_buffer((BN, BM), "float32", scope="local")  # scores, key-major
        if k.score_mod:
            Sm = T.sblock_alloc_buffer((BN, BM), "float32", scope="local")  # softcapped / ALiBi scores
        # probabilities (the AMX form: one key pair's, packed to PV's words as made)
        P = T.sblock_alloc_buffer((2, BM) if AMX else (BN, BM), "float32", scope="local")
        m = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # running max (log2 units)
        m_new = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # max after this tile
        l = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # running sum
        alpha = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # exp2(m_old - m_new)
        acc = T.sblock_alloc_buffer((BM, DV), "float32", scope="local")  # unnormalised output
        # (placeholders, T.meta_var: buffers a form has not, bound to m without renaming it, never read)
        if cmask:
            seen = T.sblock_alloc_buffer((1,), "int32", scope="local")  # the key tile's custom-mask bits, ORed
        else:
            seen = T.meta_var(m)
        if k.qk_int8:
            qs = T.sblock_alloc_buffer((2, BM), "float32", scope="local")  # the rows' max|q|, then s_q; 128·Σq_i
        if fine:  # the key tile's key and value scales: per (key, row) as S, or (head, key, group)
            Ksc = T.sblock_alloc_buffer(SC_SHAPE, "float32", scope="local")
            Vsc = T.sblock_alloc_buffer(VSC_SHAPE, "float32", scope="local")
        else:
            Ksc, Vsc = T.meta_var((m, m))
        if dot_decode == 2:
            Pr = T.sblock_alloc_buffer((BN, BM), "uint16", scope="local")  # P rounded, key-major
            Pb = T.sblock_alloc_buffer((BN // 2, BM, 2), "uint16", scope="local")  # p pairs (key)
        elif not DOT:
            Pr, Pb = T.meta_var((m, m))
        if DOT:
            Qu = T.decl_buffer(Q.shape, "uint16", data=Q.data, align=A)  # bf16 inputs as their bits
            Ku = T.decl_buffer(K.shape, "uint16", data=K.data, align=A)
            Vu = T.decl_buffer(V.shape, "uint16", data=V.data, align=A)
            Qp = T.sblock_alloc_buffer((D // 2, BM, 2), "uint16", scope="local")  # q pairs (d)
            Kb = T.sblock_alloc_buffer((BN, D), "uint16", scope="local")  # the key tile
            if AMX:  # V's and P's pairs as words (one pass each), P query-major (amx.tile_products)
                Vt = T.sblock_alloc_buffer((BN // 2, DV), "uint32", scope="local")
                Pb = T.sblock_alloc_buffer((BN // 2, BM), "uint32", scope="local")
                Pq = T.sblock_alloc_buffer((BM, BN), "uint16", scope="local")
                Vb, Pr = T.meta_var((m, m))
            else:
                Vb = T.sblock_alloc_buffer((BN, DV), "uint16", scope="local")  # the value tile
                Vt = T.sblock_alloc_buffer((BN // 2, DV, 2), "uint16", scope="local")  # v pairs (key)
                Pr = T.sblock_alloc_buffer((BN, BM), "uint16", scope="local")  # P rounded, key-major
                Pb = T.sblock_alloc_buffer((BN // 2, BM, 2), "uint16", scope="local")  # p pairs (key)
                Pq = T.meta_var(m)
            Qt, Kt = T.meta_var((m, m))
        else:
            Qp = T.meta_var(m)
            Kt, Vb, Vt, Kb, Pq = T.meta_var(_staged_buffers(k, stage_k, KT_DTYPE, V.dtype, m))
        lz = T.meta_var(_lazy_state(BM) if AMX else (m, m))  # the AMX form's lazy correction
        # the emulated tile registers (C 0-3, A 4-5, B 6-7)
        regs = T.meta_var(amx.emulated_registers() if AMX_EMU else (m, m, m))
        if not DOT and k.v_bits:  # a bf16 cache read as its bits (decode_dot's products, staged values)
            Ku = T.decl_buffer(K.shape, "uint16", data=K.data, align=A)
            Vu = T.decl_buffer(V.shape, "uint16", data=V.data, align=A)
        elif not DOT:  # the products read K and V as they are
            Ku, Vu = T.meta_var((K, V))

        if AMX or AMX_DEC:
            amx_config()
        if DOT:
            q_pairs(Qu, Qp, t)
        else:
            if k.qk_int8:
                q_load(Q, Qt, t, qs)
            else:
                q_load(Q, Qt, t, m)  # (m: a placeholder, never read)
        for i in T.serial(BM):
            with T.sblock(N["state_init"]):
                vi = T.axis.remap("S", [i])
                m[vi] = neg_inf
                l[vi] = T.float32(0)
        for i, d in T.grid(BM, DV):
            with T.sblock(N["acc_init"]):
                vi, vd = T.axis.remap("SS", [i, d])
                acc[vi, vd] = T.float32(0)

        for c in T.serial(t.n_tiles(nc), annotations=KV_LOOP):
            with T.sblock(N["kv_tile"]):
                # The key-tile loop carries m, l and acc from one tile to the next: a
                # reduction over tiles. Inside it each buffer has exactly one writer
                # block, so every stage is a proper (decomposable) reduction.
                vc = T.axis.reduce(nc, c)
                if cmask:  # whether any row of the tile may see a key of it (else the tile is skipped)
                    mask_any(seen, t, vc)
                if t.tile_seen(seen):
                    if fine:
                        scale_load(Ksc, Vsc, t, vc)
                    s_product(K, V, Ku, Kb, Kt, Qp, Qt, S, t, vc, Ksc, regs)
                    if k.score_mod and k.qk_int8:
                        online_softmax(S, Sm, P, m, m_new, l, alpha, t, vc, qs, Ksc, lz, Pb)
                    elif k.score_mod:
                        online_softmax(S, Sm, P, m, m_new, l, alpha, t, vc, m, Ksc, lz, Pb)  # (m for qs: never read)
                    elif k.qk_int8:
                        online_softmax(S, S, P, m, m_new, l, alpha, t, vc, qs, Ksc, lz, Pb)  # (no Sm: never read)
                    else:
                        online_softmax(S, S, P, m, m_new, l, alpha, t, vc, m, Ksc, lz, Pb)
                    pv_product(K, V, Vu, P, Pr, Pb, Pq, Vb, Vt, acc, alpha, t, vc, Vsc, regs, lz[1])
        store(O, X, acc, m, l, t)
        if AMX or AMX_DEC:
            amx_release()

    return tile


#: Suffix of the split-KV form of a decode nest (``row_tile_dec4_split``...); its partials are
#: combined by the ``merge_dec4`` block.
SPLIT = "_split"
MERGE = "merge"
#: Fewest keys one split-KV task takes: below this a task's fixed cost (its Q load, partial
#: store and share of the merge) outweighs the parallelism it adds. 256 keys of D=128 fp32 K and
#: V are 256 KiB of streaming reads.
MIN_SPLIT_KEYS = 256


class _Dense:
    """What every nest of a dense-query kernel shares: its dims (ints, or the symbolic vars of
    ``spec.dynamic``), the layout's K/V addressing (:mod:`.kv`), the tile sizes, and the key
    tiles a row tile may stream (``NC``)."""

    def __init__(self, spec: AttentionSpec, block_m: int, block_n: int):
        self.spec = spec
        self.B, self.H, self.KH = dim(spec, "batch"), spec.heads, spec.kv_heads
        self.SQ, self.D, self.DV = dim(spec, "seq_q"), spec.head_dim, spec.v_dim
        self.G = spec.group_size
        self.BM, self.BN = block_m, block_n
        self.kv = kv_layout(spec, self.B, self.D)
        if spec.append:  # the appended keys count in every sequence's length
            self.kv.new = self.SQ
        SQ, BM = self.SQ, block_m
        self.NR = T.floordiv(SQ + BM - 1, BM) if not isinstance(SQ, int) else math.ceil(SQ / BM)  # row tiles
        self.NC = self._key_tiles(block_n)
        self.lse = bool(spec.return_lse)

    def _key_tiles(self, BN: int):
        """The key tiles of ``BN`` keys a row tile may stream (the layout's bound on its keys)."""
        bound = self.kv.bound
        return T.floordiv(bound + BN - 1, BN) if not isinstance(bound, int) else math.ceil(bound / BN)

    def with_key_tile(self, block_n: int) -> _Dense:
        """The same dims and K/V addressing (its symbolic vars too) with key tiles of ``block_n``."""
        out = copy.copy(self)
        out.BN, out.NC = block_n, self._key_tiles(block_n)
        return out


def _main_nest(f: _Dense, dot_bf16: int):
    """The main nest: one row tile per (batch, head, block of ``block_m`` query rows)."""
    spec, B, H, SQ, D, G, BM, BN, kv, NC, lse = f.spec, f.B, f.H, f.SQ, f.D, f.G, f.BM, f.BN, f.kv, f.NC, f.lse
    NR = f.NR
    tile = _tile_macro(spec, BM, BN, stats="lse" if lse else None, dot_bf16=dot_bf16,
                       stage_k=stages_half_keys(spec, dot_bf16))

    def at(X, W, vb, vh, vr):
        return _Tile(
            spec, BM, BN, vr * BM, SQ, kv.length(X, vb),
            q_index=lambda row, d: (vb, vh, row, d),
            kv_index=lambda key, d: kv.index(X, vb, vh // G, key, d),
            o_index=lambda row, d: (vb, vh, row, d),
            always_masked=False,
            lse_index=lambda row: (vb, vh, row),
            var=W, b=vb, head=lambda row: vh,
        )

    @T.macro
    def main_nest(Q, K, V, O, LSE, X, W):
        for b, h, r in T.grid(B, H, NR):
            with T.sblock("row_tile"):
                vb, vh, vr = T.axis.remap("SSS", [b, h, r])
                T.reads([Q[vb, vh, 0:SQ, 0:D]] + kv.reads(K, V, X, vb, vh // G))
                if lse:
                    T.writes(O[vb, vh, 0:SQ, 0:f.DV], LSE[vb, vh, 0:SQ])
                else:
                    T.writes(O[vb, vh, 0:SQ, 0:f.DV])
                tile(Q, K, V, O, at(X, W, vb, vh, vr), NC, LSE)

    return main_nest


def _latent_nest(f: _Dense, dot_bf16: int, split_tasks: int = 0):
    """The main nest of a latent cache (MLA): one kv head for all ``H`` query heads, so a row
    tile packs them: row ``p`` of sequence ``b`` is position ``p // H`` of head ``p % H``, and one
    tile per (batch, ``block_m`` packed rows) reads the latent rows once for ``block_m`` heads
    (``H / block_m`` tiles per position instead of ``H``).

    With ``split_tasks`` (flash-decoding, as the decode tiers'): when the ``batch · NRP`` row
    tiles are fewer than ``split_tasks`` (a small batch, or few heads: DeepSeek's 128 heads over
    8 devices are 16 per device), each sequence's keys are split into ``NS = ceil(split_tasks /
    (batch · NRP))`` chunks (multiples of ``block_n``, at least ``MIN_SPLIT_KEYS`` keys); each
    (batch, row tile, chunk) task writes its unnormalised ``acc`` and ``m``/``l`` to a workspace
    (blocks ``*_split``) and ``merge`` combines them per row."""
    spec, B, H, SQ, D, DV, BM, BN, kv, NC, lse = (f.spec, f.B, f.H, f.SQ, f.D, f.DV, f.BM, f.BN, f.kv, f.NC,
                                                  f.lse)
    rows = SQ * H
    NRP = T.floordiv(rows + BM - 1, BM) if not isinstance(rows, int) else math.ceil(rows / BM)
    tile = _tile_macro(spec, BM, BN, stats="lse" if lse else None, dot_bf16=dot_bf16,
                       stage_k=stages_half_keys(spec, dot_bf16))
    NS = n_splits(split_tasks, B, NRP)
    single = isinstance(NS, int) and NS == 1  # known at build time: no split nest

    def qo(vb, p):  # (batch, head, position) of packed row p
        return (vb, T.floormod(p, H), T.floordiv(p, H))

    def at(X, W, vb, vr):
        return _Tile(
            spec, BM, BN, vr * BM, rows, kv.length(X, vb),
            q_index=lambda p, d: qo(vb, p) + (d,),
            kv_index=lambda key, d: kv.index(X, vb, 0, key, d),
            o_index=lambda p, d: qo(vb, p) + (d,),
            always_masked=True,
            pos=lambda p: T.floordiv(p, H),
            seq_q=SQ,
            lse_index=lambda p: qo(vb, p),
            var=W, b=vb, head=lambda p: T.floormod(p, H),
        )

    @T.macro
    def latent_nest(Q, K, V, O, LSE, X, W):
        for b, r in T.grid(B, NRP):
            with T.sblock("row_tile"):
                vb, vr = T.axis.remap("SS", [b, r])
                T.reads([Q[vb, 0:H, 0:SQ, 0:D]] + kv.reads(K, V, X, vb, 0))
                if lse:
                    T.writes(O[vb, 0:H, 0:SQ, 0:DV], LSE[vb, 0:H, 0:SQ])
                else:
                    T.writes(O[vb, 0:H, 0:SQ, 0:DV])
                tile(Q, K, V, O, at(X, W, vb, vr), NC, LSE)

    if single:
        return latent_nest, False

    tile_split = _tile_macro(spec, BM, BN, SPLIT, stats="partial", dot_bf16=dot_bf16,
                             stage_k=stages_half_keys(spec, dot_bf16))
    SLOTS = 2 * split_tasks

    def task(vb, vr, vs):  # the workspace slot of (sequence, row tile, chunk)
        return (vb * NRP + vr) * NS + vs

    merge = _merge_macro(f, BM, NS, "", tiles=NRP, task=task)
    locate = _split_locate(f)

    def in_tile(p, vr):
        # packed row p's row in tile vr, simplified: an index p - vr·BM left as it is (its
        # terms cancel) divides by zero in TVM's buffer compaction once the merge reads St
        return Analyzer().simplify(p - vr * BM)

    def split_at(X, W, vb, vr, vs, spl):
        # spl[0]: the chunk's first key, spl[1]: its keys (computed once per task, split_locate)
        L = kv.length(X, vb)
        k0 = spl[0]
        return _Tile(
            spec, BM, BN, vr * BM, rows, spl[1],
            q_index=lambda p, d: qo(vb, p) + (d,),
            kv_index=lambda key, d: kv.index(X, vb, 0, k0 + key, d),
            o_index=lambda p, d: (task(vb, vr, vs), in_tile(p, vr), d),
            always_masked=True,
            pos=lambda p: T.floordiv(p, H),
            seq_q=SQ,
            offset=Visibility.offset(SQ, L - k0),  # the chunk's keys start at k0
            seq_keys=L,
            state_index=lambda p, j: (task(vb, vr, vs), in_tile(p, vr), j),
            var=W, b=vb, head=lambda p: T.floormod(p, H), key0=k0,
        )

    @T.macro
    def split_nest(Q, K, V, O, LSE, X, W):
        with T.sblock("split_kv"):
            T.reads([_whole(x) for x in (Q, K) + X])
            if lse:
                T.writes(O[0:B, 0:H, 0:SQ, 0:DV], LSE[0:B, 0:H, 0:SQ])
            else:
                T.writes(O[0:B, 0:H, 0:SQ, 0:DV])
            # one slot per task: taken only while B·NRP < split_tasks, so the B·NRP·NS tasks
            # are fewer than 2·split_tasks (a size that grows with nothing). Read and written
            # through views of their data: TVM's buffer compaction would shrink them to the
            # region the tasks touch, a size of batch · seq_q
            Opw = T.sblock_alloc_buffer((SLOTS, BM, DV), "float32")
            Stw = T.sblock_alloc_buffer((SLOTS, BM, 2), "float32")
            Op = T.decl_buffer((SLOTS, BM, DV), "float32", data=Opw.data)  # unnormalised acc per chunk
            St = T.decl_buffer((SLOTS, BM, 2), "float32", data=Stw.data)  # m, l per chunk
            for b, r, sp in T.grid(B, NRP, NS):
                with T.sblock("row_tile" + SPLIT):
                    vb, vr, vs = T.axis.remap("SSS", [b, r, sp])
                    T.reads([Q[vb, 0:H, 0:SQ, 0:D]] + kv.reads(K, V, X, vb, 0))
                    T.writes(Op[task(vb, vr, vs), 0:BM, 0:DV], St[task(vb, vr, vs), 0:BM, 0:2])
                    spl = T.sblock_alloc_buffer((2,), "int32", scope="local")
                    locate(spl, X, W, vb, vs, NS, "")
                    tile_split(Q, K, V, Op, split_at(X, W, vb, vr, vs, spl), NC, St)
            merge(Op, St, O, LSE, K, V, X, W)

    @T.macro
    def nest(Q, K, V, O, LSE, X, W):
        if NS == 1:
            latent_nest(Q, K, V, O, LSE, X, W)
        else:
            split_nest(Q, K, V, O, LSE, X, W)

    return nest, True


class _Packing:
    """The GQA packing of a decode tier: tile row ``p`` of head block ``vkb`` is kv head
    ``head_of(vkb, p)``, packed row ``loc(p)`` of that head, which is position ``loc(p) // G`` of
    query head ``head_of·G + loc(p) % G``. ``NH`` kv heads per task, ``BD`` rows per head. One
    head per task keeps the expressions of the per-head workload (tuning logs match it
    structurally)."""

    def __init__(self, f: _Dense, BD: int, NH: int):
        self.f, self.BD, self.NH = f, BD, NH

    def head_of(self, vkb, p):
        return vkb if self.NH == 1 else vkb * self.NH + T.floordiv(p, self.BD)

    def loc(self, p):
        return p if self.NH == 1 else T.floormod(p, self.BD)

    def q_of(self, vb, vkb, p):
        G = self.f.G
        return (vb, self.head_of(vkb, p) * G + T.floormod(self.loc(p), G), T.floordiv(self.loc(p), G))

    def pos(self, p):
        return T.floordiv(self.loc(p), self.f.G)

    def head(self, vkb, p):
        """The query head of packed row ``p``."""
        return self.head_of(vkb, p) * self.f.G + T.floormod(self.loc(p), self.f.G)

    def kv_of(self, X, vb, vkb, k0=None):
        kv, NH = self.f.kv, self.NH
        at = (lambda key: key) if k0 is None else (lambda key: k0 + key)
        if NH == 1:
            return lambda key, d: kv.index(X, vb, vkb, at(key), d)
        return lambda key, d, h: kv.index(X, vb, vkb * NH + h, at(key), d)

    def h0(self, vkb):  # first kv head of head block vkb
        return vkb if self.NH == 1 else vkb * self.NH


def _merge_macro(f: _Dense, BD: int, NS, suffix: str, tiles=None, task=None):
    """The ``merge<suffix>`` block of a split nest: per query row, ``M = max m_s``, ``O =
    Σ acc_s·2^(m_s-M) / Σ l_s·2^(m_s-M)`` over the chunks' partials ``Op``/``St`` ``(B, tiles,
    NS, BD, ·)``. A decode tier's (``tiles`` None): one tile per kv head, its rows GQA-packed;
    a latent nest's: ``tiles`` row tiles of ``BD`` packed rows (row ``p`` is position ``p // H``
    of head ``p % H``), one block per row of a tile, its partials in ``(slots, BD, ·)`` at slot
    ``task(b, tile, chunk)``."""
    spec, B, H, SQ, D, G, kv, lse = f.spec, f.B, f.H, f.SQ, f.DV, f.G, f.kv, f.lse  # D: the output's (V's)
    neg_inf = T.float32(float("-inf"))

    def reads(Op, St, vb, vh):
        if tiles is None:  # a decode tier: the kv head's tile
            return [Op[vb, vh // G, 0:NS, 0:BD, 0:D], St[vb, vh // G, 0:NS, 0:BD, 0:2]]
        return [_whole(Op), _whole(St)]

    def at(vb, st, sp2, row):  # the index of a partial without its last (column) axis
        return (vb, st, sp2, row) if task is None else (task(vb, st, sp2), row)

    def merged_sees_key(X, W, vb, vi):
        L = kv.length(X, vb)
        vis = Visibility.of(spec)
        return vis.sees_a_key(vis.position(vi, vis.offset(SQ, L)), L, W.start(vb))

    def out(X, W, vb, vh, vi, am, ls, mx):
        keys_sum = ls
        am, ls = W.with_sink(am, ls, mx, vh)  # the sink joins the merged denominator once
        return W.normalized(am, ls, vi, False, lambda: merged_sees_key(X, W, vb, vi), keys_sum)

    @T.macro
    def merge_row(Op, St, O, LSE, K, V, X, W, vb, vh, vi, st, row, valid):
        # query row (vb, vh, vi), whose partials are row `row` of tile `st`; nothing unless valid
        T.reads(reads(Op, St, vb, vh) + kv.reads(K, V, X, vb, 0)[2:])
        if lse:
            T.writes(O[vb, vh, vi, 0:D], LSE[vb, vh, vi])
        else:
            T.writes(O[vb, vh, vi, 0:D])
        mx = T.sblock_alloc_buffer((1,), "float32", scope="local")
        ls = T.sblock_alloc_buffer((1,), "float32", scope="local")
        w = T.sblock_alloc_buffer((1,), "float32", scope="local")
        am = T.sblock_alloc_buffer((D,), "float32", scope="local")
        if valid:
            mx[0] = neg_inf
            for sp2 in T.serial(NS):
                mx[0] = T.max(mx[0], St[at(vb, st, sp2, row) + (0,)])
            ls[0] = T.float32(0)
            for d in T.vectorized(D):
                am[d] = T.float32(0)
            for sp2 in T.serial(NS):
                w[0] = exp2_fast(St[at(vb, st, sp2, row) + (0,)] - guarded(mx[0]))
                ls[0] = ls[0] + St[at(vb, st, sp2, row) + (1,)] * w[0]
                for d in T.vectorized(D):
                    am[d] = am[d] + Op[at(vb, st, sp2, row) + (d,)] * w[0]
            for d in T.vectorized(D):
                O[vb, vh, vi, d] = cast_to(O, out(X, W, vb, vh, vi, am[d], ls[0], mx[0]))
            if lse:
                LSE[vb, vh, vi] = lse_of(mx[0], ls[0])

    @T.macro
    def merge_tier(Op, St, O, LSE, K, V, X, W):
        for b, h, i in T.grid(B, H, SQ):
            with T.sblock(MERGE + suffix):
                vb, vh, vi = T.axis.remap("SSS", [b, h, i])
                merge_row(Op, St, O, LSE, K, V, X, W, vb, vh, vi, vh // G, vi * G + T.floormod(vh, G), True)

    @T.macro
    def merge_packed(Op, St, O, LSE, K, V, X, W):
        # over (tile, row) as the workspace is laid out, rows past the last packed one skipped
        for b, r, i in T.grid(B, tiles, BD):
            with T.sblock(MERGE + suffix):
                vb, vr, vi = T.axis.remap("SSS", [b, r, i])
                merge_row(Op, St, O, LSE, K, V, X, W, vb, T.floormod(vr * BD + vi, H), T.floordiv(vr * BD + vi, H),
                          vr, vi, vr * BD + vi < SQ * H)

    return merge_tier if tiles is None else merge_packed


def _split_locate(f: _Dense):
    """The ``split_locate<suffix>`` block of a split nest: ``spl[0]`` the first key of chunk
    ``vs`` of ``NS``, ``spl[1]`` its keys. The chunks split the keys from the first one a step's
    rows may see, down to a tile edge (a window or a start hides those before it; 0 otherwise),
    in multiples of ``block_n``, at least ``MIN_SPLIT_KEYS`` keys each."""
    SQ, BN, kv = f.SQ, f.BN, f.kv
    vis = Visibility.of(f.spec)
    skips = vis.windowed  # keys before a window or a start: the chunks begin past them

    def first(X, W, vb):
        L = kv.length(X, vb)
        begin = vis.key_begin(vis.position(0, vis.offset(SQ, L)), W.start(vb))
        return vis.tiles_before(begin, BN) * BN

    def chunk(L, NS):
        # truncdiv: every operand is non-negative, and floordiv by a run-time divisor lowers
        # to selects that nest exponentially
        per = T.truncdiv(T.truncdiv(L + NS - 1, NS) + BN - 1, BN) * BN
        return T.max(MIN_SPLIT_KEYS, per)

    @T.macro
    def locate(spl, X, W, vb, vs, NS, suffix):
        with T.sblock("split_locate" + suffix):
            if skips:
                spl[0] = first(X, W, vb) + vs * chunk(kv.length(X, vb) - first(X, W, vb), NS)
                spl[1] = T.max(0, T.min(chunk(kv.length(X, vb) - first(X, W, vb), NS), kv.length(X, vb) - spl[0]))
            else:
                spl[0] = vs * chunk(kv.length(X, vb), NS)
                spl[1] = T.max(0, T.min(chunk(kv.length(X, vb), NS), kv.length(X, vb) - spl[0]))

    return locate


def _decode_tier(f: _Dense, BD: int, suffix: str, split_tasks: int, stage: bool, prefetch: int, NH: int,
                 dot: int = 0):
    """The packed decode nest of ``BD`` rows per kv head (blocks ``*<suffix>``) and its split-KV
    form (``*<suffix>_split``, merged by ``merge<suffix>``), as one macro that picks between them
    at run time. ``stage``: the tier stages its key tiles (``_tile_macro``'s ``stage_k``), with a
    software prefetch ``prefetch`` tiles ahead, ``NH`` kv heads per task and its products on
    bf16 operands with ``dot`` (``_tile_macro``'s ``dot_decode``: 1 QKᵀ, 2 both)."""
    spec, B, H, KH, SQ, D, G, BN, kv, NC, lse = f.spec, f.B, f.H, f.KH, f.SQ, f.D, f.G, f.BN, f.kv, f.NC, f.lse
    DV = f.DV
    pf = prefetch if stage else 0
    BT, KB = BD * NH, KH // NH  # tile rows, head blocks
    NS = n_splits(split_tasks, B, KB)  # key-range chunks per sequence
    single = isinstance(NS, int) and NS == 1  # known at build time: no split nest
    pk = _Packing(f, BD, NH)
    h0 = pk.h0

    locate = _split_locate(f)
    tile_dec = _tile_macro(spec, BT, BN, suffix, stats="lse" if lse else None, stage_k=stage, prefetch=pf,
                           heads=NH, dot_decode=dot)
    tile_split = _tile_macro(spec, BT, BN, suffix + SPLIT, stats="partial", stage_k=stage, prefetch=pf,
                             heads=NH, dot_decode=dot)
    merge = _merge_macro(f, BD, NS, suffix)

    def packed(X, W, vb, vkb):
        # One tile per (batch, head block) holds all SQ·G packed rows of its heads
        return _Tile(
            spec, BT, BN, 0, SQ * G, kv.length(X, vb),
            q_index=lambda p, d: pk.q_of(vb, vkb, p) + (d,),
            kv_index=pk.kv_of(X, vb, vkb),
            o_index=lambda p, d: pk.q_of(vb, vkb, p) + (d,),
            always_masked=True,
            pos=pk.pos,
            seq_q=SQ,
            lse_index=lambda p: pk.q_of(vb, vkb, p),
            heads=NH,
            var=W, b=vb, head=lambda p: pk.head(vkb, p),
        )

    def split_at(X, W, vb, vkb, vs, spl):
        # spl[0]: the chunk's first key, spl[1]: its keys (computed once per task, split_locate)
        L = kv.length(X, vb)
        k0 = spl[0]
        return _Tile(
            spec, BT, BN, 0, SQ * G, spl[1],
            q_index=lambda p, d: pk.q_of(vb, vkb, p) + (d,),
            kv_index=pk.kv_of(X, vb, vkb, k0),
            o_index=lambda p, d: (vb, pk.head_of(vkb, p), vs, pk.loc(p), d),
            always_masked=True,
            pos=pk.pos,
            seq_q=SQ,
            offset=Visibility.offset(SQ, L - k0),  # the chunk's keys start at k0
            seq_keys=L,
            state_index=lambda p, j: (vb, pk.head_of(vkb, p), vs, pk.loc(p), j),
            heads=NH,
            var=W, b=vb, head=lambda p: pk.head(vkb, p), key0=k0,
        )

    @T.macro
    def decode_nest(Q, K, V, O, LSE, X, W):
        for b, kh in T.grid(B, KB):
            with T.sblock("row_tile" + suffix):
                vb, vkh = T.axis.remap("SS", [b, kh])
                T.reads([Q[vb, h0(vkh) * G:h0(vkh) * G + NH * G, 0:SQ, 0:D]] + kv.reads(K, V, X, vb, h0(vkh), NH))
                if lse:
                    T.writes(O[vb, h0(vkh) * G:h0(vkh) * G + NH * G, 0:SQ, 0:DV],
                             LSE[vb, h0(vkh) * G:h0(vkh) * G + NH * G, 0:SQ])
                else:
                    T.writes(O[vb, h0(vkh) * G:h0(vkh) * G + NH * G, 0:SQ, 0:DV])
                tile_dec(Q, K, V, O, packed(X, W, vb, vkh), NC, LSE)

    @T.macro
    def split_nest(Q, K, V, O, LSE, X, W):
        with T.sblock("split_kv" + suffix):
            T.reads([_whole(x) for x in (Q, K, V) + X])
            if lse:
                T.writes(O[0:B, 0:H, 0:SQ, 0:DV], LSE[0:B, 0:H, 0:SQ])
            else:
                T.writes(O[0:B, 0:H, 0:SQ, 0:DV])
            Op = T.sblock_alloc_buffer((B, KH, NS, BD, DV), "float32")  # unnormalised acc per chunk
            St = T.sblock_alloc_buffer((B, KH, NS, BD, 2), "float32")  # m, l per chunk
            for b, kh, sp in T.grid(B, KB, NS):
                with T.sblock("row_tile" + suffix + SPLIT):
                    vb, vkh, vs = T.axis.remap("SSS", [b, kh, sp])
                    T.reads([Q[vb, h0(vkh) * G:h0(vkh) * G + NH * G, 0:SQ, 0:D]] + kv.reads(K, V, X, vb, h0(vkh), NH))
                    if NH == 1:
                        T.writes(Op[vb, vkh, vs, 0:BD, 0:DV], St[vb, vkh, vs, 0:BD, 0:2])
                    else:
                        T.writes(Op[vb, h0(vkh):h0(vkh) + NH, vs, 0:BD, 0:DV],
                                 St[vb, h0(vkh):h0(vkh) + NH, vs, 0:BD, 0:2])
                    spl = T.sblock_alloc_buffer((2,), "int32", scope="local")
                    locate(spl, X, W, vb, vs, NS, suffix)
                    tile_split(Q, K, V, Op, split_at(X, W, vb, vkh, vs, spl), NC, St)
            merge(Op, St, O, LSE, K, V, X, W)

    @T.macro
    def tier(Q, K, V, O, LSE, X, W):
        if single:
            decode_nest(Q, K, V, O, LSE, X, W)
        elif NS == 1:
            decode_nest(Q, K, V, O, LSE, X, W)
        else:
            split_nest(Q, K, V, O, LSE, X, W)

    return tier


def _dense(spec: AttentionSpec, block_m: int, block_n: int, decode_rows: tuple[int, ...] = (),
           split_tasks: int = 0, stage_k_below: int = 0, dot_bf16: int = 0, prefetch: int = 0,
           decode_heads: int = 1, decode_dot: int = 0, decode_block_n: int = 0) -> tirx.PrimFunc:
    """Layouts with dense queries, ``Q``/``O (B, H, Sq, D)``: ``bhsd`` (``K``/``V (B, KH, Skv,
    D)``), ``kvcache`` (``K``/``V (B, KH, max_len, D)`` + ``cache_seqlens (B,)``) and ``paged``
    (``K``/``V (num_pages, page_size, KH, D)`` + ``block_table (B, max_pages)`` +
    ``cache_seqlens``); then ``O``, and ``LSE (B, H, Sq)`` float32 when ``spec.return_lse``.

    Main nest: one row tile per (batch, head, block of ``block_m`` query rows).

    With ``decode_rows`` (symbolic seq_q only) the function holds a second nest, taken at run
    time when ``seq_q · group ≤ decode_rows`` (decode: one or a few new tokens per sequence). Its
    tile packs the ``group`` query heads that share a kv head (row ``p`` is position ``p //
    group`` of head ``kv_head·group + p % group``), ``decode_rows`` rows per tile, one tile per
    (batch, kv head): a decode step computes ``decode_rows`` rows per kv head instead of
    ``block_m`` per query head, and reads each K/V tile once for the whole group.

    With ``split_tasks`` as well (flash-decoding): when ``batch · kv_heads`` tiles are fewer than
    ``split_tasks``, each sequence's key range is split into ``NS = ceil(split_tasks / (batch ·
    kv_heads))`` chunks (multiples of ``block_n``, at least ``MIN_SPLIT_KEYS`` keys). Each
    (batch, kv head, chunk) task writes its unnormalised ``acc`` and its ``m``/``l`` to a
    workspace of ``batch · kv_heads · NS`` tiles (no size depends on a length), and the
    ``merge`` block combines them per row: ``M = max m_s``, ``O = Σ acc_s·2^(m_s-M) / Σ
    l_s·2^(m_s-M)``.

    ``decode_heads`` (the page order; staged decode tiers only): one task takes ``decode_heads``
    kv heads at once, ``decode_heads · rows`` rows, and stages each key tile for all of them (see
    ``_tile_macro``'s ``heads``). Tasks are (batch, head block[, chunk]). The paged cache keeps
    a key's kv heads side by side, so one head's keys are ``kv_heads·D`` elements apart: per
    head, a task reads ``D``-element pieces of every row; with all heads, whole rows.
    """
    f = _Dense(spec, block_m, block_n)
    SQ, G, KH = f.SQ, f.G, f.KH
    latent = spec.layout_info.latent  # one nest: the heads packed into its row tiles
    # a latent nest may take a split form (when its row tiles are few): it records split_tasks
    main_nest, latent_split = _latent_nest(f, dot_bf16, split_tasks) if latent else (_main_nest(f, dot_bf16), False)
    tiers = () if latent else tuple(sorted(decode_rows))
    if decode_heads < 1 or KH % decode_heads:
        raise ValueError(f"decode_heads={decode_heads} must divide kv_heads={KH}")
    if len(tiers) > 2:
        raise ValueError(f"at most two decode tiers, got {tiers}")
    stage_tiers = [r for r in tiers if r < stage_k_below]
    HT = decode_heads if stage_tiers else 1  # kv heads per decode task (staged tiers)
    dot = int(decode_dot) if stage_tiers else 0  # what the staged tiers take (the others: float32)
    # the int8 dot product's form follows the vectors: AVX-512 VNNI's (3) or AVX2's (4, 8 lanes)
    tile_dot = 4 if dot == 3 and stage_k_below < 16 else dot
    if dot == 3 and spec.kv_quantized and spec.kv_scale == "group":
        tile_dot = 5  # one dot product per group of 32 (a ymm of bytes: AVX2's form, or VNNI's on AVX-512)
    # the staged tiers' key tile (decode_block_n; the others and the main nest: block_n)
    fd = f.with_key_tile(decode_block_n) if decode_block_n and stage_tiers else f
    tier_macros = [_decode_tier(fd, r, DECODE + str(r), split_tasks, True, prefetch, HT, tile_dot)
                   if r < stage_k_below else _decode_tier(f, r, DECODE + str(r), split_tasks, False, prefetch, 1, 0)
                   for r in tiers]
    t0 = tier_macros[0] if tiers else None
    t1 = tier_macros[-1] if tiers else None
    r0 = tiers[0] if tiers else 0
    r1 = tiers[-1] if tiers else 0
    n_tiers = len(tiers)

    append = _append_macro(f)

    @T.macro
    def body(Q, K, V, O, LSE, X, W):
        if spec.append:  # the new keys first: every nest below attends to them
            append(K, V, X, W)
        if n_tiers == 0:
            main_nest(Q, K, V, O, LSE, X, W)
        elif n_tiers == 1:
            if SQ * G <= r0:
                t0(Q, K, V, O, LSE, X, W)
            else:
                main_nest(Q, K, V, O, LSE, X, W)
        else:
            if SQ * G <= r0:
                t0(Q, K, V, O, LSE, X, W)
            elif SQ * G <= r1:
                t1(Q, K, V, O, LSE, X, W)
            else:
                main_nest(Q, K, V, O, LSE, X, W)

    attrs = {"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused",
             **record(FUSED_TILE, block_m=block_m, block_n=block_n), "attn.data_alignment": A,
             **record(FUSED_FORM, dot_bf16=dot_bf16)}
    if tiers or latent_split:  # what regenerates this workload from a tuning record (task_mods.regenerate)
        attrs.update(record(FUSED_DECODE, decode_rows=tiers, split_tasks=split_tasks, stage_k_below=stage_k_below,
                            prefetch=prefetch, decode_heads=HT, decode_dot=dot,
                            decode_block_n=decode_block_n if stage_tiers else 0))
    return _dense_function(f, attrs, body)


def _append_macro(f: _Dense):
    """Block ``kv_append``: the call's ``k_new (B, KH, Sq, D)``/``v_new (.., DV)`` written into the cache at
    each sequence's keys ``cache_seqlens[b] .. + Sq - 1`` (paged: through ``block_table``), in the
    cache's dtype; an 8-bit cache stores ``x / scale[kv head]`` rounded to nearest even and
    saturated (``f32_to_kv``: what ``quant.quantize_kv`` stores, bit for bit); with per-token or
    per-group scales each new key's own, computed from it as ``quantize_kv`` does and written to
    ``k_scale``/``v_scale`` at its position. One task per (batch,
    kv head, new key), serial: ``B·KH·Sq`` rows of ``D`` elements, against the cache a step reads.
    A latent layout (MLA) takes ``kv_new (B, Sq, D)``: one row per new token into its one cache."""
    spec, B, KH, SQ, D, DV, kv = f.spec, f.B, f.KH, f.SQ, f.D, f.DV, f.kv
    kvd = spec.kv_dtype
    same = D == DV  # one loop writes both rows (else K's D columns, then V's DV)

    def stored(buf, x, scale):
        # without kv_dtype the cache has k_new's dtype: copied as it is (a bfloat16 value through
        # float32 and cast_to's rounding would come back unchanged)
        return x if kvd is None else f32_to_kv(f32(x) / scale, kvd)

    def scale_of(S, h):
        return None if S is None else S[h]

    NG = spec.scale_groups if kvd is not None else 0
    group = kvd is not None and spec.kv_scale == "group"
    GS = SCALE_GROUP if group else D  # elements per scale: K's
    GSV = SCALE_GROUP if group else DV  # V's
    NGV = spec.v_scale_groups if kvd is not None else 0
    fine = NG > 0

    def scale_index(X, vb, vh, vi, g):  # the new key's g-th scale (kv.index without head_dim)
        idx = kv.index(X, vb, vh, X[-1][vb] + vi, g * GS)[:-1]
        return idx + (g,) if spec.kv_scale == "group" else idx

    def magnitude(x):  # what quantize_kv's largest magnitude takes: finite |x|, else 0
        return T.Select(T.isfinite(f32(x)), T.fabs(f32(x)), T.float32(0))

    def new_scale(amax):  # quantize_kv's: largest finite magnitude / QMAX, 1 for zeros (float32)
        return T.Select(amax > T.float32(0), amax / T.float32(QMAX[kvd]), T.float32(1))

    @T.macro
    def append_fine(K, V, X, W):
        # per-token or per-group scales: each new key's own, computed from it and written beside it
        for b, h, i in T.grid(B, KH, SQ):
            with T.sblock("kv_append"):
                vb, vh, vi = T.axis.remap("SSS", [b, h, i])
                T.reads([W.KN[vb, vh, vi, 0:D], W.VN[vb, vh, vi, 0:DV]] + kv.reads(K, V, X, vb, 0)[2:])
                T.writes(_whole(K), _whole(V), _whole(W.KSC), _whole(W.VSC))
                sc = T.sblock_alloc_buffer((2, max(NG, NGV)), "float32", scope="local")
                for g in T.serial(max(NG, NGV)):
                    sc[0, g] = T.float32(0)
                    sc[1, g] = T.float32(0)
                if same:
                    for d in T.serial(D):
                        sc[0, d // GS] = T.max(sc[0, d // GS], magnitude(W.KN[vb, vh, vi, d]))
                        sc[1, d // GS] = T.max(sc[1, d // GS], magnitude(W.VN[vb, vh, vi, d]))
                    for g in T.serial(NG):
                        sc[0, g] = new_scale(sc[0, g])
                        sc[1, g] = new_scale(sc[1, g])
                        W.KSC[scale_index(X, vb, vh, vi, g)] = sc[0, g]
                        W.VSC[scale_index(X, vb, vh, vi, g)] = sc[1, g]
                    for d in T.vectorized(D):
                        K[kv.index(X, vb, vh, X[-1][vb] + vi, d)] = stored(K, W.KN[vb, vh, vi, d], sc[0, d // GS])
                        V[kv.index(X, vb, vh, X[-1][vb] + vi, d)] = stored(V, W.VN[vb, vh, vi, d], sc[1, d // GS])
                else:
                    for d in T.serial(D):
                        sc[0, d // GS] = T.max(sc[0, d // GS], magnitude(W.KN[vb, vh, vi, d]))
                    for d in T.serial(DV):
                        sc[1, d // GSV] = T.max(sc[1, d // GSV], magnitude(W.VN[vb, vh, vi, d]))
                    for g in T.serial(NG):
                        sc[0, g] = new_scale(sc[0, g])
                        W.KSC[scale_index(X, vb, vh, vi, g)] = sc[0, g]
                    for g in T.serial(NGV):
                        sc[1, g] = new_scale(sc[1, g])
                        W.VSC[scale_index(X, vb, vh, vi, g)] = sc[1, g]
                    for d in T.vectorized(D):
                        K[kv.index(X, vb, vh, X[-1][vb] + vi, d)] = stored(K, W.KN[vb, vh, vi, d], sc[0, d // GS])
                    for d in T.vectorized(DV):
                        V[kv.index(X, vb, vh, X[-1][vb] + vi, d)] = stored(V, W.VN[vb, vh, vi, d], sc[1, d // GSV])

    @T.macro
    def append(K, V, X, W):
        for b, h, i in T.grid(B, KH, SQ):
            with T.sblock("kv_append"):
                vb, vh, vi = T.axis.remap("SSS", [b, h, i])
                T.reads([W.KN[vb, vh, vi, 0:D], W.VN[vb, vh, vi, 0:DV]] + kv.reads(K, V, X, vb, 0)[2:]
                        + ([W.KSC[vh], W.VSC[vh]] if kvd is not None else []))
                T.writes(_whole(K), _whole(V))
                if same:
                    for d in T.vectorized(D):
                        K[kv.index(X, vb, vh, X[-1][vb] + vi, d)] = stored(K, W.KN[vb, vh, vi, d], scale_of(W.KSC, vh))
                        V[kv.index(X, vb, vh, X[-1][vb] + vi, d)] = stored(V, W.VN[vb, vh, vi, d], scale_of(W.VSC, vh))
                else:
                    for d in T.vectorized(D):
                        K[kv.index(X, vb, vh, X[-1][vb] + vi, d)] = stored(K, W.KN[vb, vh, vi, d], scale_of(W.KSC, vh))
                    for d in T.vectorized(DV):
                        V[kv.index(X, vb, vh, X[-1][vb] + vi, d)] = stored(V, W.VN[vb, vh, vi, d], scale_of(W.VSC, vh))

    @T.macro
    def append_latent(K, V, X, W):
        # one latent row per new token (kv_new (B, Sq, D)), for every head; V is K's buffer, and
        # an 8-bit cache's one kv_scale V's too (per token or group: the row's own, written beside it)
        for b, i in T.grid(B, SQ):
            with T.sblock("kv_append"):
                vb, vi = T.axis.remap("SS", [b, i])
                T.reads([W.KN[vb, vi, 0:D]] + kv.reads(K, V, X, vb, 0)[2:]
                        + ([W.KSC[0]] if kvd is not None and not fine else []))
                if fine:
                    T.writes(_whole(K), _whole(W.KSC))
                else:
                    T.writes(_whole(K))
                if fine:
                    sc = T.sblock_alloc_buffer((NG,), "float32", scope="local")
                    for g in T.serial(NG):
                        sc[g] = T.float32(0)
                    for d in T.serial(D):
                        sc[d // GS] = T.max(sc[d // GS], magnitude(W.KN[vb, vi, d]))
                    for g in T.serial(NG):
                        sc[g] = new_scale(sc[g])
                        W.KSC[scale_index(X, vb, 0, vi, g)] = sc[g]
                    for d in T.vectorized(D):
                        K[kv.index(X, vb, 0, X[-1][vb] + vi, d)] = stored(K, W.KN[vb, vi, d], sc[d // GS])
                else:
                    for d in T.vectorized(D):
                        K[kv.index(X, vb, 0, X[-1][vb] + vi, d)] = stored(K, W.KN[vb, vi, d], scale_of(W.KSC, 0))

    if spec.layout_info.latent:
        return append_latent
    return append_fine if fine else append


#: The index arrays a dense-query layout may take, in call order (between ``v`` and ``o``): the
#: signature template has a parameter for each, and a layout whose entry lacks one drops it.
INDEX_PARAMS = ("block_table", "cache_seqlens")
#: The variants' arguments a signature template has a parameter for (the first of
#: ``layouts.VARIANT_ARGS``), in call order after the index arrays; it drops those the spec does
#: not take (a variant added later is declared by ``variants.ExtraParams``).
VARIANT_PARAMS = TEMPLATE_ARGS


def _dense_function(f: _Dense, attrs: dict, body) -> tirx.PrimFunc:
    """The PrimFunc of a dense-query kernel, its signature read from the layout's entry
    (``layouts.py``): its arguments in call order (q, k, v, the index arrays, o, then lse when
    ``return_lse``), each argument's dims mapped to this kernel's values (ints, or its symbolic
    vars), its attrs, ``body``."""
    layout, dtype, kv_dtype = f.spec.layout_info, f.spec.dtype, f.spec.kv_dtype_name
    fp8 = kv_dtype.startswith("float8")  # read through uint8 aliases (kv_to_f32 takes the bits)
    args = layout.all_args(f.spec)
    names = [a.name for a in args]
    index = [a.name for a in layout.index_args]
    if [n for n in INDEX_PARAMS if n in index] != index:
        raise ValueError(f"layout {layout.name}: index arrays {index} are not a subsequence of {INDEX_PARAMS}")
    values = {"batch": f.B, "heads": f.H, "seq_q": f.SQ, "head_dim": f.D, "head_dim_v": f.DV, **f.kv.dim_values()}

    def shape(i):  # argument i's shape; a dropped index parameter's is a placeholder
        return tuple(values[d] for d in args[i].dims) if i is not None else (1,)

    def at(name):
        return names.index(name) if name in names else None
    latent = layout.latent  # V is K's buffer (its first head_dim_v columns), not an argument
    QS, KS, OS, LS = shape(0), shape(1), shape(names.index(layout.output.name)), shape(at("lse"))
    VS = KS if latent else shape(2)
    BTS, CLS = shape(at(INDEX_PARAMS[0])), shape(at(INDEX_PARAMS[1]))
    ALS, SKS, KSS = (shape(at(n)) for n in VARIANT_PARAMS)
    present = [n in index for n in INDEX_PARAMS]
    variants = [n in names for n in VARIANT_PARAMS]
    extra = ExtraParams(f.spec, f.B, f.SQ, f.kv.shape)

    def index_buffers(*bufs):
        return tuple(b for b, p in zip(bufs, present) if p)

    # the extra buffers become parameters after parsing: _keep_params checks the function
    @T.prim_func(s_tir=True, check_well_formed=False)
    def attention(
        Q: T.Buffer(QS, dtype, align=A),
        K: T.Buffer(KS, kv_dtype, align=A),
        V: T.Buffer(VS, kv_dtype, align=A),
        BT: T.Buffer(BTS, "int32", align=A),
        CL: T.Buffer(CLS, "int32", align=A),
        AL: T.Buffer(ALS, "float32", align=A),
        SK: T.Buffer(SKS, "float32", align=A),
        KST: T.Buffer(KSS, "int32", align=A),
        O: T.Buffer(OS, dtype, align=A),
        LSE: T.Buffer(LS, "float32", align=A),
    ):
        T.func_attr(attrs)
        if latent and fp8:  # both read through uint8 aliases of the one cache
            KL8 = T.decl_buffer(KS, "uint8", data=K.data, align=A)
            VL8 = T.decl_buffer(KS, "uint8", data=K.data, align=A)
            body(Q, KL8, VL8, O, LSE, index_buffers(BT, CL), Variants(f.spec, AL, SK, KST, *extra.variant_args))
        elif latent:
            KV = T.decl_buffer(KS, kv_dtype, data=K.data, align=A)  # V: the latent rows again
            body(Q, K, KV, O, LSE, index_buffers(BT, CL), Variants(f.spec, AL, SK, KST, *extra.variant_args))
        elif fp8:
            K8 = T.decl_buffer(KS, "uint8", data=K.data, align=A)
            V8 = T.decl_buffer(VS, "uint8", data=V.data, align=A)
            body(Q, K8, V8, O, LSE, index_buffers(BT, CL), Variants(f.spec, AL, SK, KST, *extra.variant_args))
        else:
            body(Q, K, V, O, LSE, index_buffers(BT, CL), Variants(f.spec, AL, SK, KST, *extra.variant_args))

    return _keep_params(attention, [True, True, not latent, *present, *variants, True, f.lse], extra.params,
                        1 + f.lse)


def _whole(buf):
    """The region of all of ``buf``."""
    return buf[tuple(slice(0, n) for n in buf.shape)]


def n_splits(split_tasks: int, B, KH: int):
    """Key-range chunks per sequence of a decode step: enough (batch, kv head, chunk) tasks to
    reach ``split_tasks``; 1 (no split) when the batch alone has that many. ``KH``: the tasks per
    sequence (kv heads of a decode tier, row tiles of a latent nest). An int when both are
    static, else an expression of them."""
    if not split_tasks:
        return 1
    if isinstance(B, int) and isinstance(KH, int):
        return max(1, -(-split_tasks // (B * KH)))
    # ceil(split_tasks / (B·KH)) written as (split_tasks − 1) // n + 1: no B·KH + split_tasks that
    # could pass 2**31 (B·KH is at most q's element count), and a divisor of at least 1: a C++
    # caller's batch of 0 must not divide by zero (SIGFPE); truncdiv: see chunk()
    return T.max(1, T.truncdiv(split_tasks - 1, T.max(B * KH, 1)) + 1)


def _keep_params(func: tirx.PrimFunc, keep: list[bool], extra=(), n_outputs: int = 1) -> tirx.PrimFunc:
    """``func`` with only the parameters ``keep`` marks (the others are unused in its body), and
    the buffers ``extra`` inserted before its last ``n_outputs`` parameters (the outputs), its
    bindings made unique and checked (``ssa_checked``)."""
    params = [p for p, k in zip(func.params, keep) if k]
    params = params[:len(params) - n_outputs] + list(extra) + params[len(params) - n_outputs:]
    return ssa_checked(tirx.PrimFunc(params, func.body, func.ret_type, func.attrs))


def _varlen(spec: AttentionSpec, block_m: int, block_n: int, dot_bf16: int = 0) -> tirx.PrimFunc:
    """FlashAttention's packed varlen layout: ``Q (total_q, H, D)``, ``K``/``V (total_k, KH, D)``,
    ``cu_seqlens_q``/``cu_seqlens_k (batch+1,) int32``, ``O (total_q, H, D)``.

    Work is one task per (head, tile slot). Sequence ``b``'s row tiles take the slots
    ``cu_seqlens_q[b] // block_m + b + i`` (strictly increasing in ``b``, and a sequence of
    ``L`` rows needs at most ``L // block_m + 1`` of them), so the slots number at most
    ``total_q // block_m + batch`` and a task finds its sequence by a binary search on
    ``cu_seqlens_q``. Empty slots compute nothing. Heads are the outer loop, so a static split of
    the parallel loop gives every core whole heads, each with the same mix of long and short
    sequences: a batch of one 2k-token sequence and many short ones stays balanced.
    """
    H, KH, D, DV = spec.heads, spec.kv_heads, spec.head_dim, spec.v_dim
    G = spec.group_size
    BM, BN = block_m, block_n
    TQ, TK = tirx.Var("total_q", "int32"), tirx.Var("total_k", "int32")
    # The buffer shape must be a plain var for the runtime to bind it: cu_seqlens has batch+1.
    NB1 = tirx.Var("batch_plus_1", "int32")
    NB = NB1 - 1
    NT = T.floordiv(TQ, BM) + NB  # tile slots
    NC = T.floordiv(TK + BN - 1, BN)  # bound on any sequence's key tiles
    dtype, kv_dtype = spec.dtype, spec.kv_dtype_name
    fp8 = kv_dtype.startswith("float8")  # read through uint8 aliases (kv_to_f32 takes the bits)
    lse = bool(spec.return_lse)
    tile = _tile_macro(spec, BM, BN, stats="lse" if lse else None, dot_bf16=dot_bf16,
                       stage_k=stages_half_keys(spec, dot_bf16))
    attrs = {"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused",
             **record(FUSED_TILE, block_m=BM, block_n=BN), "attn.data_alignment": A,
             **record(FUSED_FORM, dot_bf16=dot_bf16)}

    def at(seq, CQ, CK, vh, W):
        b = seq[0]
        q0, k0 = CQ[b], CK[b]
        return _Tile(
            spec, BM, BN, seq[1], CQ[b + 1] - q0, CK[b + 1] - k0,
            # max(…, 0): an empty sequence's slot clamps its (unused) row into the buffer
            q_index=lambda row, d: (T.min(q0 + T.max(row, 0), TQ - 1), vh, d),
            kv_index=lambda key, d: (k0 + key, vh // G, d),
            o_index=lambda row, d: (q0 + row, vh, d),
            always_masked=True,
            valid=seq[1] < CQ[b + 1] - q0,
            lse_index=lambda row: (vh, q0 + row),
            var=W, b=b, head=lambda row: vh,
        )

    # the signature from the layout entry: q, k, v, cu_seqlens_q, cu_seqlens_k, o, then lse
    layout = spec.layout_info
    values = {"total_q": TQ, "total_k": TK, "heads": H, "kv_heads": KH, "head_dim": D, "head_dim_v": DV,
              "batch+1": NB1}
    QS, KS, VS, CQS, CKS, OS = (tuple(values[d] for d in a.dims) for a in layout.args)
    LS = tuple(values[d] for d in layout.lse_dims)
    names = [a.name for a in layout.all_args(spec)]
    variants = [n in names for n in VARIANT_PARAMS[:2]]  # varlen has no kv_start (no padding)
    NBK = tirx.Var("key_bound_rows", "int32")  # key_lo's rows: batch, checked (index_checks)
    extra = ExtraParams(spec, NBK, kv_shape=KS)

    @T.prim_func(s_tir=True, check_well_formed=False)  # _keep_params checks it
    def attention(
        Q: T.Buffer(QS, dtype, align=A),
        K: T.Buffer(KS, kv_dtype, align=A),
        V: T.Buffer(VS, kv_dtype, align=A),
        CQ: T.Buffer(CQS, "int32", align=A),
        CK: T.Buffer(CKS, "int32", align=A),
        AL: T.Buffer((H,), "float32", align=A),
        SK: T.Buffer((H,), "float32", align=A),
        O: T.Buffer(OS, dtype, align=A),
        LSE: T.Buffer(LS, "float32", align=A),
    ):
        T.func_attr(attrs)
        for h, s in T.grid(H, NT):
            with T.sblock("row_tile"):
                vh, vs = T.axis.remap("SS", [h, s])
                T.reads(Q[0:TQ, vh, 0:D], K[0:TK, vh // G, 0:D], V[0:TK, vh // G, 0:DV], CQ[0:NB1], CK[0:NB1])
                if lse:
                    T.writes(O[0:TQ, vh, 0:DV], LSE[vh, 0:TQ])
                else:
                    T.writes(O[0:TQ, vh, 0:DV])
                # seq[0]: the sequence b of slot vs; seq[1]: the tile's first row within it.
                # seq[2], seq[3]: binary-search bounds on b.
                seq = T.sblock_alloc_buffer((4,), "int32", scope="local")
                with T.sblock("seq_locate"):
                    T.reads(CQ[0:NB1])
                    T.writes(seq[0:4])
                    seq[2] = 0
                    seq[3] = NB - 1
                    for _ in T.serial(32):  # 32 halvings cover any int32 batch
                        if seq[2] < seq[3]:
                            if T.floordiv(CQ[T.floordiv(seq[2] + seq[3] + 1, 2)], BM) + T.floordiv(seq[2] + seq[3] + 1, 2) <= vs:
                                seq[2] = T.floordiv(seq[2] + seq[3] + 1, 2)
                            else:
                                seq[3] = T.floordiv(seq[2] + seq[3] + 1, 2) - 1
                    seq[0] = seq[2]
                    seq[1] = (vs - T.floordiv(CQ[seq[2]], BM) - seq[2]) * BM
                if fp8:
                    K8 = T.decl_buffer(KS, "uint8", data=K.data, align=A)
                    V8 = T.decl_buffer(VS, "uint8", data=V.data, align=A)
                    tile(Q, K8, V8, O, at(seq, CQ, CK, vh, Variants(spec, AL, SK, None, *extra.variant_args)), NC, LSE)
                else:
                    tile(Q, K, V, O, at(seq, CQ, CK, vh, Variants(spec, AL, SK, None, *extra.variant_args)), NC, LSE)

    return _keep_params(attention, [True] * 5 + variants + [True, lse], extra.params, 1 + lse)
