"""The fused attention backward on the CPU (issue 46): BHSD and varlen, float32 and bfloat16,
static and symbolic shapes. The TensorIR is ``workloads/backward.py``'s; this module is its
interface: knobs, checks, the built kernel.

FlashAttention-2's scheme. The forward saves ``lse``; the backward recomputes each score tile
from Q and K, ``P = exp(T − lse)`` for the final score ``T``, and never holds more than a
``block_m × block_n`` tile of it (the audit proves it, as for the forward). One PrimFunc, two
parallel phases, each task writing its own rows (no atomics):

1. **dK, dV**, one task per (sequence, kv head, key tile; varlen: a tile slot): over every query head of the group and
   every query tile that can see the key tile, ``dV += Pᵀ·dO``, ``dP = dO·Vᵀ``, ``dS = P ∘ (dP −
   delta) ∘ T'(X)``, ``dK += dSᵀ·Q·scale`` (GQA's sum over the group happens in the task);
2. **dQ**, by one of the issue's two strategies (``BackwardKnobs.dq_chunks``): a second pass, one
   task per (sequence, head, query tile; varlen: a tile slot), over every key tile it can see,
   the same ``dS`` again, ``dQ += dS·K·scale``; or (the preset) per-chunk partial sums: the
   dK/dV phase runs as chunks, each adding ``dS·K`` into its own dQ partials, summed at the end
   (20–27 % faster: no ``S`` and ``dP`` recomputed).

``delta = rowsum(dO ∘ O)`` is recomputed per query tile where a phase needs it: 2·Dv FLOP per row
against the tile's 4·block_n·D, no workspace. ``T'(X)`` is the softcap's ``1 − tanh²(X / c)`` (1
without one). Which keys a row sees comes from :class:`~tvm_attention.visibility.Visibility`, as
everywhere; a row that sees no key (``lse = −inf``) takes no gradient. The semantics are
``reference_attention_backward``'s. ALiBi subtracts its constant in ``T``; with sinks each row's
denominator takes the sink (``row_lse``) and a third phase sums ``dsink_h = −Σ p_sink·delta``.
``kv_start`` hides each sequence's keys before it (the dQ phase starts its key tiles there).
Key bounds, a custom mask, ``mask_mod`` and ``score_mod`` are the forward's own hooks
(``workloads/variants.py``) over the same arguments, evaluated per score (no tile is skipped by
them); ``score_mod``'s derivative is :mod:`tvm_attention.modifier_grad`'s. What it does not build
yet (the KV-cache layouts, float16, varlen with ``kv_start``) is refused by name.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import SpecError
from .spec import AttentionSpec
from .visibility import Visibility

#: query rows whose score products share each K/V tile row load (4 rows × block_n 32: 8 vector
#: accumulators); block_m and block_m_dq must be multiples of it
PRODUCT_ROWS = 4
#: the layouts it builds: BHSD and FlashAttention's varlen (packed sequences, cu_seqlens)
LAYOUTS = ("bhsd", "varlen")
#: the input and gradient dtypes it builds (float32 arithmetic; bf16 gradients rounded once, at the store)
DTYPES = ("float32", "bfloat16")
#: the variants this step's kernel takes
SUPPORTED_VARIANTS = ("window", "softcap", "alibi", "sinks", "kv_start", "key_bounds", "custom_mask", "mask_mod",
                      "score_mod")


@dataclasses.dataclass(frozen=True)
class BackwardKnobs:
    #: query rows per tile: a dK/dV task reads its Q/dO rows this many at a time; 32 keeps the
    #: tile's three score-sized locals (S, P, dS: 3·32·64 floats, 24 KiB) in L1 beside Q's rows
    #: (64 measured the same)
    block_m: int = 32
    #: keys per tile, and so per dK/dV task: its dK and dV accumulators (block_n × D each) live in
    #: local scope for the whole task. 64: each Q/dO row load feeds twice the FMAs of 32; 7 %
    #: faster than 32 and 20–35 % faster than 128, whose accumulators spill (B1 H8 S2k, D 64 and
    #: 128, causal and not, 2 Zen 4 threads)
    block_n: int = 64
    #: query rows per dQ task: each key tile it visits is transposed for the score rows, so more
    #: rows share that cost (128: 3–5 % faster than 64 at S2k; dQ accumulators of 128 × D)
    block_m_dq: int = 128
    #: the dQ strategy: 0, a second pass over query tiles (recomputing S and dP); N > 0, the
    #: dK/dV phase as N parallel chunks each adding dS·K into its own dQ partials, summed at the
    #: end (a workspace of N × dQ's elements, float32, the call allocates)
    dq_chunks: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_m_dq"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise SpecError(f"backward knobs: {name} must be a positive int, got {x!r}")
        if isinstance(self.dq_chunks, bool) or not isinstance(self.dq_chunks, int) or self.dq_chunks < 0:
            raise SpecError(f"backward knobs: dq_chunks must be an int >= 0 (0: the second pass), got {self.dq_chunks!r}")
        for name in ("block_m", "block_m_dq"):
            if getattr(self, name) % PRODUCT_ROWS:
                raise SpecError(f"backward knobs: {name}={getattr(self, name)} must be a multiple of {PRODUCT_ROWS} "
                                "(the rows whose products share a K/V row load)")


#: the most chunks the preset takes: each holds a dQ-sized workspace (B·H·Sq·D floats), so a
#: CPU with more cores than this keeps the second pass (which needs none) unless asked
MAX_PRESET_CHUNKS = 8


def default_knobs(spec: AttentionSpec) -> BackwardKnobs:
    """The preset: :class:`BackwardKnobs`' tiles, and the chunked dQ with one chunk per
    core this process may use (at least 2; B1 H8 S2k, 2 Zen 4 threads: 20–27 % faster than the
    second pass, D 64 and 128, causal and not; 4 chunks measured the same, 8 up to 10 % slower).
    Fewer chunks than cores would idle cores in the dK/dV phase, more cost memory: past
    :data:`MAX_PRESET_CHUNKS` cores the preset is the second pass."""
    from .hostcpu import available_cores  # affinity-aware

    cores = max(2, available_cores())
    return BackwardKnobs(dq_chunks=cores if cores <= MAX_PRESET_CHUNKS else 0)


def check_spec(spec: AttentionSpec) -> None:
    """Refuse, by name, what this step's kernel does not build."""
    if spec.layout not in LAYOUTS:
        raise SpecError(f"backward: layout {spec.layout!r} is not built yet ({', '.join(LAYOUTS)})")
    if spec.layout == "varlen" and spec.kv_start:
        raise SpecError("backward: varlen takes no kv_start (its sequences hold no padding)")
    if spec.dtype not in DTYPES:
        raise SpecError(f"backward: dtype {spec.dtype} is not built yet ({', '.join(DTYPES)})")
    other = [v for v in spec.variants if v not in SUPPORTED_VARIANTS]
    if other:
        raise SpecError(f"backward: {', '.join(other)} not built yet (this step takes {', '.join(SUPPORTED_VARIANTS)})")
    _check_score_mod(spec)


