"""Sizing TVM's CPU thread pool.

TVM's runtime defaults to ``hardware_concurrency() / 2`` threads on x86 (it assumes
hyper-threading), which is 1 on a 2-core VM, and pins each worker to one core; on these VMs both
workers then share a core. We configure the pool explicitly: ``n`` threads, each free to run on
any core this process may use (TVM's ``kSpecifyThreadShareAllCore`` mode).

TVM keeps one pool per OS thread (the pool of the thread that launches a kernel runs it), so the
setting is per calling thread too: :func:`set_num_threads` configures the calling thread's pool
and remembers that in a thread-local, and a loaded kernel re-applies its own thread count in the
calling thread when that differs (:func:`use_threads`, a thread-local compare per call).

Default thread count: ``TVM_NUM_THREADS`` when the user set it, else every core available to the
process.
"""
from __future__ import annotations

import os
import threading
import warnings

from .hostcpu import available_cores
from .runtime import global_func

# threading::ThreadGroup::AffinityMode in TVM's threading_backend.h
_SHARE_ALL_CORES = -3
_ENV = "TVM_NUM_THREADS"
_local = threading.local()  # .n: what this OS thread's pool was configured to
_ours: str | None = None  # the value *we* put in TVM_NUM_THREADS (not the user's choice)
_lock = threading.Lock()


def default_num_threads() -> int:
    """``TVM_NUM_THREADS`` if the user set it (to a positive int), else every available core."""
    env = os.environ.get(_ENV)
    if env is not None and env != _ours:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n >= 1:
            return n
    return available_cores()


def _make_room(n: int) -> None:
    """A pool's size is fixed when TVM first creates it (per OS thread), from TVM_NUM_THREADS,
    else the hardware_concurrency()/2 guess. Unless the user chose a value, make room for every
    available core before that happens; config_threadpool then chooses how many of them run."""
    global _ours
    with _lock:
        if _ENV not in os.environ:
            _ours = str(max(n, available_cores()))
            os.environ[_ENV] = _ours


def set_num_threads(n: int | None = None) -> int:
    """Use ``n`` threads for kernels launched from the calling thread (default:
    :func:`default_num_threads`).

    Returns the number of threads TVM will actually use (fewer than ``n``, with a warning, if
    this thread's pool was created smaller — e.g. ``TVM_NUM_THREADS=1`` in the environment).
    """
    n = default_num_threads() if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_threads must be a positive int, got {n!r}")
    _make_room(n)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    global_func("runtime.config_threadpool")(_SHARE_ALL_CORES, n, [str(c) for c in cpus])
    _local.n = n
    actual = num_threads()
    if actual < n:
        warnings.warn(
            f"TVM's thread pool for this thread has {actual} thread(s); asked for {n}. Set "
            f"TVM_NUM_THREADS={n} in the environment before the first kernel runs.",
            RuntimeWarning,
            stacklevel=2,
        )
    return actual


def use_threads(n: int) -> None:
    """Apply ``n`` in the calling thread unless it is already set there (cheap: one
    thread-local compare on the fast path; kernels call this on every call)."""
    if getattr(_local, "n", None) != n:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # said once at load time instead
            set_num_threads(n)


def num_threads() -> int:
    """Threads TVM's runtime uses now for kernels launched from the calling thread."""
    _make_room(default_num_threads())  # asking creates the pool: let it have room first
    return int(global_func("runtime.NumThreads")())
