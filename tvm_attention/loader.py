"""Serving-side loader: ``tvm_attention.load(DIR)`` → ``kernel(q, k, v) -> o`` (varlen:
``kernel(q, k, v, cu_seqlens_q=..., cu_seqlens_k=...)``; the layout entry says which).

The callable checks every input against the manifest (rank, static dims, the agreement of each
symbolic dim between arguments, dtype, device, contiguity, 32-bit indexing) and the layout's
index arrays (``Layout.check_indices``: cu_seqlens), and raises :class:`KernelArgumentError`
naming the argument and the mismatch, so that through the loader a kernel never reads out of
bounds (the bare runtime function checks none of this). Zero-size inputs are answered here and
never reach the kernel. A kernel assumes its arguments' data aligned as its manifest's
``data_alignment`` says (16 bytes for CPU builds, where NumPy puts arrays; 64 for CUDA builds and
artifacts that predate the key): an input that is not is copied into aligned memory first, so a
misaligned view can never crash the process. A kernel that appends ``k_new``/``v_new`` to its
caches (``spec.append``) writes them in place: a cache it would have to copy (misaligned) or
cannot write (read-only) is refused instead. An ``out=`` buffer may be
any writeable C-contiguous array of the right shape and dtype (a misaligned one is computed into
aligned memory and copied); one that shares memory with ``q``, ``k`` or ``v`` is rejected, since
the kernel reads its inputs while it writes the output (its PrimFunc declares no aliasing).

CUDA artifacts take CUDA DLPack tensors in place (CPU inputs are copied over and back). A strided
or misaligned CUDA tensor is copied into a compact one first (``contiguous()``/``clone()``),
``out=`` included (computed aside, then copied in). The kernel runs on a torch caller's current
CUDA stream (``tvm_ffi.use_torch_stream``), so work the caller queued on a side stream is
ordered with it; other callers get TVM's default stream.

``load`` checks the artifact before anything runs: the library's SHA-256 against the manifest's
``library_sha256`` (a library from another build next to this manifest would compute something
else without a word), the manifest's ``args`` against its spec, the CPU features the code needs
against this CPU's, and the spec against the one the library reports it was built from.

Serving needs neither the compiler nor its import (seconds, hundreds of MB): this module imports
``tvm_ffi`` and NumPy only, and loads the parts of TVM's runtime the artifact carries
(``tvm_attention.runtime``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from . import runtime
from .hostcpu import describe_host, missing_features
from .layouts import (ARG_ALIASES, INDEX_ERROR_ARG, INDEX_ERROR_BITS, SEQUENCE_DIMS, VARIANT_ARGS, KernelArgumentError,
                      _bound_dim, describe_index_error)
from .spec import ENTRY, MAX_ELEMENTS, MAX_SEQ_LEN, AttentionSpec, SpecError, numpy_dtype
from .threads import default_num_threads, set_num_threads, use_threads

#: What ``aligned_empty`` gives, and what an artifact whose manifest names no ``data_alignment``
#: (built before it was recorded, or a CUDA build) needs of every argument's data pointer.
ALIGNMENT = 64
MANIFEST = "manifest.json"
SUPPORTED_MANIFEST_VERSIONS = (1,)
_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_SLOW = object()  # _fast_call's "take the checked path"
_NO_ARG = object()  # __call__'s third argument not given (a latent cache's kernel takes two data inputs)


class ArtifactError(RuntimeError):
    """An artifact directory is missing files or has an unreadable/unsupported manifest."""


def _as_numpy(name: str, x: Any, kernel_device: str = "cpu") -> tuple[np.ndarray, str | None]:
    """NumPy view of ``x`` (no copy) and the name of the framework to return results in."""
    if isinstance(x, np.ndarray):
        return x, None
    if type(x).__module__ == "torch" and getattr(getattr(x, "device", None), "type", None) == "cpu":
        # Fast path, paid on every generated token: Tensor.numpy() is a view, like DLPack's,
        # at a third of the cost. It refuses tensors that require grad; DLPack below says why.
        try:
            return x.numpy(), "torch"
        except (RuntimeError, TypeError):
            pass
        torch = sys.modules["torch"]
        if x.dtype == torch.bfloat16 and not x.requires_grad:  # NumPy has no bfloat16: its bits
            return x.view(torch.int16).numpy().view(numpy_dtype("bfloat16")), "torch"
        name = str(x.dtype).replace("torch.", "")
        if name.startswith("float8") and not x.requires_grad:  # an 8-bit cache: ml_dtypes' float8 of its bits
            return x.view(torch.uint8).numpy().view(numpy_dtype(name)), "torch"
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
    if framework == "torch" and mod is not None:
        if isinstance(arr, np.ndarray) and arr.dtype.name == "bfloat16":  # ml_dtypes: torch takes the bits
            return mod.from_numpy(arr.view(np.int16)).view(mod.bfloat16)
        try:
            return mod.from_numpy(arr)  # a view, cheaper than DLPack
        except TypeError:  # a dtype torch.from_numpy does not know
            pass
    if mod is not None and hasattr(mod, "from_dlpack"):
        return mod.from_dlpack(arr)
    return arr


def _compact_copy(x: Any) -> Any:
    """A compact, freshly allocated copy of a device tensor that TVM would not wrap (strided, or
    a view at a misaligned offset), or None when ``x`` offers no way to make one."""
    contiguous = getattr(x, "contiguous", None)
    y = contiguous() if callable(contiguous) else x
    if y is x:  # already contiguous: a misaligned view; a clone gets a new allocation
        clone = getattr(x, "clone", None)
        return clone() if callable(clone) else None
    return y


def kernel_arg(a: np.ndarray) -> Any:
    """What the kernel is called with for the NumPy array ``a``: ``a`` itself (DLPack, no
    copy), or for bfloat16, which DLPack cannot export from NumPy, a view of its bits."""
    return runtime.cpu_view(a)


def aligned_empty(shape, dtype) -> np.ndarray:
    """A C-contiguous NumPy array whose data pointer is 64-byte aligned."""
    import tvm_ffi

    dtype = numpy_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    shape = tuple(int(d) for d in shape) if not isinstance(shape, int) else (shape,)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    # the data pointer through DLPack: a third of the time of raw.ctypes.data, paid per call
    offset = -tvm_ffi.from_dlpack(raw).data_ptr() % ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


class _Interface:
    """An ``__array_interface__`` holder that keeps the array it describes alive."""

    def __init__(self, interface: dict, base: np.ndarray):
        self.__array_interface__ = interface
        self.base = base


def writeable_alias(a: np.ndarray) -> np.ndarray:
    """The memory of read-only ``a`` (``np.memmap`` or ``np.load(mmap_mode="r")`` of a cache, an
    array whose ``writeable`` flag is off) as a writeable view, no copy: NumPy refuses to export a
    read-only array through DLPack (``BufferError: Cannot export readonly array``), which has no
    read-only flag in the version tvm-ffi asks for. Only for inputs the kernel never writes."""
    interface = dict(a.__array_interface__)
    interface["data"] = (interface["data"][0], False)
    out = np.asarray(_Interface(interface, a))
    return out if out.dtype == a.dtype else out.view(a.dtype)  # ml_dtypes' types travel as raw bytes


def is_aligned(a: np.ndarray, alignment: int = ALIGNMENT) -> bool:
    return a.ctypes.data % alignment == 0


def _byte_range(x: Any) -> tuple[int, int] | None:
    """[start, end) of a device tensor's memory where the framework tells it (torch)."""
    try:
        start = int(x.data_ptr())
        return start, start + int(x.numel()) * int(x.element_size())
    except (AttributeError, TypeError):
        return None


