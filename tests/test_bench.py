"""Benchmarks in tiny mode: outputs, plots, failure handling, compare."""
import csv
import json
import time

import pytest

from tvm_attention.bench import sweep
from tvm_attention.bench.compare import compare, format_compare
from tvm_attention.bench.sweep import Result, points, run_sweep
from tvm_attention.cli import main
from tvm_attention.spec import AttentionSpec

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import functools

    from tvm_attention.bench import cpu

    out = tmp_path_factory.mktemp("bench")
    # The run measures its roofs twice (start and end) and sgemm once, ~5.5 s of the fixture's
    # 18 s at the product's sizes. These tests check how the roofs enter the report (present,
    # positive, the fractions computed from them), not their values: a 16 MiB read and a 512²
    # sgemm measure the same code paths in ~0.3 s. The product's sizes are measured by
    # test_roof_is_the_fma_peak_of_a_tvm_loop (≥ 256 MiB read).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "read_bandwidth", functools.partial(cpu.read_bandwidth, mib=16))
        mp.setattr(cpu, "sgemm_ceiling", functools.partial(cpu.sgemm_ceiling, n=512))
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
    meta = data["meta"]
    # the roof: TVM's FMA loop and streaming-read bandwidth, measured in the same run, with how
    assert meta["fma_peak_gflops"] > 0 and meta["read_gbps"] > 0 and meta["sgemm_gflops"] > 0
    assert "vfmadd" in meta["ceilings"]["fma_peak"]["method"]
    assert "read" in meta["ceilings"]["read_bandwidth"]["method"]
    for r in rows:
        assert r["fma_peak_frac"] == pytest.approx(r["gflops"] / meta["fma_peak_gflops"])
        assert r["read_bw_frac"] == pytest.approx(
            r["modeled_bytes"] / (r["median_ms"] * 1e-3) / 1e9 / meta["read_gbps"])
    with open(tiny / "bench.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    md = (tiny / "bench.md").read_text()
    assert "fused/materialized" in md and "% of FMA peak" in md and "sgemm" in md


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
    series = write_plots(results, {"fma_peak_gflops": 100.0, "read_gbps": 10.0, "sgemm_gflops": 80.0}, tmp_path)
    assert series["throughput_seq.png"] == ["fused", "materialized", "torch"]  # failed numpy absent
    assert series["roofline.png"] == ["fused", "materialized", "torch"]
    from tvm_attention.bench.plots import roofs

    assert roofs({"fma_peak_gflops": 100.0, "read_gbps": 10.0, "sgemm_gflops": 80.0}) == (100.0, 10.0)


def test_roofs_measured_again_keep_the_better(monkeypatch):
    """The sweep measures the roofs at its start and end and keeps the better of each: a roof
    measured while another process held a core must not sit under the points."""
    from tvm_attention.bench import cpu

    def fake(kind, value):
        class M:
            gflops = gbps = value
            fma_instructions, chains, lanes, threads, seconds, bytes_read = 1, 12, 16, 2, 0.1, 2**28

            def to_meta(self):
                return {"gflops" if kind == "fma" else "gbps": value, "method": kind}
        return M()

    values = iter([(200.0, 30.0), (100.0, 40.0)])
    cur = {}

    def peak(threads=None):
        cur["v"] = next(values)
        return fake("fma", cur["v"][0])

    monkeypatch.setattr(cpu, "fma_peak", peak)
    monkeypatch.setattr(cpu, "read_bandwidth", lambda threads=None: fake("read", cur["v"][1]))
    monkeypatch.setattr(cpu, "sgemm_ceiling", lambda: 150.0)
    first = cpu.measure_ceilings(2)
    both = cpu.measure_ceilings(2, earlier=first)
    assert (both["fma_peak_gflops"], both["read_gbps"], both["sgemm_gflops"]) == (200.0, 40.0, 150.0)
    assert both["ceilings"]["fma_peak"]["measured_gflops"] == [200.0, 100.0]
    assert both["ceilings"]["read_bandwidth"]["measured_gbps"] == [30.0, 40.0]


def test_failing_variant_is_recorded_not_fatal(monkeypatch):
    real = sweep._tvm_runner

    def flaky(spec, variant):
        if variant == "materialized":
            raise MemoryError("pretend the S×S buffer did not fit")
        return real(spec, variant)

    monkeypatch.setattr(sweep, "_tvm_runner", flaky)
    # fused's peak memory would run a fresh process importing TVM (4-5 s of CPU): not what this
    # test is about (the tiny bench above measures every row's in its fresh process)
    monkeypatch.setattr(sweep, "tvm_first_call_peak", lambda *a: None)
    pts = points([128], [64], [False], heads=1, batch=1, tokens=None)
    res = run_sweep(pts, ["materialized", "fused", "fused-tuned"], threads=2, repeat=1, min_repeat_ms=1,
                    say=lambda m: None)
    by = {r.variant: r for r in res}
    assert by["materialized"].error.startswith("out of memory")
    assert by["fused"].timing is not None and by["fused"].error is None
    assert by["fused-tuned"].error == ("skipped: no tuning log for this spec "
                                       "(make one: tvm-attention tune with the same spec flags)")


def test_constant_token_points():
    pts = points([256, 512, 1024], [64], [True], heads=2, batch=1, tokens=1024)
    tokens = [(s.batch, s.seq_q) for m, s in pts if m == "tokens"]
    assert tokens == [(4, 256), (2, 512), (1, 1024)]


def test_compare_side_by_side(tiny, tmp_path, capsys, monkeypatch):
    from tvm_attention.target import resolve_target, vector_lanes

    # benchmarks build through the build cache: the command line below compares builds compare()
    # made, and compare() takes fused and materialized from the tiny bench (its first point: this spec)
    spec = AttentionSpec(batch=1, heads=2, seq_q=256, head_dim=64)
    # a knob set that fits the host's registers: 8 keys per S_gemm block on AVX-512's 32 zmm
    # over 32 rows (2 zmm), 2 on AVX2's 16 ymm (32 rows: 4 ymm)
    knobs = 'fused:{"block_m": 32, "block_n": 128, "s_rows": %d}' % (
        8 if vector_lanes(resolve_target("llvm")) == 16 else 2)
    entries = compare(spec, ["fused", knobs, "materialized", "rowcache", "nope"], repeat=2)
    by = {e.label: e for e in entries}
    assert by["fused"].audit == "fused" and by["materialized"].audit == "not fused"
    assert by[knobs].error is None and by[knobs].knobs["block_n"] == 128
    assert by["fused"].on_chip_bytes["local"] > 0 and by["materialized"].global_bytes > 0
    assert all(e.max_abs_err < 1e-4 for e in entries if e.error is None)
    assert "unknown schedule 'nope'" in by["nope"].error
    table = format_compare(spec, entries)
    assert table.count("\n") == 2 + len(entries)
    rc = main(["compare", "--batch", "1", "--heads", "2", "--seq-q", "256", "--head-dim", "64",
               "fused", "materialized", "--repeat", "1", "--plot", str(tmp_path / "c.png")])
    assert rc == 0 and (tmp_path / "c.png").read_bytes()[:8] == PNG
    assert "| fused | hand |" in capsys.readouterr().out


def test_compare_without_a_tuning_log_is_an_error_that_says_how_to_make_one(capsys, monkeypatch):
    """``fused-tuned`` with no log for the spec: nothing is built or timed, and the command line
    says so as its error (exit 2, no traceback) with the folders looked in and ``tvm-attention tune``."""
    from tvm_attention.bench import compare as cmp
    from tvm_attention.logs import NoTuningLog

    monkeypatch.setattr(cmp, "build_kernel", lambda *a, **k: pytest.fail("built before the missing log was found"))
    spec = AttentionSpec(batch=1, heads=2, seq_q=96, head_dim=64)  # no committed log, an empty user cache
    with pytest.raises(NoTuningLog, match="tvm-attention tune"):
        compare(spec, ["fused", "fused-tuned"], repeat=1)
    rc = main(["compare", "--batch", "1", "--heads", "2", "--seq-q", "96", "--head-dim", "64", "fused", "fused-tuned"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("tvm-attention compare: error: no tuning log for b1_h2_kv2_q96_k96_d64")
    assert "tvm-attention tune" in err and "tuning_logs" in err


def test_measure_scale_scales_every_least_time_and_names_a_bad_value(monkeypatch):
    from tvm_attention.timing import MEASURE_SCALE_ENV, measure_ms, time_callable

    monkeypatch.setenv(MEASURE_SCALE_ENV, "0.1")
    assert (measure_ms(100), measure_ms(5), measure_ms(1)) == (10, 1, 1)  # at least 1 ms
    monkeypatch.setenv(MEASURE_SCALE_ENV, "2")
    calls = []
    t0 = time.perf_counter()
    time_callable(lambda: calls.append(time.sleep(0.005)), repeat=2, min_repeat_ms=20)
    assert time.perf_counter() - t0 >= 2 * 0.040  # each repeat ran its 20 ms doubled
    for bad in ("0", "-1", "abc", "inf", "nan"):
        monkeypatch.setenv(MEASURE_SCALE_ENV, bad)
        with pytest.raises(ValueError, match=f"{MEASURE_SCALE_ENV}={bad!r}"):
            measure_ms(100)


def test_roof_is_the_fma_peak_of_a_tvm_loop():
    """The compute roof is TVM's FMA peak (vfmadd in the assembly, every core), not sgemm — the fused
    kernel can beat OpenBLAS sgemm and must not plot above its roof; the memory roof is
    streaming-read bandwidth."""
    import time

    from tvm_attention.bench.cpu import fma_peak, read_bandwidth, sgemm_ceiling
    from tvm_attention.target import resolve_target, target_features, vector_lanes

    target = resolve_target("llvm")
    t0 = time.perf_counter()
    peak = fma_peak()
    t_peak = time.perf_counter() - t0
    assert peak.fma_instructions > 0  # fp contraction happened: the loop is FMAs
    if "avx512f" in target_features(target):
        assert peak.lanes == 16 and "zmm" in peak.fma_sample
    assert peak.lanes == vector_lanes(target)
    assert 8 <= peak.chains <= 16
    # 2 FLOP per lane per FMA, at most 2 vector FMA per cycle per thread at ≤ 6 GHz
    assert 1 < peak.gflops < 2 * peak.lanes * 2 * peak.threads * 6
    # sgemm is FMAs plus loads and packing: it cannot beat the machine's FMA peak. Another process
    # taking a core for a second halves either measurement, so measure the pair up to 3 times.
    pairs = [(peak.gflops, sgemm_ceiling())]
    while pairs[-1][0] < 0.9 * pairs[-1][1] and len(pairs) < 3:
        pairs.append((fma_peak().gflops, sgemm_ceiling()))
    assert pairs[-1][0] >= 0.9 * pairs[-1][1], pairs
    t0 = time.perf_counter()
    bw = read_bandwidth()
    t_bw = time.perf_counter() - t0
    assert bw.bytes_read >= 256 * 2**20 and 1 < bw.gbps < 2000
    assert t_peak < 10 and t_bw < 10, (t_peak, t_bw)
    meta = peak.to_meta()
    assert meta["gflops"] == peak.gflops and "vfmadd" in meta["method"]


def test_peer_peak_memory_is_measured_in_a_fresh_process(tmp_path, monkeypatch):
    """NumPy's per-(b, h) S×S float32 scores must show in its peak extra memory even after
    earlier calls in this process left the allocator holding memory (they read 0 B before)."""
    import os

    from tvm_attention.bench.peers import numpy_attention_fn, torch_sdpa_fn
    from tvm_attention.timing import aligned_inputs

    spec = AttentionSpec(batch=1, heads=2, seq_q=1024, head_dim=64)
    # An earlier, longer point (the sweep runs causal after every non-causal length) leaves
    # glibc's raised mmap threshold and a heap holding freed score matrices in this process.
    earlier = AttentionSpec(batch=1, heads=2, seq_q=2048, head_dim=64)
    numpy_attention_fn(earlier)(*aligned_inputs(earlier)[:3])
    q, k, v, _ = aligned_inputs(spec)
    numpy_attention_fn(spec)(q, k, v)
    out_bytes = spec.batch * spec.heads * spec.seq_q * spec.head_dim * 4
    # NumPy's fresh process without torch (tvm-ffi imports it where it can: 1-1.5 s of CPU there),
    # which a NumPy call never uses: a `torch` that raises ImportError, as where it is not installed
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch: not for the NumPy peer')\n")
    with monkeypatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
        r = sweep.run_variant(spec, "seq", "numpy", threads=2, repeat=1, min_repeat_ms=1)
    assert r.error is None, r.error
    assert r.peak_extra_bytes >= 4 * spec.seq_q * spec.seq_kv + out_bytes, r.peak_extra_bytes
    fn = torch_sdpa_fn(spec, 2)
    if fn is None:
        pytest.skip("torch not installed")
    for _ in range(2):
        fn(q, k, v)
    r = sweep.run_variant(spec, "seq", "torch", threads=2, repeat=1, min_repeat_ms=1)
    assert r.error is None, r.error
    # a real measurement: at least the output torch allocates and first touches
    assert r.peak_extra_bytes is not None and r.peak_extra_bytes >= out_bytes, r.peak_extra_bytes


# --- progress, Ctrl-C and an absent matplotlib (issue 47): the measurements faked or kept cheap ---

ROOFS = {"fma_peak_gflops": 100.0, "read_gbps": 10.0, "sgemm_gflops": 80.0}


def _fake_result(spec, mode, variant, *args):
    from tvm_attention.timing import Timing

    return Result(spec, mode, variant, timing=Timing(1e-3, 1e-5, 1), max_abs_err=0.0)


class _Clock:
    """A clock that moves 10 s each time it is read after the start."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 10.0
        return self.t


def test_progress_line_counts_units_with_elapsed_and_eta(monkeypatch):
    """Each point's line begins [i/N, elapsed, ETA] with N the (point, variant) units known up
    front, ETA = elapsed / i · (N − i); Ctrl-C in the middle of a point keeps its finished variants."""
    from tvm_attention.bench import Interrupted, Progress, fmt_duration

    assert [fmt_duration(s) for s in (0, 45, 72, 599, 900, 3900, float("inf"))] == \
        ["0s", "45s", "1m12s", "9m59s", "15m", "1h05m", "?"]
    monkeypatch.setattr(sweep, "run_variant", _fake_result)
    pts = points([64, 128, 256], [32], [False], heads=1, batch=1, tokens=None)
    lines = []
    clock = _Clock()
    res = run_sweep(pts, ["fused", "torch"], threads=1, say=lines.append, progress=Progress(6, clock=clock))
    assert len(res) == 6 and len(lines) == 3
    # the clock reads 10 s at the start, then +10 s at each tag (elapsed, then ETA's elapsed)
    assert lines[0].startswith("[2/6, 10s elapsed, ETA 40s] [seq B=1 S=64 D=32 float32 causal=False] fused=")
    assert lines[1].startswith("[4/6, 30s elapsed, ETA 20s] [seq B=1 S=128 ")
    assert lines[2].startswith("[6/6, 50s elapsed, done] [seq B=1 S=256 ")
    lines.clear()
    assert run_sweep(pts[:1], ["fused", "torch", "numpy"], threads=1, say=lines.append) and \
        lines[0].startswith("[3/3, ")  # the default count: this sweep's units
    monkeypatch.setattr(sweep, "run_variant", interrupted_at(4, _fake_result))
    with pytest.raises(Interrupted) as e:
        run_sweep(pts, ["fused", "materialized", "torch"], threads=1, say=lambda m: None)
    assert (e.value.completed, e.value.total) == (3, 9) and len(e.value.partial) == 3
    assert isinstance(e.value, KeyboardInterrupt)  # a caller that does not look stops as before


def interrupted_at(nth: int, fn):
    """``fn`` whose ``nth`` call raises KeyboardInterrupt (a Ctrl-C during that measurement)."""
    calls = []

    def wrapper(*args):
        calls.append(args)
        if len(calls) == nth:
            raise KeyboardInterrupt
        return fn(*args)

    return wrapper


def _cheap_cli(monkeypatch):
    """``bench`` in-process with the roofs faked (counted) and the peers' fresh-process memory probe
    skipped: the sweep's timing, errors, tables and exit codes are real."""
    from tvm_attention.bench import cpu

    roofs = []
    monkeypatch.setattr(cpu, "measure_ceilings",
                        lambda threads, say=print, earlier=None: roofs.append(1) or dict(ROOFS))
    monkeypatch.setattr(sweep, "peer_first_call_peak", lambda spec, variant, threads: None)
    return roofs


CHEAP = ["bench", "--head-dim", "32", "--causal", "no", "--no-tokens", "--heads", "1", "--variants", "numpy",
         "--repeat", "1", "--threads", "2"]


def test_ctrl_c_writes_partial_results_and_exits_130(monkeypatch, tmp_path, capsys):
    """Ctrl-C after the first point: its results are written (JSON, CSV, Markdown, marked partial),
    no plot, no closing roofs, exit 130."""
    roofs = _cheap_cli(monkeypatch)
    monkeypatch.setattr(sweep, "run_variant", interrupted_at(2, sweep.run_variant))
    assert main(CHEAP + ["--seq", "64", "128", "--out", str(tmp_path)]) == 130
    out = capsys.readouterr().out
    assert "[1/2, " in out and "ETA" in out and "interrupted after 1 of 2 measurements" in out
    assert f"partial results (interrupted after 1 of 2): {tmp_path / 'bench.json'}" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert (data["meta"]["interrupted"], data["meta"]["completed"], data["meta"]["total"]) == (True, 1, 2)
    (row,) = data["rows"]
    assert row["seq_q"] == 64 and row["variant"] == "numpy" and row["gflops"] > 0 and row["max_abs_err"] < 1e-4
    with open(tmp_path / "bench.csv") as f:
        assert [r["seq_q"] for r in csv.DictReader(f)] == ["64"]
    md = (tmp_path / "bench.md").read_text()
    assert md.startswith("**partial: interrupted after 1 of 2 measurements**") and "| seq | 1 | 64 |" in md
    assert roofs == [1] and data["meta"]["fma_peak_gflops"] == ROOFS["fma_peak_gflops"]  # the start's roofs
    assert not list(tmp_path.glob("*.png"))


def test_memory_scaling_counts_in_the_total_and_keeps_its_partial(monkeypatch, tmp_path, capsys):
    """--memory-scaling's four measurements are in N up front; Ctrl-C during them keeps the sweep's
    and theirs (a materialized run that does not fit is recorded as skipped and counted)."""
    import types

    import psutil

    _cheap_cli(monkeypatch)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=1 << 30))
    monkeypatch.setattr(sweep, "run_variant", interrupted_at(3, _fake_result))  # the fused kernel at S=65536
    assert main(CHEAP + ["--seq", "64", "--memory-scaling", "--out", str(tmp_path)]) == 130
    out = capsys.readouterr().out
    assert "5 measurements: 1 point × 1 variant + 4 of --memory-scaling" in out
    tags = [line.split("]")[0] for line in out.splitlines() if line.startswith("[")]
    assert [t.split(",")[0] for t in tags] == ["[1/5", "[2/5", "[3/5"], out
    assert "[3/5, " in out and "[memory B=1 S=32768 D=64] materialized=(skipped: S×S scores need 4 GiB" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["mode"], r["seq_q"], r["variant"]) for r in data["rows"]] == [
        ("seq", 64, "numpy"), ("memory", 32768, "fused"), ("memory", 32768, "materialized")]
    assert (data["meta"]["completed"], data["meta"]["total"]) == (3, 5)


