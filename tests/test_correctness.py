"""Fused kernel vs the float64 reference over awkward shapes, GQA/MQA, causal, large logits."""
import numpy as np
import pytest

from tvm_attention.reference import random_inputs, reference_attention
from tvm_attention.spec import AttentionSpec
from tvm_attention.validate import TOLERANCES, validate_callable
from tvm_attention.artifact import kernel_of

from conftest import built, report, run_kernel

SEQ_PAIRS = [(1, 1), (1, 517), (113, 203), (1023, 1024), (300, 45), (128, 128)]


def check(spec, out, ref):
    atol, rtol = TOLERANCES[spec.dtype]
    assert np.isfinite(out).all(), "non-finite output"
    assert np.allclose(out, ref, atol=atol, rtol=rtol), report(out, ref)


# Every pair at head_dim 64; head_dim 128 (another register tiling of P·V) at the pairs that
# reach each nest with a tail: the decode nest over a key tail (1, 517), row and key tails
# (113, 203), many tiles (1023, 1024). A single key (1, 1), Sq > Skv (300, 45: whole row tiles
# skipped) and exact tiles (128, 128) decide which tiles run, not how a tile computes: at 64.
D128_PAIRS = [(1, 517), (113, 203), (1023, 1024)]
SHAPE_CASES = [(sq, sk, 64) for sq, sk in SEQ_PAIRS] + [(sq, sk, 128) for sq, sk in D128_PAIRS]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seq_q, seq_kv, head_dim", SHAPE_CASES, ids=lambda x: str(x))
def test_fused_matches_reference(seq_q, seq_kv, head_dim, causal):
    spec = AttentionSpec(batch=1, heads=2, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim, causal=causal)
    q, k, v = random_inputs(spec, seed=seq_q + seq_kv)
    check(spec, run_kernel(spec, q, k, v), reference_attention(spec, q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 1)], ids=["gqa", "mqa"])
def test_grouped_query_heads(heads, kv_heads, causal):
    spec = AttentionSpec(batch=2, heads=heads, kv_heads=kv_heads, seq_q=77, seq_kv=150, head_dim=64, causal=causal)
    q, k, v = random_inputs(spec, seed=3)
    check(spec, run_kernel(spec, q, k, v), reference_attention(spec, q, k, v))


def test_causal_fully_masked_rows_are_zero():
    # seq_q > seq_kv: the top seq_q - seq_kv rows see no key (whole row tiles are skipped).
    spec = AttentionSpec(batch=1, heads=2, seq_q=300, seq_kv=45, head_dim=64, causal=True)
    q, k, v = random_inputs(spec, seed=1)
    out = run_kernel(spec, q, k, v)
    assert np.all(out[:, :, : 300 - 45] == 0)
    check(spec, out, reference_attention(spec, q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_logits_stay_finite(causal):
    spec = AttentionSpec(batch=1, heads=2, seq_q=200, seq_kv=333, head_dim=64, causal=causal)
    q, k, v = random_inputs(spec, seed=7)
    q = (q * 30).astype(np.float32)  # softmax close to one-hot; exp would overflow without the max
    check(spec, run_kernel(spec, q, k, v), reference_attention(spec, q, k, v))


def test_custom_scale():
    spec = AttentionSpec(batch=1, heads=1, seq_q=64, seq_kv=96, head_dim=64, scale=0.5)
    q, k, v = random_inputs(spec, seed=2)
    check(spec, run_kernel(spec, q, k, v), reference_attention(spec, q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_materialized_matches_reference(causal):
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=113, seq_kv=203, head_dim=64, causal=causal)
    q, k, v = random_inputs(spec, seed=5)
    check(spec, run_kernel(spec, q, k, v, schedule="materialized"), reference_attention(spec, q, k, v))


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequence_sampled_rows(causal):
    # 8192 keys per row: a whole-row local buffer would be 32 KiB per row; the tile stays 64 keys.
    spec = AttentionSpec(batch=1, heads=1, seq_q=8192, head_dim=64, causal=causal)
    result = validate_callable(spec, kernel_of(built(spec)), seed=0)
    assert result.rows_checked != "all"  # sampled: the full reference would be 8192² doubles
    assert result.finite and result.passed, result.format()


def reference_kernel(spec, spoil):
    """A stand-in kernel (called as validation calls one): the reference's ``o`` (and ``lse``)
    in float32, then ``spoil(o, lse, arrays)`` in place."""
    layout = spec.layout_info
    names = [a.name for a in layout.all_args(spec) if not a.output]

    def kernel(*args):
        arrays = dict(zip(names, args))
        o, lse = (x.astype(np.float32) for x in layout.reference_outputs(spec, arrays))
        spoil(o, lse, arrays)
        return (o, lse) if spec.return_lse else o

    return kernel


def test_failed_validation_says_where_nan_is():
    """NaN where the reference is finite fails validation saying so, naming the case and the rows
    (the errors skip NaN: alone they read 0 and FAIL); varlen's rows by sequence, an lse finite
    where the reference's is -inf too; a pass says nothing more and its manifest entry is as it was."""
    spec = AttentionSpec(batch=1, heads=1, seq_q=25, seq_kv=1, head_dim=8, window=(-1, 23))

    def row0(o, lse, arrays):
        o[0, 0, 0, :] = np.nan

    r = validate_callable(spec, reference_kernel(spec, row0))
    assert not r.passed and r.problem == ("NaN in 1 row where the reference is finite: case batch=1, seq_q=25, "
                                          "seq_kv=1, batch 0 head 0 row 0"), r.problem
    assert r.format().startswith("validation: FAIL  NaN in 1 row where the reference is finite: case batch=1, "
                                 "seq_q=25, seq_kv=1, batch 0 head 0 row 0; elsewhere max abs err 0.000e+00")

    varlen = AttentionSpec(batch=2, heads=2, seq_q=6, head_dim=8, layout="varlen", causal=True, return_lse=True)

    def packed(o, lse, arrays):
        if len(arrays["cu_seqlens_q"]) == 9:  # the mixed case: sequence 2 (70 rows over 33 keys) starts at row 1
            o[1:5, 1, 0] = np.inf
            lse[0, 1] = 0.5  # row 0 of sequence 2 sees no key: its reference lse is -inf

    r = validate_callable(varlen, reference_kernel(varlen, packed))
    assert not r.passed
    assert ("inf in 4 rows where the reference is finite: case 8 sequences, lengths [(0, 7), (1, 1), (70, 33), "
            "(33, 70), (5, 0), (129, 129)] ..., sequence 2 head 1 row 0 (packed row 1), sequence 2 head 1 row 1 "
            "(packed row 2), sequence 2 head 1 row 2 (packed row 3) and 1 more") in r.problem, r.problem
    assert "lse: finite in 1 row where the reference is -inf (no key seen): case 8 sequences" in r.problem, r.problem
    ok = validate_callable(varlen, reference_kernel(varlen, lambda *_: None))
    assert ok.passed and ok.problem == "" and "problem" not in ok.to_dict() and "elsewhere" not in ok.format()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seq_q, seq_kv", [(1, 517), (113, 203), (300, 45)])
def test_rowcache_matches_reference(seq_q, seq_kv, causal):
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=seq_q, seq_kv=seq_kv, head_dim=64, causal=causal)
    q, k, v = random_inputs(spec, seed=6)
    check(spec, run_kernel(spec, q, k, v, schedule="rowcache"), reference_attention(spec, q, k, v))
