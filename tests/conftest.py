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


def report(out, ref):
    diff = np.abs(out.astype(np.float64) - ref)
    return f"max abs err {diff.max():.3e}, mean abs err {diff.mean():.3e}"
