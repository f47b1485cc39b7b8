"""The machine's streaming-read bandwidth, measured with a TIR kernel: the roof of decode.

A decode step reads each K/V byte once and does about 0.5 FLOP per byte, so its time is bounded
by how fast the cores can stream memory in, not by the FMA units. This kernel is that bound
measured: a parallel sum over a buffer far larger than the caches, ``TASKS`` contiguous chunks,
each summed into ``ACC`` independent 16-lane accumulators.

Why these values (measured on a 2-core znver4): 4 accumulators streamed 44–46 GB/s with two
threads, 8 only 28–29 (as did a C/OpenMP AVX-512 loop): the loop shape matters on this
hardware, so the decode benchmark quotes the best of these measurements, never a datasheet.
"""
from __future__ import annotations

import functools
import statistics

import numpy as np
import tvm
from tvm.script import tirx as T
from ..target import resolve_target

LANES = 16  # float32 lanes of an AVX-512 vector
ACC = 4  # independent vector accumulators per task
TASKS = 16  # contiguous chunks (a static split over the threads)
DEFAULT_BYTES = 512 << 20  # far beyond any L3 here


def stream_func(n: int):
    """``Out[t, :] = Σ_k A[(t·steps + k)·W : +W]``: reads ``A (n,) float32`` once."""
    W = LANES * ACC
    steps = n // (TASKS * W)

    @T.prim_func(s_tir=True)
    def stream(A: T.Buffer((n,), "float32"), Out: T.Buffer((TASKS, W), "float32")):
        T.func_attr({"global_symbol": "stream", "tirx.noalias": True})
        for t in T.parallel(TASKS):
            with T.sblock("task"):
                vt = T.axis.spatial(TASKS, t)
                T.reads(A[vt * steps * W:(vt + 1) * steps * W])
                T.writes(Out[vt, 0:W])
                s = T.sblock_alloc_buffer((W,), "float32", scope="local")
                for lane in T.vectorized(W):
                    s[lane] = T.float32(0)
                for k in T.serial(steps):
                    for lane in T.vectorized(W):
                        s[lane] = s[lane] + A[(vt * steps + k) * W + lane]
                for lane in T.vectorized(W):
                    Out[vt, lane] = s[lane]

    return stream


@functools.lru_cache(maxsize=None)
def _built(n: int):
    return tvm.compile(stream_func(n), target=resolve_target("llvm"))


def stream_read_gbps(nbytes: int = DEFAULT_BYTES, repeat: int = 7) -> float:
    """GB/s (1e9 bytes/s) of one streaming read of ``nbytes``, median of ``repeat`` runs, on the
    threads the calling thread has set (``tvm_attention.set_num_threads``)."""
    q = TASKS * LANES * ACC
    n = max(q, (nbytes // 4) // q * q)
    ex = _built(n)
    a = tvm.runtime.tensor(np.ones(n, dtype="float32"))
    out = tvm.runtime.tensor(np.zeros((TASKS, LANES * ACC), dtype="float32"))
    ex["stream"](a, out)
    total = float(out.numpy().sum())
    if abs(total - n) > 1e-3 * n:  # the kernel must have read every element
        raise RuntimeError(f"stream kernel summed {total}, expected {n}")
    te = ex.mod.time_evaluator("stream", tvm.cpu(), number=3, repeat=repeat)
    return n * 4 / statistics.median(te(a, out).results) / 1e9
