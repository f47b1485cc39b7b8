#!/usr/bin/env python3
"""Start, inspect or stop a local TVM RPC fleet (tracker + N servers) for distributed tuning.

    scripts/rpc_fleet.py start --servers 2 --key cpu-local   # prints the tracker address
    tvm-attention tune ... --rpc-tracker 127.0.0.1:PORT --rpc-key cpu-local
    scripts/rpc_fleet.py status
    scripts/rpc_fleet.py stop                                 # by the PIDs it recorded

Loopback (127.0.0.1) by default. State (tracker address, key, PIDs) in .rpc_fleet.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tvm_attention.tune.rpc import LocalFleet, parse_tracker, stop_from_state, tracker_status

STATE = Path(".rpc_fleet.json")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--servers", type=int, default=2)
    s.add_argument("--key", default="cpu-local")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--tracker-port", type=int, default=None)
    s.add_argument("--threads-per-server", type=int, default=1)
    sub.add_parser("status")
    sub.add_parser("stop")
    a = p.parse_args()
    if a.cmd == "start":
        if STATE.exists():
            print(f"a fleet is already recorded in {STATE}; stop it first", file=sys.stderr)
            return 2
        fleet = LocalFleet(a.servers, a.key, a.host, a.tracker_port, a.threads_per_server, STATE).start()
        print(f"tracker {fleet.address}  key {a.key}  servers {a.servers}  pids {fleet.pids()}")
        print(f"tune with: --rpc-tracker {fleet.address} --rpc-key {a.key}")
        return 0
    if not STATE.exists():
        print(f"no fleet recorded in {STATE}", file=sys.stderr)
        return 2
    state = json.loads(STATE.read_text())
    if a.cmd == "status":
        host, port = parse_tracker(state["tracker"])
        print(json.dumps({**state, **tracker_status(host, port, state["key"])}, indent=2))
        return 0
    print(f"stopped pids {stop_from_state(STATE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
