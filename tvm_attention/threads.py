"""Sizing TVM's CPU thread pool.

TVM's runtime defaults to ``hardware_concurrency() / 2`` threads on x86 (it assumes
hyper-threading), which is 1 on a 2-core VM, and pins each worker to one core; on these VMs both
workers then share a core. We configure the pool explicitly: ``n`` threads, each free to run on
any core this process may use (TVM's ``kSpecifyThreadShareAllCore`` mode).
"""
from __future__ import annotations

import os
import warnings

import tvm

from .target import available_cores

# threading::ThreadGroup::AffinityMode in TVM's threading_backend.h
_SHARE_ALL_CORES = -3
_configured: int | None = None


def set_num_threads(n: int | None = None) -> int:
    """Use ``n`` threads (default: every core available to this process).

    Returns the number of threads TVM will actually use (fewer than ``n``, with a warning, if
    TVM's pool was already created smaller before this call).
    """
    global _configured
    n = available_cores() if n is None else int(n)
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    if _configured is None:
        # The pool's size is fixed when TVM first creates it, from TVM_NUM_THREADS (else the
        # hardware_concurrency()/2 guess). Make room for every available core before that
        # happens; config_threadpool below then chooses how many of them run.
        os.environ.setdefault("TVM_NUM_THREADS", str(max(n, available_cores())))
    if _configured != n:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        tvm.get_global_func("runtime.config_threadpool")(_SHARE_ALL_CORES, n, [str(c) for c in cpus])
        _configured = n
    actual = num_threads()
    if actual < n:
        warnings.warn(
            f"TVM's thread pool was created with {actual} thread(s) before tvm-attention sized it; "
            f"asked for {n}. Set TVM_NUM_THREADS={n} in the environment, or call "
            "tvm_attention.set_num_threads() before running any TVM kernel.",
            RuntimeWarning,
            stacklevel=2,
        )
    return actual


def num_threads() -> int:
    """Threads TVM's runtime uses now."""
    return int(tvm.get_global_func("runtime.NumThreads")())
