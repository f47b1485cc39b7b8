"""Attention as a differentiable torch function (issues 46 and 65).

``tvm_attention.torch.attention(q, k, v, causal=..., window=..., softcap=..., ...)`` runs our fused
forward (with ``lse``) and, under autograd, our fused backward (``tvm_attention.backward``): a
``torch.autograd.Function`` over a kernel pair built once per configuration, with symbolic batch
and lengths (the forward through the build cache, both kept for the process). Keyword names are the spec's fields. This step takes what the
backward builds: CPU float32 or bfloat16 tensors (bf16 gradients: float32 arithmetic, rounded
once), BHSD ``q (B, H, Sq, D)``, ``k (B, KH, Skv, D)``, ``v (B, KH, Skv, Dv)`` (or FlashAttention's
varlen form: :func:`attention_varlen`); causal, a window, a softcap, ALiBi (``alibi_slopes (H,)``, constants), sinks
(``sinks (H,)``, which take a gradient), ``kv_start (B,)`` int32 (each sequence's keys before it
hidden: left padding), key bounds, a custom mask and ``mask_mod`` (their zeros pass through),
``score_mod`` (differentiated; a float tensor it reads takes its gradient when it requires one).

CUDA tensors (float16 or bfloat16) run the CUDA pair instead, built in the process for the local
GPU (TVM and nvcc on it): the tensor-core forward with lse and the tensor-core backward
(``backward.build_backward`` with a CUDA target; the same variants, BHSD and varlen, a learned
bias's gradient), the data never leaving the GPU.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import SpecError
from .spec import AttentionSpec


class _Pairs:
    """``_pair(spec, grad_tensors, cache_dir)``: (forward kernel, backward kernel) of ``spec``
    (with ``return_lse``), built or loaded once per process; the backward also differentiates
    the modifier tensors ``grad_tensors``. ``cache_dir`` (:func:`backward_cache`) is where a miss
    finds or caches the backward's artifact; a pair in memory serves every caller."""

    def __init__(self):
        self.pairs: dict[tuple, tuple] = {}
        self.misses = 0
        self.lock = threading.Lock()

    def __call__(self, spec: AttentionSpec, grad_tensors: tuple[str, ...] = (), cache_dir: str | None = None,
                 device: str = "cpu"):
        key = (spec, tuple(grad_tensors), device)
        got = self.pairs.get(key)
        if got is None:
            from .artifact import kernel_of  # the compiler's side (imports TVM)
            from .build import build_kernel  # the compiler's side (imports TVM)

            with self.lock:  # one build per configuration, whichever thread asks first
                got = self.pairs.get(key)
                if got is None:
                    self.misses += 1
                    if device == "cuda":
                        got = self.pairs[key] = _cuda_pair(spec, tuple(grad_tensors))
                    else:
                        got = self.pairs[key] = (kernel_of(build_kernel(spec, cache=True)),
                                                 _cached_backward(spec, tuple(grad_tensors), cache_dir))
        return got

    def cache_clear(self) -> None:
        """Forget the pairs (the next call of each loads its backward from the disk cache)."""
        with self.lock:
            self.pairs.clear()


_pair = _Pairs()


def _cuda_pair(spec: AttentionSpec, grad_tensors: tuple[str, ...]):
    """The pair of ``spec`` for this machine's GPU (its arch: ``target.resolve_target("cuda")``):
    the CUDA forward (``--schedule fused``: tensor cores, with lse) and the tensor-core backward
    (``build_backward`` with a CUDA target), built in this process (TVM and nvcc on the GPU
    machine), kept for it; a learned bias (``grad_tensors``) takes its gradient there too."""
    from .artifact import kernel_of  # the compiler's side (imports TVM)
    from .backward import build_backward  # the compiler's side (imports TVM)
    from .build import build_kernel  # the compiler's side (imports TVM)
    from .target import resolve_target  # the local GPU's arch

    target = resolve_target("cuda")
    return kernel_of(build_kernel(spec, "fused", target=target, cache=True)), \
        build_backward(spec, target=target, grad_tensors=grad_tensors)