def check_no_overlap(out: Any, inputs: dict[str, Any]) -> None:
    """Raise if ``out`` may share memory with an input (NumPy arrays, or tensors exposing
    ``data_ptr``): the kernel would read what it is overwriting."""
    for name, x in inputs.items():
        if isinstance(out, np.ndarray) and isinstance(x, np.ndarray):
            shared = np.may_share_memory(out, x)
        else:
            a, b = _byte_range(out), _byte_range(x)
            shared = a is not None and b is not None and a[0] < b[1] and b[0] < a[1]
        if shared:
            raise KernelArgumentError(
                f"out: shares memory with {name}; the kernel reads {name} while it writes out, so the "
                "result would be wrong. Pass a separate output buffer (or none: a new one is returned)"
            )


def _shape_text(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


#: a variant argument's name -> the spec flag (and CLI option) that makes a kernel take it
VARIANT_FLAGS = {a.name: flag for flag, a in VARIANT_ARGS}


class AttentionKernel:
    """Callable wrapper around a compiled attention function.

    bhsd: ``kernel(q, k, v) -> o`` with ``q (B, H, Sq, D)``, ``k``, ``v (B, KH, Skv, D)``, result
    ``(B, H, Sq, D)``; varlen: ``kernel(q, k, v, cu_seqlens_q=..., cu_seqlens_k=...)`` with the
    packed ``(total, heads, D)`` tensors (``tvm_attention.layouts``); a latent cache (``mla``):
    ``kernel(q, kv_cache, cache_seqlens)``, one cache for K and V. All ``spec.dtype``,
    C-contiguous, on the CPU. A symbolic dim (the manifest's ``symbolic_dims``) takes any size;
    the others must match. Pass ``out=`` to write into your own buffer. FlashAttention's
    ``causal``, ``softmax_scale`` (and for varlen ``max_seqlen_q``/``max_seqlen_k``) keywords are
    accepted and checked against what the artifact was built with.
    """

    def __init__(self, spec: AttentionSpec, function: Any, manifest: dict[str, Any] | None = None,
                 device: str = "cpu", num_threads: int | None = None):
        self.spec = spec
        self.function = function
        self.manifest = manifest or {}
        self.device = device  # "cpu" or "cuda"
        #: bytes every argument's data must be aligned to (the manifest's ``data_alignment``):
        #: an input that is not is copied, never passed on (aligned moves would fault)
        self.alignment = self.manifest.get("data_alignment", ALIGNMENT)
        if isinstance(self.alignment, bool) or not isinstance(self.alignment, int) or self.alignment < 1 \
                or self.alignment & (self.alignment - 1):
            raise ArtifactError(f"manifest data_alignment must be a power of two, got {self.alignment!r}")
        #: CPU threads this kernel runs on, applied in the calling thread at each call.
        self.num_threads = default_num_threads() if num_threads is None else num_threads
        if isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int) or self.num_threads < 1:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        self.layout = spec.layout_info
        self._arg_specs = spec.arg_specs()
        # (name, shape with ints and dim names, NumPy dtype) of each input, in call order
        self._inputs = [(a["name"], tuple(a["shape"]), numpy_dtype(a["dtype"]))
                        for a, arg in zip(self._arg_specs, self.layout.all_args(spec)) if not arg.output]
        outs = [(tuple(a["shape"]), a["dtype"]) for a, arg in zip(self._arg_specs, self.layout.all_args(spec))
                if arg.output and arg.name != INDEX_ERROR_ARG.name]
        self._out_shape = outs[0][0]  # o
        self._extra_outs = outs[1:]  # lse, when the artifact returns it
        #: a CUDA build with device-side index checks: the call passes ``index_error`` last and
        #: reads it back after the launch (``_check_index_error``)
        self._device_checks = bool(getattr(spec, "device_checks", False))
        self._qkv = self.layout.data_names  # q, k, v / q, k_cache, v_cache / q, kv_cache (a latent cache)...
        self._index_names = self.layout.index_names(spec)  # index arrays, then variant arguments
        self._options = self.layout.all_options()
        self._static = not any(isinstance(d, str) for _, shape, _ in self._inputs for d in shape)
        #: the fast path (``_fast_call``): CPU kernels returning o alone
        self._fast = device == "cpu" and not self._extra_outs
        self._names = tuple(name for name, _, _ in self._inputs)
        #: positions of the inputs the kernel writes (an appending kernel's caches): never aliased
        #: when read-only, refused by name instead
        self._written = frozenset(i for i, name in enumerate(self._names)
                                  if getattr(spec, "append", False) and name in self.layout.kv_names)

    # -- argument handling ---------------------------------------------------------------------
    def _gather(self, data, index, kw) -> tuple[dict[str, Any], dict[str, Any]]:
        """The inputs by name (index arrays positional or by keyword) and the option keywords."""
        given: dict[str, Any] = dict(zip(self._qkv, data))
        options: dict[str, Any] = {}
        if len(index) > len(self._index_names):
            raise KernelArgumentError(
                f"{len(index)} arguments after {', '.join(self._qkv)}; this {self.layout.name} kernel takes "
                f"{len(self._index_names)}{': ' + ', '.join(self._index_names) if self._index_names else ''}"
            )
        given.update(zip(self._index_names, index))
        for name, x in kw.items():
            name = ARG_ALIASES.get(name, name) if ARG_ALIASES.get(name) in self._index_names else name
            if name in self._index_names:
                if name in given:
                    raise KernelArgumentError(f"{name}: given both by position and by keyword")
                given[name] = x
            elif name in self._options:
                options[name] = x
            elif name in VARIANT_FLAGS or ARG_ALIASES.get(name) in VARIANT_FLAGS:
                if x is not None:  # FlashAttention callers pass None for what they do not use
                    flag = VARIANT_FLAGS[ARG_ALIASES.get(name, name)]
                    raise KernelArgumentError(
                        f"{name}: this artifact was built without {flag}; build one with --{flag.replace('_', '-')} "
                        "to pass it")
            else:
                known = list(self._index_names) + list(self._options) + ["out"]
                raise KernelArgumentError(
                    f"unexpected keyword argument {name!r} for a {self.layout.name} kernel; it takes {', '.join(known)}"
                )
        if getattr(self.spec, "custom_mask", False) and given.get("mask_indptr") is None \
                and "custom_mask" in given:
            given["custom_mask"], given["mask_indptr"] = self._packed_mask(given)
        missing = [n for n in self._index_names if n not in given]
        if missing:
            raise KernelArgumentError(
                f"missing {', '.join(missing)}: a {self.layout.name} kernel is called as "
                f"kernel({', '.join(self._qkv)}, {', '.join(f'{n}=...' for n in self._index_names)})"
            )
        return given, options

    def _packed_mask(self, given: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """A boolean ``custom_mask`` given without ``mask_indptr``, packed (FlashInfer's bits,
        ``tvm_attention.masks``): a ``(batch, rows, keys)`` array of which each sequence takes its
        first ``(rows_b, keys_b)`` (its query rows and keys: the call's lengths), or a list of one
        ``(rows_b, keys_b)`` array per sequence."""
        from .masks import pack_mask  # only callers of a boolean mask need it

        m, shapes = given["custom_mask"], self.layout.mask_shapes(self.spec, given)
        try:
            if isinstance(m, (list, tuple)):
                masks = [np.asarray(x) for x in m]
                if len(masks) != len(shapes) or any(x.shape != s for x, s in zip(masks, shapes)):
                    raise KernelArgumentError(f"custom_mask: expected one boolean mask per sequence, shaped "
                                              f"{shapes}, got {[x.shape for x in masks]}")
                return pack_mask(masks)
            a = np.asarray(m)
            if a.dtype != np.bool_:
                raise KernelArgumentError(f"custom_mask: without mask_indptr, expected booleans (batch, rows, keys) "
                                          f"(or packed uint8 bytes with mask_indptr), got {a.dtype}")
            if a.ndim != 3 or a.shape[0] != len(shapes) or any(a.shape[1] < r or a.shape[2] < k for r, k in shapes):
                raise KernelArgumentError(f"custom_mask: expected (batch={len(shapes)}, rows, keys) booleans covering "
                                          f"every sequence's (rows, keys) {shapes}, got {a.shape}")
            return pack_mask([a[b, :r, :k] for b, (r, k) in enumerate(shapes)])
        except SpecError as e:
            raise KernelArgumentError(str(e)) from None

    def _bind_dims(self, name: str, shape: tuple, actual: tuple[int, ...], bound: dict[str, int],
                   source: dict[str, str]) -> str:
        """Check ``actual`` against ``shape`` (ints and dim names), binding each symbolic dim at
        its first sight (``source`` names the argument it came from); returns the layout's name
        for messages."""
        layout = self.layout.manifest_name
        if len(actual) != len(shape):
            raise KernelArgumentError(
                f"{name}: expected rank {len(shape)} ({layout} {_shape_text(shape)}), got rank {len(actual)} "
                f"with shape {actual}"
            )
        for i, want in enumerate(shape):
            n = actual[i]
            if isinstance(want, int):
                if n != want:
                    raise KernelArgumentError(f"{name}: expected shape {_shape_text(shape)} ({layout}), got {actual}")
                continue
            key, plus = _bound_dim(want)
            value = n - plus
            if key in SEQUENCE_DIMS and value > MAX_SEQ_LEN:
                raise KernelArgumentError(
                    f"{name}: dim {i} ({want}) is {n}; the longest sequence a kernel takes is {MAX_SEQ_LEN} rows or "
                    "keys (2**30: kernels form positions and tile bounds in int32)")
            if key not in bound:
                bound[key], source[key] = value, name
            elif bound[key] != value:
                raise KernelArgumentError(
                    f"{name}: dim {i} ({want}) is {n}, but {source[key]} has {key}={bound[key]}; expected shape "
                    f"{_shape_text(shape)} with {key}={bound[key]}"
                )
        return layout

    def _check_array(self, name: str, shape: tuple, dtype: np.dtype, arr: np.ndarray, bound: dict[str, int],
                     source: dict[str, str]) -> np.ndarray:
        layout = self._bind_dims(name, shape, tuple(arr.shape), bound, source)
        if arr.size and arr.size > MAX_ELEMENTS:
            raise KernelArgumentError(
                f"{name}: {arr.size} elements {tuple(arr.shape)}; the kernel indexes with 32-bit ints, so a "
                f"tensor may hold at most {MAX_ELEMENTS}: split the batch"
            )
        if arr.dtype != dtype:
            raise KernelArgumentError(f"{name}: expected dtype {dtype}, got {arr.dtype}")
        if not arr.flags.c_contiguous:
            raise KernelArgumentError(
                f"{name}: expected a C-contiguous (row-major {layout}) array, got strides {arr.strides}; "
                "use np.ascontiguousarray / .contiguous()"
            )
        if self.spec.append and name in self.layout.kv_names:
            # the kernel writes k_new/v_new into this cache: a copy would lose them
            if not arr.flags.writeable:
                raise KernelArgumentError(f"{name}: read-only; this kernel appends the new keys to the cache in place")
            if not is_aligned(arr, self.alignment):
                raise KernelArgumentError(
                    f"{name}: data at {arr.ctypes.data % 64} mod 64 bytes, not {self.alignment}-byte aligned; this "
                    "kernel appends to the cache in place and would have to copy it (allocate caches with "
                    "tvm_attention.aligned_empty, or torch)")
        if not is_aligned(arr, self.alignment):
            # Vectorized kernels assume this alignment; copy rather than risk a crash.
            aligned = aligned_empty(arr.shape, arr.dtype)
            aligned[...] = arr
            arr = aligned
        elif not arr.flags.writeable:  # the kernel only reads it (an appended cache was refused above)
            arr = writeable_alias(arr)
        return arr

    def _prepare(self, given: dict[str, Any]) -> tuple[dict[str, np.ndarray], str | None, dict[str, int]]:
        """NumPy views of the inputs after every check the kernel cannot make, the framework to
        answer in, and the symbolic dims' values."""
        arrays: dict[str, np.ndarray] = {}
        bound: dict[str, int] = {}
        source: dict[str, str] = {}
        framework = None
        for name, shape, dtype in self._inputs:
            arr, fw = _as_numpy(name, given[name], self.device)
            if name == "q":
                framework = fw
            arrays[name] = self._check_array(name, shape, dtype, arr, bound, source)
        if self._index_names:
            self.layout.check_indices(arrays, bound, self.spec)
        return arrays, framework, bound

    def output_shape(self, bound: dict[str, int], dims: tuple | None = None) -> tuple[int, ...]:
        """The output's shape (or that of ``dims``: another output's) once the symbolic dims are
        known."""
        dims = self._out_shape if dims is None else dims
        if self._static:
            return dims
        shape = []
        for d in dims:
            if isinstance(d, str):
                key, plus = _bound_dim(d)
                d = bound[key] + plus
            shape.append(d)
        out = tuple(shape)
        if math.prod(out) > MAX_ELEMENTS:
            raise KernelArgumentError(
                f"o: the output {out} would have {math.prod(out)} elements; the kernel indexes with 32-bit "
                f"ints, so a tensor may hold at most {MAX_ELEMENTS}: split the batch"
            )
        return out

    def _check_out(self, out: Any, inputs: dict[str, Any], shape: tuple[int, ...]) -> np.ndarray:
        """``out`` as a NumPy view after the checks the kernel cannot make itself."""
        oa, _ = _as_numpy("out", out, self.device)
        if tuple(oa.shape) != shape or oa.dtype != self.spec.np_dtype:
            raise KernelArgumentError(
                f"out: expected shape {shape} dtype {self.spec.dtype}, got {tuple(oa.shape)} {oa.dtype}"
            )
        if not oa.flags.c_contiguous or not oa.flags.writeable:
            raise KernelArgumentError(
                f"out: must be a writeable C-contiguous array, got strides {oa.strides}"
                f"{'' if oa.flags.writeable else ' (read-only)'}"
            )
        check_no_overlap(oa, {n: x if isinstance(x, np.ndarray) else _as_numpy(n, x, self.device)[0]
                              for n, x in inputs.items()})
        return oa

    def _trivial(self, arrays: dict[str, Any]) -> bool:
        """No work for the kernel: no query row, or no key at all (every row a zero row; a paged
        ``block_table`` with no column, which the index checks passed, means every sequence is
        empty). A zero-size tensor is answered here, never handed to the kernel."""
        return any(math.prod(a.shape) == 0 for a in arrays.values())  # NumPy arrays or device tensors

    def __call__(self, q: Any, k: Any, v: Any = _NO_ARG, *index: Any, out: Any = None, **kw: Any) -> Any:
        """``o = softmax(q·kᵀ·scale + mask)·v`` in the artifact's layout; with ``out=`` the result
        is written there and ``out`` returned. An artifact built with ``return_lse`` returns
        ``(o, lse)``."""
        if self.layout.latent:  # kernel(q, kv_cache, *index): the third positional is the first index
            data, index = (q, k), (index if v is _NO_ARG else (v, *index))
        elif v is _NO_ARG:
            raise KernelArgumentError(f"missing {self._qkv[2]}: a {self.layout.name} kernel is called as "
                                      f"kernel({', '.join(self._qkv)}, ...)")
        else:
            data = (q, k, v)
        if self._fast:
            if not kw:
                args = (*data, *index)
            elif not index and len(kw) == len(self._index_names):  # index arrays by keyword
                args = (*data, *(kw.get(n, _SLOW) for n in self._index_names))
            else:
                args = ()
            result = self._fast_call(args, out) if args and not any(a is _SLOW for a in args) else _SLOW
            if result is not _SLOW:
                return result
        given, options = self._gather(data, index, kw) if (index or kw or self._index_names) else (dict(zip(self._qkv, data)), None)
        if self.device == "cuda":
            return self._call_cuda(given, out, options)

        arrays, framework, bound = self._prepare(given)
        if options:
            self.layout.check_options(self.spec, options, arrays)
        oshape = self.output_shape(bound)
        if out is None:
            oa = aligned_empty(oshape, self.spec.dtype)
        else:
            user = self._check_out(out, given, oshape)
            # Vectorized stores assume the kernel's alignment: compute into aligned memory and
            # copy when the caller's buffer is not aligned (aligned_empty gives buffers that are).
            oa = user if is_aligned(user, self.alignment) else aligned_empty(user.shape, user.dtype)
        extra = [aligned_empty(self.output_shape(bound, dims), dt) for dims, dt in self._extra_outs]
        if self._trivial(arrays):
            oa[...] = 0
            for x in extra:
                x[...] = -np.inf  # lse of a row that sees no key
        else:
            use_threads(self.num_threads)
            try:
                self.function(*map(kernel_arg, arrays.values()), kernel_arg(oa), *map(kernel_arg, extra))
            except ValueError as e:  # the library's own argument and index checks
                raise KernelArgumentError(str(e).strip()) from None
        if out is None:
            result = _from_framework(framework, oa)
        else:
            if oa is not user:
                user[...] = oa
            result = out
        if extra:
            return (result, *(_from_framework(framework, x) for x in extra))
        return result

    def _fast_call(self, args: tuple, out: Any = None) -> Any:
        """The common call, at a few µs: CPU tensors that are compact and aligned as the kernel
        needs (``self.alignment``: 16 bytes for CPU builds, so NumPy arrays and torch tensors), no
        keyword, no ``lse``, and no ``out=`` or one of the same kind (a NumPy array or torch
        tensor) as compact and aligned, sharing no memory with an input. tvm-ffi's DLPack import
        checks alignment, contiguity and the device; the library checks rank, shapes (``o``'s
        against ``q``'s), dtypes, the agreement of symbolic dims and every index it will read.
        Read-only NumPy inputs the kernel only reads are passed as writeable aliases
        (:func:`writeable_alias`). Anything else — a misaligned or strided input, NumPy
        bfloat16, an empty tensor, a bad argument of any kind — returns ``_SLOW``, and the
        checked path copies what it must or raises the error that names it."""
        import tvm_ffi

        if len(args) != len(self._inputs):
            return _SLOW
        try:
            tensors = [tvm_ffi.from_dlpack(x, require_alignment=self.alignment, require_contiguous=True) for x in args]
        except BufferError:  # NumPy exports no read-only array: alias those the kernel only reads
            args = tuple(writeable_alias(x) if isinstance(x, np.ndarray) and not x.flags.writeable and i not in
                         self._written else x for i, x in enumerate(args))
            try:
                tensors = [tvm_ffi.from_dlpack(x, require_alignment=self.alignment, require_contiguous=True)
                           for x in args]
            except (RuntimeError, TypeError, ValueError, BufferError, AttributeError):
                return _SLOW
        except (RuntimeError, TypeError, ValueError, AttributeError):
            return _SLOW
        for t in tensors:
            n = t.numel()
            if n == 0 or n > MAX_ELEMENTS or t.device.dlpack_device_type() != _DLPACK_CPU:
                return _SLOW
        q = args[0]
        if out is not None:
            if type(out) is not type(q):
                return _SLOW
            try:
                o = tvm_ffi.from_dlpack(out, require_alignment=self.alignment, require_contiguous=True)
                check_no_overlap(out, dict(zip(self._names, args)))
            except (RuntimeError, TypeError, ValueError, BufferError, AttributeError):  # KernelArgumentError too
                return _SLOW
            result = out
        elif isinstance(q, np.ndarray):  # o: q's shape with head_dim_v columns
            o = result = aligned_empty(tuple(tensors[0].shape)[:-1] + (self.spec.v_dim,), self.spec.np_dtype)
        elif type(q).__module__ == "torch":  # torch's CPU allocator aligns to 64
            o = result = sys.modules["torch"].empty(tuple(q.shape)[:-1] + (self.spec.v_dim,), dtype=q.dtype)
        else:
            return _SLOW

        use_threads(self.num_threads)
        try:
            self.function(*tensors, o)
        except (ValueError, TypeError, RuntimeError):  # a bad argument: the checked path names it
            return _SLOW
        return result

    def _cuda_device(self):
        return runtime.cuda_device(0)

    def _cuda_tensor(self, name: str, shape: tuple, x: Any, bound: dict[str, int], source: dict[str, str],
                     dtype: str | None = None):
        """A CUDA DLPack tensor, wrapped without a copy when TVM takes it as it is (compact and
        64-byte aligned), else a compact copy of it (``x.contiguous()``, or ``x.clone()`` for a
        misaligned view); shape (binding its symbolic dims in ``bound``) and dtype (``dtype``,
        default the spec's) checked. Returns (tensor, framework, copied)."""
        import tvm_ffi

        copied = False
        try:
            t = tvm_ffi.from_dlpack(x, require_alignment=self.alignment, require_contiguous=True)
        except (ValueError, RuntimeError, TypeError) as e:
            y = _compact_copy(x)
            if y is None:
                raise KernelArgumentError(
                    f"{name}: {str(e).splitlines()[0]}; pass a contiguous, 64-byte-aligned tensor (this "
                    f"{type(x).__name__} has no contiguous()/clone() to copy it)") from None
            t, copied = tvm_ffi.from_dlpack(y, require_alignment=self.alignment, require_contiguous=True), True
        self._bind_dims(name, shape, tuple(t.shape), bound, source)
        dtype = dtype or self.spec.dtype
        if str(t.dtype) != dtype:
            raise KernelArgumentError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        return t, type(x).__module__.split(".")[0], copied

    def _cuda_stream(self, framework: str | None):
        """The stream the kernel runs on: a torch caller's current stream (its work on a side
        stream is then ordered with the kernel, as torch's own ops are); TVM's default otherwise."""
        torch = sys.modules.get("torch") if framework == "torch" else None
        if torch is not None and torch.cuda.is_available():
            import tvm_ffi

            return tvm_ffi.use_torch_stream()
        return contextlib.nullcontext()

    def _skips_host_reads(self, options: dict[str, Any] | None) -> bool:
        """Whether a call may pass GPU-resident index arrays unread (no host check, no sync): the
        library checks them on the device (``spec.device_checks``), every index argument is one
        its check kernel covers (or one no rule reads: ALiBi slopes, sinks), and no keyword
        needs them here (``max_seqlen_q``/``max_seqlen_k`` are checked against cu_seqlens)."""
        if not self._device_checks:
            return False
        if any(options.get(k) is not None for k in ("max_seqlen_q", "max_seqlen_k")) if options else False:
            return False
        return all(n in _DEVICE_CHECKED for n in self._index_names)

    def _check_index_error(self, err: Any, framework: str | None) -> None:
        """Read the call's ``index_error`` (one 4-byte copy, after the kernels: it waits for the
        stream) and raise :class:`KernelArgumentError` naming each broken rule's argument."""
        torch = sys.modules.get("torch") if framework == "torch" else None
        if torch is not None and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the kernels ran on the caller's stream
        mask = int(runtime.to_numpy(err, np.dtype(np.int32))[0])
        if mask:
            raise KernelArgumentError(describe_index_error(mask))

    def _call_cuda(self, given: dict[str, Any], out: Any = None, options: dict[str, Any] | None = None) -> Any:
        """CPU inputs are copied to GPU 0 and the result copied back; CUDA DLPack tensors are
        used in place and the result stays on the GPU. ``out`` (a CUDA tensor, or a CPU array)
        receives the result. CUDA builds take BHSD (static, or with symbolic batch and lengths),
        varlen, kvcache and paged: the dims are bound from the tensors; the index arrays
        (``cu_seqlens_q/k``, ``cache_seqlens``, ``block_table``), which device code cannot
        check, are checked here by the layout's rules, read back from the GPU when given there
        (a copy of a few ints, which waits for the stream); a call with no work (an empty
        tensor) is answered without a launch (a grid of zero blocks is a launch error), and a
        batch past the grid's limit is refused by name. A library built with device-side index
        checks (``spec.device_checks``) takes ``index_error`` last, read back after the launch
        (:meth:`_check_index_error`); its GPU-resident index arrays are then not read here
        (:meth:`_skips_host_reads`)."""
        dev = self._cuda_device()
        args, framework, on_gpu = [], None, False
        bound: dict[str, int] = {}
        source: dict[str, str] = {}
        host: dict[str, np.ndarray] = {}  # what the layout's checks read
        unread: dict[str, tuple[Any, np.dtype]] = {}  # GPU-resident index arrays, read only if checked here
        for i, (name, shape, dtype) in enumerate(self._inputs):
            x = given[name]
            if hasattr(x, "__dlpack_device__") and int(x.__dlpack_device__()[0]) == _DLPACK_CUDA:
                t, fw, _ = self._cuda_tensor(name, shape, x, bound, source, dtype.name)
                on_gpu = True
                # index arrays read back for the checks; the others by shape only (no copy)
                if name in self._index_names:
                    unread[name] = (t, dtype)
                else:
                    host[name] = np.broadcast_to(np.zeros((), dtype), tuple(t.shape))
            else:
                arr, fw = _as_numpy(name, x, self.device)
                arr = self._check_array(name, shape, dtype, arr, bound, source)
                host[name] = arr
                t = runtime.to_device(arr, dev)
            framework = framework if i else fw
            args.append(t)
        # answered without a launch: a grid of zero blocks is a launch error
        empty = self._trivial(dict(zip((n for n, _, _ in self._inputs), args)))
        # an empty call never reaches the device checks: its arrays are checked here
        if not unread or empty or not self._skips_host_reads(options):
            host.update({n: runtime.to_numpy(t, dt) for n, (t, dt) in unread.items()})
            unread = {}
        if self._index_names and not unread:
            self.layout.check_indices(host, bound, self.spec)
        if options:
            self.layout.check_options(self.spec, options, host)
        oshape = self.output_shape(bound)
        check_cuda_grid(self.spec, bound)
        # the log-sum-exp (``return_lse``): -inf where a row sees no key, so for an empty call
        extra = [runtime.to_device(np.full(self.output_shape(bound, dims), -np.inf, np.dtype(dt)), dev)
                 for dims, dt in self._extra_outs]
        # the device checks' flag: the kernel always writes it (no clearing needed)
        flag = [runtime.empty((1,), "int32", dev)] if self._device_checks else []
        if out is not None and hasattr(out, "__dlpack_device__") and int(out.__dlpack_device__()[0]) == _DLPACK_CUDA:
            check_no_overlap(out, given)
            o, fw, copied = self._cuda_tensor("out", oshape, out, {}, {})
            if empty:
                if hasattr(out, "zero_"):
                    out.zero_()
                else:
                    out[...] = 0
            else:
                with self._cuda_stream(fw):
                    self.function(*args, o, *extra, *flag)
                    if copied:  # a misaligned or strided out: computed aside, written back
                        out.copy_(_from_framework(fw, o))
                if flag:  # non-zero: out is undefined (the kernels did nothing)
                    self._check_index_error(flag[0], fw)
            return (out, *(_from_framework(fw, x) for x in extra)) if extra else out
        user = self._check_out(out, given, oshape) if out is not None else None
        if empty:
            o = runtime.to_device(np.zeros(oshape, self.spec.np_dtype), dev)
        else:
            o = runtime.empty(oshape, self.spec.dtype, dev)
            with self._cuda_stream(framework if on_gpu else None):
                self.function(*args, o, *extra, *flag)
            if flag:
                self._check_index_error(flag[0], framework if on_gpu else None)
        if on_gpu:
            lse = [_from_framework(framework, x) for x in extra]
        else:
            lse = [_from_framework(framework, runtime.to_numpy(x, np.dtype(dt)))
                   for x, (_, dt) in zip(extra, self._extra_outs)]
        if user is not None:
            user[...] = runtime.to_numpy(o, self.spec.np_dtype)
            result = out
        elif on_gpu:
            result = _from_framework(framework, o)
        else:
            result = _from_framework(framework, runtime.to_numpy(o, self.spec.np_dtype))
        return (result, *lse) if lse else result


#: index arguments a device-checked library validates itself (``layouts.INDEX_ERROR_BITS``), or
#: that no rule reads (float per-head values)
_DEVICE_CHECKED = frozenset(name for name, _ in INDEX_ERROR_BITS.values()) | {"alibi_slopes", "sinks",
                                                                                "custom_mask"}


#: ``workloads.fused_cuda.MAX_GRID_YZ`` (this module loads without TVM): a symbolic BHSD CUDA
#: build's grid is (row tiles, heads, batch) on (x, y, z), so the batch is bounded by gridDim.z
#: here (varlen's grid is (tile slots, heads)), and the build refuses more heads
#: (``fused_cuda.grid_refusal``)
MAX_GRID_YZ = 65535


def check_cuda_grid(spec: AttentionSpec, bound: dict[str, int]) -> None:
    """Refuse by name a call whose grid CUDA cannot launch (a symbolic batch past gridDim.z),
    instead of the driver's launch error."""
    if not spec.layout_info.packed and spec.dynamic and bound.get("batch", 0) > MAX_GRID_YZ:
        raise KernelArgumentError(
            f"batch={bound['batch']}: a symbolic CUDA kernel launches one grid layer per sequence, at most "
            f"{MAX_GRID_YZ} (gridDim.z); split the batch")


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: no manifest (is {directory} an artifact directory?)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: a manifest is a JSON object, got a {type(manifest).__name__}")
    version = manifest.get("manifest_version")
    if version not in SUPPORTED_MANIFEST_VERSIONS:
        raise ArtifactError(
            f"{path}: manifest_version {version!r} not supported (supported: {SUPPORTED_MANIFEST_VERSIONS})"
        )
    for key in ("entry", "library", "spec", "args"):
        if key not in manifest:
            raise ArtifactError(f"{path}: manifest has no {key!r}")
    return manifest


def library_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_artifact(directory: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    """The library path, after checking it: a file name inside ``directory`` that exists and
    matches the manifest's digest; the runtime libraries and CUDA binary it lists match theirs
    (a runtime library may be absent when the process already holds it: ``runtime``); the
    manifest's ``args`` are what its spec says. Raises :class:`ArtifactError`."""
    name = manifest["library"]
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise ArtifactError(
            f"{Path(directory) / MANIFEST}: library {name!r} must be a file name inside the artifact directory "
            "(an artifact never loads code from elsewhere)")
    lib = Path(directory) / name
    if lib.is_symlink():
        raise ArtifactError(f"{lib}: a symbolic link; an artifact loads code only from regular files inside its "
                            "folder, never from where a link points")
    if not lib.is_file():
        raise ArtifactError(f"{lib}: shared library missing")
    if manifest["entry"] != ENTRY:  # e.g. the library's other function: it loads, then every call fails
        raise ArtifactError(
            f"{Path(directory) / MANIFEST}: entry {manifest['entry']!r} is not the attention function: every "
            f"tvm-attention library exports its kernel as {ENTRY!r} (its other function, "
            f"{AttentionSpec.SPEC_FUNCTION}, takes no tensor)")
    want = manifest.get("library_sha256")
    if want is None:
        warnings.warn(f"{directory}: manifest has no library_sha256 (built before tvm-attention recorded "
                      "it): cannot check that the library belongs to this manifest", RuntimeWarning, stacklevel=3)
    elif library_digest(lib) != want:
        raise ArtifactError(
            f"{lib}: SHA-256 does not match the manifest's library_sha256: the library and the manifest come "
            "from different builds (rebuild the artifact)"
        )
    for entry in runtime_entries(directory, manifest):
        path = Path(directory) / entry["file"]
        if path.is_symlink():
            raise ArtifactError(f"{path}: a symbolic link; an artifact loads code only from regular files inside its "
                                "folder, never from where a link points")
        if path.is_file() and library_digest(path) != entry["sha256"]:
            raise ArtifactError(f"{path}: SHA-256 does not match the manifest's runtime_libraries entry")
    binary = manifest.get("kernel_binary")
    if binary is not None:
        path = Path(directory) / binary["file"]
        if Path(binary["file"]).name != binary["file"] or path.is_symlink() or not path.is_file():
            raise ArtifactError(f"{path}: the CUDA binary the manifest names is missing")
        if library_digest(path) != binary["sha256"]:
            raise ArtifactError(f"{path}: SHA-256 does not match the manifest's kernel_binary")
    spec = AttentionSpec.from_dict(manifest["spec"])
    if manifest["args"] != spec.arg_specs():
        raise ArtifactError(
            f"{Path(directory) / MANIFEST}: args {manifest['args']} disagree with its spec, which gives "
            f"{spec.arg_specs()}"
        )
    return lib


def runtime_entries(directory: str | os.PathLike, manifest: dict[str, Any]) -> list[dict[str, str]]:
    """The manifest's ``runtime_libraries`` (``[{file, sha256}]``; [] when absent: an artifact
    from before they were carried), each checked to be a file name inside the artifact folder
    with a digest. Raises :class:`ArtifactError` naming what is malformed."""
    where = Path(directory) / MANIFEST
    entries = manifest.get("runtime_libraries", [])
    if not isinstance(entries, list):
        raise ArtifactError(f"{where}: runtime_libraries must be a list of {{file, sha256}}, got "
                            f"{type(entries).__name__}")
    for entry in entries:
        if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("sha256"), str)):
            raise ArtifactError(f"{where}: runtime_libraries entry {entry!r} is not {{file, sha256}}")
        if not entry["file"] or Path(entry["file"]).name != entry["file"] or entry["file"] in (".", ".."):
            raise ArtifactError(f"{where}: runtime library {entry['file']!r} must be a file name inside the artifact "
                                "directory")
    return entries


