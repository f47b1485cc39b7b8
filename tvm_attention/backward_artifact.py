"""Exported backward libraries (issue 46): a built backward as an artifact directory that loads
with TVM's runtime alone, as the forward's do (``docs/serving.md``'s artifact folder).

``export_backward(kernel, out_dir)`` validates the kernel against the float64 reference
(:func:`validate_backward`) and writes::

    attention_backward.so   the kernel, linked with attention_spec_hash() (the spec it computes)
    libtvm_runtime.so       TVM's runtime, so that no compiler is needed to load it
    lowered_ir.py           the final lowered TIR (what the audit read)
    manifest.json           format "tvm-attention-backward", the spec, knobs, the call's arguments
                            (name, shape: ints or a dim's name, dtype) in order, outputs last,
                            the CPU features its code uses, the audit, validation, SHA-256s

``load_backward(out_dir)`` checks the manifest, the files' SHA-256, that this CPU has the
features (a library built for another would SIGILL), and the library's own spec hash, and
returns a :class:`~tvm_attention.backward.BackwardKernel`. The library checks its own index
arrays and shapes (``build_backward``), so C++ callers get the same errors; the call is
``attention_backward(q, k, v, o, lse, do, <variant arguments>, dq, dk, dv[, dsinks][,
dq_workspace])`` in the manifest's order (DLTensors, 64-byte-aligned; ``dq_workspace``, the
chunked dQ's scratch of the manifest's shape, is the caller's to allocate).

A CUDA build (``build_backward`` with a CUDA target) exports the same way, with the forward's CUDA
files beside its library: ``kernel.cu`` and, where nvcc is, ``kernel.fatbin`` (``kernel_binary``:
loaded in place of a JIT compile), TVM's runtime with CUDA, the manifest's ``target`` naming the
arch, ``resources`` (ptxas) and ``workspaces`` (``dq_accum``, ``delta``: float32 scratch the
caller allocates, as the call does); its validation runs where a GPU does (``ran: false`` here).
Loaded, it takes torch CUDA tensors; a machine without a GPU is refused by name.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .backward import CUDA_WORKSPACES, ENTRY, OUTPUTS, BackwardKernel, BackwardKnobs, CudaBackwardKnobs
from .loader import (ArtifactError, check_cpu_features, check_library_spec, library_digest, load_module,
                     runtime_entries)
from .spec import AttentionSpec

FORMAT = "tvm-attention-backward"
MANIFEST_VERSION = 1
MANIFEST, LIBRARY, LOWERED = "manifest.json", "attention_backward.so", "lowered_ir.py"
#: a CUDA build's: its CUDA C and, where nvcc is, the fatbin compiled offline (``kernel_binary``:
#: loaded in place of a JIT compile, so the GPU machine needs no compiler)
KERNEL_SOURCE, KERNEL_BINARY = "kernel.cu", "kernel.fatbin"


def validate_backward(kernel: BackwardKernel, seed: int = 0) -> dict[str, Any]:
    """The kernel against ``reference_attention_backward`` on seeded inputs at its spec's shape
    (BHSD; a symbolic spec at its representative shape; varlen: two sequences of the
    representative lengths and one shorter): ``{"passed", "max_abs_error", "tolerance"}`` per the
    forward's float32/bf16 tolerances."""
    from .reference import reference_attention, reference_attention_backward  # float64, NumPy only

    spec, rng = kernel.spec, np.random.default_rng(seed)
    dt = spec.np_dtype
    lens = [(spec.seq_q, spec.seq_kv)] * (spec.batch if spec.layout == "bhsd" else 2) \
        + ([(max(spec.seq_q // 3, 1), max(spec.seq_kv // 2, 1))] if spec.layout == "varlen" else [])
    args = {n: rng.standard_normal(spec.heads).astype(np.float32) for n, on in
            (("alibi_slopes", spec.alibi), ("sinks", spec.sinks)) if on}
    if spec.alibi:
        args["alibi_slopes"] = np.abs(args["alibi_slopes"]) * 0.1
    one = AttentionSpec.from_dict({**spec.to_dict(), "layout": "bhsd", "batch": 1, "dynamic": []})
    kargs, rargs = _variant_args(spec, lens, rng)
    errs, per = 0.0, []
    for b, (sq, skv) in enumerate(lens):  # one sequence at a time: BHSD batch 1
        q, do = (rng.standard_normal((1, spec.heads, sq, d)).astype(dt) for d in (spec.head_dim, spec.v_dim))
        k, v = (rng.standard_normal((1, spec.kv_heads, skv, d)).astype(dt) for d in (spec.head_dim, spec.v_dim))
        ref = dict(args, **{n: x[b:b + 1] for n, x in rargs.items() if n == "kv_start"},
                   **{n: x for n, x in rargs.items() if n != "kv_start"})
        o, lse = reference_attention(one, q, k, v, return_lse=True, seq_index=b, **ref)
        per.append((q, k, v, o.astype(dt), lse.astype(np.float32), do,
                    reference_attention_backward(one, q, k, v, do, seq_index=b, **ref)))
    got = _run(kernel, per, dict(args, **kargs), lens)
    pairs = [(g, want[name]) for (*_, want), grads in zip(per, got) for name, g in zip(OUTPUTS[:3], grads)]
    if spec.sinks:  # one dsinks for the whole call: the sequences' sum
        pairs.append((got[0][3], sum(p[-1]["dsinks"] for p in per)))
    for g, w in pairs:
        scale = max(float(np.abs(w).max()), 1.0)
        errs = max(errs, float(np.abs(g.astype(np.float64) - w).max()) / scale)
    tol = 1e-2 if spec.dtype == "bfloat16" else 1e-4
    return {"passed": bool(errs <= tol), "max_rel_error": errs, "tolerance": tol, "seed": seed,
            "shapes": [list(x) for x in lens]}


def _variant_args(spec: AttentionSpec, lens: list, rng) -> tuple[dict, dict]:
    """The variants' arguments for validation (the kernel's, the reference's): ``kv_start`` 0,
    key bounds seeing every key, a custom mask of ~80 % of the pairs, the modifiers' tensors
    (int32 zeros, float32 small normals) at their declared shapes."""
    from .masks import pack_mask  # the custom mask's bits

    kargs, rargs = {}, {}
    n, keys = len(lens), max(x[1] for x in lens)
    if spec.kv_start:
        kargs["kv_start"] = rargs["kv_start"] = np.zeros(n, np.int32)
    if spec.key_bounds:
        kargs["key_lo"] = rargs["key_lo"] = np.zeros((n, keys), np.int32)
        kargs["key_hi"] = rargs["key_hi"] = np.full((n, keys), keys, np.int32)
    if spec.custom_mask:
        packed, indptr = pack_mask([rng.random(x) < 0.8 for x in lens])
        kargs.update(custom_mask=packed, mask_indptr=indptr)
        rargs["custom_mask"] = (packed, indptr)
    tensors = {}
    for name, dtype, dims in spec.mod_tensors:
        shape = tuple(d if isinstance(d, int) else getattr(spec, d) for d in dims)
        tensors[name] = np.zeros(shape, np.int32) if dtype == "int32" else \
            (rng.standard_normal(shape) * 0.1).astype(np.float32)
    if tensors:
        kargs.update(tensors)
        rargs["mod_tensors"] = tensors
    return kargs, rargs


def _run(kernel: BackwardKernel, per: list, args: dict, lens: list) -> list:
    """The kernel's gradients of each sequence in ``per`` (BHSD batch 1 inputs), by the kernel's
    layout: a BHSD batch, or varlen's packed rows."""
    if kernel.spec.layout == "bhsd":
        cat = [np.concatenate([p[i] for p in per]) for i in range(6)]
        out = kernel(*cat, **args)
        return [[g[b:b + 1] for g in out[:3]] + list(out[3:]) for b in range(len(per))]
    pack = [np.concatenate([p[i][0].transpose(1, 0, 2) for p in per]) for i in (0, 1, 2, 3, 5)]
    lse = np.concatenate([p[4][0] for p in per], axis=1)
    cq, ck = (np.concatenate([[0], np.cumsum([x[i] for x in lens])]).astype(np.int32) for i in (0, 1))
    out = kernel(pack[0], pack[1], pack[2], pack[3], lse, pack[4], cu_seqlens_q=cq, cu_seqlens_k=ck, **args)
    return [[g[c[b]:c[b + 1]].transpose(1, 0, 2)[None] for g, c in zip(out[:3], (cq, ck, ck))] + list(out[3:])
            for b in range(len(per))]


def export_backward(kernel: BackwardKernel, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Validate ``kernel`` and write its artifact directory (the module docstring); returns the
    manifest. A failed validation exports nothing (:class:`ArtifactError`). ``out_dir`` is
    replaced atomically, and only if it holds nothing but artifact files."""
    from .artifact import copy_runtime, write_directory  # the forward's: runtime copies, atomic replace
    from .target import cpu_features  # the compiler's side

    if kernel.lowered is None:
        raise ArtifactError("export_backward: this kernel was loaded from an artifact; export the build")
    cuda = kernel.device == "cuda"
    validation = {"ran": False, "passed": None, "why": "a CUDA build: validated where a GPU runs it (the GPU "
                  "payload's check)"} if cuda else validate_backward(kernel)
    if not cuda and not validation["passed"]:
        raise ArtifactError(f"export_backward: {kernel.spec.short_name()} failed validation, not exported: "
                            f"max relative error {validation['max_rel_error']:.3g} > {validation['tolerance']}")
    out = Path(out_dir)
    if out.exists():
        foreign = sorted(p.name for p in out.iterdir()) if out.is_dir() else [out.name]
        foreign = [n for n in foreign if n not in (MANIFEST, LIBRARY, LOWERED, KERNEL_SOURCE, KERNEL_BINARY)
                   and not n.startswith("libtvm")]
        if foreign:
            raise ArtifactError(f"{out}: holds files that are not part of a backward artifact ({', '.join(foreign[:5])})")
    def fill(tmp: Path) -> dict[str, Any]:
        if kernel.library is not None:  # the very library validation ran
            shutil.copy2(kernel.library, tmp / LIBRARY)
        else:
            kernel.module.export_library(str(tmp / LIBRARY))
        runtime = copy_runtime(tmp, cuda=cuda)
        (tmp / LOWERED).write_text(kernel.lowered.script())
        target = kernel.target
        where = {"kind": "cuda", "arch": str(target.attrs["arch"])} if cuda else \
            {"kind": target.kind.name, "mcpu": str(target.attrs.get("mcpu", ""))}
        manifest = {
            "format": FORMAT, "manifest_version": MANIFEST_VERSION, "entry": ENTRY, "library": LIBRARY,
            "spec": kernel.spec.to_dict(), "spec_hash": kernel.spec.fingerprint(),
            "knobs": dataclasses.asdict(kernel.knobs),
            "args": [{"name": n, "shape": list(s), "dtype": str(d), "output": n in OUTPUTS} for n, s, d in kernel.args],
            "target": where, "cpu_features": cpu_features(target), "audit": kernel.report.verdict,
            "validation": validation, "library_sha256": library_digest(tmp / LIBRARY), "runtime_libraries": runtime,
        }
        if cuda:  # the forward's way: kernel.cu, and the fatbin where nvcc is (the loader's kernel_binary)
            from .artifact import _write_cuda_sources  # the compiler's side

            manifest.update(kernel_source=KERNEL_SOURCE, resources=kernel.resources, workspaces=list(CUDA_WORKSPACES))
            binary = _write_cuda_sources(kernel, tmp)
            if binary is not None:
                manifest["kernel_binary"] = binary
        return manifest

    return write_directory(out, fill)


def load_backward(directory: str | os.PathLike) -> BackwardKernel:
    """The backward of an artifact directory :func:`export_backward` wrote, with TVM's runtime
    alone (no compiler); :class:`ArtifactError` naming what is wrong: not a backward manifest
    (or a key of it missing or malformed), a file missing, changed or a symbolic link, CPU
    features this host lacks, a manifest whose spec the library was not built from. The library
    and runtime run are private copies of the bytes checked (``tvm_attention.runtime``)."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no manifest (is {directory} a backward artifact directory?)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: a manifest is a JSON object, got a {type(manifest).__name__}")
    if manifest.get("format") != FORMAT or manifest.get("manifest_version") != MANIFEST_VERSION:
        raise ArtifactError(f"{path}: not a backward artifact (format {manifest.get('format')!r}, version "
                            f"{manifest.get('manifest_version')!r}; expected {FORMAT!r} {MANIFEST_VERSION})")
    for key, kind in (("library_sha256", str), ("runtime_libraries", list), ("spec", dict), ("knobs", dict),
                      ("args", list), ("audit", str)):
        if not isinstance(manifest.get(key), kind):
            raise ArtifactError(f"{path}: the manifest's {key!r} is missing or not a {kind.__name__} (every backward "
                                "artifact has it; rebuild it with export_backward)")
    entries = runtime_entries(directory, manifest)
    lib = Path(directory) / LIBRARY
    for name, digest in [(LIBRARY, manifest["library_sha256"])] + [(r["file"], r["sha256"]) for r in entries]:
        f = Path(directory) / name
        if f.is_symlink():
            raise ArtifactError(f"{f}: a symbolic link; an artifact loads code only from regular files inside its "
                                "folder, never from where a link points")
        if not f.is_file():
            if name != LIBRARY:  # as the forward's: a runtime library the process already holds may be absent
                continue  # (loading checks that it is held: ``runtime.ensure_runtime``)
            raise ArtifactError(f"{f}: missing (the manifest names it)")
        if library_digest(f) != digest:
            raise ArtifactError(f"{f}: SHA-256 does not match the manifest's")
    cuda = manifest.get("target", {}).get("kind") == "cuda"
    check_cpu_features(directory, manifest)
    try:
        spec = AttentionSpec.from_dict(manifest["spec"])
        knobs = (CudaBackwardKnobs if cuda else BackwardKnobs)(**manifest["knobs"])
        args = tuple((a["name"], tuple(a["shape"]), _dtype(a["dtype"])) for a in manifest["args"])
    except (TypeError, KeyError, ValueError) as e:
        raise ArtifactError(f"{path}: malformed spec, knobs or args ({type(e).__name__}: {e})") from None
    from . import runtime  # the runtime's side: whether TVM sees a GPU

    try:
        module = load_module(directory, manifest, lib)  # the bytes checked, from a private copy
        problem = None if not cuda or runtime.cuda_arch() is not None else "no device found"
    except ArtifactError as e:
        if not cuda:
            raise
        problem = str(e)  # no CUDA driver or runtime on this machine
    if problem is not None:
        raise ArtifactError(f"{directory}: a CUDA backward artifact ({manifest['target'].get('arch')}); this machine "
                            f"has no CUDA device TVM can use ({problem})")
    check_library_spec(directory, module, manifest)
    return BackwardKernel(spec, knobs, module, manifest["audit"], args, device="cuda" if cuda else "cpu")


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # what NumPy's bf16 arrays are

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
