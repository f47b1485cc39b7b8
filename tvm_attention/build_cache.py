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
* ``meta.json``: the audit report, the knobs (family and values) and the data alignment, as
  plain JSON (a cache holds data, never a pickle: unpickling runs code);
* ``entry.json``: the key, its parts in plain JSON (to read, never read back), each file's SHA-256.

An entry is written into a temporary folder beside it and renamed into place, so a reader never
sees half an entry; two processes building one key both build, the first rename wins and the
other's folder is dropped. A hit copies the files into a private folder, checks every SHA-256,
and is used only if all of them match, ``meta.json`` parses and **the library proves it is the
build asked for**: its own ``attention_spec_hash()`` returns the requested spec's
``AttentionSpec.fingerprint()`` (an entry of another spec, or another library with its digests
updated, is refused). Anything else (a truncated file, a folder a crash or a user cut short, a
foreign entry) is a miss: the entry is removed and the build made and stored again. A hit that then
fails validation is removed the same way and rebuilt (``pipeline.build_best``).

The folder is private (``tvm_attention.paths.private_dir``): created 0700, and used only while it
belongs to this user and no other user can write it; an entry whose folder or files another user
owns or may write is not trusted. A folder that fails is not used: builds are made and not stored,
with a warning once per process. Entries are read, never modified; a hit touches ``entry.json``, and a store removes the
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
from .paths import CacheFolderError, cache_dir, private_dir
from .target import runnable_here, target_to_json

#: Where the cache lives when set (tests point every worker of a run at one temporary folder).
DIR_ENV = "TVM_ATTENTION_BUILD_CACHE_DIR"
#: ``0`` turns the cache off for every caller (as ``--no-cache`` does for one command).
ENABLE_ENV = "TVM_ATTENTION_BUILD_CACHE"
#: The size bound in MiB (default :data:`DEFAULT_MAX_MB`).
MAX_ENV = "TVM_ATTENTION_BUILD_CACHE_MAX_MB"
DEFAULT_MAX_MB = 1024
SUBDIR = "builds"
#: Bumped when an entry's files change meaning: every older entry then misses (2: meta.json
#: replaced meta.pkl).
FORMAT = 2

LIBRARY, LOWERED_TIR, LOWERED_JSON, META, ENTRY = "attention.so", "lowered.tir", "lowered.json", "meta.json", "entry.json"
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
_EXTRA_DIGESTS: dict[tuple[str, ...], str] = {}


