"""The CPU peers every benchmark runs beside our kernels: NumPy and PyTorch's SDPA, on NumPy
inputs in the spec's layout (bhsd), and llama.cpp's flash attention on a decode step
(:class:`GgmlDecode`, when ``ggml-python`` is installed).

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


#: The ggml type llama.cpp's flash attention reads a cache dtype of ours in, at the same bytes
#: per element (bf16 as F16; Q8_0: 34 bytes per 32 int8 elements, its fp16 scale per group
#: included). float8 has no such type.
GGML_KV_TYPES = {"float32": "F32", "bfloat16": "F16", "float16": "F16", "int8": "Q8_0"}


class GgmlDecode:
    """llama.cpp's CPU flash attention (``ggml_flash_attn_ext``, through the ``ggml-python``
    package, which compiles ggml at install) on one decode step: ``q (B, H, 1, D)`` float32 and
    ``k (B, KH, cache, D)``/``v (.., Dv)`` float32 (MLA: 576 / 512), stored as :data:`GGML_KV_TYPES`'s type of ``kv_dtype``
    (converted or quantized here, by ggml's own quantizer for Q8_0). ggml's shapes run innermost
    first, so our (B, KH, cache, D) is its ``[D, cache, KH, B]``; its output ``[D, H, 1, B]`` is
    (B, 1, H, D). No mask: one new token sees the whole cache. ``call()`` runs the step on
    ``threads`` of ggml's own threads; ``output()`` is its result as (B, H, 1, D).

    Built with :meth:`create`, which returns None and a reason when it cannot run here. The
    arrays ggml reads are held by this object: keep it alive while it runs, and ``close()`` it
    (frees ggml's context)."""

    def __init__(self, ggml, ctx, graph, plan, keep, result, shape):
        self._ggml, self._ctx, self._graph, self._plan = ggml, ctx, graph, plan
        self._keep, self._result, self._shape = keep, result, shape

    @classmethod
    def create(cls, q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_dtype: str, scale: float,
               threads: int) -> tuple[GgmlDecode | None, str]:
        import ctypes

        kv_type = GGML_KV_TYPES.get(kv_dtype)
        if kv_type is None:
            return None, f"llama.cpp has no {kv_dtype} cache its CPU flash attention reads at our bytes per element"
        try:
            import ggml
        except ImportError:
            return None, "ggml-python is not installed (pip install ggml-python: it compiles llama.cpp's ggml)"
        b, h = q.shape[:2]
        gtype = getattr(ggml, f"GGML_TYPE_{kv_type}")
        # no_alloc: every tensor's data is an array of ours; the graph's work buffer is ours too
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=1 << 20, mem_buffer=None, no_alloc=True))
        keep = []

        def tensor(x, dtype):
            d = x.shape[3]  # (V's own: Dv)
            t = ggml.ggml_new_tensor_4d(ctx, dtype, d, x.shape[2], x.shape[1], x.shape[0])
            if dtype == ggml.GGML_TYPE_F32:
                a = np.ascontiguousarray(x, np.float32)
            elif dtype == ggml.GGML_TYPE_F16:
                a = np.ascontiguousarray(x, np.float16)
            else:  # quantized by ggml, row by row (rows of D elements)
                src = np.ascontiguousarray(x, np.float32).reshape(-1, d)
                a = np.empty(ggml.ggml_nbytes(t), np.uint8)
                ggml.ggml_quantize_chunk(dtype, src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                         a.ctypes.data_as(ctypes.c_void_p), 0, src.shape[0], d, None)
            if a.nbytes != ggml.ggml_nbytes(t):  # a layout of ggml's we did not expect: no silent misread
                ggml.ggml_free(ctx)
                raise RuntimeError(f"ggml tensor of {a.shape} {kv_type}: {ggml.ggml_nbytes(t)} bytes, ours {a.nbytes}")
            keep.append(a)
            t.contents.data = ctypes.c_void_p(a.ctypes.data)
            return t

        tq = tensor(q, ggml.GGML_TYPE_F32)
        out = ggml.ggml_flash_attn_ext(ctx, tq, tensor(k, gtype), tensor(v, gtype), None, scale, 0.0, 0.0)
        result = np.empty((b, 1, h, v.shape[3]), np.float32)
        out.contents.data = ctypes.c_void_p(result.ctypes.data)
        graph = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(graph, out)
        plan = ggml.ggml_graph_plan(graph, threads, None)
        work = np.empty(max(int(plan.work_size), 1), np.uint8)
        plan.work_data = ctypes.cast(work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
        keep.append(work)
        return cls(ggml, ctx, graph, plan, keep, result, q.shape), kv_type

    def call(self) -> None:
        import ctypes

        status = self._ggml.ggml_graph_compute(self._graph, ctypes.byref(self._plan))
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed (status {status})")

    def output(self) -> np.ndarray:
        return self._result.transpose(0, 2, 1, 3)

    def close(self) -> None:
        if self._ctx is not None:
            self._ggml.ggml_free(self._ctx)
            self._ctx = None
