"""Content-addressed cache of CPU builds: a kernel built before is loaded, not built again.

A build's **key** is the SHA-256 of canonical JSON holding everything that decides its code:

* the spec (``AttentionSpec.to_dict``: every field), the schedule name;
* a hand build's family and resolved knobs (``knobs.to_dict``, after the target's preset is
  applied), or a tuned build's trace (``Trace.as_json``, its decisions included) and a digest of
  the workload module it replays on;
* the target (its JSON: ``mcpu``, ``mattr``, ``num-cores``...), TVM's and tvm-ffi's versions;
* :func:`source_digest`: a SHA-256 of the source files of :data:`GENERATOR_MODULES`, every
  project module the build path imports (tests/test_build_cache.py checks the list against the
  import graph of ``tvm_attention.build``), so editing a workload, a schedule, the lowering or the
  audit misses every entry made before.

An **entry** is a folder ``<root>/<key[:2]>/<key>/`` (:func:`root`: ``$TVM_ATTENTION_BUILD_CACHE_DIR``,
else ``tvm_attention.paths.cache_dir() / "builds"``) holding what a ``BuiltKernel`` needs:

* ``attention.so``: the build's exported library (the very file validation runs and ``export``
  copies);
* ``lowered.tir``: the lowered IR's text (``LoweredModule.script``: what ``export`` writes);
* ``lowered.json``: the lowered IR (``tvm.ir.save_json``), parsed only when something asks for the
  IR itself (the audit's allocations, a test reading a buffer);
* ``meta.pkl``: the audit report, the knobs and the data alignment;
* ``entry.json``: the key's parts in plain JSON (to read, never read back), each file's SHA-256.

An entry is written into a temporary folder beside it and renamed into place, so a reader never
sees half an entry; two processes building one key both build, the first rename wins and the
other's folder is dropped. A hit copies the files into a private folder, checks every SHA-256,
and is used only if all of them match and the pickle loads: anything else (a truncated file, a
folder a crash or a user cut short) is a miss, the entry is removed and the build made and stored
again. Entries are read, never modified; a hit touches ``entry.json``, and a store removes the
least recently used entries past :func:`max_bytes` (1 GiB; ``$TVM_ATTENTION_BUILD_CACHE_MAX_MB``).
``rm -rf`` of the folder (``tvm-attention`` prints it: docs/cli.md) clears it at any time.

Only CPU (LLVM) builds this host can run are cached: a CUDA module (source for the device) and a
library for features this CPU lacks (never loaded here) are built every time.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import pickle
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm.target import Target

from .lowering import LoweredModule
from .paths import cache_dir
from .target import runnable_here, target_to_json

#: Where the cache lives when set (tests point every worker of a run at one temporary folder).
DIR_ENV = "TVM_ATTENTION_BUILD_CACHE_DIR"
#: ``0`` turns the cache off for every caller (as ``--no-cache`` does for one command).
ENABLE_ENV = "TVM_ATTENTION_BUILD_CACHE"
#: The size bound in MiB (default :data:`DEFAULT_MAX_MB`).
MAX_ENV = "TVM_ATTENTION_BUILD_CACHE_MAX_MB"
DEFAULT_MAX_MB = 1024
SUBDIR = "builds"
#: Bumped when an entry's files change meaning: every older entry then misses.
FORMAT = 1

LIBRARY, LOWERED_TIR, LOWERED_JSON, META, ENTRY = "attention.so", "lowered.tir", "lowered.json", "meta.pkl", "entry.json"
_FILES = (LIBRARY, LOWERED_TIR, LOWERED_JSON, META)

#: The project modules whose source decides a build's code: the build path and everything it
#: imports (a package: every ``.py`` file under it). A digest of their files is part of every key.
GENERATOR_MODULES = (
    "tvm_attention.build",
    "tvm_attention.build_cache",
    "tvm_attention.lowering",
    "tvm_attention.audit",
    "tvm_attention.spec",
    "tvm_attention.layouts",
    "tvm_attention.limits",
    "tvm_attention.errors",
    "tvm_attention.target",
    "tvm_attention.hostcpu",
    "tvm_attention.task_mods",
    "tvm_attention.modifiers",
    "tvm_attention.modifier_grad",
    "tvm_attention.quant",
    "tvm_attention.masks",
    "tvm_attention.reference",
    "tvm_attention.visibility",
    "tvm_attention.cuda_tools",
    "tvm_attention.paths",
    "tvm_attention.tvm_internals",
    "tvm_attention.workloads",
    "tvm_attention.schedules",
)


def root() -> Path:
    """The cache folder: ``$TVM_ATTENTION_BUILD_CACHE_DIR``, else ``<cache_dir()>/builds``."""
    env = os.environ.get(DIR_ENV)
    return Path(env).expanduser() if env else cache_dir() / SUBDIR


def enabled(cache: bool) -> bool:
    """Whether a caller asking for the cache (``cache``) gets it: not when ``$TVM_ATTENTION_BUILD_CACHE=0``."""
    return cache and os.environ.get(ENABLE_ENV, "1").strip() not in ("0", "off", "no", "false")


def max_bytes() -> int:
    return int(float(os.environ.get(MAX_ENV, DEFAULT_MAX_MB)) * (1 << 20))


def cacheable(target: Target) -> bool:
    """A CPU target whose code this host runs (see the module docstring)."""
    return target.kind.name == "llvm" and runnable_here(target)


def module_files(name: str) -> list[tuple[str, Path]]:
    """``(relative name, path)`` of every source file of module or package ``name``."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"build cache: generator module {name} not found")
    if spec.submodule_search_locations:
        base = Path(spec.origin).parent
        return [(f"{name}/{p.relative_to(base).as_posix()}", p) for p in sorted(base.rglob("*.py"))]
    return [(name, Path(spec.origin))]


