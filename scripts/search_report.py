#!/usr/bin/env python3
"""Search as research: for each spec, the hand knobs and the best tuned record (knobs and its
sampling decisions), timed side by side in one process with PyTorch SDPA, plus the tuning curve
(best GFLOP/s vs trials) read from the log.

Default: the committed specs (fp32, B=1, H=8, D=64, S in {1024, 4096}, causal and not).

``--held-out``: the search where the hand presets were never tuned (an AVX2 target, head_dim 96
and 256, GQA 4:1 and 8:1, decode at batch 1 and 8; ``tvm_attention.bench.heldout``): each case is
tuned for ``--trials`` into ``--out``/<case> (resumable), then hand and tuned are timed side by
side; prints the table and the geometric mean, and writes ``--out``/heldout.json.
"""
from __future__ import annotations

import argparse
import os
import sys

from tvm_attention.artifact import validate_built
from tvm_attention.bench.peers import torch_sdpa_fn
from tvm_attention.bench.search import curve_milestones, readable_trace, tuning_curve
from tvm_attention.timing import time_built
from tvm_attention.build import build_from_record, build_kernel
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target
from tvm_attention.threads import set_num_threads
from tvm_attention.timing import aligned_inputs, time_callable
from tvm_attention.logs import best_records, default_work_dir


def main() -> int:
    # many tunes in one process: keep the builder/runner workers between them (driver.keep_workers)
    os.environ.setdefault("TVM_ATTENTION_KEEP_WORKERS", "1")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--schedule", default="fused", choices=["fused", "materialized", "rowcache"])
    p.add_argument("--work-dir", default=None, help="log folder (default per spec: your tune's log in the user cache if it has records, else the committed one)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--held-out", action="store_true", help="tune and time the held-out cases (see above)")
    p.add_argument("--trials", type=int, default=64, help="--held-out: tuning budget per case")
    p.add_argument("--out", default="heldout_logs", help="--held-out: log folders and heldout.json")
    p.add_argument("--only", nargs="+", default=None, help="--held-out: these case names only")
    p.add_argument("--tiny", action="store_true", help="--held-out: short lengths (a smoke run)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.held_out:
        return held_out(a)

    threads = set_num_threads(a.threads)
    target = resolve_target("llvm")
    summary = []
    for causal in {"both": [False, True], "yes": [True], "no": [False]}[a.causal]:
        for s in a.seq:
            spec = AttentionSpec(batch=1, heads=a.heads, seq_q=s, head_dim=a.head_dim, causal=causal)
            work = a.work_dir or default_work_dir(spec, target)
            print(f"\n## {spec.short_name()}  [{a.schedule}]  log {work}")
            hand = build_kernel(spec, schedule=a.schedule, target=target)
            print(f"hand knobs:  {hand.knobs.to_dict() if hand.knobs else '-'}")
            recs = best_records(spec, target, a.schedule, work, k=1)
            tuned = None
            if recs:
                tuned = build_from_record(spec, a.schedule, target, *recs[0])
                v = validate_built(tuned)
                print(f"tuned knobs: {tuned.knobs.to_dict() if tuned.knobs else '(MetaSchedule space)'}"
                      f"  validation {'PASS' if v.passed else 'FAIL'} {v.max_abs_err:.1e}")
                print("tuned sampling decisions:")
                for line in readable_trace(recs[0][1].trace):
                    print(f"    {line}")
                curve = tuning_curve(spec, work, a.schedule)
                print("tuning curve (trials: best GFLOP/s): " +
                      ", ".join(f"{n}: {g:.1f}" for n, g in curve_milestones(curve)))
            else:
                print("no tuned record for this spec/target")
            # Time side by side, interleaved twice to even out drift on a noisy machine.
            th = time_built(hand, repeat=a.repeat)
            tt = time_built(tuned, repeat=a.repeat) if tuned else None
            fn = torch_sdpa_fn(spec, threads)
            q, k, v, _ = aligned_inputs(spec)
            tq = time_callable(lambda: fn(q, k, v), repeat=a.repeat) if fn else None
            th2 = time_built(hand, repeat=a.repeat)
            th = min(th, th2, key=lambda t: t.median_s)
            line = f"hand {th.gflops(spec):.1f} GFLOP/s"
            if tt:
                line += f" | tuned {tt.gflops(spec):.1f} GFLOP/s | tuned/hand {th.median_s / tt.median_s:.3f}x"
            if tq:
                line += f" | torch {tq.gflops(spec):.1f} GFLOP/s | hand/torch {tq.median_s / th.median_s:.2f}x"
                if tt:
                    line += f" | tuned/torch {tq.median_s / tt.median_s:.2f}x"
            print(line)
            summary.append((spec, th, tt, tq))
    print("\n| S | causal | hand GFLOP/s | tuned GFLOP/s | tuned/hand | torch GFLOP/s | tuned/torch |")
    print("|---|---|---|---|---|---|---|")
    for spec, th, tt, tq in summary:
        print(f"| {spec.seq_q} | {'yes' if spec.causal else 'no'} | {th.gflops(spec):.1f} | "
              f"{tt.gflops(spec) if tt else float('nan'):.1f} | "
              f"{(th.median_s / tt.median_s) if tt else float('nan'):.3f} | "
              f"{tq.gflops(spec) if tq else float('nan'):.1f} | "
              f"{(tq.median_s / tt.median_s) if (tt and tq) else float('nan'):.2f} |")
    return 0


def held_out(a) -> int:
    import json
    from pathlib import Path

    from tvm_attention.bench.heldout import format_table, geomean, held_out_cases, run_case

    threads = set_num_threads(a.threads)
    cases = [c for c in held_out_cases(tiny=a.tiny, cores=threads) if a.only is None or c.name in a.only]
    unknown = set(a.only or []) - {c.name for c in held_out_cases(tiny=a.tiny)}
    if unknown:
        print(f"unknown case(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for c in cases:
        print(f"## {c.name}: {c.why}  {c.spec.short_name()}", flush=True)
        r = run_case(c, a.trials, out, seed=a.seed, repeat=a.repeat, threads=threads)
        print(f"   hand {r.hand_s * 1e3:.3f} ms, tuned {r.tuned_s * 1e3 if r.tuned_s else float('nan'):.3f} ms: "
              f"tuned/hand {r.ratio:.2f}x, kept {r.selected} ({r.ratio_selected:.2f}x), tune {r.tune_s:.0f} s",
              flush=True)
        results.append(r)
        (out / "heldout.json").write_text(json.dumps({"threads": threads, "trials": a.trials,
                                                      "results": [x.to_dict() for x in results]}, indent=2))
    print()
    print(format_table(results))
    print(f"\ngeometric mean tuned/hand {geomean([r.ratio for r in results]):.3f}x, after build's selection "
          f"{geomean([r.ratio_selected for r in results]):.3f}x over {len(results)} case(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
