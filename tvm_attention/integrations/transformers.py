"""Hugging Face transformers attention backend: ``attn_implementation="tvm_attention"``.

::

    from tvm_attention.integrations.transformers import register

    register()                      # once per process; register(cache_dir=...) to choose the cache
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32,
                                                 attn_implementation="tvm_attention")
    # or, on a loaded model: model.set_attn_implementation("tvm_attention")
    model.generate(input_ids, max_new_tokens=32, do_sample=False)

Prefill and decode (a ``DynamicCache``: ``seq_q = 1`` against the grown cache) run through one
*dynamic* tvm-attention artifact per layer configuration — ``(heads, kv_heads, head_dim, dtype,
causal, scale, target)``; batch, ``seq_q`` and ``seq_kv`` are symbolic. With a ``StaticCache``
(``cache_implementation="static"``) the keys are a prefix of a preallocated cache: those calls
run the *kvcache* artifact of the configuration, which reads the cache in place and only the
keys in use (``cache_seqlens``) — where a bhsd kernel would need a mask and read every slot. A
decode step (one new token per sequence) takes the kernels' GQA-packed decode nest either way.
Artifacts are built on first use and
cached on disk in ``<cache>/artifacts/<key>/`` (``<cache>`` is ``register(cache_dir=...)``, else
``tvm_attention.paths.cache_dir()``: ``$TVM_ATTENTION_CACHE_DIR``, ``$XDG_CACHE_HOME/tvm-attention``
or ``~/.cache/tvm-attention``). The key names the configuration and target and ends in a hash of
the scale, versions and representative shape. Each configuration is loaded once per process;
another process loads the artifact from disk (``tvm_attention.load`` checks its SHA-256 and the
library's spec hash, and the spec must be the configuration's) and does not rebuild; a cached
artifact that does not load, or is another configuration's, is rebuilt, with a warning. Builders
of one key take a file lock, so concurrent processes build it once. The cache folder is private
(created 0700; one that another user owns or may write is not used: the artifacts then go to a
temporary folder of the process, with a warning), as the training path's backward artifacts are
(``<cache>/backward/`` with ``register(cache_dir=...)``, else ``tvm_attention.torch``'s default).

DeepSeek-V2/V3's latent attention arrives unabsorbed (transformers expands the cached latent
into per-head keys and values): a value head size unlike the key's is the configuration's
``head_dim_v``.

Semantics: ``softmax(q·kᵀ·scaling)·v`` with bottom-right causal masking when the module is causal
(what transformers' decode against a cache means), GQA done by the kernel (key/value keep their
``kv_heads``; nothing is repeated). The variants the models use are compiled in
(docs/transformers.md): a causal ``sliding_window = W`` (Mistral, Qwen2, Gemma-2, gpt-oss) is the
window ``(W − 1, 0)``, ``softcap`` (Gemma-2) the logit softcap, ``s_aux`` (gpt-oss) the sinks,
and a left-padded batch (zeros before each row's first token in the 2D ``attention_mask``) runs
with ``kv_start``: the pad keys are hidden, and the pad query rows output zeros (eager gives them
something; no real token reads them). Padding elsewhere (right padding, a hole: a zero after a
row's first token, e.g. a pad token inside a prompt given to ``generate()`` without an
attention_mask) runs the configuration's key-mask variant (``LayerConfig.key_mask``): a mask
modifier reading the 2D mask's columns of the keys handed over (``keep``), evaluated per score,
skipping no tile; only calls with such zeros take it. Any other mask (packed sequences, padding
in a non-causal model, an offset cache, a sliding window over a static cache not full yet, a 4-D
mask given to the model: a bidirectional prefix...) runs the configuration's custom-mask variant
(``LayerConfig.custom_mask``, non-causal: the mask's bits are the whole truth), booleans or an
additive mask of 0 and −inf, the same for every head. What the kernel cannot compute raises
:class:`UnsupportedAttention` naming the feature — never a silent fallback: an additive mask
holding other values (a bias), a mask per head, attention dropout > 0 (training mode), a
position bias, a dtype other than float32/bfloat16/float16 or a device other than the CPU. A bfloat16 model runs the bf16 kernels
(AVX512-BF16 dot products where the CPU has them). Training: a float32 or bfloat16 call whose inputs take
gradients runs :func:`tvm_attention.torch.attention` (the fused forward with ``lse`` and the fused
backward, one pair per configuration, symbolic in batch and lengths) with the module's variants and its mask (left padding as
``kv_start``, other padding as the key-mask modifier, a 4-D mask as custom bits), ``s_aux``
taking its gradient; what that backward does not build yet (float16, a static cache) runs the
forward, and ``backward`` through it raises naming it. A sliding layer's cache past its window (a prompt longer than the
window) hands over its last keys only, from ``kv_offset``: the keys still end at the last query,
so bottom-right alignment and the window are exact there too.

Masks: transformers builds one mask per forward (not per layer) through the mask function
registered under the implementation's name (``masking_utils.AttentionMaskInterface``). Ours
returns ``None`` for the plain causal (or full, or causal sliding-window) case — the kernel applies
it itself —, a tagged ``(batch, 1, 1, 2)`` int32 plan for a static cache's keys in use and a left
padding's ``kv_start`` (``(batch, 1, 1, 2 + keys)`` with other padding: the key mask after them),
and otherwise the boolean 4D mask ``sdpa_mask`` would build (tagged with why the plans cannot
say it), which the attention function packs into a custom mask (once per mask: the packed bits
are cached on it). Without a registered mask function
transformers would hand the attention ``None`` even for a padded batch
(``masking_utils._preprocess_mask_arguments`` exits early for unknown names), so padding would go
unnoticed: ``register`` registers both.

Threads: kernels use every available core (or ``register(num_threads=...)``), like PyTorch.
``register`` also sets ``TVM_THREAD_POOL_SPIN_COUNT=0`` unless it is set: TVM's workers would
otherwise busy-wait after each kernel and slow PyTorch's ops between attention calls.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from .. import __version__, load
from ..paths import cache_dir
from ..spec import DYNAMIC_DIMS, AttentionSpec, SpecError

NAME = "tvm_attention"
#: Subfolder of the tvm-attention cache holding the artifacts this backend builds.
ARTIFACTS = "artifacts"
#: Dimensions that are symbolic in every artifact built here: all of them.
DYNAMIC = DYNAMIC_DIMS
#: The representative shape a dynamic build is validated (and scheduled) at.
REPRESENTATIVE_BATCH = 1
REPRESENTATIVE_SEQ = 1024
#: Bump when what an artifact under a given key means changes.
KEY_FORMAT = 1
_MASK_REASON = "_tvm_attention_reason"
#: the key-mask variant's modifier (``LayerConfig(key_mask=True)``): key ``kv`` of sequence ``b``
#: is visible where the 2D attention_mask's column for it is not 0 (joined with causal, the window)
KEY_MASK_MOD = "lambda b, h, q, kv: keep[b, kv] != 0"
KEY_MASK_TENSORS = (("keep", "int32", ("batch", "seq_kv")),)
#: tags attention_mask's plan: a ``(batch, 1, 1, 2)`` int32 tensor of each sequence's keys in use
#: (a static cache's prefix) and first visible key (left padding), then, for padding that is not
#: left padding, the 2D mask's columns of the keys (``keep``); the tag says which are given
_PLAN = "_tvm_attention_plan"
SPIN_ENV = "TVM_THREAD_POOL_SPIN_COUNT"


#: torch dtypes the kernels take (inputs, cache and output; softmax and sums in float32)
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class UnsupportedAttention(NotImplementedError):
    """The attention call uses a feature the tvm_attention backend cannot compute."""


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """The static part of an attention layer: what one artifact serves. ``layout``: ``bhsd``
    (the keys are exactly the given ones: no cache, a ``DynamicCache``) or ``kvcache`` (the
    keys are a prefix of a preallocated cache, ``StaticCache``: the kernel reads only the
    ``cache_seqlens`` keys in use)."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    scale: float
    layout: str = "bhsd"
    #: the variants (docs/semantics.md): a causal sliding window's left bound (transformers'
    #: ``sliding_window = W`` is ``W - 1``), the logit softcap, sinks (``s_aux``), left padding
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    kv_start: bool = False
    #: a padding mask with zeros anywhere (holes, right padding): the mask modifier
    #: :data:`KEY_MASK_MOD` reads the 2D mask's columns of the keys handed over, ``keep (batch,
    #: keys) int32``, a call argument (evaluated per score: no tile is skipped)
    key_mask: bool = False
    #: the value head size where it differs from ``head_dim`` (DeepSeek's MLA, unabsorbed: query
    #: and key 192 columns, value and output 128); None when equal
    head_dim_v: int | None = None
    #: the call's 4-D mask as a custom mask (``custom_mask``, ``mask_indptr``: FlashInfer's packed
    #: bits of each sequence's (query, key) booleans): what the plans above cannot say (packed
    #: sequences, a bidirectional prefix, a 4-D mask given to the model); its bits hold the
    #: causality and the window, so such a configuration is built non-causal and windowless
    custom_mask: bool = False

    def spec(self):
        """The dynamic :class:`~tvm_attention.spec.AttentionSpec` built for this configuration
        (a kvcache one is represented by a decode step: one new token per sequence)."""
        seq_q = REPRESENTATIVE_SEQ if self.layout == "bhsd" else 1
        return AttentionSpec(batch=REPRESENTATIVE_BATCH, heads=self.heads, kv_heads=self.kv_heads,
                             seq_q=seq_q, seq_kv=REPRESENTATIVE_SEQ, head_dim=self.head_dim,
                             head_dim_v=self.head_dim_v, dtype=self.dtype, causal=self.causal, scale=self.scale,
                             dynamic=DYNAMIC,
                             layout=self.layout, window=None if self.window is None else (self.window, 0),
                             softcap=self.softcap, sinks=self.sinks, kv_start=self.kv_start,
                             custom_mask=self.custom_mask,
                             **(dict(mask_mod=KEY_MASK_MOD, mod_tensors=KEY_MASK_TENSORS) if self.key_mask else {}))

    @property
    def variants(self) -> dict[str, Any]:
        """The variants that are on, as the spec's fields (what a key records)."""
        return {k: v for k, v in (("window", self.window), ("softcap", self.softcap), ("sinks", self.sinks),
                                  ("kv_start", self.kv_start), ("key_mask", self.key_mask),
                                  ("custom_mask", self.custom_mask)) if v not in (None, False)}

    def key(self, target) -> str:
        """Folder name of this configuration's artifact for ``target`` (a ``tvm.target.Target``):
        ``h8_kv2_d64_float32_causal_<target key>_<hash>``; the hash covers the scale (exactly),
        the target, the dynamic dims and representative shape, and the tvm-attention and TVM
        versions."""
        import tvm

        from ..logs import target_key  # TVM loads only when a first artifact is built

        ident = {
            "format": KEY_FORMAT, "scale": float(self.scale).hex(), "target": str(target),
            "dynamic": list(DYNAMIC), "representative": [REPRESENTATIVE_BATCH, REPRESENTATIVE_SEQ],
            "tvm_attention": __version__, "tvm": tvm.__version__,
        }
        prefix = ""
        if self.layout != "bhsd":  # bhsd keys predate layouts: unchanged
            ident["layout"] = self.layout
            prefix = f"{self.layout}_"
        dims = f"d{self.head_dim}"
        if self.head_dim_v not in (None, self.head_dim):  # keys of equal head sizes: unchanged
            ident["head_dim_v"] = self.head_dim_v
            dims += f"v{self.head_dim_v}"
        if self.variants:  # keys of plain configurations predate the variants: unchanged
            ident["variants"] = {k: float(v).hex() if k == "softcap" else v for k, v in self.variants.items()}
        digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
        kind = "causal" if self.causal else "full"
        kind += self.spec().variant_suffix()
        return (f"{prefix}h{self.heads}_kv{self.kv_heads}_{dims}_{self.dtype}_{kind}_"
                f"{target_key(target)}_{digest}")


