
import numpy as np
import pytest

from tvm_attention.reference import causal_mask, reference_attention
from tvm_attention.spec import AttentionSpec, SpecError
from tvm_attention.visibility import Visibility


def test_defaults():
    s = AttentionSpec(batch=2, heads=8, seq_q=128, head_dim=64)
    assert s.seq_kv == 128 and s.kv_heads == 8 and s.group_size == 1
    assert s.scale == pytest.approx(1 / 8)
    assert s.q_shape == (2, 8, 128, 64) and s.kv_shape == (2, 8, 128, 64)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(batch=0), "batch"),
        (dict(heads=-1), "heads"),
        (dict(seq_q=0), "seq_q"),
        (dict(seq_kv=0), "seq_kv"),
        (dict(head_dim=2.5), "head_dim"),
        (dict(heads=8, kv_heads=3), "kv_heads"),
        (dict(dtype="float64"), "float64"),
        (dict(dtype="int8"), "int8"),
        (dict(causal=1), "causal"),
        (dict(scale=-1.0), "scale"),
        (dict(scale=float("nan")), "scale"),
    ],
)
def test_invalid_spec_names_the_field(kwargs, field):
    base = dict(batch=1, heads=8, seq_q=16, head_dim=64)
    base.update(kwargs)
    with pytest.raises(SpecError, match=field):
        AttentionSpec(**base)


def test_flop_and_byte_models_by_hand():
    s = AttentionSpec(batch=2, heads=4, seq_q=256, seq_kv=512, head_dim=64, kv_heads=2)
    assert s.flops() == 4 * 2 * 4 * 256 * 512 * 64
    c = AttentionSpec(batch=2, heads=4, seq_q=256, seq_kv=512, head_dim=64, kv_heads=2, causal=True)
    assert c.flops() == 4 * 2 * 4 * 256 * 512 * 64 / 2
    # q and o: 2·4·256·64 each; k and v: 2·2·512·64 each; 4 bytes
    assert s.io_bytes() == 4 * (2 * (2 * 4 * 256 * 64) + 2 * (2 * 2 * 512 * 64))
    assert s.score_elements() == 256 * 512


def test_visible_pairs_bottom_right():
    s = AttentionSpec(batch=1, heads=1, seq_q=5, seq_kv=2, head_dim=8, causal=True)
    # rows 0..2 see nothing, row 3 sees key 0, row 4 sees keys 0 and 1
    assert s.visible_pairs() == 3
    assert causal_mask(5, 2).astype(int).tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    assert causal_mask(2, 5).astype(int).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q, seq_kv", [(1, 1), (5, 2), (2, 5), (7, 7), (1, 9), (33, 17)])
def test_one_definition_of_visibility(causal, seq_q, seq_kv):
    """Visibility's mask, counts, "sees a key" and the key-tile bound agree with each other and
    with the definition written out (row i sees key j iff j <= i + seq_kv - seq_q, causal)."""
    vis = Visibility(causal=causal)
    i, j = np.arange(seq_q)[:, None], np.arange(seq_kv)[None, :]
    want = (j <= i + seq_kv - seq_q) if causal else np.ones((seq_q, seq_kv), bool)
    mask = vis.mask(seq_q, seq_kv)
    assert mask.shape == (seq_q, seq_kv) and (mask == want).all()
    assert vis.pairs(seq_q, seq_kv) == want.sum()
    assert (vis.keys_seen(seq_q, seq_kv) == want.sum(axis=1)).all()
    off = vis.offset(seq_q, seq_kv)
    assert [bool(vis.sees_a_key(vis.position(r, off), seq_kv)) for r in range(seq_q)] == want.any(axis=1).tolist()
    for block_m, block_n in [(1, 1), (2, 4), (4, 3)]:
        for r0 in range(0, seq_q, block_m):
            end = vis.key_end(vis.position(min(r0 + block_m, seq_q), off))
            seen = np.nonzero(want[r0:r0 + block_m].any(axis=0))[0]
            if end is None:  # every key may be seen
                assert not vis.hides_keys
                continue
            assert seen.size == 0 or seen.max() < end  # no seen key past the bound
            tiles = vis.tiles_to(max(end, 0), block_n)
            assert seen.size == 0 or seen.max() < tiles * block_n


def test_visibility_builds_tir_expressions():
    from tvm import tirx

    vis = Visibility(causal=True)
    key, row, sk, sq = (tirx.Var(n, "int32") for n in ("key", "row", "seq_kv", "seq_q"))
    seen = vis.sees(key, vis.position(row, vis.offset(sq, sk)))
    assert isinstance(seen, tirx.LE)
    assert isinstance(vis.sees_a_key(vis.position(row, vis.offset(sq, sk)), sk), tirx.GE)
    assert Visibility(causal=False).sees(key, row) is None  # no mask to emit


def test_roundtrip_dict():
    s = AttentionSpec(batch=1, heads=4, kv_heads=1, seq_q=7, seq_kv=9, head_dim=32, causal=True, scale=0.3)
    assert AttentionSpec.from_dict(s.to_dict()) == s
    with pytest.raises(SpecError, match="bogus"):
        AttentionSpec.from_dict({**s.to_dict(), "bogus": 1})


def test_reference_matches_naive_softmax_and_zero_rows():
    rng = np.random.default_rng(0)
    s = AttentionSpec(batch=1, heads=2, kv_heads=1, seq_q=6, seq_kv=3, head_dim=4, causal=True)
    q = rng.standard_normal(s.q_shape)
    k = rng.standard_normal(s.kv_shape)
    v = rng.standard_normal(s.kv_shape)
    out = reference_attention(s, q, k, v)
    assert np.all(out[:, :, :3] == 0)  # rows 0..2 see no key
    for h in range(2):
        for i in range(3, 6):
            n = i - 3 + 1
            logits = q[0, h, i] @ k[0, 0, :n].T * s.scale
            p = np.exp(logits - logits.max())
            p /= p.sum()
            np.testing.assert_allclose(out[0, h, i], p @ v[0, 0, :n], rtol=1e-12)


def test_materialized_byte_model_by_hand():
    s = AttentionSpec(batch=1, heads=2, seq_q=1024, head_dim=64)
    io = 4 * (2 * (2 * 1024 * 64) + 2 * (2 * 1024 * 64))  # q, o, k, v: 4 × 131072 floats
    assert s.io_bytes() == io == 2097152
    # + 6 passes over 2 × 1024² float32 scores = 50331648 bytes
    assert s.materialized_bytes() == io + 6 * 4 * 2 * 1024 * 1024 == 52428800
    c = AttentionSpec(batch=1, heads=2, seq_q=1024, head_dim=64, causal=True)
    assert c.materialized_bytes() == s.materialized_bytes()  # materialized writes masked scores too
