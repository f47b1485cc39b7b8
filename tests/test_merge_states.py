"""``merge_states`` on what callers pass besides float NumPy arrays (issue 62): torch bfloat16
tensors (merged in float arithmetic, answered in bfloat16), tensors that take a gradient (refused
by name: the merge would drop it), and inputs it cannot merge (integer states, ranks that do not
fit), refused by name. No kernel is built: the states are the float64 reference's."""
from __future__ import annotations

import numpy as np
import pytest

from tvm_attention import merge_states
from tvm_attention.reference import reference_attention
from tvm_attention.spec import AttentionSpec


def halves(seed=3):
    """Two key halves' states of one BHSD attention and the whole's, float64."""
    spec = AttentionSpec(batch=2, heads=3, seq_q=5, seq_kv=12, head_dim=8)
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 5, 8), (2, 3, 12, 8), (2, 3, 12, 8)))
    oa, la = reference_attention(spec, q, k[:, :, :7], v[:, :, :7], return_lse=True)
    ob, lb = reference_attention(spec, q, k[:, :, 7:], v[:, :, 7:], return_lse=True)
    o, lse = reference_attention(spec, q, k, v, return_lse=True)
    return (oa, la, ob, lb), (o, lse)


def test_torch_bfloat16_states_merge_in_float_and_come_back_bfloat16():
    torch = pytest.importorskip("torch")
    (oa, la, ob, lb), (want, want_lse) = halves()
    t = lambda x, dt: torch.from_numpy(np.ascontiguousarray(x)).to(dt)  # noqa: E731
    o, lse = merge_states(t(oa, torch.bfloat16), t(la, torch.float32), t(ob, torch.bfloat16), t(lb, torch.float32))
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and o.shape == (2, 3, 5, 8)
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    # bf16 keeps 8 bits: the inputs' rounding and the output's, 2**-8 of the largest value each
    np.testing.assert_allclose(o.float().numpy(), want, atol=2 * 2**-8 * np.abs(want).max())
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=1e-5)
    # a bf16 lse is read as well (float32 out)
    _, lse16 = merge_states(t(oa, torch.bfloat16), t(la, torch.bfloat16), t(ob, torch.bfloat16),
                            t(lb, torch.bfloat16))
    assert lse16.dtype == torch.float32
    np.testing.assert_allclose(lse16.numpy(), want_lse, atol=0.05)
    # and a NumPy (ml_dtypes) bf16 o comes back NumPy bf16
    ml_dtypes = pytest.importorskip("ml_dtypes")
    o_np, _ = merge_states(oa.astype(ml_dtypes.bfloat16), la, ob.astype(ml_dtypes.bfloat16), lb)
    assert o_np.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(o_np, o.float().numpy().astype(ml_dtypes.bfloat16))


def test_tensors_that_take_a_gradient_are_refused_by_name():
    """The merge does not differentiate: a gradient would be dropped without a word, so a tensor
    that requires grad (with grad mode on) is refused, naming it; under no_grad it merges."""
    torch = pytest.importorskip("torch")
    (oa, la, ob, lb), (want, _) = halves()
    ta, tla, tb, tlb = (torch.from_numpy(np.ascontiguousarray(x)).float() for x in (oa, la, ob, lb))
    with pytest.raises(ValueError, match=r"o_b requires grad: merge_states does not differentiate"):
        merge_states(ta, tla, tb.requires_grad_(), tlb)
    with pytest.raises(ValueError, match=r"lse_a requires grad"):
        merge_states(ta, tla.clone().requires_grad_(), tb.detach(), tlb)
    with pytest.raises(ValueError, match=r"sinks requires grad"):
        merge_states(ta, tla, tb.detach(), tlb, sinks=torch.zeros(3, 1, requires_grad=True))
    with torch.no_grad():  # inference: nothing to drop
        o, _ = merge_states(ta, tla, tb, tlb)
    np.testing.assert_allclose(o.numpy(), want, atol=1e-5)


