"""Fused kernel vs the float64 reference over awkward shapes, GQA/MQA, causal, large logits.

The shapes are a covering set (each case says which path it is there for); the full sweep of
shape × head_dim × mask, group size × mask and the rowcache shapes is
``python scripts/kernel_sweep.py correctness``."""
import numpy as np
import pytest

from tvm_attention.reference import random_inputs, reference_attention
from tvm_attention.spec import AttentionSpec
from tvm_attention.validate import TOLERANCES, validate_callable
from tvm_attention.artifact import kernel_of

from conftest import built, report, run_kernel


def check(spec, out, ref):
    atol, rtol = TOLERANCES[spec.dtype]
    assert np.isfinite(out).all(), "non-finite output"
    assert np.allclose(out, ref, atol=atol, rtol=rtol), report(out, ref)


# A covering set, not the sweep (``python scripts/kernel_sweep.py correctness`` runs every
# shape × head_dim × causal): each case names the code path it is there for.
#   (1, 1, 64, full)        a single key: the decode nest with one key
#   (1, 517, 64, causal)    the decode nest over a key tail, masked
#   (113, 203, 64, full)    row and key tails in the prefill nest (also large logits, full)
#   (300, 45, 64, causal)   Sq > Skv: whole row tiles skipped, rows with no key are zero
#   (1023, 1024, 64, causal) many tiles, tiles past the diagonal skipped
#   head_dim 128 (another register tiling of P·V) at each nest with a tail, the other mask:
#   (1, 517, 128, full), (113, 203, 128, causal) (also large logits, causal), (1023, 1024, 128, full)
# Exact tiles (128 × 128) are test_custom_scale's shape.
SHAPE_CASES = [(1, 1, 64, False), (1, 517, 64, True), (113, 203, 64, False), (300, 45, 64, True),
               (1023, 1024, 64, True), (1, 517, 128, False), (113, 203, 128, True), (1023, 1024, 128, False)]


@pytest.mark.parametrize("seq_q, seq_kv, head_dim, causal", SHAPE_CASES,
                         ids=lambda x: {True: "causal", False: "full"}.get(x, str(x)) if isinstance(x, bool) else str(x))
def test_fused_matches_reference(seq_q, seq_kv, head_dim, causal):
    spec = AttentionSpec(batch=1, heads=2, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim, causal=causal)
    q, k, v = random_inputs(spec, seed=seq_q + seq_kv)
    check(spec, run_kernel(spec, q, k, v), reference_attention(spec, q, k, v))


# GQA (8:2) under the causal mask and MQA (4:1) without: each group size and each mask once (the
# sweep script runs the other two)
@pytest.mark.parametrize("heads, kv_heads, causal", [(8, 2, True), (4, 1, False)], ids=["gqa-causal", "mqa-full"])
def test_grouped_query_heads(heads, kv_heads, causal):
    spec = AttentionSpec(batch=2, heads=heads, kv_heads=kv_heads, seq_q=77, seq_kv=150, head_dim=64, causal=causal)
    q, k, v = random_inputs(spec, seed=3)
    check(spec, run_kernel(spec, q, k, v), reference_attention(spec, q, k, v))


def test_causal_fully_masked_rows_are_zero():
    # seq_q > seq_kv: the top seq_q - seq_kv rows see no key (whole row tiles are skipped).
    # (The build of test_fused_matches_reference[300-45-64-causal].)
    spec = AttentionSpec(batch=1, heads=2, seq_q=300, seq_kv=45, head_dim=64, causal=True)
    q, k, v = random_inputs(spec, seed=1)
    out = run_kernel(spec, q, k, v)
    assert np.all(out[:, :, : 300 - 45] == 0)
    check(spec, out, reference_attention(spec, q, k, v))


# the builds of two shape cases, one per mask: the logits' size, not the shape, is the point
@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True)], ids=["full", "causal"])
def test_large_logits_stay_finite(head_dim, causal):
    spec = AttentionSpec(batch=1, heads=2, seq_q=113, seq_kv=203, head_dim=head_dim, causal=causal)
    q, k, v = random_inputs(spec, seed=7)
    q = (q * 30).astype(np.float32)  # softmax close to one-hot; exp would overflow without the max
    check(spec, run_kernel(spec, q, k, v), reference_attention(spec, q, k, v))


def test_custom_scale():
    # also exact tiles (128 × 128: no row or key tail) under the causal mask
    spec = AttentionSpec(batch=1, heads=1, seq_q=128, seq_kv=128, head_dim=64, causal=True, scale=0.5)
    q, k, v = random_inputs(spec, seed=2)
    check(spec, run_kernel(spec, q, k, v), reference_attention(spec, q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_materialized_matches_reference(causal):
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=113, seq_kv=203, head_dim=64, causal=causal)
    q, k, v = random_inputs(spec, seed=5)
    check(spec, run_kernel(spec, q, k, v, schedule="materialized"), reference_attention(spec, q, k, v))


@pytest.mark.slow
def test_long_sequence_sampled_rows():
    # 8192 keys per row: a whole-row local buffer would be 32 KiB per row; the tile stays 64 keys
    # (causal: the buffers are the full mask's; the sweep script runs both)
    spec = AttentionSpec(batch=1, heads=1, seq_q=8192, head_dim=64, causal=True)
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


# the decode row over a key tail (full), row and key tails and Sq > Skv (causal): each shape and
# each mask once (the sweep script runs all six)
@pytest.mark.parametrize("seq_q, seq_kv, causal", [(1, 517, False), (113, 203, True), (300, 45, True)])
def test_rowcache_matches_reference(seq_q, seq_kv, causal):
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=seq_q, seq_kv=seq_kv, head_dim=64, causal=causal)
    q, k, v = random_inputs(spec, seed=6)
    check(spec, run_kernel(spec, q, k, v, schedule="rowcache"), reference_attention(spec, q, k, v))
