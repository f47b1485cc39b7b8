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

from typing import Any

import numpy as np


def _numpy(name: str, x: Any) -> tuple[np.ndarray, str | None]:
    """``x`` as a NumPy array and the framework to answer in (``"torch"``, else None). A torch
    bfloat16 tensor is read as ml_dtypes' bfloat16 through its bits (NumPy has none; what
    ``tvm_attention.torch.to_numpy`` does, without importing that module: this one stays
    torch-free). A tensor that requires grad while grad mode is on is refused by name: the merge
    runs in NumPy, and its result would carry no gradient without a word."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        import torch  # the caller's tensors are torch's: it is loaded already

        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad: merge_states does not differentiate (it merges in NumPy, so the "
                             f"result would carry no gradient); pass {name}.detach(), or merge under torch.no_grad()")
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            import ml_dtypes  # TVM's own dependency, and tvm-ffi's: there wherever the kernels are

            return x.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16), "torch"
        return x.numpy(), "torch"
    return np.asarray(x), None


def _check_float(name: str, a: np.ndarray) -> None:
    """Merged states are floats: an integer (or bool) ``o`` would come back rounded to integers."""
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":  # ml_dtypes' bfloat16 is kind "V"
        raise TypeError(f"{name}: expected a floating-point array (float16, bfloat16, float32 or float64), "
                        f"got {a.dtype.name}")


def merge_states(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any, sinks: Any = None) -> tuple[Any, Any]:
    """``(o, lse)`` of attention over the union of two disjoint key sets, from each set's
    ``(o, lse)``.

    ``o_*``: ``(..., S, D)`` (BHSD: ``(B, H, S, D)``); ``lse_*``: ``(..., S)`` float, natural log,
    ``-inf`` for a row that saw no key in that set (its ``o`` row is ignored). A row that saw no
    key in either set gives zeros and ``-inf``; NaN in either state gives NaN. NumPy arrays or
    torch tensors (answered in the same kind), floating-point (float16, bfloat16 — torch's or
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
    (oa, fw), (ob, _) = _numpy("o_a", o_a), _numpy("o_b", o_b)
    la, lb = _numpy("lse_a", lse_a)[0], _numpy("lse_b", lse_b)[0]
    for name, x in (("o_a", oa), ("lse_a", la), ("o_b", ob), ("lse_b", lb)):
        _check_float(name, x)
    if oa.ndim == 0:  # head_dim is o's last dim: a 0-d o has none (lse would need -1 dims)
        raise ValueError("o_a: expected (..., S, D) (head_dim last, lse's shape before it), got a 0-d array")
    if oa.shape != ob.shape:
        raise ValueError(f"o_a {oa.shape} and o_b {ob.shape} must have the same shape")
    for name, lse in (("lse_a", la), ("lse_b", lb)):
        if lse.shape != oa.shape[:-1]:
            raise ValueError(f"{name}: expected shape {oa.shape[:-1]} (o's shape without head_dim), got {lse.shape}")
    la64, lb64 = la.astype(np.float64), lb.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = np.maximum(la64, lb64)  # NaN propagates
        ref = np.where(np.isneginf(m), 0.0, m)  # both empty: no -inf - -inf
        wa, wb = np.exp(la64 - ref), np.exp(lb64 - ref)  # an empty side weighs 0
        # ...and its o row is ignored (float64 first: a bf16 o is read, never computed in)
        oa0 = np.where(np.isneginf(la64)[..., None], 0.0, oa.astype(np.float64))
        ob0 = np.where(np.isneginf(lb64)[..., None], 0.0, ob.astype(np.float64))
        total = wa + wb  # 0 only when both sides are empty (the larger weighs 1)
        o = (wa[..., None] * oa0 + wb[..., None] * ob0) / total[..., None]
        o = np.where((total == 0)[..., None], 0.0, o)
        lse = ref + np.log(total)
        if sinks is not None:
            sk = _numpy("sinks", sinks)[0].astype(np.float64)
            try:
                sk = np.broadcast_to(sk, lse.shape)
            except ValueError:
                raise ValueError(f"sinks: shape {sk.shape} does not broadcast against lse {lse.shape} "
                                 "(BHSD: pass sinks.reshape(H, 1))") from None
            # e^lse / (e^lse + e^sink), as 1 / (1 + e^(sink - lse)): 0 for a row that saw no key
            o = o / (1.0 + np.exp(sk - lse))[..., None]
    o = o.astype(oa.dtype)
    lse = lse.astype(np.float32)
    if fw == "torch":
        import torch

        o = np.ascontiguousarray(o)
        if o.dtype.name == "bfloat16":  # back through its bits, as it came
            return torch.from_numpy(o.view(np.int16)).view(torch.bfloat16), torch.from_numpy(lse)
        return torch.from_numpy(o), torch.from_numpy(lse)
    return o, lse