def device_of(q: torch.Tensor) -> str:
    """Where a call's pair runs: "cuda" for CUDA tensors (tensor cores, float16 or bfloat16), "cpu"
    otherwise."""
    return "cuda" if q.device.type == "cuda" else "cpu"


#: The modules besides the build cache's generators whose source decides a backward artifact:
#: editing one misses every artifact made before (the key holds their digest).
BACKWARD_GENERATORS = ("tvm_attention.backward", "tvm_attention.backward_artifact")
#: Bumped when a backward artifact's key changes meaning.
KEY_FORMAT = 2


def backward_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of the backward's cached artifacts: ``cache_dir`` when given, else
    ``tvm_attention.paths.cache_dir() / "backward"``."""
    from .paths import cache_dir as user_cache  # the per-user cache

    return Path(cache_dir).expanduser() if cache_dir is not None else user_cache() / "backward"


def backward_artifact_name(spec: AttentionSpec, grad_tensors: tuple[str, ...] = ()) -> str:
    """The folder name of ``spec``'s backward artifact in :func:`backward_cache`:
    ``<spec's short name>_<key>``, the key hashing the spec, the knobs, ``grad_tensors``, the
    target, the versions and the generators' sources (:data:`BACKWARD_GENERATORS` with the build
    cache's), so an edit of any of them misses every artifact made before."""
    import hashlib
    import json

    import tvm  # the compiler's side: its version is part of the key
    import tvm_ffi

    from .backward import default_knobs  # the compiler's side (imports TVM)
    from .build_cache import source_digest  # the generators' digest, as the build cache keys by
    from .target import resolve_target  # this CPU's target

    ident = {"format": KEY_FORMAT, "spec": spec.to_dict(), "knobs": dataclasses.asdict(default_knobs(spec)),
             "wrt": list(grad_tensors), "target": str(resolve_target("llvm")),
             "sources": source_digest(BACKWARD_GENERATORS), "tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__}
    return f"{spec.short_name()}_{hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]}"


def _cached_backward(spec: AttentionSpec, grad_tensors: tuple[str, ...], cache_dir: str | None = None):
    """The backward of ``spec`` from the on-disk cache, as the transformers backend keeps its
    artifacts: ``<backward_cache(cache_dir)>/<backward_artifact_name>/``, an exported and validated artifact
    (``tvm_attention.backward_artifact``) loaded in later processes without a rebuild. A hit
    must prove it is the backward asked for: its library's spec hash (``load_backward``) is this
    spec's, its knobs and differentiated tensors these; anything else is rebuilt, with a warning
    (``paths.load_or_build``). A cache folder that is not private (``paths.usable_cache``) is
    not used: the artifact goes to a temporary folder of this process."""
    from .backward import PARTIALS, build_backward, default_knobs  # the compiler's side (imports TVM)
    from .backward_artifact import export_backward, load_backward  # the artifact's two ends
    from .paths import load_or_build, usable_cache  # the cache of code: a private folder, checked hits

    knobs = default_knobs(spec)
    out = usable_cache(backward_cache(cache_dir), "the backward") / backward_artifact_name(spec, grad_tensors)

    def check(kernel) -> str | None:
        if kernel.spec.fingerprint() != spec.fingerprint():
            return f"its spec is {kernel.spec.short_name()} {kernel.spec.to_dict()}, not {spec.to_dict()}"
        if kernel.knobs != knobs:
            return f"its knobs are {dataclasses.asdict(kernel.knobs)}, not {dataclasses.asdict(knobs)}"
        wrt = tuple(n[2:-len(PARTIALS)] for n, _, _ in kernel.args if n.endswith(PARTIALS))
        if wrt != tuple(grad_tensors):
            return f"it differentiates {list(wrt)}, not {list(grad_tensors)}"
        return None

    kernel, _ = load_or_build(out, load_backward,
                              lambda o: export_backward(build_backward(spec, knobs, grad_tensors=grad_tensors), o),
                              check, "backward")
    return kernel


def spec_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "bhsd", **fields: Any) -> AttentionSpec:
    """The spec (``return_lse``) of a call: its head counts, head sizes and dtype, the spec
    ``fields`` given, and symbolic batch and lengths (:data:`DYNAMIC`; the representative shape
    is fixed, so one pair serves every shape; the shapes given are checked here). ``layout``:
    ``bhsd`` (``q (B, H, Sq, D)``, ``k``/``v (B, KH, Skv, D|Dv)``) or ``varlen`` (``q (total_q, H,
    D)``, ``k``/``v (total_k, KH, D|Dv)``)."""
    rank, form = (4, "(B, H, S, D)") if layout == "bhsd" else (3, "(total, H, D)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            raise SpecError(f"attention: {name} must be a {rank}-D torch tensor {form}, got "
                            f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))}")
        cuda = device_of(q) == "cuda"
        if cuda and (t.dtype not in _CUDA_DTYPES or t.dtype != q.dtype or t.device != q.device):
            raise SpecError(f"attention: {name} must be a float16 or bfloat16 tensor on {q.device} (tensor cores), "
                            f"q's dtype, got {t.dtype} on {t.device}")
        if not cuda and (t.dtype not in _DTYPES or t.dtype != q.dtype or t.device.type != "cpu"):
            raise SpecError(f"attention: {name} must be a CPU float32 or bfloat16 tensor, q's dtype (the "
                            f"backward's), got {t.dtype} on {t.device}")
    heads = -3 if layout == "bhsd" else -2  # the heads' axis
    shared = k.shape[:-1] == v.shape[:-1] and k.shape[-1] == q.shape[-1]
    if not shared or (layout == "bhsd" and k.shape[0] != q.shape[0]):
        raise SpecError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                        f"{layout} {form} (batch, kv heads and keys shared by k and v; q's and k's head size equal)")
    d, dv = q.shape[-1], v.shape[-1]
    return AttentionSpec(batch=1, heads=q.shape[heads], kv_heads=k.shape[heads], seq_q=REPRESENTATIVE_SEQ,
                         seq_kv=REPRESENTATIVE_SEQ, head_dim=d, head_dim_v=None if dv == d else dv,
                         dtype={**_DTYPES, **_CUDA_DTYPES}[q.dtype], return_lse=True, layout=layout,
                         dynamic=() if layout == "varlen" else DYNAMIC, **fields)


