"""8-bit K/V caches: quantizing keys and values per kv head, and reading them back.

A cache of ``kv_dtype`` ``float8_e4m3fn``, ``float8_e5m2`` or ``int8`` stores ``x / scale``
rounded to the nearest representable value (ties to even) and saturated at the format's largest
finite magnitude (``QMAX``: 448, 57344, 127); the value of a stored element is ``scale · stored``.
There is one scale per kv head for the whole cache or page pool, float32 (pages are shared
between sequences, so a per-sequence scale does not fit a pool; vLLM keeps one per tensor), passed
to the kernel as ``k_scale``/``v_scale (kv_heads,)``. int8 is symmetric (no zero point). NaN stays
NaN in float8 (a NaN key still makes its rows NaN: "NaN in, NaN out"); int8 has no NaN, so
quantizing one to int8 is refused by name.

Finer scales (``AttentionSpec.kv_scale``, :data:`KV_SCALES`): ``"token"`` one scale per (token,
kv head), shaped as the cache without its last axis (head_dim); ``"group"`` one per
:data:`SCALE_GROUP` elements of head_dim (llama.cpp's Q8_0 blocks), ``(..., head_dim / 32)``. Each
maps the largest finite magnitude of what it scales onto ``QMAX`` (an all-zero token or group: 1).
An appending kernel computes them from its new keys the same way, in float32, bit for bit. Their
entries are data, as the cache's values are: the kernel reads those of the key tiles it attends
to, and a scale that is not a positive finite number makes rows NaN (as a NaN element does: a key
scale the rows that see its key, a value scale the rows of its key tile); entries past a
sequence's length are never read.

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
#: How finely an 8-bit cache is scaled (``AttentionSpec.kv_scale``): per kv head, per (token, kv
#: head), per group of :data:`SCALE_GROUP` head_dim elements of a token
KV_SCALES = ("head", "token", "group")
#: Elements of head_dim one ``"group"`` scale covers: llama.cpp's ``QK8_0``
SCALE_GROUP = 32


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


def _check_granularity(granularity: str, head_dim: int) -> str:
    if granularity not in KV_SCALES:
        raise SpecError(f"quantize_kv: granularity {granularity!r} is not one of {', '.join(KV_SCALES)}")
    if granularity == "group" and head_dim % SCALE_GROUP:
        raise SpecError(f"quantize_kv: granularity 'group' scales each {SCALE_GROUP} elements of the last axis "
                        f"(head_dim); {head_dim} is not a multiple of {SCALE_GROUP}")
    return granularity


def scale_shape(shape: tuple, head_axis: int, granularity: str = "head") -> tuple:
    """The shape of the scales of a K/V array of ``shape`` (head_dim last): ``(kv_heads,)``,
    ``shape[:-1]`` per token, ``shape[:-1] + (head_dim / 32,)`` per group."""
    if granularity == "head":
        return (shape[head_axis],)
    return tuple(shape[:-1]) + ((shape[-1] // SCALE_GROUP,) if granularity == "group" else ())


def _grouped(xf, granularity: str):
    """``xf`` (float32, head_dim last) as ``(..., groups, elements)`` for a fine granularity."""
    g = SCALE_GROUP if granularity == "group" else xf.shape[-1]
    return xf.reshape(*xf.shape[:-1], xf.shape[-1] // g if g else 0, g)


def quantize_kv(x: Any, dtype: str, head_axis: int = 1, scale: Any = None,
                granularity: str = "head") -> tuple[Any, Any]:
    """``(x_q, scale)``: ``x`` (a NumPy array or torch tensor, any float dtype, head_dim last)
    quantized to the 8-bit ``dtype`` with float32 scales of ``granularity`` (:data:`KV_SCALES`):
    ``scale (kv_heads,)`` per kv head, or per token / per group as :func:`scale_shape` says.

    ``head_axis``: the kv-head axis of ``x``, 1 for our caches ``(batch, kv_heads, len, D)`` and
    ``k_new (batch, kv_heads, seq_q, D)``, 2 for a page pool ``(pages, page_size, kv_heads, D)``.
    ``scale``: the scales to use (e.g. those of the cache new keys are appended to); by default
    the largest finite magnitude of what each scales over ``QMAX[dtype]`` (1.0 for zeros), in
    float32 as an appending kernel computes it."""
    name = _check_dtype(dtype)
    if type(x).__module__.startswith("torch"):
        return _quantize_torch(x, name, head_axis, scale, granularity)
    x = np.asarray(x)
    axis = _axis(x.ndim, head_axis)
    _check_granularity(granularity, x.shape[-1])
    xf = x.astype(np.float32)
    if name == "int8" and np.isnan(xf).any():
        raise SpecError("quantize_kv: int8 has no NaN; the tensor holds NaN (use a float8 cache to keep it)")
    want = scale_shape(x.shape, axis, granularity)
    if granularity == "head":
        moved = np.moveaxis(xf, axis, 0).reshape(x.shape[axis], -1)
    else:
        moved = _grouped(xf, granularity).reshape(-1, SCALE_GROUP if granularity == "group" else x.shape[-1])
    if scale is None:
        finite = np.where(np.isfinite(moved), np.abs(moved), np.float32(0))
        amax = finite.max(axis=1) if moved.shape[1] else np.zeros(moved.shape[0], np.float32)
        scale = np.where(amax > 0, amax / np.float32(QMAX[name]), np.float32(1)).astype(np.float32).reshape(want)
    scale = check_scale(np.asarray(scale, np.float32), want, "scale", every=granularity == "head")
    y = np.clip(xf / _broadcast(scale, x.shape, axis, granularity), -QMAX[name], QMAX[name])  # NaN passes np.clip
    if name == "int8":
        return np.rint(y).astype(np.int8), scale
    import ml_dtypes  # NumPy has no float8 of its own; TVM and the serving install bring ml_dtypes

    return y.astype(np.dtype(getattr(ml_dtypes, name))), scale


def _broadcast(scale, shape: tuple, head_axis: int, granularity: str):
    """``scale`` reshaped (NumPy or torch) to multiply an array of ``shape`` element by element."""
    if granularity == "head":
        b = [1] * len(shape)
        b[head_axis] = shape[head_axis]
        return scale.reshape(b)
    if granularity == "token":
        return scale[..., None]
    g = scale[..., None]  # (..., groups, 1) -> (..., groups, 32) -> (..., head_dim)
    return (g.expand(*g.shape[:-1], SCALE_GROUP) if hasattr(g, "expand")
            else np.broadcast_to(g, (*g.shape[:-1], SCALE_GROUP))).reshape(shape)


def _quantize_torch(x, name: str, head_axis: int, scale, granularity: str) -> tuple[Any, Any]:
    import torch  # a torch tensor was passed: torch is installed

    axis = _axis(x.dim(), head_axis)
    _check_granularity(granularity, x.shape[-1])
    xf = x.detach().to(torch.float32)
    if name == "int8" and torch.isnan(xf).any():
        raise SpecError("quantize_kv: int8 has no NaN; the tensor holds NaN (use a float8 cache to keep it)")
    want = scale_shape(tuple(x.shape), axis, granularity)
    if scale is None:
        if granularity == "head":
            moved = xf.movedim(axis, 0).reshape(x.shape[axis], -1)
        else:
            moved = xf.reshape(-1, SCALE_GROUP if granularity == "group" else x.shape[-1])
        finite = torch.where(torch.isfinite(moved), moved.abs(), torch.zeros_like(moved))
        amax = finite.amax(dim=1) if moved.shape[1] else torch.zeros(moved.shape[0])
        scale = torch.where(amax > 0, amax / QMAX[name], torch.ones_like(amax)).to(torch.float32).reshape(want)
    scale = torch.as_tensor(scale, dtype=torch.float32)
    check_scale(scale.numpy(), want, "scale", every=granularity == "head")
    y = (xf / _broadcast(scale, tuple(x.shape), axis, granularity)).clamp(-QMAX[name], QMAX[name])  # NaN passes
    if name == "int8":
        return torch.round(y).to(torch.int8), scale  # round: half to even, as NumPy's rint
    return y.to(getattr(torch, name)), scale


def dequantize(x: np.ndarray, scale: np.ndarray, head_axis: int = 1, granularity: str = "head") -> np.ndarray:
    """Float64 ``scale · x`` of an 8-bit K/V array ``x`` (the reference's reading of a cache),
    ``scale`` of ``granularity`` (:func:`scale_shape`)."""
    s = _broadcast(np.asarray(scale, np.float64), x.shape, head_axis % x.ndim, granularity)
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(np.float64) * s


def check_scale(scale: np.ndarray, shape, name: str, every: bool = True) -> np.ndarray:
    """``scale`` if it has ``shape`` (an int: ``(shape,)``, one scale per kv head) and, with
    ``every``, every entry positive and finite; else a :class:`SpecError` naming ``name`` and the
    entry. (Per-token and per-group scales are data: the kernel reads those of the keys it
    attends to, and entries past a sequence's length may hold anything.)"""
    scale = np.asarray(scale)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if scale.shape != shape:
        what = "one scale per kv head" if len(shape) == 1 else "the scales' shape"
        raise SpecError(f"{name}: expected shape {shape} ({what}), got {scale.shape}")
    bad = ~(np.isfinite(scale) & (scale > 0)) if every else np.zeros(scale.shape, bool)
    if bad.any():
        h = tuple(int(i) for i in np.argwhere(bad)[0])
        h = h[0] if len(h) == 1 else h
        raise SpecError(f"{name}[{h}]={scale[h]!r}: a scale must be a positive finite number")
    return scale
