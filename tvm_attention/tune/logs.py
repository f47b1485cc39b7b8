"""Tuning logs: MetaSchedule's own JSON database, one folder per (target, spec).

Layout: ``tuning_logs/<target key>/<spec short name>/database_workload.json`` and
``database_tuning_record.json`` (TVM's ``JSONDatabase`` reads them as they are). Before TVM
touches a log we parse every line ourselves, so a corrupt or truncated file is reported as
``file:line: what is wrong`` instead of a crash deep in TVM.

A final line without its newline is what an interrupted append (Ctrl-C, SIGKILL) leaves; the
tuner repairs that (the fragment is kept in a ``.interrupted`` file beside the log) and says so.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

from tvm.target import Target

from ..spec import AttentionSpec

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
FAILED_RUN_SECS = 1e10  # what a failed build/run is recorded as (MetaSchedule's convention)


class LogError(RuntimeError):
    """A tuning log that cannot be used; the message names the file and line."""


def repo_logs_root() -> Path:
    """``tuning_logs/`` beside the package (the committed logs), else ``./tuning_logs``."""
    here = Path(__file__).resolve().parents[2] / "tuning_logs"
    return here if here.is_dir() else Path("tuning_logs")


def target_key(target: Target) -> str:
    """A folder name for a target, e.g. ``llvm-znver4-2c``."""
    kind = target.kind.name
    parts = [kind]
    if "mcpu" in target.attrs:
        parts.append(str(target.attrs["mcpu"]))
    elif "arch" in target.attrs:
        parts.append(str(target.attrs["arch"]))
    if "num-cores" in target.attrs:
        parts.append(f"{int(target.attrs['num-cores'])}c")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(parts))


def default_work_dir(spec: AttentionSpec, target: Target, root: Path | None = None) -> Path:
    return (root or repo_logs_root()) / target_key(target) / spec.short_name()


@dataclasses.dataclass
class ParsedLog:
    workloads: list[Any]  # ms.database.Workload, in file order
    records: list[tuple[int, Any]]  # (workload index, ms.database.TuningRecord)
    repaired: list[str]


def _split_lines(path: Path, repair: bool, repaired: list[str]) -> list[tuple[int, str]]:
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        tail = data[cut:]
        try:
            json.loads(tail)
            complete = True
        except (ValueError, UnicodeDecodeError):
            complete = False
        if not complete:
            lineno = data[:cut].count(b"\n") + 1
            if not repair:
                raise LogError(
                    f"{path}:{lineno}: truncated last line (an interrupted write); rerun the same "
                    "`tvm-attention tune` command to repair the log and resume"
                )
            with open(str(path) + ".interrupted", "ab") as f:
                f.write(tail + b"\n")
            with open(path, "r+b") as f:
                f.truncate(cut)
            repaired.append(f"{path}:{lineno}: dropped a truncated last line (kept in {path.name}.interrupted)")
            data = data[:cut]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LogError(f"{path}: not UTF-8 text ({e})") from None
    return [(i, line) for i, line in enumerate(text.split("\n"), 1) if line.strip()]


def parse_logs(work_dir: str | os.PathLike, repair: bool = False) -> ParsedLog:
    """Parse and check both database files line by line (missing files = empty log)."""
    from tvm.s_tir import meta_schedule as ms

    work = Path(work_dir)
    repaired: list[str] = []
    workloads = []
    wpath = work / WORKLOAD_FILE
    if wpath.exists():
        for lineno, line in _split_lines(wpath, repair, repaired):
            where = f"{wpath}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise LogError(f"{where}: not valid JSON ({e})") from None
            if not (isinstance(obj, list) and len(obj) == 2 and all(isinstance(x, str) for x in obj)):
                raise LogError(f"{where}: expected [structural hash, module], got {line[:80]!r}")
            try:
                workloads.append(ms.database.Workload.from_json(obj))
            except Exception as e:  # TVM raises on a bad base64/JSON module
                raise LogError(f"{where}: workload module cannot be decoded ({type(e).__name__})") from None
    records = []
    rpath = work / RECORD_FILE
    if rpath.exists():
        for lineno, line in _split_lines(rpath, repair, repaired):
            where = f"{rpath}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise LogError(f"{where}: not valid JSON ({e})") from None
            if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int) and isinstance(obj[1], list)):
                raise LogError(f"{where}: expected [workload index, record], got {line[:80]!r}")
            idx = obj[0]
            if not 0 <= idx < len(workloads):
                raise LogError(f"{where}: refers to workload #{idx}, but {wpath.name} has {len(workloads)}")
            try:
                records.append((idx, ms.database.TuningRecord.from_json(obj[1], workloads[idx])))
            except Exception as e:
                raise LogError(f"{where}: tuning record cannot be decoded ({type(e).__name__}: {str(e)[:120]})") from None
            rec = records[-1][1]
            if rec.run_secs is None or not len(rec.run_secs):
                raise LogError(f"{where}: tuning record has no run times")
    return ParsedLog(workloads, records, repaired)


def open_database(work_dir: str | os.PathLike, repair: bool = False):
    """Check the logs, then open them with TVM's JSONDatabase (created when missing)."""
    from tvm.s_tir import meta_schedule as ms

    work = Path(work_dir)
    parsed = parse_logs(work, repair=repair)
    work.mkdir(parents=True, exist_ok=True)
    db = ms.database.JSONDatabase(
        path_workload=str(work / WORKLOAD_FILE),
        path_tuning_record=str(work / RECORD_FILE),
        allow_missing=True,
    )
    return db, parsed


def mean_secs(record) -> float:
    secs = [float(x) for x in record.run_secs]
    return sum(secs) / len(secs)


def records_for(parsed: ParsedLog, schedule: str) -> Iterator[tuple[Any, Any]]:
    """(workload, record) pairs whose workload is ``schedule`` (by its ``attn.workload`` attr)."""
    for idx, rec in parsed.records:
        wl = parsed.workloads[idx]
        func = wl.mod["main"]
        attrs = func.attrs if func.attrs is not None else {}
        if "attn.workload" in attrs and str(attrs["attn.workload"]) == schedule:
            yield wl, rec


def best_records(spec: AttentionSpec, target: Target, schedule: str, work_dir: str | os.PathLike,
                 k: int = 3) -> list[tuple[Any, Any]]:
    """Up to ``k`` fastest successful (workload, record) pairs in ``work_dir`` for exactly this
    spec, schedule and target (CPU name and core count), fastest first."""
    from .tasks import workload_matches

    work = Path(work_dir)
    if not (work / RECORD_FILE).exists():
        return []
    parsed = parse_logs(work, repair=False)
    want = target_key(target)
    matched: dict[int, bool] = {}
    out = []
    for wl, rec in records_for(parsed, schedule):
        key = id(wl)
        if key not in matched:
            matched[key] = workload_matches(spec, wl.mod)
        if not matched[key] or rec.target is None or target_key(rec.target) != want:
            continue
        secs = mean_secs(rec)
        if secs < FAILED_RUN_SECS:
            out.append((secs, wl, rec))
    out.sort(key=lambda x: x[0])
    return [(wl, rec) for _, wl, rec in out[:k]]
