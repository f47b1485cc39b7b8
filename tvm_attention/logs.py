"""Tuning logs: MetaSchedule's own JSON database, one folder per (target, spec).

Layout: ``<root>/<target key>/<spec short name>/database_workload.json`` and
``database_tuning_record.json`` (TVM's ``JSONDatabase`` reads them as they are). Two roots:

* the user's cache, ``tvm_attention.paths.cache_dir() / "tuning_logs"`` — where ``tune`` writes
  by default (``$TVM_ATTENTION_CACHE_DIR``, else ``$XDG_CACHE_HOME/tvm-attention``, else
  ``~/.cache/tvm-attention``), so a tune never writes into the source tree;
* the committed logs, ``tuning_logs/`` of the checkout (``scripts/tune_defaults.sh`` regenerates
  them with an explicit ``--work-dir``), installed with the package as ``tvm_attention.tuning_logs``
  (``repo_logs_root``).

``build`` looks in the user's log first, then the committed one (``search_dirs``).

Before TVM touches a log we parse every line ourselves. For ``tune`` (strict) a corrupt or
truncated file is reported as ``file:line: what is wrong`` instead of a crash deep in TVM; readers
that only want the best record (``best_records``: ``build``, ``run``) skip such a line with a
warning instead, so one bad line never stops a build.

A tune holds an exclusive lock on its folder (``tune_lock``): MetaSchedule's JSONDatabase numbers
workloads by their line in ``database_workload.json`` as it appends them, so two tunes appending
to one folder credit records to the wrong workload or interleave a line. A final line without its
newline is what an interrupted append (Ctrl-C, SIGKILL) leaves; the tuner repairs that under the
lock (a cut line is kept in a ``.interrupted`` file beside the log, a complete one gets its newline)
and says so.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import tvm
from tvm.target import Target

from .paths import cache_dir
from .schedules import WORKLOAD_KINDS  # schedules/ of the checkout, installed as tvm_attention.schedules
from .spec import AttentionSpec
from .target import cpu_features, is_cuda

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
LOCK_FILE = "tune.lock"
FAILED_RUN_SECS = 1e10  # what a failed build/run is recorded as (MetaSchedule's convention)


class LogError(RuntimeError):
    """A tuning log that cannot be used; the message names the file and line."""


class LogLocked(RuntimeError):
    """Another tune holds the folder's lock; the message names the folder and the holder's pid."""


class NoTuningLog(LookupError, RuntimeError):
    """No log has a record for this spec, schedule and target, where one is required (``compare``'s
    ``fused-tuned``); the message names the folders looked in and says how to make one
    (:data:`TUNE_HINT`). A RuntimeError too: the command line reports it as an error (exit 2)."""


class LogWarning(UserWarning):
    """A log line a reader skipped (when no ``say`` callback was given)."""


#: What to do when no log has a record: said wherever a log is missing (build, run, compare)
TUNE_HINT = ("Make one: tvm-attention tune with the same spec flags (e.g. tvm-attention tune --seq-q 1024 "
             "--causal --trials 64), then build again")
#: :data:`TUNE_HINT` where a line has room for a few words only (a skipped sweep point, ``inspect``)
TUNE_HINT_SHORT = "make one: tvm-attention tune with the same spec flags"
#: The package the committed logs install as (pyproject.toml maps ``tuning_logs/`` of the
#: checkout to it): an installed package finds them wherever it is run from.
LOGS_PACKAGE = "tvm_attention.tuning_logs"


def repo_logs_root() -> Path:
    """The committed logs: the folder of :data:`LOGS_PACKAGE` (``tuning_logs/`` of the checkout
    in an editable install, the package data of an installed one), or ``tuning_logs/`` beside
    the package when it is imported from a checkout that was never installed. Never the current
    folder: a build run elsewhere must find the same logs. Read by ``build``; ``tune`` writes
    there only when given it as ``--work-dir``."""
    try:
        spec = importlib.util.find_spec(LOGS_PACKAGE)
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parents[1] / "tuning_logs"


def user_logs_root() -> Path:
    """``tuning_logs/`` in the user's cache folder (``tvm_attention.paths.cache_dir``)."""
    return cache_dir() / "tuning_logs"


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