def _check_score_mod(spec: AttentionSpec) -> None:
    """A ``score_mod`` with a step in it is refused by name before any TIR is made (its derivative
    is 0 or undefined: ``modifier_grad``)."""
    if spec.score_mod is not None:
        from .modifier_grad import score_derivative  # NumPy here: no TVM

        tensors = {n: np.zeros((1,) * len(dims), dtype) for n, dtype, dims in spec.mod_tensors}
        with np.errstate(all="ignore"):
            score_derivative(spec.score_mod, tensors)(np.zeros(2), 0, 0, np.arange(2), np.arange(2))


#: the CUDA backward (``workloads/backward_mma.py``, tensor cores): what it builds so far
CUDA_LAYOUTS = ("bhsd", "varlen")
CUDA_DTYPES = ("float16", "bfloat16")
#: its scratch arguments, allocated by the call (not returned): the dQ accumulator and delta
CUDA_WORKSPACES = ("dq_accum", "delta")


@dataclasses.dataclass(frozen=True)
class CudaBackwardKnobs:
    #: warps per thread block, 16 keys each (``block_n = 16·warps``): a warp's dK and dV
    #: accumulators (head_dim / 2 and head_dim_v / 2 registers a lane) stay in registers for the
    #: whole block
    warps: int = 4
    #: query rows per tile: the score fragments Sᵀ and dPᵀ (block_m / 2 registers a lane each)
    #: beside them; 32 at head_dim 128 (ptxas: 248-251 registers, no spill; 64 took all 255)
    block_m: int = 64

    def __post_init__(self) -> None:
        for name in ("warps", "block_m"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise SpecError(f"CUDA backward knobs: {name} must be a positive int, got {x!r}")
        if self.block_m % 16 or self.warps % (self.block_m // 16):
            raise SpecError(f"CUDA backward knobs: block_m={self.block_m} must be a multiple of 16 whose row groups "
                            f"({self.block_m // 16}) divide warps={self.warps} (the dQ product's warps)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def cuda_knobs(spec: AttentionSpec) -> CudaBackwardKnobs:
    """The CUDA backward's preset: 4 warps (64 keys a block), query tiles of 64 rows up to
    head_dim 64 and of 32 beyond (registers: above)."""
    return CudaBackwardKnobs(warps=4, block_m=64 if max(spec.head_dim, spec.v_dim) <= 64 else 32)


def check_cuda_spec(spec: AttentionSpec) -> None:
    """Refuse, by name, what the CUDA backward does not build (yet)."""
    if spec.layout not in CUDA_LAYOUTS:
        raise SpecError(f"backward on CUDA: layout {spec.layout!r} is not built ({', '.join(CUDA_LAYOUTS)})")
    if spec.dtype not in CUDA_DTYPES:
        raise SpecError(f"backward on CUDA: dtype {spec.dtype} is not built ({', '.join(CUDA_DTYPES)}: tensor cores)")
    other = [v for v in spec.variants if v not in SUPPORTED_VARIANTS]
    if other:
        raise SpecError(f"backward on CUDA: {', '.join(other)} not built (it takes {', '.join(SUPPORTED_VARIANTS)})")
    _check_score_mod(spec)
    for name, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.v_dim)):
        if d % 16 or d > 128:
            raise SpecError(f"backward on CUDA: {name}={d} must be a multiple of 16 up to 128 (its accumulators "
                            "stay in registers)")


def backward_target(target: Any = "llvm", cuda: bool = False):
    """``target`` resolved (:func:`~tvm_attention.target.resolve_target`), refused by name
    (:class:`~tvm_attention.target.TargetError`) unless it is an LLVM (CPU) target, or with
    ``cuda`` a CUDA one (``build_backward``'s: the tensor-core backward; its tuning search is the
    CPU kernel's alone). The kind a caller names is refused before it is resolved (a bare
    ``"cuda"`` would look for a GPU first)."""
    from tvm.target import Target  # the compiler's side

    from .target import TargetError, resolve_target  # the compiler's side (imports TVM)

    if isinstance(target, Target):
        named = target.kind.name
    elif isinstance(target, Mapping):
        named = target.get("kind")
    elif isinstance(target, str) and target.strip().startswith("{"):
        try:
            named = json.loads(target).get("kind")
        except (ValueError, AttributeError):  # not a JSON object: resolve_target names what is wrong
            named = None
    else:
        named = target.strip() if isinstance(target, str) else None
    if cuda and named == "cuda":
        return target if isinstance(target, Target) else resolve_target(target)
    resolved = resolve_target(target) if named in (None, "llvm", "cpu", "host") else None
    kind = named if resolved is None else resolved.kind.name
    if kind != "llvm":
        if cuda:
            raise TargetError(f"backward: target kind {kind!r} is not built: llvm (the CPU backward: 'llvm' for "
                              "this CPU, or a JSON llvm target naming its mcpu) or cuda (tensor cores, with its arch)")
        raise TargetError(f"backward: target kind {kind!r} is not built: the backward is a CPU kernel (llvm "
                          "targets only: 'llvm' for this CPU, or a JSON llvm target naming its mcpu)")
    return resolved


def backward_func(spec: AttentionSpec, knobs: BackwardKnobs | None = None, grad_tensors: tuple[str, ...] = ()):
    """The PrimFunc of ``spec``'s backward with ``knobs`` (``workloads.backward.backward_func``:
    its parameters, in call order, and their layouts); ``grad_tensors``: float32 tensors of the
    spec's ``score_mod`` whose gradients it computes too."""
    from .reference import _check_grad_tensors  # the oracle's rule: NumPy only
    from .workloads.backward import backward_func as tir  # the compiler's side (imports TVM)

    check_spec(spec)
    _check_grad_tensors(spec, grad_tensors)
    kn = knobs or default_knobs(spec)
    return tir(spec, kn.block_m, kn.block_n, kn.block_m_dq, PRODUCT_ROWS, tuple(grad_tensors), kn.dq_chunks)


#: the backward's template buffers' argument names (the others are named as the arguments)
_ARG_NAMES = {"Q": "q", "K": "k", "V": "v", "O": "o", "LSE": "lse", "DO": "do", "SL": "alibi_slopes", "SK": "sinks",
              "KST": "kv_start", "CQ": "cu_seqlens_q", "CK": "cu_seqlens_k", "DQ": "dq", "DK": "dk", "DV_": "dv",
              "DSK": "dsinks"}
#: the outputs, in call order
OUTPUTS = ("dq", "dk", "dv", "dsinks")
#: the library's entry function
ENTRY = "attention_backward"
#: the chunked dQ strategy's scratch argument (``dq_chunks``): allocated by the call, not returned
WORKSPACE = "dq_workspace"
#: the suffix of a differentiated tensor's output, ``d_<name>_partials (H, elements)``: each query
#: head's share, summed by the caller (the kernel call sums them: ``d_<name>`` of the tensor's shape)
PARTIALS = "_partials"


@dataclasses.dataclass
class BackwardKernel:
    """A built backward: ``kernel(q, k, v, o, lse, do, **variant_args) -> (dq, dk, dv[, dsinks])``
    on NumPy arrays (the layout's, C-contiguous; varlen's ``cu_seqlens_q``/``cu_seqlens_k`` among
    the variant arguments), with its lowered IR's audit. ``args``: each parameter's
    ``(name, shape, dtype)`` in call order, outputs last."""

    spec: AttentionSpec
    knobs: BackwardKnobs
    module: Any
    report: Any  # the audit's report (a loaded artifact: its manifest's verdict)
    args: tuple
    lowered: Any = None  # the final lowered module (None: loaded from an artifact)
    target: Any = None
    #: the shared library ``module`` was loaded from (a build this host runs: written once, then
    #: called, validated and exported, copied, from it); None: loaded from an artifact, or built
    #: for a CPU this host lacks (``module`` is then the module as built, never run)
    library: str | None = None
    #: a CUDA build's ptxas report (``cuda_tools.ptxas_report``; or why there is none)
    resources: dict | None = None
    #: where it runs: "cpu", or "cuda" (a CUDA build, or a loaded CUDA artifact: torch CUDA tensors)
    device: str = "cpu"

    def __call__(self, q, k, v, o, lse, do, **variant_args):
        """``(dq, dk, dv)``, and ``dsinks (H,)`` last with sinks. ``variant_args`` where the spec
        takes them, as the forward's: ``alibi_slopes``/``sinks (H,)`` float32, ``kv_start (B,)``
        int32 (any value: keys before it are hidden), ``key_lo``/``key_hi (B, Skv)`` int32,
        ``custom_mask``/``mask_indptr`` (the packed bits, ``tvm_attention.masks.pack_mask``), the
        modifiers' tensors by name."""
        from .loader import ALIGNMENT, aligned_empty  # the runtime's side: no compiler
        from .runtime import cpu_view  # bf16 arrays through their bits

        given = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do, **variant_args}
        if self.device == "cuda":
            return self._call_cuda(given)
        takes = {n for n, _, _ in self.args}
        stray = sorted(n for n, a in given.items() if n not in takes and a is not None)
        if stray:
            raise SpecError(f"backward: this spec takes no {', '.join(stray)}")
        arrays, outs, bound = [], [], {}
        for name, shape, dtype in self.args:
            if name in OUTPUTS:
                outs.append((name, aligned_empty(tuple(bound.get(x, x) for x in shape), dtype)))
                continue
            if name.endswith(PARTIALS):  # (H, the tensor's elements): each query head's share
                outs.append((name, aligned_empty((shape[0], np.asarray(given[name[2:-len(PARTIALS)]]).size), dtype)))
                continue
            if name == WORKSPACE or name in CUDA_WORKSPACES:  # scratch (the chunked dQ's partials...): not returned
                outs.append((name, aligned_empty(tuple(bound.get(x, x) for x in shape), dtype)))
                continue
            a = given.get(name)
            if a is None:
                raise SpecError(f"backward: missing {name} ({dtype} {shape})")
            a = np.asarray(a)
            # a symbolic dim is bound by the first array that has it, and must agree after
            want = tuple(bound.setdefault(x, n) if isinstance(x, str) else x for x, n in zip(shape, a.shape))
            if a.ndim != len(shape) or a.shape != want or a.dtype != dtype:
                raise SpecError(f"backward: {name} must be {dtype} {tuple(bound.get(x, x) for x in shape)}, got "
                                f"{a.dtype} {a.shape}")
            a = np.ascontiguousarray(a)
            if a.ctypes.data % ALIGNMENT:  # the kernels assume 64-byte-aligned data: a copy that is
                a = _aligned_copy(a, aligned_empty)
            arrays.append(a)
        self._check_indices({n: np.asarray(a) for n, a in given.items() if a is not None}, bound)
        if any(a.size == 0 for a in arrays[:6]):  # no query row or no key: every gradient is zero
            for _, x in outs:  # (the forward answers such calls itself too: nothing for the kernel)
                x[...] = 0
        else:
            self.module[ENTRY](*(cpu_view(a) for a in arrays), *(cpu_view(x) for _, x in outs))
        fixed = [x for n, x in outs if n in OUTPUTS]
        tensor_grads = [x.sum(axis=0).reshape(np.shape(given[n[2:-len(PARTIALS)]])) for n, x in outs
                        if n.endswith(PARTIALS)]
        return tuple(fixed + tensor_grads)


    def _call_cuda(self, given: dict) -> tuple:
        """A CUDA build's call: torch CUDA tensors of the spec's shapes and dtypes (contiguous),
        its outputs and scratch allocated by torch on their device, the kernels on torch's
        current stream. ``(dq, dk, dv)`` as torch tensors."""
        import sys

        import tvm_ffi  # the runtime's side

        torch = sys.modules.get("torch")
        stray = sorted(n for n, a in given.items() if n not in {x for x, _, _ in self.args} and a is not None)
        if stray:
            raise SpecError(f"backward: this spec takes no {', '.join(stray)}")
        tensors, outs, bound, device = [], [], {}, None
        for name, shape, dtype in self.args:
            want = np.dtype(dtype).name if dtype != "bfloat16" else "bfloat16"
            if name.endswith(PARTIALS):  # (H, the tensor's elements): each query head's share
                outs.append((name, torch.empty((shape[0], given[name[2:-len(PARTIALS)]].numel()), device=device,
                                               dtype=torch.float32)))
                continue
            if name in OUTPUTS or name in CUDA_WORKSPACES:
                outs.append((name, torch.empty(tuple(bound.get(x, x) for x in shape), device=device,
                                               dtype=getattr(torch, want))))
                continue
            a = given.get(name)
            if a is None:
                raise SpecError(f"backward: missing {name} ({want} {shape})")
            if torch is None or not isinstance(a, torch.Tensor) or a.device.type != "cuda":
                raise SpecError(f"backward: {name}: a CUDA build takes torch CUDA tensors, got {type(a).__name__}"
                                + (f" on {a.device}" if hasattr(a, "device") else ""))
            device = device or a.device
            dims = tuple(bound.setdefault(x, n) if isinstance(x, str) else x for x, n in zip(shape, a.shape))
            if a.ndim != len(shape) or tuple(a.shape) != dims or str(a.dtype) != f"torch.{want}" or a.device != device:
                raise SpecError(f"backward: {name} must be {want} {tuple(bound.get(x, x) for x in shape)} on {device}, "
                                f"got {str(a.dtype).replace('torch.', '')} {tuple(a.shape)} on {a.device}")
            tensors.append(a.contiguous())
        # what the kernel indexes by, on the host (a copy of a few ints, which waits for the stream)
        indices = {n: given[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "custom_mask", "mask_indptr", "key_lo",
                                          "key_hi") if given.get(n) is not None}
        arrays = {n: np.asarray(a.detach().cpu().numpy() if torch is not None and isinstance(a, torch.Tensor) else a)
                  for n, a in indices.items()}
        arrays.update({n: np.broadcast_to(np.zeros((), np.float32), tuple(given[n].shape)) for n in ("q", "k")})
        self._check_indices(arrays, bound)
        if any(t.numel() == 0 for t in tensors):  # no query row or no key: every gradient is zero
            for _, x in outs:
                x.zero_()
        else:
            with tvm_ffi.use_torch_stream():
                self.module[ENTRY](*(tvm_ffi.from_dlpack(t) for t in tensors),
                                   *(tvm_ffi.from_dlpack(x) for _, x in outs))
        return tuple([x for n, x in outs if n in OUTPUTS]
                     + [x.sum(0).reshape(given[n[2:-len(PARTIALS)]].shape) for n, x in outs if n.endswith(PARTIALS)])

    def _check_indices(self, arrays: dict, bound: dict) -> None:
        """What the kernel indexes by (before it reads a byte), as the forward's loader checks it:
        varlen's ``cu_seqlens`` (from 0, non-decreasing, ending at the totals) with its key bounds
        and custom mask per sequence; a BHSD custom mask's ``mask_indptr``, in int64."""
        from .layouts import check_custom_mask, get_layout  # the forward loader's rules

        if self.spec.layout == "varlen":
            get_layout("varlen").check_indices(arrays, bound, self.spec)
        elif self.spec.custom_mask:
            nb, sq, skv = arrays["q"].shape[0], arrays["q"].shape[2], arrays["k"].shape[2]
            check_custom_mask(arrays, [sq] * nb, [skv] * nb, nb)


