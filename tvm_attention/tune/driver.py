"""The tune driver: MetaSchedule's search pieces, our loop.

Per round: pick a task (tile pair), let its EvolutionarySearch (XGBoost cost model) propose
candidates, skip those already in the database, build and run the rest with MetaSchedule's
LocalBuilder/LocalRunner (or a given runner), and commit each record to the JSON database the
moment it is measured. Owning the loop gives us what ``ms.tune_tir`` does not:

* resume — records already in the log for this target are replayed at start: their modules are
  marked measured (never measured again), they warm-start the cost model and seed the evolution,
  and the trial budget counts them; records measured on another target are not counted;
* durability — every measured record is on disk before the next build starts; Ctrl-C or
  SIGKILL loses at most the batch in flight (an interrupted final line is repaired on resume);
* one tune per log folder — the folder's lock is held for the whole tune, and a second tune of
  the same folder fails at once naming it (``logs.tune_lock``);
* Ctrl-C — ends the tune cleanly after the current phase with one line (what is saved, how to
  resume) and exit code 130; a second Ctrl-C exits at once (``_CtrlC``);
* progress — trials done, best time/GFLOP/s so far and with which knobs, elapsed and ETA.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import tvm
import tvm_ffi
from tvm.target import Target

from ..build import knobs_of
from ..logs import (FAILED_RUN_SECS, RECORD_FILE, for_target, mean_secs, open_database, parse_logs, records_for,
                    replay_record, target_key, tune_lock, tune_work_dir)
from ..schedules import get_schedule
from ..spec import AttentionSpec
from ..target import check_target_runnable, is_cuda, local_cuda_arch, resolve_target, vector_lanes
from ..task_mods import workload_matches
from ..timing import measure_ms
from ..threads import set_num_threads
from ..tvm_internals import (POPEN_WORKER_MODULE, local_builder_parts, local_runner_class, mark_pool_shut_down,
                             pool_worker_processes, skip_tensor_intrin_import, torchless_workers)
from .paged import AllocInputs
from .rpc import _port_open, is_rpc_failure, parse_tracker, tracker_status
from .tasks import TaskDef, make_tasks
from .workers import ignore_sigint, lean_build, runner_init

# Test hook: when set, tune() calls it as _phase_hook(name) at the start of each phase — "setup"
# (log check, tasks, TuneContexts), "replay" (the log's records, design spaces, builder and runner
# start-up), then per round "search", "build", "measure" — so a test can deliver a real SIGINT
# inside a chosen phase.
_phase_hook: Callable[[str], None] | None = None


def _phase(name: str) -> None:
    if _phase_hook is not None:
        _phase_hook(name)


def _note_sigint(_signum, _frame) -> None:
    """The Python-level SIGINT handler while tuning: never raises (see _CtrlC)."""
    if _CtrlC.current is not None:
        _CtrlC.current.requested = True


class _CtrlC:
    """Ctrl-C for the duration of a tune.

    Python's default handler raises KeyboardInterrupt in the main thread wherever it happens to
    be: inside TVM's C++ search (a segfault), inside LocalRunner's start-up (a traceback), or in
    a callback whose error TVM rewraps (an empty error message). Instead, while tuning:

    * the handler only records the request (``requested``); the loop checks it between phases and
      stops, without committing the batch in flight, and says what is saved and how to resume;
    * the second Ctrl-C exits at once, printing the same line, with ``os._exit(130)``: records
      are appended one by one, so the log loses at most the line being written, which the next
      tune repairs. It is noticed by a watcher thread reading the signal wakeup fd (Python's C
      handler writes the signal number there from whichever thread the kernel picked), so it
      works even while the main thread is deep in C++ and cannot run a Python handler.

    Inactive outside the main thread (signal handlers belong to it; the caller owns Ctrl-C then).
    Everything is restored on exit."""

    current: "_CtrlC | None" = None

    def __init__(self, line: Callable[[], str], progress: Callable[[str], None]):
        self.requested = False
        self._line = line
        self._progress = progress
        self._active = False

    def __enter__(self) -> "_CtrlC":
        if threading.current_thread() is not threading.main_thread() or _CtrlC.current is not None:
            return self
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd requires it
        _CtrlC.current = self
        self._old_handler = signal.signal(signal.SIGINT, _note_sigint)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="tvm-attention-ctrl-c", daemon=True)
        self._thread.start()
        self._active = True
        return self

    def _watch(self) -> None:
        presses = 0
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:  # __exit__ closed the write end
                return
            for signum in data:
                if signum != signal.SIGINT:
                    continue
                presses += 1
                self.requested = True
                if presses >= 2:
                    try:
                        self._progress(self._line())
                        sys.stdout.flush()
                        sys.stderr.flush()
                        _kill_workers()
                    finally:
                        os._exit(130)

    def __exit__(self, *exc) -> bool:
        if not self._active:
            return False
        signal.set_wakeup_fd(self._old_fd)
        old = self._old_handler
        signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)
        _CtrlC.current = None
        os.close(self._write)
        self._thread.join(timeout=5)
        os.close(self._read)
        self._active = False
        return False


def _kill_workers() -> None:
    """Kill this process's MetaSchedule workers (direct children running tvm.exec.popen_worker)
    before a hard exit: they ignore SIGINT, and an orphaned one would finish its build and then
    complain on the terminal about the closed pipe. Other children (an RPC fleet started from
    this process) are left alone."""
    try:
        import psutil

        for child in psutil.Process().children():
            try:
                if POPEN_WORKER_MODULE in child.cmdline():
                    child.kill()
            except psutil.Error:
                pass
    except Exception:  # noqa: BLE001 - best effort on the way to a hard exit (no psutil: nothing to kill)
        pass


@contextlib.contextmanager
def _workers_spawn():
    """Block SIGINT in this thread while MetaSchedule's pools start their threads and worker
    processes (builder and runner construction, ``build``, ``run``).

    Threads inherit their creator's signal mask and processes keep it across exec, so the
    workers start — and stay — deaf to the Ctrl-C that a terminal sends to the whole foreground
    process group, even while they import TVM, before an initializer could ignore it. Meanwhile
    the kernel hands a SIGINT to another thread of ours, or holds it until the mask is restored;
    either way it reaches _CtrlC.

    The workers started meanwhile run without torch (``tvm_internals.torchless_workers``): they
    build and run our kernels on NumPy arrays, and an import of torch cost each a second or more."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with torchless_workers():
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclasses.dataclass
class TaskState:
    defn: TaskDef
    ctx: Any
    best_secs: float = math.inf
    measured: int = 0
    exhausted: bool = False


