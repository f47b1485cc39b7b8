"""What every schedule family's knob dataclass shares."""
from __future__ import annotations

import dataclasses
from typing import Any


class KnobError(ValueError):
    """An infeasible or unknown knob set; the message names the knob and the limit it breaks."""


class KnobsMixin:
    """``to_dict``/``from_dict`` for a frozen knob dataclass (unknown keys are an error), and a
    type check on construction: a knob whose default is an int takes an int, never a bool
    (``{"auto_unroll": false}`` would otherwise pass as 0) nor a float or a string."""

    FAMILY = "?"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(f.default, int) and not isinstance(f.default, bool):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise KnobError(f"knob {f.name} must be an int, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        if not isinstance(d, dict):
            raise KnobError(f"knobs for {cls.FAMILY} must be a JSON object, got {type(d).__name__} {d!r}")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if unknown:
            raise KnobError(f"unknown knob(s) for {cls.FAMILY}: {', '.join(sorted(unknown))}")
        return cls(**d)
