"""Serving-side loader: ``tvm_attention.load(DIR)`` → ``kernel(q, k, v) -> o``.

The callable checks every input against the manifest (rank, shape, dtype, device, contiguity)
and raises :class:`KernelArgumentError` naming the argument and the mismatch. TVM kernels assume
64-byte-aligned data (vectorized loads/stores): an input that is not aligned is copied into
aligned memory first, so a misaligned view can never crash the process.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from .spec import AttentionSpec, numpy_dtype

ALIGNMENT = 64
MANIFEST = "manifest.json"
SUPPORTED_MANIFEST_VERSIONS = (1,)
_DLPACK_CPU = 1
_DLPACK_CUDA = 2


class KernelArgumentError(ValueError):
    """A kernel argument does not match the artifact's manifest."""


class ArtifactError(RuntimeError):
    """An artifact directory is missing files or has an unreadable/unsupported manifest."""


def _as_numpy(name: str, x: Any, kernel_device: str = "cpu") -> tuple[np.ndarray, str | None]:
    """NumPy view of ``x`` (no copy) and the name of the framework to return results in."""
    if isinstance(x, np.ndarray):
        return x, None
    if hasattr(x, "__dlpack__"):
        if hasattr(x, "__dlpack_device__"):
            dev_type, dev_id = x.__dlpack_device__()
            if int(dev_type) != _DLPACK_CPU:
                raise KernelArgumentError(
                    f"{name}: tensor is on DLPack device type {int(dev_type)} (id {dev_id}); "
                    f"this kernel runs on {kernel_device}: pass a "
                    f"{'CPU' if kernel_device == 'cpu' else 'CPU or cuda:0'} tensor"
                )
        try:
            arr = np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError) as e:
            raise KernelArgumentError(f"{name}: cannot read tensor through DLPack: {e}") from None
        return arr, type(x).__module__.split(".")[0]
    raise KernelArgumentError(
        f"{name}: expected a NumPy array or a DLPack tensor, got {type(x).__name__}"
    )


def _from_framework(framework: str | None, arr: np.ndarray) -> Any:
    if framework is None or framework == "numpy":
        return arr
    mod = sys.modules.get(framework)
    if mod is not None and hasattr(mod, "from_dlpack"):
        return mod.from_dlpack(arr)
    return arr


def aligned_empty(shape, dtype) -> np.ndarray:
    """A C-contiguous NumPy array whose data pointer is 64-byte aligned."""
    dtype = numpy_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def is_aligned(a: np.ndarray) -> bool:
    return a.ctypes.data % ALIGNMENT == 0