@dataclasses.dataclass
class _Settings:
    cache_dir: Path | None = None
    target: Any = "llvm"
    num_threads: int | None = None
    use_log: bool = False


@dataclasses.dataclass(eq=False)
class _BackendState:
    """Everything the backend keeps in this process, in one object (:data:`_STATE`): what
    :func:`register` set, the kernels loaded, the counters :func:`stats` reports. One place to
    read what a call depends on, and to reset it."""

    settings: _Settings = dataclasses.field(default_factory=_Settings)
    #: guards ``settings`` and ``kernels`` changes (a kernel is built once however many threads ask)
    lock: Any = dataclasses.field(default_factory=threading.RLock)
    #: (artifact root, config tuple) -> loaded kernel
    kernels: dict[tuple, Any] = dataclasses.field(default_factory=dict)
    #: repr(settings.target) -> resolved Target
    targets: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: (the environment variables the default root depends on, that root)
    root_memo: tuple = (None, None)
    stats: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"builds": 0, "loads": 0, "rebuilds": 0, "calls": 0})
    #: id(kernel) -> the same kernel run on one thread (:func:`_one_thread`)
    one_threaded: dict[int, Any] = dataclasses.field(default_factory=dict)
    #: the warnings given once per process (``output_attentions``)
    warned: set[str] = dataclasses.field(default_factory=set)
    #: the seam the attention function gets kernels through (tests substitute a fake one); None:
    #: :func:`kernel_for`
    kernel_factory: Callable[[LayerConfig], Any] | None = None


