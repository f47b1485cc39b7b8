"""A virtual environment holding exactly what serving installs: ``apache-tvm-ffi``, ``numpy`` and
``ml_dtypes`` (with what they require) and this project without its build dependencies — no
``tvm``, no compiler, no xgboost. The serving install is

    pip install "apache-tvm-ffi==0.1.14.post1" numpy ml_dtypes && pip install --no-deps .

Made offline for the tests: the three distributions (and their requirements) are linked from this
interpreter's installed copies, the project is installed with ``pip install --no-deps``.
"""
from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

SERVING = ("apache-tvm-ffi", "numpy", "ml_dtypes")
REPO = Path(__file__).resolve().parents[1]


def _requirements(name: str) -> list[str]:
    """Distributions ``name`` requires, extras and other platforms' markers left out."""
    out = []
    for req in md.requires(name) or []:
        head, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        if marker.strip() and not _marker_true(marker):
            continue
        out.append(re.split(r"[ <>=!~\[(]", head.strip(), maxsplit=1)[0])
    return out


def _marker_true(marker: str) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:  # pragma: no cover - packaging ships with pip's environments
        return True
    return Marker(marker).evaluate()


def _closure(names) -> list[md.Distribution]:
    seen, todo, out = set(), list(names), []
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        dist = md.distribution(name)
        out.append(dist)
        todo += _requirements(name)
    return out


def make(root: Path) -> Path:
    """Create the environment under ``root``; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    base = Path(sysconfig.get_paths()["purelib"])
    for dist in _closure(SERVING):
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"bin", "__pycache__"}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
                    "--target", str(site), str(REPO)], check=True, capture_output=True)
    return python
