"""A virtual environment holding exactly what serving installs: ``apache-tvm-ffi``, ``numpy`` and
``ml_dtypes`` (with what they require) and this project without its build dependencies — no
``tvm``, no compiler, no xgboost. The serving install is

    pip install "apache-tvm-ffi==0.1.14.post1" numpy ml_dtypes && pip install --no-deps .

Made offline for the tests: the three distributions (and their requirements) are linked from this
interpreter's installed copies, the project is installed with ``pip install --no-deps``.

:func:`make_full` makes the *full* install the same way — everything ``pip install .`` brings
(``project_requirements``: the compiler, the tuner's xgboost, ...) — for the tests of an installed
package (tests/test_install.py). Both build a wheel from a copy of the checkout's tracked files
(``source_copy``: the build writes build/ and *.egg-info into the tree it builds, which parallel
test workers must not share) and install it with ``pip --python <venv>`` (not editable), so the
venv's ``bin/tvm-attention`` runs the venv's python. Run the venv's python with :func:`env`: a
``PYTHONPATH`` naming the checkout would import the checkout instead of the install.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
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


def project_requirements() -> list[str]:
    """The distributions pyproject.toml's ``[project] dependencies`` name (what ``pip install .``
    brings), and ``ml_dtypes`` where it is installed (bfloat16 and float8 arrays)."""
    import tomllib  # Python 3.11+: the full install's tests need it, the serving env does not

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[ <>=!~\[(;]", d.strip(), maxsplit=1)[0] for d in deps]
    try:
        md.distribution("ml_dtypes")
        names.append("ml_dtypes")
    except md.PackageNotFoundError:
        pass
    return names


def env() -> dict[str, str]:
    """This process's environment without ``PYTHONPATH``: for the venv's python and scripts."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def source_copy(dst: Path, repo: Path = REPO) -> Path:
    """The files a build of ``repo`` reads (tracked, or new and not ignored), copied to ``dst``;
    without git (an unpacked sdist), the tree less its build outputs."""
    parts = ["pyproject.toml", "README.md", "tvm_attention", "schedules", "tuning_logs"]
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *parts],
                                cwd=repo, check=True, capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(repo, dst, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".git"))
        return dst
    for rel in filter(None, listed):
        if (repo / rel).is_file():  # a file deleted but not yet committed is listed too
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / rel, dst / rel)
    return dst


def _venv(root: Path, distributions) -> tuple[Path, Path]:
    """A venv without pip at ``root`` whose site-packages links ``distributions`` (and what they
    require) from this interpreter; (its python, its site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for dist in _closure(distributions):
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"bin", "__pycache__"}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    return python, site


def _install_project(python: Path) -> None:
    """``pip install --no-deps .`` of this checkout into ``python``'s venv, from a wheel built from a
    copy (the checkout's tree is left alone)."""
    with tempfile.TemporaryDirectory(prefix="tvma-install-") as tmp:
        src = source_copy(Path(tmp) / "src")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(Path(tmp) / "wheel"), str(src)], check=True, capture_output=True)
        wheel = next((Path(tmp) / "wheel").glob("*.whl"))
        # Without PYTHONPATH: a checkout on it (with its egg-info) reads to pip as this project
        # already installed in the venv, and pip would install nothing.
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                        "--no-index", "--no-compile", str(wheel)], check=True, capture_output=True, env=env())


def make(root: Path) -> Path:
    """Create the serving environment under ``root``; returns its python."""
    python, _ = _venv(root, SERVING)
    _install_project(python)
    return python


def shared() -> Path:
    """The run's one serving environment (``make``), made by the first test that asks for it under
    the folder conftest.py shares between the run's workers (``$_TVMA_TEST_SHARED``), under a lock;
    returns its python. Its users only run it: a wheel build and install (~3 s) per test file
    bought nothing, the checkout being the same."""
    import fcntl

    root = Path(os.environ["_TVMA_TEST_SHARED"]) / "serving"
    with open(str(root) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
        if not (root / "done").exists():  # a process that died making it left no "done": made again
            shutil.rmtree(root, ignore_errors=True)
            make(root / "venv")
            (root / "done").write_text("")
    return root / "venv" / "bin" / "python"


def make_full(root: Path) -> Path:
    """Create an environment under ``root`` holding what ``pip install .`` installs (every
    requirement, the compiler included; not editable); returns its python (``bin/tvm-attention``
    beside it)."""
    python, _ = _venv(root, project_requirements())
    _install_project(python)
    return python