def _aligned_copy(a: np.ndarray, aligned_empty) -> np.ndarray:
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def _call_args(func) -> tuple:
    """``(name, shape, dtype)`` of each of ``func``'s parameters, in call order (static shapes)."""
    import ml_dtypes  # TVM's own dependency: NumPy's bfloat16

    def dtype(name):
        return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)

    def extent(x):  # an int, or a symbolic dim's name (bound by the first array that has it)
        return int(x) if hasattr(x, "value") or isinstance(x, int) else str(x)

    # TVM 0.27: a PrimFunc's parameters are its buffers (no buffer_map)
    return tuple((_ARG_NAMES.get(p.name, p.name), tuple(extent(x) for x in p.shape), dtype(str(p.dtype)))
                 for p in func.params)


def build_backward(spec: AttentionSpec, knobs: BackwardKnobs | None = None, target: Any = "llvm",
                   grad_tensors: tuple[str, ...] = ()) -> BackwardKernel:
    """Lower, audit and compile the backward of ``spec`` for ``target`` (default: this CPU; an LLVM
    target, any other kind refused by name: :func:`backward_target`). The audit must find no
    buffer that grows with the lengths or, probed, holds the score matrix's elements
    (``score_buffers`` S, P)."""
    import tvm  # the compiler's side

    from .audit import audit, list_allocations, probe_spec  # the compiler's side (imports TVM)
    from .build import _spec_module  # the forward's self-description (imports TVM)
    from .layouts import SEQUENCE_DIMS  # the dims a sequence's length names
    from .lowering import ArgBounds, codegen, lower_final  # the compiler's side (imports TVM)
    from .spec import MAX_SEQ_LEN  # the longest sequence, as the forward's bounds
    from .target import cpu_features, missing_features  # whether this host runs what it builds
    from .workloads.index_checks import with_index_checks  # the forward library's own checks (imports TVM)

    target = backward_target(target, cuda=True)  # before anything is built
    if target.kind.name == "cuda":
        return _build_cuda(spec, knobs, target, grad_tensors)
    knobs = knobs or default_knobs(spec)
    func = backward_func(spec, knobs, grad_tensors)
    args = _call_args(func)
    # as the forward's library: it checks its index arrays (cu_seqlens, kv_start, key bounds,
    # mask_indptr) and every shape in int64 before it reads a byte, for callers without Python
    why = f"the longest sequence a kernel takes is {MAX_SEQ_LEN} rows or keys"
    bounds = [ArgBounds(name, {i: MAX_SEQ_LEN for i, d in enumerate(shape) if d in SEQUENCE_DIMS}, why, shape)
              for name, shape, _ in args]
    lowered = lower_final(with_index_checks(tvm.IRModule({"main": func}), spec), target, bounds)
    # as the forward's: the same kernel lowered at doubled lengths tells a tile (fixed) from a
    # buffer that grows with them, so that short sequences' tiles are not taken for score matrices
    probe = list_allocations(lower_final(backward_func(probe_spec(spec), knobs, grad_tensors), target))
    report = audit(lowered, spec, probe=probe)
    if report.verdict != "fused":
        raise RuntimeError(f"backward: the audit found it not fused: {'; '.join(report.reasons)}")
    module = codegen(lowered)
    module.import_module(_spec_module(spec, target))  # attention_spec_hash(): an artifact names its spec
    library = None
    if not missing_features(cpu_features(target)):
        # as the forward's BuiltKernel.library: LLVM makes machine code once, for the library,
        # instead of once for its JIT (the calls, validation) and again for the export
        library, module = _library_of(module)
    return BackwardKernel(spec, knobs, module, report, args, lowered, target, library)