_DIGEST: list[str] = []


def source_digest() -> str:
    """SHA-256 of the files of :data:`GENERATOR_MODULES` (names and bytes), once per process."""
    if not _DIGEST:
        h = hashlib.sha256()
        for name in GENERATOR_MODULES:
            for rel, path in module_files(name):
                data = path.read_bytes()
                h.update(f"{rel}\0{len(data)}\0".encode())
                h.update(data)
        _DIGEST.append(h.hexdigest())
    return _DIGEST[0]


def make_key(kind: str, spec, schedule: str, target: Target, **parts: Any) -> tuple[str, dict[str, Any]]:
    """The key of a build (``kind``: ``"hand"`` or ``"tuned"``; ``parts``: its knobs or trace)
    and the document it hashes."""
    doc = {"format": FORMAT, "kind": kind, "spec": spec.to_dict(), "schedule": schedule,
           "target": target_to_json(target), "tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__,
           "sources": source_digest(), **parts}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest(), doc


def hand_key(spec, schedule: str, target: Target, knobs) -> tuple[str, dict[str, Any]]:
    return make_key("hand", spec, schedule, target, family=type(knobs).__name__,
                    knobs=knobs.to_dict() if knobs is not None else None)


def tuned_key(spec, schedule: str, target: Target, workload_mod, trace) -> tuple[str, dict[str, Any]]:
    return make_key("tuned", spec, schedule, target,
                    workload=hashlib.sha256(tvm.ir.save_json(workload_mod).encode()).hexdigest(),
                    trace=tvm.ir.save_json(trace.as_json(remove_postproc=False)))


def entry_dir(key: str) -> Path:
    return root() / key[:2] / key


class CachedLowered(LoweredModule):
    """The lowered IR of a build loaded from the cache: its text at hand (``script``), the IR
    parsed from ``lowered.json`` the first time ``host`` is read."""

    def __init__(self, json_path: Path, text: str, target_host: Target):  # noqa: D107 - no dataclass init
        self._json_path, self._text, self._host = json_path, text, None
        self.devices = {}
        self.target_host = target_host

    @property
    def host(self) -> tvm.IRModule:
        if self._host is None:
            self._host = tvm.ir.load_json(self._json_path.read_text())
        return self._host

    def script(self) -> str:
        return self._text


