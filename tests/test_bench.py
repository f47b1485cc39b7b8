"""Benchmarks in tiny mode: outputs, plots, failure handling, compare."""
import csv
import json

import pytest

from tvm_attention.bench import sweep
from tvm_attention.bench.compare import compare, format_compare
from tvm_attention.bench.sweep import Result, points, run_sweep
from tvm_attention.cli import main
from tvm_attention.spec import AttentionSpec

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", "--tiny", "--out", str(out)]) == 0
    return out


def test_tiny_bench_writes_table_csv_json(tiny):
    data = json.loads((tiny / "bench.json").read_text())
    rows = data["rows"]
    assert {r["variant"] for r in rows} == {"fused", "materialized"}
    assert sorted({r["seq_q"] for r in rows}) == [256, 512]
    for r in rows:
        assert r["error"] is None, r
        assert r["gflops"] > 0 and r["median_ms"] > 0 and r["max_abs_err"] < 1e-4
        assert r["peak_extra_bytes"] is not None
    mat = [r for r in rows if r["variant"] == "materialized" and r["seq_q"] == 512][0]
    fused = [r for r in rows if r["variant"] == "fused" and r["seq_q"] == 512][0]
    assert mat["modeled_bytes"] > fused["modeled_bytes"]
    # the materialized build's first call holds its 2 × 512² score matrix (2 MiB)
    assert mat["peak_extra_bytes"] >= 2 * 512 * 512 * 4
    assert data["meta"]["sgemm_gflops"] > 0 and data["meta"]["copy_gbps"] > 0
    with open(tiny / "bench.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert "fused/materialized" in (tiny / "bench.md").read_text()


def test_tiny_bench_plots_are_pngs_with_series(tiny):
    import matplotlib.image as mpimg

    for name in ("throughput_seq.png", "memory_seq.png", "roofline.png"):
        path = tiny / name
        assert path.read_bytes()[:8] == PNG
        img = mpimg.imread(path)
        assert img.shape[0] > 100 and img.shape[1] > 100


def test_plot_series_match_variants(tmp_path):
    from tvm_attention.bench.plots import write_plots
    from tvm_attention.timing import Timing

    spec = AttentionSpec(batch=1, heads=1, seq_q=256, head_dim=64)
    results = [Result(spec, "seq", v, timing=Timing(1e-3, 1e-5, 3), peak_extra_bytes=1 << 20)
               for v in ("fused", "materialized", "torch")]
    results.append(Result(spec, "seq", "numpy", error="boom"))
    series = write_plots(results, {"sgemm_gflops": 100.0, "copy_gbps": 10.0}, tmp_path)
    assert series["throughput_seq.png"] == ["fused", "materialized", "torch"]  # failed numpy absent
    assert series["roofline.png"] == ["fused", "materialized", "torch"]


def test_failing_variant_is_recorded_not_fatal(monkeypatch):
    real = sweep._tvm_runner

    def flaky(spec, variant):
        if variant == "materialized":
            raise MemoryError("pretend the S×S buffer did not fit")
        return real(spec, variant)

    monkeypatch.setattr(sweep, "_tvm_runner", flaky)
    pts = points([128], [64], [False], heads=1, batch=1, tokens=None)
    res = run_sweep(pts, ["materialized", "fused", "fused-tuned"], threads=2, repeat=1, min_repeat_ms=1,
                    say=lambda m: None)
    by = {r.variant: r for r in res}
    assert by["materialized"].error.startswith("out of memory")
    assert by["fused"].timing is not None and by["fused"].error is None
    assert by["fused-tuned"].error == "skipped: no tuning log for this spec"


def test_constant_token_points():
    pts = points([256, 512, 1024], [64], [True], heads=2, batch=1, tokens=1024)
    tokens = [(s.batch, s.seq_q) for m, s in pts if m == "tokens"]
    assert tokens == [(4, 256), (2, 512), (1, 1024)]


def test_compare_side_by_side(tmp_path, capsys):
    spec = AttentionSpec(batch=1, heads=2, seq_q=256, head_dim=64, causal=True)
    entries = compare(spec, ["fused", 'fused:{"block_n": 128, "s_rows": 8}', "materialized", "rowcache",
                             "nope"], repeat=2)
    by = {e.label: e for e in entries}
    assert by["fused"].audit == "fused" and by["materialized"].audit == "not fused"
    assert by['fused:{"block_n": 128, "s_rows": 8}'].knobs["block_n"] == 128
    assert by["fused"].on_chip_bytes["local"] > 0 and by["materialized"].global_bytes > 0
    assert all(e.max_abs_err < 1e-4 for e in entries if e.error is None)
    assert "unknown schedule 'nope'" in by["nope"].error
    table = format_compare(spec, entries)
    assert table.count("\n") == 2 + len(entries)
    rc = main(["compare", "--batch", "1", "--heads", "1", "--seq-q", "128", "--head-dim", "64",
               "fused", "materialized", "--repeat", "1", "--plot", str(tmp_path / "c.png")])
    assert rc == 0 and (tmp_path / "c.png").read_bytes()[:8] == PNG
    assert "| fused | hand |" in capsys.readouterr().out
