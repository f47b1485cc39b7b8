"""Symbolic shapes: one bhsd artifact serves every batch and length (issue 9)."""
import json

import numpy as np
import pytest

from tvm_attention import cli
from tvm_attention.artifact import export, validate_built
from tvm_attention.layouts import LAYOUTS
from tvm_attention.loader import KernelArgumentError, load
from tvm_attention.reference import reference_attention
from tvm_attention.spec import MAX_ELEMENTS, AttentionSpec, SpecError

from conftest import built

ALL = ("batch", "seq_q", "seq_kv")
#: shapes none of the artifacts below was built at (its representative shape is 256 × 256)
SHAPES = [(1, 1, 1), (2, 113, 203), (1, 1, 517), (3, 300, 45), (1, 1024, 1024)]


def dyn_spec(causal, **kw):
    base = dict(batch=1, heads=4, kv_heads=2, seq_q=256, head_dim=64, causal=causal, dynamic=ALL)
    return AttentionSpec(**{**base, **kw})


@pytest.fixture(scope="module", params=[False, True], ids=["full", "causal"])
def artifact(request, tmp_path_factory):
    spec = dyn_spec(request.param)
    b = built(spec)
    out = tmp_path_factory.mktemp("dyn")
    export(b, out, validate_built(b))
    return spec, out


def inputs(spec, b, sq, sk, seed=0):
    return LAYOUTS["bhsd"].random_inputs(spec, {"batch": b, "seq_q": sq, "seq_kv": sk}, seed)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_any_shape_matches_the_reference(artifact, shape):
    spec, out = artifact
    kernel = load(out)
    x = inputs(spec, *shape)
    o = kernel(x["q"], x["k"], x["v"])
    assert o.shape == (shape[0], 4, shape[1], 64)
    np.testing.assert_allclose(o, reference_attention(spec, x["q"], x["k"], x["v"]), atol=1e-4, rtol=1e-4)


def test_manifest_writes_symbolic_dims_by_name(artifact):
    spec, out = artifact
    m = json.loads((out / "manifest.json").read_text())
    assert m["layout"] == "BHSD" and m["symbolic_dims"] == ["batch", "seq_q", "seq_kv"]
    assert m["args"][0]["shape"] == ["batch", 4, "seq_q", 64]
    assert m["args"][1]["shape"] == ["batch", 2, "seq_kv", 64]
    assert m["spec"]["dynamic"] == list(ALL)
    # validated at the representative shape and at one it was not built at (tails, empty rows)
    assert m["validation"]["passed"] and "seq_q=67" in m["validation"]["rows_checked"]


def test_audit_on_symbolic_ir():
    fused = built(dyn_spec(True))
    assert fused.audit.fused and fused.audit.probe == {"symbolic": ["batch", "seq_q", "seq_kv"]}
    # nothing grows with a length; only the split-KV decode partials are sized by the batch
    assert not any(a.grows for a in fused.audit.allocations)
    assert {a.name for a in fused.audit.allocations if a.depends_on} == {"Op", "St"}
    assert all(set(a.depends_on) == {"batch"} for a in fused.audit.allocations if a.depends_on)
    mat = built(dyn_spec(True), "materialized")
    assert not mat.audit.fused
    s = next(a for a in mat.audit.allocations if a.name == "S")
    assert {"batch", "seq_q", "seq_kv"} <= set(s.depends_on)
    assert any("S (global) has a size that depends on the symbolic" in r for r in mat.audit.reasons)


def test_partly_symbolic(tmp_path):
    spec = dyn_spec(True, batch=2, dynamic=("seq_kv",), seq_q=1)  # decode: one query row, any cache
    b = built(spec)
    assert b.audit.fused
    kernel = load_built(b, tmp_path)
    for sk in (1, 64, 300):
        x = inputs(spec, 2, 1, sk)
        np.testing.assert_allclose(kernel(x["q"], x["k"], x["v"]),
                                   reference_attention(spec, x["q"], x["k"], x["v"]), atol=1e-4, rtol=1e-4)
    x = inputs(spec, 3, 1, 8)  # batch is static here
    with pytest.raises(KernelArgumentError, match=r"q: expected shape \(2, 4, 1, 64\)"):
        kernel(x["q"], x["k"], x["v"])