def check_library_spec(directory: str | os.PathLike, module: Any, manifest: dict[str, Any]) -> None:
    """Raise :class:`ArtifactError` when the library's own ``attention_spec_hash()`` disagrees
    with the manifest's spec (an edited manifest would describe a kernel that computes something
    else: another scale, causal where it is not). A library from before the function existed
    (no ``spec_hash`` in its manifest) is let through with a warning."""
    spec = AttentionSpec.from_dict(manifest["spec"])
    try:
        function = module.get_function(spec.SPEC_FUNCTION, query_imports=True)
    except (AttributeError, KeyError, RuntimeError):
        function = None
    if function is None:
        if "spec_hash" in manifest:
            raise ArtifactError(f"{directory}: the library has no {spec.SPEC_FUNCTION}() to confirm its spec")
        warnings.warn(f"{directory}: library built before tvm-attention libraries described themselves: cannot "
                      "check that the manifest's spec is what it computes", RuntimeWarning, stacklevel=3)
        return
    have = int(function())
    if have != spec.fingerprint():
        raise ArtifactError(
            f"{Path(directory) / MANIFEST}: its spec ({spec.short_name()}, scale {spec.scale!r}) is not the one "
            f"the library was built from ({spec.SPEC_FUNCTION}() = {have}, this spec hashes to "
            f"{spec.fingerprint()}): the manifest was edited or belongs to another build; rebuild the artifact"
        )


