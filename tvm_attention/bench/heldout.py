"""Held-out evaluation of the search: shapes and targets the hand presets were never tuned on.

For each case: tune a fixed budget into a fresh log, build the hand preset and the log's best
record, validate both, and time them side by side (interleaved, twice, the faster round of each
kept). ``build`` keeps the tuned kernel only when it measured faster than the hand one here, so
the case also reports the ratio *after* that selection, which is never below 1 by more than the
noise of one more round.

The cases are one list (:func:`held_out_cases`), shared by ``scripts/search_report.py
--held-out``, its tiny mode in the tests, and the table in docs/results/tuning.md.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable

from ..artifact import validate_built
from ..build import build_from_record, build_kernel
from ..logs import best_records
from ..spec import AttentionSpec
from ..target import resolve_target
from ..timing import time_built
from ..tune.driver import tune


@dataclasses.dataclass(frozen=True)
class HeldOutCase:
    name: str
    spec: AttentionSpec
    target: Any  # "llvm" (this CPU, named) or a JSON target dict
    why: str  # what the hand preset was not tuned for


def held_out_cases(tiny: bool = False, cores: int | None = None) -> list[HeldOutCase]:
    """The held-out set: an AVX2 target, head_dim 96 and 256, GQA 4:1 and 8:1, decode at batch 1
    and 8 (contiguous, and paged). ``tiny``: the same kinds at lengths a test can afford, without
    the paged ones (``tests/test_kvcache.py`` tunes a paged step)."""
    import os

    s = 256 if tiny else 2048
    skv_decode = (512, 256) if tiny else (16384, 4096)
    avx2 = {"kind": "llvm", "mcpu": "haswell", "num-cores": cores or os.cpu_count() or 1}
    pre = dict(batch=1, seq_q=s, causal=True)
    return [
        HeldOutCase("avx2", AttentionSpec(heads=8, head_dim=64, **pre), avx2,
                    "an AVX2 target (8 fp32 lanes, 16 registers); presets are sized for AVX-512"),
        HeldOutCase("d96", AttentionSpec(heads=8, head_dim=96, **pre), "llvm", "head_dim 96"),
        HeldOutCase("d256", AttentionSpec(heads=4, head_dim=256, **pre), "llvm", "head_dim 256"),
        HeldOutCase("gqa4", AttentionSpec(heads=16, kv_heads=4, head_dim=64, **pre), "llvm", "GQA 4:1"),
        HeldOutCase("gqa8", AttentionSpec(heads=32, kv_heads=4, head_dim=64, **pre), "llvm", "GQA 8:1"),
        HeldOutCase("decode_b1", AttentionSpec(batch=1, heads=32, kv_heads=8, seq_q=1, seq_kv=skv_decode[0],
                                               head_dim=128), "llvm", "decode, batch 1 (GQA 4:1, D=128)"),
        HeldOutCase("decode_b8", AttentionSpec(batch=8, heads=32, kv_heads=8, seq_q=1, seq_kv=skv_decode[1],
                                               head_dim=128), "llvm", "decode, batch 8 (GQA 4:1, D=128)"),
    ] + ([] if tiny else [  # tuned in pages (tune.paged); the tests tune a tiny paged step themselves
        HeldOutCase(f"paged_b{b}", AttentionSpec(batch=b, heads=32, kv_heads=8, seq_q=1, seq_kv=n, head_dim=128,
                                                 layout="paged"), "llvm",
                    f"paged decode, batch {b} (GQA 4:1, D=128, 16-key pages), tuned in pages")
        for b, n in ((1, skv_decode[0]), (8, skv_decode[1]))])


@dataclasses.dataclass
class HeldOutResult:
    case: HeldOutCase
    trials: int
    tune_s: float
    hand_s: float
    tuned_s: float | None  # None: the log has no valid record
    selected: str  # "tuned" or "hand": what build would keep
    selected_s: float
    hand_knobs: dict | None
    tuned_knobs: dict | None
    tuned_valid: bool
    error: str | None = None

    @property
    def ratio(self) -> float:
        """hand time / tuned time (> 1: the search found a faster kernel)."""
        return self.hand_s / self.tuned_s if self.tuned_s else math.nan

    @property
    def ratio_selected(self) -> float:
        return self.hand_s / self.selected_s

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["case"] = {"name": self.case.name, "spec": self.case.spec.to_dict(), "target": self.case.target,
                     "why": self.case.why}
        d["ratio"], d["ratio_selected"] = self.ratio, self.ratio_selected
        return d


def run_case(case: HeldOutCase, trials: int, work_root: str | Path, seed: int = 0, repeat: int = 5,
             threads: int | None = None, progress: Callable[[str], None] = print) -> HeldOutResult:
    """Tune ``case`` for ``trials`` into ``work_root/<name>`` (resumable), then time hand vs tuned."""
    target = resolve_target(case.target)
    work = Path(work_root) / case.name
    t0 = time.time()
    tune(case.spec, target, "fused", trials=trials, work_dir=work, seed=seed, threads=threads,
         progress=lambda m: progress(f"  [{case.name}] {m}"))
    tune_s = time.time() - t0
    hand = build_kernel(case.spec, target=target)
    tuned, valid = None, False
    for wl, rec in best_records(case.spec, target, "fused", work, k=3):
        b = build_from_record(case.spec, "fused", target, wl, rec)
        if validate_built(b).passed:
            tuned, valid = b, True
            break

    def t(b) -> float:
        return time_built(b, case.spec, repeat=repeat, min_repeat_ms=100).median_s

    times: dict[str, list[float]] = {"hand": [], "tuned": []}
    for _ in range(2):  # interleaved: drift on a noisy machine hits both
        times["hand"].append(t(hand))
        if tuned is not None:
            times["tuned"].append(t(tuned))
    hand_s = min(times["hand"])
    tuned_s = min(times["tuned"]) if tuned is not None else None
    selected = "tuned" if tuned_s is not None and tuned_s <= hand_s else "hand"
    # build's selection, then one more round of the kept kernel against the hand one
    selected_s = t(tuned) if selected == "tuned" else hand_s
    if selected == "tuned":
        hand_s = min(hand_s, t(hand))
    return HeldOutResult(case, trials, tune_s, hand_s, tuned_s, selected, selected_s,
                         hand.knobs.to_dict() if hand.knobs else None,
                         tuned.knobs.to_dict() if tuned is not None and tuned.knobs else None, valid)


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def format_table(results: list[HeldOutResult]) -> str:
    lines = ["| case | held out for | spec | trials | hand ms | tuned ms | tuned/hand | after build's selection | tuned knobs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tuned = f"{r.tuned_s * 1e3:.3f}" if r.tuned_s else "-"
        knobs = ", ".join(f"{k}={v}" for k, v in (r.tuned_knobs or {}).items() if v not in (None, False))
        lines.append(f"| {r.case.name} | {r.case.why} | {r.case.spec.short_name()} | {r.trials} | "
                     f"{r.hand_s * 1e3:.3f} | {tuned} | {r.ratio:.2f}× | {r.ratio_selected:.2f}× | {knobs or '-'} |")
    lines.append(f"| **geometric mean** | | | | | | **{geomean([r.ratio for r in results]):.2f}×** | "
                 f"**{geomean([r.ratio_selected for r in results]):.2f}×** | |")
    return "\n".join(lines)
