"""Tuning for a device reachable only by files: a MetaSchedule runner whose transport is a directory.

A GPU machine without the compiler and without a network can still measure. Three steps:

1. **export** (``tvm-attention tune ... --runner dir:PATH``, :func:`export_payload`): the tune's
   phases up to the search (its tasks and spaces, the log replayed, the cost model trained on
   it), then rounds that draw unmeasured candidates (``trials`` minus the log's records) instead
   of measuring them. Each is built by the path ``tvm-attention build`` takes for a tuned record
   (``build_from_record``: what is timed is what would ship) and exported as a self-contained
   artifact (``artifact.export``; CUDA compiled to a fatbin, no JIT). ``PATH`` then holds one
   payload, in the GPU check's form (``scripts/gpu_payload.py``)::

       candidates.json      payload_id, spec, schedule, target, and per candidate id: its task,
                            workload hash, tuning record (trace, args) and knobs, or its build error
       kernels/<id>/        attention.so, kernel.fatbin (CUDA), manifest.json
       runtime/             TVM's runtime libraries, once
       tvm_attention/       the package (the device imports its loader side only)
       time_candidates.py   the device entry (with gpu_device_check.py, whose timer it uses)
       run.sh, wheels/      tvm-ffi's wheel with ``--wheel``, installed by run.sh (no index there)

   A payload is at most ``MAX_PAYLOAD_BYTES`` (what one device command carries): the export
   stops at the candidate that would pass it, and says so.
2. **device**: ``bash PATH/run.sh`` (``scripts/time_candidates.py``) loads, validates and times
   each candidate, one failing candidate never stopping the rest, and writes ``timings.json``.
3. **import** (``tvm-attention tune ... --import-timings PATH``, :func:`import_timings`): checks
   that ``timings.json`` belongs to this payload (its id, target key, the GPU arch it ran on) and
   commits one MetaSchedule tuning record per timed candidate (a failed one as
   ``FAILED_RUN_SECS``) into the tune's JSON database, under its lock, so that ``build`` picks
   the best as after any tune. A candidate already in the log is skipped: importing twice adds
   nothing. Then the next ``--runner dir:`` export draws from a cost model that learned them.

:class:`DirRunner` is the same transport as a MetaSchedule runner: ``run()`` writes the run
inputs (exported artifacts) into the directory, and its futures read ``timings.json`` back.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import importlib.util
import json
import math
import shutil
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Callable

import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.ir.utils import derived_object
from tvm.target import Target

from ..artifact import export
from ..build import build_from_record
from ..logs import (FAILED_RUN_SECS, _register_intrinsics, for_target, open_database, records_for, replay_record,
                    target_key, tune_lock, tune_work_dir)
from ..runtime import compiler_runtime_paths
from ..spec import AttentionSpec
from ..target import is_cuda, resolve_target, target_to_json
from ..threads import set_num_threads
from ..validate import ValidationResult
from .driver import _Tune, describe, knob_summary
from .tasks import make_tasks

FORMAT = 1
CANDIDATES = "candidates.json"
TIMINGS = "timings.json"
IMPORTED = "imported.json"  # written by the import: the payload may be replaced by the next export
KERNELS = "kernels"
#: what one command to a GPU machine carries (the devices lent to this project)
MAX_PAYLOAD_BYTES = 64 * 2**20
#: the checkout's scripts: the device entry, the GPU check whose timer and runtime loader it
#: uses, and the GPU payload's package copy, wheel download and run.sh
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
DEVICE_SCRIPTS = ("time_candidates.py", "gpu_device_check.py")


class PayloadError(ValueError):
    """A payload or timings file that cannot be used; the message names the file and the problem."""


def parse_runner(text: str) -> Path:
    """``--runner dir:PATH`` -> PATH."""
    kind, _, path = str(text).partition(":")
    if kind != "dir" or not path:
        raise ValueError(f"--runner {text!r}: expected dir:PATH (a payload folder to carry to the device)")
    return Path(path)


@functools.lru_cache(maxsize=1)
def _gpu_payload():
    """``scripts/gpu_payload.py`` as a module: a payload of candidates is carried as the GPU
    check's is (its package copy, wheel download, run.sh and device files)."""
    path = SCRIPTS / "gpu_payload.py"
    if not path.is_file():
        raise RuntimeError(f"{path} missing: a payload for the device needs the source checkout's scripts/")
    spec = importlib.util.spec_from_file_location("gpu_payload", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- step 1: export ---------------------------------------------------------------------------------

class _Draw(_Tune):
    """A tune's phases up to the search (tasks, the log replayed, the cost model), then rounds
    that draw candidates without measuring them."""

    def draw(self, count: int) -> list[tuple[Any, Any]]:
        """Up to ``count`` distinct (task state, candidate) pairs the log has not measured on this
        target, round by round as the search would measure them."""
        self.trials = self.done + count  # plan() takes no more than that
        picked, empty = [], 0
        while self.done < self.trials:
            state = self.pick()
            if state is None:
                break
            cands = state.ctx.generate_measure_candidates()
            if not cands:
                state.exhausted = True
                continue
            cands = list(cands)
            _, results, todo = self.plan(cands)
            for i in todo:  # the search only counts results; the cost model learns nothing here
                results[i] = ms.runner.RunnerResult([FAILED_RUN_SECS], "exported, not measured yet")
            state.ctx.notify_runner_results(cands, results)
            if not todo:
                empty += 1
                if empty >= 3 * len(self.states):
                    break
                continue
            empty = 0
            picked += [(state, cands[i]) for i in todo]
            state.measured += len(todo)  # pick() moves on to the untried tasks
            self.done += len(todo)
        return picked


def draw_candidates(spec: AttentionSpec, target: Target, schedule: str, trials: int, work: Path, per_round: int,
                    seed: int, threads: int, search: str, warm_start: str | Path | None,
                    progress: Callable[[str], None]) -> tuple[list, int]:
    """(candidates, records of this target already in the log); a candidate is (task name,
    workload, record without run time, knobs). Holds the log's lock while reading it."""
    # no Ctrl-C handling of its own: an export commits nothing to the log, so stopping anywhere is safe
    t = _Draw(spec, target, "cuda" if is_cuda(target) else "cpu", schedule, trials, work, per_round, seed, threads,
              progress, types.SimpleNamespace(requested=False), [0], lambda: "", search, warm_start)
    with tune_lock(work):
        try:
            t.open_tasks()
            existing = t.replay()
            if existing >= trials:
                return [], existing
            t.prepare()
            picked = t.draw(trials - existing)
        finally:
            t.close()
    out = []
    for state, cand in picked:
        workload = ms.database.Workload(state.defn.mod)
        record = ms.database.TuningRecord(cand.sch.trace, workload, [], target, cand.args_info)
        out.append((state.defn.name, workload, record, describe(state.defn, cand.sch, target, spec)))
    return out, existing


def export_payload(spec: AttentionSpec, target: str | Target, path: str | Path, schedule: str = "fused",
                   trials: int = 64, work_dir: str | Path | None = None, per_round: int = 8, seed: int = 0,
                   threads: int | None = None, search: str = "xgb", warm_start: str | Path | None = None,
                   wheel: bool = False,
                   max_bytes: int = MAX_PAYLOAD_BYTES, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Step 1: write a payload of the candidates a tune to ``trials`` records would measure next
    (``trials`` minus the log's records, at most) into ``path``, which is replaced when it holds
    an earlier payload and refused when it holds anything else. Returns its ``candidates.json``
    ({} when there was nothing to export)."""
    target = resolve_target(target)
    if spec.dynamic:
        raise ValueError(f"{spec.short_name()}: a paged decode step is tuned on a kernel specialized to its "
                         "representative step, which has no artifact form; tune it where it runs (or over RPC)")
    out = Path(path)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / CANDIDATES).is_file())):
        raise PayloadError(f"{out}: exists and is not a payload (no {CANDIDATES}); choose a new or empty folder")
    if (out / TIMINGS).is_file() and not (out / IMPORTED).is_file():
        raise PayloadError(f"{out}: holds timings that were not imported; run --import-timings {out} first (or "
                           "remove the folder to discard them)")
    threads = set_num_threads(threads)
    work = Path(work_dir) if work_dir else tune_work_dir(spec, target)
    t0 = time.time()
    cands, existing = draw_candidates(spec, target, schedule, trials, work, per_round, seed, threads, search,
                                      warm_start, progress)
    if not cands:
        progress(f"nothing to export: the log {work} holds {existing} record(s) of {trials} --trials"
                 if existing >= trials else "nothing to export: every candidate of the spaces is in the log")
        return {}
    progress(f"drew {len(cands)} candidate(s) in {time.time() - t0:.0f} s; building them")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        size = _start_payload(tmp, target, wheel, max_bytes)
        entries = _add_candidates(tmp, spec, schedule, target, cands, size, max_bytes, progress)
        info = _write_index(tmp, spec, schedule, target, entries, work=str(work))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    built = sum("dir" in c for c in entries.values())
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    progress(f"payload {out}: {built} candidate(s) to time, {len(entries) - built} failed to build, "
             f"{size / 2**20:.1f} MiB, {time.time() - t0:.0f} s. On the device: bash {out.name}/run.sh; bring its "
             f"{TIMINGS} back into {out}, then rerun this command with --import-timings {out} instead of --runner")
    return info


def _start_payload(tmp: Path, target: Target, wheel: bool, max_bytes: int) -> int:
    """The payload's fixed part (runtime, package, device scripts, run.sh, wheel); its size."""
    gp = _gpu_payload()
    (tmp / "runtime").mkdir()
    for p in compiler_runtime_paths(cuda=is_cuda(target)):
        shutil.copy2(p, tmp / "runtime" / p.name)
    gp.copy_package(tmp)
    for name in DEVICE_SCRIPTS:
        shutil.copy2(SCRIPTS / name, tmp / name)
    run_sh = gp.RUN_SH.replace("gpu_device_check.py", DEVICE_SCRIPTS[0])  # same set-up, our entry
    if run_sh == gp.RUN_SH:
        raise RuntimeError("scripts/gpu_payload.py's RUN_SH no longer runs gpu_device_check.py: update dirrunner")
    (tmp / "run.sh").write_text(run_sh)
    (tmp / "run.sh").chmod(0o755)
    if wheel:
        gp.download_wheel(tmp)
    size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    if size > max_bytes:
        raise PayloadError(f"the payload's fixed part alone is {size / 2**20:.1f} MiB, over the "
                           f"{max_bytes / 2**20:.0f} MiB a device command carries")
    return size


def _add_kernel(tmp: Path, cid: str, artifact: Path) -> dict[str, Any]:
    """Copy an artifact's device files into ``kernels/<cid>``; its candidates.json entry."""
    dest = tmp / KERNELS / cid
    dest.mkdir(parents=True)
    for name in _gpu_payload().DEVICE_FILES:
        if (artifact / name).is_file():
            shutil.copy2(artifact / name, dest / name)
    sha = json.loads((dest / "manifest.json").read_text())["library_sha256"]
    return {"dir": f"{KERNELS}/{cid}", "library_sha256": sha}


def _add_candidates(tmp: Path, spec, schedule, target, cands, size: int, max_bytes: int, progress) -> dict[str, Any]:
    """Build and add each candidate, as ``build`` builds a tuned record (what is timed is what
    would ship); a build error is that candidate's result. Stops before the candidate that
    would take the payload past ``max_bytes``."""
    entries: dict[str, Any] = {}
    for n, (task, workload, record, knobs) in enumerate(cands):
        cid = f"c{n:04d}"
        entry = {"task": task, "workload_hash": str(tvm_ffi.structural_hash(workload.mod)),
                 "record": record.as_json(), "knobs": knobs}
        with tempfile.TemporaryDirectory(dir=tmp) as scratch:
            try:
                built = build_from_record(spec, schedule, target, workload, record)
                export(built, Path(scratch) / "a", ValidationResult.not_run(spec, "a tuning candidate"))
            except Exception as e:  # noqa: BLE001 - recorded as its result, the others go on
                entries[cid] = {**entry, "build_error": f"{type(e).__name__}: {str(e).strip()[:2000]}"}
                continue
            entry.update(_add_kernel(tmp, cid, Path(scratch) / "a"))
        grown = sum(f.stat().st_size for f in (tmp / entry["dir"]).iterdir())
        if size + grown > max_bytes:
            shutil.rmtree(tmp / entry["dir"])
            progress(f"the payload is full ({max_bytes / 2**20:.0f} MiB, what a device command carries): "
                     f"{len(cands) - n} candidate(s) left out; import these timings, then export again")
            break
        size += grown
        entries[cid] = entry
        if (n + 1) % 8 == 0:
            progress(f"built {n + 1}/{len(cands)}")
    return entries


def _write_index(tmp: Path, spec, schedule: str, target: Target, entries: dict[str, Any], **extra) -> dict[str, Any]:
    """``candidates.json``; its ``payload_id`` hashes what the timings depend on (the spec, the
    target, each candidate's record and library)."""
    body = {"format": FORMAT, "spec": spec.to_dict() if spec is not None else None, "schedule": schedule,
            "target": target_to_json(target), "target_key": target_key(target), "candidates": entries}
    info = {"payload_id": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16], **body,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra}
    (tmp / CANDIDATES).write_text(json.dumps(info, indent=1) + "\n")
    return info


# -- step 3: import ---------------------------------------------------------------------------------

def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise PayloadError(f"{path}: missing ({what})")
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise PayloadError(f"{path}: not valid JSON ({e}); {what}") from None
    if not isinstance(doc, dict):
        raise PayloadError(f"{path}: expected a JSON object; {what}")
    return doc


def read_payload(path: str | Path) -> dict[str, Any]:
    """A payload's ``candidates.json``, checked for the keys the import reads."""
    info = _read_json(Path(path) / CANDIDATES, "is this a folder `tune --runner dir:PATH` wrote?")
    if info.get("format") != FORMAT:
        raise PayloadError(f"{Path(path) / CANDIDATES}: payload format {info.get('format')!r}, this version "
                           f"reads {FORMAT}")
    for key in ("payload_id", "target_key", "candidates"):
        if key not in info:
            raise PayloadError(f"{Path(path) / CANDIDATES}: no {key!r}")
    return info


def read_timings(path: str | Path, info: dict[str, Any]) -> dict[str, list[float] | str]:
    """``timings.json`` of the payload ``info``: candidate id -> seconds per round, or the error
    that candidate met. Refuses timings of another payload, another target or GPU arch, ids the
    payload does not have, and values that are neither."""
    where = Path(path) / TIMINGS
    doc = _read_json(where, f"run the payload's run.sh on the device and copy the {TIMINGS} it writes here")
    if doc.get("payload_id") != info["payload_id"]:
        raise PayloadError(f"{where}: timings of payload {doc.get('payload_id')!r}, but {Path(path) / CANDIDATES} "
                           f"is payload {info['payload_id']!r}: they come from different exports")
    if doc.get("target_key") != info["target_key"]:
        raise PayloadError(f"{where}: measured for target {doc.get('target_key')!r}, the payload is for "
                           f"{info['target_key']!r}")
    device = doc.get("device") if isinstance(doc.get("device"), dict) else {}
    arch = info.get("target", {}).get("arch")
    if info.get("target", {}).get("kind") == "cuda" and device.get("arch") != arch:
        raise PayloadError(f"{where}: measured on {device.get('name', '?')} ({device.get('arch')}), but the kernels "
                           f"are built for {arch}: its times are not this target's")
    timings = doc.get("timings")
    if not isinstance(timings, dict):
        raise PayloadError(f"{where}: no 'timings' object")
    foreign = sorted(set(timings) - set(info["candidates"]))
    if foreign:
        raise PayloadError(f"{where}: candidate(s) {', '.join(foreign[:5])} are not in the payload")
    for cid, v in timings.items():
        ok = isinstance(v, str) or (isinstance(v, list) and v and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in v))
        if not ok:
            raise PayloadError(f"{where}: {cid}: expected a list of positive seconds or an error string, got "
                               f"{json.dumps(v)[:80]}")
    return timings


@dataclasses.dataclass
class ImportResult:
    work_dir: Path
    new: int  # records committed
    failed: int  # of which failed (a build, load, validation or run error)
    duplicate: int  # already in the log: skipped
    untimed: int  # no result in timings.json (the device run stopped early): not committed
    best_secs: float
    best: str | None  # the best candidate committed: id, task, knobs


def import_timings(spec: AttentionSpec, target: str | Target, path: str | Path, schedule: str = "fused",
                   work_dir: str | Path | None = None, progress: Callable[[str], None] = print) -> ImportResult:
    """Step 3: commit the timings of the payload ``path`` to ``spec``'s tuning log (``work_dir``,
    default the tune's), under its lock. The payload must be of this spec, schedule and target."""
    target = resolve_target(target)
    info = read_payload(path)
    mine = {"spec": spec.to_dict(), "schedule": schedule, "target_key": target_key(target)}
    for key, want in mine.items():
        if info.get(key) != want:
            name = AttentionSpec.from_dict(info["spec"]).short_name() if key == "spec" and info.get("spec") else \
                info.get(key)
            raise PayloadError(f"{Path(path) / CANDIDATES}: a payload of {key} {name}, not "
                               f"{spec.short_name() if key == 'spec' else want}: import it with the command "
                               "that exported it")
    timings = read_timings(path, info)
    tasks = {t.name: (t, str(tvm_ffi.structural_hash(t.mod))) for t in make_tasks(spec, target, schedule)}
    work = Path(work_dir) if work_dir else tune_work_dir(spec, target)
    want = target_key(target)
    result = ImportResult(work, 0, 0, 0, 0, math.inf, None)
    with tune_lock(work):
        db, parsed = open_database(work, repair=True)
        for msg in parsed.repaired:
            progress(f"warning: {msg}")
        have = {tvm_ffi.structural_hash(replay_record(wl, rec).mod)
                for wl, rec in records_for(parsed, schedule) if for_target(rec, want)}
        workloads: dict[str, Any] = {}
        for cid, entry in sorted(info["candidates"].items()):
            outcome = entry.get("build_error") or timings.get(cid)
            if outcome is None:
                result.untimed += 1
                continue
            task, workload_hash = tasks.get(entry["task"], (None, None))
            if workload_hash != entry["workload_hash"]:
                raise PayloadError(f"{Path(path) / CANDIDATES}: {cid}: task {entry['task']} is not what it was at "
                                   "export (the code changed since?): export again")
            _register_intrinsics(json.dumps(entry["record"]))  # a decode trace names our dot intrinsic
            rec = ms.database.TuningRecord.from_json(entry["record"], ms.database.Workload(task.mod))
            key = tvm_ffi.structural_hash(replay_record(rec.workload, rec).mod)
            if key in have:
                result.duplicate += 1
                continue
            have.add(key)
            secs = [float(x) for x in outcome] if isinstance(outcome, list) else [FAILED_RUN_SECS]
            if entry["task"] not in workloads:
                workloads[entry["task"]] = db.commit_workload(task.mod)
            db.commit_tuning_record(ms.database.TuningRecord(rec.trace, workloads[entry["task"]], secs, rec.target,
                                                             rec.args_info))
            result.new += 1
            result.failed += secs[0] >= FAILED_RUN_SECS
            mean = sum(secs) / len(secs)
            if mean < result.best_secs:
                result.best_secs = mean
                result.best = f"{cid} {entry['task']} {knob_summary(entry.get('knobs'))}".strip()
    (Path(path) / IMPORTED).write_text(json.dumps({"payload_id": info["payload_id"], "work_dir": str(work),
                                                   "new": result.new, "duplicate": result.duplicate}) + "\n")
    line = (f"imported {result.new} record(s) ({result.failed} failed) into {work}; {result.duplicate} already "
            f"in the log")
    if result.untimed:
        line += f"; {result.untimed} candidate(s) without a timing (the device run stopped early?) left out"
    if result.best is not None and result.best_secs < FAILED_RUN_SECS:
        line += f"; best {result.best_secs * 1e3:.4f} ms ({result.best})"
    progress(line)
    return result


# -- the same transport as a MetaSchedule runner ----------------------------------------------------

@derived_object
class DirRunner(ms.runner.PyRunner):
    """MetaSchedule's runner over a directory. ``run()`` writes one payload into ``path`` (an
    earlier one is replaced) holding each run input's artifact — ``artifact_path`` must be an
    artifact directory (``artifact.export``), not MetaSchedule's ``.tar`` — and returns futures
    that are done once the device's ``timings.json`` in ``path`` names their candidate; a
    future's ``result()`` waits for that (polling every ``poll_s`` seconds, at most
    ``timeout_s``). The tuning records stay with the caller, who has the candidates."""

    def __init__(self, path: str | Path, target: str | Target, wheel: bool = False, poll_s: float = 2.0,
                 timeout_s: float | None = None):
        super().__init__()
        self.path, self.target = Path(path), resolve_target(target)
        self.wheel, self.poll_s, self.timeout_s = wheel, poll_s, timeout_s

    def run(self, runner_inputs) -> list:
        if self.path.exists():
            read_payload(self.path)  # only ever replaces a payload
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        size = _start_payload(self.path, self.target, self.wheel, MAX_PAYLOAD_BYTES)
        entries = {f"c{n:04d}": _add_kernel(self.path, f"c{n:04d}", Path(inp.artifact_path))
                   for n, inp in enumerate(runner_inputs)}
        size += sum(f.stat().st_size for f in (self.path / KERNELS).rglob("*"))
        if size > MAX_PAYLOAD_BYTES:
            raise PayloadError(f"{self.path}: {size / 2**20:.1f} MiB, over the {MAX_PAYLOAD_BYTES / 2**20:.0f} MiB "
                               "a device command carries: run fewer candidates at once")
        info = _write_index(self.path, None, None, self.target, entries)
        return [_DirFuture(self.path, info, cid, self.poll_s, self.timeout_s) for cid in entries]


@derived_object
class _DirFuture(ms.runner.PyRunnerFuture):
    def __init__(self, path: Path, info: dict[str, Any], cid: str, poll_s: float, timeout_s: float | None):
        super().__init__()
        self.path, self.info, self.cid, self.poll_s, self.timeout_s = path, info, cid, poll_s, timeout_s

    def _timing(self):
        if not (self.path / TIMINGS).is_file():
            return None
        try:
            return read_timings(self.path, self.info).get(self.cid)
        except PayloadError:
            return None  # being copied in, or an older payload's: not ours yet

    def done(self) -> bool:
        return self._timing() is not None

    def result(self):
        deadline = None if self.timeout_s is None else time.time() + self.timeout_s
        while (v := self._timing()) is None:
            if deadline is not None and time.time() > deadline:
                return ms.runner.RunnerResult(None, f"no timing in {self.path / TIMINGS} after {self.timeout_s} s")
            time.sleep(self.poll_s)
        return ms.runner.RunnerResult(v, None) if isinstance(v, list) else ms.runner.RunnerResult(None, v)