_STATE = _BackendState()

#: Below this many FLOPs (4·B·H·Sq·Skv·D: a decode step of a short context) a call runs on one
#: thread. Between PyTorch's ops TVM's pool sleeps, and waking it costs more than the work:
#: in greedy generation (8/2 heads, D=64, a 32-token context, 2 cores) a decode call took 122 µs
#: on 2 threads and 50 µs on 1 (the kernel alone: 5 µs with the pool awake). Prefill and long
#: contexts keep every thread; the switch happens at those phase changes only (17 µs each).
SMALL_CALL_FLOPS = 1 << 22


def _one_thread(kernel):
    """The same loaded kernel run on one thread (cached per kernel)."""
    single = _STATE.one_threaded.get(id(kernel))
    if single is None or single.function is not kernel.function:
        import copy

        single = copy.copy(kernel)
        single.num_threads = 1
        _STATE.one_threaded[id(kernel)] = single
    return single


# -- public API ----------------------------------------------------------------------------------

def register(cache_dir: str | os.PathLike | None = None, *, target: Any = "llvm",
             num_threads: int | None = None, use_log: bool = False, spin_count: int | None = 0) -> str:
    """Register ``"tvm_attention"`` with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface``; returns the name.

    ``cache_dir``: where artifacts live (default ``tvm_attention.paths.cache_dir() / "artifacts"``,
    which honours ``$TVM_ATTENTION_CACHE_DIR``). ``target``: the CPU target (default ``"llvm"``,
    this CPU). ``num_threads``: TVM threads per kernel call (default: every available core, or
    ``TVM_NUM_THREADS``). ``use_log``: let builds use a tuning log record (off: the hand schedule,
    a few seconds per configuration). Calling it again changes the settings; kernels already
    loaded in this process are dropped (the disk cache stays).

    ``spin_count``: sets ``TVM_THREAD_POOL_SPIN_COUNT`` unless the environment already does
    (``None``: leave it alone). TVM's pool workers otherwise busy-wait about 0.1 s after every
    kernel, taking cores from PyTorch's next ops (the projections and MLP between two attention
    calls); 0 makes them sleep at once. TVM reads it when its pool first runs, so it only acts
    if no TVM kernel has run in this process yet.
    """
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    if spin_count is not None:
        os.environ.setdefault(SPIN_ENV, str(int(spin_count)))
    new = _Settings(Path(cache_dir).expanduser() if cache_dir is not None else None, target, num_threads,
                    bool(use_log))
    with _STATE.lock:
        if new != _STATE.settings:
            _STATE.kernels.clear()
            _STATE.settings = new
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)
    return NAME


