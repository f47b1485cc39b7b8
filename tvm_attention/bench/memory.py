"""Measured peak extra memory of one call (Linux: peak RSS, reset through /proc).

Every variant is measured in a fresh process: in the benchmark's own process the allocators
(glibc's heap with its raised mmap threshold, TVM's workspace pool, PyTorch's caches) already hold
memory freed by earlier points, so a call that needs S×S scores could read 0 B there. The child
creates the inputs first and returns the heap's free pages to the OS (``malloc_trim``: making the
inputs frees float64 temporaries, and an output placed in those still-resident pages would not
count), then resets the peak (``clear_refs``), takes VmRSS as the baseline, makes one call and
reports VmHWM − baseline — which includes the first touch of the output.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..spec import AttentionSpec

#: The measurement itself, shared by every child: baseline after the inputs exist, one call.
_MEASURE = r"""
import gc, json
def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
gc.collect()
try:  # hand back what making the inputs freed: the call must not reuse resident free-list pages
    import ctypes
    ctypes.CDLL(None).malloc_trim(0)
except (OSError, AttributeError):  # not glibc
    pass
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = kib("VmRSS")
CALL
print(json.dumps({"peak_extra_bytes": max(0, kib("VmHWM") - base) * 1024, "baseline_bytes": base * 1024}))
"""

#: The library runs with the runtime alone, as serving runs it (``tvm_attention.runtime``: the
#: installed TVM's libtvm_runtime.so, no ``import tvm``: 3-4 s less per child). tvm_ffi imports
#: torch whenever it can; the child has no use for it (another 1-2 s, and hundreds of MB in the
#: baseline), so torch is made unimportable first.
_TVM_CHILD = r"""
import json, sys
sys.modules["torch"] = None
import numpy as np, tvm_ffi
from tvm_attention.loader import aligned_empty
from tvm_attention.runtime import RUNTIME_CPU, ensure_runtime, load_library
lib, entry, shapes, dtype = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
f = load_library(lib, ensure_runtime(None, [RUNTIME_CPU]))[entry]
arrays = [aligned_empty(s, dtype) for s in shapes]
rng = np.random.default_rng(0)
for a in arrays[:3]:
    a[...] = rng.standard_normal(a.shape).astype(dtype)
args = [tvm_ffi.from_dlpack(a) for a in arrays]
""" + _MEASURE.replace("CALL", "f(*args)")

_PEER_CHILD = r"""
import json, sys
from tvm_attention.spec import AttentionSpec
from tvm_attention.timing import aligned_inputs
from tvm_attention.bench.peers import numpy_attention_fn, torch_sdpa_fn
spec, variant, threads = AttentionSpec.from_dict(json.loads(sys.argv[1])), sys.argv[2], int(sys.argv[3])
fn = numpy_attention_fn(spec) if variant == "numpy" else torch_sdpa_fn(spec, threads)
if fn is None:
    sys.exit("torch not installed")
q, k, v, _ = aligned_inputs(spec, seed=0)  # the output buffer is never touched by a peer
""" + _MEASURE.replace("CALL", "out = fn(q, k, v)")


def can_measure() -> bool:
    try:
        with open("/proc/self/status") as f:
            if not any(line.startswith("VmHWM:") for line in f):
                return False
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _run_child(code: str, args: list[str], threads: int) -> int:
    # Every pool sized like the timed run's; the package importable even from a source checkout.
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, TVM_NUM_THREADS=str(threads), TVM_BIND_THREADS="0",
               OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=1800)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}"
        raise RuntimeError(f"memory probe failed: {last}")
    return int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_extra_bytes"])


def tvm_first_call_peak(library, entry: str, spec: AttentionSpec, threads: int) -> int | None:
    """Peak extra memory (bytes) of a CPU build's first call, in a fresh process (TVM's workspace
    pool would otherwise reuse what earlier builds left in this one). ``library``: the build's
    shared library (``BuiltKernel.library``), or a runtime module to export to one."""
    shapes = [list(spec.q_shape), list(spec.kv_shape), list(spec.v_shape), list(spec.o_shape)]
    return library_first_call_peak(library, entry, shapes, spec.dtype, threads)


def library_first_call_peak(library, entry: str, shapes: list[list[int]], dtype: str, threads: int) -> int | None:
    """Peak extra memory (bytes) of the first call of ``entry`` in ``library`` (a shared library's
    path, or a runtime module to export to one) on arrays of ``shapes`` and ``dtype`` (the first
    three random, the others zeros), in a fresh process; None where it cannot be measured."""
    if not can_measure():
        return None
    if isinstance(library, (str, os.PathLike)):
        return _run_child(_TVM_CHILD, [str(library), entry, json.dumps(shapes), dtype], threads)
    with tempfile.TemporaryDirectory() as tmp:
        lib = os.path.join(tmp, "k.so")
        library.export_library(lib)
        return _run_child(_TVM_CHILD, [lib, entry, json.dumps(shapes), dtype], threads)


def peer_first_call_peak(spec: AttentionSpec, variant: str, threads: int) -> int | None:
    """Peak extra memory (bytes) of one call of a CPU peer (``"numpy"`` or ``"torch"``) on seeded
    inputs, in a fresh process. NumPy's is at least one (b, h)'s S×S float32 scores plus the output;
    PyTorch's flash SDPA allocates little beyond its output."""
    if variant not in ("numpy", "torch"):
        raise ValueError(f"not a CPU peer: {variant!r}")
    if not can_measure():
        return None
    return _run_child(_PEER_CHILD, [json.dumps(spec.to_dict()), variant, str(threads)], threads)