#: the dims a pair takes at call time: one build per configuration, whatever the batch and lengths
#: (the symbolic backward runs within 2 % of the static one: B1 H8 D64 S2k, 2 Zen 4 cores)
DYNAMIC = ("batch", "seq_q", "seq_kv")
#: the shape a pair's spec records (its builds' cache key and its knobs' choice; any shape runs)
REPRESENTATIVE_SEQ = 256


#: the dtypes the pair builds: float32 arithmetic, bf16 inputs and gradients rounded once
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
#: ... on CUDA tensors: the tensor-core forward and backward's
_CUDA_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def to_numpy(t: torch.Tensor):
    """``t`` as a NumPy array without a copy (bf16 as ml_dtypes', which NumPy lacks)."""
    t = t.detach().contiguous()
    if t.dtype != torch.bfloat16:
        return t.numpy()
    import ml_dtypes  # TVM's own dependency: loaded with the kernels

    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def _tensor_of(a) -> torch.Tensor:
    """A NumPy result as a tensor without a copy (ml_dtypes' bf16 through its bits)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, spec, extra, wrt, cache_dir, *tensors):
        """``extra``: the variants' other call arguments by name (no gradient), detached;
        ``tensors``: the modifier tensors named ``wrt``, which take a gradient. Every tensor the
        backward reads is saved with ``save_for_backward``, ``extra`` too: changed in place
        before ``backward()`` (``kv_start`` shifted, the mask's bits cleared), torch refuses it
        by name ("modified by an inplace operation") instead of differentiating other values."""
        fwd, _ = _pair(spec, wrt, cache_dir, device_of(q))
        args = dict(extra, **({"sinks": sinks.detach()} if spec.sinks else {}),
                    **{n: t.detach().contiguous() for n, t in zip(wrt, tensors)})
        if device_of(q) == "cuda":  # the variants' arrays beside the data (the kernels read them there)
            args = {n: t.to(q.device) for n, t in args.items()}
        o, lse = fwd(q.detach().contiguous(), k.detach().contiguous(), v.detach().contiguous(), **args)
        ctx.spec, ctx.extra_names, ctx.wrt, ctx.cache_dir = spec, tuple(extra), wrt, cache_dir
        ctx.save_for_backward(q, k, v, o, lse, sinks, *tensors, *extra.values())
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks, *rest = ctx.saved_tensors
        tensors, extra = rest[:len(ctx.wrt)], dict(zip(ctx.extra_names, rest[len(ctx.wrt):]))
        spec = ctx.spec
        _, bwd = _pair(spec, ctx.wrt, ctx.cache_dir, device_of(q))
        if device_of(q) == "cuda":  # tensors in, tensors out, on their device and torch's stream
            args = {n: t.to(q.device) for n, t in extra.items()}
            if spec.sinks:
                args["sinks"] = sinks.detach().to(q.device)
            args.update({n: t.detach().contiguous().to(q.device) for n, t in zip(ctx.wrt, tensors)})
            grads = list(bwd(q.detach().contiguous(), k.detach().contiguous(), v.detach().contiguous(), o, lse,
                             do.to(q.dtype).contiguous(), **args))
            if torch.is_grad_enabled():
                grads = list(_NoDoubleBackward.apply(*(g.requires_grad_() for g in grads)))
            return (grads[0], grads[1], grads[2], grads[3] if spec.sinks else None, None, None, None, None,
                    *(g.to(t.device) for g, t in zip(grads[3 + spec.sinks:], tensors)))
        arrays = [to_numpy(t.to(q.dtype) if t is do else t) for t in (q, k, v, o, lse, do)]
        args = {n: t.numpy() for n, t in extra.items()}
        args.update({n: to_numpy(t) for n, t in zip(ctx.wrt, tensors)})
        if spec.sinks:
            args["sinks"] = to_numpy(sinks)
        grads = [_tensor_of(np.ascontiguousarray(g)) for g in bwd(*arrays, **args)]
        if torch.is_grad_enabled():  # create_graph=True: the gradients must not pass for constants
            grads = list(_NoDoubleBackward.apply(*(g.requires_grad_() for g in grads)))
        dsinks = grads[3] if spec.sinks else None
        return (grads[0], grads[1], grads[2], dsinks, None, None, None, None, *grads[3 + spec.sinks:])


class _NoDoubleBackward(torch.autograd.Function):
    """The first-order gradients, as they are, under ``create_graph=True``; differentiating them
    again (a gradient penalty, a Hessian-vector product) raises by name. Without it they would be
    constants to autograd, and a second-order term silently zero."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(
            "tvm_attention.torch.attention: the gradient of its gradient (double backward: create_graph=True, then "
            "a backward through dq, dk, dv or dsinks) is not implemented; the fused backward is first-order only. "
            "Use eager attention for second-order terms")


