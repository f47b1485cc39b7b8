"""The float64 NumPy reference: the single definition of tvm-attention's semantics."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .visibility import Visibility

if TYPE_CHECKING:  # the spec builds on layouts, which build on this reference
    from .spec import AttentionSpec


def causal_mask(seq_q: int, seq_kv: int) -> np.ndarray:
    """Boolean ``(seq_q, seq_kv)`` mask, True where query i may see key j (bottom-right)."""
    return Visibility(causal=True).mask(seq_q, seq_kv)


def reference_attention(
    spec: AttentionSpec,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    rows: np.ndarray | None = None,
    return_lse: bool = False,
):
    """``softmax(q·kᵀ·scale + mask)·v`` in float64, BHSD layout, GQA by ``h // group_size``.

    Lengths come from the arrays (``q (B, H, Sq, D)``, ``k``/``v (B, KH, Skv, D)``), so one spec
    serves every shape of a dynamic kernel; ``spec`` gives scale, GQA and causality.
    ``rows`` (optional) restricts the computation to those query rows; the result then has
    shape ``(B, H, len(rows), D)``. Rows the mask gives no key are zeros; NaN in q, k or v (or an
    infinite score) gives NaN in the rows it reaches.

    ``return_lse``: also return ``lse (B, H, Sq)``, the natural log of each row's softmax
    denominator ``log Σ_j exp(q·k_j·scale)`` over the keys it sees (``-inf`` for a row that sees
    none): the value FlashAttention returns as ``softmax_lse``.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    seq_q, seq_kv = q.shape[2], k.shape[2]
    if seq_kv == 0:  # no key at all: every row is a zero row
        o = np.zeros(q.shape if rows is None else q.shape[:2] + (len(rows), q.shape[3]))
        return (o, np.full(o.shape[:3], -np.inf)) if return_lse else o
    if rows is not None:
        rows = np.asarray(rows)
        q = q[:, :, rows, :]
    # Expand kv heads to query heads: query head h reads kv head h // group_size.
    k = np.repeat(k, spec.group_size, axis=1)
    v = np.repeat(v, spec.group_size, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k) * spec.scale
    mask = Visibility.of(spec).mask(seq_q, seq_kv)
    if rows is not None:
        mask = mask[rows]
    s = np.where(mask, s, -np.inf)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = s.max(axis=-1, keepdims=True)
        # Only masking's -inf is guarded (a row that sees no key); NaN and +inf pass through, so
        # NaN in q, k or v gives NaN out, as in torch.
        m = np.where(m == -np.inf, 0.0, m)
        p = np.exp(s - m)
        denom = p.sum(axis=-1, keepdims=True)
        o = np.einsum("bhij,bhjd->bhid", p, v) / denom
    # A zero row means one thing: the mask gave that row no key.
    sees_key = mask.any(axis=-1)[None, None, :, None]
    o = np.where(sees_key, o, 0.0)
    if not return_lse:
        return o
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = m[..., 0] + np.log(denom[..., 0])  # m is 0 for a row with no key: log(0) = -inf
    return o, lse


def random_inputs(spec: AttentionSpec, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded standard-normal q, k, v of ``spec``'s (representative) BHSD shapes and dtype."""
    rng = np.random.default_rng(seed)
    dt = spec.np_dtype
    q = rng.standard_normal(spec.q_shape).astype(dt)
    k = rng.standard_normal(spec.kv_shape).astype(dt)
    v = rng.standard_normal(spec.kv_shape).astype(dt)
    return q, k, v
