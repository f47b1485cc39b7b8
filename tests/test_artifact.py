"""Export → manifest → load in a fresh process with only tvm and numpy; the loader's checks."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tvm_attention.artifact import export, validate_built, ValidationFailed
from tvm_attention.loader import KernelArgumentError, ArtifactError, load, read_manifest
from tvm_attention.reference import random_inputs, reference_attention
from tvm_attention.spec import AttentionSpec

from conftest import at_offset, built

SPEC = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=100, seq_kv=160, head_dim=64, causal=True)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("artifact")
    b = built(SPEC)
    export(b, out, validate_built(b))
    return out


def test_manifest_contents(artifact):
    m = json.loads((artifact / "manifest.json").read_text())
    assert m["manifest_version"] == 1 and m["entry"] == "attention" and m["layout"] == "BHSD"
    assert [a["name"] for a in m["args"]] == ["q", "k", "v", "o"]
    assert m["args"][1]["shape"] == [1, 2, 160, 64]
    assert m["schedule"]["name"] == "fused" and m["schedule"]["source"] == "hand"
    assert m["schedule"]["knobs"]["block_m"] > 0
    assert m["audit"]["verdict"] == "fused" and m["audit"]["largest_allocation"]["scope"] == "local"
    assert m["validation"]["passed"] and m["validation"]["max_abs_err"] < 1e-4
    assert m["target"]["kind"] == "llvm"
    assert (artifact / "attention.so").stat().st_size > 0
    text = (artifact / "lowered.tir").read_text()
    assert "TVMBackendAllocWorkspace" in text and "__tvm_ffi_attention" in text  # the exported entry


def test_load_in_fresh_process_with_only_tvm_and_numpy(artifact, tmp_path):
    q, k, v = random_inputs(SPEC, seed=11)
    np.savez(tmp_path / "in.npz", q=q, k=k, v=v)
    script = textwrap.dedent(
        f"""
        import json, sys
        import numpy as np, tvm
        d = {str(artifact)!r}
        m = json.load(open(d + "/manifest.json"))
        f = tvm.runtime.load_module(d + "/" + m["library"])[m["entry"]]
        x = np.load({str(tmp_path / 'in.npz')!r})
        args = [tvm.runtime.tensor(x[n]) for n in ("q", "k", "v")]
        o = tvm.runtime.empty(m["args"][3]["shape"], m["args"][3]["dtype"])
        f(*args, o)
        np.save({str(tmp_path / 'out.npy')!r}, o.numpy())
        assert "tvm_attention" not in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    out = np.load(tmp_path / "out.npy")
    np.testing.assert_allclose(out, reference_attention(SPEC, q, k, v), atol=1e-4, rtol=1e-4)
    # and the same as the in-process kernel
    np.testing.assert_array_equal(out, load(artifact)(q, k, v))


def test_loader_rejects_bad_inputs_with_clear_errors(artifact):
    kernel = load(artifact)
    q, k, v = random_inputs(SPEC, seed=0)
    with pytest.raises(KernelArgumentError, match=r"q: expected shape \(1, 4, 100, 64\)"):
        kernel(q[:, :, :50], k, v)
    with pytest.raises(KernelArgumentError, match="k: expected dtype float32, got float64"):
        kernel(q, k.astype(np.float64), v)
    with pytest.raises(KernelArgumentError, match="v: expected rank 4"):
        kernel(q, k, v[0])
    with pytest.raises(KernelArgumentError, match="q: expected a C-contiguous"):
        kernel(np.asfortranarray(q), k, v)
    with pytest.raises(KernelArgumentError, match="q: expected a C-contiguous"):
        kernel(q.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3), k, v)
    with pytest.raises(KernelArgumentError, match="expected a NumPy array or a DLPack tensor"):
        kernel(q.tolist(), k, v)


def test_loader_copies_misaligned_inputs_instead_of_crashing(artifact):
    kernel = load(artifact)
    q, k, v = random_inputs(SPEC, seed=4)
    ref = reference_attention(SPEC, q, k, v)
    for shift in (1, 2, 3):  # 4, 8, 12 bytes off a 64-byte boundary
        buf = np.empty(q.size + 16, np.float32)
        base = (-buf.ctypes.data % 64) // 4
        mis = buf[base + shift : base + shift + q.size].reshape(q.shape)
        mis[...] = q
        assert mis.ctypes.data % 64 != 0 and mis.flags.c_contiguous
        np.testing.assert_allclose(kernel(mis, k, v), ref, atol=1e-4, rtol=1e-4)