class AttentionKernel:
    """Callable wrapper around a compiled attention function: ``kernel(q, k, v) -> o``.

    ``q``: ``(B, H, Sq, D)``; ``k``, ``v``: ``(B, KH, Skv, D)``; result ``o``: ``(B, H, Sq, D)``,
    all ``spec.dtype``, C-contiguous, on the CPU. Pass ``out=`` to write into your own buffer.
    """

    def __init__(self, spec: AttentionSpec, function: Any, manifest: dict[str, Any] | None = None,
                 device: str = "cpu"):
        self.spec = spec
        self.function = function
        self.manifest = manifest or {}
        self.device = device  # "cpu" or "cuda"
        self._arg_specs = spec.arg_specs()

    def _cuda_tensor(self, idx: int, x: Any):
        """A CUDA DLPack tensor, wrapped without a copy (shape and dtype checked)."""
        want = self._arg_specs[idx]
        t = tvm.runtime.from_dlpack(x)
        if tuple(t.shape) != tuple(want["shape"]) or str(t.dtype) != want["dtype"]:
            raise KernelArgumentError(
                f"{want['name']}: expected shape {tuple(want['shape'])} dtype {want['dtype']}, "
                f"got {tuple(t.shape)} {t.dtype}"
            )
        return t, type(x).__module__.split(".")[0]

    def _check(self, idx: int, x: Any) -> tuple[np.ndarray, str | None]:
        want = self._arg_specs[idx]
        name = want["name"]
        arr, framework = _as_numpy(name, x, self.device)
        shape = tuple(want["shape"])
        if arr.ndim != len(shape):
            raise KernelArgumentError(
                f"{name}: expected rank {len(shape)} (BHSD {shape}), got rank {arr.ndim} with shape {arr.shape}"
            )
        if tuple(arr.shape) != shape:
            raise KernelArgumentError(f"{name}: expected shape {shape} (BHSD), got {tuple(arr.shape)}")
        if arr.dtype != numpy_dtype(want["dtype"]):
            raise KernelArgumentError(f"{name}: expected dtype {want['dtype']}, got {arr.dtype}")
        if not arr.flags.c_contiguous:
            raise KernelArgumentError(
                f"{name}: expected a C-contiguous (row-major BHSD) array, got strides {arr.strides}; "
                "use np.ascontiguousarray / .contiguous()"
            )
        if not is_aligned(arr):
            # Vectorized kernels assume 64-byte alignment; copy rather than risk a crash.
            aligned = aligned_empty(arr.shape, arr.dtype)
            aligned[...] = arr
            arr = aligned
        return arr, framework

    def __call__(self, q: Any, k: Any, v: Any, out: Any = None) -> Any:
        if self.device == "cuda":
            return self._call_cuda(q, k, v)
        qa, framework = self._check(0, q)
        ka, _ = self._check(1, k)
        va, _ = self._check(2, v)
        if out is None:
            oa = aligned_empty(self.spec.o_shape, self.spec.dtype)
            result = oa
        else:
            oa, _ = _as_numpy("out", out)
            if tuple(oa.shape) != self.spec.o_shape or oa.dtype != self.spec.np_dtype:
                raise KernelArgumentError(
                    f"out: expected shape {self.spec.o_shape} dtype {self.spec.dtype}, "
                    f"got {tuple(oa.shape)} {oa.dtype}"
                )
            if not oa.flags.c_contiguous or not is_aligned(oa) or not oa.flags.writeable:
                raise KernelArgumentError(
                    "out: must be writeable, C-contiguous and 64-byte aligned "
                    "(see tvm_attention.loader.aligned_empty)"
                )
            result = out
        self.function(qa, ka, va, oa)
        return result if out is not None else _from_framework(framework, result)


    def _call_cuda(self, q: Any, k: Any, v: Any) -> Any:
        """CPU inputs are copied to GPU 0 and the result copied back; CUDA DLPack tensors are
        used in place and the result stays on the GPU."""
        dev = tvm.cuda(0)
        args, framework, on_gpu = [], None, False
        for i, x in enumerate((q, k, v)):
            if hasattr(x, "__dlpack_device__") and int(x.__dlpack_device__()[0]) == _DLPACK_CUDA:
                t, fw = self._cuda_tensor(i, x)
                on_gpu = True
            else:
                arr, fw = self._check(i, x)
                t = tvm.runtime.tensor(arr, dev)
            framework = framework if i else fw
            args.append(t)
        o = tvm.runtime.empty(self.spec.o_shape, self.spec.dtype, dev)
        self.function(*args, o)
        if on_gpu:
            return _from_framework(framework, o)
        return _from_framework(framework, o.numpy())


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: no manifest (is {directory} an artifact directory?)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: not valid JSON: {e}") from None
    version = manifest.get("manifest_version")
    if version not in SUPPORTED_MANIFEST_VERSIONS:
        raise ArtifactError(
            f"{path}: manifest_version {version!r} not supported (supported: {SUPPORTED_MANIFEST_VERSIONS})"
        )
    for key in ("entry", "library", "spec", "args"):
        if key not in manifest:
            raise ArtifactError(f"{path}: manifest has no {key!r}")
    return manifest


def load(directory: str | os.PathLike, num_threads: int | None = None) -> AttentionKernel:
    """Load an artifact directory written by ``tvm-attention build``.

    ``num_threads``: TVM runtime threads (default: every core available to this process).
    """
    from .threads import set_num_threads

    manifest = read_manifest(directory)
    lib = Path(directory) / manifest["library"]
    if not lib.is_file():
        raise ArtifactError(f"{lib}: shared library missing")
    spec = AttentionSpec.from_dict(manifest["spec"])
    device = "cuda" if manifest.get("target", {}).get("kind") == "cuda" else "cpu"
    if device == "cuda":
        from .target import local_cuda_arch

        if local_cuda_arch() is None:
            raise ArtifactError(
                f"{directory}: a CUDA artifact ({manifest['target'].get('arch')}); this machine has no "
                "CUDA device TVM can use"
            )
    set_num_threads(num_threads)
    module = tvm.runtime.load_module(str(lib))
    return AttentionKernel(spec, module[manifest["entry"]], manifest, device=device)
