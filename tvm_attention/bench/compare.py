"""``tvm-attention compare``: several schedules of one spec, side by side.

Each entry is a built kernel: a hand preset (``fused``, ``materialized``, ``rowcache``), a hand
knob set (``fused:{"block_n": 128}``), the best tuned record (``fused-tuned``; with no log for the
spec on this CPU nothing is built: ``logs.NoTuningLog`` says how to make one), or a build with
batch, seq_q and seq_kv symbolic (``fused-dyn``, ``fused-dyn:{knobs}``; timed at the spec's shape,
and next to its static twin the table is followed by the ratio static time / dynamic time). For each: knobs
(or trace summary), audit verdict, on-chip bytes per tile (local/shared allocations of the final
IR), time (median ± std), GFLOP/s and max abs error vs the float64 reference on sampled rows.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..build import build_from_record, build_kernel
from ..logs import TUNE_HINT, NoTuningLog, best_records, default_work_dir, search_dirs
from ..reference import reference_attention
from ..spec import DYNAMIC_DIMS, AttentionSpec
from ..target import resolve_target
from ..timing import Timing, aligned_inputs, time_built
from .plots import _plt

SCHEDULES = ("fused", "materialized", "rowcache")
#: ``NAME-dyn``: the NAME schedule with every dim that may be symbolic left symbolic.
DYN_SUFFIX = "-dyn"


@dataclasses.dataclass
class Entry:
    label: str
    source: str = ""
    knobs: dict[str, Any] | None = None
    audit: str = ""
    on_chip_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    global_bytes: int = 0
    timing: Timing | None = None
    max_abs_err: float | None = None
    error: str | None = None
    trace_summary: list[str] = dataclasses.field(default_factory=list)

    def gflops(self, spec: AttentionSpec) -> float | None:
        return self.timing.gflops(spec) if self.timing else None


def parse_entry(text: str) -> tuple[str, str, dict | None]:
    """``name`` or ``name:{json knobs}`` → (label, schedule, knobs)."""
    name, _, knobs = text.partition(":")
    if knobs:
        try:
            return text, name, json.loads(knobs)
        except json.JSONDecodeError as e:
            raise ValueError(f"schedule {text!r}: knobs are not valid JSON ({e})") from None
    return text, name, None


def tuned_record(spec: AttentionSpec, schedule: str):
    """(target, (workload, record)): the best record of ``schedule`` for ``spec`` on this CPU;
    :class:`NoTuningLog`, naming the folders looked in and how to make one, when no log has one."""
    target = resolve_target("llvm")
    recs = best_records(spec, target, schedule, default_work_dir(spec, target), k=1)
    if not recs:
        raise NoTuningLog(f"no tuning log for {spec.short_name()} ({schedule}) on this target: looked in "
                          f"{', '.join(str(d) for d in search_dirs(spec, target))}. {TUNE_HINT}")
    return target, recs[0]


def build_entry(spec: AttentionSpec, text: str, tuned: dict | None = None):
    """(label, built kernel) of one entry; ``tuned``: schedule -> :func:`tuned_record`, already read."""
    label, name, knobs = parse_entry(text)
    if name.endswith("-tuned"):
        schedule = name[: -len("-tuned")]
        target, rec = (tuned or {}).get(schedule) or tuned_record(spec, schedule)
        return label, build_from_record(spec, schedule, target, *rec)
    if name.endswith(DYN_SUFFIX) and name[: -len(DYN_SUFFIX)] in SCHEDULES:
        # representative = the spec's shape: same knobs, same inputs, only the signature differs
        dyn = dataclasses.replace(spec, dynamic=DYNAMIC_DIMS)
        return label, build_kernel(dyn, schedule=name[: -len(DYN_SUFFIX)], knobs=knobs, cache=True)
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: use fused, materialized, rowcache, fused-tuned, "
                         "fused-dyn, or NAME:{knobs json}")
    return label, build_kernel(spec, schedule=name, knobs=knobs, cache=True)


def compare(spec: AttentionSpec, entries: list[str], repeat: int = 5) -> list[Entry]:
    import tvm

    # A missing log is the user's to make (NoTuningLog: the CLI's error, exit 2), not a row of the
    # table: found before anything is built.
    names = [text.partition(":")[0] for text in entries]
    tuned = {n[: -len("-tuned")]: tuned_record(spec, n[: -len("-tuned")]) for n in names if n.endswith("-tuned")}
    q, k, v, o = aligned_inputs(spec)
    rows = np.unique(np.linspace(0, spec.seq_q - 1, num=min(32, spec.seq_q)).astype(int))
    ref = reference_attention(spec, q, k, v, rows=rows)
    out = []
    for text in entries:
        e = Entry(text)
        try:
            label, built = build_entry(spec, text, tuned)
            e.source = built.source
            e.knobs = built.knobs.to_dict() if built.knobs else None
            e.audit = built.audit.verdict
            by_scope = built.audit.bytes_by_scope()
            e.on_chip_bytes = {s: b for s, b in by_scope.items() if s != "global"}
            e.global_bytes = by_scope.get("global", 0)
            if built.trace:
                e.trace_summary = [line for line in built.trace.splitlines() if "sample_" in line][:8]
            args = [tvm.runtime.tensor(x) for x in (q, k, v, o)]
            built.function(*args)
            e.max_abs_err = float(np.abs(args[3].numpy()[:, :, rows, :] - ref).max())
            e.timing = time_built(built, spec, repeat=repeat)
        except Exception as ex:  # recorded, the comparison goes on
            e.error = f"{type(ex).__name__}: {ex}"
        out.append(e)
    return out


def format_compare(spec: AttentionSpec, entries: list[Entry]) -> str:
    lines = [f"compare {spec.short_name()}",
             "| schedule | source | knobs | audit | on-chip bytes (per tile) | global scratch | time ms | GFLOP/s | max abs err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        if e.error:
            lines.append(f"| {e.label} | - | - | - | - | - | - | - | {e.error} |")
            continue
        knobs = " ".join(f"{k}={v}" for k, v in (e.knobs or {}).items() if k != "vector_lanes") or "-"
        chip = ", ".join(f"{s} {b}" for s, b in e.on_chip_bytes.items()) or "-"
        t = f"{e.timing.median_s * 1e3:.3f} ± {e.timing.std_s * 1e3:.3f}"
        lines.append(f"| {e.label} | {e.source} | {knobs} | {e.audit} | {chip} | {e.global_bytes} | {t} | "
                     f"{e.gflops(spec):.1f} | {e.max_abs_err:.1e} |")
    lines += dynamic_ratios(entries)
    return "\n".join(lines)


def static_twin(label: str) -> str | None:
    """``fused-dyn`` -> ``fused``, ``fused-dyn:{k}`` -> ``fused:{k}``; None for a static label."""
    name, sep, knobs = label.partition(":")
    if not name.endswith(DYN_SUFFIX):
        return None
    return name[: -len(DYN_SUFFIX)] + sep + knobs


def dynamic_ratios(entries: list[Entry]) -> list[str]:
    """One line per symbolic entry timed next to its static twin: static time / dynamic time
    (≥ 1: the symbolic build is as fast)."""
    by = {e.label: e for e in entries if e.timing}
    out = []
    for e in entries:
        twin = by.get(static_twin(e.label) or "")
        if e.timing and twin:
            out.append(f"{twin.label}/{e.label} (static time / dynamic time): "
                       f"{twin.timing.median_s * 1e3:.3f} ms / {e.timing.median_s * 1e3:.3f} ms = "
                       f"{twin.timing.median_s / e.timing.median_s:.3f}")
    return ([""] if out else []) + out


def compare_plot(spec: AttentionSpec, entries: list[Entry], path: Path) -> list[str]:
    plt = _plt()
    ok = [e for e in entries if e.timing]
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(ok)), 4))
    ax.bar(range(len(ok)), [e.gflops(spec) for e in ok],
           yerr=[e.timing.std_s / e.timing.median_s * e.gflops(spec) for e in ok],
           color=["C0" if e.audit == "fused" else "C3" for e in ok])
    ax.set_xticks(range(len(ok)))
    ax.set_xticklabels([e.label for e in ok], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("GFLOP/s")
    ax.set_title(spec.short_name(), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [e.label for e in ok]
