"""FlashAttention's packed varlen layout: ragged batches through one artifact (issue 9)."""
import json

import numpy as np
import pytest

from tvm_attention import cli
from tvm_attention.artifact import export, validate_built
from tvm_attention.layouts import LAYOUTS
from tvm_attention.loader import KernelArgumentError, load
from tvm_attention.spec import AttentionSpec

from conftest import built

VARLEN = LAYOUTS["varlen"]


def varlen_spec(causal):
    return AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=128, head_dim=64, causal=causal, layout="varlen")


@pytest.fixture(scope="module", params=[False, True], ids=["full", "causal"])
def artifact(request, tmp_path_factory):
    spec = varlen_spec(request.param)
    b = built(spec)
    out = tmp_path_factory.mktemp("varlen")
    export(b, out, validate_built(b))
    return spec, out


CASES = {
    "mixed": [(0, 7), (1, 1), (70, 33), (33, 70), (5, 0), (129, 129), (0, 0), (3, 200)],
    "q_longer_than_k": [(40, 3), (64, 64), (17, 1)],
    "one_long_many_short": [(700, 700)] + [(16, 16), (1, 20)] * 10,
    "single": [(1, 1)],
    "all_empty": [(0, 0), (0, 5)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(artifact, case):
    spec, out = artifact
    kernel = load(out)
    x = VARLEN.random_inputs(spec, {"seqlens": CASES[case]}, seed=3)
    o = kernel(x["q"], x["k"], x["v"], cu_seqlens_q=x["cu_seqlens_q"], cu_seqlens_k=x["cu_seqlens_k"])
    ref = VARLEN.reference(spec, x)
    assert o.shape == x["q"].shape
    np.testing.assert_allclose(o, ref, atol=1e-4, rtol=1e-4)
    # a sequence with no key (and causal rows beyond the keys) outputs exact zeros
    for b, (lq, lk) in enumerate(CASES[case]):
        if lk == 0 and lq:
            rows = slice(x["cu_seqlens_q"][b], x["cu_seqlens_q"][b + 1])
            assert not o[rows].any()


def test_flash_attention_call_forms(artifact):
    spec, out = artifact
    kernel = load(out)
    x = VARLEN.random_inputs(spec, {"seqlens": [(5, 9), (12, 12)]}, seed=1)
    cq, ck = x["cu_seqlens_q"], x["cu_seqlens_k"]
    a = kernel(x["q"], x["k"], x["v"], cq, ck)  # positional, as flash_attn_varlen_func takes them
    b = kernel(x["q"], x["k"], x["v"], cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=12, max_seqlen_k=12,
               softmax_scale=spec.scale, causal=spec.causal)
    np.testing.assert_array_equal(a, b)
    out_buf = np.empty_like(x["q"])
    assert kernel(x["q"], x["k"], x["v"], cq, ck, out=out_buf) is out_buf
    np.testing.assert_array_equal(out_buf, a)


def test_manifest(artifact):
    spec, out = artifact
    m = json.loads((out / "manifest.json").read_text())
    assert m["layout"] == "varlen" and m["symbolic_dims"] == ["total_q", "total_k", "batch"]
    assert [a["name"] for a in m["args"]] == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "o"]
    assert m["args"][3] == {"name": "cu_seqlens_q", "shape": ["batch+1"], "dtype": "int32"}
    assert m["args"][0]["shape"] == ["total_q", 4, 64]
    assert m["audit"]["verdict"] == "fused"


def bad_calls(x):
    q, k, v, cq, ck = x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"]
    i32 = lambda *a: np.array(a, np.int32)  # noqa: E731
    return [
        ((q, k, v), {"cu_seqlens_k": ck}, "missing cu_seqlens_q"),
        ((q, k, v, cq, ck), {"cu_seqlens_q": cq}, "cu_seqlens_q: given both"),
        ((q, k, v, cq.astype(np.int64), ck), {}, "cu_seqlens_q: expected dtype int32, got int64"),
        ((q, k, v, cq, ck[:-1]), {}, r"cu_seqlens_k: dim 0 \(batch\+1\) is 2, but cu_seqlens_q has batch=2"),
        ((q, k, v, cq.reshape(1, -1), ck), {}, "cu_seqlens_q: expected rank 1"),
        ((q, k, v, i32(1, 5, 17), ck), {}, "cu_seqlens_q: must start at 0, got 1"),
        ((q, k, v, cq, i32(0, 12, 9)), {}, r"cu_seqlens_k: must be non-decreasing, but cu_seqlens_k\[2\]=9 < cu_seqlens_k\[1\]=12"),
        ((q, k, v, i32(0, 5, 16), ck), {}, r"cu_seqlens_q: last entry 16 must equal the number of rows of q \(total_q=17\)"),
        ((q, k, v, cq, i32(0, 9, 22)), {}, r"cu_seqlens_k: last entry 22 must equal the number of rows of k and v \(total_k=21\)"),
        ((q, k, v[:-1], cq, ck), {}, r"v: dim 0 \(total_k\) is 20, but k has total_k=21"),
        ((q, k[:, :1], v, cq, ck), {}, r"k: expected shape \(total_k, 2, 64\)"),
        ((q, k, v, cq, ck), {"max_seqlen_q": 4}, r"max_seqlen_q=4 is smaller than the longest sequence in cu_seqlens_q \(12\)"),
        ((q, k, v, cq, ck), {"window_size": (4, 0)}, r"window_size=\(4, 0\): this artifact was built with window"),
        ((q, k, v, cq, ck), {"dropout_p": 0.1}, "unexpected keyword argument 'dropout_p'"),
        ((q, k, v, cq, ck, ck), {}, "3 arguments after q, k, v"),
    ]


@pytest.mark.parametrize("i", range(15))
def test_bad_input_is_rejected_naming_it(artifact, i):
    spec, out = artifact
    kernel = load(out)
    x = VARLEN.random_inputs(spec, {"seqlens": [(5, 9), (12, 12)]}, seed=1)
    args, kw, match = bad_calls(x)[i]
    with pytest.raises(KernelArgumentError, match=match):
        kernel(*args, **kw)


def test_empty_totals(artifact):
    spec, out = artifact
    kernel = load(out)
    x = VARLEN.random_inputs(spec, {"seqlens": [(0, 4), (0, 0)]})
    assert kernel(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"]).shape == (0, 4, 64)
    x = VARLEN.random_inputs(spec, {"seqlens": [(3, 0), (2, 0)]})
    assert not kernel(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"]).any()


def test_materialized_has_no_varlen_build():
    from tvm_attention.schedules._knobs import KnobError

    with pytest.raises(KnobError, match="builds layout\\(s\\) bhsd, not 'varlen'"):
        built(varlen_spec(False), "materialized")


def test_cli_build_varlen(tmp_path, capsys):
    out = tmp_path / "v"
    rc = cli.main(["build", "--layout", "varlen", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                   "--causal", "--no-log", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert "audit: FUSED  (symbolic dims: total_q, total_k, batch; largest buffer " in capsys.readouterr().out
    assert json.loads((out / "manifest.json").read_text())["layout"] == "varlen"
    # an int is the representative value (what it is validated and timed at); still symbolic
    assert cli.main(["build", "--layout", "varlen", "--batch", "3", "--seq-q", "200", "--heads", "4",
                     "--head-dim", "64", "--no-log", "--out", str(tmp_path / "w")]) == 0
    m = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert (m["spec"]["batch"], m["spec"]["seq_q"], m["spec"]["seq_kv"]) == (3, 200, 200)
    assert m["symbolic_dims"] == ["total_q", "total_k", "batch"] and "3 sequences" in m["validation"]["rows_checked"]
