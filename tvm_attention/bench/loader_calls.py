"""What a call through ``tvm_attention.load`` costs over the library itself, side by side
(``tvm-attention bench --loader``).

Serving code calls the kernel once per layer per generated token, so the loader's per-call work
(argument checks, the output buffer) is paid at decode shapes, where the kernel itself takes
tens of microseconds. This times, alternately on the same inputs (a kvcache decode step, GQA
32:8, D=128, fp32, batch 1, 256 keys by default): the bare exported function (``function``, a
preallocated output), the loader returning a new array, the loader writing ``out=``, and the
loader with read-only inputs (a cache mapped with ``np.load(mmap_mode="r")``). Prints each one's
best round (median µs per call) and its ratio to the bare call.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..artifact import export, validate_built
from ..build import build_kernel
from ..loader import aligned_empty, load
from ..spec import AttentionSpec
from .serving import alternate

BATCH = 1
CACHE = 256  # keys per sequence
CALLS = 400  # calls per round
ROUNDS = 6


def _median_us(fn, calls: int) -> float:
    fn()  # warm
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def run(batch: int = BATCH, cache: int = CACHE, calls: int = CALLS, rounds: int = ROUNDS,
        say: Callable[[str], None] = print) -> dict[str, list[float]]:
    """Time the four ways of calling one kvcache decode kernel; print the best round of each
    (median µs per call) and its ratio to the bare call; return every round's samples."""
    spec = AttentionSpec(batch=batch, heads=32, kv_heads=8, seq_q=1, seq_kv=cache, head_dim=128, causal=True,
                         layout="kvcache")
    with tempfile.TemporaryDirectory() as d:
        b = build_kernel(spec, cache=True)
        export(b, d, validate_built(b))
        kernel = load(d, num_threads=1)
        lay = spec.layout_info
        x = lay.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [cache] * batch, "max_len": cache})
        args = [aligned_empty(v.shape, v.dtype) for v in x.values()]
        for dst, src in zip(args, x.values()):
            dst[...] = src
        o = aligned_empty(x["q"].shape, x["q"].dtype)
        np.save(Path(d) / "k.npy", args[1])
        np.save(Path(d) / "v.npy", args[2])
        ro = [args[0], np.load(Path(d) / "k.npy", mmap_mode="r"), np.load(Path(d) / "v.npy", mmap_mode="r"), *args[3:]]
        fns = {
            "bare function": lambda: _median_us(lambda: kernel.function(*args, o), calls),
            "loader": lambda: _median_us(lambda: kernel(*args), calls),
            "loader, out=": lambda: _median_us(lambda: kernel(*args, out=o), calls),
            "loader, read-only cache": lambda: _median_us(lambda: kernel(*ro), calls),
        }
        samples = alternate(fns, rounds)
    best = {k: min(v) for k, v in samples.items()}
    say(f"kvcache decode GQA 32:8 D=128 fp32, batch {batch}, {cache} keys, 1 thread; "
        f"best of {rounds} rounds of {calls} calls (median µs per call)")
    for k, v in best.items():
        say(f"  {k:<24} {v:8.1f} µs  {v / best['bare function']:.2f}x the bare call "
            f"(rounds {min(samples[k]):.1f}-{max(samples[k]):.1f})")
    return samples
