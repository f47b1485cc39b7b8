"""Exported backward libraries (issue 46; ``tvm_attention.backward_artifact``): a validated
artifact directory that loads with TVM's runtime alone, in a process where ``tvm`` cannot be
imported, and computes what the build does; a changed library, an edited manifest or a bad index
array is refused by name, by the loader or by the library itself."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tvm_attention.backward import BackwardKnobs, build_backward
from tvm_attention.backward_artifact import export_backward, load_backward
from tvm_attention.loader import ArtifactError
from tvm_attention.spec import AttentionSpec

SPEC = AttentionSpec(layout="varlen", batch=2, heads=4, kv_heads=2, seq_q=24, seq_kv=40, head_dim=16, causal=True,
                     sinks=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    kern = build_backward(SPEC, BackwardKnobs(dq_chunks=0))  # varlen's second pass (the preset chunks elsewhere)
    out = tmp_path_factory.mktemp("bwd") / "artifact"
    manifest = export_backward(kern, out)
    return kern, out, manifest


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    cq, ck = np.asarray([0, 24, 31], np.int32), np.asarray([0, 40, 52], np.int32)
    q, o, do = (rng.standard_normal((31, 4, 16)).astype(np.float32) for _ in range(3))
    k, v = (rng.standard_normal((52, 2, 16)).astype(np.float32) for _ in range(2))
    lse = rng.standard_normal((4, 31)).astype(np.float32)
    return (q, k, v, o, lse, do), dict(cu_seqlens_q=cq, cu_seqlens_k=ck, sinks=rng.standard_normal(4).astype(np.float32))


def test_the_artifact_loads_without_the_compiler_and_computes_the_builds_gradients(exported):
    kern, out, manifest = exported
    assert manifest["validation"]["passed"] and manifest["audit"] == "fused"
    assert [a["name"] for a in manifest["args"]] == ["q", "k", "v", "o", "lse", "do", "sinks", "cu_seqlens_q",
                                                     "cu_seqlens_k", "dq", "dk", "dv", "dsinks"]
    arrays, args = _inputs()
    want = kern(*arrays, **args)
    np.savez(out.parent / "inputs.npz", *arrays, **args)
    code = textwrap.dedent(f"""
        import sys, numpy as np
        sys.modules["tvm"] = None  # the compiler cannot be imported: the runtime alone loads it
        from tvm_attention.backward_artifact import load_backward
        kern = load_backward({str(out)!r})
        z = np.load({str(out.parent / "inputs.npz")!r})
        got = kern(*(z[f"arr_{{i}}"] for i in range(6)), cu_seqlens_q=z["cu_seqlens_q"],
                   cu_seqlens_k=z["cu_seqlens_k"], sinks=z["sinks"])
        np.savez({str(out.parent / "got.npz")!r}, *got)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = np.load(out.parent / "got.npz")
    for i, w in enumerate(want):
        np.testing.assert_array_equal(got[f"arr_{i}"], w)


def test_the_library_checks_its_index_arrays_itself(exported):
    """Called as a C++ caller would (the raw function, no Python checks): cu_seqlens that fall
    are refused by the library, by name."""
    _, out, manifest = exported
    kern = load_backward(out)
    arrays, args = _inputs()
    args["cu_seqlens_k"] = np.asarray([0, 53, 52], np.int32)
    from tvm_attention.runtime import cpu_view

    outs = [np.empty(a.shape, np.float32) for a in (arrays[0], arrays[1], arrays[2])] + [np.empty(4, np.float32)]
    with pytest.raises(ValueError, match="cu_seqlens_k: must be non-decreasing"):
        kern.module[manifest["entry"]](*map(cpu_view, arrays), cpu_view(args["sinks"]), args["cu_seqlens_q"],
                                       args["cu_seqlens_k"], *map(cpu_view, outs))


def test_a_changed_artifact_is_refused_by_name(exported, tmp_path):
    _, out, _ = exported
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["spec"]["causal"] = False  # an edited manifest: the library computes another spec
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="not the one the library was built from"):
        load_backward(bad)
    (bad / "attention_backward.so").write_bytes(b"\0" * 10)
    with pytest.raises(ArtifactError, match="SHA-256 does not match"):
        load_backward(bad)
    with pytest.raises(ArtifactError, match="not a backward artifact"):
        (bad / "manifest.json").write_text(json.dumps({"format": "other"}))
        load_backward(bad)


def test_a_kernel_that_disagrees_with_the_reference_is_not_exported(exported, tmp_path):
    """Validation can fail: the same library claimed for another scale."""
    import dataclasses

    kern, _, _ = exported
    wrong = dataclasses.replace(kern, spec=dataclasses.replace(SPEC, scale=0.5))
    with pytest.raises(ArtifactError, match="failed validation, not exported"):
        export_backward(wrong, tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists()


def test_a_manifest_missing_what_loading_needs_is_refused_by_name(exported, tmp_path):
    """A manifest without ``runtime_libraries`` or ``library_sha256``, or one that is a JSON list,
    is an ArtifactError naming the key (not a KeyError); a library that is a symbolic link is
    refused, and one swapped after the digests were checked never loads."""
    import shutil

    import tvm_attention.backward_artifact as ba

    _, out, manifest = exported
    cases = {"runtime_libraries": None, "library_sha256": None, "knobs": "x"}
    for key, value in cases.items():
        bad = tmp_path / key
        shutil.copytree(out, bad)
        edited = {k: v for k, v in manifest.items() if k != key or value is not None}
        if value is not None:
            edited[key] = value
        (bad / "manifest.json").write_text(json.dumps(edited))
        with pytest.raises(ArtifactError, match=f"manifest's '{key}' is missing or not a"):
            load_backward(bad)
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ArtifactError, match="a manifest is a JSON object, got a list"):
        load_backward(tmp_path / "list")
    link = tmp_path / "link"
    shutil.copytree(out, link)
    (link / "attention_backward.so").unlink()
    (link / "attention_backward.so").symlink_to(out / "attention_backward.so")  # the very same bytes, elsewhere
    with pytest.raises(ArtifactError, match="attention_backward.so: a symbolic link"):
        load_backward(link)
    swapped = tmp_path / "swapped"
    shutil.copytree(out, swapped)
    real = ba.check_cpu_features

    def swap_then_check(*a, **k):
        (swapped / "attention_backward.so").write_bytes(b"\x7fELF" + b"\0" * 100)
        return real(*a, **k)

    ba.check_cpu_features = swap_then_check
    try:
        with pytest.raises(ArtifactError, match="attention_backward.so: SHA-256 does not match"):
            load_backward(swapped)
    finally:
        ba.check_cpu_features = real
