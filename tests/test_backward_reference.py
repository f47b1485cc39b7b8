"""The float64 reference backward (issue 46's oracle, ``reference_attention_backward``): the
gradients of ``Σ o ∘ do`` against central finite differences of the forward reference for every
variant it takes, at awkward lengths (GQA, Sq ≠ Skv, a key tail), against torch's autograd of
SDPA in float64 for dense masks, and zero where nothing reaches the output."""
from __future__ import annotations

import numpy as np
import pytest

from tvm_attention.masks import pack_mask
from tvm_attention.reference import reference_attention, reference_attention_backward
from tvm_attention.spec import AttentionSpec

B, H, KH, SQ, SKV, D = 2, 4, 2, 5, 7, 8


def _inputs(spec, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((B, H, SQ, D)), rng.standard_normal((B, KH, SKV, D))
    v, do = rng.standard_normal((B, KH, SKV, spec.v_dim)), rng.standard_normal((B, H, SQ, spec.v_dim))
    args = {}
    if spec.alibi:
        args["alibi_slopes"] = np.abs(rng.standard_normal(H))
    if spec.sinks:
        args["sinks"] = rng.standard_normal(H)
    if spec.kv_start:
        args["kv_start"] = np.asarray([2, 0], np.int32)
    if spec.key_bounds:  # one document boundary per sequence
        args["key_lo"] = np.asarray([[0, 0, 0, 3, 3, 3, 3], [0] * 7], np.int32)
        args["key_hi"] = np.asarray([[3, 3, 3, 7, 7, 7, 7], [7] * 7], np.int32)
    if spec.custom_mask:
        m = rng.random((B, SQ, SKV)) < 0.7
        m[1, 2] = False  # a row with no key
        args["custom_mask"] = pack_mask(m)
    if spec.mod_tensors:
        args["mod_tensors"] = {"doc": np.asarray([[0, 0, 1, 1, 1, 2, 2]] * B, np.int32)}
    return q, k, v, do, args


def _numeric(spec, q, k, v, do, args, eps=1e-6):
    """Central differences of ``Σ o ∘ do`` in each element of q, k, v (and the sinks)."""
    def loss(q, k, v, a):
        return float((reference_attention(spec, q, k, v, **a) * do).sum())

    out = {}
    for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):
        base = [q, k, v]
        grad = np.zeros_like(base[i])
        for idx in np.ndindex(grad.shape):
            plus, minus = base[i].copy(), base[i].copy()
            plus[idx] += eps
            minus[idx] -= eps
            hi, lo = list(base), list(base)
            hi[i], lo[i] = plus, minus
            grad[idx] = (loss(*hi, args) - loss(*lo, args)) / (2 * eps)
        out[name] = grad
    if spec.sinks:
        grad = np.zeros(H)
        for h in range(H):
            plus, minus = args["sinks"].copy(), args["sinks"].copy()
            plus[h] += eps
            minus[h] -= eps
            grad[h] = (loss(q, k, v, dict(args, sinks=plus)) - loss(q, k, v, dict(args, sinks=minus))) / (2 * eps)
        out["dsinks"] = grad
    return out


