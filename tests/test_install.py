"""An installed package behaves like the checkout (issue 47): ``pip install .`` (not editable) into
a fresh venv, run from a folder outside the checkout that holds a ``schedules.py`` of its own.

``schedules/`` installs as ``tvm_attention.schedules`` — it was a top-level ``schedules`` package,
which such a file shadowed (``ImportError: cannot import name 'check' from 'schedules'``) — and the
committed tuning logs as ``tvm_attention.tuning_logs``, found from any folder. A checkout on
``sys.path`` (``PYTHONPATH``, a worktree, CI's clone) resolves both to the folders beside *its*
``tvm_attention/``, whatever is installed (``tvm_attention._checkout``).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import serving_env
from tvm_attention.logs import repo_logs_root, target_key
from tvm_attention.target import resolve_target

REPO = Path(__file__).resolve().parents[1]
#: the cheapest spec with a committed log (tuning_logs/<target key>/<spec>)
LOGGED = ["--batch", "1", "--heads", "8", "--seq-q", "1024", "--head-dim", "64"]
LOGGED_NAME = "b1_h8_kv8_q1024_k1024_d64_float32_full"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, a folder outside the checkout with a shadowing schedules.py, its environment:
    no PYTHONPATH, an empty user cache so only the installed logs can be found)."""
    root = tmp_path_factory.mktemp("install")
    python = serving_env.make_full(root / "venv")
    work = root / "work"
    work.mkdir()
    (work / "schedules.py").write_text("def cosine(a, b):\n    return sum(x * y for x, y in zip(a, b))\n")
    env = {**serving_env.env(), "TVM_ATTENTION_CACHE_DIR": str(root / "cache")}
    return python, work, env


def test_schedules_install_inside_the_package_and_a_local_schedules_py_does_not_break_a_build(installed):
    python, work, env = installed
    script = textwrap.dedent("""
        import json, sys, sysconfig
        from pathlib import Path
        import schedules  # the user's own module: importable from this folder
        import tvm_attention.schedules as s
        site = Path(sysconfig.get_paths()["purelib"])
        print(json.dumps({"mine": schedules.__file__, "cosine": hasattr(schedules, "cosine"),
                          "ours": s.__file__, "site": str(site),
                          "tops": sorted(p.name for p in site.iterdir()),
                          "finders": [type(f).__name__ for f in sys.meta_path]}))
    """)
    r = subprocess.run([str(python), "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    site = Path(got["site"])
    assert got["cosine"] and Path(got["mine"]) == work / "schedules.py"
    assert Path(got["ours"]) == site / "tvm_attention" / "schedules" / "__init__.py"
    assert "tvm_attention" in got["tops"]
    assert not [t for t in got["tops"] if t.split(".")[0].split("-")[0] in ("schedules", "tuning_logs")], got["tops"]
    assert "CheckoutFinder" not in got["finders"]  # an installed package maps nothing
    # `python -m` from the folder: sys.path[0] is the folder, where schedules.py would shadow a
    # top-level package (the console script's sys.path[0] is the venv's bin/)
    r = subprocess.run([str(python), "-m", "tvm_attention.cli", "build", "--batch", "1", "--heads", "2", "--seq-q",
                        "128", "--head-dim", "64", "--no-log", "--out", str(work / "a")],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "validation: PASS" in r.stdout and (work / "a" / "manifest.json").exists()


def test_the_installed_package_ships_and_uses_the_committed_tuning_logs(installed):
    python, work, env = installed
    script = "from tvm_attention.logs import repo_logs_root; print(repo_logs_root())"
    r = subprocess.run([str(python), "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    shipped = Path(r.stdout.strip().splitlines()[-1])
    assert shipped.is_relative_to(python.parent.parent) and shipped.name == "tuning_logs"
    files = lambda base: sorted(str(p.relative_to(base)) for p in base.rglob("*.json"))  # noqa: E731
    assert files(repo_logs_root()) and files(shipped) == files(repo_logs_root())
    # compare's fused-tuned replays the best record of a log and nothing else: with an empty user
    # cache, the installed one (or, on a CPU no committed log is for, an error naming `tune`)
    key = target_key(resolve_target("llvm"))
    r = subprocess.run([str(python.parent / "tvm-attention"), "compare", *LOGGED, "fused-tuned", "--repeat", "1"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    if (REPO / "tuning_logs" / key / LOGGED_NAME).is_dir():
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert "| fused-tuned | tuned |" in r.stdout
    else:
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
        assert r.stderr.startswith("tvm-attention compare: error: no tuning log for ") and \
            "tvm-attention tune" in r.stderr and "Traceback" not in r.stderr
        assert str(shipped / key / LOGGED_NAME) in r.stderr


def test_a_checkout_on_the_path_resolves_its_own_schedules_and_logs(tmp_path):
    """Mode (c): a checkout imported from ``PYTHONPATH`` (no install of it, or an editable install
    of another checkout — this interpreter's) takes the schedules/ and tuning_logs/ beside its own
    tvm_attention/, and ``import tvm_attention`` imports neither them nor TVM."""
    copy = serving_env.source_copy(tmp_path / "checkout")
    (tmp_path / "elsewhere").mkdir()
    script = textwrap.dedent("""
        import importlib.util, json, sys
        import tvm_attention
        light = [m for m in sys.modules if m in ("tvm", "tvm_attention.schedules", "tvm_attention.tuning_logs")]
        import tvm_attention.schedules as s
        logs = importlib.util.find_spec("tvm_attention.tuning_logs").submodule_search_locations[0]
        print(json.dumps({"package": tvm_attention.__file__, "schedules": s.__file__, "logs": logs, "light": light}))
    """)
    env = {**serving_env.env(), "PYTHONPATH": str(copy)}
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path / "elsewhere", env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["package"] == os.path.join(copy, "tvm_attention", "__init__.py")
    assert got["schedules"] == os.path.join(copy, "schedules", "__init__.py")
    assert got["logs"] == os.path.join(copy, "tuning_logs")
    assert got["light"] == []
