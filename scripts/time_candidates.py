#!/usr/bin/env python3
"""The device side of tuning by files: time every candidate of a payload, write ``timings.json``.

``tvm-attention tune ... --runner dir:PATH`` builds a tune's candidates offline into the payload
``PATH`` (``tvm_attention/tune/dirrunner.py``); on the device, ``bash PATH/run.sh`` (or ``python
PATH/time_candidates.py``) runs this with what a bare machine has: NumPy, tvm-ffi (its wheel in
the payload), PyTorch for CUDA events on a GPU. It imports the package's loader side only
(``tvm_attention.load``), never ``tvm``. Per candidate, in id order:

1. load ``kernels/<id>`` (TVM's runtime from ``runtime/``, a CUDA kernel's precompiled fatbin);
2. validate it on seeded inputs against the float64 reference (``validate_callable``, sampled rows
   for large shapes): a kernel that computes wrong results is recorded as failed, never as fast;
3. time the bare entry function on inputs already on the device (the layout's representative
   call): ``--rounds`` rounds of at least ``--min-ms`` each, one time per round (CUDA events on a
   GPU, ``gpu_device_check.cuda_time``; a wall clock on a CPU).

The candidates run in a worker process; the supervisor restarts it when a candidate crashes it
(a segfault, a CUDA error that poisons the context) or runs past ``--timeout`` seconds, recording
that candidate as failed, so one bad candidate never costs the others. ``timings.json``::

    payload_id   the payload's (``tune --import-timings`` refuses timings of another payload)
    target_key   the payload's target key;  device: what ran them (name, arch or CPU)
    timings      candidate id -> [seconds per round] | "error message"

It is rewritten after every worker run, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import timeit
from pathlib import Path

CANDIDATES = "candidates.json"
TIMINGS = "timings.json"
PROGRESS = "timings.jsonl"  # the worker's log: {"id", "started"} then {"id", "secs" | "error"}


def cpu_time(fn, min_ms: float, rounds: int) -> list[float]:
    """Seconds per call, one per round of at least ``min_ms`` (after one warm-up call)."""
    timer = timeit.Timer(fn)
    once = timer.timeit(1)
    number = max(1, math.ceil(min_ms / 1e3 / max(once, 1e-7)))
    return [t / number for t in timer.repeat(rounds, number)]


def device_args(kernel, device: str) -> list:
    """The bare function's arguments at the layout's representative call: inputs (seeded) then
    outputs, 64-byte aligned on the CPU, copied to GPU 0 for CUDA. Payload specs are static."""
    import numpy as np

    from tvm_attention import runtime
    from tvm_attention.loader import aligned_empty
    from tvm_attention.spec import numpy_dtype

    spec, layout = kernel.spec, kernel.spec.layout_info
    arrays = list(layout.random_inputs(spec, layout.validation_cases(spec)[0], seed=0).values())
    arrays += [np.zeros(a["shape"], numpy_dtype(a["dtype"]))
               for a, arg in zip(spec.arg_specs(), layout.all_args(spec)) if arg.output]
    if device == "cuda":
        dev = runtime.cuda_device(0)
        return [runtime.to_device(a, dev) for a in arrays]
    out = []
    for a in arrays:
        aligned = aligned_empty(a.shape, a.dtype)
        aligned[...] = a
        out.append(runtime.cpu_view(aligned))
    return out


def time_one(entry: Path, device: str, a: argparse.Namespace, torch) -> list[float]:
    import tvm_attention
    from tvm_attention.validate import validate_callable

    kernel = tvm_attention.load(entry)
    if not a.no_validate:
        v = validate_callable(kernel.spec, kernel, seed=a.seed)
        if not v.passed:
            raise RuntimeError(f"wrong results, not timed: {v.format()}")
    args = device_args(kernel, device)
    fn = kernel.function
    if device == "cpu":
        return cpu_time(lambda: fn(*args), a.min_ms, a.rounds)
    import tvm_ffi
    from gpu_device_check import cuda_time  # the GPU check's CUDA-events timer, carried beside this

    with tvm_ffi.use_torch_stream():
        return [cuda_time(torch, lambda: fn(*args), a.min_ms, 1) for _ in range(a.rounds)]


def worker(a: argparse.Namespace, payload: Path, out: Path, ids: list[str]) -> int:
    """Time ``ids`` in order, appending each start and result to ``PROGRESS``."""
    info = json.loads((payload / CANDIDATES).read_text())
    device = "cuda" if info["target"].get("kind") == "cuda" else "cpu"
    torch = None
    manifests = []
    for i in ids:
        try:
            manifests.append(json.loads((payload / info["candidates"][i]["dir"] / "manifest.json").read_text()))
        except (OSError, ValueError):
            pass  # loading that candidate says what is wrong with it, the others go on
    from gpu_device_check import preload_runtime  # the payload's runtime, checked against the manifests

    preload_runtime(payload, manifests)
    if device == "cuda":
        import torch
    with open(out / PROGRESS, "a") as log:
        def note(**entry):
            log.write(json.dumps(entry) + "\n")
            log.flush()

        for i in ids:
            note(id=i, started=True)
            if i == a.crash_on:  # test hook: a candidate that kills its process
                os._exit(134)
            try:
                note(id=i, secs=time_one(payload / info["candidates"][i]["dir"], device, a, torch))
            except Exception as e:  # noqa: BLE001 - recorded, the next candidate goes on
                note(id=i, error=f"{type(e).__name__}: {str(e).strip()[:2000]}")
                if device == "cuda":
                    return 3  # a CUDA error may poison the context: the next candidate gets a fresh process
    return 0


def read_progress(path: Path) -> tuple[dict[str, object], str | None]:
    """The results the worker logged, and the candidate it started last without a result."""
    done: dict[str, object] = {}
    started = None
    if not path.exists():
        return done, None
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line cut by the crash
        if e.get("started"):
            started = e["id"]
        else:
            done[e["id"]] = e["secs"] if "secs" in e else e["error"]
            started = None
    return done, started


def describe_device(device: str) -> dict:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("time_candidates: a CUDA payload, and torch sees no CUDA GPU here")
        major, minor = torch.cuda.get_device_capability()
        return {"kind": "cuda", "name": torch.cuda.get_device_name(), "arch": f"sm_{major}{minor}"}
    from tvm_attention.hostcpu import available_cores

    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.machine()
    return {"kind": "cpu", "name": model, "cores": available_cores()}


def supervise(a: argparse.Namespace, payload: Path, out: Path) -> int:
    info = json.loads((payload / CANDIDATES).read_text())
    ids = sorted(i for i, c in info["candidates"].items() if "dir" in c)
    if a.only:
        ids = [i for i in ids if i in a.only]
    device = describe_device("cuda" if info["target"].get("kind") == "cuda" else "cpu")
    (out / PROGRESS).unlink(missing_ok=True)
    results: dict[str, object] = {}
    t0 = time.time()
    write_timings(out, info, device, results, t0)  # an earlier run's file never stands for this one
    while True:
        todo = [i for i in ids if i not in results]
        if not todo:
            break
        cmd = [sys.executable, str(Path(__file__).resolve()), "--payload", str(payload), "--out", str(out),
               "--worker", *todo, "--min-ms", str(a.min_ms), "--rounds", str(a.rounds), "--seed", str(a.seed)]
        cmd += ["--no-validate"] * a.no_validate + (["--crash-on", a.crash_on] if a.crash_on else [])
        proc = subprocess.Popen(cmd)
        last, seen = time.time(), 0
        while proc.poll() is None:  # a candidate past --timeout is killed with its worker
            time.sleep(0.2)
            size = (out / PROGRESS).stat().st_size if (out / PROGRESS).exists() else 0
            if size != seen:
                last, seen = time.time(), size
            elif time.time() - last > a.timeout:
                proc.kill()
                proc.wait()
        before = len(results)
        done, started = read_progress(out / PROGRESS)
        results.update(done)
        if started is not None and started not in results:
            why = f"ran past {a.timeout:.0f} s" if proc.returncode == -9 else f"exit status {proc.returncode}"
            results[started] = f"the candidate killed its timing process ({why})"
        write_timings(out, info, device, results, t0)
        if len(results) == before:  # the worker died before its first candidate: it would again
            print(f"time_candidates: the worker failed before timing anything (exit {proc.returncode})",
                  file=sys.stderr)
            break
    ok = sum(isinstance(v, list) for v in results.values())
    print(f"time_candidates: {ok}/{len(ids)} timed, {len(results) - ok} failed, {len(ids) - len(results)} not run; "
          f"{out / TIMINGS}")
    best = sorted((sum(v) / len(v), i) for i, v in results.items() if isinstance(v, list))[:5]
    for secs, i in best:
        print(f"  {i} {secs * 1e3:.4f} ms  {info['candidates'][i].get('task')}")
    return 0 if len(results) == len(ids) else 1


def write_timings(out: Path, info: dict, device: dict, results: dict, t0: float) -> None:
    doc = {"payload_id": info["payload_id"], "target_key": info["target_key"], "device": device,
           "seconds": round(time.time() - t0, 1), "timings": dict(sorted(results.items()))}
    tmp = out / (TIMINGS + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out / TIMINGS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--payload", default=str(Path(__file__).resolve().parent))
    p.add_argument("--out", default=None, help="where timings.json goes (default: $OUT if set, else the payload)")
    p.add_argument("--min-ms", type=float, default=None, help="per round (default: 100 on a CPU, 30 on a GPU)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one candidate may take")
    p.add_argument("--seed", type=int, default=0, help="validation inputs")
    p.add_argument("--no-validate", action="store_true", help="time without checking the results first")
    p.add_argument("--only", nargs="+", default=None, metavar="ID", help="time these candidates only")
    p.add_argument("--worker", nargs="+", default=None, help=argparse.SUPPRESS)
    p.add_argument("--crash-on", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    payload = Path(a.payload).resolve()
    out = Path(a.out or os.environ.get("OUT") or payload)
    out.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(payload)]  # the payload's package and gpu_device_check.py
    if a.min_ms is None:
        kind = json.loads((payload / CANDIDATES).read_text())["target"].get("kind")
        a.min_ms = 30.0 if kind == "cuda" else 100.0
    if a.worker is not None:
        return worker(a, payload, out, a.worker)
    return supervise(a, payload, out)


if __name__ == "__main__":
    sys.exit(main())