@dataclasses.dataclass
class TuneResult:
    work_dir: Path
    trials_total: int  # records of this spec/schedule in the log after tuning
    trials_new: int  # measured by this run
    best_secs: float
    best_task: str | None
    best_knobs: dict[str, Any] | None
    curve: list[tuple[int, float]]  # (trial number, best GFLOP/s so far)
    interrupted: bool = False


class NoDevicesLeft(RuntimeError):
    """Every device of the fleet is gone; the log holds everything measured so far."""


def _run_with_retry(runner, run_inputs, run_idx, results, progress):
    """Run, then measure again (once) the candidates whose device failed — a dead or hung RPC
    server — so that a crash costs a retry, not a record. Kernel errors are not retried.

    TVM's RPCRunner waits without limit for a free server (its worker blocks in the tracker's
    queue), so on a fleet each result gets a deadline of the session timeout plus a margin; a
    worker past it is killed with its pool and the runner replaced. Returns the runner to use."""
    from tvm.s_tir import meta_schedule as ms

    rpc = hasattr(runner, "tvm_attention_tracker")
    pending = list(zip(run_idx, run_inputs))
    for attempt in range(2):
        if not pending:
            return runner
        futures = runner.run([inp for _, inp in pending])
        deadline = time.time() + (runner.rpc_config.session_timeout_sec * 1.5 + 10 if rpc else 1e9)
        retry, hung = [], False
        gone = False
        for (i, inp), fut in zip(pending, futures):
            if rpc:
                # A request waits in the tracker's queue as long as no server is free; when the
                # whole fleet is gone it would wait out the deadline (25 s at a 10 s session
                # timeout), so the tracker is asked every 2 s whether any server is left.
                next_check = time.time() + 2
                while not gone and not fut.done() and time.time() < deadline:
                    time.sleep(0.05)
                    if time.time() >= next_check:
                        gone = _servers_left(runner) == 0
                        next_check = time.time() + 2
                if fut.done():
                    r = fut.result()
                else:
                    hung = True
                    r = ms.runner.RunnerResult(None, "RPC: no server left under the key" if gone else
                                               "RPC: no result before the deadline (server hung, or none free)")
            else:
                r = fut.result()
            if r.error_msg and attempt == 0 and rpc and is_rpc_failure(r.error_msg):
                retry.append((i, inp))
                continue
            results[i] = r if not r.error_msg else ms.runner.RunnerResult([FAILED_RUN_SECS], r.error_msg)
        if hung:
            runner = _reset_rpc_runner(runner)
        if retry:
            if _servers_left(runner) == 0:
                for i, _ in retry:
                    results[i] = ms.runner.RunnerResult([FAILED_RUN_SECS], "RPC: no server left")
                return runner
            progress(f"{len(retry)} measurement(s) lost with their RPC server; measuring them again")
        pending = retry
    return runner


def lost_with_device(runner, results, run_idx) -> set[int]:
    """Indices of measurements lost with their RPC server (to be measured again, never
    committed). Only an RPC fleet loses devices: a local runner's timeout or crash is the
    candidate's own failure, recorded as such."""
    if not hasattr(runner, "tvm_attention_tracker"):
        return set()
    return {i for i in run_idx if is_rpc_failure(results[i].error_msg)}


