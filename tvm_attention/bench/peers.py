"""The CPU peers every benchmark runs beside our kernels: NumPy and PyTorch's SDPA, on NumPy
inputs in the spec's layout (bhsd).

Apart from the rest of ``bench`` so that a fresh process measuring a peer's memory
(``bench.memory``) imports NumPy and the peer, not TVM (3-4 s a process)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..loader import _from_framework
from ..spec import AttentionSpec
from ..visibility import Visibility


def numpy_attention_fn(spec: AttentionSpec) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """Float32 NumPy attention (matmul-based, per (b, h)); a peer, not the reference."""
    g = spec.group_size
    vis = Visibility.of(spec)
    mask = ~vis.mask(spec.seq_q, spec.seq_kv) if vis.hides_keys else None  # True where hidden

    def run(q, k, v):
        q, k, v = (x.astype(np.float32, copy=False) for x in (q, k, v))  # half inputs: float32 math
        out = np.empty(spec.o_shape, np.float32)
        for b in range(spec.batch):
            for h in range(spec.heads):
                s = (q[b, h] @ k[b, h // g].T) * np.float32(spec.scale)
                if mask is not None:
                    s[mask] = -np.inf
                m = s.max(axis=-1, keepdims=True)
                m[~np.isfinite(m)] = 0
                p = np.exp(s - m)
                l = p.sum(axis=-1, keepdims=True)
                out[b, h] = (p @ v[b, h // g]) / np.where(l > 0, l, 1)
        return out

    return run


def torch_sdpa_fn(spec: AttentionSpec, threads: int) -> Callable[..., Any] | None:
    """PyTorch's CPU scaled_dot_product_attention on NumPy inputs, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    mask = None
    if spec.causal and spec.seq_q != spec.seq_kv:
        # torch's is_causal is top-left aligned; pass the bottom-right mask explicitly.
        mask = torch.from_numpy(Visibility.of(spec).mask(spec.seq_q, spec.seq_kv))


    def run(q, k, v):
        qt, kt, vt = (_from_framework("torch", x) for x in (q, k, v))  # the spec's dtype, bf16 too
        if spec.group_size > 1:
            kt = kt.repeat_interleave(spec.group_size, dim=1)
            vt = vt.repeat_interleave(spec.group_size, dim=1)
        if mask is not None:
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=spec.scale)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=spec.causal, scale=spec.scale)
        return o.numpy() if o.dtype == torch.float32 else o.float().numpy()

    return run
