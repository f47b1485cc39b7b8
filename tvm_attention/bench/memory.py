"""Measured peak extra memory of one call (Linux: peak RSS, reset through /proc)."""
from __future__ import annotations

import gc
from typing import Callable


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def can_measure() -> bool:
    try:
        _status_kib("VmHWM")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_extra_bytes(fn: Callable[[], object]) -> int | None:
    """Bytes by which the process's resident set peaked above its level before ``fn()``.

    Writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to the current RSS. Call it on a
    function's *first* run: TVM's workspace pool keeps what it allocated for later calls.
    """
    if not can_measure():
        return None
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    fn()
    peak = _status_kib("VmHWM")
    return max(0, peak - base) * 1024


_CHILD = r"""
import json, sys
import numpy as np, tvm
lib, entry, shapes, dtype = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
f = tvm.runtime.load_module(lib)[entry]
args = [tvm.runtime.empty(s, dtype) for s in shapes]
rng = np.random.default_rng(0)
for a in args[:3]:
    a.copyfrom(rng.standard_normal(tuple(a.shape)).astype(dtype))
def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")
base = kib("VmRSS")
f(*args)
print(json.dumps({"peak_extra_bytes": max(0, kib("VmHWM") - base) * 1024}))
"""


def tvm_first_call_peak(module, entry: str, spec, threads: int) -> int | None:
    """Peak extra memory of a TVM build's first call, measured in a fresh process (TVM's
    workspace pool would otherwise reuse what earlier builds left in this one)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    if not can_measure():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        lib = os.path.join(tmp, "k.so")
        module.export_library(lib)
        shapes = [list(spec.q_shape), list(spec.kv_shape), list(spec.kv_shape), list(spec.o_shape)]
        env = dict(os.environ, TVM_NUM_THREADS=str(threads), TVM_BIND_THREADS="0")
        proc = subprocess.run([sys.executable, "-c", _CHILD, lib, entry, json.dumps(shapes), spec.dtype],
                              capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode}")
    return int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_extra_bytes"])
