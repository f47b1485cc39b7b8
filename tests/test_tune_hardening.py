"""Tuning under stress: one tune per log folder, readers that skip bad lines, resume by target,
the missing final newline, Ctrl-C in every phase, and the per-user default log folder."""
import atexit
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import tvm
from tvm.target import Target

from tvm_attention.schedules import cpu_fused
from tvm_attention import cli, paths
from tvm_attention.pipeline import build_best
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target
from tvm_attention import logs
from tvm_attention.tune.driver import tune
from tvm_attention.logs import (LOCK_FILE, RECORD_FILE, WORKLOAD_FILE, LogError, LogLocked,
                                     best_records, open_database, parse_logs, target_key, tune_lock)
from tvm_attention.tune.tasks import make_tasks

# Tuning logs go to the user cache by default: conftest points it at a temporary folder.

TARGET = resolve_target("llvm")
OTHER = Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})  # another CPU: another target key
SPEC = AttentionSpec(batch=1, heads=1, seq_q=64, head_dim=16)
SPEC_ARGS = ["--batch", "1", "--heads", "1", "--seq-q", "64", "--head-dim", "16"]


@functools.lru_cache(maxsize=None)
def _tasks() -> list:
    """SPEC's tasks, made once for the file (~0.3 s each time)."""
    return make_tasks(SPEC, TARGET, "fused")


#: (n, target, tasks) -> a log fake_log wrote, copied for each later caller (most tests want the
#: same 2-record log: each paid ~0.3 s to sample and write it again); removed at exit
_FAKE_LOGS: dict[tuple, Path] = {}


def fake_log(work: Path, n: int = 2, target: Target = TARGET, tasks: int = 1) -> Path:
    """A log of ``n`` records per task for SPEC, written by TVM's JSONDatabase as a tune would:
    sampled points of the fused space with made-up run times (no measuring: milliseconds). Each
    kind is written once per process and copied into ``work``."""
    key = (n, str(target), tasks)
    if key not in _FAKE_LOGS:
        made = Path(tempfile.mkdtemp(prefix="tvma-fake-log-"))
        atexit.register(shutil.rmtree, made, True)
        _FAKE_LOGS[key] = _write_fake_log(made, n, target, tasks)
    shutil.copytree(_FAKE_LOGS[key], work, dirs_exist_ok=True)
    return work


def _write_fake_log(work: Path, n: int, target: Target, tasks: int) -> Path:
    from tvm.s_tir import meta_schedule as ms

    work.mkdir(parents=True, exist_ok=True)
    db = ms.database.JSONDatabase(path_workload=str(work / WORKLOAD_FILE),
                                  path_tuning_record=str(work / RECORD_FILE), allow_missing=True)
    for t, task in enumerate(_tasks()[:tasks]):
        wl = db.commit_workload(task.mod)
        args = ms.arg_info.ArgInfo.from_prim_func(task.mod["main"])
        for i in range(n):
            sch = tvm.s_tir.Schedule(task.mod, seed=100 * t + i + 1)
            cpu_fused.design_space(SPEC, TARGET)(sch)
            db.commit_tuning_record(ms.database.TuningRecord(sch.trace, wl, [1e-3 * (i + 1)], target, args))
    return work


def log_used(built) -> str | None:
    """The log a build took its record from (also when timing kept the hand build instead)."""
    return built.log_dir or (built.selection or {}).get("tuned_log")


def record_lines(work: Path) -> list[str]:
    return (work / RECORD_FILE).read_text().splitlines()


# ---- the per-user default folder (issue 17) --------------------------------------------------


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TVM_ATTENTION_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("TVM_ATTENTION_CACHE_DIR")
    assert paths.cache_dir() == tmp_path / "xdg" / "tvm-attention"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "tvm-attention"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "tvm-attention"


def test_tune_writes_to_the_user_cache_by_default(monkeypatch, tmp_path):
    monkeypatch.setenv("TVM_ATTENTION_CACHE_DIR", str(tmp_path / "cache"))
    work = logs.tune_work_dir(SPEC, TARGET)
    assert work == tmp_path / "cache" / "tuning_logs" / target_key(TARGET) / SPEC.short_name()
    assert logs.repo_logs_root() not in work.parents
    # The tune's folder is the one whose lock it takes: holding it makes tune() name it at once.
    with tune_lock(work):
        with pytest.raises(LogLocked, match=str(work)):
            tune(SPEC, trials=1, progress=lambda m: None)