def _reset_rpc_runner(runner):
    """Kill a runner's workers (stuck in the tracker queue or on a hung server) and make a new one."""
    from tvm.s_tir import meta_schedule as ms

    import psutil

    # Never call the old pool's shutdown (nor let its __del__ do it): it would kill() the workers
    # again through the blocked pipes. Its threads end on their own once the workers' pipes close.
    # Marked before the kill: the jobs it has not started are dropped then, not given fresh workers.
    mark_pool_shut_down(runner.pool)
    # Kill the worker processes themselves: PopenWorker.kill() would close the pipe that the
    # pool's thread is blocked reading, and deadlock. A killed worker's reader gets EOF instead.
    for proc in pool_worker_processes(runner.pool):
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
        except (psutil.Error, OSError):
            pass
    fresh = ms.runner.RPCRunner(rpc_config=runner.rpc_config, evaluator_config=runner.evaluator_config,
                                max_workers=runner.tvm_attention_workers, initializer=ignore_sigint,
                                f_alloc_argument=runner.f_alloc_argument)
    fresh.tvm_attention_tracker = runner.tvm_attention_tracker
    fresh.tvm_attention_workers = runner.tvm_attention_workers
    return fresh


def _servers_left(runner) -> int:
    host, port, key = runner.tvm_attention_tracker
    try:
        return tracker_status(host, port, key, timeout=10)["servers"]
    except Exception:  # noqa: BLE001 - a network probe: an unreachable or confused tracker has no server for us
        return 0


def _fleet_line(runner) -> str:
    if not hasattr(runner, "tvm_attention_tracker"):
        return ""

    host, port, key = runner.tvm_attention_tracker
    try:
        st = tracker_status(host, port, key, timeout=10)
    except Exception:  # noqa: BLE001 - a progress line's network probe: whatever fails, it says so
        return "  [tracker unreachable]"
    return f"  [rpc {key}: {st['servers']} server(s), {st['free']} free]"


def _fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    return f"{s // 60}:{s % 60:02d}"


def describe(task: TaskDef, sch, target: Target, spec: AttentionSpec) -> dict[str, Any] | None:
    """Knobs of a tile-kernel candidate (from its attn.* annotations); None for MetaSchedule's
    own spaces (materialized), whose trace is the description."""
    knobs = knobs_of(get_schedule(task.name.split("_")[0], target), sch, spec, target)
    return None if knobs is None else knobs.to_dict()


def make_rpc_runner(tracker: str, key: str | None, workers: int | None = None, timeout_s: int = 60,
                    f_alloc_argument: Any = None):
    """MetaSchedule's RPCRunner for ``HOST:PORT`` / ``key``: one measurement per worker at a
    time (default: one worker per registered server), every session bounded by ``timeout_s``.
    Fails at once when the tracker is unreachable or has no server under ``key``.
    ``f_alloc_argument``: the candidates' inputs (None: MetaSchedule's random fill)."""
    from tvm.s_tir import meta_schedule as ms


    host, port = parse_tracker(tracker)
    if not key:
        raise ValueError("--rpc-key is required with --rpc-tracker")
    if not _port_open(host, port):
        raise RuntimeError(f"cannot reach the RPC tracker at {tracker} (nothing listens there)")
    try:
        status = tracker_status(host, port, key, timeout=min(timeout_s, 10))
    except Exception as e:
        raise RuntimeError(f"cannot reach the RPC tracker at {tracker}: {e}") from None
    if status["servers"] == 0:
        raise RuntimeError(f"the RPC tracker at {tracker} has no server registered under key {key!r}")
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key,
                                 session_timeout_sec=timeout_s)
    runner = ms.runner.RPCRunner(
        rpc_config=config,
        evaluator_config=ms.runner.EvaluatorConfig(number=1, repeat=3, min_repeat_ms=measure_ms(100),
                                                   enable_cpu_cache_flush=False),
        max_workers=workers or status["servers"],
        initializer=ignore_sigint,
        f_alloc_argument=f_alloc_argument,
    )
    runner.tvm_attention_tracker = (host, port, key)  # for progress and the no-server check
    runner.tvm_attention_workers = workers or status["servers"]
    return runner


def knob_summary(knobs: dict[str, Any] | None) -> str:
    if not knobs:
        return ""
    if "s_rows" not in knobs:
        return " ".join(f"{k}={v}" for k, v in knobs.items())
    text = f"m{knobs['block_m']}"
    if "block_n" in knobs:
        text += f"×n{knobs['block_n']}"
    text += f" s{knobs['s_rows']} p{knobs['pv_rows']} d{knobs['d_unroll']} c{knobs['parallel_chunk']}"
    if "auto_unroll" in knobs:
        text += f" u{knobs['auto_unroll']}"
    if "split_tasks" in knobs:
        text += f" split{knobs['split_tasks']}"
    if knobs.get("dot_bf16"):
        text += " bf16dot"
    if knobs.get("decode_heads", 1) > 1:
        text += f" heads{knobs['decode_heads']}"
    if knobs.get("prefetch"):
        text += f" prefetch{knobs['prefetch']}"
    return text


