"""Benchmarks: every variant of a spec timed side by side in one process."""
from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator


def write_report(report: dict[str, Any], out_dir: str | Path, stem: str,
                 markdown: Callable[[dict[str, Any]], str]) -> dict[str, Path]:
    """Write ``<stem>.json`` (the report) and ``<stem>.md`` (its table) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["md"].write_text(markdown(report) + "\n")
    return paths


def fmt_duration(s: float) -> str:
    """A duration said plainly: ``45s``, ``1m12s`` (under 10 minutes), ``15m``, ``1h05m``; ``?``
    when unknown."""
    if not math.isfinite(s):
        return "?"
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    if s < 600:
        return f"{s // 60}m{s % 60:02d}s"
    m = int(round(s / 60))
    return f"{m}m" if m < 60 else f"{m // 60}h{m % 60:02d}m"


class Progress:
    """How far a benchmark is: ``total`` units known up front (a sweep's (point, variant)
    measurements, a decode or half-precision benchmark's points), ``done`` so far, and the
    ``[i/N, elapsed, ETA]`` tag its progress lines begin with. ETA = elapsed / i · (N − i): it
    assumes the units left cost the average so far."""

    def __init__(self, total: int, clock: Callable[[], float] = time.perf_counter):
        self.total, self.done, self.clock, self.t0 = int(total), 0, clock, clock()

    def advance(self, n: int = 1) -> None:
        self.done += n

    @property
    def elapsed(self) -> float:
        return self.clock() - self.t0

    @property
    def eta(self) -> float:
        return self.elapsed / self.done * (self.total - self.done) if self.done else math.inf

    def tag(self) -> str:
        """``[3/42, 1m12s elapsed, ETA 15m]``; ``[42/42, 17m elapsed, done]`` at the end."""
        head = f"[{self.done}/{self.total}, {fmt_duration(self.elapsed)} elapsed, "
        return head + ("done]" if self.done >= self.total else f"ETA {fmt_duration(self.eta)}]")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a benchmark: ``partial`` is what the function returns normally, holding what
    was measured before the interrupt (a report's meta marked ``interrupted``), ``completed`` of
    ``total`` units. A KeyboardInterrupt still: a caller that does not look at it stops as before."""

    def __init__(self, partial: Any, completed: int, total: int):
        super().__init__(f"interrupted after {completed} of {total}")
        self.partial, self.completed, self.total = partial, completed, total


def best_of_alternated(timers: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """The best time (s) of each timer over ``rounds`` rounds, taken alternately (forward, then
    backward), so that a drift of the machine's speed reaches each of them alike."""
    best = {n: float("inf") for n in timers}
    for r in range(rounds):
        for n in (list(timers) if r % 2 == 0 else list(reversed(timers))):
            best[n] = min(best[n], timers[n]())
    return best


def mark_interrupted(meta: dict[str, Any], completed: int, total: int) -> None:
    """The report meta of a partial run: ``"interrupted": true, "completed": i, "total": N``."""
    meta.update(interrupted=True, completed=completed, total=total)


def partial_line(meta: dict[str, Any], unit: str) -> list[str]:
    """A partial report's first Markdown lines (none for a complete one)."""
    if not meta.get("interrupted"):
        return []
    return [f"**partial: interrupted after {meta['completed']} of {meta['total']} {unit}** (Ctrl-C; "
            "the rows below are what was measured before it)", ""]


@contextlib.contextmanager
def ctrl_c_ignored() -> Iterator[None]:
    """Ctrl-C ignored while the results are written (milliseconds): a second Ctrl-C right after the
    first cannot leave a file half written or the files of two runs side by side. Off the main
    thread (no signal handlers there) it changes nothing."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
