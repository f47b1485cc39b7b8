#!/usr/bin/env python3
"""Continuous-batching simulation: varlen prefill + paged decode from a page pool, step by step.

See tvm_attention/bench/sim.py. Prints tokens/s of attention, the peak KV memory and the
reference check of sampled steps; --tiny is a smoke run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a source checkout

from tvm_attention.bench import sim  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="smoke run: a few short requests")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="mean new requests per step")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the statistics here")
    a = p.parse_args(argv)
    cfg = sim.tiny_config() if a.tiny else sim.SimConfig()
    over = {k: v for k, v in (("steps", a.steps), ("arrival_rate", a.rate), ("seed", a.seed)) if v is not None}
    cfg = dataclasses.replace(cfg, **over)
    stats = sim.run(cfg, threads=a.threads, say=lambda m: print(m, flush=True))
    print(sim.summary(stats))
    if a.json:
        Path(a.json).write_text(json.dumps(stats, indent=2) + "\n")
    return 0 if stats["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
