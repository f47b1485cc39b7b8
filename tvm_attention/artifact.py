"""Artifact directory: ``attention.so`` + ``manifest.json`` + ``lowered.tir``.

Manifest (``manifest_version`` 1; keys are only ever added, never repurposed)::

    manifest_version  1
    entry             function name inside attention.so ("attention")
    library           "attention.so"
    lowered_ir        "lowered.tir" (the audited IR, TVMScript)
    kernel_source     "kernel.cu" (CUDA builds: the generated CUDA C)
    resources         (CUDA builds) ptxas report: registers, spill bytes, stack frame, shared
                      memory, barriers, threads per block, occupancy estimate; or why it is absent
    layout            "BHSD"
    args              [{name, shape, dtype}] for q, k, v, o (o is the output buffer the caller passes)
    spec              AttentionSpec fields
    target            the TVM target (JSON dict)
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
from pathlib import Path
from typing import Any

import tvm

from .build import BuiltKernel
from .loader import MANIFEST, AttentionKernel
from .target import is_cuda, local_cuda_arch, target_to_json
from .validate import ValidationResult, validate_callable

MANIFEST_VERSION = 1
LIBRARY = "attention.so"
LOWERED = "lowered.tir"
KERNEL_SOURCE = "kernel.cu"


class ValidationFailed(RuntimeError):
    """A build computed wrong results; it is not exported."""


def kernel_of(built: BuiltKernel) -> AttentionKernel:
    return AttentionKernel(built.spec, built.function, device="cuda" if is_cuda(built.target) else "cpu")


def validate_built(built: BuiltKernel, seed: int = 0) -> ValidationResult:
    """Run the build on seeded random inputs against the reference. A CUDA build on a machine
    with no GPU is recorded as not run (``tvm-attention validate DIR`` on a GPU runs it)."""
    if is_cuda(built.target) and local_cuda_arch() is None:
        return ValidationResult.not_run(
            built.spec, "no CUDA device on this machine; run `tvm-attention validate DIR` on a GPU", seed
        )
    return validate_callable(built.spec, kernel_of(built), seed=seed)


def make_manifest(built: BuiltKernel, validation: ValidationResult) -> dict[str, Any]:
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "entry": built.entry,
        "library": LIBRARY,
        "lowered_ir": LOWERED,
        "layout": "BHSD",
        "args": built.spec.arg_specs(),
        "spec": built.spec.to_dict(),
        "target": target_to_json(built.target),
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


def _atomic_write_bytes(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def export(built: BuiltKernel, out_dir: str | os.PathLike, validation: ValidationResult) -> dict[str, Any]:
    """Write the artifact directory; refuses a build whose validation failed."""
    if validation.ran and not validation.passed:
        raise ValidationFailed(
            f"{built.spec.short_name()} [{built.schedule}/{built.source}] failed validation, not exported: "
            + validation.format()
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = make_manifest(built, validation)
    _atomic_write_bytes(out / LIBRARY, lambda p: built.module.export_library(str(p)))
    _atomic_write_bytes(out / LOWERED, lambda p: p.write_text(built.lowered.script()))
    if is_cuda(built.target):
        from .cuda_tools import kernel_source

        _atomic_write_bytes(out / KERNEL_SOURCE, lambda p: p.write_text(kernel_source(built.module)))
    # The manifest goes last: a directory with a manifest is a complete artifact.
    _atomic_write_bytes(out / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=2) + "\n"))
    return manifest
