"""Arm servers (issue 66, a first step): an aarch64 target (``{"kind": "llvm", "mtriple":
"aarch64-linux-gnu", "mcpu": "neoverse-v2"}``) builds the fused CPU kernel on this x86 host,
links it with the cross toolchain (``aarch64-linux-gnu-g++``) into an aarch64 ELF, never loads or
runs it here, and records its ISA (the ``aarch64`` architecture and Neoverse V2's NEON, SVE, BF16,
i8mm...) so that an x86 host's loader refuses it by name; the artifact carries no runtime of
this host's architecture. Skipped where the cross toolchain is missing."""
import json
import shutil

import pytest

from tvm_attention.spec import AttentionSpec

ARM = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-v2"}

needs_cross = pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                                 reason="no aarch64 cross toolchain (Debian: g++-aarch64-linux-gnu)")


@needs_cross
def test_an_aarch64_build_exports_an_aarch64_library_this_host_refuses(tmp_path):
    import platform

    from tvm_attention import load
    from tvm_attention.artifact import export
    from tvm_attention.build import build_kernel
    from tvm_attention.loader import ArtifactError
    from tvm_attention.target import resolve_target
    from tvm_attention.artifact import validate_built

    if platform.machine().lower() in ("aarch64", "arm64"):
        pytest.skip("an aarch64 host runs its own builds (the test checks a cross build)")
    spec = AttentionSpec(batch=1, heads=2, seq_q=64, head_dim=32, causal=True)
    built = build_kernel(spec, target=resolve_target(json.dumps(ARM)))
    assert built.library is None  # never loaded on this host
    validation = validate_built(built)
    assert not validation.ran and "aarch64" in validation.format()
    manifest = export(built, tmp_path / "arm", validation)
    data = (tmp_path / "arm" / "attention.so").read_bytes()
    assert data[:4] == b"\x7fELF" and int.from_bytes(data[18:20], "little") == 183  # EM_AARCH64
    assert {"aarch64", "neon", "sve", "sve2", "bf16", "i8mm", "dotprod"} <= set(manifest["cpu_features"])
    assert manifest["runtime_libraries"] == [] and not list((tmp_path / "arm").glob("libtvm*"))
    with pytest.raises(ArtifactError, match="its code needs CPU features aarch64, bf16"):
        load(tmp_path / "arm")