def confirm_spec(directory: str | os.PathLike, manifest: dict[str, Any], lib: Path) -> str:
    """For ``inspect``: load the library where this machine can (a CPU artifact whose features
    this CPU has; a CUDA one with a GPU) and check its spec (:func:`check_library_spec`, which
    raises). Returns a line saying what was checked, or why nothing was."""
    if manifest.get("target", {}).get("kind") == "cuda":
        from .target import local_cuda_arch  # inspect: the compiler is installed

        if local_cuda_arch() is None:
            return "not checked (a CUDA library loads only on a machine with a GPU)"
    else:
        missing = missing_features(manifest.get("cpu_features") or [])
        if missing:
            return f"not checked (this CPU lacks {', '.join(missing)})"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_library_spec(directory, load_module(directory, manifest, lib), manifest)
    if caught:
        return f"not checked ({caught[0].message})"
    return f"confirmed by the library's {AttentionSpec.SPEC_FUNCTION}()"


def check_cpu_features(directory: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Raise :class:`ArtifactError` naming the features a CPU artifact needs and this host lacks
    (loading and calling it would SIGILL)."""
    required = manifest.get("cpu_features")
    if required is None:
        warnings.warn(f"{directory}: manifest has no cpu_features (built before tvm-attention recorded them): "
                      "cannot check that this CPU runs its code", RuntimeWarning, stacklevel=3)
        return
    missing = missing_features(required)
    if missing:
        mcpu = manifest.get("target", {}).get("mcpu", "?")
        raise ArtifactError(
            f"{directory}: built for mcpu={mcpu}, its code needs CPU features {', '.join(missing)}, which "
            f"{describe_host()} lacks; rebuild it here (tvm-attention build ...) or run it on a CPU that has them"
        )


def load_module(directory: str | os.PathLike, manifest: dict[str, Any], lib: Path) -> Any:
    """The artifact's library as a tvm-ffi module, with TVM's runtime loaded first: the copy the
    artifact carries (``runtime_libraries``), or the one this process already holds. An artifact
    from before they were carried needs the installed ``apache-tvm``'s."""
    entries = runtime_entries(directory, manifest)
    names = [e["file"] for e in entries]
    if not names:  # an older artifact: the compiler's runtime
        try:
            import tvm  # noqa: F401 - loads libtvm_runtime (and the CUDA runtime, where built with it)
        except ImportError:
            raise ArtifactError(f"{directory}: built before artifacts carried TVM's runtime; rebuild it, or install "
                                "apache-tvm to load it") from None
    try:
        rt = runtime.ensure_runtime(directory, names or [runtime.RUNTIME_CPU], {e["file"]: e["sha256"] for e in entries})
        binary = manifest.get("kernel_binary")
        if binary is not None:  # a CUDA kernel compiled offline: no JIT (the bytes checked are those used)
            runtime.provide_cuda_binary(binary["source_sha256"], runtime.read_code(
                Path(directory) / binary["file"], binary["sha256"], "the manifest's kernel_binary"))
        return runtime.load_library(lib, rt, manifest.get("library_sha256"))
    except runtime.RuntimeLoadError as e:
        raise ArtifactError(str(e)) from None


def load(directory: str | os.PathLike, num_threads: int | None = None) -> AttentionKernel:
    """Load an artifact directory written by ``tvm-attention build``. Needs ``tvm_ffi`` and
    NumPy, not ``tvm``: the artifact carries the parts of TVM's runtime its library calls.

    ``num_threads``: CPU threads the kernel runs on, applied in whichever thread calls it
    (default: ``TVM_NUM_THREADS`` if set, else every core available to this process).
    """
    manifest = read_manifest(directory)
    lib = check_artifact(directory, manifest)
    spec = AttentionSpec.from_dict(manifest["spec"])
    device = "cuda" if manifest.get("target", {}).get("kind") == "cuda" else "cpu"
    if device == "cpu":
        check_cpu_features(directory, manifest)
    try:
        module = load_module(directory, manifest, lib)
        problem = None if device == "cpu" or runtime.cuda_arch() is not None else "no device found"
    except ArtifactError as e:
        if device == "cpu":
            raise
        problem = str(e)  # no CUDA driver or runtime on this machine
    if problem is not None:
        raise ArtifactError(
            f"{directory}: a CUDA artifact ({manifest['target'].get('arch')}); this machine has no "
            f"CUDA device TVM can use ({problem})"
        )
    try:
        function = module[manifest["entry"]]
    except (AttributeError, KeyError, RuntimeError):
        raise ArtifactError(f"{lib}: has no function {manifest['entry']!r} (the manifest's entry)") from None
    check_library_spec(directory, module, manifest)
    kernel = AttentionKernel(spec, function, manifest, device=device, num_threads=num_threads)
    if device == "cpu":
        set_num_threads(kernel.num_threads)  # warns now if the pool cannot have that many
    return kernel