def _tensor(name: str, t: Any, shape: tuple | None, dtype: torch.dtype) -> torch.Tensor:
    """``t`` checked (a tensor of ``dtype``, ``shape`` where given; a CPU one, or a CUDA one for a
    call on CUDA tensors, which moves it beside them), detached and contiguous."""
    if (not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type not in ("cpu", "cuda")
            or (shape is not None and tuple(t.shape) != shape)):
        raise SpecError(f"attention: {name} must be a tensor of {str(dtype).removeprefix('torch.')} "
                        f"{shape if shape is not None else ''}, got {getattr(t, 'dtype', type(t).__name__)} "
                        f"{tuple(getattr(t, 'shape', ()))}".replace("  ", " "))
    return t.detach().contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              window: tuple[int, int] | None = None, softcap: float | None = None, scale: float | None = None,
              alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              kv_start: torch.Tensor | None = None, key_lo: torch.Tensor | None = None,
              key_hi: torch.Tensor | None = None, custom_mask: Any = None, score_mod: Any = None,
              mask_mod: Any = None, mod_tensors: dict[str, torch.Tensor] | None = None,
              cache_dir: str | os.PathLike | None = None) -> torch.Tensor:
    """``o (B, H, Sq, Dv)`` of ``softmax(q·kᵀ·scale + mask)·v``, differentiable in ``q``, ``k``,
    ``v`` and ``sinks`` (the module docstring). The variants' arguments, as the spec's:
    ``alibi_slopes``/``sinks (H,)`` float32; ``kv_start (B,)`` int32; ``key_lo``/``key_hi (B,
    Skv)`` int32 (row at position p sees keys ``key_lo[b, p] ≤ j < key_hi[b, p]``); ``custom_mask``
    booleans ``(B, Sq, Skv)`` (True: visible) or FlashInfer's packed ``(bits uint8, mask_indptr
    int32)``; ``score_mod``/``mask_mod`` (functions or their source, ``tvm_attention.modifiers``;
    ``score_mod`` is differentiated, ``tvm_attention.modifier_grad``) over ``mod_tensors`` (name ->
    int32/float32 tensor; a float32 one of ``score_mod`` that requires a gradient, a learned bias,
    takes it). A row that sees no key outputs zeros and takes no gradient. ``cache_dir``: where
    the backward's artifact is cached (:func:`backward_cache`).

    The arguments the backward reads (``q``, ``k``, ``v``, ``sinks``, the index arrays, the
    mask's bits, the modifiers' tensors) are saved, not copied: changed in place before
    ``backward()``, torch refuses it ("modified by an inplace operation"). A gradient of the
    gradient (``create_graph=True``, then a backward through it) raises ``NotImplementedError``."""
    spec = spec_of(q, k, v, **_fields(causal, window, softcap, scale, alibi_slopes, sinks, kv_start, key_lo, key_hi,
                                      custom_mask, score_mod, mask_mod, mod_tensors))
    b, sq, skv = q.shape[0], q.shape[2], k.shape[2]  # the call's (the spec's are symbolic)
    extra = _extras(spec, b, skv, alibi_slopes, sinks, kv_start, key_lo, key_hi, mod_tensors)
    if custom_mask is not None:
        extra.update(_packed(custom_mask, (b, sq, skv)))
    wrt = _wrt(mod_tensors)
    return _Attention.apply(q, k, v, torch.zeros(0) if sinks is None else sinks, spec, extra, wrt,
                            None if cache_dir is None else str(cache_dir), *(mod_tensors[n] for n in wrt))


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, *, causal: bool = False, window: tuple[int, int] | None = None,
                     softcap: float | None = None, scale: float | None = None,
                     alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     key_lo: torch.Tensor | None = None, key_hi: torch.Tensor | None = None,
                     custom_mask: Any = None, score_mod: Any = None, mask_mod: Any = None,
                     mod_tensors: dict[str, torch.Tensor] | None = None,
                     cache_dir: str | os.PathLike | None = None) -> torch.Tensor:
    """FlashAttention's ``flash_attn_varlen_func``, differentiable: ``o (total_q, H, Dv)`` of
    sequences packed in ``q (total_q, H, D)``, ``k``/``v (total_k, KH, D|Dv)``, sequence ``b``'s
    rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` attending to its keys ``cu_seqlens_k[b]:…``
    (``(batch + 1,)`` int32; bottom-right causal per sequence). No key is read across sequences,
    no tile computed there. The variants as :func:`attention`'s (no ``kv_start``: the sequences
    hold no padding); a custom mask is FlashInfer's packed ``(bits, mask_indptr)`` of each
    sequence's ``(rows, keys)``; ``key_lo``/``key_hi (batch, positions)``."""
    spec = spec_of(q, k, v, layout="varlen", **_fields(causal, window, softcap, scale, alibi_slopes, sinks, None,
                                                       key_lo, key_hi, custom_mask, score_mod, mask_mod, mod_tensors))
    cq, ck = (_tensor(n, t, (len(t),) if isinstance(t, torch.Tensor) else None, torch.int32)
              for n, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)))
    if len(cq) != len(ck) or len(cq) < 1:
        raise SpecError(f"attention_varlen: cu_seqlens_q {tuple(cq.shape)} and cu_seqlens_k {tuple(ck.shape)} must "
                        "both hold batch + 1 offsets")
    extra = {"cu_seqlens_q": cq, "cu_seqlens_k": ck,
             **_extras(spec, len(cq) - 1, None, alibi_slopes, sinks, None, key_lo, key_hi, mod_tensors)}
    if custom_mask is not None:
        if not (isinstance(custom_mask, tuple) and len(custom_mask) == 2):
            raise SpecError("attention_varlen: custom_mask must be FlashInfer's packed (bits, mask_indptr) of each "
                            "sequence's (rows, keys) (tvm_attention.masks.pack_mask of a list)")
        extra.update(_packed(custom_mask, (len(cq) - 1, 0, 0)))
    wrt = _wrt(mod_tensors)
    return _Attention.apply(q, k, v, torch.zeros(0) if sinks is None else sinks, spec, extra, wrt,
                            None if cache_dir is None else str(cache_dir), *(mod_tensors[n] for n in wrt))