def tune(
    spec: AttentionSpec,
    target: str | Target = "llvm",
    schedule: str = "fused",
    trials: int = 64,
    work_dir: str | Path | None = None,
    per_round: int = 8,
    seed: int = 0,
    runner: Any = None,
    threads: int | None = None,
    rpc_tracker: str | None = None,
    rpc_key: str | None = None,
    rpc_workers: int | None = None,
    rpc_timeout_s: int = 60,
    progress: Callable[[str], None] = print,
    search: str = "xgb",
    warm_start: str | Path | None = None,
) -> TuneResult:
    """Tune ``spec`` until the log holds ``trials`` measured records for it on ``target``
    (resuming). The log folder is ``work_dir``, by default ``logs.tune_work_dir`` (the user's
    cache); the first progress line names it. Its lock is held throughout: a second tune of the
    same folder raises ``logs.LogLocked`` at once.

    Candidates are measured locally, or on the devices registered with ``rpc_tracker``
    (``HOST:PORT``) under ``rpc_key`` — the only way to tune for a GPU from a machine without one.
    A candidate whose measurement fails because its server died or hung is measured again on
    the remaining servers (once); when no server is left the tune stops with an error, and every
    record measured so far is in the log (rerun to resume).

    Ctrl-C (in the main thread) stops after the current phase without committing the batch in
    flight, prints one line (records saved, where, how to resume) and returns with
    ``interrupted=True``; a second Ctrl-C exits the process at once with status 130.

    ``search``: ``"xgb"`` (default): MetaSchedule's evolutionary search ranked by an XGBoost cost
    model; ``"random"``: candidates sampled at random from the same spaces (MetaSchedule's
    ``ReplayTrace``), the baseline the cost model has to beat. ``warm_start``: another tuning log
    folder (another spec's, same target) whose records train the cost model before the first
    round, so that it ranks candidates from the start instead of after its warm-up samples.
    """
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {', '.join(SEARCHES)}, got {search!r}")
    if warm_start is not None and search != "xgb":
        raise ValueError("warm_start trains the cost model: it needs search='xgb'")
    if warm_start is not None and not (Path(warm_start) / RECORD_FILE).exists():
        raise ValueError(f"--warm-start {warm_start}: no tuning log there ({RECORD_FILE} missing)")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive int, got {trials!r}")
    if isinstance(per_round, bool) or not isinstance(per_round, int) or per_round < 1:
        raise ValueError(f"per_round must be a positive int, got {per_round!r}")
    target = resolve_target(target)
    device = "cuda" if is_cuda(target) else "cpu"
    if runner is None and rpc_tracker is not None:
        with _workers_spawn():  # its pool's workers must not see Ctrl-C either
            runner = make_rpc_runner(rpc_tracker, rpc_key, rpc_workers, rpc_timeout_s, _alloc_for(spec))
    elif runner is None and device == "cuda" and local_cuda_arch() is None:
        raise RuntimeError(
            "tune --target cuda: this machine has no CUDA GPU to measure candidates on; pass "
            "--rpc-tracker HOST:PORT --rpc-key KEY to measure on GPUs registered with a TVM RPC tracker"
        )
    elif runner is None and device == "cpu":
        # Candidates run in local workers: code for a CPU this one is not would SIGILL them.
        check_target_runnable(target, f"tuning for mcpu={target.attrs['mcpu']} (candidates measured here)")
    threads = set_num_threads(threads)
    work = Path(work_dir) if work_dir else tune_work_dir(spec, target)
    saved = [0]  # records of this spec and target in the log, for the interrupted line

    def interrupted_line() -> str:
        return (f"interrupted: {saved[0]} record(s) are saved in {work}; rerun the same command to resume "
                "(the batch in flight was not saved)")

    with tune_lock(work), _CtrlC(interrupted_line, progress) as ctrl_c:
        try:
            return _tune_locked(spec, target, device, schedule, trials, work, per_round, seed, runner,
                                threads, progress, ctrl_c, saved, interrupted_line, search, warm_start)
        except KeyboardInterrupt:  # only when _CtrlC is inactive (tune() outside the main thread)
            progress(interrupted_line())
            return TuneResult(work, saved[0], 0, math.inf, None, None, [], interrupted=True)


SEARCHES = ("xgb", "random")


def _alloc_for(spec: AttentionSpec):
    """The runner's ``f_alloc_argument`` for ``spec``'s tasks: a symbolic spec tuned as itself
    (a paged decode step) is measured on its layout's representative inputs (a valid block
    table), and so is a static one whose variant arguments decide its work (key bounds,
    ``kv_start``: random int32s would skip every tile; the modifiers' tensors; an 8-bit cache's
    scales, which the library refuses unless positive and finite); every other task on
    MetaSchedule's random fill (None)."""
    if not spec.dynamic and not (spec.key_bounds or spec.kv_start or spec.custom_mask or spec.mod_tensors
                                 or spec.kv_quantized):
        return None

    return AllocInputs(spec)