def log_folder(root: str | os.PathLike, spec: AttentionSpec, target: Target) -> Path:
    """``root/<target key>/<spec short name>``; a symbolic spec tuned as itself (a paged decode
    step, :mod:`.paged`) adds the representative step it was measured at
    (``paged_p16_h32_kv8_d128_float32_causal_at_b4_q1_k4096``)."""
    name = spec.short_name()
    if spec.dynamic:
        name += f"_at_b{spec.batch}_q{spec.seq_q}_k{spec.seq_kv}"
    return Path(root) / target_key(target) / name


def tune_work_dir(spec: AttentionSpec, target: Target) -> Path:
    """Where ``tune`` writes by default: the user's cache, never the source tree."""
    return log_folder(user_logs_root(), spec, target)


def committed_work_dir(spec: AttentionSpec, target: Target) -> Path:
    """The committed log of ``spec`` on ``target`` (``tuning_logs/`` of the checkout)."""
    return log_folder(repo_logs_root(), spec, target)


def search_dirs(spec: AttentionSpec, target: Target, elsewhere: bool = False) -> list[Path]:
    """The folders ``build`` looks in, in order: the user's tuning log, then the committed one;
    with ``elsewhere``, then the committed logs of other targets whose code this one may run
    (:func:`committed_elsewhere`)."""
    dirs = [tune_work_dir(spec, target), committed_work_dir(spec, target)]
    dirs += committed_elsewhere(spec, target) if elsewhere else []
    return [d for i, d in enumerate(dirs) if d.absolute() not in [e.absolute() for e in dirs[:i]]]


def usable_on(tuned: Target, target: Target) -> bool:
    """True when a record measured on ``tuned`` may serve ``target``: the same kind and core
    count, and every ISA feature code for ``tuned`` may use is one ``target``'s code may use
    (``cpu_features``: AVX-512, AVX512-BF16, AMX...). CPU names do not enter: a VM that reports a
    model other than its own (a Sapphire Rapids Xeon that says ``rocketlake``) still finds the
    logs of its class, and a log measured where the code may use a feature this target lacks
    (``znver4``'s ``sse4a`` on an Intel CPU, AVX-512 on an AVX2 host) is never taken."""
    if tuned.kind.name != target.kind.name or is_cuda(target):
        return target_key(tuned) == target_key(target)
    cores = [int(t.attrs["num-cores"]) if "num-cores" in t.attrs else None for t in (tuned, target)]
    return cores[0] == cores[1] and set(cpu_features(tuned)) <= set(cpu_features(target))


def committed_elsewhere(spec: AttentionSpec, target: Target) -> list[Path]:
    """The committed logs of ``spec`` measured on other targets (another target key) whose code
    ``target`` may run (:func:`usable_on`, read from each log's first record), the one sharing
    the most ISA features first: where the committed logs are found by what the host's code may
    use rather than by its CPU's name."""
    want, name = target_key(target), log_folder("", spec, target).name
    found = []
    for work in sorted(repo_logs_root().glob(f"*/{name}")):
        if work.parent.name == want:
            continue
        tuned = _first_target(work)
        if tuned is not None and usable_on(tuned, target):
            found.append((-len(cpu_features(tuned)), work))
    return [work for _, work in sorted(found, key=lambda x: x[0])]


def _first_target(work: Path) -> Target | None:
    """The target of the first record of the log in ``work`` (None: no readable record)."""
    try:
        with open(work / RECORD_FILE) as f:
            return Target(json.loads(f.readline())[1][2])
    except Exception:  # unreadable, cut, or not a target: not a log to take records from
        return None


def default_work_dir(spec: AttentionSpec, target: Target, root: Path | None = None) -> Path:
    """The log folder of ``spec`` under ``root``; without ``root``, the log a reader should use:
    the first of ``search_dirs`` that holds a record file, else the user's (``tune``'s default).

    Kept for readers that take one folder (bench, compare, search_report); ``build`` goes through
    ``search_dirs`` itself so that it can fall back per schedule."""
    if root is not None:
        return log_folder(root, spec, target)
    dirs = search_dirs(spec, target)
    return next((d for d in dirs if (d / RECORD_FILE).exists()), dirs[0])


