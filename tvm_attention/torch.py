"""Attention as a differentiable torch function (issue 46, first step).

``tvm_attention.torch.attention(q, k, v, causal=..., window=..., softcap=..., ...)`` runs our fused
forward (with ``lse``) and, under autograd, our fused backward (``tvm_attention.backward``): a
``torch.autograd.Function`` over a kernel pair built once per spec (the forward through the build
cache, both kept for the process). Keyword names are the spec's fields. This step takes what the
backward builds: CPU float32 BHSD tensors ``q (B, H, Sq, D)``, ``k (B, KH, Skv, D)``, ``v (B, KH,
Skv, Dv)``; causal, a window, a softcap, ALiBi (``alibi_slopes (H,)``, constants), sinks
(``sinks (H,)``, which take a gradient) and ``kv_start (B,)`` int32 (each sequence's keys before it
hidden: left padding). Every shape is a static build of its own.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from .errors import SpecError
from .spec import AttentionSpec


@functools.lru_cache(maxsize=64)
def _pair(spec: AttentionSpec):
    """(forward kernel, backward kernel) of ``spec`` (with ``return_lse``), built once."""
    from .artifact import kernel_of  # the compiler's side (imports TVM)
    from .backward import build_backward  # the compiler's side (imports TVM)
    from .build import build_kernel  # the compiler's side (imports TVM)

    return kernel_of(build_kernel(spec, cache=True)), build_backward(spec)


def spec_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **fields: Any) -> AttentionSpec:
    """The static BHSD spec (``return_lse``) of a call: its shapes and the spec ``fields`` given."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise SpecError(f"attention: {name} must be a 4-D torch tensor (B, H, S, D), got "
                            f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))}")
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise SpecError(f"attention: {name} must be a CPU float32 tensor (the backward's first step), got "
                            f"{t.dtype} on {t.device}")
    b, h, sq, d = q.shape
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[3] != d:
        raise SpecError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit BHSD "
                        "(batch, kv heads and keys shared by k and v; q's and k's head size equal)")
    dv = v.shape[3]
    return AttentionSpec(batch=b, heads=h, kv_heads=k.shape[1], seq_q=sq, seq_kv=k.shape[2], head_dim=d,
                         head_dim_v=None if dv == d else dv, return_lse=True, **fields)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, slopes, sinks, starts, spec):
        fwd, _ = _pair(spec)
        extra = _extras(spec, slopes, sinks, starts)
        o, lse = fwd(q.detach().contiguous(), k.detach().contiguous(), v.detach().contiguous(), **extra)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, o, lse, slopes, sinks, starts)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, slopes, sinks, starts = ctx.saved_tensors
        spec = ctx.spec
        _, bwd = _pair(spec)
        arrays = [t.detach().contiguous().numpy() for t in (q, k, v, o, lse, do)]
        extra = {n: t.numpy() for n, t in _extras(spec, slopes, sinks, starts).items()}
        grads = [torch.from_numpy(g) for g in bwd(*arrays, **extra)]
        dsinks = grads[3] if spec.sinks else None
        return grads[0], grads[1], grads[2], None, dsinks, None, None


def _extras(spec: AttentionSpec, slopes, sinks, starts) -> dict[str, torch.Tensor]:
    """The variants' call arguments the spec takes, by name, detached and contiguous."""
    given = (("alibi_slopes", spec.alibi, slopes), ("sinks", spec.sinks, sinks), ("kv_start", spec.kv_start, starts))
    return {n: t.detach().contiguous() for n, on, t in given if on}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              window: tuple[int, int] | None = None, softcap: float | None = None, scale: float | None = None,
              alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              kv_start: torch.Tensor | None = None) -> torch.Tensor:
    """``o (B, H, Sq, Dv)`` of ``softmax(q·kᵀ·scale + mask)·v``, differentiable in ``q``, ``k``,
    ``v`` and ``sinks`` (the module docstring). ``alibi_slopes``/``sinks``: ``(H,)`` float32;
    ``kv_start``: ``(B,)`` int32 (a row that sees no key outputs zeros and takes no gradient)."""
    fields: dict[str, Any] = {"causal": causal, "window": window, "softcap": softcap,
                              "alibi": alibi_slopes is not None, "sinks": sinks is not None,
                              "kv_start": kv_start is not None}
    if scale is not None:
        fields["scale"] = scale
    spec = spec_of(q, k, v, **fields)
    for name, t, shape, dtype in (("alibi_slopes", alibi_slopes, (spec.heads,), torch.float32),
                                  ("sinks", sinks, (spec.heads,), torch.float32),
                                  ("kv_start", kv_start, (spec.batch,), torch.int32)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype):
            raise SpecError(f"attention: {name} must be a tensor of {str(dtype).removeprefix('torch.')} {shape}, got "
                            f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    empty = torch.zeros(0)
    return _Attention.apply(q, k, v, empty if alibi_slopes is None else alibi_slopes,
                            empty if sinks is None else sinks, empty if kv_start is None else kv_start, spec)