def artifact_root() -> Path:
    """The folder holding this backend's artifacts (``register(cache_dir=...)``, else
    ``tvm_attention.paths.cache_dir() / "artifacts"``)."""
    if _STATE.settings.cache_dir is not None:
        return _STATE.settings.cache_dir
    env = (os.environ.get("TVM_ATTENTION_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"))
    if _STATE.root_memo[0] != env:  # cheap on the hot path: two env reads and a compare
        _STATE.root_memo = (env, cache_dir() / ARTIFACTS)
    return _STATE.root_memo[1]


def stats() -> dict[str, int]:
    """Counters since the last :func:`reset_stats`: ``builds`` (artifacts built and exported,
    ``rebuilds`` of them replacing an unusable cached one), ``loads`` (artifacts loaded from the
    disk cache without building) and ``calls`` (attention calls served)."""
    return dict(_STATE.stats)


def reset_stats() -> None:
    for k in _STATE.stats:
        _STATE.stats[k] = 0


def clear_kernels() -> None:
    """Forget the kernels loaded in this process (the next call loads them from disk again)."""
    with _STATE.lock:
        _STATE.kernels.clear()


def resolved_target():
    """The ``tvm.target.Target`` artifacts are built for (resolved once per setting)."""
    from ..target import resolve_target  # the compiler loads only when a first artifact is built

    k = repr(_STATE.settings.target)
    t = _STATE.targets.get(k)
    if t is None:
        t = _STATE.targets[k] = resolve_target(_STATE.settings.target)
    return t


def artifact_dir(config: LayerConfig) -> Path:
    """Where ``config``'s artifact lives (or will)."""
    return artifact_root() / config.key(resolved_target())


def kernel_for(config: LayerConfig):
    """The kernel serving ``config``: loaded from the disk cache, or built, exported there and
    loaded. Callers go through the in-process cache (:func:`_get_kernel`) first. A cached
    artifact must load (the loader checks its files' SHA-256 and its library's spec hash) and be
    this configuration's spec; any other is rebuilt, with a warning, and the rebuilt library is
    the one that runs (each load runs a private copy: ``tvm_attention.runtime``). A cache folder
    that is not private (``tvm_attention.paths.usable_cache``) is not used: the artifact goes to
    a temporary folder of this process."""
    from ..paths import load_or_build, usable_cache  # the cache of code: a private folder, checked hits

    spec = config.spec()
    target = resolved_target()
    out = usable_cache(artifact_root(), "the attention kernel") / config.key(target)

    def check(kernel) -> str | None:
        got = AttentionSpec.from_dict(kernel.manifest["spec"])
        return None if got == spec else f"its manifest's spec {got} is not {spec}"

    kernel, how = load_or_build(out, lambda o: load(o, num_threads=_STATE.settings.num_threads),
                                lambda o: _build_into(spec, target, o), check, "artifact")
    _STATE.stats["loads" if how == "loaded" else "builds"] += 1
    _STATE.stats["rebuilds"] += how == "rebuilt"
    return kernel


# -- transformers hooks --------------------------------------------------------------------------