CASES = {
    "dense": dict(),
    "causal_softcap_sinks": dict(causal=True, softcap=2.5, sinks=True),
    "window_alibi": dict(window=(2, 1), alibi=True),
    "kv_start_bounds_mask_mod": dict(causal=True, kv_start=True, key_bounds=True,
                                     mask_mod="lambda b, h, q, kv: doc[b, q] >= doc[b, kv]",
                                     mod_tensors=(("doc", "int32", ("batch", "seq_kv")),)),
    "custom_mask_headdim_v": dict(custom_mask=True, head_dim_v=5, sinks=True),
    # score_mod's derivative (tvm_attention.modifier_grad): every smooth word, after a softcap and ALiBi
    "score_mod_smooth": dict(softcap=4.0, alibi=True, score_mod=(
        "lambda s, b, h, q, kv: sqrt(s * s + 1) + sigmoid(s) * exp(-abs(s)) - log(1 + exp(s)) / (2 + tanh(s))"
        " + min(s, 0.5) + maximum(s * 2, -1.0) - s / (q - kv + 9)")),
    # ... and its arms: a -inf arm hides keys, an int tensor picks the arm, the head scales it
    "score_mod_where": dict(causal=True, mod_tensors=(("doc", "int32", ("batch", "seq_kv")),), score_mod=(
        "lambda s, b, h, q, kv: (s * (1 + h) if q - kv <= 2 else -inf) if doc[b, kv] > 0 else s - 0.5 * (q - kv)")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_equal_finite_differences(case):
    spec = AttentionSpec(batch=B, heads=H, kv_heads=KH, seq_q=SQ, seq_kv=SKV, head_dim=D, **CASES[case])
    q, k, v, do, args = _inputs(spec)
    got = reference_attention_backward(spec, q, k, v, do, **args)
    want = _numeric(spec, q, k, v, do, args)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-7, rtol=1e-6, err_msg=name)
    assert got["dk"].shape == k.shape and got["dv"].shape == v.shape


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (3, 1))])
def test_gradients_equal_torch_autograd_of_sdpa(causal, window):
    torch = pytest.importorskip("torch")
    from tvm_attention.visibility import Visibility

    spec = AttentionSpec(batch=B, heads=H, kv_heads=KH, seq_q=SQ, seq_kv=SKV, head_dim=D, causal=causal, window=window)
    q, k, v, do, _ = _inputs(spec, seed=1)
    mask = torch.from_numpy(Visibility.of(spec).mask(SQ, SKV))  # bottom-right, as ours
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=spec.scale, enable_gqa=True)
    o.backward(torch.from_numpy(do))
    got = reference_attention_backward(spec, q, k, v, do)
    for name, t in (("dq", tq), ("dk", tk), ("dv", tv)):
        np.testing.assert_allclose(got[name], t.grad.numpy(), atol=1e-12, rtol=1e-10, err_msg=name)


def test_rows_that_see_no_key_take_no_gradient_and_nan_passes_through():
    spec = AttentionSpec(batch=B, heads=H, kv_heads=KH, seq_q=SQ, seq_kv=SKV, head_dim=D, custom_mask=True)
    q, k, v, do, args = _inputs(spec)
    got = reference_attention_backward(spec, q, k, v, do, **args)
    assert not got["dq"][1, :, 2].any()  # row 2 of sequence 1 sees no key
    empty = reference_attention_backward(AttentionSpec(batch=1, heads=2, seq_q=3, seq_kv=3, head_dim=4, sinks=True),
                                         np.ones((1, 2, 3, 4)), np.ones((1, 2, 0, 4)), np.ones((1, 2, 0, 4)),
                                         np.ones((1, 2, 3, 4)), sinks=np.zeros(2))
    assert all(not a.any() for a in empty.values()) and empty["dsinks"].shape == (2,)
    k2 = k.copy()
    k2[0, 0, 3] = np.nan
    nan = reference_attention_backward(AttentionSpec(batch=B, heads=H, kv_heads=KH, seq_q=SQ, seq_kv=SKV, head_dim=D),
                                       q, k2, v, do)
    assert np.isnan(nan["dq"][0, :2]).all() and np.isfinite(nan["dq"][1]).all()  # kv head 0's group, batch 0 only


@pytest.mark.parametrize("body, word", [("floor(s)", "floor"), ("s // 2", "//"), ("s % 1.5", "%"),
                                        ("where(q > 0, s, floor(s * 2))", "floor")])
def test_a_step_in_score_mod_is_refused_by_name(body, word):
    """A step's derivative is 0 or undefined: refused where the score reaches it; a step of the
    indices alone is fine."""
    spec = AttentionSpec(batch=1, heads=2, seq_q=3, seq_kv=3, head_dim=4, score_mod=f"lambda s, b, h, q, kv: {body}")
    with pytest.raises(Exception, match=f"score_mod's derivative: {word} of the score"):
        reference_attention_backward(spec, *(np.ones((1, 2, 3, 4)),) * 4)
    fine = AttentionSpec(batch=1, heads=2, seq_q=3, seq_kv=3, head_dim=4,
                         score_mod="lambda s, b, h, q, kv: s + floor((q - kv) / 2) + (q // 2) % 2")
    assert np.isfinite(reference_attention_backward(fine, *(np.ones((1, 2, 3, 4)),) * 4)["dq"]).all()


