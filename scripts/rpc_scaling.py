#!/usr/bin/env python3
"""Tuning throughput on 1 vs 2 loopback RPC servers (same spec, trials and seed), for the notes.

Builds stay local; only measurements move to the servers. On a 2-core machine the servers share
the cores with the builder, so this shows the mechanism more than a real fleet's speedup.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

from tvm_attention.spec import AttentionSpec
from tvm_attention.tune.driver import tune
from tvm_attention.tune.rpc import LocalFleet


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--per-round", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    a = p.parse_args()
    spec = AttentionSpec(batch=1, heads=4, seq_q=a.seq, head_dim=64)
    for servers in (1, 2):
        with LocalFleet(servers=servers, key=f"scale{servers}") as fleet, tempfile.TemporaryDirectory() as work:
            t = time.time()
            r = tune(spec, trials=a.trials, per_round=a.per_round, work_dir=work, rpc_tracker=fleet.address,
                     rpc_key=f"scale{servers}", progress=lambda m: None)
            dt = time.time() - t
            print(f"{servers} server(s): {r.trials_new} trials in {dt:.1f} s = {60 * r.trials_new / dt:.1f} trials/min",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