def _fields(causal, window, softcap, scale, alibi_slopes, sinks, kv_start, key_lo, key_hi, custom_mask, score_mod,
            mask_mod, mod_tensors) -> dict[str, Any]:
    """The spec's fields of a call's variant arguments (the modifiers' tensors declared by their
    dtypes and shapes)."""
    fields: dict[str, Any] = {"causal": causal, "window": window, "softcap": softcap,
                              "alibi": alibi_slopes is not None, "sinks": sinks is not None,
                              "kv_start": kv_start is not None, "key_bounds": key_lo is not None or key_hi is not None,
                              "custom_mask": custom_mask is not None}
    if scale is not None:
        fields["scale"] = scale
    tensors = dict(mod_tensors or {})
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is not None:
            fields[name] = mod
    if score_mod is not None or mask_mod is not None:
        fields["mod_tensors"] = tuple((n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                                      for n, t in tensors.items() if isinstance(t, torch.Tensor))
    elif tensors:
        raise SpecError("attention: mod_tensors given without a score_mod or mask_mod to read them")
    return fields


def _wrt(mod_tensors) -> tuple[str, ...]:
    """The modifier tensors that require a gradient (float32 tensors of a score_mod: the backward
    checks it, by name)."""
    return tuple(n for n, t in (mod_tensors or {}).items() if isinstance(t, torch.Tensor) and t.requires_grad)


def _extras(spec: AttentionSpec, b: int, skv: int | None, alibi_slopes, sinks, kv_start, key_lo, key_hi,
            mod_tensors) -> dict[str, torch.Tensor]:
    """The variants' call arguments but the custom mask, checked (``b`` sequences; key bounds of
    ``skv`` positions, any number where None)."""
    h, extra = spec.heads, {}
    if alibi_slopes is not None:
        extra["alibi_slopes"] = _tensor("alibi_slopes", alibi_slopes, (h,), torch.float32)
    if sinks is not None:
        _tensor("sinks", sinks, (h,), torch.float32)  # checked; passed apart: it takes a gradient
    if kv_start is not None:
        extra["kv_start"] = _tensor("kv_start", kv_start, (b,), torch.int32)
    if spec.key_bounds:
        if key_lo is None or key_hi is None:
            raise SpecError("attention: key bounds take both key_lo and key_hi")
        for name, t in (("key_lo", key_lo), ("key_hi", key_hi)):
            extra[name] = _tensor(name, t, (b, skv) if skv is not None else None, torch.int32)
    for name, t in (mod_tensors or {}).items():
        checked = _tensor(name, t, None, t.dtype if isinstance(t, torch.Tensor) else torch.int32)
        if name not in _wrt(mod_tensors):  # those passed apart: they take a gradient
            extra[name] = checked
    return extra


def _packed(mask: Any, shape: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """``custom_mask``/``mask_indptr`` of booleans ``shape`` ``(B, Sq, Skv)`` or of ``(bits,
    indptr)`` given (checked by the kernels before a byte is read)."""
    from .masks import pack_mask  # only custom masks need it

    if isinstance(mask, tuple) and len(mask) == 2:
        bits, indptr = mask
        return {"custom_mask": _tensor("custom_mask", bits, None, torch.uint8),
                "mask_indptr": _tensor("mask_indptr", indptr, (shape[0] + 1,), torch.int32)}
    mask = _tensor("custom_mask", mask, shape, torch.bool)
    bits, indptr = pack_mask(mask.cpu().numpy())
    return {"custom_mask": torch.from_numpy(bits), "mask_indptr": torch.from_numpy(indptr)}