def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (the signature of ``sdpa_attention_forward``): query
    ``(B, H, Sq, D)``, key ``(B, KH, Skv, D)``, value ``(B, KH, Skv, Dv)`` → ``(attn_output
    (B, Sq, H, Dv), None)``. Dv may differ from D (DeepSeek-V2/V3's unabsorbed MLA: 192 and 128).

    With a ``StaticCache`` key/value are the whole preallocated cache ``(B, KH, max_cache_len,
    D)`` and :func:`attention_mask` hands over the keys in use as ``cache_seqlens`` (a tagged
    ``(B, 1, 1, 1)`` int32 tensor): the kvcache kernel reads only those, in place."""
    plan = getattr(attention_mask, _PLAN, None)
    packed = None
    if plan is None and attention_mask is not None and getattr(attention_mask, "ndim", 0) == 4:
        packed = _custom_mask_of(attention_mask, query, key)  # every visible pair in its bits
    _check_supported(module, query, key, value, None if plan is not None or packed is not None else attention_mask,
                     dropout, kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    head_dim = query.shape[-1]
    scale = float(scaling) if scaling is not None else head_dim ** -0.5
    cache_seqlens = attention_mask[:, 0, 0, 0] if plan is not None and plan["in_use"] else None
    kv_start = attention_mask[:, 0, 0, 1] if plan is not None and plan["kv_start"] else None
    keep = attention_mask[:, 0, 0, 2:] if plan is not None and plan["keep"] else None
    window, softcap, sinks = _variants_of(module, causal, kwargs)
    if packed is not None:  # the bits hold causality and the window
        causal, window = False, None
    training = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, kwargs.get("s_aux")))
    why = training and _no_backward(query, cache_seqlens)
    if training and not why:  # the fused backward (tvm_attention.torch): one pair per configuration
        from ..torch import attention as differentiable  # only training calls need it

        s_aux = kwargs.get("s_aux")
        masks = {}
        if keep is not None:  # right padding, holes: the key-mask modifier over the 2D mask's columns
            masks = dict(mask_mod=KEY_MASK_MOD, mod_tensors={"keep": keep.to(torch.int32).contiguous()})
        if packed is not None:  # a 4-D mask's bits (they hold causality and the window)
            masks["custom_mask"] = packed
        mine = _STATE.settings.cache_dir  # register(cache_dir=): the backward's artifacts go there too
        out = differentiable(query, key, value, causal=causal, window=None if window is None else (window, 0),
                             softcap=softcap, scale=scale, sinks=None if s_aux is None else s_aux.reshape(-1).float(),
                             kv_start=None if kv_start is None else kv_start.to(torch.int32).contiguous(),
                             cache_dir=None if mine is None else mine / "backward", **masks)
        _STATE.stats["calls"] += 1
        return out.transpose(1, 2).contiguous(), None
    cfg = (query.shape[1], key.shape[1], head_dim, _DTYPES[query.dtype], causal, scale)
    head_dim_v = value.shape[-1] if value.shape[-1] != head_dim else None
    # the fields after layout, in LayerConfig's order: the variants, then the value head size
    variants = (window, softcap, sinks is not None, kv_start is not None, keep is not None, head_dim_v,
                packed is not None)
    if cache_seqlens is None and (artifact_root(), cfg + ("kvcache",) + variants) in _STATE.kernels:
        # every key is in use (a static cache that is full, e.g. generate's last step): the
        # kvcache kernel already loaded computes the same, with no build of the bhsd one
        cache_seqlens = torch.full((query.shape[0],), key.shape[2], dtype=torch.int32)
    try:
        kernel = _get_kernel(cfg + ("bhsd" if cache_seqlens is None else "kvcache",) + variants)
    except SpecError as e:  # a shape or scale the kernels do not take (head_dim > 512...)
        raise _unsupported("this attention configuration", str(e).rstrip("."), _OTHER) from None
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    if 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3] < SMALL_CALL_FLOPS:
        kernel = _one_thread(kernel)  # a decode step: runs in this thread, no pool to wake
    # the layout's index array, then the variants' arguments (sinks, kv_start), then the key
    # mask's tensor (the modifier's), in call order
    extra = tuple(x.contiguous() for x in (cache_seqlens, sinks, kv_start, *(packed or ()), keep) if x is not None)
    if training:  # what the backward does not build yet: the forward runs, backward() says why
        out = _NoBackward.apply(kernel, why, q, k, v, *extra)
    else:
        out = kernel(q, k, v, *extra)
    _STATE.stats["calls"] += 1
    return out.transpose(1, 2).contiguous(), None


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers mask function (``AttentionMaskInterface``; the signature of
    ``masking_utils.sdpa_mask``). ``None`` when the kernel's own masking is exact: a plain
    causal pattern whose keys end at the last query (bottom-right: a ``DynamicCache`` or no
    cache), or a plain full pattern, and no padding in the keys' window of the 2D
    ``attention_mask``. A causal pattern over a prefix of the keys (a ``StaticCache``: keys
    ``[0, q_offset + q_length)`` of ``kv_length`` slots are in use) gives those lengths as a
    ``(batch, 1, 1, 1)`` int32 tensor tagged for the attention function, which then runs the
    kvcache kernel. Left padding adds each row's ``kv_start``; other zeros in the 2D mask (right
    padding, holes) add its columns of the keys for the key-mask variant. Otherwise the boolean
    4D mask ``sdpa_mask`` builds, tagged with why, which the attention function serves as a
    custom mask."""
    from transformers import masking_utils as mu

    if mask_function is None:
        mask_function = mu.causal_mask_function
    reason, in_use, kv_start, keep = _mask_plan(q_length, kv_length, q_offset, kv_offset, mask_function,
                                                attention_mask, local_size)
    if reason is None and (in_use is not None or kv_start is not None or keep is not None):
        # 4-D, so that transformers passes it on untouched (generate prepares the masks of a
        # static cache before the forward, which then treats any 4-D mask as ready); a key mask
        # rides in the columns after the first two
        plan = torch.zeros((batch_size, 1, 1, 2 + (0 if keep is None else keep.shape[1])), dtype=torch.int32)
        plan[:, 0, 0, 0] = kv_length if in_use is None else in_use
        if kv_start is not None:
            plan[:, 0, 0, 1] = kv_start
        if keep is not None:
            plan[:, 0, 0, 2:] = keep
        setattr(plan, _PLAN, {"in_use": in_use is not None, "kv_start": kv_start is not None,
                              "keep": keep is not None})
        return plan
    if reason is None:
        return None
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    mask = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        local_size=local_size, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                        **kwargs)
    if mask is None:  # pragma: no cover - sdpa_mask materializes when no skip is allowed
        mask = torch.zeros((batch_size, 1, q_length, kv_length), dtype=torch.bool)
    with contextlib.suppress(AttributeError, TypeError):
        setattr(mask, _MASK_REASON, reason)
    return mask