def test_build_looks_in_the_user_log_then_the_committed_one(monkeypatch, tmp_path):
    monkeypatch.setenv("TVM_ATTENTION_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(logs, "repo_logs_root", lambda: tmp_path / "repo")
    user, repo = logs.search_dirs(SPEC, TARGET)
    assert user == logs.tune_work_dir(SPEC, TARGET) and repo == tmp_path / "repo" / user.relative_to(
        tmp_path / "cache" / "tuning_logs")
    # Every build through the run's build cache (cache=True): the hand kernel and the one tuned
    # record (fake_log's seeds: the repo's and the user's logs hold the same traces) are built
    # once; which log each build took is what is checked.
    said = []
    built, _ = build_best(SPEC, say=said.append, cache=True)  # no log anywhere: the hand schedule, and why
    assert built.source == "hand"
    assert any("no tuning log for" in m and str(user) in m and str(repo) in m for m in said), said
    fake_log(repo)  # only the committed log: it is used
    built, v = build_best(SPEC, say=said.append, cache=True)
    assert v.passed and log_used(built) == str(repo)
    fake_log(user, target=OTHER)  # a user log without a record for this target: still the committed one
    built, _ = build_best(SPEC, say=said.append, cache=True)
    assert log_used(built) == str(repo)
    shutil.rmtree(user)
    fake_log(user)  # a usable user log wins
    built, _ = build_best(SPEC, say=said.append, cache=True)
    assert log_used(built) == str(user)
    assert str(user) in cli.log_line(built.schedule_info())  # what build, run and inspect print


def test_the_committed_logs_of_other_cpu_names_are_found_by_features(monkeypatch, tmp_path):
    """A committed log measured on another target key (a VM that reports another CPU model) is
    taken where this target's code may use every ISA feature the log's could, at the same core
    count: closest feature set first; never one whose code may use a feature this host lacks."""
    monkeypatch.setenv("TVM_ATTENTION_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(logs, "repo_logs_root", lambda: tmp_path / "repo")
    cores = int(TARGET.attrs["num-cores"])

    def cpu(mcpu, *mattr, n=cores):
        return Target({"kind": "llvm", "mcpu": mcpu, "num-cores": n, **({"mattr": list(mattr)} if mattr else {})})

    v2, v3 = cpu("x86-64-v2"), cpu("x86-64-v3")
    nowhere = cpu("x86-64", "+sse4a", "+amx-tile")  # AMD's sse4a and Intel's AMX: no CPU has both
    other_cores = cpu("x86-64-v2", n=cores + 1)
    for t in (v2, v3, nowhere, other_cores):
        fake_log(logs.log_folder(tmp_path / "repo", SPEC, t), target=t)
    assert logs.usable_on(v2, TARGET) and logs.usable_on(v3, TARGET) and logs.usable_on(TARGET, TARGET)
    assert not logs.usable_on(nowhere, TARGET) and not logs.usable_on(other_cores, TARGET)
    assert not logs.usable_on(TARGET, v2) or TARGET.attrs["mcpu"] == "x86-64-v2"
    found = logs.committed_elsewhere(SPEC, TARGET)
    # (under TVM_ATTENTION_HOST_CPU=x86-64-v3 that log is this target's own, not another's)
    assert found == [logs.log_folder(tmp_path / "repo", SPEC, t) for t in (v3, v2)
                     if target_key(t) != target_key(TARGET)], found
    assert logs.search_dirs(SPEC, TARGET, elsewhere=True)[2:] == found
    assert logs.best_records(SPEC, TARGET, "fused", found[0]) == []  # by the exact key, nothing
    assert len(logs.best_records(SPEC, TARGET, "fused", found[0], elsewhere=True)) == 2
    built, v = build_best(SPEC, say=lambda m: None, cache=True)
    first = next(d for d in logs.search_dirs(SPEC, TARGET, elsewhere=True) if (d / RECORD_FILE).exists())
    assert first == found[0] or str(TARGET.attrs["mcpu"]) == "x86-64-v3"
    assert v.passed and log_used(built) == str(first)
    fake_log(logs.committed_work_dir(SPEC, TARGET))  # this target's own committed log comes first
    built, _ = build_best(SPEC, say=lambda m: None, cache=True)
    assert log_used(built) == str(logs.committed_work_dir(SPEC, TARGET))


def test_the_committed_logs_are_found_from_any_folder(monkeypatch, tmp_path):
    """``repo_logs_root`` looked two folders above the package, then at ./tuning_logs: a build
    run anywhere but the checkout's root silently used the hand schedule (issue 41). It is the
    ``tvm_attention.tuning_logs`` package's folder now (the checkout's tuning_logs/ here)."""
    repo = Path(__file__).resolve().parents[1] / "tuning_logs"
    monkeypatch.chdir(tmp_path)
    assert logs.repo_logs_root().resolve() == repo
    assert logs.committed_work_dir(SPEC, TARGET).is_absolute()
    said = []
    built, _ = build_best(SPEC, use_log=True, say=said.append, cache=True)  # the hand kernel, cached
    assert built.logs_searched == [str(d) for d in logs.search_dirs(SPEC, TARGET)]
    line = cli.log_line(built.schedule_info())
    assert line.startswith("none: no record for this spec and target in ") and str(repo) in line
    assert any("tvm-attention tune" in m for m in said), said  # how to make one
    assert cli.log_line({"source": "hand"}).startswith("none: the hand schedule was asked for")
    assert "ran slower here" in cli.log_line({"source": "hand", "selection": {"tuned_log": "/x"}})


# ---- one tune per folder; readers skip bad lines (issue 4) -----------------------------------


def test_second_tune_on_the_same_folder_fails_at_once(tmp_path, capsys):
    work = tmp_path / "log"
    work.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(work / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, str(os.getpid()).encode())
        print("locked", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t = time.time()
        rc = cli.main(["tune", *SPEC_ARGS, "--trials", "2", "--work-dir", str(work)])
        assert time.time() - t < 10  # at once: before any search
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("tvm-attention tune: error: ") and str(work) in err and f"pid {holder.pid}" in err
    assert not (work / RECORD_FILE).exists()
    # The lock dies with its holder: the folder is free again.
    with tune_lock(work):
        pass


def test_repair_only_under_the_lock(tmp_path):
    work = fake_log(tmp_path / "log")
    with pytest.raises(RuntimeError, match="tune lock"):
        parse_logs(work, repair=True)
    with tune_lock(work):
        assert len(parse_logs(work, repair=True).records) == 2
        with pytest.raises(LogLocked, match=str(work)):  # one tune per folder, in-process too
            with tune_lock(work):
                pass


def test_readers_skip_bad_lines_and_tune_still_refuses_them(tmp_path):
    work = fake_log(tmp_path / "log", n=3)
    good = record_lines(work)
    undecodable = json.loads(good[1])
    undecodable[1][0] = [["NoSuchInstruction", [], [], []], []]  # valid JSON, not a trace
    (work / RECORD_FILE).write_text("\n".join([
        good[0], "{oops", json.dumps(undecodable), json.dumps([7, json.loads(good[2])[1]]), good[2],
        good[1][: len(good[1]) // 2],  # a cut last line: a tune still appending, or killed
    ]))
    said = []
    recs = best_records(SPEC, TARGET, "fused", work, say=said.append)
    assert len(recs) == 2  # lines 1 and 5
    said.sort(key=lambda m: int(m.split(RECORD_FILE + ":")[1].split(":")[0]))
    assert [m.split(RECORD_FILE + ":")[1].split(":")[0] for m in said] == ["2", "3", "4", "6"]
    assert "not valid JSON" in said[0] and "cannot be decoded" in said[1] and "workload #7" in said[2]
    assert "truncated last line" in said[3] and all(m.endswith("skipped") for m in said)
    with pytest.warns(logs.LogWarning):  # without a say callback: warnings, still no error
        assert len(best_records(SPEC, TARGET, "fused", work)) == 2
    said.clear()
    built, v = build_best(SPEC, log_dir=work, say=said.append, cache=True)  # fake_log's seed-1 trace: cached
    assert built.source == "tuned" and v.passed and len(said) == 4
    # tune is strict: it names the first bad line (after moving the cut last line aside).
    before = record_lines(work)
    with pytest.raises(LogError, match=rf"{RECORD_FILE}:2: not valid JSON"):
        tune(SPEC, trials=4, work_dir=work, progress=lambda m: None)
    assert record_lines(work) == before[:5]


def test_a_skipped_workload_keeps_the_indices_of_the_others(tmp_path):
    work = fake_log(tmp_path / "log", n=1, tasks=2)
    w = (work / WORKLOAD_FILE).read_text().splitlines()
    (work / WORKLOAD_FILE).write_text('["1", "not base64"]\n' + w[1] + "\n")
    said = []
    parsed = parse_logs(work, on_bad_line=said.append)
    assert parsed.workloads[0] is None and parsed.workloads[1] is not None
    assert [idx for idx, _ in parsed.records] == [1]  # still credited to workload #1
    assert f"{WORKLOAD_FILE}:1: workload module cannot be decoded" in said[0]
    assert "whose line was skipped" in said[1]


# ---- a complete last line without its newline (issue 9) -------------------------------------


def test_missing_final_newline_is_repaired_before_appending(tmp_path):
    from tvm.s_tir import meta_schedule as ms

    work = fake_log(tmp_path / "log")
    data = (work / RECORD_FILE).read_bytes()
    (work / RECORD_FILE).write_bytes(data.rstrip(b"\n"))
    assert len(parse_logs(work).records) == 2  # readers accept the complete line as it is
    with tune_lock(work):
        db, parsed = open_database(work, repair=True)
        assert any("added the missing newline" in m for m in parsed.repaired)
        _, rec = parsed.records[0]
        db.commit_tuning_record(ms.database.TuningRecord(rec.trace, db.commit_workload(rec.workload.mod),
                                                         [5e-3], TARGET, rec.args_info))
    assert (work / RECORD_FILE).read_bytes().startswith(data)
    assert len(parse_logs(work).records) == 3  # the append got its own line


# ---- resume counts only this target's records (issue 8) --------------------------------------


def test_resume_ignores_records_of_another_target(tmp_path, monkeypatch):
    """Also: a local runner's timeout is the candidate's failure, not a lost device (on the
    LocalRunner this tune measured with, kept for the next tune)."""
    from tvm.s_tir import meta_schedule as ms

    from tvm_attention.tune import driver
    from tvm_attention.tune.driver import lost_with_device

    work = fake_log(tmp_path / "log", n=3, target=OTHER)
    said = []
    monkeypatch.setenv("TVM_ATTENTION_KEEP_WORKERS", "1")
    # search="random": which records count is the log replay's, the same for either search; the
    # evolutionary search's first round (a population sampled and evolved) is tested in test_tune
    result = tune(SPEC, trials=1, per_round=1, work_dir=work, progress=said.append, search="random")
    assert not any("nothing to do" in m or "resuming" in m for m in said), said
    assert result.trials_new == 1 and result.trials_total == 1
    parsed = parse_logs(work)
    assert sorted(target_key(r.target) for _, r in parsed.records) == sorted(
        [target_key(OTHER)] * 3 + [target_key(TARGET)])
    assert len(best_records(SPEC, TARGET, "fused", work)) == 1
    # A LocalRunner measurement that timed out was taken for an RPC server lost with its
    # candidate, and the no-server check then crashed on the local runner (AttributeError).
    results = [ms.runner.RunnerResult(None, "LocalRunner: Timeout, killed after 120 seconds"),
               ms.runner.RunnerResult([1e-3], None)]
    local = next(runner for _, runner in driver._KEPT.values())  # the tune's LocalRunner, kept
    assert isinstance(local, ms.runner.LocalRunner._cls)
    assert lost_with_device(local, results, [0, 1]) == set()

    class Fleet:
        tvm_attention_tracker = ("127.0.0.1", 9190, "cpu-local")

    assert lost_with_device(Fleet(), results, [0, 1]) == {0}


# ---- Ctrl-C in every phase (issue 12) --------------------------------------------------------

#: (phase, nth, delays, search): Ctrl-C DELAYS seconds after PHASE begins for the NTH time, one
#: tune per case (``--search SEARCH``), in this order, in one process (CTRL_C): the last case's
#: second Ctrl-C ends it. The cases up to the search run the default, evolutionary search (its
#: XGBoost model trained on the log in "replay", its C++ search in "search"); the cases in a later
#: phase sample at random: they stop in the builder or the runner, which are the same for either
#: search, and each evolutionary search before them cost 2-3 s of CPU (its model trained, a
#: population of 64 sampled and evolved) for nothing that is checked.
CTRL_C_CASES = [
    ("setup", 1, "0.05", "xgb"),
    ("replay", 1, "0", "xgb"),            # right after `resuming:`, before the builder and runner start
    ("search", 1, "0.3", "xgb"),          # inside TVM's C++ search (it used to segfault)
    ("build", 1, "0.3", "random"),        # while the builder's workers start (import TVM) and build
    ("measure", 1, "0.1", "random"),      # while the runner measures
    ("build", 1, "0.3,0.6", "random"),    # twice: exit at once, not after the build (5-10 s here)
]

CTRL_C = textwrap.dedent("""
    # For each case (PHASE, NTH, DELAYS, SEARCH, WORK): run `tvm-attention tune ARGS --search SEARCH
    # --work-dir WORK` (cli.main, what the command runs) and press Ctrl-C (a SIGINT to the whole
    # process group, as a terminal does) DELAYS seconds after PHASE begins for the NTH time. "@@"
    # lines on stdout delimit the cases and give each one's exit status.
    import sys
    sys.modules["torch"] = None  # never used by a tune: its import cost this process 1-2 s of CPU
    import json, os, signal, threading, time
    from tvm_attention import cli
    from tvm_attention.tune import driver

    # Every case tunes the same spec: its tasks are made once, by the first case (whose Ctrl-C
    # comes while they are made), then reused (~0.3 s of CPU a case); no later case stops in "setup".
    made, make_tasks = {}, driver.make_tasks

    def make_tasks_once(spec, target, schedule):
        key = (spec, str(target), schedule)
        if key not in made:
            made[key] = make_tasks(spec, target, schedule)
        return list(made[key])

    driver.make_tasks = make_tasks_once
    cases, stamp, args = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3:]
    for i, (phase, nth, delays, search, work) in enumerate(cases):
        seen = {}

        def hook(name, phase=phase, nth=nth, delays=delays, seen=seen):
            seen[name] = seen.get(name, 0) + 1
            if name == phase and seen[name] == nth:
                with open(stamp, "w") as f:
                    f.write(repr(time.time()))
                for d in delays.split(","):
                    t = threading.Timer(float(d), os.killpg, (0, signal.SIGINT))
                    t.daemon = True
                    t.start()

        driver._phase_hook = hook
        if phase == "build":  # its builder's workers start in the phase, as in a fresh process
            for builder, _ in driver._KEPT.values():
                builder.close()
        print(f"@@ case {i}", flush=True)
        rc = cli.main(args + ["--search", search, "--work-dir", work])
        print(f"@@ exit {rc}", flush=True)
""")


@pytest.mark.slow
def test_ctrl_c_ends_with_one_line_and_130(tmp_path):
    """Ctrl-C in every phase of a tune (CTRL_C_CASES): one line, what is saved and how to resume,
    exit status 130, the log intact and unlocked. Every case runs in one fresh process (a process
    per case paid 4-5 s each to import TVM; torch, which no tune uses, is not imported), each on a
    copy of the same 2-record log. The runner's
    worker is kept from case to case (``TVM_ATTENTION_KEEP_WORKERS=1``); a "build" case closes
    the kept builder's, so that its builder's workers start in that phase, as in a fresh process.
    The last case, a double Ctrl-C, ends that process with 130."""
    log = fake_log(tmp_path / "log")  # 2 records: each tune resumes
    before = (log / RECORD_FILE).read_bytes()
    works = [Path(shutil.copytree(log, tmp_path / f"log{i}")) for i in range(len(CTRL_C_CASES))]
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C)
    stamp = tmp_path / "stamp"
    cases = [[*case, str(work)] for case, work in zip(CTRL_C_CASES, works)]
    cmd = [sys.executable, str(script), json.dumps(cases), str(stamp),
           "tune", *SPEC_ARGS, "--trials", "20", "--per-round", "2", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TVM_ATTENTION_KEEP_WORKERS="1"),
                            start_new_session=True)  # killpg(0) hits these tunes and their workers only
    try:
        out, err = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ended = time.time()
    text = out + err
    assert proc.returncode == 130, text  # the last case's double Ctrl-C ends the process
    assert "Traceback" not in text and "Segfault" not in text and "error" not in text, text
    assert "interrupted" not in err, text  # each case's one line is on stdout
    chunks = out.split("@@ case ")[1:]
    assert len(chunks) == len(CTRL_C_CASES), text
    for i, ((phase, nth, delays, _), work, chunk) in enumerate(zip(CTRL_C_CASES, works, chunks)):
        lines = chunk.splitlines()
        assert lines[0] == str(i), text
        lines = lines[1:]
        if i < len(CTRL_C_CASES) - 1:  # cli.main returned; the last case exits inside it
            assert lines[-1] == "@@ exit 130", (phase, delays, chunk)
            lines = lines[:-1]
        said = [line for line in lines if "interrupted" in line]
        assert len(said) == 1 and said[0] == lines[-1], (phase, delays, chunk)  # the last line, only once
        assert f"2 record(s) are saved in {work}" in said[0] and "rerun the same command" in said[0]
        # The batch in flight was not committed; the log is intact and resumable.
        assert (work / RECORD_FILE).read_bytes() == before, (phase, delays)
        assert len(parse_logs(work).records) == 2
        with tune_lock(work):  # the lock went with the tune
            pass
    # the last case's second Ctrl-C exits at once (its workers killed), not after the phase
    assert "," in CTRL_C_CASES[-1][2] and ended - float(stamp.read_text()) < 2, text
