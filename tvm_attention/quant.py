"""8-bit K/V caches: quantizing keys and values per kv head, and reading them back.

A cache of ``kv_dtype`` ``float8_e4m3fn``, ``float8_e5m2`` or ``int8`` stores ``x / scale``
rounded to the nearest representable value (ties to even) and saturated at the format's largest
finite magnitude (``QMAX``: 448, 57344, 127); the value of a stored element is ``scale · stored``.
There is one scale per kv head for the whole cache or page pool, float32 (pages are shared
between sequences, so a per-sequence scale does not fit a pool; vLLM keeps one per tensor), passed
to the kernel as ``k_scale``/``v_scale (kv_heads,)``. int8 is symmetric (no zero point). NaN stays
NaN in float8 (a NaN key still makes its rows NaN: "NaN in, NaN out"); int8 has no NaN, so
quantizing one to int8 is refused by name.

``quantize_kv(x, dtype)`` takes NumPy arrays (float8 results are ``ml_dtypes`` arrays, the dtype
NumPy callers pass to a kernel) or torch tensors (``torch.float8_e4m3fn``/``float8_e5m2``/``int8``
results). Its scale maps each head's largest finite magnitude onto ``QMAX``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .errors import SpecError

#: The 8-bit K/V cache dtypes (``AttentionSpec.kv_dtype``) and the largest finite magnitude of
#: each: where quantizing saturates.
QMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
KV_DTYPES = tuple(QMAX)


def qk_int8_query(q: Any) -> np.ndarray:
    """What ``AttentionSpec.qk_int8`` makes of the queries, as float64 values ``s_q·q_i``: each
    row (the last axis, head_dim) rounded to int8 exactly as a kernel does it in float32:
    ``a = max|q|`` (1 for a row of zeros), ``q_i = rint(q · (127 / a))`` (ties to even; never
    past ±127), ``s_q = a / 127``. A NaN or infinite element makes its row NaN."""
    q32 = np.asarray(q).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        a = np.max(np.abs(q32), axis=-1, keepdims=True)
        a = np.where(a == 0, np.float32(1), a)
        qi = np.rint(q32 * (np.float32(127) / a))
        return qi.astype(np.float64) * (a / np.float32(127)).astype(np.float64)


def _check_dtype(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in KV_DTYPES:
        raise SpecError(f"quantize_kv: dtype {dtype!r} is not an 8-bit K/V dtype; one of {', '.join(KV_DTYPES)}")
    return name


def _axis(ndim: int, head_axis: int) -> int:
    if not -ndim <= head_axis < ndim:
        raise SpecError(f"quantize_kv: head_axis={head_axis} is not an axis of a {ndim}-d tensor")
    return head_axis % ndim


def quantize_kv(x: Any, dtype: str, head_axis: int = 1, scale: Any = None) -> tuple[Any, Any]:
    """``(x_q, scale)``: ``x`` (a NumPy array or torch tensor, any float dtype) quantized to the 8-bit
    ``dtype`` with one float32 scale per kv head, ``scale (kv_heads,)``.

    ``head_axis``: the kv-head axis of ``x``, 1 for our caches ``(batch, kv_heads, len, D)`` and
    ``k_new (batch, kv_heads, seq_q, D)``, 2 for a page pool ``(pages, page_size, kv_heads, D)``.
    ``scale``: the scales to use (e.g. those of the cache new keys are appended to); by default
    each head's largest finite magnitude over ``QMAX[dtype]`` (1.0 for a head of zeros)."""
    name = _check_dtype(dtype)
    if type(x).__module__.startswith("torch"):
        return _quantize_torch(x, name, head_axis, scale)
    x = np.asarray(x)
    axis = _axis(x.ndim, head_axis)
    xf = x.astype(np.float32)
    if name == "int8" and np.isnan(xf).any():
        raise SpecError("quantize_kv: int8 has no NaN; the tensor holds NaN (use a float8 cache to keep it)")
    moved = np.moveaxis(xf, axis, 0).reshape(x.shape[axis], -1)
    if scale is None:
        finite = np.where(np.isfinite(moved), np.abs(moved), 0.0)
        amax = finite.max(axis=1) if moved.shape[1] else np.zeros(moved.shape[0], np.float32)
        scale = np.where(amax > 0, amax / QMAX[name], 1.0).astype(np.float32)
    scale = check_scale(np.asarray(scale, np.float32), x.shape[axis], "scale")
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    y = np.clip(xf / scale.reshape(shape), -QMAX[name], QMAX[name])  # NaN passes np.clip
    if name == "int8":
        return np.rint(y).astype(np.int8), scale
    import ml_dtypes  # NumPy has no float8 of its own; TVM and the serving install bring ml_dtypes

    return y.astype(np.dtype(getattr(ml_dtypes, name))), scale


def _quantize_torch(x, name: str, head_axis: int, scale) -> tuple[Any, Any]:
    import torch  # a torch tensor was passed: torch is installed

    axis = _axis(x.dim(), head_axis)
    xf = x.detach().to(torch.float32)
    if name == "int8" and torch.isnan(xf).any():
        raise SpecError("quantize_kv: int8 has no NaN; the tensor holds NaN (use a float8 cache to keep it)")
    if scale is None:
        moved = xf.movedim(axis, 0).reshape(x.shape[axis], -1)
        finite = torch.where(torch.isfinite(moved), moved.abs(), torch.zeros_like(moved))
        amax = finite.amax(dim=1) if moved.shape[1] else torch.zeros(moved.shape[0])
        scale = torch.where(amax > 0, amax / QMAX[name], torch.ones_like(amax)).to(torch.float32)
    scale = torch.as_tensor(scale, dtype=torch.float32)
    check_scale(scale.numpy(), x.shape[axis], "scale")
    shape = [1] * x.dim()
    shape[axis] = x.shape[axis]
    y = (xf / scale.reshape(shape)).clamp(-QMAX[name], QMAX[name])  # NaN passes clamp
    if name == "int8":
        return torch.round(y).to(torch.int8), scale  # round: half to even, as NumPy's rint
    return y.to(getattr(torch, name)), scale


def dequantize(x: np.ndarray, scale: np.ndarray, head_axis: int = 1) -> np.ndarray:
    """Float64 ``scale[h] · x`` of an 8-bit K/V array ``x`` (the reference's reading of a cache)."""
    shape = [1] * x.ndim
    shape[head_axis] = x.shape[head_axis]
    return x.astype(np.float64) * np.asarray(scale, np.float64).reshape(shape)


def check_scale(scale: np.ndarray, kv_heads: int, name: str) -> np.ndarray:
    """``scale`` if it is ``(kv_heads,)`` with every entry positive and finite, else a
    :class:`SpecError` naming ``name`` and the entry."""
    scale = np.asarray(scale)
    if scale.shape != (kv_heads,):
        raise SpecError(f"{name}: expected shape ({kv_heads},) (one scale per kv head), got {scale.shape}")
    bad = ~(np.isfinite(scale) & (scale > 0))
    if bad.any():
        h = int(np.argmax(bad))
        raise SpecError(f"{name}[{h}]={scale[h]!r}: a scale must be a positive finite number")
    return scale
