"""The backward's knobs as a MetaSchedule search (issue 46): one task per knob point.

The backward's TensorIR is written whole for its knobs (``BackwardKnobs``: the dK/dV phase's row
and key tiles, the dQ phase's rows): each point is a workload of its own, as each tile pair is for
the forward (``tune/tasks.py``), and its space is the function as written (one schedule: the
kernel vectorizes and unrolls itself). MetaSchedule builds and measures every task on its own
builder and runner (MetaSchedule's task scheduler is not used: its FLOP estimate has no rule
for the kernel's ``Let``), and records each in a JSON database under ``work_dir``
(``database_workload.json``, ``database_tuning_record.json``), so a search can be read back without rerunning it
(:func:`best_knobs`). The dQ strategy is a knob too (``dq_chunks``: the second pass, or per-chunk
partial sums).

What the runner's random arguments could misread is refused by name: index arrays (varlen's
``cu_seqlens``, a custom mask's ``mask_indptr``) would be random offsets; symbolic shapes have no
shape to allocate. Tune a static BHSD spec of the shapes you train at and build the others with its
knobs (``build_backward(spec, knobs)``).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..backward import BackwardKnobs
from ..errors import SpecError
from ..spec import AttentionSpec

#: the points searched by default: block_m, block_n, block_m_dq and the dQ strategy (dq_chunks)
CANDIDATES = tuple(BackwardKnobs(bm, bn, bmq, ch) for bm in (32, 64) for bn in (32, 64) for bmq in (64, 128)
                   for ch in (0, 2, 4))  # ch: the dQ strategy, 0 the second pass, else that many chunks
#: the search's JSON database under its work_dir (MetaSchedule's JSONDatabase files)
WORKLOADS, RECORDS = "database_workload.json", "database_tuning_record.json"


@dataclasses.dataclass
class BackwardSearch:
    """A search's result: the fastest point's knobs and every point's median seconds (None:
    it failed to build or run, with why in ``errors``)."""

    knobs: BackwardKnobs
    seconds: dict[BackwardKnobs, float | None]
    errors: dict[BackwardKnobs, str]
    work_dir: Path


def _task_name(kn: BackwardKnobs) -> str:
    return f"backward_m{kn.block_m}_n{kn.block_n}_dq{kn.block_m_dq}_c{kn.dq_chunks}"


def check_tunable(spec: AttentionSpec) -> None:
    """Refuse, by name, a spec the runner's random arguments would make misread (the module
    docstring)."""
    if spec.layout != "bhsd" or spec.custom_mask:
        raise SpecError("tune_backward: a static BHSD spec without a custom mask (the runner fills index arrays "
                        f"with random values), got layout {spec.layout!r}{' with a custom mask' if spec.custom_mask else ''}")
    if spec.dynamic:
        raise SpecError(f"tune_backward: symbolic dims {', '.join(spec.dynamic)} have no shape to measure; tune a "
                        "static spec of the shapes you train at and build the symbolic one with its knobs")


def _modules(spec: AttentionSpec, target, candidates):
    import tvm  # the compiler's side

    from ..backward import backward_func  # the compiler's side (imports TVM)

    return [(kn, tvm.IRModule({"main": backward_func(spec, kn).with_attr("global_symbol", "main")}))
            for kn in candidates]


def tune_backward(spec: AttentionSpec, work_dir: str | Path, target: Any = "llvm",
                  candidates: tuple[BackwardKnobs, ...] | None = None) -> BackwardSearch:
    """Measure every point of ``candidates`` with MetaSchedule's local builder and runner (in
    workers without torch), record each in the JSON database, and return the fastest (the module
    docstring). A point that fails to build or run is recorded as failed (1e10 s)."""
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms
    from tvm.tirx import FloatImm

    from ..backward import backward_target, check_spec  # what the backward builds at all, and for which targets
    from ..timing import measure_ms  # the measurement's least time, as the forward's tuner's
    from ..tvm_internals import torchless_workers  # workers that skip torch's import
    from .driver import _new_builder  # the forward tuner's builder

    check_spec(spec)
    check_tunable(spec)
    target = backward_target(target)  # an LLVM target, before anything is built or written
    candidates = CANDIDATES if candidates is None else candidates
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    mods = _modules(spec, target, candidates)
    db = ms.database.JSONDatabase(path_workload=str(work / WORKLOADS), path_tuning_record=str(work / RECORDS))
    with torchless_workers():
        # the forward's measurement: 3 repeats of at least 100 ms each (scaled: TVM_ATTENTION_MEASURE_SCALE)
        runner = ms.runner.LocalRunner(timeout_sec=120, evaluator_config=ms.runner.EvaluatorConfig(
            number=1, repeat=3, min_repeat_ms=measure_ms(100), enable_cpu_cache_flush=False))
        builder = _new_builder(1)  # the forward tuner's lean build (TVM's default builder: 10 s a point here)
        built = builder.build([ms.builder.BuilderInput(mod, target) for _, mod in mods])
        done = [(kn, mod, b) for (kn, mod), b in zip(mods, built)]
        inputs = [ms.runner.RunnerInput(b.artifact_path, "cpu", ms.arg_info.ArgInfo.from_prim_func(mod["main"]))
                  for _, mod, b in done if b.error_msg is None]
        futures = iter(runner.run(inputs))
        for kn, mod, b in done:
            result = next(futures).result() if b.error_msg is None else None
            secs = [float(x) for x in result.run_secs] if result is not None and result.error_msg is None else [1e10]
            sch = s_tir.Schedule(mod)
            db.commit_tuning_record(ms.database.TuningRecord(
                sch.trace, db.commit_workload(mod), [FloatImm("float32", x) for x in secs], target,
                ms.arg_info.ArgInfo.from_prim_func(mod["main"])))
    return _read(spec, target, work, mods)


def best_knobs(spec: AttentionSpec, work_dir: str | Path, target: Any = "llvm",
               candidates: tuple[BackwardKnobs, ...] | None = None) -> BackwardSearch:
    """The result of a search recorded in ``work_dir`` for ``spec`` on ``target``, read from its
    database without running anything; a missing or corrupt database is a :class:`SpecError`
    naming the file."""
    from ..backward import backward_target  # the targets the backward builds for

    check_tunable(spec)
    target = backward_target(target)
    _check_log(Path(work_dir))  # before any workload is generated
    return _read(spec, target, Path(work_dir), _modules(spec, target, CANDIDATES if candidates is None else candidates))


def _check_log(work: Path) -> None:
    """A search's two database files exist and hold JSON lines, else :class:`SpecError` naming the file."""
    for f in (work / WORKLOADS, work / RECORDS):
        if not f.is_file():
            raise SpecError(f"backward tuning log: {f} is missing (run tune_backward with work_dir={str(work)!r})")
        for n, line in enumerate(f.read_text().splitlines(), 1):
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecError(f"backward tuning log: {f}, line {n}, is not JSON ({e.msg}); delete the file and tune "
                                "again") from None


def _read(spec, target, work: Path, mods) -> BackwardSearch:
    from tvm.s_tir import meta_schedule as ms

    _check_log(work)
    files = [work / WORKLOADS, work / RECORDS]
    db = ms.database.JSONDatabase(path_workload=str(files[0]), path_tuning_record=str(files[1]))
    seconds: dict[BackwardKnobs, float | None] = {}
    errors: dict[BackwardKnobs, str] = {}
    records = db.get_all_tuning_records()
    for kn, mod in mods:
        w = db.commit_workload(mod) if db.has_workload(mod) else None
        secs = [float(x) for r in records if w is not None and r.workload.same_as(w) for x in (r.run_secs or [])]
        seconds[kn] = sorted(secs)[len(secs) // 2] if secs and min(secs) < 1e9 else None
        if seconds[kn] is None:
            errors[kn] = "no measurement recorded (it failed to build or run, or was not searched)"
    timed = {k: v for k, v in seconds.items() if v is not None}
    if not timed:
        raise SpecError(f"backward tuning log in {work}: no point of {spec.short_name()} on {target.kind.name} was "
                        "measured")
    return BackwardSearch(min(timed, key=timed.get), seconds, errors, work)
