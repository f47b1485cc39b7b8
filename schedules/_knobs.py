"""What every schedule family's knob dataclass shares."""
from __future__ import annotations

import dataclasses
from typing import Any


class KnobError(ValueError):
    """An infeasible or unknown knob set; the message names the knob and the limit it breaks."""


class KnobsMixin:
    """``to_dict``/``from_dict`` for a frozen knob dataclass (unknown keys are an error)."""

    FAMILY = "?"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if unknown:
            raise KnobError(f"unknown knob(s) for {cls.FAMILY}: {', '.join(sorted(unknown))}")
        return cls(**d)