def _warm_start(cost_model, warm_dir, schedule: str, target: Target, want: str, threads: int) -> int:
    """Train ``cost_model`` on the successful records of ``warm_dir`` (any spec) measured on this
    target; each workload gets a context of its own, so the model normalises its times per
    workload as it does for the tasks being tuned. Returns the number of records used."""
    from tvm.s_tir import meta_schedule as ms

    parsed = parse_logs(warm_dir, repair=False, on_bad_line=lambda m: None)
    by_wl: dict[int, tuple[Any, list, list]] = {}
    for wl, rec in records_for(parsed, schedule):
        if not for_target(rec, want) or mean_secs(rec) >= FAILED_RUN_SECS:
            continue
        try:
            sch = replay_record(wl, rec)
        except Exception:  # noqa: BLE001 - a record of an older space: skip it (only TVM's trace replay runs here)
            continue
        entry = by_wl.setdefault(id(wl), (wl, [], []))
        entry[1].append(ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_prim_func(wl.mod["main"])))
        entry[2].append(ms.runner.RunnerResult(list(rec.run_secs), None))
    n = 0
    for wl, cands, results in by_wl.values():
        with skip_tensor_intrin_import():
            ctx = ms.TuneContext(mod=wl.mod, target=target, task_name="warm_start", num_threads=threads)
        cost_model.update(ctx, cands, results)
        n += len(cands)
    return n


#: Local worker pools kept for the next tune() of this process (TVM_ATTENTION_KEEP_WORKERS=1).
_KEPT: dict[tuple, Any] = {}


def keep_workers() -> bool:
    """Whether tune() leaves its local builder and runner workers running for the next tune()
    of this process (``TVM_ATTENTION_KEEP_WORKERS=1``). Off by default: the workers hold a TVM
    each (~400 MB) and a library user's process should not carry them after tuning. Processes
    that tune many times (the test suite, the search reports) turn it on: each tune otherwise
    starts three workers that import TVM again, 3-4 s of CPU each on 2 cores."""
    return os.environ.get("TVM_ATTENTION_KEEP_WORKERS", "").strip() not in ("", "0")


@functools.lru_cache(maxsize=1)
def _lean_builder_class():
    from tvm.s_tir import meta_schedule as ms
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    # the plain Python class under TVM's object wrapper: the loop calls build() from Python
    local_builder, _worker_func, _serialize_params = local_builder_parts()

    class LeanBuilder(local_builder):
        """MetaSchedule's LocalBuilder with ``lean_build``, with one pool for every round.

        TVM's starts a fresh pool for every batch (its workers grew in memory over many uses)
        and, at construction, another one only to look up ``f_build`` by name (ours is a
        Python function: it looks up nothing). Each fresh worker imports TVM, 3-4 s of CPU on
        2 cores. Here the pool lives as long as the builder, and each worker is replaced after
        ``WORKER_USES`` builds instead."""

        WORKER_USES = 64

        def _sanity_check(self) -> None:
            self._pool = None

        def build(self, build_inputs):
            if self._pool is None:
                self._pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=self.timeout_sec,
                                               initializer=self.initializer,
                                               maximum_process_uses=self.WORKER_USES)
            results = []
            jobs = [(self.f_build, self.f_export, b.mod, b.target, _serialize_params(b.params))
                    for b in build_inputs]
            for r in self._pool.map_with_error_catching(lambda x: _worker_func(*x), jobs):
                if r.status == StatusKind.COMPLETE:
                    results.append(ms.builder.BuilderResult(r.value, None))
                elif r.status == StatusKind.TIMEOUT:
                    results.append(ms.builder.BuilderResult(
                        None, f"LocalBuilder: Timeout, killed after {self.timeout_sec} seconds"))
                else:
                    results.append(ms.builder.BuilderResult(None, "LocalBuilder: An exception occurred\n"
                                                            + str(r.value)))
            return results

        def close(self) -> None:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    return LeanBuilder


def _new_builder(threads: int):
    return _lean_builder_class()(max_workers=threads, timeout_sec=120, f_build=lean_build,
                                 initializer=ignore_sigint)


def _local_workers(spec: AttentionSpec, threads: int):
    """(builder, runner) for a local tune: new ones, or the ones kept from the last tune of this
    process (``keep_workers()``). Call under ``_workers_spawn()``: the pools' threads and worker
    processes inherit its SIGINT mask, however many tunes later they start."""
    from tvm.s_tir import meta_schedule as ms

    key = ("local", threads)
    if key in _KEPT:
        builder, runner = _KEPT.pop(key)
    else:
        builder = _new_builder(threads)
        runner = local_runner_class()(
            timeout_sec=120,
            evaluator_config=ms.runner.EvaluatorConfig(number=1, repeat=3, min_repeat_ms=measure_ms(100),
                                                       enable_cpu_cache_flush=False),
            initializer=functools.partial(runner_init, threads),
        )
    runner.f_alloc_argument = _alloc_for(spec)  # passed to the worker with each measurement
    return builder, runner


def _release_local_workers(threads: int, builder, runner) -> None:
    """Keep the local workers for the next tune, or stop them now. A fleet's tune (``runner``
    None) keeps nothing: kept as the local pair, its builder would give the next local tune no
    runner (``_local_workers`` would set ``f_alloc_argument`` on None)."""
    if keep_workers() and runner is not None and ("local", threads) not in _KEPT:
        _KEPT[("local", threads)] = (builder, runner)
        return
    builder.close()
    if runner is not None:
        runner.pool.shutdown()


class _Interrupted(Exception):
    """Ctrl-C was requested: the tune stops at the end of the current phase."""