def test_numpy_alignment_passes_without_a_copy(artifact, monkeypatch):
    """CPU kernels declare 16-byte aligned data (the manifest's data_alignment): arrays where NumPy
    puts them (16 mod 64 bytes) reach the library as they are, on the fast path and on the checked
    one, with the same output as 64-byte aligned ones; what is not 16-byte aligned is copied; an
    artifact whose manifest names no alignment (built before it was recorded) still gets 64."""
    import tvm_attention.loader as loader
    from tvm_attention.loader import AttentionKernel
    from tvm_attention.spec import DATA_ALIGNMENT

    assert DATA_ALIGNMENT == 16 and read_manifest(artifact)["data_alignment"] == 16
    kernel = load(artifact)
    q, k, v = random_inputs(SPEC, seed=6)
    want = kernel(*(at_offset(x, 0) for x in (q, k, v)))
    allocs = []
    real = loader.aligned_empty
    monkeypatch.setattr(loader, "aligned_empty", lambda shape, dtype: allocs.append(tuple(shape)) or real(shape, dtype))
    for offset in (16, 32, 48):
        args = [at_offset(x, offset) for x in (q, k, v)]
        allocs.clear()
        np.testing.assert_array_equal(kernel(*args), want)  # fast path: o is the one allocation
        assert allocs == [SPEC.o_shape], allocs
        allocs.clear()
        out = at_offset(np.zeros(SPEC.o_shape, np.float32), offset)
        assert kernel(*args, out=out) is out and not allocs  # checked path (out=): no copy either
        np.testing.assert_array_equal(out, want)
    allocs.clear()
    np.testing.assert_array_equal(kernel(at_offset(q, 8), k, v), want)  # 8 bytes off: copied
    assert SPEC.q_shape in allocs
    old = AttentionKernel(SPEC, kernel.function, {k_: v_ for k_, v_ in kernel.manifest.items() if k_ != "data_alignment"})
    assert old.alignment == 64
    allocs.clear()
    np.testing.assert_array_equal(old(*(at_offset(x, 16) for x in (q, k, v))), want)
    assert SPEC.q_shape in allocs  # copied to 64-byte aligned memory, as before
    with pytest.raises(ArtifactError, match="data_alignment must be a power of two, got 24"):
        AttentionKernel(SPEC, kernel.function, {"data_alignment": 24})


class DLPackOnly:
    """A minimal non-NumPy DLPack producer (what a framework tensor looks like to the loader)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class OnGPU(DLPackOnly):
    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA


def test_loader_accepts_dlpack_and_checks_device(artifact):
    kernel = load(artifact)
    q, k, v = random_inputs(SPEC, seed=8)
    out = kernel(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v))
    np.testing.assert_allclose(np.asarray(out), reference_attention(SPEC, q, k, v), atol=1e-4, rtol=1e-4)
    with pytest.raises(KernelArgumentError, match="DLPack device type 2"):
        kernel(OnGPU(q), k, v)


def test_loader_with_torch_tensors(artifact):
    torch = pytest.importorskip("torch", reason="torch not installed (optional peer)")
    kernel = load(artifact)
    q, k, v = random_inputs(SPEC, seed=9)
    out = kernel(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v))
    assert isinstance(out, torch.Tensor)
    np.testing.assert_allclose(out.numpy(), reference_attention(SPEC, q, k, v), atol=1e-4, rtol=1e-4)
    with pytest.raises(KernelArgumentError, match="C-contiguous"):
        kernel(torch.from_numpy(np.repeat(q, 2, axis=3))[..., ::2], k, v)  # strided view, right shape


def test_out_buffer_and_bad_artifacts(artifact, tmp_path):
    kernel = load(artifact)
    q, k, v = random_inputs(SPEC, seed=2)
    with pytest.raises(KernelArgumentError, match="out: must be"):
        kernel(q, k, v, out=np.empty(SPEC.o_shape, np.float32)[:, :, :, :].T.copy().T)
    with pytest.raises(ArtifactError, match="no manifest"):
        load(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"manifest_version": 99}))
    with pytest.raises(ArtifactError, match="manifest_version 99"):
        read_manifest(tmp_path)


def test_failed_validation_is_not_exported(tmp_path):
    b = built(SPEC)
    bad = validate_built(b).__class__(**{**validate_built(b).to_dict(), "passed": False})
    with pytest.raises(ValidationFailed):
        export(b, tmp_path / "x", bad)
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_an_artifact_loads_only_its_own_regular_files(artifact, tmp_path, monkeypatch):
    """A library or runtime that is a symbolic link (to a file outside the folder, or inside it)
    is refused by name; the library loaded is the bytes that were checked, so one swapped
    after the check is refused, never run (the loader reads, hashes and loads a private copy)."""
    import shutil

    import tvm_attention.loader as loader

    for name in ("attention.so", "libtvm_runtime.so"):
        bad = tmp_path / name.split(".")[0]
        shutil.copytree(artifact, bad)
        outside = tmp_path / f"outside-{name}"
        shutil.move(bad / name, outside)
        (bad / name).symlink_to(outside)
        with pytest.raises(ArtifactError, match=f"{name}: a symbolic link"):
            load(bad)
    swapped = tmp_path / "swapped"
    shutil.copytree(artifact, swapped)
    real = loader.check_cpu_features

    def swap_then_check(*a, **k):  # runs after the digests were checked, before the library loads
        (swapped / "attention.so").write_bytes((swapped / "libtvm_runtime.so").read_bytes())
        return real(*a, **k)

    monkeypatch.setattr(loader, "check_cpu_features", swap_then_check)
    with pytest.raises(ArtifactError, match="attention.so: SHA-256 does not match"):
        load(swapped)
    monkeypatch.undo()
    kernel = load(artifact)  # the artifact itself still loads and runs
    q, k, v = random_inputs(SPEC, seed=4)
    assert np.isfinite(kernel(q, k, v)).all()
    for manifest in ([1, 2], {"manifest_version": 1, "entry": "attention", "library": "attention.so", "spec": {},
                              "args": [], "runtime_libraries": {"file": "x"}}):
        broken = tmp_path / f"broken{type(manifest).__name__}"
        shutil.copytree(artifact, broken)
        (broken / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ArtifactError, match="a manifest is a JSON object|runtime_libraries must be a list"):
            load(broken)
