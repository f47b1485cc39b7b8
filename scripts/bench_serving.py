#!/usr/bin/env python3
"""Serving benchmarks: dynamic vs static, varlen vs dense, loader overhead per call.

Ratios measured side by side in one run (tvm_attention/bench/serving.py); prints a markdown table
and writes serving.md and serving.json to --out. `--quick` is a smoke run on short lengths.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a source checkout

from tvm_attention.bench import serving  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: short lengths, few rounds and calls")
    p.add_argument("--rounds", type=int, default=None, help="alternated rounds per comparison (a, b)")
    p.add_argument("--calls", type=int, default=None, help="loader calls per measurement (c)")
    p.add_argument("--threads", type=int, default=None, help="threads for every variant (default: all cores)")
    p.add_argument("--out", default="bench_out/serving", help="folder for serving.md/json (default: bench_out/serving)")
    a = p.parse_args(argv)
    cfg = serving.quick_config() if a.quick else serving.full_config()
    over = {k: v for k, v in (("rounds", a.rounds), ("calls", a.calls)) if v is not None}
    if over:
        cfg = serving.Config(**{**cfg.__dict__, **over})
    report = serving.run(cfg, threads=a.threads, quick=a.quick, say=lambda m: print(m, flush=True))
    paths = serving.write(report, a.out)
    print()
    print(serving.markdown(report))
    print(f"\nresults: {paths['md']}, {paths['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
