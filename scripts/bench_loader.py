#!/usr/bin/env python3
"""What a call through ``tvm_attention.load`` costs over the library itself, side by side.

Serving code calls the kernel once per layer per generated token, so the loader's per-call work
(argument checks, the output buffer) is paid at decode shapes, where the kernel itself takes
tens of microseconds. This times, alternately on the same inputs (a kvcache decode step, GQA
32:8, D=128, fp32, batch 1, 256 keys by default): the bare exported function (``function``, a
preallocated output), the loader returning a new array, the loader writing ``out=``, and the
loader with read-only inputs (a cache mapped with ``np.load(mmap_mode="r")``). Prints each one's
best round (median µs per call) and its ratio to the bare call.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a source checkout

from tvm_attention.artifact import export, validate_built  # noqa: E402
from tvm_attention.bench.serving import alternate  # noqa: E402
from tvm_attention.build import build_kernel  # noqa: E402
from tvm_attention.loader import aligned_empty, load  # noqa: E402
from tvm_attention.spec import AttentionSpec  # noqa: E402


def _median_us(fn, calls: int) -> float:
    fn()  # warm
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cache", type=int, default=256, help="keys per sequence")
    p.add_argument("--calls", type=int, default=400, help="calls per round")
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args(argv)
    spec = AttentionSpec(batch=a.batch, heads=32, kv_heads=8, seq_q=1, seq_kv=a.cache, head_dim=128, causal=True,
                         layout="kvcache")
    with tempfile.TemporaryDirectory() as d:
        b = build_kernel(spec)
        export(b, d, validate_built(b))
        kernel = load(d, num_threads=1)
        lay = spec.layout_info
        x = lay.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [a.cache] * a.batch, "max_len": a.cache})
        args = [aligned_empty(v.shape, v.dtype) for v in x.values()]
        for dst, src in zip(args, x.values()):
            dst[...] = src
        o = aligned_empty(x["q"].shape, x["q"].dtype)
        np.save(Path(d) / "k.npy", args[1])
        np.save(Path(d) / "v.npy", args[2])
        ro = [args[0], np.load(Path(d) / "k.npy", mmap_mode="r"), np.load(Path(d) / "v.npy", mmap_mode="r"), *args[3:]]
        fns = {
            "bare function": lambda: _median_us(lambda: kernel.function(*args, o), a.calls),
            "loader": lambda: _median_us(lambda: kernel(*args), a.calls),
            "loader, out=": lambda: _median_us(lambda: kernel(*args, out=o), a.calls),
            "loader, read-only cache": lambda: _median_us(lambda: kernel(*ro), a.calls),
        }
        samples = alternate(fns, a.rounds)
    best = {k: min(v) for k, v in samples.items()}
    print(f"kvcache decode GQA 32:8 D=128 fp32, batch {a.batch}, {a.cache} keys, 1 thread; "
          f"best of {a.rounds} rounds of {a.calls} calls (median µs per call)")
    for k, v in best.items():
        print(f"  {k:<24} {v:8.1f} µs  {v / best['bare function']:.2f}x the bare call "
              f"(rounds {min(samples[k]):.1f}-{max(samples[k]):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
