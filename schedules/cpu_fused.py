"""Hand-authored CPU (LLVM) schedule for the fused flash-attention PrimFunc (``workloads/fused.py``).

The tile sizes ``block_m``/``block_n`` shape the PrimFunc itself (the online softmax is written
per tile). :func:`schedule` then, finding blocks by name:

1. register-blocks ``S_gemm`` as ``for key block: for d: for s_rows keys (unrolled): for query
   rows (vector)`` — one K element broadcast against ``block_m`` query rows, ``s_rows ×
   block_m / lanes`` accumulators held in vector registers across the ``d`` loop;
2. register-blocks ``PV_gemm`` as ``for row block: [for column block:] for key: for pv_rows rows
   (unrolled): for pv_cols columns (vector)`` — one V row segment reused by ``pv_rows`` query
   rows; head_dim is split into ``pv_cols`` column blocks only when one row of accumulators
   over all of it would not fit the vector registers (D=128 on AVX2, D=512 on AVX-512);
3. vectorizes every softmax stage across query rows (the score tile is key-major, so row max and
   row sum are element-wise vector ops);
4. optionally auto-unrolls the key-tile body;
5. hoists reduction inits (``acc·alpha``, ``l·alpha``, ``m_new = m``) out of their loops;
6. parallelizes over the fused (batch, head, row tile) loop, ``parallel_chunk`` tiles per task.

The same function is the hand schedule (decisions pinned to the knobs) and the MetaSchedule
design space (decisions sampled). Knobs are a frozen dataclass; ``check`` rejects infeasible sets
against named hardware limits before anything is built; ``preset`` gives the per-target default.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from tvm import s_tir
from tvm.target import Target

from ..layouts import LAYOUTS
from ..quant import KV_SCALES
from ..spec import KV_DTYPES, SUPPORTED_DTYPES, VARIANTS, AttentionSpec
from ..target import target_features, vector_lanes
from ..workloads import fused_attention
from ..workloads.fused import DECODE, MERGE, SPLIT, n_splits
from ..workloads.knob_attrs import FUSED, FUSED_DECODE

from . import cpu_amx, cpu_balance, cpu_bf16, cpu_decode
from ._knobs import KnobError, KnobsMixin
from .cpu_space import (AUTO_UNROLL_STEPS, D_UNROLL_MAX, MAX_TILE_BYTES, PARALLEL_CHUNKS, PV_ROWS_GOAL,
                        VECTOR_REGISTERS, dot_pv_columns, max_pv_rows, max_s_rows, pv_columns, sample_choice,
                        sample_tile, vectorize_rows)
from .family import Capabilities, read_attrs

NAME = "fused"
#: every layout, dtype (stored; it computes in float32 always), symbolic dim, the lse output and
#: every attention variant. The layouts are the registry's live view: a layout registered after
#: this import (docs/design.md's way to add one) is built too
CAPABILITIES = Capabilities(label=NAME, target="cpu", layouts=LAYOUTS.keys(), dtypes=SUPPORTED_DTYPES,
                            symbolic=True, lse=True, variants=VARIANTS, kv_dtypes=KV_DTYPES,
                            appends=True, qk_int8=True, kv_scales=KV_SCALES, head_dim_v=True)


@dataclasses.dataclass(frozen=True)
class FlashCPUKnobs(KnobsMixin):
    FAMILY = NAME

    block_m: int = 32  # BLOCK_M: query rows per row tile (row_tile); a multiple of vector_lanes
    block_n: int = 64  # BLOCK_N: keys per key tile (kv_tile)
    s_rows: int = 4  # keys per register block of S_gemm, unrolled (accumulators: s_rows·block_m/lanes)
    pv_rows: int = 4  # query rows per register block of PV_gemm, unrolled (pv_rows·pv_cols/lanes)
    pv_cols: int = 0  # head_dim columns per PV_gemm register block (0 = all of head_dim)
    vector_lanes: int = 16  # float32 SIMD lanes: 16 = AVX-512, 8 = AVX2
    d_unroll: int = 1  # S_gemm: head_dim steps unrolled per iteration (1 = leave to LLVM)
    parallel_chunk: int = 1  # row tiles per parallel task (1 = finest load balance)
    auto_unroll: int = 0  # pragma_auto_unroll_max_step on the key-tile loop (0 = off)
    # Decode steps (symbolic seq_q): when batch·kv_heads tiles are fewer than this, split each
    # sequence's keys so that about this many tasks run (flash-decoding); 0 = never split.
    split_tasks: int = 8
    # bfloat16 specs: 1 = QKᵀ and PV of the main nest as AVX512-BF16 dot products (cpu_bf16),
    # 0 = float32 products of the converted inputs. Needs avx512bf16 (Zen 4/5, Sapphire Rapids); the
    # preset takes it where this host's dot products outrun its FMAs (cpu_balance: Zen, not Intel).
    dot_bf16: int = 0
    # Decode nests (dot-product scheduled, cpu_decode): software prefetch of the K/V rows this
    # many key tiles ahead (0 = leave it to the hardware prefetcher).
    prefetch: int = 0
    # Decode nests: kv heads per task (the page order). 1: one task per (sequence, kv head)
    # streams that head's keys; more: a task takes a key tile for that many heads at once,
    # which reads a paged cache's rows whole (its heads sit side by side in a page).
    decode_heads: int = 1
    # Staged decode nests on AVX512-BF16, bfloat16 queries: 1 = QKᵀ as bf16 dot products
    # (cpu_decode, vdpbf16ps) on q and the keys widened to bf16 (exact for a bf16 or 8-bit
    # cache: nothing rounded), PV float32; 2 = PV too, P rounded to bf16 (as dot_bf16's
    # prefill); 0 = float32 FMAs; 6 = AMX tiles (7 emulated: DECODE_FORMS).
    decode_dot: int = 0
    # Staged decode nests: keys per key tile (0 = block_n, the main nest's). The AMX preset's
    # decode tiles take 64 where its prefill takes 128 (AMX_DECODE_BLOCK_N).
    decode_block_n: int = 0

    @property
    def decode_tile(self) -> int:
        """The staged decode nests' key tile: ``decode_block_n``, or ``block_n``."""
        return self.decode_block_n or self.block_n


#: (block_m in vector widths, block_n) tile pairs the tuner searches across, one task each.
TILE_CANDIDATES = ((1, 32), (1, 64), (2, 32), (2, 64), (2, 128), (4, 64))


def pv_cols_of(knobs: Any, head_dim: int) -> int:
    """The knobs' PV column block, ``pv_cols = 0`` meaning all of head_dim."""
    return knobs.pv_cols or head_dim


