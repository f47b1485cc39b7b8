"""`tvm-attention bench --serving --tiny` end to end: every row present, every number finite and
positive (no timing assertions: these VMs are shared)."""
import json
import math

import pytest

from tvm_attention.cli import main


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(folder, serving.json, serving.md, config) of one `bench --serving --tiny`, in this process
    (a subprocess would pay TVM's import and builds again), its builds through the run's build
    cache, where test_fused_dyn_in_compare_and_bench finds two of them.

    On causal points only: the tiny config's two masks built every kernel twice (8 of its 11
    builds, ~0.5 s of CPU each) for the same rows, fields and tables. Causal, whose useful FLOPs
    (the visible pairs) are not the dense count: a mask the benchmark lost would show in the
    varlen rows' GFLOP/s. That the command passes ``quick_config()`` itself to the benchmark:
    test_bench's test_every_benchmark_has_the_cli_as_its_front_door."""
    import dataclasses

    from tvm_attention.bench import serving

    out = tmp_path_factory.mktemp("serving")
    cfg = dataclasses.replace(serving.quick_config(), causals=(True,))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serving, "quick_config", lambda: cfg)
        assert main(["bench", "--serving", "--tiny", "--out", str(out)]) == 0
    return out, json.loads((out / "serving.json").read_text()), (out / "serving.md").read_text(), cfg


def positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_dynamic_rows(quick):
    _, data, _, cfg = quick
    rows = data["dynamic"]
    assert {(r["seq"], r["causal"]) for r in rows} == {(s, c) for s in cfg.dyn_seqs for c in cfg.causals}
    for r in rows:
        for key in ("static_ms", "dynamic_ms", "ratio", "static_gflops", "dynamic_gflops"):
            assert positive(r[key]), (key, r)
        assert r["ratio"] == pytest.approx(r["static_ms"] / r["dynamic_ms"])
        assert len(r["static_rounds_ms"]) == len(r["dynamic_rounds_ms"]) == cfg.rounds
        assert r["static_ms"] == pytest.approx(min(r["static_rounds_ms"]))  # best of the rounds


def test_varlen_rows(quick):
    _, data, _, cfg = quick
    from tvm_attention.layouts import LAYOUTS
    from tvm_attention.spec import AttentionSpec

    rows = data["varlen"]
    assert {(r["mix"], r["causal"]) for r in rows} == {(m, c) for m, _ in cfg.mixes for c in cfg.causals}
    for r in rows:
        for key in ("varlen_ms", "dense_ms", "varlen_gflops", "dense_gflops", "ratio"):
            assert positive(r[key]), (key, r)
        assert r["sequences"] == len(r["seqlens"]) and r["tokens"] == sum(q for q, _ in r["seqlens"])
        spec = AttentionSpec(batch=1, heads=cfg.heads, seq_q=cfg.dense_seq, head_dim=cfg.head_dim,
                             causal=r["causal"], layout="varlen")
        # useful GFLOP/s: only visible pairs count (a causal mix does about half the work)
        flops = LAYOUTS["varlen"].useful_flops(spec, {"seqlens": r["seqlens"]})
        assert r["varlen_gflops"] == pytest.approx(flops / (r["varlen_ms"] * 1e-3) / 1e9)
        assert r["ratio"] == pytest.approx(r["varlen_gflops"] / r["dense_gflops"])


def test_loader_rows(quick):
    _, data, _, _ = quick
    rows = data["loader"]
    artifacts = list(dict.fromkeys(r["artifact"] for r in rows))
    assert len(artifacts) == 3 and artifacts[0].startswith("static") and artifacts[1].startswith("dynamic")
    assert artifacts[2].startswith("varlen")
    try:
        import torch  # noqa: F401

        inputs = {"numpy", "numpy-unaligned", "torch"}
    except ImportError:
        inputs = {"numpy", "numpy-unaligned"}
    for a in artifacts:
        assert {r["inputs"] for r in rows if r["artifact"] == a} == inputs
    for r in rows:
        assert positive(r["bare_us"]) and positive(r["loader_us"]), r
        assert math.isfinite(r["overhead_us"])
        assert r["overhead_us"] == pytest.approx(r["loader_us"] - r["bare_us"])


def test_markdown_has_every_row(quick):
    _, data, md, _ = quick
    assert "static/dynamic" in md and "varlen/dense" in md and "overhead µs" in md
    table_rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| S |")
                  and not line.startswith("| batch |") and not line.startswith("| artifact |")]
    assert len(table_rows) == len(data["dynamic"]) + len(data["varlen"]) + len(data["loader"])
    assert data["meta"]["quick"] is True and data["meta"]["threads"] >= 1


def test_fused_dyn_in_compare_and_bench(quick, capsys, monkeypatch):
    """`fused-dyn` (batch, seq_q, seq_kv symbolic) timed at the spec's shape next to `fused`. At
    the shape of the serving benchmark's dynamic row (B=1, H=8, S=128, D=64, causal), whose static
    and symbolic builds (``quick``) compare() and the sweep load from the build cache."""
    from tvm_attention.bench import sweep
    from tvm_attention.bench.sweep import markdown_table, points, run_sweep
    from tvm_attention.cli import main

    # peak memory runs a fresh process per variant (seconds); not what this test is about
    monkeypatch.setattr(sweep, "tvm_first_call_peak", lambda *a: None)
    # (benchmarks build through the build cache: the sweep below times the two builds the comparison made)

    rc = main(["compare", "--batch", "1", "--heads", "8", "--seq-q", "128", "--head-dim", "64", "--causal",
               "fused", "fused-dyn", "--repeat", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "| fused-dyn | hand |" in out
    assert "fused/fused-dyn (static time / dynamic time):" in out
    res = run_sweep(points([128], [64], [True], heads=8, batch=1, tokens=None), ["fused", "fused-dyn"],
                    threads=2, repeat=1, min_repeat_ms=1, say=lambda m: None)
    dyn = next(r for r in res if r.variant == "fused-dyn")
    assert dyn.error is None and dyn.timing is not None and dyn.max_abs_err < 1e-4
    md = markdown_table(res, {})
    assert "fused-dyn/fused" in md.splitlines()[2]