def load_built(b, out):
    export(b, out, validate_built(b))
    return load(out)


def test_loader_checks_static_and_symbolic_dims(artifact):
    spec, out = artifact
    kernel = load(out)
    x = inputs(spec, 2, 10, 20)
    with pytest.raises(KernelArgumentError, match=r"q: expected shape \(batch, 4, seq_q, 64\)"):
        kernel(np.zeros((2, 3, 10, 64), np.float32), x["k"], x["v"])
    with pytest.raises(KernelArgumentError, match=r"v: dim 2 \(seq_kv\) is 21, but k has seq_kv=20"):
        kernel(x["q"], x["k"], np.zeros((2, 2, 21, 64), np.float32))
    with pytest.raises(KernelArgumentError, match=r"k: dim 0 \(batch\) is 3, but q has batch=2"):
        kernel(x["q"], np.zeros((3, 2, 20, 64), np.float32), x["v"])
    with pytest.raises(KernelArgumentError, match=f"causal={not spec.causal}: this artifact was built with causal"):
        kernel(x["q"], x["k"], x["v"], causal=not spec.causal)
    with pytest.raises(KernelArgumentError, match="softmax_scale=0.5: this artifact was built with scale"):
        kernel(x["q"], x["k"], x["v"], softmax_scale=0.5)
    with pytest.raises(KernelArgumentError, match="unexpected keyword argument 'cu_seqlens_q'"):
        kernel(x["q"], x["k"], x["v"], cu_seqlens_q=np.zeros(2, np.int32))
    o = kernel(x["q"], x["k"], x["v"], softmax_scale=spec.scale, causal=spec.causal)
    assert o.shape == x["q"].shape


def test_int32_overflow_is_a_clear_error(artifact):
    spec, out = artifact
    kernel = load(out)
    rows = MAX_ELEMENTS // (4 * 64) + 1  # q of (1, 4, rows, 64) has more than 2**31 - 1 elements
    huge = np.broadcast_to(np.zeros(1, np.float32), (1, 4, rows, 64))  # no memory behind it
    k = np.zeros((1, 2, 8, 64), np.float32)
    with pytest.raises(KernelArgumentError, match="q: .* elements .* 32-bit ints"):
        kernel(huge, k, k)
    # static dims: at build time, naming the tensor
    with pytest.raises(SpecError, match="kernels index with 32-bit ints"):
        AttentionSpec(batch=1, heads=4, seq_q=rows, head_dim=64)


def test_empty_lengths(artifact):
    spec, out = artifact
    kernel = load(out)
    x = inputs(spec, 2, 5, 0)
    assert not kernel(x["q"], x["k"], x["v"]).any()  # no key at all: zero rows
    x = inputs(spec, 2, 0, 7)
    assert kernel(x["q"], x["k"], x["v"]).shape == (2, 4, 0, 64)


def test_nan_in_nan_out_symbolic(artifact):
    spec, out = artifact
    kernel = load(out)
    x = inputs(spec, 1, 70, 90)
    x["q"][0, 1, 33, 5] = np.nan
    o = kernel(x["q"], x["k"], x["v"])
    assert np.isnan(o[0, 1, 33]).all()
    assert np.isfinite(np.delete(o[0, 1], 33, axis=0)).all() and np.isfinite(o[0, 0]).all()