# Folders whose lock this process holds (resolved paths): repair is allowed only there.
_held: set[str] = set()


def _lock_key(work: Path) -> str:
    return str(work.resolve())


@contextlib.contextmanager
def tune_lock(work_dir: str | os.PathLike):
    """Hold the exclusive lock of a log folder (``flock`` on ``tune.lock`` inside it, created
    with the folder when missing) for the ``with`` block; fail at once with ``LogLocked`` if
    another tune (any process, or this one) holds it. The holder's pid is written into the lock
    file for that message. The kernel drops the lock when the process ends, however it ends."""
    work = Path(work_dir)
    path = work / LOCK_FILE
    try:
        work.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by worker processes
    except OSError as e:
        raise LogError(f"{work}: cannot create the tuning log folder's lock {path.name} ({e.strerror}); "
                       "give the tune a writable --work-dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        except OSError:
            holder = ""
        os.close(fd)
        who = f"another tune (pid {holder})" if holder.isdigit() else "another tune"
        raise LogLocked(
            f"{who} is using the tuning log {work} (lock: {path}); two tunes must not append to "
            "one log. Wait for it to finish, or give this tune another --work-dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    key = _lock_key(work)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held.add(key)
        yield path
    finally:
        _held.discard(key)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # releases the flock


@dataclasses.dataclass
class ParsedLog:
    workloads: list[Any]  # ms.database.Workload in file order; None for a line a reader skipped
    records: list[tuple[int, Any]]  # (workload index, ms.database.TuningRecord)
    repaired: list[str]  # what repair=True changed, one message each
    skipped: list[str] = dataclasses.field(default_factory=list)  # lines a lenient parse skipped


def _split_lines(path: Path, repair: bool, repaired: list[str],
                 bad: Callable[[str], None] | None) -> list[tuple[int, str]]:
    """The non-blank lines of ``path`` as ``(line number, text)``.

    The last line may lack its newline: a cut, invalid line is what an interrupted append leaves;
    a complete one would make the next append by MetaSchedule's JSONDatabase join two records on
    one line. With ``repair`` (the tuner, under the folder's lock) the cut line is moved aside to
    ``<file>.interrupted`` and a complete one gets its newline. Without it a cut line is an error
    (strict, ``bad`` is None) or skipped through ``bad`` (a reader: a tune may be appending)."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        tail = data[cut:]
        lineno = data[:cut].count(b"\n") + 1
        try:
            json.loads(tail)
            complete = True
        except (ValueError, UnicodeDecodeError):
            complete = False
        if complete:
            if repair:
                with open(path, "ab") as f:
                    f.write(b"\n")
                repaired.append(f"{path}:{lineno}: added the missing newline at the end of the last line")
        elif repair:
            with open(str(path) + ".interrupted", "ab") as f:
                f.write(tail + b"\n")
            with open(path, "r+b") as f:
                f.truncate(cut)
            repaired.append(f"{path}:{lineno}: dropped a truncated last line (kept in {path.name}.interrupted)")
            data = data[:cut]
        elif bad is None:
            raise LogError(
                f"{path}:{lineno}: truncated last line (an interrupted write); rerun the same "
                "`tvm-attention tune` command to repair the log and resume"
            )
        else:
            bad(f"{path}:{lineno}: truncated last line (an interrupted write, or a tune still "
                "appending); skipped")
            data = data[:cut]
    lines = []
    for i, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            msg = f"{path}:{i}: not UTF-8 text ({e})"
            if bad is None:
                raise LogError(msg) from None
            bad(msg)
            continue
        if line.strip():
            lines.append((i, line))
    return lines


#: Tensor intrinsics of our own that a record's trace may name. They register only when a kernel
#: that uses them is scheduled (cpu_bf16's dot product and interleave; a decode nest's dot, one per
#: head_dim and row count, float32 or bf16), so a fresh process reading a log that names them (a resumed tune,
#: `build`) must register them before decoding the record.
_DECODE_DOT = re.compile(r"attn_decode_dot_d(\d+)_r(\d+)(?:_l(\d+))?")
_DECODE_BF16_DOT = re.compile(r"attn_decode_bf16dot_d(\d+)_r(\d+)")
_DECODE_I8_DOT = re.compile(r"attn_decode_i8dot_d(\d+)_r(\d+)(?:_l(\d+))?")


def _register_intrinsics(line: str) -> None:
    if "attn_bf16_" in line:
        from .schedules import cpu_bf16  # only for a log of a bf16 dot-product kernel

        cpu_bf16.register()
    if not any(f"attn_decode_{x}dot_" in line for x in ("", "bf16", "i8")):
        return
    from .schedules.cpu_decode import dot_bf16_intrinsic, dot_i8_intrinsic, dot_intrinsic  # a log that names one

    for d, rows, lanes in set(_DECODE_DOT.findall(line)):  # no _l suffix: AVX-512's 16 lanes
        dot_intrinsic(int(d), int(rows), int(lanes or 16))
    for d, rows in set(_DECODE_BF16_DOT.findall(line)):
        dot_bf16_intrinsic(int(d), int(rows))
    for d, rows, lanes in set(_DECODE_I8_DOT.findall(line)):
        dot_i8_intrinsic(int(d), int(rows), int(lanes or 16))


def parse_logs(work_dir: str | os.PathLike, repair: bool = False,
               on_bad_line: Callable[[str], None] | None = None) -> ParsedLog:
    """Parse and check both database files line by line (missing files = empty log).

    Strict by default: the first bad line raises ``LogError("file:line: what is wrong")``. With
    ``on_bad_line`` (readers), a bad line is reported to it and skipped instead; a skipped
    workload keeps its index (as ``None``) so that the records after it still point at the right
    workload, and records pointing at it are skipped too. ``repair`` (see ``_split_lines``)
    requires this process to hold the folder's ``tune_lock``: another tune may be writing the
    very line a repair would cut."""
    from tvm.s_tir import meta_schedule as ms

    work = Path(work_dir)
    if repair and _lock_key(work) not in _held:
        raise RuntimeError(f"{work}: a log is repaired only under its tune lock (logs.tune_lock)")
    repaired: list[str] = []
    skipped: list[str] = []

    def bad(msg: str) -> None:
        if on_bad_line is None:
            raise LogError(msg)
        msg = msg if msg.endswith("; skipped") else msg + "; skipped"
        skipped.append(msg)
        on_bad_line(msg)

    lenient = None if on_bad_line is None else bad  # what _split_lines reports a cut line to
    workloads: list[Any] = []
    wpath = work / WORKLOAD_FILE
    if wpath.exists():
        for lineno, line in _split_lines(wpath, repair, repaired, lenient):
            where = f"{wpath}:{lineno}"
            workloads.append(None)  # the index is the line's, even when the line is skipped
            try:
                obj = json.loads(line)
            except ValueError as e:
                bad(f"{where}: not valid JSON ({e})")
                continue
            if not (isinstance(obj, list) and len(obj) == 2 and all(isinstance(x, str) for x in obj)):
                bad(f"{where}: expected [structural hash, module], got {line[:80]!r}")
                continue
            try:
                workloads[-1] = ms.database.Workload.from_json(obj)
            except Exception as e:  # TVM raises on a bad base64/JSON module
                bad(f"{where}: workload module cannot be decoded ({type(e).__name__})")
    records = []
    rpath = work / RECORD_FILE
    if rpath.exists():
        for lineno, line in _split_lines(rpath, repair, repaired, lenient):
            where = f"{rpath}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                bad(f"{where}: not valid JSON ({e})")
                continue
            if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int) and isinstance(obj[1], list)):
                bad(f"{where}: expected [workload index, record], got {line[:80]!r}")
                continue
            idx = obj[0]
            if not 0 <= idx < len(workloads):
                bad(f"{where}: refers to workload #{idx}, but {wpath.name} has {len(workloads)}")
                continue
            if workloads[idx] is None:
                bad(f"{where}: refers to workload #{idx}, whose line was skipped")
                continue
            # outside the try: registering our own intrinsic is no decoding of the line, and an error
            # there is a bug of ours, not a bad line
            _register_intrinsics(line)
            try:
                rec = ms.database.TuningRecord.from_json(obj[1], workloads[idx])
            except Exception as e:  # noqa: BLE001 - TVM's decoder raises several types on a bad record
                bad(f"{where}: tuning record cannot be decoded ({type(e).__name__}: {str(e)[:120]})")
                continue
            if rec.run_secs is None or not len(rec.run_secs):
                bad(f"{where}: tuning record has no run times")
                continue
            records.append((idx, rec))
    return ParsedLog(workloads, records, repaired, skipped)


def open_database(work_dir: str | os.PathLike, repair: bool = False):
    """Check the logs (strictly), then open them with TVM's JSONDatabase (created when missing).
    ``repair`` needs the folder's ``tune_lock``."""
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
    """(workload, record) pairs whose workload schedule ``schedule`` builds (its ``attn.workload``
    attr, one of ``WORKLOAD_KINDS[schedule]``: ``fused`` on CUDA tunes and builds the
    ``fused_mma`` and ``fused_cuda`` kernels, whose records were skipped when only the name
    ``fused`` matched, so ``build`` never used a CUDA tuning log)."""
    kinds = WORKLOAD_KINDS.get(schedule, (schedule,))
    for idx, rec in parsed.records:
        wl = parsed.workloads[idx]
        func = wl.mod["main"]
        attrs = func.attrs if func.attrs is not None else {}
        if "attn.workload" in attrs and str(attrs["attn.workload"]) in kinds:
            yield wl, rec


def replay_record(workload, record):
    """The schedule ``record``'s trace gives on ``workload`` (postprocessing kept, as measured):
    its ``.mod`` is what was measured, and its structural hash the key a tune dedups by."""
    sch = tvm.s_tir.Schedule(workload.mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch


def for_target(rec, want: str) -> bool:
    """True iff ``rec`` was measured on the target whose ``target_key`` is ``want``."""
    return rec.target is not None and target_key(rec.target) == want


def _usable(tuned: Target | None, target: Target, memo: dict[str, bool]) -> bool:
    """:func:`usable_on`, once per distinct record target (``memo``: by its JSON)."""
    if tuned is None:
        return False
    key = str(tuned)
    if key not in memo:
        memo[key] = usable_on(tuned, target)
    return memo[key]


def _warn(msg: str) -> None:
    warnings.warn(msg, LogWarning, stacklevel=3)


def best_records(spec: AttentionSpec, target: Target, schedule: str, work_dir: str | os.PathLike,
                 k: int = 3, say: Callable[[str], None] | None = None,
                 elsewhere: bool = False) -> list[tuple[Any, Any]]:
    """Up to ``k`` fastest successful (workload, record) pairs in ``work_dir`` for exactly this
    spec, schedule and target (CPU name and core count), fastest first. ``elsewhere``: records
    of any target whose code ``target`` may run (:func:`usable_on`), for the committed logs of
    other targets (:func:`committed_elsewhere`).

    A reader: a bad or cut line (a corrupt log, or a tune appending right now) is skipped with a
    warning through ``say`` (default: ``warnings.warn`` with ``LogWarning``), never an error."""
    from .task_mods import workload_matches  # it builds workloads: TVM's parser, loaded on first use

    work = Path(work_dir)
    if not (work / RECORD_FILE).exists():
        return []
    parsed = parse_logs(work, repair=False, on_bad_line=say or _warn)
    want = target_key(target)
    matched: dict[int, bool] = {}
    usable: dict[str, bool] = {}
    out = []
    for wl, rec in records_for(parsed, schedule):
        key = id(wl)
        if key not in matched:
            matched[key] = workload_matches(spec, wl.mod, target)
        if not matched[key] or not (for_target(rec, want) or elsewhere and _usable(rec.target, target, usable)):
            continue
        secs = mean_secs(rec)
        if secs < FAILED_RUN_SECS:
            out.append((secs, wl, rec))
    out.sort(key=lambda x: x[0])
    return [(wl, rec) for _, wl, rec in out[:k]]
