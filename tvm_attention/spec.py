"""The workload spec: one value type that every room of tvm-attention speaks.

Layout is BHSD throughout:

* ``q``: ``(batch, heads, seq_q, head_dim)``
* ``k``: ``(batch, kv_heads, seq_kv, head_dim)``
* ``v``: ``(batch, kv_heads, seq_kv, head_dim_v)``
* ``o``: ``(batch, heads, seq_q, head_dim_v)``

``head_dim_v`` (the value head size, DeepSeek's ``v_head_dim``) defaults to ``head_dim``.

Query head ``h`` reads kv head ``h // (heads // kv_heads)`` (GQA; ``kv_heads == 1`` is MQA).

Causal masking is bottom-right aligned (FlashAttention >= 2.1): query ``i`` may see key ``j``
iff ``j <= i + (seq_kv - seq_q)``. For ``seq_q=5, seq_kv=2``::

    0 0
    0 0
    0 0
    1 0
    1 1

A row that may see no key outputs zeros.

Other argument layouts (FlashAttention's packed ``varlen``) and symbolic dims are data:
``layout`` names an entry of :mod:`tvm_attention.layouts`, and ``dynamic`` names the dims the
built kernel takes at call time (``batch``, ``seq_q``, ``seq_kv``). A dynamic dim's integer is then
only its *representative* value: the shape the build validates, times and tunes at.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Mapping

from . import modifiers
from .errors import SpecError
# tensor elements, sequence lengths and window sides a kernel takes (int32 indexing): limits.py
from .limits import MAX_ELEMENTS, MAX_SEQ_LEN, MAX_WINDOW  # noqa: F401 - MAX_ELEMENTS re-exported
from .quant import KV_DTYPES, KV_SCALES, SCALE_GROUP
from .layouts import get_layout, in_words, layouts_where
from .visibility import Visibility

#: Input/output dtypes a spec may have. Accumulation is always float32. Which targets build which
#: dtype is the schedule's business: the CPU schedules take float32 only and say so.
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
#: 8-bit K/V cache dtypes (``kv_dtype``, :data:`tvm_attention.quant.KV_DTYPES`): the value of a
#: stored element is ``scale[kv_head] · stored`` (``k_scale``/``v_scale`` call arguments); q and o
#: keep ``dtype``.


#: Bounds of ``scale``: kernels multiply q by the float32 constant ``scale·log2(e)``, which must be
#: a finite normal float32 (3e38 would overflow it; TVM rejects the literal).
MIN_SCALE, MAX_SCALE = 1e-30, 1e30
#: Largest head_dim: every x86 schedule builds up to it (FlashAttention stops at 256): MLA's
#: latent rows are 576 wide (kv_lora_rank 512 + rope 64, DeepSeek-V2/V3, Kimi K2).
MAX_HEAD_DIM = 576
#: Bounds of ``softcap``: kernels compute c·tanh(x / c) in float32 with c and 1/c folded into
#: float32 constants, so both must be finite normal float32 values; no model caps outside
#: [1, 100] (Gemma-2 30 and 50, Grok 30), so the range is generous and far from the edges.
MIN_SOFTCAP, MAX_SOFTCAP = 1e-6, 1e6
#: The exported attention function's name (every kernel's ``global_symbol``; the manifest's
#: ``entry``). The library's other function is ``AttentionSpec.SPEC_FUNCTION``.
ENTRY = "attention"
#: Byte alignment the CPU kernels (fused, materialized, row-cached) declare for every argument's
#: data: NumPy places arrays at 16 mod 64 bytes, and a kernel declaring 64 (TVM's default) may
#: use aligned vector moves that fault on them, so the loader had to copy every NumPy input on
#: every call (a decode step B4 4k GQA 32:8 D128 fp32: 42 ms copied, 14 ms not). Declared 16,
#: LLVM emits unaligned moves, which cost nothing measurable on aligned data (2-core znver4,
#: 2 threads, best of 20: prefill B1 H8 S1024 D64 causal 12.2-12.4 ms at 64, 12.3-12.9 at 16;
#: the same on 16-mod-64 data 12.2-12.3; decode 12.7-14.3 / 11.6 / 11.7-13.8 ms). Recorded
#: as the manifest's ``data_alignment``; CUDA kernels keep TVM's 64.
DATA_ALIGNMENT = 16


#: The attention variants a spec may turn on (docs/semantics.md), in the order the call arguments
#: of those that take one follow (``alibi_slopes``, ``sinks``, ``kv_start``, ``key_lo``/``key_hi``;
#: then the modifiers' tensors, ``mod_tensors``).
#: 8-bit query dtypes (``q_dtype``, fp8 inputs): e4m3, as FlashAttention-3's fp8 forward takes
Q_DTYPES = ("float8_e4m3fn",)
#: kv_dtype -> its tag in short names (``..._float32_kve4m3_causal``)
KV_TAGS = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "int8": "i8"}
#: kv_scale -> its tag in short names (``..._kvi8_stok_causal``; per kv head: none)
SCALE_TAGS = {"head": "", "token": "_stok", "group": f"_sg{SCALE_GROUP}"}

VARIANTS = ("window", "softcap", "alibi", "sinks", "kv_start", "score_mod", "mask_mod", "key_bounds", "custom_mask")

#: Dims a spec may leave symbolic (``dynamic``); heads, kv_heads, head_dim, dtype, causal and
#: scale are always compiled in.
DYNAMIC_DIMS = ("batch", "seq_q", "seq_kv")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """One attention workload: ``O = softmax(Q·Kᵀ·scale + mask)·V`` in BHSD layout."""

    batch: int
    heads: int
    seq_q: int
    head_dim: int
    seq_kv: int | None = None  # defaults to seq_q
    kv_heads: int | None = None  # defaults to heads
    dtype: str = "float32"
    causal: bool = False
    scale: float | None = None  # defaults to 1/sqrt(head_dim)
    layout: str = "bhsd"  # an entry of tvm_attention.layouts.LAYOUTS
    #: dims taken at call time (symbolic in the PrimFunc): any of DYNAMIC_DIMS. Their integers
    #: above are representative values (validation, timing, tuning). varlen: all of them.
    dynamic: tuple[str, ...] = ()
    #: the kernel also writes ``lse`` (float32, natural log of each row's softmax denominator,
    #: ``-inf`` for a row that sees no key): an output after ``o`` in the layout's call order
    return_lse: bool = False
    #: keys per page of the paged layout's K/V pools (compiled in; that layout's default 16)
    page_size: int | None = None
    # -- variants (docs/semantics.md; each compiled in, off by default) ---------------------------
    #: sliding window ``(left, right)``: a row at position p sees keys p − left .. p + right (-1:
    #: unbounded; FlashAttention's window_size). Causal is right = 0; stored canonical (None: none)
    window: tuple[int, int] | None = None
    #: logit softcap c > 0: the scaled score x becomes c·tanh(x / c) before masking (Gemma-2)
    softcap: float | None = None
    #: ALiBi: the (capped) score gains −slope_h·|p − j|; slopes ``alibi_slopes (heads,)`` float32
    #: are a call argument
    alibi: bool = False
    #: attention sinks: ``sinks (heads,)`` float32 logits (natural log, not scaled), a call
    #: argument; each row's softmax denominator gains exp(sink_h), with no value attached
    sinks: bool = False
    #: left padding: ``kv_start (batch,)`` int32, a call argument; keys j < kv_start[b] are hidden
    kv_start: bool = False
    #: user-written modifiers (tvm_attention.modifiers): the source text of ``score_mod(score, b, h,
    #: q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` (a function given here is stored as its
    #: source), compiled into the tile; ``mod_tensors`` the extra tensors they read, each
    #: ``(name, dtype, dims)``, call arguments in that order
    score_mod: str | None = None
    mask_mod: str | None = None
    mod_tensors: tuple = ()
    #: per-position key bounds: call arguments ``key_lo``, ``key_hi (batch, positions)`` int32; a
    #: row at position p sees keys key_lo[b, p] <= j < key_hi[b, p] only (both non-decreasing in p),
    #: and key tiles outside a row tile's bounds are skipped (a block mask given at call time)
    key_bounds: bool = False
    #: a custom mask (FlashInfer's packed bits, :mod:`tvm_attention.masks`): call arguments
    #: ``custom_mask (mask_bytes,) uint8`` and ``mask_indptr (batch + 1,) int32``; row ``i`` of
    #: sequence ``b`` sees key ``j`` only where bit ``i·keys_b + j`` of its bytes from
    #: ``mask_indptr[b]`` is set (ANDed with causal, the window, key bounds and ``mask_mod``)
    custom_mask: bool = False
    # an 8-bit K/V dtype (KV_DTYPES; None: K/V in ``dtype``): the kernel then takes the scales
    # ``k_scale``/``v_scale (kv_heads,)`` float32 after the variant arguments
    kv_dtype: str | None = None
    # kvcache/paged: the call's k_new/v_new (batch, kv_heads, seq_q, head_dim) are written into
    # the cache at cache_seqlens[b] .. + seq_q - 1 (quantized with the scales for an 8-bit
    # cache) and attended to in the same call; cache_seqlens is the length before the append.
    # mla/mla_paged: kv_new (batch, seq_q, head_dim), the new tokens' latent rows
    append: bool = False
    #: CUDA builds: a check kernel validates the index arrays (cu_seqlens, cache_seqlens,
    #: block_table, kv_start) on the device before the attention kernels, which then do nothing
    #: when one is broken; the call gains a last output ``index_error (1,) int32`` (its bits:
    #: ``layouts.INDEX_ERROR_BITS``; 0: valid). CPU builds always check on the host. A kernel
    #: without index arrays (bhsd without kv_start) refuses it (docs/cuda.md)
    device_checks: bool = False
    #: an int8 cache's QKᵀ on integers (issue 42): each query row (its head_dim elements) is
    #: rounded to int8 at the start of the call, ``q ≈ s_q·q_i`` with ``s_q = max|q| / 127`` (1/127
    #: for a row of zeros), ``q_i = rint(q · (127 / max|q|))`` in float32, ties to even; a score is
    #: then ``s_q·k_scale·(q_i·k_i)``, the integer dot product exact. llama.cpp's choice (per
    #: row). It changes the numerics: the float64 reference models it (``quant.qk_int8_query``)
    qk_int8: bool = False
    #: how finely an 8-bit cache is scaled (``quant.KV_SCALES``): ``"head"`` one float32 scale per
    #: kv head, ``k_scale``/``v_scale (kv_heads,)``; ``"token"`` one per (token, kv head), the
    #: cache's shape without head_dim (kvcache ``(batch, kv_heads, max_len)``, paged
    #: ``(num_pages, page_size, kv_heads)``); ``"group"`` one per 32 elements of head_dim (llama.cpp's
    #: Q8_0 blocks), ``(..., head_dim / 32)``. Finer scales follow outliers (a token, a channel) at
    #: 4 bytes per scale; an appending kernel writes the scales of the keys it appends
    kv_scale: str = "head"
    #: the head size of v and o (``v_dim``); None (the default, and what a value equal to
    #: ``head_dim`` is stored as): ``head_dim``. DeepSeek's unabsorbed prefill is 192 / 128
    head_dim_v: int | None = None
    #: fp8 inputs (FlashAttention-3's fp8 forward): q stored as ``float8_e4m3fn`` (:data:`Q_DTYPES`)
    #: with ``q_scale (heads,)`` float32 (per query head; a per-tensor scale is that value in every
    #: entry), a call argument before ``k_scale``; K/V then must be an e4m3 cache scaled per KV
    #: head (``kv_dtype``, ``kv_scale="head"``); o keeps ``dtype``. The value of q is ``q_scale[h]
    #: · stored``. Built by the Hopper kernel (products on wgmma's e4m3 form); None: q in ``dtype``
    q_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq_q", "head_dim"):
            _check_positive_int(name, getattr(self, name))
        if self.seq_kv is None:
            object.__setattr__(self, "seq_kv", self.seq_q)
        if self.kv_heads is None:  # a latent cache (MLA) is one kv head for every query head
            object.__setattr__(self, "kv_heads", 1 if get_layout(self.layout).latent else self.heads)
        _check_positive_int("seq_kv", self.seq_kv)
        _check_positive_int("kv_heads", self.kv_heads)
        for name in ("seq_q", "seq_kv"):
            if getattr(self, name) > MAX_SEQ_LEN:
                raise SpecError(f"{name}={getattr(self, name)} is longer than the longest sequence a kernel takes, "
                                f"{MAX_SEQ_LEN} (2**30; kernels form positions and tile bounds in int32)")
        layout = get_layout(self.layout)  # SpecError naming the known layouts
        object.__setattr__(self, "layout", layout.name)
        dyn = self.dynamic
        if isinstance(dyn, str) or not isinstance(dyn, (tuple, list)):
            raise SpecError(f"dynamic must be a list of dim names, got {dyn!r}")
        unknown = [d for d in dyn if d not in DYNAMIC_DIMS]
        if unknown:
            raise SpecError(f"dynamic: unknown dim(s) {unknown}; symbolic dims may be {', '.join(DYNAMIC_DIMS)}")
        dyn = tuple(d for d in DYNAMIC_DIMS if d in dyn or d in layout.always_dynamic)
        object.__setattr__(self, "dynamic", dyn)
        if self.heads % self.kv_heads:
            raise SpecError(
                f"heads={self.heads} must be divisible by kv_heads={self.kv_heads} "
                "(each kv head serves heads // kv_heads query heads)"
            )
        if self.head_dim_v is not None:
            _check_positive_int("head_dim_v", self.head_dim_v)
            if self.head_dim_v == self.head_dim:
                object.__setattr__(self, "head_dim_v", None)
        for name in ("head_dim", "head_dim_v"):
            if (getattr(self, name) or 0) > MAX_HEAD_DIM:
                raise SpecError(f"{name}={getattr(self, name)} is larger than the supported {MAX_HEAD_DIM}")
        for name, shape in (("q", self.q_shape), ("k", self.kv_shape), ("v", self.v_shape), ("o", self.o_shape)):
            if math.prod(shape) > MAX_ELEMENTS:
                raise SpecError(
                    f"{name} {shape} has {math.prod(shape)} elements: kernels index with 32-bit ints, "
                    f"so a tensor may hold at most {MAX_ELEMENTS}"
                )
        if not isinstance(self.causal, bool):
            raise SpecError(f"causal must be a bool, got {self.causal!r}")
        if not isinstance(self.return_lse, bool):
            raise SpecError(f"return_lse must be a bool, got {self.return_lse!r}")
        if layout.paged:
            if self.page_size is None:
                object.__setattr__(self, "page_size", layout.default_page_size)
            _check_positive_int("page_size", self.page_size)
            if self.page_size * self.kv_heads * max(self.head_dim, self.v_dim) > MAX_ELEMENTS:
                raise SpecError(f"page_size={self.page_size}: one page of kv_heads={self.kv_heads} x "
                                f"head_dim={max(self.head_dim, self.v_dim)} would hold more than {MAX_ELEMENTS} "
                                "elements (kernels index with 32-bit ints)")
        elif self.page_size is not None:
            raise SpecError(f"page_size={self.page_size!r} applies to the paged layout only (layout={layout.name})")
        self._check_variants(layout)
        if self.dtype not in SUPPORTED_DTYPES:
            raise SpecError(
                f"dtype={self.dtype!r} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}"
            )
        if self.kv_dtype == self.dtype:
            object.__setattr__(self, "kv_dtype", None)
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise SpecError(f"kv_dtype={self.kv_dtype!r} is not supported; 8-bit caches: {', '.join(KV_DTYPES)} "
                            f"(or None: K/V in dtype={self.dtype})")
        if not isinstance(self.append, bool):
            raise SpecError(f"append must be a bool, got {self.append!r}")
        if not isinstance(self.qk_int8, bool):
            raise SpecError(f"qk_int8 must be a bool, got {self.qk_int8!r}")
        if self.qk_int8 and self.kv_dtype != "int8":
            raise SpecError(f"qk_int8 rounds q to int8 for integer dot products against an int8 cache: it needs "
                            f"kv_dtype='int8', got kv_dtype={self.kv_dtype!r}")
        if self.kv_scale not in KV_SCALES:
            raise SpecError(f"kv_scale={self.kv_scale!r} is not a scale granularity; one of {', '.join(KV_SCALES)}")
        if self.kv_scale != "head" and self.kv_dtype is None:
            raise SpecError(f"kv_scale={self.kv_scale!r} scales an 8-bit cache: it needs kv_dtype (one of "
                            f"{', '.join(KV_DTYPES)})")
        for name in ("head_dim", "head_dim_v"):
            if self.kv_scale == "group" and (getattr(self, name) or 0) % SCALE_GROUP:
                raise SpecError(f"kv_scale='group' scales each {SCALE_GROUP} elements of {name}: {name}="
                                f"{getattr(self, name)} is not a multiple of {SCALE_GROUP}")
        self._check_q_dtype(layout)
        if not isinstance(self.device_checks, bool):
            raise SpecError(f"device_checks must be a bool, got {self.device_checks!r}")
        if self.device_checks and not layout.index_args and not self.kv_start and not self.custom_mask:
            raise SpecError(f"device_checks: a {layout.name} kernel without kv_start or a custom mask takes no index "
                            "array to check "
                            "on the device (its shapes are checked by the library's argument checks); drop "
                            "--device-checks")
        if self.append and not layout.is_cache:
            raise SpecError(f"append (k_new/v_new, a latent layout's kv_new, written into the cache) applies to "
                            f"the {in_words(layouts_where('is_cache'))} layouts, not {layout.name!r}")
        if layout.latent:
            self._check_latent(layout)
        if self.scale is None:
            object.__setattr__(self, "scale", 1.0 / math.sqrt(self.head_dim))
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)):
            raise SpecError(f"scale must be a number, got {self.scale!r}")
        object.__setattr__(self, "scale", float(self.scale))
        if not math.isfinite(self.scale) or not MIN_SCALE <= self.scale <= MAX_SCALE:
            raise SpecError(
                f"scale must be a positive number in [{MIN_SCALE:g}, {MAX_SCALE:g}], got {self.scale!r} "
                "(kernels fold scale·log2(e) into a float32 constant)"
            )

    def _check_q_dtype(self, layout) -> None:
        """fp8 inputs (``q_dtype``): q, K and V all e4m3 with per-head scales (FlashAttention-3's
        fp8 forward, whose descales are per tensor or per head), o in ``dtype``."""
        if self.q_dtype is None or self.q_dtype == self.dtype:
            object.__setattr__(self, "q_dtype", None)
            return
        if self.q_dtype not in Q_DTYPES:
            raise SpecError(f"q_dtype={self.q_dtype!r} is not supported; 8-bit queries: {', '.join(Q_DTYPES)} "
                            f"(or None: q in dtype={self.dtype})")
        if self.kv_dtype != self.q_dtype or self.kv_scale != "head":
            raise SpecError(f"q_dtype={self.q_dtype!r} (fp8 inputs) multiplies q and K on {self.q_dtype} products: "
                            f"give kv_dtype={self.q_dtype!r} with kv_scale='head', got kv_dtype={self.kv_dtype!r}, "
                            f"kv_scale={self.kv_scale!r}")
        if layout.latent or self.append or self.qk_int8:
            raise SpecError(f"q_dtype={self.q_dtype!r} (fp8 inputs) is a prefill form: not for a latent cache, an "
                            "appending kernel or qk_int8")

    def _check_latent(self, layout) -> None:
        """A latent cache (MLA): one kv head, V its first ``head_dim_v < head_dim`` columns, the
        scale given (the model's is not ``1/sqrt(head_dim)``)."""
        if self.kv_heads != 1:
            raise SpecError(f"layout {layout.name!r}: the latent cache is one kv head shared by every query head, "
                            f"got kv_heads={self.kv_heads}")
        if self.head_dim_v is None or self.head_dim_v > self.head_dim:
            raise SpecError(f"layout {layout.name!r}: V is the latent row's first head_dim_v columns: give "
                            f"head_dim_v < head_dim={self.head_dim} (DeepSeek-V3: head_dim 576, head_dim_v 512), "
                            f"got head_dim_v={self.head_dim_v}")
        if self.scale is None:
            raise SpecError(f"layout {layout.name!r}: give the scale (the model's softmax scale; DeepSeek's is "
                            "1/sqrt(qk_nope_head_dim + qk_rope_head_dim), not 1/sqrt(head_dim))")
        if self.qk_int8:
            raise SpecError(f"layout {layout.name!r}: qk_int8 (QKᵀ on int8 dot products) is not built for a latent "
                            "cache; an 8-bit latent cache (kv_dtype) takes float32 products")

    def _check_variants(self, layout) -> None:
        """Validate the variant fields and store them canonically: a window as a ``(left, right)``
        tuple that hides something (``right = 0`` is ``causal``), a softcap as a float."""
        for name in ("alibi", "sinks", "kv_start"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.kv_start and layout.packed:
            raise SpecError(f"kv_start (left padding) applies to the {in_words(layouts_where('packed', False))} "
                            f"layouts: {layout.name} packs sequences without padding")
        w = self.window
        if w is not None:
            if isinstance(w, str) or not isinstance(w, (tuple, list)) or len(w) != 2 or \
                    any(isinstance(x, bool) or not isinstance(x, int) or x < -1 for x in w):
                raise SpecError(f"window must be (left, right), two ints >= -1 (-1: unbounded), got {w!r}")
            left, right = w
            for side, x in (("left", left), ("right", right)):
                if x > MAX_WINDOW:
                    raise SpecError(
                        f"window: {side}={x} is out of range; each side is -1 (unbounded) or in [0, {MAX_WINDOW}] "
                        f"(2**29: kernels form p ± window in int32; for no bound pass -1)")
            if self.causal and right > 0:
                raise SpecError(f"window=({left}, {right}) with causal: causal means right = 0 (keys after the "
                                "row's own are hidden); pass right 0 or -1, or drop causal")
            if self.causal or right == 0:
                object.__setattr__(self, "causal", True)
                right = 0
            w = None if left == -1 and right in (-1, 0) else (left, right)
            object.__setattr__(self, "window", w)
        c = self.softcap
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
                raise SpecError(f"softcap must be a positive number (0 or None: off), got {c!r}")
            if c and not MIN_SOFTCAP <= c <= MAX_SOFTCAP:
                raise SpecError(f"softcap={c!r} is out of range: a cap is in [{MIN_SOFTCAP:g}, {MAX_SOFTCAP:g}] (0 or "
                                "None: off; kernels fold c and 1/c into float32 constants)")
            object.__setattr__(self, "softcap", float(c) if c > 0 else None)
        self._check_modifiers()

    def _check_modifiers(self) -> None:
        """Store the modifiers as checked source text and ``mod_tensors`` canonically."""
        for name in ("key_bounds", "custom_mask"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name} must be a bool, got {getattr(self, name)!r}")
        tensors = modifiers.check_tensors(self.mod_tensors)
        object.__setattr__(self, "mod_tensors", tensors)
        # the call arguments' names, and the kernel's own buffer names (its checks find buffers by name)
        taken = {"q", "k", "v", "o", "lse", "key_lo", "key_hi", "alibi_slopes", "sinks", "kv_start", "k_scale",
                 "v_scale", "k_new", "v_new", "kv_new", "custom_mask", "mask_indptr", "CM", "MI", "Q", "K", "V",
                 "O", "LSE", "BT", "CL", "AL", "SK", "KST", "CQ", "CK"} | {a.name for a in self.layout_info.args}
        clash = [t[0] for t in tensors if t[0] in taken]
        if clash:
            raise SpecError(f"mod_tensors: {clash[0]!r} is the name of another argument")
        for kind in ("score_mod", "mask_mod"):
            fn = getattr(self, kind)
            if fn is None:
                continue
            text = modifiers.source_of(fn, kind)
            modifiers.check_source(text, kind, tuple(t[0] for t in tensors))
            object.__setattr__(self, kind, text)
        if tensors and self.score_mod is None and self.mask_mod is None:
            raise SpecError("mod_tensors: no score_mod or mask_mod reads them")

    @property
    def has_modifiers(self) -> bool:
        """Whether user-written modifiers, key bounds or a custom mask decide visibility or
        scores: a row then outputs zeros when no key is left with a score above -inf
        (modifiers.py)."""
        return self.score_mod is not None or self.mask_mod is not None or self.key_bounds or self.custom_mask

    @property
    def variants(self) -> tuple[str, ...]:
        """The variants this spec turns on (``window``, ``softcap``, ``alibi``, ``sinks``,
        ``kv_start``, ``score_mod``, ``mask_mod``, ``key_bounds``, ``custom_mask``), in that order: what a family
        that builds none of them refuses by name."""
        return tuple(n for n in VARIANTS if getattr(self, n) not in (None, False))

    # -- shapes -------------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    @property
    def kv_offset(self) -> int:
        """Query row i sits at key position ``i + kv_offset`` (bottom-right; see visibility.py)."""
        return Visibility.offset(self.seq_q, self.seq_kv)

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.seq_q, self.head_dim)

    @property
    def v_dim(self) -> int:
        """The head size of v and o: ``head_dim_v``, else ``head_dim``."""
        return self.head_dim_v or self.head_dim

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """The shape of k (bhsd; v's is :attr:`v_shape`)."""
        return (self.batch, self.kv_heads, self.seq_kv, self.head_dim)

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.seq_kv, self.v_dim)

    @property
    def o_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.seq_q, self.v_dim)

    def arg_specs(self) -> list[dict[str, Any]]:
        """The kernel's arguments in call order (the layout's; bhsd: q, k, v, then the output
        buffer o), each ``{name, shape, dtype}``; a symbolic dim is written as its name."""
        return self.layout_info.arg_specs(self)

    @property
    def layout_info(self):
        """The :class:`tvm_attention.layouts.Layout` entry of ``layout``."""
        return get_layout(self.layout)

    @property
    def is_dynamic(self) -> bool:
        return bool(self.dynamic)

    def representative(self) -> "AttentionSpec":
        """The static BHSD spec of the representative shape: what a dynamic build validates,
        times and is tuned at (its tuning log is that spec's)."""
        return dataclasses.replace(self, layout="bhsd", dynamic=(), return_lse=False, page_size=None, append=False,
                                   device_checks=False)

    # -- models ----------------------------------------------------------------------------------
    def visible_pairs(self) -> int:
        """Number of (query, key) pairs that are not masked, per (batch, head)."""
        return Visibility.of(self).pairs(self.seq_q, self.seq_kv)

    def flops(self) -> float:
        """Conventional attention FLOPs: 4·B·H·Sq·Skv·D, halved for causal (the usual benchmark
        convention of FlashAttention and Triton, used for every GFLOP/s we print); with a
        sliding window 4·B·H·D per visible pair (the window's work, as FlashAttention counts it).
        With ``head_dim_v``, ``4·D`` is ``2·(head_dim + head_dim_v)``: QKᵀ and PV each."""
        per_pair = 2.0 * (self.head_dim + self.v_dim)
        if self.window is not None:
            return per_pair * self.batch * self.heads * self.visible_pairs()
        f = per_pair * self.batch * self.heads * self.seq_q * self.seq_kv
        return f / 2 if self.causal else f

    @property
    def np_dtype(self):
        """The NumPy dtype of q, k, v and o (bfloat16 through ml_dtypes, which TVM installs)."""
        return numpy_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes of one element of o (and of q unless ``q_dtype``, of K/V unless ``kv_dtype``, is 8-bit)."""
        return {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    @property
    def q_dtype_name(self) -> str:
        """The dtype of q as stored: ``q_dtype``, else ``dtype``."""
        return self.q_dtype or self.dtype

    @property
    def q_itemsize(self) -> int:
        """Bytes of one q element as stored."""
        return 1 if self.q_dtype is not None else self.itemsize

    @property
    def kv_quantized(self) -> bool:
        """Whether K/V are an 8-bit cache with scales (``kv_dtype``; how fine: ``kv_scale``)."""
        return self.kv_dtype is not None

    @property
    def scale_groups(self) -> int:
        """Scales per (token, kv head) of an 8-bit cache scaled finer than per head: 1 per
        token, ``head_dim / 32`` per group (``kv_scale``); 0 with per-head scales."""
        return {"head": 0, "token": 1, "group": self.head_dim // SCALE_GROUP}[self.kv_scale]

    @property
    def v_scale_groups(self) -> int:
        """:attr:`scale_groups` of V: per group ``head_dim_v / 32``."""
        return {"head": 0, "token": 1, "group": self.v_dim // SCALE_GROUP}[self.kv_scale]

    @property
    def kv_dtype_name(self) -> str:
        """The dtype of K/V as stored: ``kv_dtype``, else ``dtype``."""
        return self.kv_dtype or self.dtype

    @property
    def kv_np_dtype(self):
        """The NumPy dtype of K/V (float8 through ml_dtypes)."""
        return numpy_dtype(self.kv_dtype_name)

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one K/V element as stored."""
        return 1 if self.kv_quantized else self.itemsize

    def io_bytes(self) -> int:
        """Modeled DRAM bytes of a fused kernel: q, k, v (and per-token or per-group scales) read
        and o written once."""
        rows = self.batch * self.heads * self.seq_q  # q read, o written
        kv = self.batch * self.kv_heads * self.seq_kv * (self.head_dim + self.v_dim)
        groups = self.scale_groups + self.v_scale_groups
        scales = self.batch * self.kv_heads * self.seq_kv * groups * 4  # float32, kv_scale
        return (rows * (self.head_dim * self.q_itemsize + self.v_dim * self.itemsize) + kv * self.kv_itemsize
                + scales)

    #: Passes over the S×S matrix a materialized implementation makes through memory: write S,
    #: read it for the row max, the row sum and the softmax, write P, read P for P·V.
    MATERIALIZED_SCORE_PASSES = 6

    def materialized_bytes(self) -> int:
        """Modeled DRAM bytes of a materialized implementation: q, k, v, o plus
        ``MATERIALIZED_SCORE_PASSES`` float32 passes over every (batch, head) score matrix."""
        scores = self.batch * self.heads * self.seq_q * self.seq_kv
        return self.io_bytes() + self.MATERIALIZED_SCORE_PASSES * 4 * scores

    def score_elements(self) -> int:
        """Elements of one (batch, head) score matrix: seq_q × seq_kv."""
        return self.seq_q * self.seq_kv

    # -- (de)serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dynamic"] = list(self.dynamic)
        # keys added after manifests existed are written only when set, so that older
        # manifests (and the tuning logs' spec files) still compare equal
        for key, default in (("return_lse", False), ("page_size", None), ("window", None), ("softcap", None),
                             ("alibi", False), ("sinks", False), ("kv_start", False), ("score_mod", None),
                             ("mask_mod", None), ("mod_tensors", ()), ("key_bounds", False), ("kv_dtype", None),
                             ("append", False), ("device_checks", False), ("qk_int8", False),
                             ("kv_scale", "head"), ("head_dim_v", None),
                             ("custom_mask", False), ("q_dtype", None)):
            if d[key] == default:
                del d[key]
        if "window" in d:
            d["window"] = list(d["window"])
        if "mod_tensors" in d:
            d["mod_tensors"] = [[n, t, list(dims)] for n, t, dims in self.mod_tensors]
        return d

    #: The exported library's function that returns :meth:`fingerprint` of the spec it was built from.
    SPEC_FUNCTION = "attention_spec_hash"

    def fingerprint(self) -> int:
        """A 63-bit hash of :meth:`to_dict` (canonical JSON, SHA-256): what an exported library
        returns from ``attention_spec_hash()``, so that a manifest whose spec was edited is
        refused instead of describing a kernel that computes something else."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AttentionSpec":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise SpecError(f"unknown spec field(s): {', '.join(sorted(unknown))}")
        d = dict(d)
        for key in ("dynamic", "window"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        return cls(**d)

    def short_name(self) -> str:
        """A filesystem-safe name, e.g. ``b1_h8_kv8_q1024_k1024_d64_float32_causal``; a symbolic
        dim reads ``dyn`` (``bdyn_h8_kv2_qdyn_kdyn_d64_float32_causal``) and another layout
        leads (``varlen_h8_kv2_d64_float32_causal``). Representative values are not part of it."""
        c = "causal" if self.causal else "full"
        kv = (f"_kv{KV_TAGS[self.kv_dtype]}{SCALE_TAGS[self.kv_scale]}{'_qk8' if self.qk_int8 else ''}"
              if self.kv_quantized else "")
        if self.q_dtype is not None:  # fp8 inputs: ..._bfloat16_qe4m3_kve4m3_causal
            kv = f"_q{KV_TAGS[self.q_dtype]}{kv}"
        dv = f"v{self.head_dim_v}" if self.head_dim_v is not None else ""
        tail = (f"_d{self.head_dim}{dv}_{self.dtype}{kv}_{c}{self.variant_suffix()}{'_lse' if self.return_lse else ''}"
                f"{'_append' if self.append else ''}{'_devchk' if self.device_checks else ''}")
        if self.layout != "bhsd":
            page = f"_p{self.page_size}" if self.page_size is not None else ""
            return f"{self.layout}{page}_h{self.heads}_kv{self.kv_heads}{tail}"

        def dim(name: str) -> str:
            return "dyn" if name in self.dynamic else str(getattr(self, name))

        return f"b{dim('batch')}_h{self.heads}_kv{self.kv_heads}_q{dim('seq_q')}_k{dim('seq_kv')}{tail}"

    def variant_suffix(self) -> str:
        """The variants' part of :meth:`short_name`: ``_w4095_0``, ``_cap30``, ``_alibi``..."""
        out = ""
        if self.window is not None:
            out += "_w" + "_".join("n" if x < 0 else str(x) for x in self.window)
        if self.softcap is not None:
            out += "_cap" + f"{self.softcap:g}".replace(".", "p").replace("+", "")
        out += "".join(f"_{n.replace('_', '')}" for n in ("alibi", "sinks", "kv_start") if getattr(self, n))
        if self.score_mod is not None or self.mask_mod is not None:
            out += "_mod" + modifiers.digest(self.score_mod, self.mask_mod, self.mod_tensors)
        return out + ("_kb" if self.key_bounds else "") + ("_cm" if self.custom_mask else "")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise SpecError(f"{name} must be positive, got {value}")


def numpy_dtype(name: str):
    import numpy as np

    if name == "bfloat16" or name.startswith("float8"):
        import ml_dtypes  # NumPy has no bfloat16 or float8 of its own; TVM installs ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)
