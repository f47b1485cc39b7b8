"""MetaSchedule search: tiny tunes, the design space, resume after a kill, corrupt logs."""
import dataclasses
import functools
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import tvm
import tvm_ffi

from tvm_attention.schedules import cpu_fused
from tvm_attention.artifact import validate_built
from tvm_attention.build import build_from_module
from tvm_attention.pipeline import LogNotUsable, build_best
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target, vector_lanes
from tvm_attention import cli
from tvm_attention.tune.driver import tune
from tvm_attention.logs import RECORD_FILE, WORKLOAD_FILE, LogError, parse_logs
from tvm_attention.tune.tasks import make_tasks
from tvm_attention.threads import set_num_threads
from tvm_attention.tvm_internals import TORCHLESS

# Tuning logs go to the user cache by default: conftest points it at a temporary folder.

TARGET = resolve_target("llvm")
SPEC = AttentionSpec(batch=1, heads=2, seq_q=160, seq_kv=224, head_dim=64, causal=True)
SPEC_ARGS = ["--batch", "1", "--heads", "2", "--seq-q", "160", "--seq-kv", "224", "--head-dim", "64", "--causal"]


def quiet(_msg):
    pass


def _count_records(work: Path) -> int:
    p = work / RECORD_FILE
    return len(p.read_bytes().splitlines()) if p.exists() else 0


@dataclasses.dataclass
class Tuned:
    """The file's one tune (``tuned_dir``): its log folder, the records the killed tune kept,
    the resumed tune's result and progress lines."""
    work: Path
    kept: int
    before: set  # the killed tune's record lines
    result: Any
    messages: list

    @property
    def trials(self) -> int:  # records in the log
        return self.kept + 2


