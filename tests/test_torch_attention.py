"""``tvm_attention.torch.attention`` (issue 46, first step): our fused forward and backward as a
torch autograd function. Values and gradients equal torch's autograd (SDPA, or the same formula
written in torch for a softcap, ALiBi and sinks) at awkward lengths; one build per spec."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tvm_attention.spec import SpecError  # noqa: E402
from tvm_attention.torch import _pair, attention  # noqa: E402
from tvm_attention.visibility import Visibility  # noqa: E402


def _eager(q, k, v, causal=False, window=None, softcap=None, alibi_slopes=None, sinks=None):
    """The same attention written in torch (float64 autograd is the peer)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    sq, skv = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(sq)[:, None] + skv - sq
    if alibi_slopes is not None:
        s = s - alibi_slopes[:, None, None] * (pos - torch.arange(skv)[None, :]).abs()
    left, right = window or (-1, 0 if causal else -1)
    mask = torch.from_numpy(Visibility(causal=causal, left=left, right=right).mask(sq, skv))
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(s.shape[0], -1, sq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    return p[..., :skv] @ v


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(9, 2), softcap=6.0), dict(causal=True, alibi=True, sinks=True)],
                         ids=["causal", "window_softcap", "causal_alibi_sinks"])
def test_values_and_gradients_equal_torch_autograd(kw):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, 53, 16, generator=gen, requires_grad=True) for _ in range(2))
    args = dict(kw)
    if args.pop("alibi", False):
        args["alibi_slopes"] = torch.rand(4, generator=gen) * 0.2
    if args.pop("sinks", False):
        args["sinks"] = torch.randn(4, generator=gen, requires_grad=True)
    o = attention(q, k, v, **args)
    do = torch.randn(o.shape, generator=gen)
    grads = torch.autograd.grad(o, [q, k, v] + ([args["sinks"]] if "sinks" in args else []), do)
    leaves = [t.detach().double().requires_grad_() for t in [q, k, v] + ([args["sinks"]] if "sinks" in args else [])]
    eargs = dict(args, **({"sinks": leaves[3]} if "sinks" in args else {}))
    if "alibi_slopes" in eargs:
        eargs["alibi_slopes"] = eargs["alibi_slopes"].double()
    want = _eager(*leaves[:3], **eargs)
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=1e-4)
    wgrads = torch.autograd.grad(want, leaves, do.double())
    for name, got, w in zip(("dq", "dk", "dv", "dsinks"), grads, wgrads):
        torch.testing.assert_close(got.double(), w, atol=5e-5, rtol=1e-4, msg=name)


def test_one_build_per_spec_and_bad_input_is_named():
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    k = v = torch.randn(1, 2, 8, 16)
    before = _pair.cache_info().misses
    for _ in range(2):
        attention(q, k, v, causal=True).sum().backward()
    assert _pair.cache_info().misses == before + 1
    with pytest.raises(SpecError, match="CPU float32"):
        attention(q.double(), k, v)
    with pytest.raises(SpecError, match="sinks must be a float32 tensor \\(2,\\)"):
        attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(SpecError, match="do not fit BHSD"):
        attention(q, k, torch.randn(1, 2, 9, 16))