def _build_cuda(spec: AttentionSpec, knobs: CudaBackwardKnobs | None, target: Any,
                grad_tensors: tuple[str, ...]) -> BackwardKernel:
    """The CUDA backward of ``spec`` (``workloads/backward_mma.py``): lowered for ``target``, audited
    (no buffer of the score matrix's size: the same probe as the CPU kernel's), compiled to CUDA C,
    and its ptxas report (nvcc here: registers, spills, SASS counts)."""
    import tvm  # the compiler's side

    from .audit import audit, list_allocations, probe_spec  # the compiler's side (imports TVM)
    from .build import _spec_module  # the forward's self-description (imports TVM)
    from .cuda_tools import NvccNotFound, block_shared_limit, kernel_source, ptxas_report  # nvcc's report
    from .layouts import SEQUENCE_DIMS  # the dims a sequence's length names
    from .lowering import ArgBounds, codegen, lower_final  # the compiler's side (imports TVM)
    from .spec import MAX_SEQ_LEN  # the longest sequence, as the forward's bounds
    from .workloads.backward_mma import backward_mma, backward_shared_bytes  # the compiler's side (imports TVM)

    from .reference import _check_grad_tensors  # the oracle's rule: NumPy only

    check_cuda_spec(spec)
    _check_grad_tensors(spec, grad_tensors)
    knobs = knobs or cuda_knobs(spec)
    if not isinstance(knobs, CudaBackwardKnobs):
        raise SpecError(f"backward on CUDA: knobs must be CudaBackwardKnobs, got {type(knobs).__name__}")
    arch = str(target.attrs.get("arch", ""))
    if not arch.startswith("sm_") or int(arch[3:5]) < 80:
        raise SpecError(f"backward on CUDA: arch {arch or '?'}: the tensor-core backward needs sm_80 or later "
                        "(mma.sync m16n8k16 with bf16, cp.async, ldmatrix)")
    smem, limit = backward_shared_bytes(spec, knobs.warps, knobs.block_m), block_shared_limit(target)
    if smem > limit:
        raise SpecError(f"backward on CUDA: shared memory {smem} B (K, V, Q, dO and dS tiles) > {limit} B on {arch}: "
                        "fewer warps or query rows")
    func = backward_mma(spec, knobs.warps, knobs.block_m, grad_tensors=tuple(grad_tensors))
    args = _call_args(func)
    why = f"the longest sequence a kernel takes is {MAX_SEQ_LEN} rows or keys"
    bounds = [ArgBounds(name, {i: MAX_SEQ_LEN for i, d in enumerate(shape) if d in SEQUENCE_DIMS}, why, shape)
              for name, shape, _ in args]
    lowered = lower_final(tvm.IRModule({"main": func}), target, bounds)
    probe = list_allocations(lower_final(backward_mma(probe_spec(spec), knobs.warps, knobs.block_m,
                                                      grad_tensors=tuple(grad_tensors)), target))
    report = audit(lowered, spec, probe=probe)
    if report.verdict != "fused":
        raise RuntimeError(f"backward: the audit found it not fused: {'; '.join(report.reasons)}")
    module = codegen(lowered)
    module.import_module(_spec_module(spec, target))
    try:
        resources = ptxas_report(kernel_source(module), arch, 32 * knobs.warps, smem)
    except NvccNotFound as e:
        resources = {"unavailable": str(e)}
    return BackwardKernel(spec, knobs, module, report, args, lowered, target, None, resources, "cuda")


def _library_of(module) -> tuple[str, Any]:
    """``module`` written to a shared library in a private folder (removed at exit) and loaded."""
    import atexit
    import os
    import shutil
    import tempfile

    import tvm  # the compiler's side

    folder = tempfile.mkdtemp(prefix="tvm-attention-bwd-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "attention_backward.so")
    module.export_library(path)
    return path, tvm.runtime.load_module(path)
