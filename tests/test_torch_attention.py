"""``tvm_attention.torch.attention`` (issue 46): our fused forward and backward as a torch
autograd function. Values and gradients equal torch's autograd (SDPA, or the same formula written
in torch for a softcap, ALiBi, sinks and a score_mod) or the float64 oracle (kv_start, masks) at
awkward lengths, in float32 and bfloat16; one build per configuration, whatever the shapes."""
from __future__ import annotations

import numpy as np
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


def test_one_build_per_spec_and_bad_input_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("TVM_ATTENTION_CACHE_DIR", str(tmp_path))
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    k = v = torch.randn(1, 2, 8, 16)
    before = _pair.misses
    for n in (8, 8, 13):  # symbolic batch and lengths: one pair for every shape
        x = torch.randn(2, 2, n, 16, requires_grad=True)
        attention(x, x[:, :, :n - 3], x[:, :, :n - 3], causal=True).sum().backward()
        assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    assert _pair.misses == before + 1
    # another process (here: the pair forgotten) loads the backward from the disk cache, no build
    import tvm_attention.backward as backward

    _pair.cache_clear()
    monkeypatch.setattr(backward, "build_backward", lambda *a, **k: pytest.fail("rebuilt a cached backward"))
    attention(q, k, v, causal=True).sum().backward()
    with pytest.raises(SpecError, match="CPU float32 or bfloat16"):
        attention(q.double(), k, v)
    with pytest.raises(SpecError, match="q's dtype"):
        attention(q, k.bfloat16(), v)
    with pytest.raises(SpecError, match="sinks must be a tensor of float32 \\(2,\\)"):
        attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(SpecError, match="do not fit bhsd"):
        attention(q, k, torch.randn(1, 2, 9, 16))


def test_kv_start_hides_keys_and_rows_that_see_none_take_no_gradient():
    """Left padding: ``kv_start`` per sequence (one past every key for the second: its rows see
    none, output zeros and take zero gradients), against the float64 oracle."""
    from tvm_attention.reference import reference_attention, reference_attention_backward
    from tvm_attention.torch import spec_of

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 11, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 1, 19, 8, generator=gen, requires_grad=True) for _ in range(2))
    starts = torch.tensor([5, 19], dtype=torch.int32)
    o = attention(q, k, v, causal=True, kv_start=starts)
    do = torch.randn(o.shape, generator=gen)
    dq, dk, dv = torch.autograd.grad(o, [q, k, v], do)
    spec = spec_of(q, k, v, causal=True, kv_start=True)
    arrays = [t.detach().numpy() for t in (q, k, v)]
    want = reference_attention(spec, *arrays, kv_start=starts.numpy())
    torch.testing.assert_close(o.double(), torch.from_numpy(want), atol=2e-5, rtol=1e-4)
    assert not o[1].any() and not dq[1].any() and not dk[1].any() and not dv[1].any()
    wgrads = reference_attention_backward(spec, *arrays, do.numpy(), kv_start=starts.numpy())
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        torch.testing.assert_close(got.double(), torch.from_numpy(wgrads[name]), atol=5e-5, rtol=1e-4, msg=name)
    with pytest.raises(SpecError, match="kv_start must be a tensor of int32 \\(2,\\)"):
        attention(q, k, v, kv_start=starts.long())


def test_masks_take_their_zeros_through_the_gradient():
    """Key bounds, a boolean custom mask and a mask_mod over a tensor, against the oracle."""
    from tvm_attention.reference import reference_attention_backward
    from tvm_attention.masks import pack_mask
    from tvm_attention.torch import spec_of

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 13, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, 21, 8, generator=gen, requires_grad=True) for _ in range(2))
    # non-decreasing along the positions, as the forward asks (it skips tiles by them)
    lo = torch.randint(0, 8, (2, 21), generator=gen, dtype=torch.int32).sort(1).values
    hi = (lo + torch.randint(4, 21, (2, 21), generator=gen, dtype=torch.int32)).sort(1).values
    seen = torch.rand(2, 13, 21, generator=gen) < 0.8
    keep = (torch.rand(2, 21, generator=gen) < 0.8).to(torch.int32)
    mod = "lambda b, h, q_idx, kv_idx: keep[b, kv_idx] != 0"
    o = attention(q, k, v, causal=True, key_lo=lo, key_hi=hi, custom_mask=seen, mask_mod=mod, mod_tensors={"keep": keep})
    do = torch.randn(o.shape, generator=gen)
    dq, dk, dv = torch.autograd.grad(o, [q, k, v], do)
    spec = spec_of(q, k, v, causal=True, key_bounds=True, custom_mask=True, mask_mod=mod,
                   mod_tensors=(("keep", "int32", (2, 21)),))
    want = reference_attention_backward(spec, *(t.detach().numpy() for t in (q, k, v)), do.numpy(),
                                        key_lo=lo.numpy(), key_hi=hi.numpy(), custom_mask=pack_mask(seen.numpy()),
                                        mod_tensors={"keep": keep.numpy()})
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        torch.testing.assert_close(got.double(), torch.from_numpy(want[name]), atol=5e-5, rtol=1e-4, msg=name)
    for b in range(2):
        assert not dk[b][:, keep[b] == 0].any() and not dv[b][:, keep[b] == 0].any()  # hidden keys: no gradient
    with pytest.raises(SpecError, match="key bounds take both"):
        attention(q, k, v, key_lo=lo)


