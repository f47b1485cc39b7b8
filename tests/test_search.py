"""Whether the search pays: random sampling and a warm-started cost model beside the default
search, the held-out evaluation and the efficiency report in tiny mode."""
import json
import runpy
import sys
from pathlib import Path

import pytest

from tvm_attention import cli
from tvm_attention.bench.heldout import held_out_cases
from tvm_attention.bench.search import trials_to_reach, tuning_curve
from tvm_attention.spec import AttentionSpec
from tvm_attention.threads import set_num_threads
from tvm_attention.tune.driver import tune

ROOT = Path(__file__).resolve().parents[1]
A = AttentionSpec(batch=1, heads=2, seq_q=128, head_dim=64, causal=True)
B = AttentionSpec(batch=1, heads=2, seq_q=128, head_dim=96, causal=True)


def fake_log(work: Path, spec: AttentionSpec, n: int = 2) -> Path:
    """A log of ``n`` records of ``spec``'s first task, written by TVM's JSONDatabase as a tune
    would: sampled points of the fused space with made-up run times (the warm start reads the
    records and trains on their times; nothing of it needs them measured: no tune of A)."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from tvm_attention.logs import RECORD_FILE, WORKLOAD_FILE
    from tvm_attention.schedules import cpu_fused
    from tvm_attention.target import resolve_target
    from tvm_attention.tune.tasks import make_tasks

    target = resolve_target("llvm")
    work.mkdir(parents=True)
    db = ms.database.JSONDatabase(path_workload=str(work / WORKLOAD_FILE),
                                  path_tuning_record=str(work / RECORD_FILE), allow_missing=True)
    task = make_tasks(spec, target, "fused")[0]
    wl = db.commit_workload(task.mod)
    args = ms.arg_info.ArgInfo.from_prim_func(task.mod["main"])
    for i in range(n):
        sch = tvm.s_tir.Schedule(task.mod, seed=i + 1)
        cpu_fused.design_space(spec, target)(sch)
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, wl, [1e-3 * (i + 1)], target, args))
    return work


@pytest.fixture(scope="module", autouse=True)
def _threads_back():
    """Every tune here runs on one thread (``threads=1``, ``--threads 1``); the file after this
    one, in the same process, gets the session's setting back."""
    yield
    set_num_threads()


@pytest.fixture(scope="module", autouse=True)
def tasks_once():
    """Each spec's tasks made once for the file: every tune made them again, a workload
    generated per task (the scripts below tune one decode step several times, ~10 s of TVMScript
    in all; B is tuned twice by ``logs``). The same tasks: the tunes and reports are unchanged."""
    from conftest import make_tasks_once

    from tvm_attention.tune import driver

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(driver, "make_tasks", make_tasks_once())
        yield


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    root = tmp_path_factory.mktemp("search")
    fake_log(root / "a", A)  # the warm start's source: another spec's log
    lines = []
    # One trial each: what is checked is the log each search writes (built, validated) and what the
    # warm start reads, not how far the search gets; a second candidate was one more build per tune.
    # One thread: the cost model (XGBoost) trains on the runtime's thread count, and on two each
    # training on these few records cost ~2 s of CPU, its OpenMP threads mostly waiting for each
    # other (~0.3 s on one); the tunes of the report test below keep these tunes' workers (kept
    # per thread count) and train on one thread too.
    tune(B, trials=1, per_round=1, work_dir=root / "random", search="random", progress=lambda m: None, threads=1)
    tune(B, trials=1, per_round=1, work_dir=root / "warm", warm_start=root / "a", progress=lines.append,
         threads=1)
    return root, lines


