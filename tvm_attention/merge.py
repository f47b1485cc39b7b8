"""Merging attention states: cascade (shared-prefix) attention and split-KV on the caller's side.

Attention over a key set ``A ∪ B`` (disjoint) is a function of the two partial results alone:
with ``o_x = softmax(q·K_xᵀ·scale)·V_x`` and ``lse_x = log Σ_{j∈x} exp(q·k_j·scale)`` (what a
kernel built with ``--return-lse`` returns),

    lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse)·o_a + exp(lse_b - lse)·o_b.

So a server can attend once to a prefix every request shares and separately to each request's
own suffix, then merge (FlashInfer's ``merge_state``). The split-KV decode kernel does the same
internally.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np


def _torch_of(x: Any):
    """torch, when ``x`` is one of its tensors (it is loaded already), else None."""
    if type(x).__module__.split(".")[0] == "torch":
        import torch

        return torch
    return None


def _refuse_grad(name: str, x: Any) -> None:
    """A tensor that requires grad while grad mode is on is refused by name: the merge does not
    differentiate (it is an inference path: its result would carry no gradient without a word)."""
    torch = _torch_of(x)
    if torch is not None and x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad: merge_states does not differentiate (the result would carry no "
                         f"gradient); pass {name}.detach(), or merge under torch.no_grad()")


def _numpy(name: str, x: Any) -> np.ndarray:
    """``x`` as a NumPy array (a torch tensor through the host: the sinks of a NumPy merge)."""
    torch = _torch_of(x)
    if torch is not None:
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:  # NumPy has none: ml_dtypes' bfloat16 of its bits
            import ml_dtypes  # TVM's own dependency, and tvm-ffi's: there wherever the kernels are

            return x.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "") if _torch_of(x) is not None else x.dtype.name


def _check_float(name: str, a: Any) -> None:
    """Merged states are floats: an integer (or bool) ``o`` would come back rounded to integers."""
    torch = _torch_of(a)
    if (not a.is_floating_point()) if torch is not None else (a.dtype.kind != "f" and a.dtype.name != "bfloat16"):
        raise TypeError(f"{name}: expected a floating-point array (float16, bfloat16, float32 or float64), "
                        f"got {_dtype_name(a)}")  # ml_dtypes' bfloat16 is NumPy kind "V"


def merge_states(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any, sinks: Any = None) -> tuple[Any, Any]:
    """``(o, lse)`` of attention over the union of two disjoint key sets, from each set's
    ``(o, lse)``.

    ``o_*``: ``(..., S, D)`` (BHSD: ``(B, H, S, D)``); ``lse_*``: ``(..., S)`` float, natural log,
    ``-inf`` for a row that saw no key in that set (its ``o`` row is ignored). A row that saw no
    key in either set gives zeros and ``-inf``; NaN in either state gives NaN. NumPy arrays or
    torch tensors, answered in ``o_a``'s kind: torch tensors merge with torch's ops on their own
    device (a GPU's states stay on the GPU: nothing goes through the host; the others are moved
    to ``o_a``'s device), NumPy arrays in NumPy. Floating-point (float16, bfloat16 — torch's or
    ml_dtypes' — float32, float64), merged in float64; ``o`` keeps ``o_a``'s dtype, ``lse`` is
    float32. For varlen's ``lse (H, total)`` pass ``lse.T`` with ``o (total, H, D)``. The merge
    does not differentiate: a tensor that requires grad is refused by name unless grad mode is off
    (``torch.no_grad()``). Integer states, a 0-d ``o`` and ``lse`` shapes other than ``o``'s
    without its last dim are refused by name.

    ``sinks`` (attention sinks, natural-log logits): states computed *without* sinks are merged,
    then each row's sink joins the merged denominator once: ``o · e^lse / (e^lse + e^sink)``;
    ``lse`` stays the keys' (as a kernel built with ``--sinks`` returns it). ``sinks`` must
    broadcast against ``lse``: ``(H, 1)`` for BHSD's ``lse (B, H, S)``, ``(H,)`` for varlen's
    ``lse.T (total, H)``.
    """
    given = {"o_a": o_a, "lse_a": lse_a, "o_b": o_b, "lse_b": lse_b, **({"sinks": sinks} if sinks is not None else {})}
    for name, x in given.items():
        _refuse_grad(name, x)
    torch = _torch_of(o_a)
    if torch is not None:  # on o_a's device, in torch
        dev = o_a.device
        x = {n: (v if _torch_of(v) is not None else torch.as_tensor(np.asarray(v))).to(dev) for n, v in given.items()}
        f64 = lambda t: t.to(torch.float64)  # noqa: E731
        xp, quiet = torch, contextlib.nullcontext()
    else:
        x = {n: _numpy(n, v) for n, v in given.items()}
        f64 = lambda a: a.astype(np.float64)  # noqa: E731
        xp, quiet = np, np.errstate(invalid="ignore", over="ignore", divide="ignore")
    oa, la, ob, lb = x["o_a"], x["lse_a"], x["o_b"], x["lse_b"]
    for name in ("o_a", "lse_a", "o_b", "lse_b"):
        _check_float(name, x[name])
    if oa.ndim == 0:  # head_dim is o's last dim: a 0-d o has none (lse would need -1 dims)
        raise ValueError("o_a: expected (..., S, D) (head_dim last, lse's shape before it), got a 0-d array")
    if tuple(oa.shape) != tuple(ob.shape):
        raise ValueError(f"o_a {tuple(oa.shape)} and o_b {tuple(ob.shape)} must have the same shape")
    for name, lse in (("lse_a", la), ("lse_b", lb)):
        if tuple(lse.shape) != tuple(oa.shape[:-1]):
            raise ValueError(f"{name}: expected shape {tuple(oa.shape[:-1])} (o's shape without head_dim), "
                             f"got {tuple(lse.shape)}")
    la64, lb64 = f64(la), f64(lb)
    with quiet:
        m = xp.maximum(la64, lb64)  # NaN propagates
        ref = xp.where(xp.isneginf(m), 0.0, m)  # both empty: no -inf - -inf
        wa, wb = xp.exp(la64 - ref), xp.exp(lb64 - ref)  # an empty side weighs 0
        # ...and its o row is ignored (float64 first: a bf16 o is read, never computed in)
        oa0 = xp.where(xp.isneginf(la64)[..., None], 0.0, f64(oa))
        ob0 = xp.where(xp.isneginf(lb64)[..., None], 0.0, f64(ob))
        total = wa + wb  # 0 only when both sides are empty (the larger weighs 1)
        o = (wa[..., None] * oa0 + wb[..., None] * ob0) / total[..., None]
        o = xp.where((total == 0)[..., None], 0.0, o)
        lse = ref + xp.log(total)
        if sinks is not None:
            sk = f64(x["sinks"])
            try:
                sk = xp.broadcast_to(sk, lse.shape)
            except (ValueError, RuntimeError):
                raise ValueError(f"sinks: shape {tuple(sk.shape)} does not broadcast against lse {tuple(lse.shape)} "
                                 "(BHSD: pass sinks.reshape(H, 1))") from None
            # e^lse / (e^lse + e^sink), as 1 / (1 + e^(sink - lse)): 0 for a row that saw no key
            o = o / (1.0 + xp.exp(sk - lse))[..., None]
    if torch is not None:
        return o.to(oa.dtype), lse.to(torch.float32)
    return o.astype(oa.dtype), lse.astype(np.float32)
