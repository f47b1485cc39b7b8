"""TVM's runtime, reached through tvm-ffi alone: what serving needs without the compiler.

``import tvm`` takes seconds and hundreds of MB (the compiler, LLVM); ``apache-tvm`` is 305 MB
installed. An exported library needs only a little of it: the CPU parallel runtime and the
workspace allocator (``libtvm_runtime.so``, 3.4 MB), and for CUDA the module loader
(``libtvm_runtime_cuda.so``). ``export`` copies those into the artifact (the manifest lists them
with their SHA-256 under ``runtime_libraries``), and this module loads them with ``ctypes`` next
to ``tvm_ffi``:

1. the runtime libraries, ``RTLD_GLOBAL`` (they register their functions — the thread pool's
   ``runtime.config_threadpool``, tensor allocation and copies, the CUDA module loader — in
   tvm-ffi's global registry). A process that already holds a TVM runtime (``import tvm``) keeps
   it, and where ``apache-tvm`` is installed its own copy is the one loaded, so that a later
   ``import tvm`` finds it loaded: a second copy registers every function twice, which aborts
   the process;
2. the kernel library, whose data slots ``__TVMBackendParallelLaunch``,
   ``__TVMBackendAllocWorkspace`` and ``__TVMBackendFreeWorkspace`` are filled with the runtime's
   functions — what TVM's own module loader does and tvm-ffi's does not (left empty, the first
   parallel loop jumps to address 0);
3. ``tvm_ffi.load_module`` of that library, which finds the same loaded copy.

What an artifact carries is loaded from a **private copy** (:func:`read_code`,
:func:`private_copy`): the file is read once, never through a symbolic link, its SHA-256 checked
on the bytes read, and those bytes written into a fresh 0700 folder, from which they are loaded
(the folder is removed at once; the mapping stays). So the library checked is the library run (a
file swapped between the check and the load is never loaded), and a library rebuilt at the path
of one this process loaded before is loaded anew (the dynamic linker reuses a loaded library of
the same path).

Nothing here imports ``tvm``.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

#: The runtime functions an exported library reaches through data slots it holds (``__`` + name).
CONTEXT_FUNCTIONS = ("TVMBackendParallelLaunch", "TVMBackendAllocWorkspace", "TVMBackendFreeWorkspace")
#: The runtime libraries an artifact carries: CPU artifacts the first, CUDA artifacts both.
RUNTIME_CPU = "libtvm_runtime.so"
RUNTIME_CUDA = "libtvm_runtime_cuda.so"

_DL_CUDA = 2


class RuntimeLoadError(RuntimeError):
    """A runtime library or kernel library could not be loaded; the message names the file."""


def _loaded(soname: str) -> ctypes.CDLL | None:
    """The library of that soname if this process already holds one (``import tvm`` loads
    TVM's), else None."""
    try:
        return ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    except OSError:
        return None


def _installed_lib_dir() -> Path | None:
    """``tvm/lib`` of an installed ``apache-tvm`` (found, not imported), or None."""
    import importlib.util

    try:
        found = importlib.util.find_spec("tvm")
    except (ImportError, ValueError):  # e.g. sys.modules["tvm"] = None
        return None
    if found is None or not found.submodule_search_locations:
        return None
    return Path(next(iter(found.submodule_search_locations))) / "lib"


def compiler_runtime_paths(cuda: bool = False) -> list[Path]:
    """The runtime libraries of the installed ``apache-tvm`` (what ``export`` copies into an
    artifact), without importing it."""
    lib = _installed_lib_dir()
    if lib is None:
        raise RuntimeLoadError("apache-tvm is not installed: no runtime library to copy into the artifact")
    names = [RUNTIME_CPU] + ([RUNTIME_CUDA] if cuda else [])
    paths = [lib / n for n in names]
    for p in paths:
        if not p.is_file():
            raise RuntimeLoadError(f"{p}: TVM's runtime library is missing from the installed apache-tvm")
    return paths


def read_code(path: str | os.PathLike, sha256: str | None = None, what: str = "the manifest's") -> bytes:
    """The bytes of the regular file ``path``, read once and never through a symbolic link (an
    artifact's code lies in its own folder), checked against ``sha256`` when given (``what``
    names whose digest it is in the error). Raises :class:`RuntimeLoadError` naming the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RuntimeLoadError(f"{path}: a symbolic link; an artifact's code is loaded only from regular files "
                                   "inside its folder, never from where a link points") from None
        raise RuntimeLoadError(f"{path}: cannot open ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise RuntimeLoadError(f"{path}: not a regular file")
        data = f.read()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise RuntimeLoadError(f"{path}: SHA-256 does not match {what}: the file and the manifest come from "
                               "different builds, or the file was changed (rebuild the artifact)")
    return data


@contextlib.contextmanager
def private_copy(data: bytes, name: str):
    """A path holding ``data`` in a fresh folder only this user can reach (0700), removed when the
    block ends: what a library is loaded from (the module docstring)."""
    folder = tempfile.mkdtemp(prefix="tvm-attention-load-")
    try:
        path = Path(folder) / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o700)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def ensure_runtime(directory: str | os.PathLike | None, names: list[str],
                   digests: dict[str, str] | None = None) -> ctypes.CDLL:
    """Load the runtime libraries ``names`` (from ``directory``, the artifact: a private copy
    of each, checked against ``digests`` by name when given) unless this process already holds
    them; returns the CPU runtime's handle."""
    import tvm_ffi  # noqa: F401 - loads libtvm_ffi.so, which the runtime libraries link against

    handles = {}
    if RUNTIME_CUDA in names and _loaded(RUNTIME_CUDA) is None:
        preload_cudart()
    installed = _installed_lib_dir()
    for name in names:
        have = _loaded(name)
        if have is None:
            if installed is not None and (installed / name).is_file():
                path = installed / name  # the compiler's copy: `import tvm` later loads this same file
            elif directory is None:
                raise RuntimeLoadError(f"{name} is not loaded and no artifact directory holds it")
            else:
                path = Path(directory) / name
            if not os.path.lexists(path):
                raise RuntimeLoadError(f"{path}: runtime library missing from the artifact")
            if path.parent == installed:
                have = _load_global(path, path)
            else:  # the artifact's copy: checked bytes, loaded from a private copy
                data = read_code(path, (digests or {}).get(name), "the manifest's runtime_libraries entry")
                with private_copy(data, name) as copy:
                    have = _load_global(copy, path)
        handles[name] = have
    return handles[RUNTIME_CPU] if RUNTIME_CPU in handles else _loaded(RUNTIME_CPU)


def _load_global(path: Path, shown: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise RuntimeLoadError(f"{shown}: cannot load ({e})") from None


#: The CUDA runtime libtvm_runtime_cuda.so links against (TVM 0.27's wheel: CUDA 13).
CUDART = "libcudart.so.13"


def preload_cudart() -> None:
    """Load ``libcudart.so.13`` where the dynamic linker would not find it by itself: PyTorch's
    ``nvidia`` packages (a GPU machine with torch and no CUDA toolkit), ``$CUDA_HOME``. Does
    nothing when it is loaded or on the linker's path already; a missing one is reported when the
    CUDA runtime library fails to load."""
    if _loaded(CUDART) is not None:
        return
    import sys

    candidates = []
    for entry in sys.path:
        root = Path(entry) / "nvidia"
        if root.is_dir():
            candidates += sorted(root.glob(f"*/lib/{CUDART}"))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates += [Path(home) / sub / CUDART for sub in ("lib64", "lib")]
    for path in candidates:
        if path.is_file():
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                continue


_CUDA_BINARIES: dict[str, bytes] = {}


def provide_cuda_binary(source_sha256: str, data: bytes) -> None:
    """Hand TVM's CUDA runtime the binary an artifact carries for its kernel source. TVM's CUDA
    modules hold source and compile it when they load, through the global function
    ``tvm_callback_cuda_compile``, which only the compiler package registers; this registers one
    that returns the precompiled binary for a source it knows (SHA-256 of the source), and for any
    other falls back to the compiler's when ``apache-tvm`` is installed."""
    import tvm_ffi

    if not _CUDA_BINARIES:
        tvm_ffi.register_global_func("tvm_callback_cuda_compile", _compile_callback, override=True)
    _CUDA_BINARIES[source_sha256] = bytes(data)


def _compile_callback(code) -> bytes:
    import hashlib

    found = _CUDA_BINARIES.get(hashlib.sha256(str(code).encode()).hexdigest())
    if found is not None:
        return found
    try:
        from tvm.support.nvcc import tvm_callback_cuda_compile
    except ImportError:
        raise RuntimeError("a CUDA kernel source without its precompiled binary, and no compiler here (apache-tvm): "
                           "rebuild the artifact where nvcc is, so that it carries kernel.fatbin") from None
    return tvm_callback_cuda_compile(code)


def load_library(path: str | os.PathLike, runtime: ctypes.CDLL, sha256: str | None = None,
                 what: str = "the manifest's library_sha256") -> Any:
    """``tvm_ffi.load_module`` of an exported kernel library, its runtime slots filled first:
    a private copy of the file's bytes (:func:`read_code`, checked against ``sha256`` when
    given), so what was checked is what runs."""
    data = read_code(path, sha256, what)
    with private_copy(data, Path(path).name) as copy:
        return _load_kernel(copy, path, runtime)


def _load_kernel(path: Path, shown: str | os.PathLike, runtime: ctypes.CDLL) -> Any:
    import tvm_ffi

    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise RuntimeLoadError(f"{shown}: cannot load ({e})") from None
    for name in CONTEXT_FUNCTIONS:
        try:
            slot = ctypes.c_void_p.in_dll(lib, "__" + name)
        except ValueError:  # a library without parallel loops or workspaces has no such slot
            continue
        if not slot.value:
            slot.value = ctypes.cast(getattr(runtime, name), ctypes.c_void_p).value
    return tvm_ffi.load_module(str(path))


def global_func(name: str):
    """A function TVM's runtime registers with tvm-ffi. When no runtime is loaded yet and the
    compiler is installed (a build, a benchmark), importing it loads TVM's runtime; serving
    loads the artifact's copy first (:func:`ensure_runtime`) and never gets here without one."""
    import tvm_ffi

    f = tvm_ffi.get_global_func(name, allow_missing=True)
    if f is None and _loaded(RUNTIME_CPU) is None:
        try:
            import tvm  # noqa: F401 - the compiler path: its import loads libtvm_runtime
        except ImportError:
            pass
        f = tvm_ffi.get_global_func(name, allow_missing=True)
    if f is None:
        raise RuntimeLoadError(f"TVM runtime function {name!r} is not registered: load an artifact first "
                               "(tvm_attention.load), which loads the TVM runtime it carries")
    return f


# -- tensors without tvm.runtime -------------------------------------------------------------
def is_ml_dtype(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is one of ml_dtypes' (bfloat16, float8_*): NumPy cannot export it through
    DLPack, so a kernel takes a view of its bits in that dtype (:func:`cpu_view`)."""
    return dtype.name == "bfloat16" or dtype.name.startswith("float8")


def cpu_view(a: np.ndarray) -> Any:
    """What a kernel is called with for NumPy array ``a``: ``a`` itself (DLPack, no copy), or
    for bfloat16 and float8 (ml_dtypes), which NumPy cannot export through DLPack, a view of
    their bits in that dtype."""
    name = a.dtype.name
    if is_ml_dtype(a.dtype):
        import tvm_ffi

        bits = tvm_ffi.from_dlpack(a.view(np.uint16 if name == "bfloat16" else np.uint8))
        return global_func("runtime.TVMTensorCreateView")(bits, a.shape, name, 0)
    return a


def cuda_device(index: int = 0):
    import tvm_ffi

    return tvm_ffi.device("cuda", index)


def cuda_arch(index: int = 0) -> str | None:
    """``sm_XY`` of CUDA device ``index`` when the CUDA runtime is loaded and the device exists."""
    import tvm_ffi

    attr = tvm_ffi.get_global_func("runtime.GetDeviceAttr", allow_missing=True)
    if attr is None:
        return None
    try:
        if not attr(_DL_CUDA, index, 0):  # kExist
            return None
        return "sm_" + str(attr(_DL_CUDA, index, 4)).replace(".", "")  # kComputeVersion
    except Exception:  # noqa: BLE001 - no driver, no device
        return None


def empty(shape, dtype: str, device) -> Any:
    """An uninitialized tensor on ``device`` (64-byte aligned, compact)."""
    return global_func("runtime.TVMTensorAllocWithScope")(tuple(int(d) for d in shape), dtype, device, None)


def to_device(a: np.ndarray, device) -> Any:
    """A copy of C-contiguous ``a`` on ``device``."""
    t = empty(a.shape, _dtype_name(a.dtype), device)
    global_func("runtime.TVMTensorCopyFromBytes")(t, a.ctypes.data_as(ctypes.c_void_p), a.nbytes)
    return t


def to_numpy(t: Any, dtype: np.dtype) -> np.ndarray:
    """A NumPy copy of tensor ``t`` (any device)."""
    out = np.empty(tuple(t.shape), dtype=dtype)
    global_func("runtime.TVMTensorCopyToBytes")(t, out.ctypes.data_as(ctypes.c_void_p), out.nbytes)
    return out


def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name if is_ml_dtype(dtype) else str(dtype)