def test_random_search_log_builds_validates_and_is_fused(logs, tmp_path):
    """`build --from-log` of the random search's log (in this process: test_tune's
    test_tuned_log_reloads_in_a_fresh_process is the fresh-process reload of a log)."""
    root, _ = logs
    assert len(tuning_curve(B, root / "random")) == 1
    out = tmp_path / "art"
    assert cli.main(["build", "--batch", "1", "--heads", "2", "--seq-q", "128", "--head-dim", "96", "--causal",
                     "--from-log", str(root / "random"), "--out", str(out)]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["schedule"]["source"] == "tuned" and m["validation"]["passed"]
    assert m["audit"]["verdict"] == "fused"


def test_warm_start_reads_another_specs_log(logs):
    root, lines = logs
    assert any(ln.startswith("warm start: the cost model learned from 2 record(s)") for ln in lines), lines
    assert len(tuning_curve(B, root / "warm")) == 1
    # the other spec's records are not B's: B's log holds only its own
    assert tuning_curve(A, root / "warm") == []


def test_search_flags_refuse_what_cannot_work(tmp_path, capsys):
    base = ["tune", "--batch", "1", "--heads", "2", "--seq-q", "128", "--head-dim", "64", "--trials", "2",
            "--work-dir", str(tmp_path / "w")]
    assert cli.main(base + ["--warm-start", str(tmp_path / "nothing")]) == 2
    assert "no tuning log there" in capsys.readouterr().err
    (tmp_path / "x").mkdir()
    assert cli.main(base + ["--search", "random", "--warm-start", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "needs search='xgb'" in err or "no tuning log there" in err


def test_trials_to_reach():
    curve = [(1, 10.0), (2, 10.0), (3, 19.0), (4, 20.0)]
    assert trials_to_reach(curve, 19.0) == 3 and trials_to_reach(curve, 25.0) is None


def test_held_out_cases_are_what_the_issue_names():
    cases = {c.name: c for c in held_out_cases()}
    assert cases["avx2"].target["mcpu"] == "haswell"
    assert {cases["d96"].spec.head_dim, cases["d256"].spec.head_dim} == {96, 256}
    assert cases["gqa4"].spec.group_size == 4 and cases["gqa8"].spec.group_size == 8
    assert cases["decode_b1"].spec.seq_q == 1 and cases["decode_b1"].spec.batch == 1
    assert cases["decode_b8"].spec.batch == 8
    # the paged decode steps, tuned in pages (too long for tiny mode: test_kvcache tunes one)
    from tvm_attention.target import resolve_target
    from tvm_attention.task_mods import tunes_as_paged

    assert all(tunes_as_paged(cases[f"paged_b{b}"].spec, resolve_target("llvm")) for b in (1, 8))
    assert not any(c.spec.layout == "paged" for c in held_out_cases(tiny=True))


def run_script(name, args, monkeypatch, capsys):
    """Run scripts/NAME's main() with ARGS in this process (a fresh process would import TVM and
    start the tuner's workers again: 15-20 s here). Returns (exit code, stdout)."""
    main = runpy.run_path(str(ROOT / "scripts" / name))["main"]  # defined, not run (not __main__)
    monkeypatch.setattr(sys, "argv", [name, *args])
    capsys.readouterr()
    rc = main()
    return rc, capsys.readouterr().out


def test_held_out_and_efficiency_reports_in_tiny_mode(logs, tmp_path, monkeypatch, capsys):
    # The two scripts tune one decode step several times (held-out, both arms), each tune's
    # tasks made once for the file (tasks_once).
    out = tmp_path / "ho"
    # One trial per tune and one timing repeat: the reports' plumbing is what is checked, not the search.
    # One thread, as the tunes of `logs` (whose workers these tunes take over): see there.
    rc, stdout = run_script("search_report.py", ["--held-out", "--tiny", "--trials", "1", "--only", "decode_b8",
                                                 "--repeat", "1", "--threads", "1", "--out", str(out)],
                            monkeypatch, capsys)
    assert rc == 0, stdout
    assert "| decode_b8 |" in stdout and "geometric mean" in stdout
    res = json.loads((out / "heldout.json").read_text())["results"]
    assert len(res) == 1 and res[0]["selected"] in ("tuned", "hand") and res[0]["hand_s"] > 0
    if res[0]["selected"] == "hand":
        assert res[0]["ratio_selected"] == 1.0  # build keeps the hand kernel: no loss by construction
    eff = tmp_path / "eff"
    rc, stdout = run_script("search_efficiency.py", ["--tiny", "--cases", "decode_b8", "--trials", "1",
                                                     "--xgb-from", str(out), "--arms", "xgb", "random",
                                                     "--threads", "1", "--out", str(eff)], monkeypatch, capsys)
    assert rc == 0, stdout
    assert "| decode_b8 | xgb |" in stdout and "| decode_b8 | random |" in stdout
    rows = json.loads((eff / "efficiency.json").read_text())["rows"]
    assert {r["arm"] for r in rows} == {"xgb", "random"} and all(r["best_gflops"] for r in rows)
    assert (eff / "efficiency.png").stat().st_size > 1000
