import atexit
import functools
import os
import shutil
import tempfile

import numpy as np
import pytest

# Every test sees its own per-user cache (tuning logs): nothing reads or writes the real one.
_CACHE = tempfile.mkdtemp(prefix="tvma-test-cache-")
os.environ["TVM_ATTENTION_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)
# Tests tune many times per process: keep the tuner's worker processes between tunes
# (tvm_attention.tune.driver.keep_workers; test_tune checks both settings).
os.environ["TVM_ATTENTION_KEEP_WORKERS"] = "1"

from xdist_crash_once import pytest_xdist_make_scheduler  # noqa: F401 - a hook: a crash fails its test once

from tvm_attention.build import build_kernel
from tvm_attention.artifact import kernel_of
from tvm_attention.threads import set_num_threads


@pytest.fixture(scope="session", autouse=True)
def _threads():
    set_num_threads()


def built(spec, schedule="fused", knobs=None):
    """Build once per (spec, schedule, knobs) for the whole session, however they are passed
    (lru_cache alone keys ``built(s)`` and ``built(s, knobs=None)`` apart)."""
    return _built(spec, schedule, knobs)


@functools.lru_cache(maxsize=None)
def _built(spec, schedule, knobs):
    return build_kernel(spec, schedule=schedule, knobs=dict(knobs) if knobs else None)


def run_kernel(spec, q, k, v, schedule="fused", knobs=None):
    return kernel_of(built(spec, schedule, knobs))(q, k, v)


def at_offset(x: np.ndarray, offset: int) -> np.ndarray:
    """A C-contiguous copy of ``x`` whose data starts ``offset`` bytes past a 64-byte boundary
    (NumPy's own arrays sit at 16 mod 64)."""
    raw = np.empty(x.nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    out = raw[start : start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    assert out.ctypes.data % 64 == offset
    return out


def report(out, ref):
    diff = np.abs(out.astype(np.float64) - ref)
    return f"max abs err {diff.max():.3e}, mean abs err {diff.mean():.3e}"


#: The files that take longest, longest first (seconds summed per file with --durations=0 in a
#: 2-core znver4 run, 2026-12-02: kvcache 201, transformers 183, tune 139, tune_hardening 139,
#: cuda_mma 125, search 110, halfprec 100, rpc 93, variants 85, cuda 79, bench 73), started first:
#: `--dist loadfile` hands files to workers in collection order, and a long file collected last
#: ran alone for minutes at the end of the run while the other worker sat idle.
LONG_FILES = ("test_kvcache.py", "test_transformers.py", "test_tune.py", "test_tune_hardening.py", "test_cuda_mma.py",
              "test_search.py", "test_halfprec.py", "test_rpc.py", "test_variants.py", "test_cuda.py", "test_bench.py",
              "test_hardening.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: the rest keep their order