def _files_digest(names, h=None) -> str:
    h = h or hashlib.sha256()
    for name in names:
        for rel, path in module_files(name):
            data = path.read_bytes()
            h.update(f"{rel}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def source_digest(extra: tuple[str, ...] = ()) -> str:
    """SHA-256 of the files of :data:`GENERATOR_MODULES` (names and bytes), once per process;
    with ``extra`` modules, of those files and theirs (another cache's generator, e.g. the
    backward's)."""
    if not _DIGEST:
        _DIGEST.append(_files_digest(GENERATOR_MODULES))
    if not extra:
        return _DIGEST[0]
    if extra not in _EXTRA_DIGESTS:
        h = hashlib.sha256(_DIGEST[0].encode())
        _EXTRA_DIGESTS[extra] = _files_digest(extra, h)
    return _EXTRA_DIGESTS[extra]


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


_REFUSED: set[str] = set()


def usable_root() -> Path | None:
    """:func:`root`, created 0700 where missing and checked (``paths.private_dir``); None, with a
    warning once per folder and process, when it is not safe or cannot be made: builds are then
    made and not stored."""
    base = root()
    try:
        return private_dir(base)
    except CacheFolderError as e:
        if str(base) not in _REFUSED:
            _REFUSED.add(str(base))
            import warnings

            warnings.warn(f"tvm_attention: build cache not used: {e}", RuntimeWarning, stacklevel=4)
        return None


def _check_owned(path: Path) -> None:
    """Raise ``ValueError`` unless ``path`` (an entry's folder or file, not followed through a
    link) belongs to this user and no other user may write it."""
    st = os.lstat(path)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022 or os.path.islink(path):
        raise ValueError(f"{path}: owned by another user, writable by others, or a link")


def meta_to_json(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` (source, knobs, audit report, trace, data alignment) as plain JSON."""
    knobs = meta["knobs"]
    return {"source": meta["source"], "trace": meta["trace"], "data_alignment": int(meta["data_alignment"]),
            "knobs": None if knobs is None else {"family": type(knobs).__name__, "values": knobs.to_dict()},
            "audit": meta["audit"].to_state()}


def meta_from_json(doc: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`meta_to_json`; the knobs' class is looked up by name among the
    schedule families' knob classes (nothing else is constructed). Raises on anything else."""
    from .audit import AuditReport  # the report type; audit imports the lowering, loaded on a hit only

    knobs = doc["knobs"]
    if knobs is not None:
        knobs = _knob_classes()[knobs["family"]].from_dict(knobs["values"])
    if not isinstance(doc["source"], str) or not isinstance(doc["trace"], (str, type(None))):
        raise ValueError("meta.json: source and trace must be strings")
    return {"source": doc["source"], "trace": doc["trace"], "data_alignment": int(doc["data_alignment"]),
            "knobs": knobs, "audit": AuditReport.from_state(doc["audit"])}


def _knob_classes() -> dict[str, type]:
    """Knob dataclasses of every schedule family, by class name."""
    from .schedules import SCHEDULES  # the families import the workloads: loaded on a hit only

    out = {}
    for by_target in SCHEDULES.values():
        for family in by_target.values():
            for value in vars(family).values():
                if isinstance(value, type) and dataclasses.is_dataclass(value) and hasattr(value, "from_dict"):
                    out[value.__name__] = value
    return out


def _library_spec_hash(module: tvm.runtime.Module) -> int:
    from .spec import AttentionSpec  # the function's name, where the spec class keeps it

    return int(module.get_function(AttentionSpec.SPEC_FUNCTION, query_imports=True)())


def lookup(key: str, target: Target, spec) -> Hit | None:
    """The entry of ``key`` for ``spec``, or None: absent, not intact, not this user's alone,
    or not the build of ``spec`` (its library's ``attention_spec_hash()`` differs); such an entry
    is removed (see the module docstring). The caller ties the private copy's lifetime to its
    build with :func:`adopt`."""
    base = usable_root()
    if base is None:
        return None
    entry = base / key[:2] / key
    if not entry.is_dir():
        return None
    folder = _private_folder(None)
    try:
        for path in (entry.parent, entry, *(entry / name for name in (*_FILES, ENTRY))):
            _check_owned(path)
        info = json.loads((entry / ENTRY).read_text())
        if info["key"] != key:
            raise ValueError(f"entry.json names key {info['key']}")
        recorded = info["sha256"]
        for name in _FILES:
            data = (entry / name).read_bytes()
            if hashlib.sha256(data).hexdigest() != recorded[name]:
                raise ValueError(f"{name}: SHA-256 differs from entry.json")
            (folder / name).write_bytes(data)  # what was checked is what is used
        meta = meta_from_json(json.loads((folder / META).read_text()))
        module = tvm.runtime.load_module(str(folder / LIBRARY))
        if _library_spec_hash(module) != spec.fingerprint():
            raise ValueError("the library was built from another spec")
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
    its folder, or None when it could not be written (a full disk, a read-only or unsafe cache:
    the build is used all the same) or another process wrote it first."""
    base = usable_root()
    if base is None:
        return None
    entry = base / key[:2] / key
    if entry.is_dir():
        return None
    tmp = None
    try:
        entry.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.tmp-", dir=entry.parent))
        shutil.copyfile(library, tmp / LIBRARY)
        (tmp / LOWERED_TIR).write_text(lowered.script())
        (tmp / LOWERED_JSON).write_text(tvm.ir.save_json(lowered.host))
        (tmp / META).write_text(json.dumps(meta_to_json(meta), indent=1) + "\n")
        info = {"key": key, "parts": doc, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "sha256": {name: _sha256(tmp / name) for name in _FILES}}
        (tmp / ENTRY).write_text(json.dumps(info, indent=1, default=str) + "\n")
        for name in (*_FILES, ENTRY):
            os.chmod(tmp / name, 0o600)  # whatever the umask: nobody else writes (or reads) an entry
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
