"""Where tvm-attention keeps per-user files (tuning logs, and the caches of built code).

``cache_dir()`` is, in order of precedence:

1. ``$TVM_ATTENTION_CACHE_DIR`` when set (tests point it at a temporary folder);
2. ``$XDG_CACHE_HOME/tvm-attention`` when ``XDG_CACHE_HOME`` is set to an absolute path (the
   XDG base-directory spec says to ignore a relative one);
3. ``~/.cache/tvm-attention``.

Nothing here creates the folder: the writer that needs it does, so a plain ``build`` never leaves
an empty cache behind.

**Caches of code.** The build cache (``builds/``), the torch function's backward artifacts
(``backward/``) and the transformers backend's artifacts (``artifacts/``) hold libraries that this
process loads and runs. Whoever can write such a folder can run code as its user, so each is made
with :func:`private_dir`: created 0700 (with any missing parents), and used only while it is a
directory of this user that no other user can write. A folder that fails (another owner, group- or
world-writable, not a folder, not creatable) is not used: :func:`usable_cache` warns once, naming
it and the fix, and the caller builds into a private temporary folder instead (removed at exit).
What those caches store is data (JSON, libraries whose SHA-256 and spec hash are checked), never a
pickle.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import stat
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

CACHE_ENV = "TVM_ATTENTION_CACHE_DIR"
APP = "tvm-attention"


def cache_dir() -> Path:
    """The per-user cache folder (see the module docstring for the order of precedence)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / APP
    return Path.home() / ".cache" / APP


@contextlib.contextmanager
def file_lock(out: Path):
    """An exclusive ``flock`` on ``<out>.lock`` beside a cached artifact: one builder per key at a
    time across processes (the kernel drops it however the process ends)."""
    import fcntl  # POSIX only: the caches' builders run there

    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(out.parent / f".{out.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class CacheFolderError(RuntimeError):
    """A cache folder of code cannot be used (safely, or at all); the message names it and why."""


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` made ready to hold code this process will load: every missing folder of it is
    created with mode 0700, then the folder is checked (:func:`check_private`). Raises
    :class:`CacheFolderError` naming the folder when it cannot be made or is not safe."""
    path = Path(path).expanduser().absolute()
    for folder in reversed((path, *path.parents)):
        if folder.is_dir():
            continue
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            if not folder.is_dir():
                raise CacheFolderError(f"{folder}: exists and is not a folder, so the cache {path} cannot be "
                                       "made there") from None
        except OSError as e:
            raise CacheFolderError(f"{folder}: cannot create the cache folder {path} ({e.strerror})") from None
    check_private(path)
    return path


def check_private(path: str | os.PathLike) -> None:
    """Raise :class:`CacheFolderError` unless ``path`` is a folder owned by this user that no
    other user may write (no group or world write bit) and this user can write."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise CacheFolderError(f"{path}: cannot read the cache folder ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheFolderError(f"{path}: the cache is not a folder")
    if st.st_uid != os.geteuid():
        raise CacheFolderError(f"{path}: the cache folder belongs to user id {st.st_uid}, not to this user "
                               f"({os.geteuid()}): its code is not loaded; choose a folder of your own")
    if st.st_mode & 0o022:
        raise CacheFolderError(f"{path}: the cache folder is writable by other users (mode "
                               f"{stat.S_IMODE(st.st_mode):o}), who could plant code this process would run; "
                               f"`chmod go-w {path}` or choose another folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheFolderError(f"{path}: the cache folder is not writable by this user")


_WARNED: set[str] = set()
_SCRATCH: list[Path] = []
_SCRATCH_LOCK = threading.Lock()


def scratch_dir() -> Path:
    """This process's private temporary folder (0700), removed at exit: where a cache's builds
    go when the cache folder cannot be used."""
    with _SCRATCH_LOCK:
        if not _SCRATCH:
            _SCRATCH.append(Path(tempfile.mkdtemp(prefix="tvm-attention-cache-")))
            atexit.register(shutil.rmtree, str(_SCRATCH[0]), True)
        return _SCRATCH[0]


def usable_cache(path: str | os.PathLike, what: str) -> Path:
    """``path`` through :func:`private_dir`; when it fails, a folder of :func:`scratch_dir`
    instead, after a warning (once per folder and process) naming the folder, why, and that
    ``what`` is built for this process only."""
    try:
        return private_dir(path)
    except CacheFolderError as e:
        if str(path) not in _WARNED:
            _WARNED.add(str(path))
            warnings.warn(f"tvm_attention: {e}; {what} is built into a temporary folder for this process only",
                          RuntimeWarning, stacklevel=3)
        fallback = scratch_dir() / Path(path).name
        fallback.mkdir(mode=0o700, exist_ok=True)
        return fallback


class StaleArtifact(RuntimeError):
    """A cached artifact that loads but is not the one asked for (``check``'s reason)."""


def load_or_build(out: Path, load: Callable[[Path], T], build: Callable[[Path], None],
                  check: Callable[[T], str | None], what: str) -> tuple[T, str]:
    """The artifact of folder ``out`` (inside a :func:`usable_cache` root), loaded, or built
    there and loaded; returns it and ``"loaded"``, ``"built"`` or ``"rebuilt"``.

    A cached one must load (``load``: the loaders check every file's SHA-256 and the library's
    own spec hash) and be what was asked (``check`` returns None, else why not); any other is
    rebuilt in its place, with a warning. ``build(out)`` writes the folder atomically. Loading
    runs a private copy of each library (``tvm_attention.runtime.private_copy``), so a library
    rebuilt at the path of one this process loaded before is the one that runs. One builder per
    folder at a time across processes (:func:`file_lock`)."""
    with file_lock(out):
        rebuilt = False
        if (out / "manifest.json").is_file():
            try:
                got = load(out)
                problem = check(got)
                if problem is None:
                    return got, "loaded"
                raise StaleArtifact(problem)
            except Exception as e:  # noqa: BLE001 - any unusable artifact is rebuilt, said once
                warnings.warn(f"tvm_attention: cached {what} {out} is unusable ({type(e).__name__}: {e}); "
                              "rebuilding it", RuntimeWarning, stacklevel=3)
                rebuilt = True
        build(out)
        got = load(out)
        problem = check(got)
        if problem is not None:  # what was just built is not what was asked: never use it
            raise StaleArtifact(f"{out}: the {what} just built is not the one asked for ({problem})")
        return got, "rebuilt" if rebuilt else "built"
