"""Imported from a source checkout: the folders pyproject.toml installs inside the package, found
beside this ``tvm_attention/``.

pyproject.toml's ``[tool.setuptools.package-dir]`` installs two folders of the checkout inside the
package: ``schedules/`` as ``tvm_attention.schedules`` and ``tuning_logs/`` as
``tvm_attention.tuning_logs`` (:data:`PACKAGE_DIRS`; tests/test_structure.py checks the two agree).
``pip install .`` copies them there; ``pip install -e .`` writes a finder into site-packages that
maps them to the checkout it was made from. A checkout imported straight from ``sys.path``
(``PYTHONPATH=<checkout>``, ``python -m tvm_attention.cli`` in its root, a script of ``scripts/``,
CI's clone, a git worktree) has neither — or has the editable finder of *another* checkout, which
would answer with that checkout's folders. So when the folder above this package is a checkout
(it holds ``pyproject.toml`` and ``schedules/__init__.py``), :func:`install` puts a small finder
first on ``sys.meta_path`` that resolves exactly those names to the folders beside this package,
and only for this package (the parent's ``__path__`` must be this folder). It imports nothing: the
schedules load when first imported (``import tvm_attention`` stays light, a runtime-only install
has no compiler). In an installed package the folder above is site-packages: nothing is installed.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

#: package name -> folder of the checkout: pyproject.toml's ``[tool.setuptools.package-dir]``
PACKAGE_DIRS = {"tvm_attention.schedules": "schedules", "tvm_attention.tuning_logs": "tuning_logs"}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Resolves :data:`PACKAGE_DIRS`' names to the folders of the checkout ``root``."""

    def __init__(self, root: Path):
        self.root = root
        self.package = os.path.realpath(root / "tvm_attention")

    def find_spec(self, fullname, path=None, target=None):
        folder = PACKAGE_DIRS.get(fullname)
        if folder is None or not path or all(os.path.realpath(p) != self.package for p in path):
            return None  # not a mapped name, or a tvm_attention other than the one beside these folders
        where = self.root / folder
        if (where / "__init__.py").is_file():
            return importlib.util.spec_from_file_location(fullname, where / "__init__.py",
                                                          submodule_search_locations=[str(where)])
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)  # data only (tuning_logs/)
        spec.submodule_search_locations = [str(where)]
        return spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"


def checkout_root() -> Path | None:
    """The checkout this package was imported from, or None (an installed package)."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "schedules" / "__init__.py").is_file():
        return root
    return None


def install() -> None:
    """Put a :class:`CheckoutFinder` first on ``sys.meta_path`` when imported from a checkout
    (once: a reload does not add a second one)."""
    root = checkout_root()
    if root is None or any(type(f).__name__ == "CheckoutFinder" and getattr(f, "root", None) == root
                           for f in sys.meta_path):
        return
    sys.meta_path.insert(0, CheckoutFinder(root))
