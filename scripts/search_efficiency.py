#!/usr/bin/env python3
"""Search efficiency: how many trials the XGBoost-guided search needs against random sampling
of the same spaces (same budget, same seed), and whether a cost model warm-started from another
spec's log gets there sooner.

For each held-out case (``tvm_attention.bench.heldout``), three arms tune into ``--out``/<case>/<arm>
(resumable): ``xgb`` (the default search; ``--xgb-from DIR`` reuses a held-out run's logs,
DIR/<case>), ``random`` (``tune --search random``) and ``warm`` (``tune --warm-start SRC``, SRC the
committed log of the default spec on this target unless ``--warm-from``). Reports, per case and
arm, the best GFLOP/s after 8/16/32/64 trials and the trials needed to reach 95% of the best any
arm found, as a table, a JSON file and a plot of the tuning curves (``--out``/efficiency.png).
"""
from __future__ import annotations

import argparse
import os
import json
import sys
from pathlib import Path

ARMS = ("xgb", "random", "warm")


def main() -> int:
    # many tunes in one process: keep the builder/runner workers between them (driver.keep_workers)
    os.environ.setdefault("TVM_ATTENTION_KEEP_WORKERS", "1")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["d96", "gqa4"], help="held-out case names")
    p.add_argument("--trials", type=int, default=64)
    p.add_argument("--out", default="efficiency_logs")
    p.add_argument("--xgb-from", default=None, help="a --held-out run's log root to reuse as the xgb arm")
    p.add_argument("--warm-from", default=None, help="warm-start log (default: the committed default-spec log)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="short lengths (a smoke run)")
    a = p.parse_args()

    from tvm_attention.bench.heldout import held_out_cases
    from tvm_attention.bench.search import curve_milestones, efficiency_plot, trials_to_reach, tuning_curve
    from tvm_attention.spec import AttentionSpec
    from tvm_attention.target import resolve_target
    from tvm_attention.threads import set_num_threads
    from tvm_attention.tune.driver import tune
    from tvm_attention.logs import committed_work_dir

    threads = set_num_threads(a.threads)
    cases = {c.name: c for c in held_out_cases(tiny=a.tiny, cores=threads)}
    unknown = [n for n in a.cases if n not in cases]
    if unknown:
        print(f"unknown case(s): {', '.join(unknown)}; known: {', '.join(cases)}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, dict[str, list]] = {}
    rows = []
    for name in a.cases:
        case = cases[name]
        target = resolve_target(case.target)
        warm_src = Path(a.warm_from) if a.warm_from else committed_work_dir(
            AttentionSpec(batch=1, heads=8, seq_q=1024, head_dim=64, causal=True), target)
        curves[name] = {}
        for arm in a.arms:
            work = Path(a.xgb_from) / name if (arm == "xgb" and a.xgb_from) else out / name / arm
            kw = {"search": "random"} if arm == "random" else {"warm_start": warm_src} if arm == "warm" else {}
            print(f"## {name} [{arm}] {case.spec.short_name()}  log {work}", flush=True)
            tune(case.spec, target, "fused", trials=a.trials, work_dir=work, seed=a.seed, threads=threads,
                 progress=lambda m, arm=arm: print(f"  [{arm}] {m}", flush=True), **kw)
            curves[name][arm] = tuning_curve(case.spec, work)
        best = max((c[-1][1] for c in curves[name].values() if c), default=float("nan"))
        for arm, c in curves[name].items():
            rows.append({"case": name, "arm": arm, "best_gflops": c[-1][1] if c else None,
                         "trials_to_95": trials_to_reach(c, 0.95 * best), "milestones": curve_milestones(c),
                         "reference_gflops": best})
    (out / "efficiency.json").write_text(json.dumps({"trials": a.trials, "seed": a.seed, "rows": rows,
                                                     "curves": curves}, indent=2))
    plotted = efficiency_plot(curves, out / "efficiency.png")
    print(f"\n| case | arm | GFLOP/s after 8 / 16 / 32 / {a.trials} trials | trials to 95% of the best found |")
    print("|---|---|---|---|")
    for r in rows:
        ms = dict(r["milestones"])
        marks = " / ".join(f"{ms[n]:.1f}" if n in ms else "-" for n in (8, 16, 32, a.trials))
        t95 = r["trials_to_95"] if r["trials_to_95"] is not None else f"not in {a.trials}"
        print(f"| {r['case']} | {r['arm']} | {marks} | {t95} |")
    print(f"\nplot: {out / 'efficiency.png' if plotted else '(matplotlib missing: no plot)'}; JSON: {out / 'efficiency.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
