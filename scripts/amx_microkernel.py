#!/usr/bin/env python3
"""The AMX micro-kernel on its own, over a sweep of reduction depths: ``workloads/amx.py``'s
32 × 32 block call (``tvma_amx_mm_bf16``) repeated on one core over the same operands, in
GFLOP/s, from zero (QKᵀ's calls) and from C (PV's), with ``bench``'s measurement
(``bench.cpu.amx_tile_peak``, whose default, 8 steps from C, is the AMX roof the benchmarks
print).

The fused kernel's products run this call on each key tile's operands (QKᵀ: head_dim / 32 steps;
PV: block_n / 32). Timed alone it says how much of a prefill's product time is the call itself
(its C tiles zeroed or loaded, then stored, once per call; two A and two B tile loads per step)
and how much is the caches around it: A and B together are 4 KiB per step, past L1 at 16 steps.

Needs a CPU with AMX-BF16 (``grep amx_bf16 /proc/cpuinfo``); elsewhere it says so and exits 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a source checkout

from tvm_attention.bench.cpu import amx_tile_peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ksteps", type=int, nargs="+", default=[2, 4, 8, 16],
                    help="reduction steps of 32 per call (QKᵀ: head_dim / 32; PV: block_n / 32)")
    ap.add_argument("--iters", type=int, default=1 << 14, help="calls per timed run")
    a = ap.parse_args(argv)
    rows = []
    for ks in a.ksteps:
        runs = [amx_tile_peak(1, iters=a.iters, repeat=5, ksteps=ks, zero=z) for z in (True, False)]
        if runs[0] is None:
            print("this CPU has no AMX-BF16 (grep amx_bf16 /proc/cpuinfo): nothing to time", file=sys.stderr)
            return 2
        rows.append((ks, *(r["gflops"] for r in runs)))
    print("ksteps  A+B KiB  from zero (QKᵀ)  from C (PV)   GFLOP/s, one core, best of 5")
    for ks, z, c in rows:
        print(f"{ks:6d}  {ks * 4:7d}  {z:15.0f}  {c:11.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
