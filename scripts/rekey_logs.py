#!/usr/bin/env python3
"""Re-key tuning logs to the current workloads, keeping every record's trace and run times.

A change to a workload's IR makes every record of it stale (``build`` would no longer find it),
even a change that compiles to the very same machine code: binding a value with a Let instead of
writing it out, say. For such a change only, this rewrites each workload line of the logs to
the workload the current code generates from that line's ``attn.*`` attrs
(``task_mods.regenerate``), in place, so the record lines still point at their workloads by
line number. Prove first that the machine code did not move: the libraries the logs' best
records build (``logs.best_records``, ``build.build_from_record``) byte-identical before and
after, or for the hand schedules

    python scripts/codegen_digest.py --asm --no-cuda > before.txt   # on the old commit
    python scripts/codegen_digest.py --asm --no-cuda > after.txt
    diff <(grep ' asm ' before.txt) <(grep ' asm ' after.txt)      # empty

Any other change (a different loop nest, other instructions) needs new measurements:
``scripts/tune_defaults.sh``. Every record's trace must replay on its new workload, or nothing is
written. Usage: ``scripts/rekey_logs.py [FOLDER ...]`` (default: every committed log folder).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a source checkout

import tvm_ffi  # noqa: E402
from tvm.s_tir import meta_schedule as ms  # noqa: E402
from tvm.target import Target  # noqa: E402

from tvm_attention.logs import RECORD_FILE, WORKLOAD_FILE, parse_logs, replay_record, repo_logs_root  # noqa: E402
from tvm_attention.spec import AttentionSpec  # noqa: E402
from tvm_attention.task_mods import regenerate, tuning_spec  # noqa: E402

_NAME = re.compile(r"b(\d+)_h(\d+)_kv(\d+)_q(\d+)_k(\d+)_d(\d+)_(\w+?)_(full|causal)")


def spec_of(folder: Path) -> AttentionSpec:
    """The spec a committed log folder is named after (``logs.log_folder``'s short name)."""
    m = _NAME.fullmatch(folder.name)
    if m is None:
        raise SystemExit(f"{folder}: not a log folder name of the form b1_h8_kv8_q1024_k1024_d64_float32_causal")
    b, h, kv, q, k, d, dtype, mask = m.groups()
    return AttentionSpec(batch=int(b), heads=int(h), kv_heads=int(kv), seq_q=int(q), seq_kv=int(k),
                         head_dim=int(d), dtype=dtype, causal=mask == "causal")


def rekey(folder: Path) -> int:
    """Rewrite ``folder``'s workload file; the number of workloads that changed."""
    parsed = parse_logs(folder)  # strict: a bad line is an error, not a record lost
    with open(folder / RECORD_FILE) as f:
        target = Target(json.loads(f.readline())[1][2])  # the target the log was measured on
    spec = tuning_spec(spec_of(folder), target)
    new = []
    for wl in parsed.workloads:
        mine = regenerate(spec, wl.mod["main"], target)
        new.append(wl if mine is None or tvm_ffi.structural_equal(mine, wl.mod) else ms.database.Workload(mine))
    for idx, rec in parsed.records:  # raises if a trace no longer applies
        replay_record(new[idx], rec)
    lines = (folder / WORKLOAD_FILE).read_text().splitlines(keepends=True)
    if len(lines) != len(new):
        raise SystemExit(f"{folder / WORKLOAD_FILE}: blank lines; rekey keeps line numbers, fix the file first")
    changed = 0
    for i, (old, wl) in enumerate(zip(parsed.workloads, new)):
        if wl is not old:
            lines[i] = json.dumps(wl.as_json(), separators=(",", ":")) + "\n"
            changed += 1
    (folder / WORKLOAD_FILE).write_text("".join(lines))
    return changed


def main(argv: list[str]) -> int:
    folders = [Path(a) for a in argv] or sorted(p for p in repo_logs_root().glob("*/*") if (p / RECORD_FILE).exists())
    for folder in folders:
        print(f"{folder}: {rekey(folder)} workload(s) re-keyed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
