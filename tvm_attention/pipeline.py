"""Choose, build and validate: what `build`, `run` and the benchmarks share.

Order of preference: explicit knobs (hand) > the best tuned record of the tuning log (validated
against NumPy before it is used; a record that computes wrong results is skipped, the next one
tried) > the hand preset.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from .artifact import validate_built
from .build import BuiltKernel, build_from_record, build_kernel
from .spec import AttentionSpec
from .target import resolve_target
from .validate import ValidationResult

TUNED_CANDIDATES = 3


class LogNotUsable(RuntimeError):
    """An explicitly requested tuning log has no usable record for this spec and target."""


def build_best(
    spec: AttentionSpec,
    schedule: str = "fused",
    target: Any = "llvm",
    knobs: dict | None = None,
    use_log: bool = True,
    log_dir: str | os.PathLike | None = None,
    seed: int = 0,
    say: Callable[[str], None] = lambda s: None,
) -> tuple[BuiltKernel, ValidationResult]:
    target = resolve_target(target)
    if knobs is None and use_log:
        from .tune.logs import best_records, default_work_dir

        explicit = log_dir is not None
        work = Path(log_dir) if explicit else default_work_dir(spec, target)
        candidates = best_records(spec, target, schedule, work, k=TUNED_CANDIDATES) if work.exists() else []
        if explicit and not candidates:
            raise LogNotUsable(
                f"{work}: no successful {schedule} record for {spec.short_name()} on this target"
            )
        for i, (wl, rec) in enumerate(candidates):
            built = build_from_record(spec, schedule, target, wl, rec)
            built.log_dir = str(work)
            validation = validate_built(built, seed=seed)
            if validation.passed:
                return built, validation
            say(f"tuned record #{i + 1} from {work} failed validation ({validation.format()}); trying the next")
        if candidates:
            say(f"no tuned record from {work} validated; using the hand schedule")
    built = build_kernel(spec, schedule=schedule, target=target, knobs=knobs)
    return built, validate_built(built, seed=seed)