@dataclasses.dataclass
class Hit:
    """A cache entry, checked and copied into a private folder (removed with ``owner``)."""

    folder: Path  # the private copy
    entry: Path  # the entry it came from
    library: Path
    module: tvm.runtime.Module
    lowered: CachedLowered
    meta: dict[str, Any]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _private_folder(owner: Any) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="tvm-attention-lib-"))
    if owner is not None:
        weakref.finalize(owner, shutil.rmtree, str(folder), True)
    return folder


def lookup(key: str, target: Target) -> Hit | None:
    """The entry of ``key``, or None: absent, or not intact (then it is removed; see the module
    docstring). The caller ties the private copy's lifetime to its build with :func:`adopt`."""
    entry = entry_dir(key)
    if not entry.is_dir():
        return None
    folder = _private_folder(None)
    try:
        recorded = json.loads((entry / ENTRY).read_text())["sha256"]
        for name in _FILES:
            shutil.copyfile(entry / name, folder / name)
            if _sha256(folder / name) != recorded[name]:
                raise ValueError(f"{name}: SHA-256 differs from entry.json")
        meta = pickle.loads((folder / META).read_bytes())
        module = tvm.runtime.load_module(str(folder / LIBRARY))
    except Exception:  # noqa: BLE001 - any damage means "not a hit": rebuilt and stored again
        shutil.rmtree(folder, ignore_errors=True)
        remove(entry)
        return None
    try:
        os.utime(entry / ENTRY)  # least recently used goes first
    except OSError:
        pass
    lowered = CachedLowered(folder / LOWERED_JSON, (folder / LOWERED_TIR).read_text(), target)
    return Hit(folder, entry, folder / LIBRARY, module, lowered, meta)


def adopt(hit: Hit, owner: Any) -> None:
    """Remove ``hit``'s private folder when ``owner`` (its ``BuiltKernel``) is collected."""
    weakref.finalize(owner, shutil.rmtree, str(hit.folder), True)


def store(key: str, doc: dict[str, Any], library: str, lowered: LoweredModule, meta: dict[str, Any]) -> Path | None:
    """Write the entry of ``key`` (atomically: a temporary folder renamed into place). Returns
    its folder, or None when it could not be written (a full disk, a read-only cache: the build
    is used all the same) or another process wrote it first."""
    entry = entry_dir(key)
    if entry.is_dir():
        return None
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.tmp-", dir=entry.parent))
        shutil.copyfile(library, tmp / LIBRARY)
        (tmp / LOWERED_TIR).write_text(lowered.script())
        (tmp / LOWERED_JSON).write_text(tvm.ir.save_json(lowered.host))
        (tmp / META).write_bytes(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
        info = {"key": key, "parts": doc, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "sha256": {name: _sha256(tmp / name) for name in _FILES}}
        (tmp / ENTRY).write_text(json.dumps(info, indent=1, default=str) + "\n")
        os.chmod(tmp, 0o755)
        os.rename(tmp, entry)  # fails when another process renamed its entry first: keep that one
        tmp = None
    except OSError:
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    evict()
    return entry


def remove(entry: Path) -> None:
    """Take ``entry`` out of the cache at once (renamed aside), then delete it."""
    aside = entry.parent / f".{entry.name[:16]}.old-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(entry, aside)
    except OSError:
        return  # gone already (another process removed or replaced it)
    shutil.rmtree(aside, ignore_errors=True)


def entries() -> list[tuple[float, int, Path]]:
    """``(last use, bytes, folder)`` of every entry, oldest use first."""
    out = []
    base = root()
    if not base.is_dir():
        return out
    for shard in base.iterdir():
        if not shard.is_dir() or shard.name.startswith("."):
            continue
        for entry in shard.iterdir():
            if entry.name.startswith("."):
                continue
            try:
                used = (entry / ENTRY).stat().st_mtime
                size = sum(p.stat().st_size for p in entry.iterdir())
            except OSError:
                continue
            out.append((used, size, entry))
    return sorted(out)


def evict(limit: int | None = None) -> int:
    """Remove the least recently used entries until the cache holds at most ``limit`` bytes
    (:func:`max_bytes`); returns how many were removed."""
    limit = max_bytes() if limit is None else limit
    found = entries()
    total = sum(size for _, size, _ in found)
    removed = 0
    for _, size, entry in found:
        if total <= limit:
            break
        remove(entry)
        total -= size
        removed += 1
    return removed
