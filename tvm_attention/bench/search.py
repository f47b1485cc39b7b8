"""Search as research: hand knobs vs the best tuned record, timed side by side, and the curve."""
from __future__ import annotations

from pathlib import Path

from ..logs import FAILED_RUN_SECS, mean_secs, parse_logs, records_for
from ..spec import AttentionSpec
from ..task_mods import workload_matches
from .plots import _plt


def readable_trace(trace) -> list[str]:
    """The sampling decisions of a trace, one line each (the rest is fixed by the space)."""
    lines = []
    for inst in trace.insts:
        kind = inst.kind.name
        if kind.startswith("Sample"):
            decision = trace.decisions.get(inst) if hasattr(trace.decisions, "get") else None
            attrs = {k: v for k, v in zip(("n", "max_innermost_factor"), inst.attrs)} if kind == "SamplePerfectTile" else {}
            if kind == "SampleCategorical":
                cands = [int(x) for x in inst.attrs[0]]
                idx = int(decision) if decision is not None else None
                lines.append(f"{kind}({cands}) -> {cands[idx] if idx is not None else '?'}")
            else:
                dec = [int(x) for x in decision] if decision is not None else "?"
                lines.append(f"{kind}({', '.join(f'{k}={v}' for k, v in attrs.items())}) -> {dec}")
        elif kind == "Annotate" and len(inst.attrs) and str(inst.attrs[0]).startswith("meta_schedule."):
            lines.append(f"Annotate {inst.attrs[0]}")
    return lines


def tuning_curve(spec: AttentionSpec, work_dir: str | Path, schedule: str = "fused") -> list[tuple[int, float]]:
    """(trial number, best GFLOP/s so far) over the log's records of ``spec``/``schedule``, in
    the order they were measured."""
    parsed = parse_logs(work_dir)
    curve, best, n = [], float("inf"), 0
    ok: dict[int, bool] = {}
    for wl, rec in records_for(parsed, schedule):
        if id(wl) not in ok:
            ok[id(wl)] = workload_matches(spec, wl.mod, rec.target)  # read on the preset it was tuned from
        if not ok[id(wl)]:
            continue
        n += 1
        secs = mean_secs(rec)
        if secs < FAILED_RUN_SECS:
            best = min(best, secs)
        if best < float("inf"):
            curve.append((n, spec.flops() / best / 1e9))
    return curve


def curve_milestones(curve: list[tuple[int, float]], points=(8, 16, 32, 64, 128, 256)) -> list[tuple[int, float]]:
    out = []
    for p in points:
        best = [g for n, g in curve if n <= p]
        if best and p <= curve[-1][0]:
            out.append((p, best[-1]))
    if curve and (not out or out[-1][0] != curve[-1][0]):
        out.append(curve[-1])
    return out


def trials_to_reach(curve: list[tuple[int, float]], target_gflops: float) -> int | None:
    """The first trial whose best-so-far reaches ``target_gflops`` (None: never)."""
    return next((n for n, g in curve if g >= target_gflops), None)


def efficiency_plot(curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> list[str]:
    """One panel per case: best GFLOP/s so far against trials, one line per search arm. Returns
    the case names plotted (empty without matplotlib)."""
    if not curves:
        return []
    try:
        plt = _plt()
    except RuntimeError:  # matplotlib is optional
        return []
    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.4), squeeze=False)
    for ax, (case, arms) in zip(axes[0], curves.items()):
        for arm, curve in arms.items():
            if curve:
                ax.step([n for n, _ in curve], [g for _, g in curve], where="post", label=arm)
        ax.set_title(case)
        ax.set_xlabel("trials")
        ax.set_ylabel("best GFLOP/s so far")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return list(curves)
