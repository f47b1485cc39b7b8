"""The float64 NumPy reference: the single definition of tvm-attention's semantics."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .modifiers import instantiate
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
    alibi_slopes: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
    kv_start: np.ndarray | None = None,
    mod_tensors: dict | None = None,
    key_lo: np.ndarray | None = None,
    key_hi: np.ndarray | None = None,
    seq_index: int | None = None,
    custom_mask: tuple[np.ndarray, np.ndarray] | None = None,
    _parts: dict | None = None,
):
    """``softmax(q·kᵀ·scale + mask)·v`` in float64, BHSD layout, GQA by ``h // group_size``.

    Lengths come from the arrays (``q (B, H, Sq, D)``, ``k (B, KH, Skv, D)``, ``v (B, KH, Skv,
    Dv)``; the result ``(B, H, Sq, Dv)``), so one spec serves every shape of a dynamic kernel;
    ``spec`` gives scale, GQA, the mask (causal, window) and the variants. ``rows`` (optional)
    restricts the computation to those query rows; the result then has shape ``(B, H,
    len(rows), Dv)``. Rows the mask gives no key are zeros; NaN in
    q, k or v (or an infinite score) gives NaN in the rows it reaches.

    The variants, in the order they act on the scaled score ``x = q·k·scale`` of row position
    ``p`` and key ``j`` (docs/semantics.md):

    * ``spec.softcap`` c: ``x ← c·tanh(x / c)``;
    * ``spec.alibi``: ``x ← x − alibi_slopes[h]·|p − j|`` (``alibi_slopes (H,)``);
    * ``spec.score_mod``: ``x ← score_mod(x, b, h, p, j)`` (tvm_attention.modifiers; its
      tensors from ``mod_tensors``, name -> array);
    * the mask: causal, ``spec.window``, ``kv_start (B,)`` (keys ``j < kv_start[b]`` hidden),
      ``spec.key_bounds`` (``key_lo[b, p'] ≤ j < key_hi[b, p']``, ``p'`` the position clamped
      into the bounds' columns), ``spec.mask_mod(b, h, p, j)`` and ``spec.custom_mask``
      (``custom_mask = (packed, mask_indptr)``, FlashInfer's bits of sequence ``b`` over its
      ``(query row, key)``: ``tvm_attention.masks``); under a modifier a key whose score is
      ``-inf`` is hidden too;
    * ``spec.sinks``: ``sinks (H,)`` natural-log logits; each row's denominator gains
      ``exp(sinks[h])``, with no value attached (a row that sees no key still outputs zeros).

    ``b`` is the sequence's index in the batch: ``seq_index + i`` for the arrays' batch entry
    ``i`` (a layout that calls this per sequence passes its index; the bounds and ``kv_start``
    are then that sequence's rows).

    ``return_lse``: also return ``lse (B, H, Sq)``, the natural log of each row's softmax
    denominator ``log Σ_j exp(x_j)`` over the keys it sees (``-inf`` for a row that sees none),
    without the sink: the value FlashAttention returns as ``softmax_lse``.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    seq_q, seq_kv = q.shape[2], k.shape[2]
    if seq_kv == 0:  # no key at all: every row is a zero row
        o = np.zeros(q.shape[:2] + (q.shape[2] if rows is None else len(rows), v.shape[3]))
        return (o, np.full(o.shape[:3], -np.inf)) if return_lse else o
    vis = Visibility.of(spec)
    pos = vis.position(np.arange(seq_q), vis.offset(seq_q, seq_kv))
    if rows is not None:
        rows = np.asarray(rows)
        q = q[:, :, rows, :]
        pos = pos[rows]
    # Expand kv heads to query heads: query head h reads kv head h // group_size.
    k = np.repeat(k, spec.group_size, axis=1)
    v = np.repeat(v, spec.group_size, axis=1)
    # matmul (BLAS), not einsum (NumPy's own loop, several times slower in float64): the same sums
    s = x = (q @ k.swapaxes(-1, -2)) * spec.scale
    keys = np.arange(seq_kv)
    if spec.softcap is not None:
        s = spec.softcap * np.tanh(s / spec.softcap)
    if spec.alibi:
        slopes = _per_head(spec, "alibi_slopes", alibi_slopes)
        s = s - slopes[None, :, None, None] * np.abs(pos[:, None] - keys[None, :])[None, None]
    mods = spec.has_modifiers
    if mods:  # the modifiers' arguments, broadcast against s (B, H, rows, keys)
        first = 0 if seq_index is None else int(seq_index)
        b_idx = (first + np.arange(q.shape[0])).reshape(-1, 1, 1, 1)
        h_idx = np.arange(spec.heads).reshape(1, -1, 1, 1)
        p_idx, j_idx = pos.reshape(1, 1, -1, 1), keys.reshape(1, 1, 1, -1)
        tensors = _mod_tensors(spec, mod_tensors)
    if spec.score_mod is not None:
        fn = instantiate(spec.score_mod, "score_mod", tensors)
        with np.errstate(all="ignore"):
            if _parts is not None:  # the backward's chain rule: d score_mod / d score at each score
                _score_mod_derivatives(spec, tensors, s, (b_idx, h_idx, p_idx, j_idx), _parts)
            s = np.broadcast_to(np.asarray(fn(s, b_idx, h_idx, p_idx, j_idx), np.float64), s.shape)
    if spec.kv_start:
        start = np.asarray(_required(kv_start, "kv_start"), np.int64).reshape(-1, 1, 1, 1)
    else:
        start = None
    seen = vis.sees(keys[None, None, None, :], pos[None, None, :, None], start)
    mask = np.ones((1, 1, len(pos), seq_kv), bool) if seen is None else np.broadcast_to(seen, seen.shape)
    if spec.key_bounds:
        # the arrays' sequences' rows, at each row's position clamped into the columns
        col = np.clip(pos, 0, np.shape(_required(key_lo, "key_lo"))[1] - 1)
        lo, hi = (np.asarray(_required(x, name), np.int64)[first:first + q.shape[0]][:, col][:, None, :, None]
                  for x, name in ((key_lo, "key_lo"), (key_hi, "key_hi")))
        mask = mask & (lo <= j_idx) & (j_idx < hi)
    if spec.mask_mod is not None:
        fn = instantiate(spec.mask_mod, "mask_mod", tensors)
        mask = mask & np.asarray(fn(b_idx, h_idx, p_idx, j_idx), bool)
    if spec.custom_mask:
        from .masks import unpack_mask  # the packed form's one definition

        packed, indptr = _required(custom_mask, "custom_mask")
        packed, indptr = np.asarray(packed), np.asarray(indptr)
        # each of the arrays' sequences' (seq_q, seq_kv) bits, its rows restricted as q's
        bits = np.zeros((q.shape[0], seq_q, seq_kv), bool)
        for i in range(q.shape[0]):
            bits[i] = unpack_mask(packed, indptr[first + i:first + i + 2], [(seq_q, seq_kv)])[0]
        if rows is not None:
            bits = bits[:, rows]
        mask = mask & bits[:, None]
    if mods:  # a score of -inf hides its key (FlexAttention's convention); NaN stays visible
        mask = mask & (s != -np.inf)
    s = np.where(mask, s, -np.inf)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = s.max(axis=-1, keepdims=True)
        # Only masking's -inf is guarded (a row that sees no key); NaN and +inf pass through, so
        # NaN in q, k or v gives NaN out, as in torch.
        m = np.where(m == -np.inf, 0.0, m)
        p = np.exp(s - m)
        denom = p.sum(axis=-1, keepdims=True)
        o = p @ v
        if spec.sinks:
            # exp(sink) joins the denominator; the max taken over both keeps it finite
            sink = _per_head(spec, "sinks", sinks)[None, :, None, None]
            top = np.maximum(m, sink)
            o = o * np.exp(m - top) / (denom * np.exp(m - top) + np.exp(sink - top))
        else:
            o = o / denom
    # A zero row means one thing: the mask gave that row no key.
    sees_key = mask.any(axis=-1)[..., None]
    o = np.where(sees_key, o, 0.0)
    if _parts is not None:  # for reference_attention_backward: the forward's intermediates
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            full = denom * np.exp(m - top) + np.exp(sink - top) if spec.sinks else denom
            scale = np.exp(m - top) if spec.sinks else 1.0
            probs = np.where(sees_key, p * scale / full, 0.0)  # each key's share, a sink's excluded
            _parts.update(q=q, k=k, v=v, x=x, probs=probs, o=o,
                          sink_share=np.where(sees_key, np.exp(sink - top) / full, 0.0) if spec.sinks else None)
    if not return_lse:
        return o
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = m[..., 0] + np.log(denom[..., 0])  # m is 0 for a row with no key: log(0) = -inf
    return o, lse


def _score_mod_derivatives(spec: AttentionSpec, tensors: dict, s: np.ndarray, at: tuple, parts: dict) -> None:
    """``parts["mod_grad"]``: d score_mod / d score at each score ``s``; ``parts["mod_reads"]``:
    (tensor, clamped index, d score_mod / d read) of each read of a tensor in ``parts["wrt"]``."""
    from .modifier_grad import score_derivative  # only the backward needs it

    _, d, reads = score_derivative(spec.score_mod, tensors, parts.get("wrt", ()))(s, *at)
    parts["mod_grad"] = np.broadcast_to(np.asarray(d, np.float64), s.shape)
    parts["mod_reads"] = reads


def _required(x, name: str):
    if x is None:
        raise ValueError(f"the spec takes {name}: pass it")
    return x


def _mod_tensors(spec: AttentionSpec, arrays) -> dict:
    arrays = arrays or {}
    missing = [n for n, _, _ in spec.mod_tensors if n not in arrays]
    if missing:
        raise ValueError(f"the spec's modifiers read {', '.join(missing)}: pass them (mod_tensors)")
    return {n: np.asarray(arrays[n]) for n, _, _ in spec.mod_tensors}


def _per_head(spec: AttentionSpec, name: str, x) -> np.ndarray:
    x = np.asarray(_required(x, name), np.float64).reshape(-1)
    if x.shape != (spec.heads,):
        raise ValueError(f"{name}: expected ({spec.heads},) (one per query head), got {x.shape}")
    return x


def random_inputs(spec: AttentionSpec, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded standard-normal q, k, v of ``spec``'s (representative) BHSD shapes and dtype."""
    rng = np.random.default_rng(seed)
    dt = spec.np_dtype
    q = rng.standard_normal(spec.q_shape).astype(dt)
    k = rng.standard_normal(spec.kv_shape).astype(dt)
    v = rng.standard_normal(spec.v_shape).astype(dt)
    return q, k, v


def reference_attention_backward(spec: AttentionSpec, q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray,
                                 grad_tensors: tuple[str, ...] = (), **variant_args) -> dict[str, np.ndarray]:
    """The gradients of ``L = Σ o ∘ do`` (``o = reference_attention(spec, q, k, v, ...)``) in
    float64, BHSD: ``{"dq" (B, H, Sq, D), "dk" (B, KH, Skv, D), "dv" (B, KH, Skv, Dv)}``, and
    ``"dsinks" (H,)`` with ``spec.sinks``. ``variant_args``: reference_attention's (alibi_slopes,
    sinks, kv_start, key bounds, custom_mask, mod_tensors, seq_index).

    FlashAttention-2's algebra over the dense probabilities ``P`` (a sink's share excluded):
    ``dV = Pᵀ·dO``; ``dP = dO·Vᵀ``; ``delta = rowsum(dO ∘ O)``; ``dT = P ∘ (dP − delta)`` for
    the final score ``T``; the softcap's chain rule ``dX = dT ∘ (1 − tanh²(X / c))`` for the
    scaled score ``X`` (ALiBi adds a constant: ``dX = dT``); ``dQ = dX·K·scale``, ``dK =
    dXᵀ·Q·scale``; GQA sums dK and dV over each group's heads; ``dsink_h = −Σ p_sink·delta`` over
    the head's rows. ``score_mod`` ``y = f(u)`` of the softcapped, ALiBi-biased score ``u``
    multiplies ``dT`` by ``f'(u)`` (``tvm_attention.modifier_grad``; a step in it is refused by
    name); ``grad_tensors`` names float32 tensors it reads (a learned bias) whose gradients
    ``"d_<name>"`` (their shapes) are returned too. Hidden keys and rows that see none take no
    gradient; NaN passes through."""
    _check_grad_tensors(spec, grad_tensors)
    parts: dict = {"wrt": tuple(grad_tensors)}
    reference_attention(spec, q, k, v, _parts=parts, **variant_args)
    parts.pop("wrt")
    if not parts:  # no key at all: nothing reaches the output
        b, h, sq, d = np.shape(q)
        out = {"dq": np.zeros((b, h, sq, d)), "dk": np.zeros(np.shape(k)), "dv": np.zeros(np.shape(v)),
               **{f"d_{n}": np.zeros(np.shape(variant_args["mod_tensors"][n])) for n in grad_tensors}}
        return {**out, "dsinks": np.zeros(spec.heads)} if spec.sinks else out
    do = np.asarray(do, np.float64)
    probs, o, x = parts["probs"], parts["o"], parts["x"]
    g = spec.group_size
    with np.errstate(invalid="ignore", over="ignore"):
        dv = probs.swapaxes(-1, -2) @ do  # (matmul, as the forward's products)
        delta = (do * o).sum(axis=-1, keepdims=True)
        dt = probs * (do @ parts["v"].swapaxes(-1, -2) - delta)
        if spec.score_mod is not None:  # through the user's modifier; a hidden key's derivative may be inf
            tensor_grads = _tensor_grads(spec, dt, probs, parts["mod_reads"], variant_args.get("mod_tensors") or {})
            dt = np.where(probs == 0, 0.0, dt * parts["mod_grad"])
        if spec.softcap is not None:
            dt = dt * (1.0 - np.tanh(x / spec.softcap) ** 2)
        dq = (dt @ parts["k"]) * spec.scale
        dk = (dt.swapaxes(-1, -2) @ parts["q"]) * spec.scale

    def by_kv_head(a):  # GQA: query head h's share belongs to kv head h // g
        return a.reshape(a.shape[0], spec.kv_heads, g, *a.shape[2:]).sum(axis=2)

    out = {"dq": dq, "dk": by_kv_head(dk), "dv": by_kv_head(dv)}
    if spec.sinks:
        out["dsinks"] = -(parts["sink_share"] * delta).sum(axis=(0, 2, 3))
    if grad_tensors:
        out.update({f"d_{n}": tensor_grads[n] for n in grad_tensors})
    return out


def _check_grad_tensors(spec: AttentionSpec, names) -> None:
    """``grad_tensors``: float32 tensors the spec declares, read by its ``score_mod``."""
    decl = {n: dtype for n, dtype, _ in spec.mod_tensors}
    for n in names:
        if n not in decl or decl[n] != "float32" or spec.score_mod is None:
            raise ValueError(f"grad_tensors: {n!r} is not a float32 tensor of the spec's score_mod (a mask's "
                             "tensors and int tensors take no gradient)")


def _tensor_grads(spec, dt, probs, reads, arrays) -> dict[str, np.ndarray]:
    """Each differentiated tensor's gradient: ``Σ dT · d score_mod / d read`` scattered to the
    element each read takes, over the scores a row sees (``dt``: the gradient by the modified
    score ``T``)."""
    out = {n: np.zeros(np.shape(arrays[n])) for n in {r[0] for r in reads}}
    for name, idx, d in reads:
        contrib = np.where(probs == 0, 0.0, dt * np.broadcast_to(np.asarray(d, np.float64), dt.shape))
        np.add.at(out[name], tuple(np.broadcast_to(np.asarray(i), dt.shape) for i in idx), contrib)
    return out