# -- internals -----------------------------------------------------------------------------------

def _get_kernel(cfg: tuple):
    """The in-process cache in front of ``_STATE.kernel_factory`` (hot path: one dict lookup)."""
    k = (artifact_root(), cfg)
    kernel = _STATE.kernels.get(k)
    if kernel is None:
        with _STATE.lock:
            kernel = _STATE.kernels.get(k)
            if kernel is None:
                kernel = _STATE.kernels[k] = (_STATE.kernel_factory or kernel_for)(LayerConfig(*cfg))
    return kernel


def _unsupported(feature: str, detail: str, hint: str) -> UnsupportedAttention:
    return UnsupportedAttention(f"tvm_attention does not support {feature}: {detail}. {hint[:1].upper()}{hint[1:]}.")


_OTHER = 'use attn_implementation="sdpa" (or "eager") for this model or call'


def _variants_of(module, causal: bool, kwargs) -> tuple[int | None, float | None, torch.Tensor | None]:
    """``(window left bound, softcap, sinks as float32 (H,))`` of the call: transformers'
    ``sliding_window = W`` (keys ``j > p − W``) is the window ``(W − 1, 0)``; ``s_aux`` are
    gpt-oss's sinks."""
    w = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    window = None
    if w is not None:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise _unsupported("this sliding window", f"sliding_window={w!r} (expected a positive int)", _OTHER)
        if not causal:
            raise _unsupported("bidirectional sliding-window attention", f"sliding_window={w} on a non-causal "
                               "module", _OTHER)
        window = w - 1
    c = kwargs.get("softcap")
    softcap = float(c) if c else None
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).reshape(-1)
    return window, softcap, sinks


#: the packed bits of a 4-D mask, cached on the mask: transformers hands one mask to every layer
_PACKED = "_tvm_attention_packed"


