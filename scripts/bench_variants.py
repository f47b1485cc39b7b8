#!/usr/bin/env python3
"""The attention variants' speed goals, side by side in one run (``tvm_attention.bench.variants``).

Pairs: a 16k causal prefill with a 4k window against plain causal (goal ≥ 3×); a decode step
against a 32k cache with a 4k window against one against a 4k cache (goal within 1.3×); softcap
(≥ 0.8×), ALiBi, sinks and kv_start (within 5 %) against the same kernel without, in prefill and
decode. Prints each ratio and writes ``variants.md``/``variants.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a source checkout

from tvm_attention.bench import variants  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--only", nargs="+", default=(), choices=list(variants.GOALS), help="pairs to run")
    p.add_argument("--tiny", action="store_true", help="small shapes, one round (a smoke run)")
    p.add_argument("--out", default="bench_out", help="folder for variants.md / variants.json")
    a = p.parse_args(argv)
    cfg = variants.quick_config() if a.tiny else variants.Config()
    if a.rounds:
        import dataclasses

        cfg = dataclasses.replace(cfg, rounds=a.rounds)
    report = variants.run(cfg, threads=a.threads, only=tuple(a.only))
    paths = variants.write(report, a.out)
    print(f"wrote {paths['md']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