def preset(spec: AttentionSpec, target: Target) -> FlashCPUKnobs:
    """Per-target default knobs, derived from the vector width and the register file.

    * ``block_m`` = 32 query rows (fp32: 2 zmm vectors on AVX-512, 4 ymm on AVX2), 64 with
      bf16 dot products or full-width zmm FMAs (measured: ``cpu_balance.wide_fmas``);
      ``block_n`` = 64 keys.
    * ``s_rows``: the S_gemm register block holds at most half the vector registers as
      accumulators (``s_rows × block_m/lanes``; 16 of 32 zmm, 8 of 16 ymm), up to 4 keys.
    * PV_gemm: up to 4 rows over all of head_dim when at least two rows fit, else
      ``PV_ROWS_GOAL`` rows over a column block (:func:`pv_columns`).

    Why (2-core znver4, B1 H8 S2048, 2 threads, GFLOP/s): AVX-512 D=64: (32, 64) s_rows 4 ran
    202; (32, 128), (48, 64), (64, 128) and (16, 64) 189-197, (32, 96) 177, (32, 128, s_rows=8)
    104 (16 accumulators + L1 pressure); pv_rows 4 at D=64, 2 at D=128 (a 4 × 64 split: level).
    AVX2 (``mcpu`` znver3 code on the same host; FMA roof 217): D=64: the one-register-file
    rule of before (16 rows, s_rows 4, one PV row over 64 columns) 165; 32 rows, s_rows 2
    (8 accumulators + 4 q vectors + a broadcast = 13 of 16 ymm), 4 PV rows × 16 columns 182;
    24 rows × s_rows 4 (16 ymm) 155; block_n 128 174. D=128: 172 before, 186 with the same rule.
    """
    lanes = vector_lanes(target)
    regs = VECTOR_REGISTERS.get(lanes, 16)
    amx_tile = next((t for t in amx_tile_order(spec) if tile_bytes(spec, *t) <= MAX_TILE_BYTES), None)
    if lanes == cpu_amx.L and amx_tile and amx_tiles(spec, target, *amx_tile):
        return _amx_preset(spec, target, amx_tile)
    # the dot-product form where it can run and this host's dot products outrun its FMAs
    # (cpu_balance: not on an Intel core, which issues vdpbf16ps on one port and FMAs on two)
    dot = bf16_dots(spec, target) and cpu_balance.dots_outrun_fmas(target)
    # bf16 dot products halve the products' time, so the per-tile work around them (the K/V
    # staging, the softmax) weighs more: 64 rows amortize it (2 threads, S=4096, H=8, D=64/128:
    # 319/344 GFLOP/s against 295/314 with 32 rows; block_n 128 no better). A row tile is at
    # most a quarter of the registers in query vectors (SSE: 4 of 16 xmm). Full-width AVX-512
    # FMAs (cpu_balance.wide_fmas: two zmm FMAs a cycle, Intel) halve them alike: 64 rows there
    # (2-core Sapphire Rapids VM, 2 threads, H=8, fp32, GFLOP/s, 32 rows -> 64: S=4096 D=64
    # 280 -> 309, D=128 263 -> 291; S=1024 causal 265 -> 274 (D=64 and 128); S=16384 D=64 266 ->
    # 290, D=128 causal 253 -> 297). A Zen 4 core splits zmm FMAs in halves: 32 rows there.
    wide = dot or (lanes == 16 and cpu_balance.wide_fmas(target))
    q_vectors = min((64 if wide else 32) // lanes, regs // 4)
    block_m, block_n = q_vectors * lanes, 64
    pv_cols = dot_pv_columns(spec.v_dim, lanes) if dot else pv_columns(spec.v_dim, lanes)
    pv_rows = max(1, min(PV_ROWS_GOAL, max_pv_rows(pv_cols, lanes)))
    while block_m % pv_rows:
        pv_rows -= 1
    s_rows = max(1, min(4, (regs // 2) // q_vectors, max_s_rows(block_m, lanes)))
    while block_n % s_rows:
        s_rows -= 1
    # A row of accumulators that is not a power-of-two number of vectors (head_dim 48, 80, 96,
    # 112 on AVX-512) stays in memory unless TVM unrolls the key-tile loop's body: 8.6-17.7
    # GFLOP/s without, 49-61 with auto_unroll=256 (1 thread, S=1024, znver4). At 4, 8 or 16
    # vectors LLVM unrolls by itself and the extra unrolling costs 5-35 % (D=64/128/256).
    # Found by the held-out evaluation (scripts/search_report.py --held-out): tuned/hand was 7.5x
    # at head_dim 96.
    d_vectors = math.ceil(pv_cols / lanes)
    auto_unroll = 0 if d_vectors & (d_vectors - 1) == 0 else 256
    knobs = FlashCPUKnobs(block_m=block_m, block_n=block_n, s_rows=s_rows, pv_rows=pv_rows,
                          pv_cols=pv_cols if pv_cols < spec.v_dim else 0, vector_lanes=lanes,
                          auto_unroll=auto_unroll, split_tasks=split_tasks_for(target), dot_bf16=int(dot))
    if stages_decode(spec, knobs):  # the page order is a property of the staged decode nests
        heads = page_order_heads(spec, block_n, lanes)
        knobs = dataclasses.replace(knobs, decode_heads=heads, prefetch=decode_prefetch(spec, lanes, block_n, heads))
        # the products on vdpbf16ps (2-core znver4, H32 KH8 D128, 2 threads, B4 4k / B1 16k,
        # the step over the float32 form's, side by side): a bf16 cache takes both (QKᵀ alone
        # 0.86 / 0.91 kvcache, 0.99 / 0.95 paged; with PV 0.85 / 0.84, 0.91 / 0.84), an 8-bit
        # one QKᵀ only, which is exact (int8 0.87 / 0.89 kvcache, 0.89 / 0.91 paged; PV on dots
        # gains nothing more: widening V is the cost, and it would round P)
        if spec.qk_int8 and decode_dots(spec, knobs, target, 3):
            # QKᵀ on int8 dot products, the keys read as they are (2-core znver4, H32 KH8 D128,
            # B4 4k / B1 16k, side by side): vpdpbusd 0.70 / 0.72 kvcache, 0.97 / 0.86 paged
            # against the int8 cache's bf16 dots (bf16 queries; fp32 queries 0.60 / 0.62 against
            # float32 FMAs); AVX2 code (vpmaddubsw) 0.78 / 0.77 kvcache, 0.86 / 0.91 paged
            # against float32 FMAs
            knobs = dataclasses.replace(knobs, decode_dot=3)
        elif decode_dots(spec, knobs, target) and cpu_balance.dots_outrun_fmas(target):
            # not where the dot products do not outrun the FMAs (cpu_balance): on a 2-core
            # Sapphire Rapids VM (B4 H32 KH8 D128, 4k keys, 2 threads, side by side) the bf16
            # cache's step on dots ran 0.85x the float32-product step, an int8 cache's 0.83x
            knobs = dataclasses.replace(knobs, decode_dot=1 if spec.kv_quantized else 2)
            if knobs.decode_dot == 2:  # PV's pairs stage two copies of the value tile's bits
                heads = page_order_heads(spec, block_n, lanes, decode_dot=2)
                knobs = dataclasses.replace(knobs, decode_heads=heads,
                                            prefetch=decode_prefetch(spec, lanes, block_n, heads))
        if {"amx-tile", "amx-bf16", "amx-int8"} & target_features(target):  # (an int8 cache's main nest: vectors)
            knobs = _with_amx_decode(spec, knobs, target)
    return knobs


#: The AMX form's tiles (block_m, block_n), the first that fits MAX_TILE_BYTES. More rows amortize
#: the per-key-tile staging (the key tile's copy, the value pairs), more keys the accumulator's
#: tile loads and stores (PV's reduction is block_n deep). 2-core Sapphire Rapids VM, B1 H8, 2
#: threads, GFLOP/s (4·S²·D·H counted), side by side, (128, 64) -> (256, 128): S=4096 D=128
#: 858 -> 971, causal 790 -> 848; D=64 576 -> 616; S=1024 D=64 550 -> 593, D=128 causal 650 ->
#: 641 (level); S=16384 D=128 816 -> 980, D=64 causal 557 -> 577; (256, 64) in between at every
#: point. Before, (64, 64) 0.64 / 0.86 TFLOP/s at D=64 / 128 against (128, 64) 0.69 / 0.94.
#: (256, 128) fits up to D + DV = 256; (128, 64) up to 896. MLA's 576/512 latent takes (64, 128):
#: MLA decode, 128 heads, B4 / B16 × 4k: 951 / 851 GFLOP/s at (64, 64), 1093 / 990 at (64, 128),
#: 875 at (64, 256) B16.
AMX_TILES = ((256, 128), (128, 64), (64, 128), (64, 64))
#: query rows up to which a causal AMX build takes 128-row tiles (:func:`amx_tile_order`)
SHORT_CAUSAL = 4096


def amx_tile_order(spec: AttentionSpec) -> tuple[tuple[int, int], ...]:
    """:data:`AMX_TILES`, with 128 × 128 first under a causal mask up to :data:`SHORT_CAUSAL` query
    rows: each row tile computes the masked half of its diagonal tile, which weighs twice as
    much at 256 rows; over longer sequences that half matters less than 256 rows' sharing of the
    staging (same VM, side by side, 256 × 128 -> 128 × 128, GFLOP/s: S=1024 causal D=64 541 ->
    570, D=128 740 -> 772; S=2048 D=64 611 -> 622, D=128 893 -> 909; S=4096 D=128 998 -> 1005;
    S=8192 D=64 714 -> 748, D=128 1083 -> 1051; S=16384 D=128 1114 -> 1028; not causal, S=4096
    D=128 1179 -> 1093, D=64 841 -> 832)."""
    if spec.causal and spec.seq_q <= SHORT_CAUSAL:
        return tuple((128, 128) if t == (256, 128) else t for t in AMX_TILES)
    return AMX_TILES
#: (block_m, block_n) the tuner searches for the AMX form (each a task)
AMX_TILE_CANDIDATES = ((64, 64), (64, 128), (128, 64), (128, 128), (256, 64), (256, 128))


def _amx_preset(spec: AttentionSpec, target: Target, tile: tuple[int, int]) -> FlashCPUKnobs:
    """The preset where the CPU has AMX tiles and ``spec`` fits them (bfloat16, dims in 32s):
    the main nest's products on tiles (:mod:`cpu_amx`); the decode nests on tiles too where
    :func:`amx_decode_heads` says so, else as the AVX-512 preset's."""
    base = preset(spec, _without_amx(target))
    # (s_rows, pv_rows, pv_cols: the decode nests' register blocks, decode_knobs; the AMX
    # schedule records them and uses none)
    return _with_amx_decode(spec, dataclasses.replace(base, block_m=tile[0], block_n=tile[1], dot_bf16=AMX), target)


def _with_amx_decode(spec: AttentionSpec, knobs: FlashCPUKnobs, target: Target) -> FlashCPUKnobs:
    """``knobs`` with the staged decode nests on AMX tiles where :func:`amx_decode_heads` says so."""
    heads = amx_decode_heads(spec, knobs, target)
    if not heads:
        return knobs
    return dataclasses.replace(knobs, decode_dot=DECODE_AMX, decode_heads=heads, decode_block_n=AMX_DECODE_BLOCK_N,
                               prefetch=decode_prefetch(spec, knobs.vector_lanes, AMX_DECODE_BLOCK_N, heads))


#: fewest query heads per kv head whose decode nest the AMX preset puts on tiles (amx_decode_heads)
AMX_DECODE_MIN_GROUP = 4
#: the AMX preset's decode key tile: 1.02-1.04x 128 keys' step on a contiguous bf16 cache (B60 ×
#: 4k 77-80 % of the stream read against 74-76 %, B15 × 16k 79 % against 76 %, B4 × 4k 1.04x;
#: 32 keys 0.98x 64's), 1.18x on a paged one (B15 × 16k, 8 kv heads a task); 2-core Sapphire
#: Rapids VM, 2 threads, GQA 32:8 D128, side by side
AMX_DECODE_BLOCK_N = 64
#: kv heads per task of the AMX preset's int8 decode on a contiguous cache (amx_decode_heads)
AMX_DECODE_INT8_HEADS = 4


def amx_decode_heads(spec: AttentionSpec, knobs: FlashCPUKnobs, target: Target) -> int:
    """The kv heads per task with which the AMX preset puts the staged decode nests on tiles
    (``decode_dot`` 6), 0 where it does not: bfloat16 queries, at least
    :data:`AMX_DECODE_MIN_GROUP` rows per kv head, and a bf16 cache (one head per task on the
    contiguous layouts, every head of a page paged) or an int8 one with ``qk_int8`` on the
    contiguous layouts (:data:`AMX_DECODE_INT8_HEADS`).

    Why (2-core Sapphire Rapids VM, 2 threads, GQA 32:8 D128, the step over the AVX-512
    preset's, side by side; stream read 28-31 GB/s): bf16 kvcache B60 × 4k 1.18, B15 × 16k 1.15,
    B4 × 4k 1.24 (72-80 % of the stream read against 59-66 %; 1, 2 or 4 heads a task level);
    bf16 paged 1.31-1.32 (8 heads a task; 1.04-1.09 with 1-2, 1.07 with 4); int8 ``qk_int8``
    kvcache 1.15-1.16 with 4 heads (1.09-1.14 with 8, 1.06-1.07 with 1), both products on tiles
    (QKᵀ on ``tdpbssd`` alone, PV float32, ran 0.94-0.97). Not: MHA (one row per kv head: the
    tiles' packing costs more than the products) 0.79; int8 paged level (0.99 at 8 heads, 0.75-0.82
    with fewer)."""
    int8 = spec.qk_int8 and getattr(spec, "kv_scale", "head") != "group"
    if (spec.dtype != "bfloat16" or spec.group_size < AMX_DECODE_MIN_GROUP or not stages_decode(spec, knobs)
            or not (int8 or not spec.kv_quantized) or (int8 and spec.layout_info.paged)):
        return 0
    if spec.layout_info.paged:
        heads = max_heads_per_task(spec, AMX_DECODE_BLOCK_N, DECODE_AMX)
    else:
        heads = max(h for h in range(1, (AMX_DECODE_INT8_HEADS if int8 else 1) + 1) if spec.kv_heads % h == 0)
    try:
        check_amx_decode(dataclasses.replace(knobs, decode_dot=DECODE_AMX, decode_heads=heads,
                                             decode_block_n=AMX_DECODE_BLOCK_N), spec, target)
    except KnobError:
        return 0
    return heads


def preset_for_overrides(spec: AttentionSpec, target: Target, overrides: dict) -> FlashCPUKnobs:
    """The preset ``overrides`` (a build's knob dict) are laid on: the preset of the product form
    they name (``dot_bf16``), so that asking for float32 products or ``vdpbf16ps`` on an AMX host
    starts from those forms' tiles and register blocks, not the AMX form's 128 rows."""
    hand = preset(spec, target)
    form = overrides.get("dot_bf16", hand.dot_bf16)
    if not isinstance(form, int) or form == hand.dot_bf16:
        return hand
    if hand.dot_bf16 in (AMX, AMX_EMULATED) and form not in (AMX, AMX_EMULATED):
        return dataclasses.replace(preset(spec, _without_amx(target)), dot_bf16=form)
    return dataclasses.replace(hand, dot_bf16=form)


def search_target(target: Target) -> Target:
    """The target the tuner's vector-product tasks are made for: ``target`` without AMX (the AMX
    form's tasks are those of :func:`tile_candidates` on ``target`` itself)."""
    return _without_amx(target) if {"amx-tile", "amx-bf16"} & set(target_features(target)) else target


def _without_amx(target: Target) -> Target:
    """``target`` with its AMX features turned off (``-amx-*``): the preset the form replaces."""
    attrs = dict(target.export())
    mattr = [f for f in attrs.get("mattr", []) if not f.lstrip("+-").startswith("amx")]
    attrs["mattr"] = mattr + ["-amx-tile", "-amx-bf16", "-amx-int8"]
    return Target(attrs)


def decode_prefetch(spec: AttentionSpec, lanes: int, block_n: int = 64, heads: int = 1) -> int:
    """The preset's software prefetch of the staged decode nests (``prefetch``, key tiles ahead,
    into L2): 1, so the next key tile streams in while this one computes, except where the step
    already streams at memory speed without it.

    Why (2-core znver4, 2 threads, D=128, B4 4k / B1 16k / B16 4k, the step with it over the step
    without, alternated in one process; the stream read about 32 GB/s): GQA 32:8 kvcache bf16
    0.84 / 0.68 / 0.86, fp16 0.70 / 0.73 / 0.78, int8 0.81 / 0.82 / 0.75, int8 with qk_int8 0.91 /
    0.91 / 0.69, e4m3 0.76 / 0.91 / 0.77, int8 per token 0.81 / 0.83 / 0.86; paged bf16 0.83 /
    0.87 / 0.98, int8 0.79 / 0.75 / 0.68, per-group qk_int8 0.89 / 0.74 / 0.69; D=64 bf16 0.64 /
    0.63 / 0.73; AVX2 code (znver3) bf16 0.59 / 0.56 / 0.60, paged int8 0.68-0.74, float32 0.87 /
    0.89 / 0.97. Without it: a float32 cache on AVX-512 (25 GB/s already; 1.03-1.04 kvcache,
    1.00-1.17 paged) and MHA's kvcache (one row per kv head, little compute per byte: int8 1.12 /
    1.15 / 1.02, bf16 level; with 2 kv heads per task, the preset's, bf16 1.03-1.23); MHA paged
    gains a little (bf16 0.93-0.96, 16 heads per task).

    Nor where one key tile ahead is more than :data:`MAX_PREFETCH_AHEAD` bytes of K and V
    (``block_n × heads`` rows of each): a paged MHA task reading whole rows (32 heads, bf16,
    D=128: 1 MiB ahead) ran 0.72-0.77× as fast with it (2-core Sapphire Rapids VM, 2 threads,
    B4 × 4k / B1 × 16k: 13.8 / 13.8 GB/s with, 19.0 / 18.4 without); the prefetched tile evicts
    the one being computed, and whole rows stream without help."""
    ahead = 2 * block_n * heads * spec.v_dim * spec.kv_itemsize
    if lanes == 16 and spec.dtype == "float32" and not spec.kv_quantized:  # a float32 cache
        return 0
    if ahead > MAX_PREFETCH_AHEAD:
        return 0
    if spec.group_size == 1 and not spec.layout_info.paged:
        return 0
    return 1


#: Largest value tile (``block_n · decode_heads · D``, :func:`decode_vt_bytes`) the preset's
#: multi-head decode task stages: it is written and read back within one key tile, so it stays in
#: L2 (1 MiB here). A bf16 cache stages its bits: twice the heads (a paged MHA task then reads
#: whole rows: 32 heads at D=128).
#: MHA 32 heads, D=128, paged (2-core znver4, GB/s at B1 16k / B4 4k / B16 4k): 16 heads per task
#: (512 KiB) 16.7 / 17.4 / 17.6, 8 heads 14.8 / 16.2 / 13.9, one head 13.7 / 17.4 / 13.9.
MAX_DECODE_VT_BYTES = 512 * 1024
#: Most K/V bytes one key tile ahead that the decode nests' software prefetch asks for
#: (:func:`decode_prefetch`): half a 1 MiB L2.
MAX_PREFETCH_AHEAD = 512 * 1024


def decode_vt_bytes(spec: AttentionSpec, block_n: int, heads: int, decode_dot: int = 0) -> int:
    """The bytes of a decode tile's staged values (``block_n × heads × head_dim``): a bf16 cache's
    as their bits (2 bytes, ``fused._TileShape.vt_dtype``; with PV on dots, ``decode_dot`` 2, two
    copies: ``Vb`` and its pairs ``Vt``; on tiles, 6 and 7, ``Vt``'s words and the staged keys
    ``Kb``), the others counted as float32."""
    bits = spec.dtype == "bfloat16" and not spec.kv_dtype and decode_dot not in (2, DECODE_AMX, DECODE_AMX_EMULATED)
    return (2 if bits else 4) * block_n * heads * spec.v_dim


def stages_decode(spec: AttentionSpec, knobs: FlashCPUKnobs) -> bool:
    """Whether ``spec`` has a decode nest narrower than a vector, which stages its K/V tiles and
    is dot-product scheduled (``cpu_decode``: AVX-512 or AVX2, head_dim a multiple of the
    lanes): the only nests ``decode_heads`` and ``prefetch`` change. Elsewhere (SSE, or a
    head_dim that is no multiple of the lanes: 72 on AVX-512) the decode nest is one vector of
    rows, scheduled as the main nest."""
    return any(r < knobs.vector_lanes for r in decode_rows(spec, knobs))


def decode_dots(spec: AttentionSpec, knobs: FlashCPUKnobs, target: Target, form: int = 1) -> bool:
    """Whether every staged decode nest of ``spec`` can take QKᵀ on the dot products of
    ``decode_dot`` ``form`` on ``target``: bf16 (1, 2: :func:`cpu_decode.supports_bf16`) or
    int8 (3: :func:`cpu_decode.supports_i8`)."""
    feats = target_features(target)
    staged = [r for r in decode_rows(spec, knobs) if r < knobs.vector_lanes]
    ok = cpu_decode.supports_i8 if form == 3 else cpu_decode.supports_bf16
    if getattr(spec, "kv_scale", "head") == "group":
        # each key element scaled as it is converted (float32 products), or with qk_int8 one int8
        # dot product per group of 32 (decode_dot 3 builds it): AVX2's 32-byte form, on AVX-512
        # lanes VNNI's (vpdpbusd on a ymm: AVX512-VL; an AVX-512 CPU without them keeps float32
        # products), 0.80-0.87x the float32 products' kvcache step, 0.87-1.09x paged (AVX2's form;
        # 2-core znver4, GQA 32:8 D128, bf16 queries, B4 4k / B1 16k / B16 4k, side by side)
        i8_form = knobs.vector_lanes == 8 or {cpu_decode.VNNI, "avx512vl"} <= feats
        return (form == 3 and bool(staged) and spec.qk_int8 and "avx2" in feats and i8_form and spec.head_dim % 32 == 0
                and all(cpu_decode.supports(spec, r, knobs.vector_lanes) and r <= 8 for r in staged))
    return bool(staged) and all(ok(spec, r, knobs.vector_lanes, feats) for r in staged)


def page_order_heads(spec: AttentionSpec, block_n: int, lanes: int = 16, decode_dot: int = 0) -> int:
    """The preset's kv heads per decode task: all of them (as many as a ``MAX_DECODE_VT_BYTES``
    value tile allows) for the paged layout; on the contiguous layouts with AVX-512 vectors, 2
    for a 16- or 32-bit cache and all of them for an 8-bit GQA cache; else 1.

    Why, paged (2-core znver4, H32 KH8 D128 fp32, 2 threads, page_size 16): one head per task
    reads a paged cache in 512-byte pieces 4 KiB apart, 10-13 GB/s at batch 1-16 (4k-16k keys);
    all 8 heads per task read whole rows, 19-30 GB/s (1.5-1.9x), level with the contiguous cache.

    Why, contiguous (same VM, 2 threads, GQA 32:8 D128 kvcache with the prefetch preset, B4 4k /
    B1 16k / B16 4k, the step over one head per task's, alternated): all 8 heads int8 0.81 / 0.78
    / 0.72, with qk_int8 0.89 / 0.88 / 0.72, e4m3 0.89 / 0.89 / 0.88; 2 heads bf16 0.96 / 0.86 /
    0.87, fp32 0.84 / 0.86 / 0.88 (all 8: 0.91-1.06); MHA 32:32 2 heads bf16 0.85-0.90, fp32
    0.70-0.84, but int8 1.06-1.21 (so one). Not on AVX2 code (2 heads bf16 1.01-1.18, int8
    1.05-1.20: 16 ymm hold less): one head per task there."""
    if spec.layout_info.paged:
        return max_heads_per_task(spec, block_n, decode_dot)
    if lanes < 16 or (spec.kv_quantized and spec.group_size == 1):
        return 1
    most = max_heads_per_task(spec, block_n)
    return most if spec.kv_quantized else max(h for h in (1, 2) if spec.kv_heads % h == 0 and h <= most)


def max_heads_per_task(spec: AttentionSpec, block_n: int, decode_dot: int = 0) -> int:
    """The most kv heads one decode task can take: a divisor of ``kv_heads`` whose value tile
    (:func:`decode_vt_bytes`) fits ``MAX_DECODE_VT_BYTES``."""
    return max(h for h in range(1, spec.kv_heads + 1)
               if spec.kv_heads % h == 0 and decode_vt_bytes(spec, block_n, h, decode_dot) <= MAX_DECODE_VT_BYTES)


def for_layout(knobs: FlashCPUKnobs, spec: AttentionSpec, target: Target,
               tuned_at: AttentionSpec | None = None) -> FlashCPUKnobs:
    """Knobs read from a record tuned at ``tuned_at`` (default ``spec.representative()``, a
    contiguous bhsd shape), made fit to build ``spec``: the decode nests' memory-order knobs
    (``decode_heads``, ``prefetch``) measured on contiguous rows say nothing about a paged
    cache, whose preset keeps its page order. A record tuned on the paged layout itself (a
    paged decode step, ``tvm_attention.tune.paged``) and other layouts take the record's knobs
    whole."""
    if not spec.layout_info.paged or (tuned_at or spec.representative()).layout_info.paged:
        return knobs
    hand = preset(spec, target)
    return dataclasses.replace(knobs, decode_heads=hand.decode_heads, prefetch=hand.prefetch)


#: the product forms of the main nest (knob ``dot_bf16``)
AMX, AMX_EMULATED = 2, 3
DOT_FORMS = {0: "float32 FMAs", 1: "vdpbf16ps", AMX: "AMX tiles", AMX_EMULATED: "AMX emulated in plain TIR, a checking form"}


def check_amx(knobs: FlashCPUKnobs, spec: AttentionSpec, target: Target) -> None:
    """The AMX forms' needs (``dot_bf16`` 2, emulated 3): bfloat16 inputs, the tile and head dims
    in blocks of 32, AVX-512 vectors for the softmax; the real form a CPU with AMX-BF16."""
    name = f"dot_bf16={knobs.dot_bf16} ({DOT_FORMS[knobs.dot_bf16]})"
    why = cpu_amx.misfit(spec, target_features(target), knobs.block_m, knobs.block_n, real=knobs.dot_bf16 == AMX)
    if why and why.startswith("needs a CPU"):
        why += f" (target {target}); the emulated form (dot_bf16={AMX_EMULATED}) runs anywhere"
    if why:
        raise KnobError(f"{name}: {why}")


#: the decode nests' product forms (knob ``decode_dot``)
DECODE_AMX, DECODE_AMX_EMULATED = 6, 7
DECODE_FORMS = {0: "float32 FMAs", 1: "QKᵀ on vdpbf16ps", 2: "QKᵀ and PV on vdpbf16ps",
                3: "QKᵀ on int8 dot products", DECODE_AMX: "AMX tiles (QKᵀ, and PV with bf16 queries)",
                DECODE_AMX_EMULATED: "AMX tiles emulated in plain TIR, a checking form"}


def check_amx_decode(knobs: FlashCPUKnobs, spec: AttentionSpec, target: Target) -> None:
    """The decode tiles' needs (``decode_dot`` 6, emulated 7): staged decode nests (the real form's
    on AVX-512 vectors, as an AMX CPU has), each fitting the tiles (:func:`cpu_amx.decode_misfit`);
    the real form a CPU with AMX (bf16, or int8 for ``qk_int8``)."""
    name = f"decode_dot={knobs.decode_dot} ({DECODE_FORMS[knobs.decode_dot]})"
    staged = [r for r in decode_rows(spec, knobs) if r < knobs.vector_lanes]
    real = knobs.decode_dot == DECODE_AMX
    if not staged or (real and knobs.vector_lanes != cpu_amx.L):
        raise KnobError(f"{name}: needs staged decode nests{f' on {cpu_amx.L}-lane vectors' if real else ''} "
                        f"(vector_lanes={knobs.vector_lanes}, decode rows {decode_rows(spec, knobs)})")
    for rows in staged:
        why = cpu_amx.decode_misfit(spec, target_features(target), rows, knobs.decode_tile, knobs.decode_heads, real)
        if why and why.startswith("needs a CPU"):
            why += f" (target {target}); the emulated form (decode_dot={DECODE_AMX_EMULATED}) runs anywhere"
        if why:
            raise KnobError(f"{name}: {why}")


def tile_bytes(spec: AttentionSpec, block_m: int, block_n: int) -> int:
    """A row tile's float32 working set: its q and accumulator rows, S and P."""
    return 4 * ((spec.head_dim + spec.v_dim) * block_m + 2 * block_n * block_m)


def amx_tiles(spec: AttentionSpec, target: Target, block_m: int = 64, block_n: int = 64) -> bool:
    """Whether ``spec`` can take the AMX form (:mod:`cpu_amx`) on ``target``."""
    return cpu_amx.supports(spec, target_features(target), block_m, block_n)


def bf16_dots(spec: AttentionSpec, target: Target) -> bool:
    """Whether ``spec`` can take the bf16 dot-product form (:mod:`cpu_bf16`) on ``target``."""
    return cpu_bf16.supports(spec, target_features(target))


#: Split-KV tasks per core a decode step aims at: 4 per core keeps both cores busy when one
#: sequence's chunks differ in cost (causal tails, the last partial tile), and each chunk still
#: streams at least MIN_SPLIT_KEYS keys.
SPLIT_TASKS_PER_CORE = 4
SPLIT_TASK_CHOICES = (0, 4, 8, 16, 32)
#: Decode prefetch distances (key tiles ahead) the tuner tries; the preset's is
#: :func:`decode_prefetch` (1, or 0 where the step streams at memory speed without it). 2 tiles
#: ahead was level with 1 or worse (one thread, bf16 kvcache: 0.85-0.99x none, 1 tile 0.80-0.87x).
PREFETCH_CHOICES = (0, 1, 2)


def split_tasks_for(target: Target) -> int:
    cores = int(target.attrs["num-cores"]) if "num-cores" in target.attrs else 2
    want = SPLIT_TASKS_PER_CORE * cores
    return min((c for c in SPLIT_TASK_CHOICES if c >= want), default=SPLIT_TASK_CHOICES[-1])


def check(knobs: FlashCPUKnobs, spec: AttentionSpec, target: Target) -> None:
    """Raise :class:`KnobError` if ``knobs`` cannot be built well for ``spec`` on ``target``."""
    lanes = knobs.vector_lanes
    for name in ("block_m", "block_n", "s_rows", "pv_rows", "vector_lanes", "d_unroll", "parallel_chunk"):
        v = getattr(knobs, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise KnobError(f"{name} must be a positive int, got {v!r}")
    if knobs.pv_cols < 0 or (knobs.pv_cols and spec.v_dim % knobs.pv_cols):
        raise KnobError(f"pv_cols={knobs.pv_cols} must divide V's head_dim={spec.v_dim} (0 = all of it)")
    target_lanes = vector_lanes(target)
    if lanes > target_lanes or target_lanes % lanes:
        raise KnobError(
            f"vector_lanes={lanes} does not fit the target's {target_lanes}-lane {spec.dtype} vectors"
        )
    if knobs.block_m % lanes:
        raise KnobError(f"block_m={knobs.block_m} must be a multiple of vector_lanes={lanes}")
    if knobs.block_n % knobs.s_rows:
        raise KnobError(f"block_n={knobs.block_n} must be a multiple of s_rows={knobs.s_rows}")
    if knobs.block_m % knobs.pv_rows:
        raise KnobError(f"block_m={knobs.block_m} must be a multiple of pv_rows={knobs.pv_rows}")
    if spec.head_dim % knobs.d_unroll or knobs.d_unroll > D_UNROLL_MAX:
        raise KnobError(
            f"d_unroll={knobs.d_unroll} must divide head_dim={spec.head_dim} and be <= {D_UNROLL_MAX}"
        )
    if knobs.parallel_chunk not in PARALLEL_CHUNKS:
        raise KnobError(f"parallel_chunk={knobs.parallel_chunk} not in {PARALLEL_CHUNKS}")
    if knobs.auto_unroll not in AUTO_UNROLL_STEPS:
        raise KnobError(f"auto_unroll={knobs.auto_unroll} not in {AUTO_UNROLL_STEPS}")
    if knobs.split_tasks not in SPLIT_TASK_CHOICES:
        raise KnobError(f"split_tasks={knobs.split_tasks} not in {SPLIT_TASK_CHOICES}")
    if knobs.prefetch not in PREFETCH_CHOICES:
        raise KnobError(f"prefetch={knobs.prefetch} not in {PREFETCH_CHOICES}")
    if knobs.decode_heads < 1 or spec.kv_heads % knobs.decode_heads:
        raise KnobError(f"decode_heads={knobs.decode_heads} must divide kv_heads={spec.kv_heads}")
    if (knobs.decode_heads > 1 or knobs.prefetch) and not stages_decode(spec, knobs):
        raise KnobError(
            f"decode_heads={knobs.decode_heads} and prefetch={knobs.prefetch} apply to the staged decode nests "
            f"(dot products on {' or '.join(map(str, cpu_decode.DOT_LANES))}-lane vectors, head_dim a multiple of them); "
            f"with vector_lanes={lanes} and head_dim={spec.head_dim} this kernel has none: leave them at 1 and 0")
    if knobs.decode_block_n < 0:
        raise KnobError(f"decode_block_n={knobs.decode_block_n} must be a positive key tile, or 0 (= block_n)")
    if knobs.decode_block_n and not stages_decode(spec, knobs):
        raise KnobError(f"decode_block_n={knobs.decode_block_n} is the staged decode nests' key tile, which this "
                        f"kernel has not (vector_lanes={knobs.vector_lanes}, head_dim={spec.head_dim}): leave it at 0")
    vt_bytes = decode_vt_bytes(spec, knobs.decode_tile, knobs.decode_heads, knobs.decode_dot)
    if knobs.decode_heads > 1 and vt_bytes > MAX_TILE_BYTES:
        raise KnobError(
            f"decode value tile {vt_bytes} B (block_n={knobs.decode_tile} × decode_heads={knobs.decode_heads} × "
            f"head_dim={spec.v_dim}, {vt_bytes // (knobs.decode_tile * knobs.decode_heads * spec.v_dim)} B each"
            f") exceeds MAX_TILE_BYTES={MAX_TILE_BYTES}")
    if knobs.decode_dot not in DECODE_FORMS:
        raise KnobError(f"decode_dot={knobs.decode_dot} must be one of "
                        f"{', '.join(f'{k} ({v})' for k, v in DECODE_FORMS.items())}")
    if knobs.decode_dot in (DECODE_AMX, DECODE_AMX_EMULATED):
        check_amx_decode(knobs, spec, target)
    if knobs.decode_dot == 3 and not decode_dots(spec, knobs, target, 3):
        raise KnobError(
            f"decode_dot=3 needs qk_int8 (q rounded to int8 against an int8 cache; qk_int8={spec.qk_int8}), staged "
            f"decode nests on {cpu_decode.BF16_LANES}-lane vectors, a head_dim that is a multiple of "
            f"{cpu_decode.I8_LANES} up to 512 (head_dim={spec.head_dim}) and a CPU with {cpu_decode.VNNI} "
            f"(target {target}); per-group scales (kv_scale={spec.kv_scale}) take a 32-byte form instead (AVX2's, "
            f"or on 16-lane vectors {cpu_decode.VNNI} with avx512vl), head_dim a multiple of 32, at most 8 rows")
    if knobs.decode_dot == 2 and knobs.decode_tile % 2:
        raise KnobError(f"decode_dot=2 pairs the keys of a tile for PV: block_n={knobs.decode_tile} must be even")
    if knobs.decode_dot == 2 and spec.dtype != "bfloat16":
        raise KnobError(f"decode_dot=2 rounds P to bf16 for PV, which only bfloat16 queries' numerics allow "
                        f"(dtype={spec.dtype}); decode_dot=1 (QKᵀ alone, exact) is open to {spec.dtype} with qk_int8")
    if knobs.decode_dot in (1, 2) and not decode_dots(spec, knobs, target):
        raise KnobError(
            f"decode_dot={knobs.decode_dot} needs staged decode nests on {cpu_decode.BF16_LANES}-lane vectors, a "
            f"head_dim that is a multiple of {2 * cpu_decode.BF16_LANES} (head_dim={spec.head_dim}), bfloat16 "
            f"queries (or qk_int8) and a bfloat16 or 8-bit cache (dtype={spec.dtype}, kv_dtype={spec.kv_dtype}) "
            f"scaled per head or per token (kv_scale={spec.kv_scale}: per group each element is scaled as it is "
            f"converted) and a CPU with {cpu_bf16.FEATURE} (target {target})")
    if knobs.dot_bf16 not in DOT_FORMS:
        raise KnobError(f"dot_bf16={knobs.dot_bf16} must be one of {', '.join(f'{k} ({v})' for k, v in DOT_FORMS.items())}")
    if knobs.dot_bf16 in (AMX, AMX_EMULATED):
        check_amx(knobs, spec, target)
    elif knobs.dot_bf16 and not bf16_dots(spec, target):
        raise KnobError(
            f"dot_bf16=1 needs bfloat16 inputs (dtype={spec.dtype}), a head_dim that is a multiple of "
            f"{cpu_bf16.L} (head_dim={spec.head_dim}) and a CPU with {cpu_bf16.FEATURE} (target {target})")
    if knobs.dot_bf16 == 1 and knobs.pv_cols % cpu_bf16.L:
        raise KnobError(f"dot_bf16=1 computes PV in {cpu_bf16.L}-column vdpbf16ps: pv_cols={knobs.pv_cols} must be "
                        f"a multiple of {cpu_bf16.L} (0 = all of head_dim)")
    if knobs.dot_bf16 and knobs.block_n % 2:
        raise KnobError(f"dot_bf16=1 pairs keys: block_n={knobs.block_n} must be even")
    regs = VECTOR_REGISTERS.get(lanes, 16)
    q_vectors = knobs.block_m // lanes
    amx_form = knobs.dot_bf16 in (AMX, AMX_EMULATED)  # its products are tiles: no register blocks
    if knobs.s_rows > max_s_rows(knobs.block_m, lanes) and not amx_form:
        raise KnobError(
            f"S_gemm register block needs {knobs.s_rows * q_vectors + q_vectors + 1} vector registers "
            f"(s_rows={knobs.s_rows} × {q_vectors} accumulators + {q_vectors} q vectors + 1 broadcast) "
            f"> {regs} available"
        )
    pv_cols = pv_cols_of(knobs, spec.v_dim)
    if knobs.pv_rows > max_pv_rows(pv_cols, lanes) and not amx_form:
        d_vectors = math.ceil(pv_cols / lanes)
        raise KnobError(
            f"PV_gemm register block needs {knobs.pv_rows * d_vectors + 2} vector registers "
            f"(pv_rows={knobs.pv_rows} × {d_vectors} accumulators over pv_cols={pv_cols} columns + V + "
            f"broadcast) > {regs} available; lower pv_rows or split head_dim with a smaller pv_cols"
        )
    if tile_bytes(spec, knobs.block_m, knobs.block_n) > MAX_TILE_BYTES:
        raise KnobError(
            f"tile working set {tile_bytes(spec, knobs.block_m, knobs.block_n)} B (block_m={knobs.block_m}, block_n={knobs.block_n}, "
            f"head_dim={spec.head_dim}) exceeds MAX_TILE_BYTES={MAX_TILE_BYTES}"
        )


def workload(spec: AttentionSpec, knobs: FlashCPUKnobs, step_only: bool = False):
    """The PrimFunc these knobs schedule (tile sizes are part of the compute). ``step_only``:
    of the decode tiers only the one a step at ``spec.seq_q`` runs (the representative value
    when symbolic), as a static seq_q keeps: a paged step's tuning task (``task_mods``), which
    is specialized to that step; the build emits every tier."""
    return fused_attention(spec, **workload_args(spec, knobs, step_only))


def workload_args(spec: AttentionSpec, knobs: FlashCPUKnobs, step_only: bool = False) -> dict[str, Any]:
    """``fused_attention``'s arguments (after ``spec``) for these knobs (``step_only``: see
    :func:`workload`). What of them the function records, and :func:`from_attrs` reads back,
    is ``knob_attrs.FUSED`` and ``FUSED_DECODE``."""
    rows = decode_rows(spec, knobs)
    if step_only:
        rows = tuple(sorted(r for r in rows if spec.seq_q * spec.group_size <= r)[:1])
    # decode tiers narrower than a vector are dot-product scheduled (cpu_decode): they stage K
    return dict(block_m=knobs.block_m, block_n=knobs.block_n, decode_rows=rows,
                split_tasks=knobs.split_tasks, stage_k_below=knobs.vector_lanes, dot_bf16=int(knobs.dot_bf16),
                prefetch=knobs.prefetch, decode_heads=knobs.decode_heads, decode_dot=knobs.decode_dot,
                decode_block_n=knobs.decode_block_n)


def from_attrs(attrs: Any, base: FlashCPUKnobs | None = None) -> FlashCPUKnobs:
    """The knobs a fused workload's ``attn.*`` attrs record (:mod:`..workloads.knob_attrs`: the
    tiles and the product form; with decode tiers also ``split_tasks``, ``prefetch``,
    ``decode_heads`` and, as ``stage_k_below``, ``vector_lanes``), the others ``base``'s
    (default: the dataclass's). A workload without decode tiers records none of those: they
    are ``base``'s, which must not give ``spec`` a tier either (``task_mods.regenerate`` passes
    the target's preset, whose lanes made the record). Raises ``WorkloadAttrsError`` for attrs
    that are missing or malformed."""
    knobs = dataclasses.replace(base or FlashCPUKnobs(), **read_attrs(FUSED, attrs, "fused"))
    if FUSED_DECODE[0].key not in attrs:
        return knobs
    dec = read_attrs(FUSED_DECODE, attrs, "fused")
    return dataclasses.replace(knobs, split_tasks=dec["split_tasks"], vector_lanes=dec["stage_k_below"],
                               prefetch=dec["prefetch"], decode_heads=dec["decode_heads"],
                               decode_dot=int(dec["decode_dot"]), decode_block_n=int(dec["decode_block_n"]))


def tile_candidates(spec: AttentionSpec, target: Target) -> list[tuple[int, int]]:
    """(block_m, block_n) pairs the tuner searches, each a separate task; the preset's is first."""
    lanes = vector_lanes(target)
    hand = preset(spec, target)
    pairs = [(hand.block_m, hand.block_n)]
    if hand.dot_bf16 in (AMX, AMX_EMULATED):  # tiles of 32 × 32 blocks (no register blocks)
        candidates = [p for p in AMX_TILE_CANDIDATES if p not in pairs]
        return pairs + [p for p in candidates if tile_bytes(spec, *p) <= MAX_TILE_BYTES]
    for m_vectors, n in TILE_CANDIDATES:
        pair = (m_vectors * lanes, n)
        if pair in pairs or max_s_rows(pair[0], lanes) < 1:
            continue
        if tile_bytes(spec, *pair) > MAX_TILE_BYTES:
            continue
        pairs.append(pair)
    return pairs


#: key tiles the tuner tries for a decode step (keys streamed per online-softmax update)
DECODE_BLOCK_N = (32, 64, 128)


def decode_step_rows(spec: AttentionSpec, target: Target) -> int | None:
    """Rows of the packed decode nest a step of ``spec`` (its ``seq_q``, the representative
    value when symbolic) runs: the narrowest that holds ``seq_q · group`` rows; None when the
    step runs the main nest."""
    fits = [r for r in decode_rows(spec, preset(spec, target)) if spec.seq_q * spec.group_size <= r]
    return min(fits) if fits else None


def is_decode_step(spec: AttentionSpec, target: Target) -> bool:
    """Whether a step of ``spec`` (at its representative ``seq_q`` when symbolic) runs a packed
    decode nest: what the tuner's decode tasks measure (:func:`decode_candidates`)."""
    return decode_step_rows(spec, target) is not None


def is_static_decode(spec: AttentionSpec, target: Target) -> bool:
    """Whether ``spec`` (a static seq_q) builds as one packed decode nest and no main nest."""
    return "seq_q" not in spec.dynamic and is_decode_step(spec, target)


def decode_candidates(spec: AttentionSpec, target: Target) -> list[FlashCPUKnobs]:
    """Knobs the tuner searches for a decode step (:func:`is_decode_step`), one task
    each (each decision changes the workload), the preset first:

    * every ``DECODE_BLOCK_N`` key tile × every ``split_tasks`` choice that gives a different
      split count at this batch (``batch · kv_heads`` tasks and up need none), one kv head per
      task;
    * every key tile with 2 and with all kv heads per task (``decode_heads``: the page order;
      staged decode tiles only), unsplit or split as the preset;
    * the preset with each other ``PREFETCH_CHOICES`` distance, and with each product form
      (``decode_dot`` 0, 1, 2, where the CPU and the cache allow it).

    This is the decode step's place in the search: a symbolic kernel tuned at a decode shape
    takes ``split_tasks``, ``block_n``, ``decode_heads`` and ``prefetch`` from the winner.
    A kvcache spec is tuned at ``spec.representative()`` (bhsd, the same memory order); a paged
    spec on its own kernel specialized to its representative step
    (``tvm_attention.tune.paged``), so its page order is measured in pages."""
    hand = preset(spec, target)
    staged = (decode_step_rows(spec, target) or hand.vector_lanes) < hand.vector_lanes
    # kv heads per task: 1, 2 and all (as many as the value tile allows); with more than one,
    # never split or the preset's split only (each task is a build: the grid stays ~20 tasks)
    heads = sorted({1, 2, max_heads_per_task(spec, min(DECODE_BLOCK_N))}
                   & {h for h in range(1, spec.kv_heads + 1) if spec.kv_heads % h == 0}) if staged else [1]
    # (the grid's key tile is block_n's: decode_block_n 0)
    grid = [dataclasses.replace(hand, block_n=bn, split_tasks=st, decode_heads=h, decode_block_n=0)
            for h in heads for bn in DECODE_BLOCK_N
            for st in (SPLIT_TASK_CHOICES if h == 1 else (0, hand.split_tasks))]
    if staged:
        grid += [dataclasses.replace(hand, prefetch=pf) for pf in PREFETCH_CHOICES if pf != hand.prefetch]
        # the product forms (the tiles' where the target has AMX: check refuses them elsewhere)
        grid += [dataclasses.replace(hand, decode_dot=v) for v in (0, 1, 2, 3, DECODE_AMX)]
    out, seen = [], set()
    for knobs in [hand] + grid:
        key = (knobs.decode_tile, knobs.decode_heads, knobs.prefetch, knobs.decode_dot,
               n_splits(knobs.split_tasks, spec.batch, spec.kv_heads // knobs.decode_heads))
        if key in seen:
            continue
        try:
            check(knobs, spec, target)
        except KnobError:
            continue
        seen.add(key)
        out.append(knobs)
    return out


@dataclasses.dataclass(frozen=True)
class TileKernelLayout:
    """Which named blocks a tile kernel has (the fused kernel and the row-cached family share
    this schedule; the latter has no key-tile loop and no online-correction blocks)."""

    row_vector_blocks: tuple[str, ...]  # innermost loop runs over query rows: vectorize across rows
    d_vector_blocks: tuple[str, ...]  # innermost loop runs over head_dim
    kv_tile: bool  # has the kv_tile loop (auto_unroll applies there)


#: Blocks a variant adds to the tile (``score_mod``: the softcap's tanh and ALiBi's bias;
#: ``scale_load``: an 8-bit cache's per-token scales of a key tile, per row), vectorized across query
#: rows like the softmax stages where the workload has them.
VARIANT_ROW_BLOCKS = ("score_mod", "scale_load")

FLASH_LAYOUT = TileKernelLayout(
    ("row_max", "P_exp", "row_sum", "Q_load", "state_init", "online_correction", "max_commit"),
    ("acc_init", "O_store"),
    kv_tile=True,
)


def schedule(
    sch: s_tir.Schedule,
    spec: AttentionSpec,
    lanes: int,
    knobs: Any = None,
    layout: TileKernelLayout = FLASH_LAYOUT,
    suffix: str = "",
) -> s_tir.Schedule:
    """The one schedule of the fused kernel, for the hand path and the search alike.

    With ``knobs`` every decision is pinned to them (the hand schedule); with ``knobs=None``
    each is sampled (``sample_perfect_tile``/``sample_categorical``), which makes this the
    MetaSchedule design space. The sampled values are recorded as ``attn.*`` annotations on
    ``row_tile`` so a tuned trace can be read back as knobs (:func:`knobs_of`). Every sample
    respects the register limits, so every point of the space keeps the score tile local and
    passes ``check``. ``suffix``: the nest whose blocks carry it (``_dec``: the decode nest).
    """
    row_tile = sch.get_sblock("row_tile" + suffix)
    bufs = {b.name: b for b in sch.get(row_tile).alloc_buffers}
    block_m = int(bufs["S"].shape[1])  # S is (block_n, block_m)
    s_buf = bufs["S"]
    block_n = int(s_buf.shape[0])  # keys per S tile: block_n (fused) or seq_kv (row-cached)
    D, DV = spec.head_dim, spec.v_dim  # QKᵀ's head dim, PV's
    pin = knobs is not None

    # Step 1. S_gemm register block: (jo, do, di, ji, io, ii) — s_rows keys (unrolled) × query
    # vectors accumulate across the head_dim loop; di optionally unrolled.
    s_gemm = sch.get_sblock("S_gemm" + suffix)
    *_, j, d, i = sch.get_loops(s_gemm)
    s_rows = sample_tile(sch, j, block_n, knobs.s_rows if pin else None, max_s_rows(block_m, lanes))
    jo, ji = sch.split(j, s_rows)
    d_split = sample_tile(sch, d, D, knobs.d_unroll if pin else None, D_UNROLL_MAX)
    do, di = sch.split(d, d_split)
    io, ii = sch.split(i, [None, lanes])
    sch.reorder(jo, do, di, ji, io, ii)
    sch.unroll(di)
    sch.unroll(ji)
    sch.unroll(io)
    sch.vectorize(ii)
    sch.annotate(row_tile, "attn.s_rows", s_rows[1])
    sch.annotate(row_tile, "attn.d_unroll", d_split[1])

    # Step 2. PV_gemm register block: (io, [do,] j, ii, di) — pv_rows rows (unrolled) × pv_cols
    # columns of vectors. The column block is not sampled: it is all of head_dim unless the
    # registers force a split (pv_columns), and a split only ever adds reloads of P.
    pv = sch.get_sblock("PV_gemm" + suffix)
    *_, i, j, d = sch.get_loops(pv)
    pv_keys = j  # (the key loop: decompose_reduction's, below)
    pv_cols = pv_cols_of(knobs, DV) if pin else pv_columns(DV, lanes)
    pv_rows = sample_tile(sch, i, block_m, knobs.pv_rows if pin else None, max_pv_rows(pv_cols, lanes))
    io, ii = sch.split(i, pv_rows)
    if pv_cols < DV:
        do, d = sch.split(d, [None, pv_cols])
        sch.reorder(io, do, j, ii, d)
    else:
        sch.reorder(io, j, ii, d)
    sch.unroll(ii)
    cpu_decode.vectorize_in_groups(sch, spec, d)
    sch.annotate(row_tile, "attn.pv_rows", pv_rows[1])
    sch.annotate(row_tile, "attn.pv_cols", pv_cols if pv_cols < DV else 0)

    # Step 3. Softmax stages and loads/stores: vectors across query rows (or head_dim); a
    # staged key tile (float16 inputs: workloads.fused.stages_half_keys) converted in head_dim
    # vectors.
    if _has_block(sch, "K_load" + suffix) and D % lanes == 0:  # else LLVM vectorizes what it can
        vectorize_rows(sch, sch.get_loops(sch.get_sblock("K_load" + suffix))[-1], lanes)
    for name in layout.row_vector_blocks + VARIANT_ROW_BLOCKS:
        if name in layout.row_vector_blocks or _has_block(sch, name + suffix):
            vectorize_rows(sch, sch.get_loops(sch.get_sblock(name + suffix))[-1], lanes)
    for name in layout.d_vector_blocks:
        sch.vectorize(sch.get_loops(sch.get_sblock(name + suffix))[-1])

    # Step 4. Optional auto-unroll of what is left inside one key tile.
    if layout.kv_tile:
        c_loop = sch.get_loops(sch.get_sblock("kv_tile" + suffix))[-1]
        unroll = sample_choice(sch, AUTO_UNROLL_STEPS, knobs.auto_unroll if pin else None)
        sch.annotate(c_loop, "pragma_auto_unroll_max_step", unroll)
        sch.annotate(c_loop, "pragma_unroll_explicit", 1)
        sch.annotate(row_tile, "attn.auto_unroll", unroll)

    # Step 5. Hoist reduction inits (m_new = m, l·alpha, acc·alpha, S = 0) out of their loops.
    sch.decompose_reduction(s_gemm, sch.get_loops(s_gemm)[-5])  # at do
    sch.decompose_reduction(pv, pv_keys)  # before the key loop
    for name in ("row_max", "row_sum"):
        blk = sch.get_sblock(name + suffix)
        sch.decompose_reduction(blk, sch.get_loops(blk)[-3])  # before the key loop

    # Step 6. Parallel over (batch, head, row tile), parallel_chunk row tiles per task. Last:
    # get_loops of the nested blocks must not see the outer loops change under them (their
    # count would differ between recording and replay of a trace).
    fused = sch.fuse(*sch.get_loops(row_tile))  # (batch, head, row tile), or varlen's (head, slot)
    chunk = sample_choice(sch, PARALLEL_CHUNKS, knobs.parallel_chunk if pin else None)
    outer, _ = sch.split(fused, [None, chunk])
    sch.parallel(outer)
    sch.annotate(row_tile, "attn.parallel_chunk", chunk)
    return sch


def apply(sch: s_tir.Schedule, knobs: FlashCPUKnobs, spec: AttentionSpec) -> s_tir.Schedule:
    """The hand schedule: :func:`schedule` with every decision pinned to ``knobs`` (and the
    decode nest, when the workload has one, with :func:`decode_knobs`). A static decode shape
    has only its decode nest (``workloads.fused_attention``)."""
    if _has_block(sch, "row_tile") and knobs.dot_bf16 in (AMX, AMX_EMULATED):
        cpu_amx.schedule(sch, spec, knobs)
    elif _has_block(sch, "row_tile") and knobs.dot_bf16:
        cpu_bf16.schedule(sch, spec, knobs)
    elif _has_block(sch, "row_tile"):
        schedule(sch, spec, knobs.vector_lanes, knobs)
    if _has_block(sch, "row_tile" + SPLIT):  # a latent nest's split form: its tiles, a task per chunk
        schedule_latent_split(sch, spec, dataclasses.replace(knobs, parallel_chunk=1))
    for rows in decode_rows(spec, knobs):
        suffix = DECODE + str(rows)
        for nest in (suffix, suffix + SPLIT):
            if not _has_block(sch, "row_tile" + nest):
                continue  # a static seq_q keeps one tier; a static batch may need no split form
            if rows < knobs.vector_lanes:
                cpu_decode.schedule(sch, spec, nest, cpu_decode.for_lanes(knobs.vector_lanes))
            else:
                schedule(sch, spec, knobs.vector_lanes, decode_knobs(knobs), suffix=nest)
        if _has_block(sch, MERGE + suffix):
            merge = sch.get_sblock(MERGE + suffix)
            sch.parallel(sch.fuse(*sch.get_loops(merge)))
    return sch


_has_block = cpu_decode.has_block


def schedule_latent_split(sch: s_tir.Schedule, spec: AttentionSpec, knobs: Any, lanes: int | None = None):
    """The split form of a latent (MLA) nest (blocks ``*_split``, ``merge``): its tile as the
    main nest's, pinned to ``knobs`` (None: sampled, with ``lanes``), the merge parallel over
    rows."""
    form = knobs.dot_bf16 if knobs is not None else _dot_form(sch)
    if form in (AMX, AMX_EMULATED):
        cpu_amx.schedule(sch, spec, knobs, suffix=SPLIT)
    elif form:
        cpu_bf16.schedule(sch, spec, knobs, suffix=SPLIT)
    else:
        schedule(sch, spec, knobs.vector_lanes if knobs is not None else lanes, knobs, suffix=SPLIT)
    merge = sch.get_sblock(MERGE)
    # parallel over (batch, row tile): its rows stay the inner loop (fusing all three symbolic
    # extents leaves the workspace's regions to a divide by zero in TVM's buffer compaction)
    sch.parallel(sch.fuse(*sch.get_loops(merge)[:2]))
    return sch


def decode_rows(spec: AttentionSpec, knobs: FlashCPUKnobs) -> tuple[int, ...]:
    """Rows of the GQA-packed decode nests (``workloads.fused._dense``): () for none. A kernel
    with a static seq_q keeps the narrowest that holds its ``seq_q · group`` rows, if any.

    * ``group`` rounded up to a power of two (1 for MHA, 4 for 32:8 heads), scheduled as dot
      products along head_dim (``cpu_decode``): one new token per sequence, the common decode
      step, computes only its own rows;
    * for the KV-cache layouts also one vector of rows (16 with AVX-512), vectorized across rows
      as the main nest: a few draft tokens per sequence (``seq_q · group ≤ 16``) fill it.
    Why not one nest: a one-vector tile at one token computes 16 rows for 4 (or 1), which bound
    decode by the FMA units, not by the memory it must stream. bhsd (the transformers path, one
    token per step) keeps one decode nest: every nest adds seconds of lowering to a build."""
    if spec.layout_info.packed or spec.layout_info.latent:  # a latent cache packs its heads into one nest
        return ()
    lanes, group = knobs.vector_lanes, spec.group_size
    if group > lanes:
        return ()
    few = 1 << (group - 1).bit_length()
    if few < lanes and cpu_decode.supports(spec, few, lanes):
        return (few, lanes) if spec.layout_info.is_cache else (few,)
    return (lanes,)


def decode_knobs(knobs: FlashCPUKnobs) -> FlashCPUKnobs:
    """The decode nest's knobs: ``block_m`` one vector of rows, the rest as the main nest's,
    clamped to what a one-vector tile allows (register blocks that fit and divide)."""
    lanes = knobs.vector_lanes
    s_rows = min(knobs.s_rows, max_s_rows(lanes, lanes))
    while knobs.block_n % s_rows:
        s_rows -= 1
    pv_rows = min(knobs.pv_rows, lanes)
    while lanes % pv_rows:
        pv_rows -= 1
    return dataclasses.replace(knobs, block_m=lanes, s_rows=s_rows, pv_rows=pv_rows, parallel_chunk=1)


def design_space(spec: AttentionSpec, target: Target):
    """The MetaSchedule space function for one (block_m, block_n) workload of ``spec``."""
    lanes = vector_lanes(target)

    def space_fn(sch: s_tir.Schedule) -> s_tir.Schedule:
        if not _has_block(sch, "row_tile"):  # a static latent decode step: its split form only
            return schedule_latent_split(sch, spec, None, lanes)
        if _dot_form(sch) in (AMX, AMX_EMULATED):  # the workload says which form it is (a task each)
            return cpu_amx.schedule(sch, spec, None)
        if _dot_form(sch):
            return cpu_bf16.schedule(sch, spec, None)
        return schedule(sch, spec, lanes, None)

    return space_fn


KNOB_ANNOTATIONS = ("s_rows", "pv_rows", "pv_cols", "d_unroll", "parallel_chunk", "auto_unroll")


def read_annotations(sch: s_tir.Schedule, names: tuple[str, ...]) -> tuple[dict[str, int], dict[str, Any]]:
    """(knob values from ``attn.*`` annotations, local buffers by name) of ``row_tile``.
    ``pv_cols`` is absent from traces recorded before it existed: they used all of head_dim."""
    # a static latent decode step has only its split form (row_tile_split)
    row_tile = sch.get(sch.get_sblock("row_tile" if _has_block(sch, "row_tile") else "row_tile" + SPLIT))
    values = {k: int(row_tile.annotations.get(f"attn.{k}", 0)) if k == "pv_cols" else int(row_tile.annotations[f"attn.{k}"])
              for k in names}
    return values, {b.name: b for b in row_tile.alloc_buffers}


def knobs_of(sch: s_tir.Schedule, lanes: int, base: FlashCPUKnobs | None = None) -> FlashCPUKnobs:
    """Read the knobs a (tuned or hand) schedule chose back from its ``attn.*`` annotations.

    A static decode kernel (no main nest, :func:`decode_candidates`) has no annotations: its
    knobs are what its attrs record (:func:`from_attrs`: the tiles, ``split_tasks``,
    ``prefetch``, ``decode_heads``, ``vector_lanes``), the others ``base``'s (the preset it was
    made from)."""
    # The workload's knobs (from_attrs): a function with decode nests records theirs; one
    # without (a prefill shape tuned for a symbolic kernel) says nothing about its decode step,
    # which keeps the preset's.
    attrs = sch.mod["main"].attrs
    if not _has_block(sch, "row_tile"):
        if base is None:
            raise ValueError("a decode-only kernel's knobs are read on top of the preset it was made from (base)")
        return from_attrs(attrs, base)
    b = base or FlashCPUKnobs()
    values, _ = read_annotations(sch, KNOB_ANNOTATIONS)
    return dataclasses.replace(
        from_attrs(attrs, FlashCPUKnobs(vector_lanes=lanes, prefetch=b.prefetch, decode_heads=b.decode_heads,
                                        decode_dot=b.decode_dot)), **values)


def _dot_form(sch: s_tir.Schedule) -> int:
    """The workload's product form (``attn.dot_bf16``: 0 when absent)."""
    attrs = sch.mod["main"].attrs
    return int(attrs["attn.dot_bf16"]) if attrs is not None and "attn.dot_bf16" in attrs else 0