def test_cli_build_dyn(tmp_path, capsys):
    out = tmp_path / "a"
    rc = cli.main(["build", "--batch", "dyn", "--heads", "4", "--kv-heads", "2", "--seq-q", "dyn:128",
                   "--seq-kv", "dyn", "--head-dim", "64", "--causal", "--no-log", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "audit: FUSED  (symbolic dims: batch, seq_q, seq_kv; largest buffer " in text
    m = json.loads((out / "manifest.json").read_text())
    assert m["spec"]["seq_q"] == 128 and m["symbolic_dims"] == ["batch", "seq_q", "seq_kv"]
    assert cli.main(["validate", str(out)]) == 0
    with pytest.raises(SystemExit):  # argparse: "expected dyn or dyn:N"
        cli.main(["build", "--batch", "dyn", "--heads", "4", "--seq-q", "dyn:x", "--head-dim", "64",
                  "--out", str(tmp_path / "b")])
    assert "expected dyn or dyn:N" in capsys.readouterr().err


def test_spec_dynamic_field():
    s = AttentionSpec(batch=1, heads=8, seq_q=64, head_dim=64, dynamic=["seq_kv", "batch"])
    assert s.dynamic == ("batch", "seq_kv") and s.short_name() == "bdyn_h8_kv8_q64_kdyn_d64_float32_full"
    assert AttentionSpec.from_dict(s.to_dict()) == s and s.representative().dynamic == ()
    with pytest.raises(SpecError, match="unknown dim"):
        AttentionSpec(batch=1, heads=8, seq_q=64, head_dim=64, dynamic=("heads",))
    with pytest.raises(SpecError, match="unknown layout 'ragged'; known layouts: bhsd, varlen, kvcache, paged"):
        AttentionSpec(batch=1, heads=8, seq_q=64, head_dim=64, layout="ragged")


@pytest.mark.parametrize("schedule", ["rowcache"])
def test_families_without_symbolic_builds_say_so(schedule):
    from tvm_attention.schedules._knobs import KnobError

    with pytest.raises(KnobError, match="no symbolic-shape build"):
        built(dyn_spec(False), schedule)


def test_symbolic_build_takes_tuned_knobs_from_the_representative_log():
    # The committed log of the representative static shape (tuned on znver4, 2 cores) gives the
    # knobs; the symbolic kernel is built with them and validated at two shapes.
    from pathlib import Path

    from tvm_attention.pipeline import build_best
    from tvm_attention.target import resolve_target, runnable_here

    spec = AttentionSpec(batch=1, heads=8, seq_q=1024, head_dim=64, causal=True, dynamic=ALL)
    log = Path(__file__).parent.parent / "tuning_logs" / "llvm-znver4-2c" / spec.representative().short_name()
    target = resolve_target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    b, validation = build_best(spec, target=target, log_dir=log)
    assert b.source == "tuned" and b.knobs is not None and b.spec.dynamic == ALL
    assert b.audit.fused
    if runnable_here(target):  # an AVX-512 host runs znver4 code: validated at two shapes
        assert validation.passed and "seq_q=67" in validation.rows_checked
    else:  # a host without its features (AVX2; an Intel one lacks AMD's sse4a) cross-compiles
        # it and never executes it (SIGILL), naming what it lacks
        from tvm_attention.hostcpu import missing_features

        lacking = missing_features(b.cpu_features)
        assert not validation.ran and lacking and all(f in validation.reason for f in lacking)


# -- the GQA-packed decode nest of a symbolic-seq_q kernel ------------------------------------
DECODE_SHAPES = [(1, 1, 1), (2, 1, 70), (2, 2, 1), (1, 3, 200), (3, 4, 64), (1, 5, 3), (2, 16, 33), (1, 8, 130)]


# One build per group size (4, 1, 8: the packed nest's rows are seq_q·group) instead of the
# full × causal product: the full mask with packed heads (group 4), the causal mask without
# packing (group 1) and with the widest packing (group 8, whose rows map back to query rows,
# row // group, for the diagonal). dyn_spec's default (4, 2), group 2, takes the nest in both
# masks at test_any_shape_matches_the_reference's seq_q=1 shapes.
@pytest.mark.parametrize("heads,kv_heads,causal", [(8, 2, False), (4, 4, True), (8, 1, True)],
                         ids=["full-8-2", "causal-4-4", "causal-8-1"])
def test_decode_nest_matches_the_reference(heads, kv_heads, causal):
    # seq_q · group <= 16 takes the packed nest (one tile per kv head); the others the main one.
    spec = dyn_spec(causal, heads=heads, kv_heads=kv_heads)
    b = built(spec)
    assert b.audit.fused and '"attn.decode_rows": [' in b.lowered.script()
    kernel = AttentionKernelOf(b)
    for shape in DECODE_SHAPES:
        x = inputs(spec, *shape, seed=sum(shape))
        np.testing.assert_allclose(kernel(x["q"], x["k"], x["v"]), reference_attention(spec, x["q"], x["k"], x["v"]),
                                   atol=1e-4, rtol=1e-4, err_msg=str(shape))


def AttentionKernelOf(b):
    from tvm_attention.artifact import kernel_of

    return kernel_of(b)
