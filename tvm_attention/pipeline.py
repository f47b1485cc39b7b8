"""Choose, build and validate: what `build`, `run` and the benchmarks share.

Order of preference: explicit knobs (hand) > the best tuned record of the tuning log (validated
against NumPy before it is used; a record that computes wrong results is skipped, the next one
tried) > the hand preset. Without ``--from-log`` the logs are the user's (``tune``'s default
folder in the cache, ``tvm_attention.paths``) and then the committed one (``tuning_logs/`` of the
checkout), the first with a record that validates winning; when neither has one, ``say`` names
the folders looked in. A bad or cut line in a log is skipped with a warning through ``say``
(``tune`` is the one that fails on it, naming file and line).

With the default log (no ``--from-log``) on a CPU target, the tuned build is then timed side by
side with the hand build and the faster one is kept: a log's best time is the minimum over noisy
measurements made in another process, and on these VMs the hand schedule already runs near the
sgemm ceiling, so the log's winner is not always faster here and now. Both times go into the
manifest (``schedule.selection``). An explicit ``--from-log`` always uses the log.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from . import build_cache
from .artifact import validate_built
from .build import BuiltKernel, build_from_record, build_kernel
from .logs import TUNE_HINT, best_records, log_folder, search_dirs, target_key
from .spec import AttentionSpec
from .target import resolve_target
from .task_mods import tuning_spec
from .timing import time_built
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
    cache: bool = False,
) -> tuple[BuiltKernel, ValidationResult]:
    """``cache``: take every build (tuned and hand) from the build cache when it holds it
    (``tvm_attention.build_cache``); each is validated here all the same."""
    target = resolve_target(target)
    if knobs is None and use_log:
        explicit = log_dir is not None
        # A symbolic (or varlen) build takes its knobs from the log of its representative static
        # shape: that is where `tune` puts them (tile sizes do not depend on the length). A paged
        # decode step is tuned as itself, at its representative step (tune.paged).

        rep = tuning_spec(spec, target, schedule)
        # Without --from-log: the user's own tuning log first, then the committed one; the first
        # with a record that validates wins.
        # Then the committed logs of other targets whose code this one may run: found by the
        # ISA features, not the CPU's name (logs.usable_on).
        dirs = [Path(log_dir)] if explicit else search_dirs(rep, target, elsewhere=True)
        exact = dirs if explicit else search_dirs(rep, target)
        tried = []
        for work in dirs:
            candidates = best_records(rep, target, schedule, work, k=TUNED_CANDIDATES, say=say,
                                      elsewhere=work not in exact) if work.exists() else []
            if explicit and not candidates:
                raise LogNotUsable(
                    f"{work}: no successful {schedule} record for {rep.short_name()} on this target"
                )
            if candidates:
                tried.append(str(work))
            for i, (wl, rec) in enumerate(candidates):
                built, validation = _validated(lambda: build_from_record(spec, schedule, target, wl, rec, cache=cache),
                                               seed, say)
                built.log_dir = str(work)
                if not validation.ran:
                    # Cross-compiled (this host cannot run the target's code, or no GPU): the
                    # record cannot be checked or timed here; it is used, recorded as not run.
                    say(f"tuned record #{i + 1} from {work} not validated here ({validation.reason})")
                    return built, validation
                if validation.passed:
                    if explicit or target.kind.name != "llvm":
                        return built, validation
                    return _faster_of(built, validation, spec, schedule, target, seed, say, cache)
                say(f"tuned record #{i + 1} from {work} failed validation ({validation.format()}); trying the next")
        if tried:
            say(f"no tuned record from {', '.join(tried)} validated; using the hand schedule")
        else:
            say(f"no tuning log for {log_folder('', rep, target).name} [{schedule}] on {target_key(target)} "
                f"(looked in {', '.join(str(d) for d in dirs)}); using the hand schedule. {TUNE_HINT}")
    built, validation = _validated(lambda: build_kernel(spec, schedule=schedule, target=target, knobs=knobs,
                                                        cache=cache), seed, say)
    if knobs is None and use_log:
        built.logs_searched = [str(d) for d in dirs]
    return built, validation


def _validated(make: Callable[[], BuiltKernel], seed: int, say,
               first: BuiltKernel | None = None) -> tuple[BuiltKernel, ValidationResult]:
    """``make()``'s build (``first`` when made already) and its validation. A build from the
    build cache that fails it is taken out of the cache and built again (a poisoned or damaged
    entry must not fail every run after it); a fresh build that fails is returned as it is, for
    the caller to report."""
    built = make() if first is None else first
    validation = validate_built(built, seed=seed)
    if validation.ran and not validation.passed and built.cache_entry:
        say(f"the build cache's entry {built.cache_entry} failed validation ({validation.format()}); removed, "
            "building it again")
        build_cache.remove(Path(built.cache_entry))
        built = make()
        validation = validate_built(built, seed=seed)
    return built, validation


def _faster_of(tuned: BuiltKernel, tuned_validation: ValidationResult, spec: AttentionSpec, schedule: str,
               target, seed: int, say, cache: bool = False) -> tuple[BuiltKernel, ValidationResult]:
    """Time the tuned and the hand build side by side (alternating, best median of two rounds
    each) and keep the faster; the selection and both times are recorded on the winner."""
    def make_hand():
        return build_kernel(spec, schedule=schedule, target=target, cache=cache)

    hand = make_hand()
    times = {"tuned": [], "hand": []}
    for _ in range(2):
        for name, b in (("tuned", tuned), ("hand", hand)):
            times[name].append(time_built(b, spec, repeat=3, min_repeat_ms=50).median_s)
    t_tuned, t_hand = min(times["tuned"]), min(times["hand"])
    selection = {"tuned_s": t_tuned, "hand_s": t_hand, "tuned_log": tuned.log_dir,
                 "kept": "tuned" if t_tuned <= t_hand else "hand"}
    if t_tuned <= t_hand:
        tuned.selection = selection
        return tuned, tuned_validation
    say(f"hand schedule {t_tuned / t_hand:.2f}x faster than the log's best here: keeping the hand build")
    hand, validation = _validated(make_hand, seed, say, first=hand)
    hand.selection = selection
    return hand, validation
