"""Where tvm-attention keeps per-user files (tuning logs now; other caches may follow).

``cache_dir()`` is, in order of precedence:

1. ``$TVM_ATTENTION_CACHE_DIR`` when set (tests point it at a temporary folder);
2. ``$XDG_CACHE_HOME/tvm-attention`` when ``XDG_CACHE_HOME`` is set to an absolute path (the
   XDG base-directory spec says to ignore a relative one);
3. ``~/.cache/tvm-attention``.

Nothing here creates the folder: the writer that needs it does (``mkdir(parents=True)``), so a
plain ``build`` never leaves an empty cache behind.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

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
    fd = os.open(str(out.parent / f".{out.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
