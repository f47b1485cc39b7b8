"""Artifact directory: ``attention.so`` + ``manifest.json`` + ``lowered.tir``.

Manifest (``manifest_version`` 1; keys are only ever added, never repurposed)::

    manifest_version  1
    entry             function name inside attention.so ("attention")
    library           "attention.so"
    library_sha256    SHA-256 of attention.so (checked by the loader, ``validate`` and ``inspect``)
    lowered_ir        "lowered.tir" (the audited IR, TVMScript)
    runtime_libraries [{file, sha256}]: the parts of TVM's runtime the library needs, copied
                      beside it (libtvm_runtime.so; CUDA builds also libtvm_runtime_cuda.so), so
                      that ``load`` runs it with tvm-ffi alone (``tvm_attention.runtime``)
    kernel_source     "kernel.cu" (CUDA builds: the generated CUDA C)
    kernel_binary     (CUDA builds made where nvcc is) {file: "kernel.fatbin", sha256, arch, format,
                      source_sha256}: the source compiled offline; ``load`` hands it to TVM's CUDA
                      runtime in place of a JIT compile, so a GPU machine needs no compiler
    resources         (CUDA builds) ptxas report: registers, spill bytes, stack frame, shared
                      memory, barriers, threads per block, occupancy estimate; or why it is absent
    layout            "BHSD" | "varlen" (the entry of tvm_attention.layouts; the spec says which too)
    args              [{name, shape, dtype}] in call order (bhsd: q, k, v, o; varlen: q, k, v,
                      cu_seqlens_q, cu_seqlens_k, o; o is the output buffer the caller passes).
                      A symbolic dim is written as its name: ["batch", 8, "seq_q", 64];
                      ``"batch+1"`` is one more than batch (cu_seqlens)
    symbolic_dims     names of the dims the kernel takes at call time ([] for a static build)
    spec_hash         ``AttentionSpec.fingerprint()`` of ``spec``; the library's own
                      ``attention_spec_hash()`` returns it, and ``load``/``inspect`` refuse a
                      manifest whose spec disagrees with the library
    spec              AttentionSpec fields (with ``layout`` and ``dynamic``; a dynamic dim's
                      integer is the representative value it was validated and timed at)
    target            the TVM target (JSON dict)
    cpu_features      (CPU builds) the ISA features the library's code may use, LLVM names
                      (``tvm_attention.hostcpu``): ``load`` refuses the artifact on a CPU that
                      lacks one instead of dying with SIGILL
    data_alignment    byte alignment the library needs of every argument's data pointer (16 for
                      CPU builds: NumPy's own placement; 64 when absent, as before it was
                      recorded, and for CUDA builds); the loader copies an input that is not,
                      and C/C++ callers must pass data so aligned (docs/artifact_checks.md)
    schedule          {name, source: "hand"|"tuned", family, knobs | trace}
    tvm_version       TVM that built it
    audit             {verdict, reasons, largest_allocation, bytes_by_scope, allocations, ...}
    validation        {max_abs_err, max_rel_err, mean_abs_err, atol, rtol, passed, ran, reason, ...}
                      (ran=false: not run, e.g. a CUDA build made on a machine with no GPU)
    created           UTC timestamp
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import tvm

from .build import BuiltKernel
from .cuda_tools import NvccNotFound, compile_fatbin, kernel_source
from .hostcpu import missing_features
from .loader import MANIFEST, AttentionKernel, library_digest
from .runtime import RUNTIME_CPU, RUNTIME_CUDA, compiler_runtime_paths
from .target import foreign_arch, is_cuda, local_cuda_arch, target_to_json
from .validate import ValidationResult, validate_callable

MANIFEST_VERSION = 1
LIBRARY = "attention.so"
LOWERED = "lowered.tir"
KERNEL_SOURCE = "kernel.cu"
KERNEL_BINARY = "kernel.fatbin"
#: Every file an artifact directory may hold: export replaces a directory holding only these.
ARTIFACT_FILES = (LIBRARY, LOWERED, KERNEL_SOURCE, KERNEL_BINARY, MANIFEST, RUNTIME_CPU, RUNTIME_CUDA)


class ExportError(RuntimeError):
    """The artifact cannot be written where asked; nothing was changed there."""


class ValidationFailed(RuntimeError):
    """A build computed wrong results; it is not exported."""


def kernel_of(built: BuiltKernel) -> AttentionKernel:
    return AttentionKernel(built.spec, built.function, {"data_alignment": built.data_alignment},
                           device="cuda" if is_cuda(built.target) else "cpu")


def validate_built(built: BuiltKernel, seed: int = 0) -> ValidationResult:
    """Run the build on seeded random inputs against the reference. A build this machine cannot
    run is recorded as not run, with why: a CUDA build on a machine with no GPU, a CPU build for
    features this CPU lacks (cross-compiled; ``tvm-attention validate DIR`` on a machine that
    has them runs it)."""
    if is_cuda(built.target) and local_cuda_arch() is None:
        return ValidationResult.not_run(
            built.spec, "no CUDA device on this machine; run `tvm-attention validate DIR` on a GPU", seed
        )
    missing = missing_features(built.cpu_features)
    if missing:
        return ValidationResult.not_run(
            built.spec, f"cross-compiled: this CPU lacks {', '.join(missing)}; run `tvm-attention validate DIR` "
            "on a CPU that has them", seed)
    return validate_callable(built.spec, kernel_of(built), seed=seed)


def make_manifest(built: BuiltKernel, validation: ValidationResult) -> dict[str, Any]:
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "entry": built.entry,
        "library": LIBRARY,
        "lowered_ir": LOWERED,
        "layout": built.spec.layout_info.manifest_name,
        "args": built.spec.arg_specs(),
        "symbolic_dims": built.spec.layout_info.symbolic_dims(built.spec),
        "spec": built.spec.to_dict(),
        "spec_hash": built.spec.fingerprint(),
        "target": target_to_json(built.target),
        "cpu_features": built.cpu_features,
        "data_alignment": built.data_alignment,
        "schedule": built.schedule_info(),
        "tvm_version": tvm.__version__,
        "audit": built.audit.to_dict(),
        "validation": validation.to_dict(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if is_cuda(built.target):
        manifest["kernel_source"] = KERNEL_SOURCE
        manifest["resources"] = built.resources
    return manifest


def export(built: BuiltKernel, out_dir: str | os.PathLike, validation: ValidationResult) -> dict[str, Any]:
    """Write the artifact directory; refuses a build whose validation failed.

    The files are written into a temporary directory beside ``out_dir``, which then takes its
    place by rename: a crash leaves the old artifact or the new one, never a new library beside
    an old manifest. An existing ``out_dir`` is replaced only if it holds nothing but artifact
    files (it is never a place to lose other files).
    """
    if validation.ran and not validation.passed:
        raise ValidationFailed(
            f"{built.spec.short_name()} [{built.schedule}/{built.source}] failed validation, not exported: "
            + validation.format()
        )
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"{out}: exists and is not a directory")
        foreign = sorted(p.name for p in out.iterdir() if p.name not in ARTIFACT_FILES)
        if foreign:
            raise ExportError(
                f"{out}: holds files that are not part of an artifact ({', '.join(foreign[:5])}"
                f"{', ...' if len(foreign) > 5 else ''}); choose an empty or new --out directory"
            )
    def fill(tmp: Path) -> dict[str, Any]:
        built.export_library(str(tmp / LIBRARY))  # the very file validation ran, when it ran
        # another architecture's library (aarch64 built on x86): this host's runtime is not its
        # own, so none is carried (the aarch64 host's apache-tvm provides it)
        runtime = [] if foreign_arch(built.target) else copy_runtime(tmp, cuda=is_cuda(built.target))
        (tmp / LOWERED).write_text(built.lowered.script())
        binary = None
        if is_cuda(built.target):
            binary = _write_cuda_sources(built, tmp)
        manifest = make_manifest(built, validation)
        if binary is not None:
            manifest["kernel_binary"] = binary
        manifest["library_sha256"] = library_digest(tmp / LIBRARY)
        manifest["runtime_libraries"] = runtime
        return manifest

    return write_directory(out, fill)


def copy_runtime(tmp: Path, cuda: bool = False) -> list[dict[str, str]]:
    """TVM's runtime libraries copied into the directory ``tmp``: the manifest's ``runtime_libraries``."""
    runtime = []
    for path in compiler_runtime_paths(cuda=cuda):
        shutil.copy2(path, tmp / path.name)
        runtime.append({"file": path.name, "sha256": library_digest(tmp / path.name)})
    return runtime


def write_directory(out: Path, fill) -> dict[str, Any]:
    """An artifact directory ``out`` written whole or not at all: ``fill(tmp)`` writes the files
    into a new directory beside it and returns the manifest, written last; the directory then
    takes ``out``'s place by rename (:func:`_swap_into_place`). A failure removes it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        manifest = fill(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _write_cuda_sources(built: BuiltKernel, tmp: Path) -> dict[str, Any] | None:
    """``kernel.cu`` and, where nvcc is, ``kernel.fatbin``: the source compiled offline, so that a
    GPU machine runs the artifact without a compiler (TVM's runtime would otherwise JIT the source
    at load, through a callback only the compiler package provides). Returns the manifest's
    ``kernel_binary`` entry, or None without nvcc."""
    import hashlib


    source = kernel_source(built.module)
    (tmp / KERNEL_SOURCE).write_text(source)
    arch = str(built.target.attrs["arch"])
    try:
        data = compile_fatbin(source, arch)
    except NvccNotFound:
        return None
    (tmp / KERNEL_BINARY).write_bytes(data)
    return {"file": KERNEL_BINARY, "sha256": library_digest(tmp / KERNEL_BINARY), "arch": arch, "format": "fatbin",
            "source_sha256": hashlib.sha256(source.encode()).hexdigest()}


def _swap_into_place(new: Path, out: Path) -> None:
    """Rename ``new`` to ``out``; an existing ``out`` is moved aside first and removed after."""
    if not out.exists():
        os.rename(new, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(old, out)  # put the old artifact back
        raise
    shutil.rmtree(old, ignore_errors=True)