def test_a_learned_bias_takes_its_gradient():
    """A float tensor read twice by score_mod (a relative bias and a per-head temperature from its
    column 0): ``grad_tensors`` gives its gradient, against central differences; int tensors and
    a mask's tensors are refused by name."""
    spec = AttentionSpec(batch=B, heads=H, kv_heads=KH, seq_q=SQ, seq_kv=SKV, head_dim=D, causal=True,
                         mod_tensors=(("bias", "float32", ("heads", 20)),),
                         score_mod="lambda s, b, h, q, kv: s * (1 + bias[h, 0]) + tanh(bias[h, q - kv + 10])")
    q, k, v, do, _ = _inputs(spec, seed=2)
    bias = np.random.default_rng(3).standard_normal((H, 20))
    got = reference_attention_backward(spec, q, k, v, do, grad_tensors=("bias",), mod_tensors={"bias": bias})
    eps, want = 1e-6, np.zeros_like(bias)
    for idx in np.ndindex(bias.shape):
        hi, lo = bias.copy(), bias.copy()
        hi[idx] += eps
        lo[idx] -= eps
        want[idx] = ((reference_attention(spec, q, k, v, mod_tensors={"bias": hi}) * do).sum()
                     - (reference_attention(spec, q, k, v, mod_tensors={"bias": lo}) * do).sum()) / (2 * eps)
    np.testing.assert_allclose(got["d_bias"], want, atol=1e-7, rtol=1e-6)
    # column 0 read twice; causal: 0 <= q - kv <= 6, columns 10..16
    assert np.abs(want[:, 0]).min() > 0 and not want[:, 17:].any() and not want[:, 1:10].any()
    with pytest.raises(ValueError, match="'doc' is not a float32 tensor of the spec's score_mod"):
        reference_attention_backward(spec, q, k, v, do, grad_tensors=("doc",), mod_tensors={"bias": bias})


@pytest.mark.parametrize("case", ["causal_softcap_sinks", "window_alibi", "score_mod_smooth"])
def test_torch_gradcheck_of_the_reference(case):
    """``torch.autograd.gradcheck`` in float64: the reference's backward, as a torch function of q,
    k, v (and the sinks), against torch's numerical Jacobian on small shapes."""
    torch = pytest.importorskip("torch")
    spec = AttentionSpec(batch=1, heads=2, kv_heads=1, seq_q=3, seq_kv=4, head_dim=2,
                         **{k: v for k, v in CASES[case].items()})
    rng = np.random.default_rng(5)
    args = {"alibi_slopes": np.abs(rng.standard_normal(2))} if spec.alibi else {}

    class Ref(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks):
            ctx.save_for_backward(q, k, v, sinks)
            extra = dict(args, **({"sinks": sinks.numpy()} if spec.sinks else {}))
            return torch.from_numpy(reference_attention(spec, q.numpy(), k.numpy(), v.numpy(), **extra))

        @staticmethod
        def backward(ctx, do):
            q, k, v, sinks = ctx.saved_tensors
            extra = dict(args, **({"sinks": sinks.numpy()} if spec.sinks else {}))
            g = reference_attention_backward(spec, q.numpy(), k.numpy(), v.numpy(), do.numpy(), **extra)
            ds = torch.from_numpy(g["dsinks"]) if spec.sinks else torch.zeros_like(sinks)
            return torch.from_numpy(g["dq"]), torch.from_numpy(g["dk"]), torch.from_numpy(g["dv"]), ds

    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True)
              for s in ((1, 2, 3, 2), (1, 1, 4, 2), (1, 1, 4, 2), (2,))]
    assert torch.autograd.gradcheck(Ref.apply, inputs, eps=1e-6, atol=1e-6)