def test_torch_states_merge_where_they_live():
    """Torch tensors merge with torch's ops on their own device, never through the host: on the
    ``meta`` device (shapes without data: a ``.cpu()`` or ``.numpy()`` would raise) it answers meta
    tensors of the right shapes and dtypes; on the CPU it equals the NumPy merge, sinks and the
    other arguments' NumPy arrays moved to ``o_a``'s device."""
    torch = pytest.importorskip("torch")
    (oa, la, ob, lb), (want, want_lse) = halves()
    meta = [torch.empty(x.shape, dtype=dt, device="meta") for x, dt in
            ((oa, torch.float16), (la, torch.float32), (ob, torch.float16), (lb, torch.float32))]
    o, lse = merge_states(*meta, sinks=torch.zeros(3, 1, device="meta"))
    assert (o.device.type, o.dtype, tuple(o.shape)) == ("meta", torch.float16, (2, 3, 5, 8))
    assert (lse.device.type, lse.dtype, tuple(lse.shape)) == ("meta", torch.float32, (2, 3, 5))
    sinks = np.linspace(-1, 1, 3).reshape(3, 1)
    o, lse = merge_states(torch.from_numpy(oa), la, torch.from_numpy(ob), torch.from_numpy(lb), sinks=sinks)
    o_np, lse_np = merge_states(oa, la, ob, lb, sinks=sinks)
    np.testing.assert_allclose(o.numpy(), o_np, rtol=1e-12)
    np.testing.assert_allclose(lse.numpy(), lse_np, rtol=1e-6)
    # an empty side, both empty, and NaN, as the NumPy merge treats them
    la2, lb2 = la.copy(), lb.copy()
    la2[0, 0, 0] = lb2[0, 0, 1] = -np.inf
    la2[0, 1, 0] = lb2[0, 1, 0] = -np.inf
    la2[1, 2, 3] = np.nan
    o, lse = merge_states(*(torch.from_numpy(x) for x in (oa, la2, ob, lb2)))
    o_np, lse_np = merge_states(oa, la2, ob, lb2)
    np.testing.assert_allclose(o.numpy(), o_np, rtol=1e-12)
    np.testing.assert_array_equal(np.isnan(lse.numpy()), np.isnan(lse_np))
    assert not o[0, 1, 0].any() and np.isneginf(lse[0, 1, 0].item()) and torch.isnan(o[1, 2, 3]).all()


@pytest.mark.parametrize("which, dtype", [("o_a", np.int32), ("o_b", np.int64), ("lse_a", np.int32),
                                          ("lse_b", np.bool_)])
def test_integer_states_are_refused_by_name(which, dtype):
    (oa, la, ob, lb), _ = halves()
    args = dict(o_a=oa, lse_a=la, o_b=ob, lse_b=lb)
    args[which] = args[which].astype(dtype)
    with pytest.raises(TypeError, match=rf"{which}: expected a floating-point array .*, got {np.dtype(dtype).name}$"):
        merge_states(**args)


def test_ranks_that_do_not_fit_are_refused_by_name():
    with pytest.raises(ValueError, match=r"o_a: expected \(\.\.\., S, D\) .*got a 0-d array"):
        merge_states(np.array(1.0), np.array(0.0), np.array(2.0), np.array(0.0))
    o, lse = np.ones((2, 4)), np.zeros(2)
    with pytest.raises(ValueError, match=r"lse_a: expected shape \(2,\) .*got \(\)"):
        merge_states(o, np.array(0.0), o, lse)
    with pytest.raises(ValueError, match=r"lse_b: expected shape \(2,\) .*got \(2, 4\)"):
        merge_states(o, lse, o, np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"o_a \(2, 4\) and o_b \(4,\) must have the same shape"):
        merge_states(o, lse, np.ones(4), np.array(0.0))
    # one row (D,) with a scalar lse is a state too
    got, l1 = merge_states(np.ones(4), np.array(0.0), np.full(4, 3.0), np.array(0.0))
    assert got.shape == (4,) and l1.shape == ()
    np.testing.assert_allclose(got, 2.0)
