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
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return x.detach().cpu().numpy(), "torch"
    return np.asarray(x), None


def merge_states(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any, sinks: Any = None) -> tuple[Any, Any]:
    """``(o, lse)`` of attention over the union of two disjoint key sets, from each set's
    ``(o, lse)``.

    ``o_*``: ``(..., S, D)`` (BHSD: ``(B, H, S, D)``); ``lse_*``: ``(..., S)`` float, natural log,
    ``-inf`` for a row that saw no key in that set (its ``o`` row is ignored). A row that saw no
    key in either set gives zeros and ``-inf``; NaN in either state gives NaN. NumPy arrays or
    torch tensors (answered in the same kind); ``o`` keeps ``o_a``'s dtype, ``lse`` is float32.
    For varlen's ``lse (H, total)`` pass ``lse.T`` with ``o (total, H, D)``.

    ``sinks`` (attention sinks, natural-log logits): states computed *without* sinks are merged,
    then each row's sink joins the merged denominator once: ``o · e^lse / (e^lse + e^sink)``;
    ``lse`` stays the keys' (as a kernel built with ``--sinks`` returns it). ``sinks`` must
    broadcast against ``lse``: ``(H, 1)`` for BHSD's ``lse (B, H, S)``, ``(H,)`` for varlen's
    ``lse.T (total, H)``.
    """
    (oa, fw), (ob, _) = _numpy("o_a", o_a), _numpy("o_b", o_b)
    la, lb = _numpy("lse_a", lse_a)[0], _numpy("lse_b", lse_b)[0]
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
        oa0 = np.where(np.isneginf(la64)[..., None], 0.0, oa)  # ...and its o row is ignored
        ob0 = np.where(np.isneginf(lb64)[..., None], 0.0, ob)
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

        return torch.from_numpy(np.ascontiguousarray(o)), torch.from_numpy(lse)
    return o, lse