def test_score_mod_is_differentiated():
    """A relative bias read from a tensor, a tanh cap and a -inf arm, written once as a modifier:
    values and gradients equal torch's autograd of the same formula (float64)."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 19, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 27, 8, generator=gen, requires_grad=True) for _ in range(2))
    bias = torch.randn(4, 64, generator=gen)
    mod = "lambda s, b, h, q_idx, kv_idx: 8 * tanh(s / 8) + bias[h, q_idx - kv_idx + 32] if kv_idx % 5 else -inf"
    o = attention(q, k, v, causal=True, score_mod=mod, mod_tensors={"bias": bias})
    do = torch.randn(o.shape, generator=gen)
    grads = torch.autograd.grad(o, [q, k, v], do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qq, kk, vv = leaves[0], leaves[1].repeat_interleave(2, 1), leaves[2].repeat_interleave(2, 1)
    s = qq @ kk.transpose(-1, -2) / 8 ** 0.5
    pos, key = torch.arange(19)[:, None] + 8, torch.arange(27)[None, :]
    s = 8 * torch.tanh(s / 8) + bias.double()[:, (pos - key + 32).clamp(0, 63)][None]
    s = s.masked_fill((key % 5 == 0) | (key > pos), float("-inf"))
    want = torch.softmax(s, -1) @ vv
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=1e-4)
    for name, got, w in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(want, leaves, do.double())):
        torch.testing.assert_close(got.double(), w, atol=5e-5, rtol=1e-4, msg=name)
    # a learned bias: its gradient too, against the same autograd
    lbias = bias.clone().requires_grad_()
    o = attention(q, k, v, causal=True, score_mod=mod, mod_tensors={"bias": lbias})
    dbias, = torch.autograd.grad(o, [lbias], do)
    wb = bias.double().requires_grad_()
    s = qq @ kk.transpose(-1, -2) / 8 ** 0.5
    s = 8 * torch.tanh(s / 8) + wb[:, (pos - key + 32).clamp(0, 63)][None]
    s = s.masked_fill((key % 5 == 0) | (key > pos), float("-inf"))
    wdbias, = torch.autograd.grad(torch.softmax(s, -1) @ vv, [wb], do.double())
    torch.testing.assert_close(dbias.double(), wdbias, atol=5e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="'keep' is not a float32 tensor of the spec's score_mod"):
        attention(q, k, v, mask_mod="lambda b, h, q, kv: keep[b, kv] != 0",
                  mod_tensors={"keep": torch.ones(1, 27, dtype=torch.float32, requires_grad=True)})


def test_bfloat16_values_and_gradients():
    """bf16 tensors in and out (float32 arithmetic): within bf16's rounding of float64 autograd."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, 37, 16, generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 2, 53, 16, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    sinks = torch.randn(4, generator=gen, requires_grad=True)
    o = attention(q, k, v, causal=True, softcap=6.0, sinks=sinks)
    assert o.dtype == torch.bfloat16
    do = torch.randn(o.shape, generator=gen).bfloat16()
    grads = torch.autograd.grad(o, [q, k, v, sinks], do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    want = _eager(*leaves[:3], causal=True, softcap=6.0, sinks=leaves[3])
    wgrads = torch.autograd.grad(want, leaves, do.double())
    for name, got, w in zip(("o", "dq", "dk", "dv", "dsinks"), (o,) + grads, (want,) + wgrads):
        assert got.dtype == (torch.float32 if name == "dsinks" else torch.bfloat16), name
        err = (got.double() - w).abs().max() / w.abs().max()
        assert err < 1e-2, (name, float(err))  # bf16: 2**-8 per rounding


def test_varlen_values_and_gradients_per_sequence():
    """FlashAttention's varlen form: three packed sequences (one with no rows), each equal to
    torch's float64 autograd of its own attention, sinks' gradient summed over them."""
    from tvm_attention.torch import attention_varlen

    gen = torch.Generator().manual_seed(12)
    lens = [(9, 21), (0, 4), (17, 13)]
    cq, ck = (torch.tensor([0] + list(torch.tensor([x[i] for x in lens]).cumsum(0)), dtype=torch.int32)
              for i in (0, 1))
    q = torch.randn(int(cq[-1]), 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(int(ck[-1]), 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=gen, requires_grad=True)
    o = attention_varlen(q, k, v, cq, ck, causal=True, softcap=6.0, sinks=sinks)
    do = torch.randn(o.shape, generator=gen)
    grads = torch.autograd.grad(o, [q, k, v, sinks], do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    outs = []
    for b in range(len(lens)):
        qb, kb, vb = (x[c[b]:c[b + 1]].transpose(0, 1)[None] for x, c in zip(leaves[:3], (cq, ck, ck)))
        outs.append(_eager(qb, kb, vb, causal=True, softcap=6.0, sinks=leaves[3])[0].transpose(0, 1))
    want = torch.cat(outs)
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=1e-4)
    for name, got, w in zip(("dq", "dk", "dv", "dsinks"), grads, torch.autograd.grad(want, leaves, do.double())):
        torch.testing.assert_close(got.double(), w, atol=5e-5, rtol=1e-4, msg=name)
    with pytest.raises(SpecError, match="both hold batch \\+ 1 offsets"):
        attention_varlen(q, k, v, cq, ck[:-1])



def test_a_gradient_of_the_gradient_raises_by_name():
    """Under ``create_graph=True`` the first-order gradients come back, and differentiating them
    (a gradient penalty) raises: never a silent zero second-order term. (The causal case's spec
    of the first test: no build of its own.)"""
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(1, 4, 9, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 11, 16, generator=gen, requires_grad=True) for _ in range(2))
    dq, dk = torch.autograd.grad(attention(q, k, v, causal=True).square().sum(), [q, k], create_graph=True)
    plain = torch.autograd.grad(attention(q, k, v, causal=True).square().sum(), [q, k])
    torch.testing.assert_close((dq, dk), plain)
    with pytest.raises(NotImplementedError, match="double backward"):
        (dq.square().sum() + dk.square().sum()).backward()
    # the penalty beside the loss (o's own gradient is first-order): still refused, not zeroed
    o = attention(q, k, v, causal=True)
    penalty = torch.autograd.grad(o.sum(), q, create_graph=True)[0].square().sum()
    with pytest.raises(NotImplementedError, match="double backward"):
        (o.sum() + penalty).backward()


def test_arguments_changed_in_place_before_backward_are_refused():
    """What the backward reads is saved: kv_start, key bounds, a custom mask's bits, a modifier's
    tensor and varlen's cu_seqlens changed in place after the forward make ``backward()`` raise
    (torch's in-place check), never differentiate other values. (The specs of the kv_start, masks
    and varlen tests above: no build of their own.)"""
    from tvm_attention.masks import pack_mask
    from tvm_attention.torch import attention_varlen

    gen = torch.Generator().manual_seed(22)
    q = torch.randn(2, 2, 11, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 1, 19, 8, generator=gen, requires_grad=True) for _ in range(2))
    starts = torch.tensor([0, 3], dtype=torch.int32)
    o = attention(q, k, v, causal=True, kv_start=starts)
    starts.fill_(30)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()
    q = torch.randn(2, 2, 13, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, 21, 8, generator=gen, requires_grad=True) for _ in range(2))
    mod = "lambda b, h, q_idx, kv_idx: keep[b, kv_idx] != 0"

    def masked(**change):
        args = dict(key_lo=torch.zeros(2, 21, dtype=torch.int32), key_hi=torch.full((2, 21), 21, dtype=torch.int32),
                    custom_mask=tuple(torch.from_numpy(a) for a in pack_mask(np.ones((2, 13, 21), bool))),
                    mod_tensors={"keep": torch.ones(2, 21, dtype=torch.int32)})
        o = attention(q, k, v, causal=True, mask_mod=mod, **args)
        return o, args

    for change in (lambda a: a["key_hi"].fill_(5), lambda a: a["custom_mask"][0].zero_(),
                   lambda a: a["mod_tensors"]["keep"].zero_()):
        o, args = masked()
        change(args)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            o.sum().backward()
    cq, ck = torch.tensor([0, 9, 9, 26], dtype=torch.int32), torch.tensor([0, 21, 25, 38], dtype=torch.int32)
    q = torch.randn(26, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(38, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    o = attention_varlen(q, k, v, cq, ck, causal=True, softcap=6.0, sinks=torch.randn(4, requires_grad=True))
    ck[1] = 30
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()


@pytest.mark.parametrize("b, sq, skv", [(1, 0, 8), (1, 8, 0), (0, 8, 8)], ids=["no_rows", "no_keys", "no_batch"])
def test_empty_calls_give_zero_gradients(b, sq, skv):
    """No query row, no key, or no sequence: the forward gives its zeros and the backward the
    gradients' (right shapes, all zero; sinks too), not TVM's compact-array error. (The first
    test's ALiBi + sinks spec.)"""
    q = torch.randn(b, 4, sq, 16, requires_grad=True)
    k, v = (torch.randn(b, 2, skv, 16, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, requires_grad=True)
    o = attention(q, k, v, causal=True, alibi_slopes=torch.rand(4) * 0.2, sinks=sinks)
    assert o.shape == (b, 4, sq, 16) and not o.any()
    o.sum().backward()
    for t in (q, k, v, sinks):
        assert t.grad.shape == t.shape and not t.grad.any()


def test_a_cached_backward_must_be_the_one_asked_for(tmp_path):
    """The backward's disk cache: another spec's artifact (intact, consistent) under this spec's
    name is refused, with a warning, and rebuilt (the gradients right); a cache folder that
    cannot be one (a file) is not used: a warning, and the artifact goes to a private temporary
    folder. (The first test's causal and window/softcap specs: their forwards
    are built.)"""
    import shutil

    from tvm_attention.paths import scratch_dir
    from tvm_attention.torch import _pair, backward_artifact_name, backward_cache, spec_of

    gen = torch.Generator().manual_seed(23)
    q = torch.randn(1, 4, 9, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 11, 16, generator=gen, requires_grad=True) for _ in range(2))
    causal, other = dict(causal=True), dict(window=(9, 2), softcap=6.0)
    attention(q, k, v, **causal).sum().backward()  # (in this process's default cache already, if the first test ran)
    mine = backward_artifact_name(spec_of(q, k, v, **causal))
    assert (backward_cache() / mine / "manifest.json").is_file()
    cache = tmp_path / "cache" / "backward"
    shutil.copytree(backward_cache() / mine, cache / backward_artifact_name(spec_of(q, k, v, **other)))
    _pair.cache_clear()
    with pytest.warns(RuntimeWarning, match="cached backward .* is unusable .*its spec is"):
        o = attention(q, k, v, cache_dir=cache, **other)
        do = torch.randn(o.shape, generator=gen)
        grads = torch.autograd.grad(o, [q, k, v], do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    for name, got, w in zip(("dq", "dk", "dv"), grads,
                            torch.autograd.grad(_eager(*leaves, **other), leaves, do.double())):
        torch.testing.assert_close(got.double(), w, atol=5e-5, rtol=1e-4, msg=name)
    (tmp_path / "file").write_text("")
    _pair.cache_clear()
    with pytest.warns(RuntimeWarning, match="file.* is not a folder.*the backward is built into a temporary folder"):
        attention(q, k, v, cache_dir=tmp_path / "file", **causal).sum().backward()
    assert (scratch_dir() / "file" / mine / "manifest.json").is_file()
    assert (scratch_dir() / "file").stat().st_mode & 0o777 == 0o700


def test_an_edit_of_the_backwards_generators_misses_its_cached_artifacts(monkeypatch, tmp_path):
    """The backward cache's key hashes the generators' sources (the build cache's and
    ``BACKWARD_GENERATORS``), not the package version: an edited ``backward.py`` (or a forward
    generator it shares) gives every spec a new artifact name, so no artifact made before it is
    loaded. Nothing is built here."""
    from tvm_attention import build_cache
    from tvm_attention.torch import backward_artifact_name, spec_of

    q = torch.zeros(1, 2, 8, 16)
    spec = spec_of(q, q, q, causal=True)
    before = backward_artifact_name(spec)
    assert backward_artifact_name(spec) == before  # a function of its inputs
    real = build_cache.module_files

    for edited_file in ("backward.py", "fused.py"):  # the backward's generator, a forward one
        def edited(name, edited_file=edited_file):
            out = []
            for rel, path in real(name):
                if path.name == edited_file:
                    copy = tmp_path / edited_file
                    copy.write_bytes(path.read_bytes() + b"\n# an edit\n")
                    path = copy
                out.append((rel, path))
            return out

        with monkeypatch.context() as mp:
            mp.setattr(build_cache, "module_files", edited)
            mp.setattr(build_cache, "_DIGEST", [])
            mp.setattr(build_cache, "_EXTRA_DIGESTS", {})
            changed = backward_artifact_name(spec)
        assert changed != before and changed.split("_")[:-1] == before.split("_")[:-1], (edited_file, changed)
