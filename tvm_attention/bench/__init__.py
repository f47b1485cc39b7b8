"""Benchmarks: every variant of a spec timed side by side in one process."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def write_report(report: dict[str, Any], out_dir: str | Path, stem: str,
                 markdown: Callable[[dict[str, Any]], str]) -> dict[str, Path]:
    """Write ``<stem>.json`` (the report) and ``<stem>.md`` (its table) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["md"].write_text(markdown(report) + "\n")
    return paths