def _custom_mask_of(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(custom_mask, mask_indptr)`` of a 4-D attention mask ``(batch or 1, heads or 1, q, keys)``:
    booleans (True: visible) or an additive mask of 0 and −inf, the same for every head; else
    :class:`UnsupportedAttention` naming what it holds (a bias: other additive values; a mask per
    head)."""
    from ..masks import pack_mask  # only calls with a 4-D mask need it

    cached = getattr(mask, _PACKED, None)
    if cached is not None:
        return cached
    batch, rows, keys = query.shape[0], query.shape[2], key.shape[2]
    if mask.dtype == torch.bool:
        seen = mask
    elif mask.is_floating_point():
        seen = mask == 0
        if not bool((seen | torch.isneginf(mask)).all()):
            raise _unsupported("this additive attention mask", "it holds values other than 0 and -inf (a bias, or "
                               "the dtype's minimum instead of -inf)", _OTHER)
    else:
        raise _unsupported("this attention mask", f"a 4-D mask of {mask.dtype} (expected bool, or float 0/-inf)",
                           _OTHER)
    if seen.shape[-2:] != (rows, keys) or seen.shape[0] not in (1, batch):
        raise _unsupported("this attention mask", f"shape {tuple(seen.shape)} for {batch} sequences of {rows} queries "
                           f"and {keys} keys", _OTHER)
    if seen.shape[1] > 1 and not bool((seen == seen[:, :1]).all()):
        raise _unsupported("a per-head attention mask", f"its {seen.shape[1]} heads differ", _OTHER)
    packed, indptr = pack_mask(seen[:, 0].expand(batch, rows, keys).cpu().numpy())
    out = (torch.from_numpy(packed), torch.from_numpy(indptr))
    with contextlib.suppress(AttributeError, TypeError):
        setattr(mask, _PACKED, out)
    return out


def _check_supported(module, query, key, value, mask, dropout, kwargs) -> None:
    """Raise :class:`UnsupportedAttention` naming the first feature the kernel cannot compute."""
    sinks = kwargs.get("s_aux")
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise _unsupported("these attention sinks", f"s_aux has shape {tuple(sinks.shape)}, not one per query "
                           f"head ({query.shape[1]},)", _OTHER)
    if kwargs.get("position_bias") is not None:
        raise _unsupported("an additive position bias", "position_bias is set", _OTHER)
    if any(kwargs.get(n) is not None for n in ("cu_seq_lens_q", "cu_seq_lens_k")):
        raise _unsupported("packed sequences", "cu_seq_lens_q/cu_seq_lens_k are set",
                           "pass one sequence per batch row, or " + _OTHER)
    if dropout:
        raise _unsupported("attention dropout", f"dropout={dropout} (the module is in training mode)",
                           "call model.eval(), or set the config's attention_dropout to 0")
    if mask is not None:
        reason = getattr(mask, _MASK_REASON, None) or (
            f"a custom {getattr(mask, 'ndim', '?')}-D attention mask of shape {tuple(getattr(mask, 'shape', ()))}"
        )
        raise _unsupported(
            "attention masks other than plain causal", reason,
            "The kernel applies bottom-right causal masking itself; batch only equal-length prompts "
            "without padding (or generate them one at a time), or " + _OTHER)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.device.type != "cpu":
            raise _unsupported(f"{t.device.type} tensors", f"{name} is on {t.device}",
                               "this backend runs on the CPU: move the model there")
        if t.dtype not in _DTYPES or t.dtype != query.dtype:
            raise _unsupported(f"dtype {str(t.dtype).removeprefix('torch.')} on CPU",
                               f"{name} is {t.dtype}, query {query.dtype}",
                               "load the model in float32, bfloat16 or float16 (one dtype for all of it)")
        if t.dim() != 4:
            raise _unsupported("this tensor layout", f"{name} has shape {tuple(t.shape)}, not (B, H, S, D)", _OTHER)
    if key.shape[:-1] != value.shape[:-1] or key.shape[0] != query.shape[0] or key.shape[-1] != query.shape[-1]:
        raise _unsupported("these shapes", f"query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                           f"{tuple(value.shape)} (key and value must match but for value's head size, with "
                           "query's batch and head_dim)", _OTHER)
    if query.shape[1] % key.shape[1]:
        raise _unsupported("this head grouping", f"{query.shape[1]} query heads over {key.shape[1]} kv heads",
                           _OTHER)
    if kwargs.get("output_attentions") and "output_attentions" not in _STATE.warned:
        _STATE.warned.add("output_attentions")
        warnings.warn("tvm_attention does not return attention weights (output_attentions=True): they are None",
                      UserWarning, stacklevel=3)


def _mask_plan(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
               local_size) -> tuple[str | None, int | None, torch.Tensor | None, torch.Tensor | None]:
    """``(why the kernel's own masking would not be exact or None, keys in use, kv_start, keep)``:
    keys in use is None when all ``kv_length`` keys are (bhsd), else the length of the cache
    prefix the queries see (a static cache: the kvcache kernel's ``cache_seqlens``); kv_start is
    each row's count of leading zeros in the 2D ``attention_mask`` (left padding), None when it
    has none, counted from the first key handed over (``kv_offset``); keep, when the mask has a
    zero after a row's first token (right padding, a hole: what kv_start cannot express), is the
    mask's columns of the keys handed over (``(batch, keys in use)`` int32, from ``kv_offset``),
    for the key-mask variant — then kv_start is None (keep hides leading zeros too). A causal
    sliding-window pattern (``local_size = W``: keys ``j > p − W``) is exact too: the attention function takes
    the window from its ``sliding_window`` argument, also over the last keys a sliding cache
    keeps (``kv_offset > 0``)."""
    from transformers import masking_utils as mu

    in_use = None
    sliding = mask_function is not mu.causal_mask_function and mask_function is not mu.bidirectional_mask_function \
        and local_size is not None
    if sliding:
        why = _not_sliding_causal(mask_function, q_length, kv_length, q_offset, kv_offset, local_size)
        if why is not None:
            return why, None, None, None
    if mask_function is mu.causal_mask_function or sliding:
        if isinstance(q_offset, torch.Tensor):
            q_offset = int(q_offset)
        end = q_offset + q_length  # the last query's position + 1: the keys it may see
        # The keys must end at the last query but may start after position 0: a sliding layer's
        # cache past its window (DynamicSlidingWindowLayer, a full StaticSlidingWindowLayer) hands
        # over its last W − 1 keys and the new ones, key j at position kv_offset + j. Bottom-right
        # alignment puts row i at i + (kv_length − q_length) in that index, its position minus
        # kv_offset, so the kernel's window (W − 1, 0) sees exactly the keys p − W < j ≤ p, and
        # kv_start counts the padding from kv_offset (below).
        if kv_offset == 0 and q_offset >= 0 and end < kv_length:
            if sliding:
                return (f"a sliding window (window {local_size}) over a static cache that is not full yet "
                        f"({end} of its {kv_length} slots in use: a prompt or first prefill chunk shorter "
                        "than the window)"), None, None, None
            in_use = end  # a static cache: slots past the last query are empty
        elif end != kv_offset + kv_length:
            return (f"the keys do not end at the last query (q_offset={q_offset}, q_length={q_length}, "
                    f"kv_offset={kv_offset}, kv_length={kv_length}: an offset cache)"), None, None, None
    elif mask_function is not mu.bidirectional_mask_function:
        return ("a mask pattern other than causal (packed sequences, an overlay or a custom mask function)",
                None, None, None)
    if attention_mask is None:
        return None, in_use, None, None
    if attention_mask.dim() != 2:
        return f"a {attention_mask.dim()}-D attention mask", None, None, None
    want = kv_length if in_use is None else in_use
    window = attention_mask[:, kv_offset:kv_offset + want].bool()
    if window.shape[-1] < want:
        return f"the 2-D attention_mask covers {window.shape[-1]} of {want} keys", None, None, None
    if bool(window.all()):
        return None, in_use, None, None
    if mask_function is mu.bidirectional_mask_function:
        return "padding (the attention_mask has zeros) in a non-causal model", None, None, None
    # left padding: each row's zeros come before its first token, and are hidden by kv_start
    lead = torch.where(window.any(dim=1), window.int().argmax(dim=1), torch.tensor(want))
    if not bool((window == (torch.arange(want)[None, :] >= lead[:, None])).all()):
        # Zeros after a row's first token: right padding, or a hole — often no padding at all:
        # generate() without an attention_mask makes one from pad_token_id when the prompt holds
        # that token (Gemma-2's is 0), and eager attends around it. kv_start (a prefix) cannot
        # express it: the key-mask variant reads these columns per score instead.
        return None, in_use, None, window.to(torch.int32).contiguous()
    return None, in_use, lead.to(torch.int32), None


def _not_sliding_causal(mask_function, q_length, kv_length, q_offset, kv_offset, w) -> str | None:
    """Why ``mask_function`` is not the causal sliding window ``kv > q − w``, ``kv ≤ q`` (None: it
    is): evaluated on the call's positions (every query row, or 64 of them for a long call)."""
    if isinstance(q_offset, torch.Tensor):
        q_offset = int(q_offset)
    rows = torch.arange(q_length)
    if q_length * kv_length > 1 << 20:
        rows = torch.unique(torch.linspace(0, q_length - 1, 64).long())
    q = (q_offset + rows)[:, None]
    kv = (kv_offset + torch.arange(kv_length))[None, :]
    want = (kv <= q) & (kv > q - w)
    try:
        got = mask_function(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, kv)
        got = torch.as_tensor(got).expand_as(want)
    except Exception as e:  # noqa: BLE001 - a mask function that takes no tensors: not ours to read
        return f"a mask with local_size={w} that cannot be read ({type(e).__name__})"
    if not bool((got == want).all()):
        return f"a sliding-window or chunked mask (window {w}) other than causal kv > q - {w}"
    return None


def _no_backward(query, cache_seqlens) -> str:
    """Why the fused backward cannot serve a training call ('' when it can): it builds float32 and
    bfloat16 BHSD attention with the module's variants and every mask the forward takes but a
    static cache's."""
    if query.dtype not in (torch.float32, torch.bfloat16):
        return f"{str(query.dtype).removeprefix('torch.')} (the backward builds float32 and bfloat16)"
    if cache_seqlens is not None:
        return "a static cache's keys in use (the backward builds the keys handed over, all of them)"
    return ""


class _NoBackward(torch.autograd.Function):
    """Runs the kernel under autograd where the fused backward does not serve the call
    (:func:`_no_backward` says why), so ``backward`` raises naming it."""

    @staticmethod
    def forward(ctx, kernel, why, q, k, v, *index):
        ctx.why = why
        return kernel(q.detach(), k.detach(), v.detach(), *index)

    @staticmethod
    def backward(ctx, grad):
        raise _unsupported("backward passes with " + ctx.why.split(" (")[0], ctx.why,
                           "train with attn_implementation=\"sdpa\"")




def _build_into(spec, target, out: Path) -> None:
    """Build ``spec`` for ``target`` (hand schedule unless ``use_log``), validate it against the
    NumPy reference at the representative shape, and export it atomically to ``out``."""
    from ..artifact import export  # the compiler loads only when a first artifact is built
    from ..pipeline import build_best  # the compiler loads only when a first artifact is built

    built, validation = build_best(spec, target=target, use_log=_STATE.settings.use_log, say=lambda m: None,
                                   cache=True)
    export(built, out, validation)