def test_bench_and_compare_without_matplotlib(monkeypatch, tmp_path, capsys):
    """matplotlib unimportable: one note before the sweep (or the builds), the tables written, no
    PNG, exit 0."""
    import sys

    from tvm_attention.bench import compare as compare_mod

    _cheap_cli(monkeypatch)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    note = ('note: matplotlib is not installed (pip install "tvm-attention[plots]"): the sweep runs, '
            "its plots are skipped")
    assert main(CHEAP + ["--seq", "64", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(note) == 1 and out.index(note) < out.index("[1/1, ")
    assert "plot:" not in out and not list(tmp_path.glob("*.png"))
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["gflops"] > 0
    assert (tmp_path / "bench.md").exists() and (tmp_path / "bench.csv").exists()
    assert main(CHEAP + ["--seq", "64", "--no-plots", "--out", str(tmp_path)]) == 0
    assert "matplotlib" not in capsys.readouterr().out  # --no-plots: nothing to say

    real, said = compare_mod.compare, []

    def spy(*args, **kwargs):
        said.append(capsys.readouterr().out)  # what was printed before any build
        return real(*args, **kwargs)

    monkeypatch.setattr(compare_mod, "compare", spy)
    png = tmp_path / "c.png"
    rc = main(["compare", "--batch", "1", "--heads", "1", "--seq-q", "64", "--head-dim", "32", "fused",
               "--repeat", "1", "--plot", str(png)])
    assert rc == 0 and not png.exists()
    assert said == ['note: matplotlib is not installed (pip install "tvm-attention[plots]"): the comparison runs, '
                    f"its plot ({png}) is skipped\n"]
    assert "| fused | hand |" in capsys.readouterr().out


def test_decode_and_halfprec_progress_and_partial(monkeypatch, tmp_path, capsys):
    """``bench --decode`` / ``--halfprec``: [i/N, elapsed, ETA] per point, N known up front; Ctrl-C
    in the second point writes the first (its ratios against the start's roof), marked partial, 130.
    Builds, timers and roofs faked: the loops, the report and its writing are real."""
    import types

    from tvm_attention.bench import decode, halfprec

    monkeypatch.setattr(decode, "build_kernel", lambda spec, knobs=None, **_: types.SimpleNamespace())  # cache=...
    monkeypatch.setattr(decode, "stream_read_gbps", lambda nbytes: 20.0)
    monkeypatch.setattr(decode, "fma_peak", lambda threads: types.SimpleNamespace(gflops=100.0))
    monkeypatch.setattr(decode, "_torch_timer", lambda *a: None)
    timers = []

    def timer(built, args, min_repeat_ms):
        timers.append(1)
        if len(timers) == 4:  # the second point's kvcache (3 layouts a point)
            raise KeyboardInterrupt
        return lambda: 1e-4

    monkeypatch.setattr(decode, "_tvm_timer", timer)
    rc = main(["bench", "--decode", "--tiny", "--decode-batch", "1", "2", "--threads", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 130 and "2 points" in out and "[1/2, " in out and "ETA" in out, out
    assert "interrupted after 1 of 2 points" in out and "partial results: " in out
    report = json.loads((tmp_path / "decode.json").read_text())
    assert (report["meta"]["interrupted"], report["meta"]["completed"], report["meta"]["total"]) == (True, 1, 2)
    (row,) = report["rows"]
    assert row["batch"] == 1 and report["meta"]["stream_gbps"] == [20.0]  # no closing stream read
    assert row["kvcache_roof"] == pytest.approx(row["kvcache_gbps"] / 20.0)
    assert (tmp_path / "decode.md").read_text().startswith("**partial: interrupted after 1 of 2 points**")

    from tvm_attention.bench import cpu

    monkeypatch.setattr(cpu, "fma_peak", lambda threads: types.SimpleNamespace(gflops=100.0))
    monkeypatch.setattr(cpu, "bf16_dot_peak", lambda threads: None)
    done = []

    def point(cfg, d, *args):
        done.append(d)
        if len(done) == 2:
            raise KeyboardInterrupt
        return {"head_dim": d, "seq": cfg.seq, "heads": cfg.heads, "causal": cfg.causal, "fp32_ms": 1.0,
                "fp32_gflops": 50.0}

    monkeypatch.setattr(halfprec, "_point", point)
    assert main(["bench", "--halfprec", "--threads", "2", "--out", str(tmp_path)]) == 130
    out = capsys.readouterr().out
    assert "[1/2, " in out and "ETA" in out and "[D=64] fp32 50.0 GFLOP/s" in out
    report = json.loads((tmp_path / "halfprec.json").read_text())
    assert [r["head_dim"] for r in report["rows"]] == [64] and report["meta"]["completed"] == 1
    assert (tmp_path / "halfprec.md").read_text().startswith("**partial: interrupted after 1 of 2 points**")


def test_every_benchmark_has_the_cli_as_its_front_door(monkeypatch, tmp_path, capsys):
    """`bench --serving`, `--variant-costs`, `--loader` start the bench package's benchmark with
    the flags given (one door: no scripts/bench_*.py duplicates them); two modes at once, or an
    unknown --only pair, exit 2 naming them."""
    import dataclasses
    from pathlib import Path

    from tvm_attention.bench import loader_calls, serving, variants

    root = Path(__file__).resolve().parents[1]
    assert sorted(p.name for p in (root / "scripts").glob("bench_*.py")) == ["bench_index_checks.py"]
    seen = {}

    def fake_serving(cfg, threads=None, quick=False, say=print):
        seen["serving"] = (cfg, threads, quick)
        return {"meta": {}, "dynamic": [], "varlen": [], "loader": []}

    def fake_variants(cfg, threads=None, only=(), say=print):
        seen["variants"] = (cfg, threads, only)
        return {"meta": {}, "rows": []}

    monkeypatch.setattr(serving, "run", fake_serving)
    monkeypatch.setattr(serving, "markdown", lambda report: "table")
    monkeypatch.setattr(variants, "run", fake_variants)
    monkeypatch.setattr(variants, "markdown", lambda report: "table")
    monkeypatch.setattr(loader_calls, "run", lambda *a: seen.setdefault("loader", []).append(a))
    assert main(["bench", "--serving", "--tiny", "--rounds", "3", "--threads", "1", "--out", str(tmp_path)]) == 0
    assert seen["serving"] == (dataclasses.replace(serving.quick_config(), rounds=3), 1, True)
    assert (tmp_path / "serving.json").exists()
    assert main(["bench", "--variant-costs", "--only", "window_prefill", "--out", str(tmp_path)]) == 0
    assert seen["variants"] == (variants.Config(), None, ("window_prefill",))
    assert (tmp_path / "variants.md").exists()
    assert main(["bench", "--loader", "--decode-batch", "1", "4", "--calls", "7"]) == 0
    assert seen["loader"] == [(1, 256, 7, loader_calls.ROUNDS), (4, 256, 7, loader_calls.ROUNDS)]
    capsys.readouterr()
    assert main(["bench", "--serving", "--decode"]) == 2
    assert "choose one of --decode, --serving" in capsys.readouterr().err
    assert main(["bench", "--variant-costs", "--only", "bogus"]) == 2
    assert "unknown pair(s) bogus" in capsys.readouterr().err

def test_loader_benchmark_times_each_way_of_calling(capsys):
    """`bench --loader` at a small decode step: the four ways of calling, each against the bare call."""
    assert main(["bench", "--loader", "--decode-cache", "64", "--calls", "5", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "batch 1, 64 keys, 1 thread; best of 2 rounds of 5 calls" in out
    for way in ("bare function", "loader", "loader, out=", "loader, read-only cache"):
        assert f"  {way:<24} " in out and "x the bare call" in out


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 5e-3), ("int8", 2e-2)])
def test_llamacpp_decode_peer_computes_attention(dtype, atol):
    """The llama.cpp peer (bench.peers.GgmlDecode) reads our (B, KH, cache, D) arrays in ggml's
    innermost-first shapes: its step matches the float64 reference within its cache type's
    rounding (F32, F16, Q8_0), GQA and a batch of two included."""
    pytest.importorskip("ggml", reason="ggml-python (llama.cpp's ggml, an optional peer) is not installed")
    import numpy as np

    from tvm_attention.bench.peers import GgmlDecode
    from tvm_attention.reference import reference_attention

    spec = AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in (spec.q_shape, spec.kv_shape, spec.kv_shape))
    peer, kind = GgmlDecode.create(q, k, v, dtype, spec.scale, threads=2)
    assert kind == {"float32": "F32", "bfloat16": "F16", "int8": "Q8_0"}[dtype]
    try:
        peer.call()
        np.testing.assert_allclose(peer.output(), reference_attention(spec, q, k, v), atol=atol)
    finally:
        peer.close()
    none, why = GgmlDecode.create(q, k, v, "float8_e5m2", spec.scale, threads=2)
    assert none is None and "float8_e5m2" in why
