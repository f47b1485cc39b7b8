#!/usr/bin/env python3
"""Side-by-side CPU benchmark of the fused kernel against materialized, NumPy and PyTorch SDPA.

The issue-#2 sweep: fp32, B=1, H=8, D=64, S in {512, 1024, 2048, 4096, 8192}, causal and not,
every variant at the same thread count in one process; GFLOP/s, ratios and the fraction of the
machine's FMA peak (a TVM FMA loop on every core; NumPy's 2048² sgemm, which the fused kernel can
beat, is printed for comparison). For the full research sweep (constant tokens, D=128, roofline,
plots) use `tvm-attention bench`.
"""
from __future__ import annotations

import argparse
import datetime
import sys

from tvm_attention.bench.cpu import measure_ceilings
from tvm_attention.bench.sweep import points, run_sweep, write_outputs
from tvm_attention.target import host_cpu
from tvm_attention.threads import set_num_threads


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--variants", nargs="+", default=["fused", "materialized", "numpy", "torch"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None, help="write bench.json/csv/md here")
    a = p.parse_args()
    threads = set_num_threads(a.threads)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": host_cpu(), "threads": threads}
    print(f"# {meta['date']} cpu={meta['cpu']} threads={threads}", flush=True)
    meta.update(measure_ceilings(threads, say=lambda m: print(m, flush=True)))
    causal = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
    pts = points(a.seq, [a.head_dim], causal, a.heads, 1, None)
    results = run_sweep(pts, a.variants, threads, repeat=a.repeat, min_repeat_ms=200,
                        say=lambda m: print(m, flush=True))
    meta.update(measure_ceilings(threads, say=print, earlier=meta))  # the better of start and end
    ceiling = meta["fma_peak_gflops"]
    print("\n| S | causal | " + " | ".join(f"{v} GFLOP/s" for v in a.variants)
          + " | fused/materialized | fused/torch | fused % of FMA peak |")
    print("|" + "---|" * (len(a.variants) + 5))
    by = {}
    for r in results:
        by.setdefault(r.spec, {})[r.variant] = r
    for spec, d in by.items():
        f = d.get("fused")
        cells = [f"{d[v].gflops:.1f}" if d.get(v) and d[v].timing else "-" for v in a.variants]

        def ratio(x):
            return f"{d[x].timing.median_s / f.timing.median_s:.2f}x" if f and f.timing and d.get(x) and d[x].timing else "-"

        pct = f"{100 * f.gflops / ceiling:.0f}%" if f and f.timing else "-"
        print(f"| {spec.seq_q} | {'yes' if spec.causal else 'no'} | " + " | ".join(cells)
              + f" | {ratio('materialized')} | {ratio('torch')} | {pct} |")
    if a.out:
        write_outputs(results, a.out, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
