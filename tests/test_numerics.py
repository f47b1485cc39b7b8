"""NaN in gives NaN out; a zero row means only "saw no key" (kernels and the reference)."""
import numpy as np
import pytest

from tvm_attention.reference import causal_mask, random_inputs, reference_attention
from tvm_attention.spec import AttentionSpec

from conftest import run_kernel

# seq_q > seq_kv with causal: rows 0..(Sq-Skv-1) see no key; key tiles have a tail (Skv % 64).
SPEC = AttentionSpec(batch=1, heads=2, seq_q=80, seq_kv=70, head_dim=64, causal=True)
NO_KEY_ROWS = np.arange(SPEC.seq_q - SPEC.seq_kv)
SCHEDULES = ["fused", "materialized", "rowcache"]


def _sees(spec, j):
    """Rows that see key j."""
    return np.nonzero(causal_mask(spec.seq_q, spec.seq_kv)[:, j])[0]


def _check(spec, out, ref, nan_rows):
    """Rows in nan_rows (head 0) are all NaN in out and ref; every other row is finite and
    matches; rows that see no key are exact zeros."""
    for o in (out, ref):
        got = np.nonzero(np.isnan(o[0, 0]).any(axis=-1))[0]
        np.testing.assert_array_equal(got, np.sort(nan_rows))
        assert np.isnan(o[0, 0, nan_rows]).any(axis=-1).all()  # V: only its column
        assert not np.isnan(o[0, 1]).any()  # other heads untouched
    fin = np.isfinite(ref)
    np.testing.assert_allclose(out[fin], ref[fin], atol=1e-4, rtol=1e-4)
    assert (out[0, :, NO_KEY_ROWS] == 0).all()
    seen = np.setdiff1d(np.arange(spec.seq_q), NO_KEY_ROWS)
    assert not (out[0, 0, np.setdiff1d(seen, nan_rows)] == 0).all(axis=-1).any()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_in_gives_nan_out(schedule, where):
    q, k, v = random_inputs(SPEC, seed=3)
    j = 41  # a key that rows 51.. see (a row of the second key tile for block_n=32, first for 64)
    if where == "q":
        q[0, 0, 60, 7] = np.nan
        nan_rows = np.array([60])
    elif where == "k":
        k[0, 0, j, 5] = np.nan
        nan_rows = _sees(SPEC, j)
    else:
        # Key 0, which every row with a key sees: a NaN in V at a key a row does not see may
        # still reach it (masked probabilities are 0 and 0·NaN = NaN, in torch too).
        v[0, 0, 0, 9] = np.nan
        nan_rows = _sees(SPEC, 0)
    ref = reference_attention(SPEC, q, k, v)
    out = run_kernel(SPEC, q, k, v, schedule)
    _check(SPEC, out, ref, nan_rows)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_infinite_score_gives_nan_not_zeros(schedule):
    q, k, v = random_inputs(SPEC, seed=4)
    q[0, 0, 70, 0] = np.inf  # score +inf (or -inf) against every key: softmax is NaN
    ref = reference_attention(SPEC, q, k, v)
    out = run_kernel(SPEC, q, k, v, schedule)
    _check(SPEC, out, ref, np.array([70]))


def test_overflowing_product_is_nan_not_zeros():
    # Finite q, k near 3e19: their float32 product overflows to inf inside the kernel. The
    # float64 reference computes the right (finite) value; the kernel cannot, and must say so
    # with NaN rather than a row of zeros that reads as "saw no key".
    spec = AttentionSpec(batch=1, heads=1, seq_q=16, seq_kv=16, head_dim=64)
    q, k, v = random_inputs(spec, seed=5)
    q[0, 0, 3, :] = 3e19
    k[0, 0, :, :] = np.abs(k[0, 0]) * 3e19
    out = run_kernel(spec, q, k, v)
    assert np.isnan(out[0, 0, 3]).all()
    assert np.isfinite(np.delete(out[0, 0], 3, axis=0)).all()
    assert np.isfinite(reference_attention(spec, q, k, v)).all()


def test_reference_zero_rows_only_for_rows_without_keys():
    q, k, v = random_inputs(SPEC, seed=6)
    q[0, 0, 75, 1] = np.nan
    ref = reference_attention(SPEC, q, k, v)
    assert np.isnan(ref[0, 0, 75]).all()  # was zeros: max/denominator guards ate the NaN
    zero_rows = np.nonzero((ref[0, 0] == 0).all(axis=-1))[0]
    np.testing.assert_array_equal(zero_rows, NO_KEY_ROWS)


@pytest.mark.parametrize("poly, bound", [("EXP2_POLY", 3e-7), ("EXP2_POLY_BF16", 4e-6)])
def test_fast_exp2_is_within_its_bound(poly, bound):
    """exp2_fast compiled and run over [-126, 8] (the softmax's range, the AMX form's lazy
    reference up to 2**8) against float64: the full polynomial within 2.5 ulp, the short one the
    AMX form takes for P (rounded to bf16 next, 2**-9) within 4e-6; exactly 0 at -inf, NaN at NaN."""
    import tvm
    from tvm.script import tirx as T

    from tvm_attention.workloads import _math

    n = 1 << 16

    @T.prim_func(s_tir=True)
    def f(x: T.Buffer((n,), "float32"), y: T.Buffer((n,), "float32")):
        for i in range(n):
            with T.sblock("e"):
                vi = T.axis.remap("S", [i])
                y[vi] = _math.exp2_fast(x[vi], getattr(_math, poly))

    lib = tvm.compile(tvm.IRModule({"main": f}), target="llvm")
    x = np.linspace(-126.0, 8.0, n - 2, dtype=np.float32)
    x = np.concatenate([x, np.float32([-np.inf, np.nan])])
    y = tvm.runtime.empty((n,), "float32")
    lib["main"](tvm.runtime.tensor(x), y)
    y = y.numpy()
    exact = np.exp2(x[:-2].astype(np.float64))
    assert np.max(np.abs(y[:-2] / exact - 1)) < bound
    assert y[-2] == 0.0 and np.isnan(y[-1])


def test_fast_exp2_and_tanh_write_their_argument_out_once():
    # exp2_fast's polynomial reads the clamped argument 15 times and tanh_fast reads exp2_fast's
    # result twice: each binds it (a Let), so a masked score's tree is in the IR once per clamp,
    # not 30 times (written out, it made a paged build's lowering twice as slow)
    from tvm import tirx

    from tvm_attention.workloads._math import exp2_fast, tanh_fast

    x = tirx.Var("score_marker", "float32")
    assert exp2_fast(x * tirx.const(3.0, "float32")).script().count("score_marker") == 2  # x < lo ? lo : x
    assert tanh_fast(x).script().count("score_marker") == 3  # |x| into the clamp, and the sign
