"""A prefix shared by many sequences, read once (issue 45 item 4, ``tvm_attention.cascade``): the
stacked queries attend to the prefix in one pass, each sequence to its own suffix, and the
merged states equal the reference over prefix + suffix, in the kvcache and paged layouts, with
sinks (joined once), lse, several tokens per sequence and a suffix of the new tokens alone."""
from __future__ import annotations

import numpy as np
import pytest

from tvm_attention import cascade
from tvm_attention.artifact import kernel_of
from tvm_attention.layouts import paged_from_contiguous
from tvm_attention.reference import reference_attention
from tvm_attention.spec import AttentionSpec, SpecError

from conftest import built

N, H, KH, D, P = 4, 8, 2, 32, 300
SUFFIX = [5, 0, 17, 40]


def kernels(spec):
    return kernel_of(built(cascade.prefix_spec(spec))), kernel_of(built(cascade.suffix_spec(spec)))


@pytest.mark.parametrize("layout, sq, sinks", [("kvcache", 1, False), ("kvcache", 3, True), ("paged", 2, False)])
def test_shared_prefix_equals_the_reference(layout, sq, sinks):
    spec = AttentionSpec(batch=N, heads=H, kv_heads=KH, seq_q=sq, seq_kv=64, head_dim=D, causal=True, layout=layout,
                         sinks=sinks, page_size=16 if layout == "paged" else None)
    kp, ks = kernels(spec)
    rng = np.random.default_rng(sq)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, pk, pv = f32(N, H, sq, D), f32(1, KH, P, D), f32(1, KH, P, D)
    lens = np.asarray([n + sq for n in SUFFIX], np.int32)  # the suffixes hold the new tokens' keys too
    sk, sv = f32(N, KH, int(lens.max()), D), f32(N, KH, int(lens.max()), D)
    sink = f32(H) if sinks else None
    if layout == "kvcache":
        prefix = (pk, pv, np.asarray([P], np.int32))
        suffix = (sk, sv, lens)
    else:
        kpp, table = paged_from_contiguous(pk, 16, np.random.default_rng(1))
        vpp, _ = paged_from_contiguous(pv, 16, np.random.default_rng(1))
        prefix = (kpp, vpp, table, np.asarray([P], np.int32))
        skp, stable = paged_from_contiguous(sk, 16, np.random.default_rng(2))
        svp, _ = paged_from_contiguous(sv, 16, np.random.default_rng(2))
        suffix = (skp, svp, stable, lens)
    o, lse = cascade.attend(kp, ks, q, prefix, suffix, sinks=sink)
    for n in range(N):  # each sequence over prefix + its suffix, causal bottom-right
        k = np.concatenate([pk, sk[n:n + 1, :, :lens[n]]], axis=2)
        v = np.concatenate([pv, sv[n:n + 1, :, :lens[n]]], axis=2)
        ref, ref_lse = reference_attention(spec, q[n:n + 1], k, v, return_lse=True, sinks=sink)
        np.testing.assert_allclose(o[n:n + 1], ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(lse[n:n + 1], ref_lse, atol=1e-5, rtol=1e-5)


def test_stacking_round_trips_and_positional_variants_are_refused():
    q = np.random.default_rng(0).standard_normal((3, 8, 2, 4)).astype(np.float32)
    s = cascade.stack_queries(q, 2)
    assert s.shape == (1, 2, 3 * 2 * 4, 4)
    np.testing.assert_array_equal(s[0, 1, (2 * 2 + 1) * 4 + 3], q[2, 1 * 4 + 3, 1])  # row (n·Sq + s)·G + g
    np.testing.assert_array_equal(cascade.unstack(s, 3, 8, 2), q)
    for kw in (dict(window=(8, 0)), dict(alibi=True), dict(kv_start=True)):
        with pytest.raises(SpecError, match="absolute positions"):
            cascade.prefix_spec(AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=1, head_dim=32, causal=True,
                                              layout="kvcache", **kw))
    with pytest.raises(SpecError, match="kvcache or paged"):
        cascade.prefix_spec(AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=1, head_dim=32))
