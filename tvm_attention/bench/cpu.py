"""CPU peers and machine ceilings for the benchmarks."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..spec import AttentionSpec
from ..timing import time_callable


def numpy_attention_fn(spec: AttentionSpec) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """Float32 NumPy attention (matmul-based, per (b, h)); a peer, not the reference."""
    g = spec.group_size
    mask = None
    if spec.causal:
        i = np.arange(spec.seq_q)[:, None]
        j = np.arange(spec.seq_kv)[None, :]
        mask = j > i + spec.kv_offset

    def run(q, k, v):
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
        i = torch.arange(spec.seq_q)[:, None]
        j = torch.arange(spec.seq_kv)[None, :]
        mask = j <= i + spec.kv_offset

    def run(q, k, v):
        qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
        if spec.group_size > 1:
            kt = kt.repeat_interleave(spec.group_size, dim=1)
            vt = vt.repeat_interleave(spec.group_size, dim=1)
        if mask is not None:
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=spec.scale)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=spec.causal, scale=spec.scale)
        return o.numpy()

    return run


def sgemm_ceiling(n: int = 2048) -> float:
    """GFLOP/s of a NumPy n×n float32 matmul: the practical compute ceiling."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    t = time_callable(lambda: a @ a, repeat=5, min_repeat_ms=200)
    return 2 * n**3 / t.median_s / 1e9


def copy_bandwidth(mib: int = 512) -> float:
    """GB/s of a large array copy (bytes read + bytes written): the memory-bandwidth ceiling."""
    src = np.ones(mib * 1024 * 1024 // 4, np.float32)
    dst = np.empty_like(src)
    t = time_callable(lambda: np.copyto(dst, src), repeat=5, min_repeat_ms=200)
    return 2 * src.nbytes / t.median_s / 1e9
