#!/usr/bin/env python3
"""The house rules of the code, measured: import cycles, function-local imports, long functions.

    python scripts/check_structure.py            # a report; exit 1 when an import cycle exists

* **Import cycles** between project modules (``tvm_attention``, with ``schedules/`` and the other
  folders pyproject.toml's package-dir installs inside it under their package names), counting the
  imports inside functions too (they hide a cycle from Python, not from a reader). An import under
  ``if TYPE_CHECKING:`` never runs and is not counted; nor is the implicit import of a module's
  parent package (``import tvm_attention.spec`` runs ``tvm_attention/__init__.py`` first, whose
  lazy wrappers import the build path only when called).
* **Function-local imports of project modules**, and which of them lack a comment saying why
  (on the import's line or the line above).
* **Functions longer than** ``--max-lines`` (default 150), nested functions counted in their own
  right and inside their parent.
"""
from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: folder of the checkout -> the package it is (``schedules/`` is ``tvm_attention.schedules``: the
#: package-dir mapping of pyproject.toml, as ``tvm_attention/_checkout.py`` holds it)
PACKAGES = {"tvm_attention": "tvm_attention", "schedules": "tvm_attention.schedules"}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the project module imported
    line: int
    local: bool  # inside a function
    commented: bool  # a comment on its line or the line above


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = (package, *path.relative_to(root / folder).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _targets(mods: dict[str, Path], module: str, node: ast.AST) -> list[str]:
    """The project modules an import statement names (``from pkg import name`` names
    ``pkg.name`` when that is a module, else ``pkg``)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if mods[module].name == "__init__.py" else module.split(".")[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = []
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != module and name not in out:
            out.append(name)
    return out


def imports(root: Path = ROOT) -> list[Import]:
    mods = modules(root)
    found = []
    for module, path in mods.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            local = typing_only = False
            up = parent.get(node)
            while up is not None:
                local |= isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef))
                typing_only |= isinstance(up, ast.If) and "TYPE_CHECKING" in ast.unparse(up.test)
                up = parent.get(up)
            if typing_only:
                continue
            here = lines[node.lineno - 1]
            above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            commented = "#" in here or above.startswith("#")
            for target in _targets(mods, module, node):
                found.append(Import(module, target, node.lineno, local, commented))
    return found


def cycles(found: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for imp in found:
        graph.setdefault(imp.module, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def long_functions(max_lines: int, root: Path = ROOT) -> list[tuple[str, str, int]]:
    """(file, qualified name, lines) of every function longer than ``max_lines``."""
    out = []
    for path in modules(root).values():
        tree = ast.parse(path.read_text())

        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        n = child.end_lineno - child.lineno + 1
                        if n > max_lines:
                            out.append((str(path.relative_to(root)), name, n))
                    walk(child, name + ".")
                else:
                    walk(child, prefix)

        walk(tree, "")
    return sorted(out, key=lambda x: -x[2])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-lines", type=int, default=150)
    p.add_argument("--list-local", action="store_true", help="list every uncommented function-local import")
    a = p.parse_args(argv)
    found = imports()
    cyc = cycles(found)
    local = [i for i in found if i.local]
    bare = [i for i in local if not i.commented]
    print(f"{len(modules())} modules, {len({(i.module, i.target) for i in found})} import edges")
    print(f"import cycles: {len(cyc)}")
    for c in cyc:
        print("  " + " -> ".join(c))
    print(f"function-local imports of project modules: {len(local)}, {len(bare)} without a comment")
    if a.list_local:
        for i in bare:
            print(f"  {i.module}:{i.line} imports {i.target}")
    longs = long_functions(a.max_lines)
    print(f"functions over {a.max_lines} lines: {len(longs)}")
    for file, name, n in longs:
        print(f"  {n:4d}  {file}  {name}")
    return 1 if cyc else 0


if __name__ == "__main__":
    sys.exit(main())