@pytest.fixture(scope="module", autouse=True)
def _threads_back():
    """The tunes here run on one thread (``threads=1``, below); the file after this one, in the
    same process, gets the session's setting back."""
    yield
    set_num_threads()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> Tuned:
    """The file's one tune, shared by every test that reads a tuning log: a `tune` command in a
    fresh process, killed (SIGKILL) once it has committed a round of 2 records, then resumed
    here for 2 more (test_killed_tune_keeps_records_and_resume_does_not_remeasure checks the
    resume). The resumed tune keeps its workers (TVM_ATTENTION_KEEP_WORKERS=1) for
    test_local_workers_are_kept_between_tunes_only_when_asked.

    Both tunes run on one thread, as the command's ``--threads 1``: the resume's XGBoost model
    trains on the runtime's thread count, and on two threads each training (two here) cost ~2 s
    of CPU, mostly its OpenMP threads waiting for each other on a few records (~0.3 s on one);
    the builder then starts one worker instead of two."""
    work = tmp_path_factory.mktemp("tune") / "log"
    # --search random: this tune is only there to commit records and be killed; the resume
    # below (the default, evolutionary search, seeded by those records) is what is checked.
    # Through tvm_attention._torchless: the command never needs torch, whose import cost it 1-2 s.
    cmd = [sys.executable, "-m", TORCHLESS, "tvm_attention.cli", "tune", *SPEC_ARGS, "--trials", "40",
           "--per-round", "2", "--threads", "1", "--search", "random", "--work-dir", str(work)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while _count_records(work) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    kept = _count_records(work)
    assert kept >= 2, "the killed tune should have committed records"
    # Simulate a write cut off by the kill: a partial final line.
    with open(work / RECORD_FILE, "ab") as f:
        f.write(b'[0, [[["GetSBlock", [], {"name": "row')
    before = set((work / RECORD_FILE).read_text().splitlines()[:kept])
    messages = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TVM_ATTENTION_KEEP_WORKERS", "1")
        result = tune(SPEC, trials=kept + 2, per_round=2, work_dir=work, progress=messages.append, threads=1)
    return Tuned(work, kept, before, result, messages)


@pytest.fixture(scope="module")
def tuned_dir(tuned) -> Path:
    return tuned.work


def test_killed_tune_keeps_records_and_resume_does_not_remeasure(tuned):
    work, kept, result = tuned.work, tuned.kept, tuned.result
    assert any("resuming" in m and f"{kept} record" in m for m in tuned.messages)
    assert any("truncated last line" in m for m in tuned.messages)
    assert (work / (RECORD_FILE + ".interrupted")).exists()
    assert result.trials_new == 2 and result.trials_total == tuned.trials == _count_records(work)
    assert result.curve and result.best_knobs is not None
    # No candidate was measured twice: every record's scheduled module is distinct.
    parsed = parse_logs(work)
    hashes = []
    for idx, rec in parsed.records:
        sch = tvm.s_tir.Schedule(parsed.workloads[idx].mod)
        rec.trace.apply_to_schedule(sch, remove_postproc=False)
        hashes.append(tvm_ffi.structural_hash(sch.mod))
    assert len(hashes) == tuned.trials and len(set(hashes)) == len(hashes)
    assert set((work / RECORD_FILE).read_text().splitlines()[:kept]) == tuned.before  # old records kept
    # Already at the budget, a rerun measures nothing: test_symbolic_tune_and_build_use_the_representative_shape.


def test_tuned_build_validates_and_is_fused(tuned_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_ATTENTION_BUILD_CACHE_DIR", str(tmp_path / "builds"))  # a build cache of its own
    built, validation = build_best(SPEC, log_dir=tuned_dir, cache=True)
    assert built.source == "tuned" and built.trace and built.log_dir == str(tuned_dir)
    assert validation.passed, validation.format()
    assert built.audit.fused and built.cache_entry is None
    cpu_fused.check(built.knobs, SPEC, TARGET)
    info = built.schedule_info()
    assert info["source"] == "tuned" and "sample_perfect_tile" in info["trace"]
    # Built again: the record's build comes from the build cache (keyed by its trace), and runs.
    again, validation = build_best(SPEC, log_dir=tuned_dir, cache=True)
    assert again.cache_entry is not None and validation.passed, validation.format()
    assert (again.source, again.knobs, again.trace, again.audit, again.record_secs) == (
        built.source, built.knobs, built.trace, built.audit, built.record_secs)
    assert again.schedule_info() == info


def test_tuned_log_reloads_in_a_fresh_process(tuned, tmp_path, capsys):
    """The fresh process is the point here: TVM's own JSONDatabase reads the log, and `build`
    reloads the record from the files alone (the CLI's main, as `python -m tvm_attention.cli`
    runs it, in the same fresh process). It builds through the run's build cache, where the
    tests below find the same tuned kernel."""
    out = tmp_path / "art"
    args = ["build", *SPEC_ARGS, "--from-log", str(tuned.work), "--out", str(out)]
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # not what is tested: its import cost this process 1-2 s of CPU
        from tvm.s_tir import meta_schedule as ms
        from tvm_attention import cli
        db = ms.database.JSONDatabase(work_dir={str(tuned.work)!r}, allow_missing=False)
        print("records:", len(db.get_all_tuning_records()), flush=True)
        sys.exit(cli.main({args!r}))
    """)
    run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert f"records: {tuned.trials}\n" in run.stdout, run.stdout
    assert (tuned.work / WORKLOAD_FILE).is_file() and _count_records(tuned.work) == tuned.trials
    m = json.loads((out / "manifest.json").read_text())
    assert m["schedule"]["source"] == "tuned" and m["validation"]["passed"]
    assert m["audit"]["verdict"] == "fused"
    # --no-log forces the hand schedule even with a log (in this process: the flag is what is checked)
    assert cli.main(args[:-2] + ["--no-log", "--out", str(tmp_path / "hand")]) == 0
    m = json.loads((tmp_path / "hand" / "manifest.json").read_text())
    assert m["schedule"]["source"] == "hand"


def test_symbolic_tune_and_build_use_the_representative_shape(tuned, capsys):
    # `tune` with dyn dims tunes the representative static shape: into the same log here, which
    # already holds its trials, so nothing new is measured (a rerun at the budget measures nothing).
    # --search random: nothing is searched; the default search's model trained on the log's
    # records before the tune found it had nothing to do (2 trainings, ~4 s of CPU).
    tuned_dir = tuned.work
    dyn = ["--batch", "dyn:1", "--heads", "2", "--seq-q", "dyn:160", "--seq-kv", "dyn:224", "--head-dim", "64",
           "--causal"]
    assert cli.main(["tune", *dyn, "--trials", str(tuned.trials), "--work-dir", str(tuned_dir),
                     "--search", "random"]) == 0
    out = capsys.readouterr().out
    assert f"tuning at the representative shape {SPEC.short_name()}" in out and "0 new" in out
    # a symbolic build takes the knobs of that log's best record
    spec = dataclasses.replace(SPEC, dynamic=("batch", "seq_q", "seq_kv"))
    built, validation = build_best(spec, log_dir=tuned_dir)
    assert built.source == "tuned" and built.spec.dynamic and validation.passed and built.audit.fused
    static, _ = build_best(SPEC, log_dir=tuned_dir, cache=True)  # the static build: cached by the CLI test
    assert built.knobs == static.knobs


def test_from_log_without_matching_record_is_an_error(tuned_dir):
    other = AttentionSpec(batch=1, heads=2, seq_q=160, seq_kv=224, head_dim=64, causal=False)
    with pytest.raises(LogNotUsable, match="no successful fused record"):
        build_best(other, log_dir=tuned_dir)


@functools.lru_cache(maxsize=None)
def tasks_of(spec: AttentionSpec, schedule: str) -> list:
    """``make_tasks`` once per spec and schedule (generating every task's workload: ~1 s), for
    the parametrized tests below, each of which samples its own task."""
    return make_tasks(spec, TARGET, schedule)


# One seed per shape class of the 6 tasks (SPEC: 160 rows, 224 keys); seed picks task seed % 6:
# 0 fused_m32_n64 (rows exact, key tail), 1 fused_m16_n32 (both exact), 4 fused_m32_n128 (a key
# tile wider than half the keys), 5 fused_m64_n64 (row tail and key tail). Left out: 2 (m16_n64)
# and 3 (m32_n32), the classes of 0 and 1 again at another tile size.
@pytest.mark.parametrize("seed", [0, 1, 4, 5])
def test_sampled_points_of_the_space_are_correct_and_fused(seed):
    tasks = tasks_of(SPEC, "fused")
    task = tasks[seed % len(tasks)]
    sch = tvm.s_tir.Schedule(task.mod, seed=seed + 1)
    cpu_fused.design_space(SPEC, TARGET)(sch)
    knobs = cpu_fused.knobs_of(sch, vector_lanes(TARGET))
    cpu_fused.check(knobs, SPEC, TARGET)  # every point of the space is feasible
    built = build_from_module(SPEC, "fused", sch.mod, TARGET, source="tuned", knobs=knobs)
    assert built.audit.fused, built.audit.format()
    v = validate_built(built, seed=seed)
    assert v.passed, f"{knobs}: {v.format()}"


def test_hand_knobs_are_a_point_of_the_space():
    hand = cpu_fused.preset(SPEC, TARGET)
    sch = cpu_fused.apply(tvm.s_tir.Schedule(cpu_fused.workload(SPEC, hand)), hand, SPEC)
    # base: what the function leaves out (SPEC's static seq_q builds no decode nest) is the preset's, as
    # build.knobs_of reads it (the preset's decode knobs, e.g. 2 kv heads per task, are not in its code)
    assert cpu_fused.knobs_of(sch, hand.vector_lanes, hand) == hand
    main_nest = [f.name for f in dataclasses.fields(hand) if f.name not in ("prefetch", "decode_heads", "decode_dot")]
    read = cpu_fused.knobs_of(sch, hand.vector_lanes)  # the main nest's knobs come from the schedule alone
    assert all(getattr(read, n) == getattr(hand, n) for n in main_nest), (read, hand)
    # Its trace replays on a fresh workload and gives the same module: the hand schedule is
    # the space with its decisions pinned.
    fresh = tvm.s_tir.Schedule(cpu_fused.workload(SPEC, hand))
    sch.trace.apply_to_schedule(fresh, remove_postproc=False)
    assert tvm_ffi.structural_equal(fresh.mod, sch.mod)
    assert (hand.block_m, hand.block_n) == cpu_fused.tile_candidates(SPEC, TARGET)[0]


def test_corrupt_logs_give_file_and_line(tuned_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / WORKLOAD_FILE).write_text((tuned_dir / WORKLOAD_FILE).read_text())
    lines = (tuned_dir / RECORD_FILE).read_text().splitlines()
    (bad / RECORD_FILE).write_text(lines[0] + "\n{oops\n" + lines[1] + "\n")
    with pytest.raises(LogError, match=rf"{RECORD_FILE}:2: not valid JSON"):
        tune(SPEC, trials=4, work_dir=bad, progress=quiet)
    # A build skips the bad line with a warning and uses the others.
    said = []
    built, validation = build_best(SPEC, log_dir=bad, say=said.append, cache=True)
    assert built.source == "tuned" and validation.passed
    assert any(f"{RECORD_FILE}:2: not valid JSON" in m and m.endswith("skipped") for m in said)
    (bad / RECORD_FILE).write_text(lines[0] + "\n" + json.dumps([99, json.loads(lines[1])[1]]) + "\n")
    with pytest.raises(LogError, match=r":2: refers to workload #99"):
        parse_logs(bad)
    (bad / WORKLOAD_FILE).write_text('["123", "not base64 at all"]\n')
    with pytest.raises(LogError, match=rf"{WORKLOAD_FILE}:1: workload module cannot be decoded"):
        parse_logs(bad)
    # A truncated last line is an error for strict readers, skipped with a warning by builds,
    # repaired only by the tuner.
    (bad / WORKLOAD_FILE).write_text((tuned_dir / WORKLOAD_FILE).read_text())
    (bad / RECORD_FILE).write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    with pytest.raises(LogError, match=r":2: truncated last line"):
        parse_logs(bad)
    # The CLI's build, in this process (test_tuned_build_in_fresh_process_via_cli runs it fresh):
    # the warning on stderr, exit 0.
    capsys.readouterr()
    rc = cli.main(["build", "--batch", "1", "--heads", "2", "--seq-q", "160", "--seq-kv", "224", "--head-dim", "64",
                   "--causal", "--from-log", str(bad), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 0 and f"{RECORD_FILE}:2: truncated last line" in err, err
    assert json.loads((tmp_path / "x" / "manifest.json").read_text())["schedule"]["source"] == "tuned"


@pytest.mark.parametrize("seed", range(3))
def test_rowcache_space_points_are_correct(seed):
    from tvm_attention.schedules import cpu_rowcache

    spec = AttentionSpec(batch=1, heads=2, seq_q=96, seq_kv=192, head_dim=64, causal=True)
    tasks = tasks_of(spec, "rowcache")
    task = tasks[seed % len(tasks)]
    sch = tvm.s_tir.Schedule(task.mod, seed=seed + 1)
    cpu_rowcache.design_space(spec, TARGET)(sch)
    knobs = cpu_rowcache.knobs_of(sch, vector_lanes(TARGET))
    cpu_rowcache.check(knobs, spec, TARGET)
    built = build_from_module(spec, "rowcache", sch.mod, TARGET, source="tuned", knobs=knobs)
    v = validate_built(built)
    assert v.passed, f"{knobs}: {v.format()}"
    # no S×S buffer, but the local row buffers span every key
    s = {a.name: a for a in built.audit.allocations}["S"]
    assert s.scope == "local" and s.elements == spec.seq_kv * knobs.block_m


def test_committed_logs_match_the_current_workloads():
    # A change to a workload's compute makes every committed record stale, and build then falls
    # back to the hand schedule without a word: regenerate them (scripts/tune_defaults.sh).
    # Checked on the record build takes, each log's fastest on its target (best_records(k=1)
    # is then that record: stricter than "some record matches", which best_records alone checked,
    # regenerating every workload of the log, 6 a folder, ~0.2 s each, where one is needed).
    import re

    from tvm.target import Target

    from tvm_attention.logs import FAILED_RUN_SECS, for_target, mean_secs, records_for, repo_logs_root, target_key
    from tvm_attention.task_mods import workload_matches

    folders = sorted(p for p in repo_logs_root().glob("*/*") if (p / RECORD_FILE).exists())
    assert folders
    for folder in folders:
        b, h, kv, q, k, d, dtype, mask = re.fullmatch(
            r"b(\d+)_h(\d+)_kv(\d+)_q(\d+)_k(\d+)_d(\d+)_(\w+?)_(full|causal)", folder.name).groups()
        spec = AttentionSpec(batch=int(b), heads=int(h), kv_heads=int(kv), seq_q=int(q), seq_kv=int(k),
                             head_dim=int(d), dtype=dtype, causal=mask == "causal")
        # the target the log was measured on: its first record's (read as JSON: parse_logs below
        # parses the whole log once, a second parse cost ~1 s a folder)
        with open(folder / RECORD_FILE) as f:
            target = Target(json.loads(f.readline())[1][2])
        parsed = parse_logs(folder)  # strict: every line parses (a reader would skip a bad one with a warning)
        timed = [(mean_secs(rec), wl) for wl, rec in records_for(parsed, "fused")
                 if for_target(rec, target_key(target)) and mean_secs(rec) < FAILED_RUN_SECS]
        assert timed, f"{folder}: no successful record measured on {target}"
        _, fastest = min(timed, key=lambda x: x[0])
        assert workload_matches(spec, fastest.mod, target), f"{folder}: its fastest record's workload is stale"


def _popen_workers():
    import psutil

    return sorted(c.pid for c in psutil.Process().children() if "tvm.exec.popen_worker" in c.cmdline())


def _pool_pids(pool) -> set[int]:
    """The worker processes a PopenPoolExecutor runs now (one per thread that has sent it a job)."""
    return {w._proc.pid for w in pool._worker_map.values() if w._proc is not None}


def test_local_workers_are_kept_between_tunes_only_when_asked(tuned, monkeypatch, tmp_path):
    import gc

    import psutil
    from tvm_attention.tune import driver

    # The file's tune (the ``tuned`` fixture: resumed in this process with
    # TVM_ATTENTION_KEEP_WORKERS=1, one thread) left its workers running for the next tune on one
    # thread. (Tunes of other files in this process may have kept workers for another count.)
    assert tuned.result.trials_new > 0 and ("local", 1) in driver._KEPT
    builder, runner = driver._KEPT[("local", 1)]
    kept = _pool_pids(builder._pool) | _pool_pids(runner.pool)
    assert len(kept) >= 2 and kept <= set(_popen_workers())  # a builder and the runner (at least) wait
    # Pools of earlier tests in this process that only a reference cycle holds stop when collected:
    # what follows counts the workers of this tune, not theirs.
    gc.collect()
    before = set(_popen_workers())
    # Off (the default): this tune takes the kept workers, then stops every worker it used.
    # (A small spec of its own, searched at random: what is checked is which processes serve it;
    # on one thread, as the file's tune: workers are kept per thread count.)
    monkeypatch.setenv("TVM_ATTENTION_KEEP_WORKERS", "0")
    during = set()
    small = AttentionSpec(batch=1, heads=1, seq_q=64, head_dim=16)
    r = tune(small, trials=1, per_round=1, work_dir=tmp_path, progress=lambda m: during.update(_popen_workers()),
             search="random", threads=1)
    assert r.trials_new == 1 and kept <= during  # the same processes served it
    assert ("local", 1) not in driver._KEPT
    used = kept | (during - before)  # the kept workers and any this tune started
    procs = []
    for pid in used:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    # Killed and joined by the pools' shutdown; waited on here (a loaded machine reaps slowly).
    _, alive = psutil.wait_procs(procs, timeout=30)
    assert alive == []


def test_tune_defaults_names_the_committed_folders():
    """scripts/tune_defaults.sh's folder helper (it imported a module that had moved, and the
    script stopped before its first tune): each default spec's committed folder on this host."""
    import subprocess
    from pathlib import Path

    from tvm_attention.logs import log_folder
    from tvm_attention.target import resolve_target

    script = Path(__file__).resolve().parents[1] / "scripts" / "tune_defaults.sh"
    helper = script.read_text().split("committed_dir() {", 1)[1].split("\n}\n", 1)[0]
    out = subprocess.run(["bash", "-c", f'REPO="{script.parents[1]}"\ncommitted_dir() {{{helper}\n}}\n'
                          "committed_dir 4096 --causal"], capture_output=True, text=True, check=True).stdout
    spec = AttentionSpec(batch=1, heads=8, seq_q=4096, head_dim=64, causal=True)
    assert Path(out.strip()) == log_folder(script.parents[1] / "tuning_logs", spec, resolve_target("llvm"))
