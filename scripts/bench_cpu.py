#!/usr/bin/env python3
"""Side-by-side CPU benchmark of the fused kernel against materialized, NumPy and PyTorch SDPA.

Default sweep (issue #2): fp32, B=1, H=8, D=64, S in {512, 1024, 2048, 4096, 8192}, causal and
not, every variant at the same thread count in one process. Prints a markdown table with
GFLOP/s, the fused/peer speedups and the fraction of a 2048² sgemm; writes JSON with --json.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys

from tvm_attention.bench.cpu import bench_spec, format_table, sgemm_ceiling, write_json
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import host_cpu
from tvm_attention.threads import set_num_threads


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--variants", nargs="+", default=["fused", "materialized", "numpy", "torch"])
    p.add_argument("--threads", type=int, default=None, help="threads for every variant (default: all cores)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None, help="write results here")
    a = p.parse_args()

    threads = set_num_threads(a.threads)
    causal = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
    ceiling = sgemm_ceiling(threads)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": host_cpu(), "machine": platform.machine(), "threads": threads,
        "sgemm_2048_gflops": ceiling,
    }
    print(f"# {meta['date']}  cpu={meta['cpu']}  threads={threads}  numpy sgemm 2048²: {ceiling:.1f} GFLOP/s",
          flush=True)
    rows = []
    for c in causal:
        for s in a.seq:
            spec = AttentionSpec(batch=a.batch, heads=a.heads, seq_q=s, head_dim=a.head_dim, causal=c)
            new = bench_spec(spec, threads, a.variants, repeat=a.repeat)
            rows += new
            print("  " + "  ".join(
                f"{r.variant}={r.gflops():.1f}" if r.timing else f"{r.variant}=({r.error})" for r in new
            ) + f"   [S={s} causal={c}]", flush=True)
    print(format_table(rows, ceiling))
    if a.json:
        write_json(a.json, rows, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