class _Tune:
    """One tune of one log folder, under its lock: its tasks, the log replayed, the search loop.

    Phases (``_tune_locked`` runs them in order): :meth:`open_tasks` (a TuneContext per
    workload; the log repaired), :meth:`replay` (what the log already holds on this target),
    :meth:`prepare`, then :meth:`search` in rounds of :meth:`pick`, :meth:`measure` and
    :meth:`commit`. Between phases :meth:`check` raises :class:`_Interrupted` when Ctrl-C came,
    and ``_tune_locked`` answers with :meth:`stopped`."""

    def __init__(self, spec, target, device, schedule, trials, work, per_round, seed, threads, progress, ctrl_c,
                 saved, interrupted_line, search, warm_start):
        self.spec, self.target, self.device, self.schedule = spec, target, device, schedule
        self.trials, self.work, self.per_round, self.seed, self.threads = trials, work, per_round, seed, threads
        self.progress, self.ctrl_c, self.saved, self.interrupted_line = progress, ctrl_c, saved, interrupted_line
        self.search_kind, self.warm_start = search, warm_start
        self.t0 = time.time()
        self.want = target_key(target)
        self.best = (math.inf, None, None)  # secs, task name, knobs
        self.curve: list[tuple[int, float]] = []
        self.new = 0  # records this run measured
        self.done = 0  # records in the log (this target)
        self.states: list[TaskState] = []
        self.measured: dict[tuple[str, int], list] = {}  # (target key, structural hash) -> run_secs

    def check(self) -> None:
        if self.ctrl_c.requested:
            raise _Interrupted

    def stopped(self) -> TuneResult:
        self.progress(self.interrupted_line())
        return TuneResult(self.work, self.saved[0], self.new, self.best[0], self.best[1], self.best[2], self.curve,
                          interrupted=True)

    def result(self) -> TuneResult:
        return TuneResult(self.work, self.done, self.new, self.best[0], self.best[1], self.best[2], self.curve)

    def gflops(self, secs: float) -> float:
        return self.spec.flops() / secs / 1e9

    # Step 1. Tasks: one TuneContext (space + evolutionary search) per workload. The log is
    # repaired (a cut last line moved aside, a missing newline added) only here, under the lock.
    def open_tasks(self) -> None:
        from tvm.s_tir import meta_schedule as ms  # loads with the first tune, not with the CLI

        _phase("setup")
        self.db, self.parsed = open_database(self.work, repair=True)
        self.saved[0] = sum(1 for _, rec in records_for(self.parsed, self.schedule) if for_target(rec, self.want))
        defs = make_tasks(self.spec, self.target, self.schedule)
        self.rng = random.Random(self.seed)
        self.progress(f"tune {self.spec.short_name()} [{self.schedule}] on {self.target}: {len(defs)} task(s), "
                      f"log {self.work}")
        for msg in self.parsed.repaired:
            self.progress(f"warning: {msg}")
        for i, d in enumerate(defs):
            with contextlib.nullcontext() if d.needs_tensor_intrin else skip_tensor_intrin_import():
                # a one-point space (a decode task) needs no search: the evolutionary one would
                # replay its trace for a population of 64 first (13-21 s a task), random sampling
                # replays it once per candidate of the round
                strategy = (ms.search_strategy.ReplayTrace() if self.search_kind == "random" or d.points == 1 else
                            ms.search_strategy.EvolutionarySearch(
                                population_size=64, init_min_unmeasured=16, genetic_num_iters=3))
                ctx = ms.TuneContext(
                    mod=d.mod, target=self.target, space_generator=d.space,
                    search_strategy=strategy,
                    task_name=d.name, rand_state=self.seed * 1000 + i + 1, num_threads=self.threads,
                )
            self.states.append(TaskState(d, ctx))
            self.check()

    # Step 2. Replay the log: what is measured already on this target, the best so far, the
    # cost model's data. Records of another target (another CPU, core count or GPU) neither
    # count towards the budget nor mark a candidate measured: `build` would not use them.
    def replay(self) -> int:
        """The records the log holds for this spec and target (they count towards ``trials``)."""
        from tvm.s_tir import meta_schedule as ms  # loads with the first tune, not with the CLI

        _phase("replay")
        spec, want = self.spec, self.want
        self.cost_model = (ms.cost_model.RandomModel(seed=self.seed) if self.search_kind == "random" else
                           ms.cost_model.XGBModel(num_warmup_samples=16, num_tuning_cores=self.threads, verbose_eval=0))
        existing = 0
        by_hash = {tvm_ffi.structural_hash(s.defn.mod): s for s in self.states}
        matches: dict[int, bool] = {}  # per workload of the log (regenerating one takes ~0.3 s)
        # what the cost model learns, per task: one update each, after the loop (XGBModel retrains
        # on all its data at every update: one update per record trained it once per record)
        learned: dict[int, tuple[TaskState, list, list]] = {}
        for wl, rec in records_for(self.parsed, self.schedule):
            if not for_target(rec, want):
                continue
            state = by_hash.get(tvm_ffi.structural_hash(wl.mod))
            if state is None or not tvm_ffi.structural_equal(wl.mod, state.defn.mod):
                continue
            if id(wl) not in matches:
                matches[id(wl)] = workload_matches(spec, wl.mod, self.target)
            if not matches[id(wl)]:
                continue
            sch = replay_record(wl, rec)
            self.measured[(want, tvm_ffi.structural_hash(sch.mod))] = list(rec.run_secs)
            existing += 1
            state.measured += 1
            secs = mean_secs(rec)
            state.best_secs = min(state.best_secs, secs)
            args = ms.arg_info.ArgInfo.from_prim_func(wl.mod["main"])
            _, cands, results = learned.setdefault(id(state), (state, [], []))
            cands.append(ms.MeasureCandidate(sch, args))
            results.append(ms.runner.RunnerResult(list(rec.run_secs), None))
            if secs < self.best[0]:
                self.best = (secs, state.defn.name, describe(state.defn, sch, self.target, spec))
        for state, cands, results in learned.values():
            self.cost_model.update(state.ctx, cands, results)
        self.saved[0] = self.done = existing
        if existing and math.isfinite(self.best[0]):
            self.curve.append((existing, self.gflops(self.best[0])))
        if existing:
            self.progress(f"resuming: {existing} record(s) in the log, best {self.best[0] * 1e3:.3f} ms "
                          f"({self.gflops(self.best[0]):.1f} GFLOP/s) {knob_summary(self.best[2])}")
        if self.warm_start is not None:
            n_warm = _warm_start(self.cost_model, self.warm_start, self.schedule, self.target, want, self.threads)
            self.progress(f"warm start: the cost model learned from {n_warm} record(s) of {self.warm_start}")
        return existing

    def prepare(self) -> None:
        for s in self.states:
            s.ctx.pre_tuning(max_trials=self.trials, num_trials_per_iter=self.per_round,
                             design_spaces=s.ctx.generate_design_space(), database=self.db, cost_model=self.cost_model)

    # Step 3. The loop. Workers start with SIGINT blocked (_workers_spawn) and ignore it
    # (their initializer): a Ctrl-C must not kill a build or a measurement half way.
    def search(self, builder, runner) -> TuneResult:
        t_loop = time.time()
        empty_rounds = 0
        while self.done < self.trials:
            state = self.pick()
            if state is None:
                self.progress("every task's space is exhausted")
                break
            _phase("search")
            t_gen = time.time()
            cands = state.ctx.generate_measure_candidates()
            t_gen = time.time() - t_gen
            self.check()
            if not cands:
                state.exhausted = True
                continue
            cands = list(cands)
            keys, results, todo = self.plan(cands)
            if not todo:
                empty_rounds += 1
                state.ctx.notify_runner_results(cands, results)
                if empty_rounds >= 3 * len(self.states):
                    self.progress("no unmeasured candidates left in the space")
                    break
                continue
            empty_rounds = 0
            runner, run_idx, t_build, t_run = self.measure(builder, runner, cands, results, todo)
            rpc_lost = self.commit(state, cands, keys, results, todo, runner, run_idx)
            self.report(state, results, todo, rpc_lost, runner, t_loop, t_gen, t_build, t_run)
            if rpc_lost and _servers_left(runner) == 0:
                raise NoDevicesLeft(
                    f"no RPC server left under key {runner.tvm_attention_tracker[2]!r}: stopping; "
                    f"{self.done} record(s) are in {self.work}, rerun the same command to resume"
                )
            self.check()  # came while committing: the batch is complete, stop here
        return self.result()

    def pick(self) -> TaskState | None:
        """The task of the next round: an untried one, else the fastest so far (70 %) or a
        random one; None when every space is exhausted (a space of known size, a decode task's
        single point, is done once that many are measured)."""
        live = [s for s in self.states if not s.exhausted and not (s.defn.points and s.measured >= s.defn.points)]
        if not live:
            return None
        untried = [s for s in live if s.measured == 0]
        if untried:
            return untried[0]
        if self.rng.random() < 0.7:
            return min(live, key=lambda s: s.best_secs)
        return self.rng.choice(live)

    def plan(self, cands) -> tuple[list, list, list[int]]:
        """Each candidate's key, the results known already (measured before, or over the
        budget), and the indices left to measure."""
        from tvm.s_tir import meta_schedule as ms  # loads with the first tune, not with the CLI

        keys = [(self.want, tvm_ffi.structural_hash(c.sch.mod)) for c in cands]
        results: list[Any] = [None] * len(cands)
        todo = []
        for i, key in enumerate(keys):
            if key in self.measured:
                results[i] = ms.runner.RunnerResult(self.measured[key], None)
            elif len(todo) < self.trials - self.done:
                todo.append(i)
                self.measured[key] = [FAILED_RUN_SECS]  # also dedups within the batch
            else:
                results[i] = ms.runner.RunnerResult([FAILED_RUN_SECS], "not measured: budget reached")
        return keys, results, todo

    def measure(self, builder, runner, cands, results, todo):
        """Build and run the ``todo`` candidates, filling ``results``; the runner (a stuck one
        is replaced), the indices run, and the build and run times."""
        from tvm.s_tir import meta_schedule as ms  # loads with the first tune, not with the CLI

        _phase("build")
        t_build = time.time()
        with _workers_spawn():
            built = builder.build([ms.builder.BuilderInput(cands[i].sch.mod, self.target) for i in todo])
        t_build = time.time() - t_build
        try:
            self.check()
            _phase("measure")
            t_run = time.time()
            run_inputs, run_idx = [], []
            for i, b in zip(todo, built):
                if b.error_msg:
                    results[i] = ms.runner.RunnerResult([FAILED_RUN_SECS], b.error_msg)
                else:
                    run_inputs.append(ms.runner.RunnerInput(b.artifact_path, self.device, cands[i].args_info))
                    run_idx.append(i)
            with _workers_spawn():
                runner = _run_with_retry(runner, run_inputs, run_idx, results, self.progress)
            t_run = time.time() - t_run
            # The batch in flight when Ctrl-C came is not committed: its measurements may
            # have been disturbed; a resumed tune measures it again.
            self.check()
        finally:
            for b in built:
                if b.artifact_path:
                    Path(b.artifact_path).unlink(missing_ok=True)
        return runner, run_idx, t_build, t_run

    def commit(self, state, cands, keys, results, todo, runner, run_idx) -> set[int]:
        """Append the round's records to the log and learn from them; the indices lost with
        their device (never committed, free to be measured again on resume)."""
        from tvm.s_tir import meta_schedule as ms  # loads with the first tune, not with the CLI

        rpc_lost = lost_with_device(runner, results, run_idx)
        for i in rpc_lost:
            self.measured.pop(keys[i], None)
        workload = self.db.commit_workload(state.defn.mod)
        for i in todo:
            if i in rpc_lost:
                continue
            r = results[i]
            secs = [float(x) for x in r.run_secs]
            self.db.commit_tuning_record(ms.database.TuningRecord(
                cands[i].sch.trace, workload, secs, self.target, cands[i].args_info))
            self.measured[keys[i]] = secs
            self.done += 1
            self.new += 1
            self.saved[0] = self.done
            state.measured += 1
            m = sum(secs) / len(secs)
            if m < state.best_secs:
                state.best_secs = m
            if m < self.best[0]:
                self.best = (m, state.defn.name, describe(state.defn, cands[i].sch, self.target, self.spec))
            if math.isfinite(self.best[0]) and self.best[0] < FAILED_RUN_SECS:
                self.curve.append((self.done, self.gflops(self.best[0])))
        kept = [i for i in todo if i not in rpc_lost]
        if kept:
            self.cost_model.update(state.ctx, [cands[i] for i in kept], [results[i] for i in kept])
        state.ctx.notify_runner_results(cands, results)
        return rpc_lost

    def report(self, state, results, todo, rpc_lost, runner, t_loop, t_gen, t_build, t_run) -> None:
        kept = [i for i in todo if i not in rpc_lost]
        failed = sum(1 for i in kept if results[i].run_secs[0] >= FAILED_RUN_SECS)
        elapsed = time.time() - self.t0
        eta = (time.time() - t_loop) / self.new * (self.trials - self.done) if self.new else math.inf
        best = self.best
        gf = self.gflops(best[0]) if best[0] < FAILED_RUN_SECS else 0.0
        self.progress(f"[{self.done:>4}/{self.trials} trials] {state.defn.name:<16} +{len(kept)}"
                      f"{f' ({failed} failed)' if failed else ''}"
                      f"{f' ({len(rpc_lost)} lost with their device)' if rpc_lost else ''}  best {best[0] * 1e3:.3f} ms "
                      f"{gf:.1f} GFLOP/s {knob_summary(best[2])}  elapsed {_fmt_time(elapsed)} "
                      f"ETA {_fmt_time(eta)}  (search {t_gen:.0f}s build {t_build:.0f}s run {t_run:.0f}s)"
                      f"{_fleet_line(runner)}")

    def close(self) -> None:
        for s in self.states:
            try:
                s.ctx.post_tuning()
            except Exception:  # noqa: BLE001 - teardown, maybe while another error propagates: never hide it
                pass


def _tune_locked(spec, target, device, schedule, trials, work, per_round, seed, runner, threads,
                 progress, ctrl_c, saved, interrupted_line, search="xgb", warm_start=None) -> TuneResult:
    """tune()'s body, run with the folder's lock held and Ctrl-C handled by ``ctrl_c``: the
    phases of :class:`_Tune`, stopping at the end of the phase in which Ctrl-C came."""
    t = _Tune(spec, target, device, schedule, trials, work, per_round, seed, threads, progress, ctrl_c, saved,
              interrupted_line, search, warm_start)
    local = None  # (builder, runner) started here: kept or stopped at the end
    try:
        t.open_tasks()
        existing = t.replay()
        t.check()
        if existing >= trials:
            progress(f"the log already holds {existing} >= {trials} trials; nothing to do")
            return t.result()
        t.prepare()
        t.check()
        with _workers_spawn():
            if runner is None:
                builder, runner = local = _local_workers(spec, threads)
            else:  # a fleet's runner: the builds stay local
                builder = _new_builder(threads)
                local = (builder, None)
        t.check()
        return t.search(builder, runner)
    except _Interrupted:
        return t.stopped()
    finally:
        t.close()
        if local is not None:
            _release_local_workers(threads, *local)
