"""Defects found by an independent review (issue 14): each test failed before its fix."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import tvm_attention
from tvm_attention import cli
from tvm_attention.artifact import ExportError, export, kernel_of, validate_built
from tvm_attention.build import build_kernel
from tvm_attention.loader import ArtifactError, AttentionKernel, KernelArgumentError, aligned_empty, load
from tvm_attention.reference import random_inputs, reference_attention
from tvm_attention.spec import AttentionSpec, SpecError
from tvm_attention.threads import num_threads
from tvm_attention.schedules._knobs import KnobError

from conftest import built

# Sq == Skv and H == KH, so that out, q, k and v all have one shape and may alias each other.
SPEC = AttentionSpec(batch=1, heads=2, seq_q=64, head_dim=64)
CAUSAL = AttentionSpec(batch=1, heads=2, seq_q=64, head_dim=64, causal=True)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    for name, spec in (("full", SPEC), ("causal", CAUSAL)):
        b = built(spec)
        export(b, root / name, validate_built(b))
    return root


# -- 1. out= overlapping an input -----------------------------------------------------------------
@pytest.mark.parametrize("alias", ["q", "k", "v", "v-view"])
def test_out_sharing_memory_with_an_input_is_rejected(alias):
    kernel = kernel_of(built(SPEC))
    q, k, v = random_inputs(SPEC, seed=1)
    if alias == "v-view":
        n = v.size
        flat = aligned_empty((2 * n,), "float32")
        flat[:n] = v.ravel()
        v = flat[:n].reshape(SPEC.kv_shape)
        out = flat[n // 2: n // 2 + n].reshape(SPEC.o_shape)  # overlaps the second half of v
    else:
        out = {"q": q, "k": k, "v": v}[alias]
    name = alias.split("-")[0]
    with pytest.raises(KernelArgumentError, match=f"out: shares memory with {name}"):
        kernel(q, k, v, out=out)


def test_out_next_to_an_input_is_fine():
    kernel = kernel_of(built(SPEC))
    q, k, v = random_inputs(SPEC, seed=1)
    big = aligned_empty((2, *SPEC.kv_shape), "float32")
    big[0] = v
    o = kernel(q, k, big[0], out=big[1])
    np.testing.assert_allclose(o, reference_attention(SPEC, q, k, v), atol=1e-4, rtol=1e-4)


# -- 14. out= accepts any writeable C-contiguous array ---------------------------------------------
def test_out_accepts_plain_and_misaligned_arrays():
    kernel = kernel_of(built(SPEC))
    q, k, v = random_inputs(SPEC, seed=2)
    ref = reference_attention(SPEC, q, k, v)
    n = int(np.prod(SPEC.o_shape))
    raw = np.empty(n + 16, np.float32)
    off = 1 if raw.ctypes.data % 64 == 0 else 0
    misaligned = raw[off + 1: off + 1 + n].reshape(SPEC.o_shape)
    assert misaligned.ctypes.data % 64 != 0
    for out in (np.empty(SPEC.o_shape, np.float32), misaligned, tvm_attention.aligned_empty(SPEC.o_shape, "float32")):
        got = kernel(q, k, v, out=out)
        assert got is out
        np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(KernelArgumentError, match="out: must be a writeable C-contiguous"):
        ro = np.empty(SPEC.o_shape, np.float32)
        ro.flags.writeable = False
        kernel(q, k, v, out=ro)


# -- issue 41: read-only inputs, out= on the fast path -----------------------------------------------
def test_read_only_inputs_are_read_in_place(tmp_path, monkeypatch):
    """A cache mapped read-only (``np.load(mmap_mode="r")``) or an array whose writeable flag is
    off raised NumPy's ``BufferError: Cannot export readonly array`` naming nothing: the kernel
    only reads them, so they are passed as they are, on the fast path and the checked one."""
    kernel = kernel_of(built(SPEC))
    q, k, v = random_inputs(SPEC, seed=4)
    ref = reference_attention(SPEC, q, k, v)
    np.save(tmp_path / "k.npy", k)
    mapped = np.load(tmp_path / "k.npy", mmap_mode="r")
    q.flags.writeable = False
    np.testing.assert_allclose(kernel(q, mapped, v), ref, atol=1e-4, rtol=1e-4)
    odd = np.empty(v.size + 1, np.float32)[1:].reshape(v.shape)  # misaligned: the checked path copies it
    odd[...] = v
    odd.flags.writeable = False
    np.testing.assert_allclose(kernel(q, mapped, odd), ref, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(kernel, "_prepare", lambda *a: pytest.fail("took the checked path"))
    np.testing.assert_allclose(kernel(q, mapped, v), ref, atol=1e-4, rtol=1e-4)
    assert not mapped.flags.writeable and not q.flags.writeable


def test_out_takes_the_fast_path(monkeypatch):
    """``out=`` took the checked path (159-217 µs a decode call against 73-97 without it):
    an aligned compact buffer of the kind of q goes straight to the library, which checks its
    shape and dtype; one that overlaps an input, or is misaligned, still goes the checked way."""
    kernel = kernel_of(built(SPEC))
    q, k, v = random_inputs(SPEC, seed=5)
    ref = reference_attention(SPEC, q, k, v)
    out = aligned_empty(SPEC.o_shape, "float32")
    with monkeypatch.context() as m:
        m.setattr(kernel, "_prepare", lambda *a: pytest.fail("took the checked path"))
        assert kernel(q, k, v, out=out) is out
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(KernelArgumentError, match="out: shares memory with k"):
        kernel(q, k, v, out=k)
    with pytest.raises(KernelArgumentError, match=r"out: expected shape \(1, 2, 64, 64\)"):
        kernel(q, k, v, out=aligned_empty((1, 2, 32, 64), "float32"))


# -- 5. CUDA out= is written (the CUDA path run on the CPU device) ---------------------------------
def test_cuda_path_writes_out():
    import tvm

    b = built(SPEC)

    class OnCpu(AttentionKernel):
        def _cuda_device(self):
            return tvm.cpu(0)

    kernel = OnCpu(SPEC, b.function, device="cuda")
    q, k, v = random_inputs(SPEC, seed=3)
    out = np.zeros(SPEC.o_shape, np.float32)
    assert kernel(q, k, v, out=out) is out
    np.testing.assert_allclose(out, reference_attention(SPEC, q, k, v), atol=1e-4, rtol=1e-4)
    with pytest.raises(KernelArgumentError, match="out: shares memory with k"):
        kernel(q, k, v, out=k)


# -- 3. a manifest tied to its library --------------------------------------------------------------
def test_library_from_another_build_is_refused(artifacts, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(artifacts / "full", mixed)
    shutil.copy(artifacts / "causal" / "attention.so", mixed / "attention.so")
    with pytest.raises(ArtifactError, match="SHA-256 does not match"):
        load(mixed)
    assert cli.main(["validate", str(mixed)]) == 2
    assert cli.main(["inspect", str(mixed)]) == 2
    assert cli.main(["inspect", str(artifacts / "full")]) == 0


def test_manifest_args_must_match_its_spec(artifacts, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(artifacts / "full", bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["args"][1]["shape"] = [1, 2, 32, 64]
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="args .* disagree with its spec"):
        load(bad)


def test_export_replaces_whole_directory_atomically(artifacts, tmp_path, monkeypatch):
    out = tmp_path / "art"
    shutil.copytree(artifacts / "full", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    b = built(CAUSAL)
    import tvm_attention.artifact as artifact_mod

    def crash(*a, **k):
        raise RuntimeError("crash while writing")

    # A crash after the new library is written, before the manifest is.
    monkeypatch.setattr(artifact_mod, "library_digest", crash, raising=False)
    with pytest.raises(RuntimeError, match="crash"):
        export(b, out, validate_built(b))
    monkeypatch.undo()
    # The old artifact is intact (library included) and loads; no temporary directory is left.
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    load(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    export(b, out, validate_built(b))
    assert json.loads((out / "manifest.json").read_text())["spec"]["causal"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_export_never_replaces_a_directory_with_other_files(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    b = built(SPEC)
    with pytest.raises(ExportError, match="notes.txt"):
        export(b, out, validate_built(b))
    assert (out / "notes.txt").read_text() == "keep me" and sorted(os.listdir(out)) == ["notes.txt"]


# -- 6. the audit's rules ---------------------------------------------------------------------------
def test_audit_catches_a_small_row_buffer_that_grows_with_seq_kv():
    # 131,072 floats of S (2/3 of the score matrix) in "local" scope: scope proves nothing on CPU.
    spec = AttentionSpec(batch=1, heads=1, seq_q=48, seq_kv=4096, head_dim=64)
    report = build_kernel(spec, schedule="rowcache").audit
    assert report.verdict == "not fused", report.format()
    assert any(r.startswith("S (local") and "grows with the sequence length" in r for r in report.reasons)
    assert {a.name: a for a in report.allocations}["S"].grows


def test_audit_passes_a_fused_build_whose_tile_exceeds_the_score_matrix():
    # Qt and acc hold block_m × head_dim floats, more than the score matrix: a big tile, not a
    # matrix. AVX-512: 64 × 320 > 129 × 129; AVX2 (16 registers: 4 vectors of rows, s_rows 2):
    # 32 × 320 > 97 × 97. auto_unroll=0: the audit reads the allocations, which unrolling leaves
    # as they are; the preset's 256 unrolled this big tile for 20 s of LLVM time (now about 1 s)
    from tvm_attention.schedules.cpu_space import max_s_rows
    from tvm_attention.target import resolve_target, vector_lanes

    lanes = vector_lanes(resolve_target("llvm"))
    spec = AttentionSpec(batch=1, heads=1, seq_q=129 if lanes == 16 else 97, head_dim=320)
    b = build_kernel(spec, knobs={"block_m": 4 * lanes, "s_rows": min(4, max_s_rows(4 * lanes, lanes)),
                                  "auto_unroll": 0})
    assert b.audit.fused, b.audit.format()
    assert {a.name: a for a in b.audit.allocations}["Qt"].elements > spec.score_elements()
    assert not any(a.grows for a in b.audit.allocations)
    assert "grows with seq" in b.audit.format()


def test_build_refuses_to_export_a_fused_build_that_fails_the_audit(tmp_path, monkeypatch, capsys):
    import tvm_attention.pipeline as pipeline

    spec = AttentionSpec(batch=1, heads=1, seq_q=64, head_dim=64)
    unfused = build_kernel(spec, schedule="materialized")
    unfused.schedule = "fused"  # a fused-schedule build whose IR is not fused
    monkeypatch.setattr(pipeline, "build_best", lambda *a, **k: (unfused, validate_built(unfused)))
    args = ["build", "--batch", "1", "--heads", "1", "--seq-q", "64", "--head-dim", "64", "--no-log"]
    assert cli.main(args + ["--out", str(tmp_path / "a")]) == 2
    assert "failed the fusion audit" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert cli.main(args + ["--out", str(tmp_path / "b"), "--allow-unfused"]) == 0
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["audit"]["verdict"] == "not fused"


# -- 7. thread count per kernel, per calling thread -------------------------------------------------
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_thread_count_is_a_property_of_each_kernel(artifacts):
    q, k, v = random_inputs(SPEC, seed=4)
    one = load(artifacts / "full", num_threads=1)
    default = load(artifacts / "full")
    assert default.num_threads == len(os.sched_getaffinity(0))
    one(q, k, v)
    assert num_threads() == 1
    default(q, k, v)
    assert num_threads() == default.num_threads  # was: one's setting leaked to every kernel
    seen = {}

    def worker():
        one(q, k, v)
        seen["worker"] = num_threads()
        tvm_attention.set_num_threads(2)
        seen["after set"] = num_threads()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"worker": 1, "after set": 2}
    assert num_threads() == default.num_threads  # the worker's pool is its own


def test_user_tvm_num_threads_is_respected(artifacts, tmp_path):
    script = textwrap.dedent(f"""
        import numpy as np, tvm_attention
        from tvm_attention.reference import random_inputs
        from tvm_attention.spec import AttentionSpec
        from tvm_attention.threads import num_threads
        kernel = tvm_attention.load({str(artifacts / 'full')!r})
        kernel(*random_inputs(AttentionSpec.from_dict(kernel.manifest["spec"])))
        print(kernel.num_threads, num_threads())
    """)
    env = dict(os.environ, TVM_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"]


# -- 10. every head_dim builds on every x86 target --------------------------------------------------
@pytest.mark.parametrize("mcpu,head_dim", [("x86-64-v3", 128), ("nehalem", 64), (None, 512), ("x86-64-v3", 80)])
def test_head_dims_that_overflow_the_registers_split_pv(mcpu, head_dim):
    target = {"kind": "llvm", "mcpu": mcpu} if mcpu else "llvm"
    spec = AttentionSpec(batch=1, heads=1, seq_q=40, seq_kv=70, head_dim=head_dim, causal=True)
    b = build_kernel(spec, target=json.dumps(target) if mcpu else target)
    assert 0 < b.knobs.pv_cols < head_dim or head_dim == 80
    assert b.audit.fused
    assert validate_built(b).passed


def test_pv_rows_1_with_too_many_columns_names_pv_cols():
    spec = AttentionSpec(batch=1, heads=1, seq_q=16, head_dim=128)
    with pytest.raises(KnobError, match="smaller pv_cols"):
        build_kernel(spec, target='{"kind": "llvm", "mcpu": "haswell"}', knobs={"pv_rows": 1, "pv_cols": 0})


# -- 11. small ones ---------------------------------------------------------------------------------
def test_small_input_errors():
    with pytest.raises(SpecError, match="scale"):
        AttentionSpec(batch=1, heads=1, seq_q=8, head_dim=64, scale=3e38)
    with pytest.raises(KnobError, match="JSON object"):
        build_kernel(SPEC, knobs=[])
    with pytest.raises(KnobError, match="auto_unroll must be an int"):
        build_kernel(SPEC, knobs={"auto_unroll": False})
    with pytest.raises(KnobError, match="block_n must be an int"):
        build_kernel(SPEC, knobs={"block_n": 64.0})
    with pytest.raises(SpecError, match="32-bit"):
        AttentionSpec(batch=1, heads=64, seq_q=1 << 20, head_dim=64)
    with pytest.raises(SpecError, match="head_dim"):
        AttentionSpec(batch=1, heads=1, seq_q=8, head_dim=1024)


def test_probe_is_not_refused_by_a_limit_on_the_growing_buffer():
    # rowcache's own row-bytes limit refused the doubled length, the audit fell back to the size
    # rule, and a row buffer of 300k keys (smaller than 64 × 300k scores) passed as fused.
    spec = AttentionSpec(batch=1, heads=1, seq_q=64, seq_kv=300000, head_dim=16)
    report = build_kernel(spec, schedule="rowcache", knobs={"block_m": 16}).audit
    assert not report.fused and "error" not in report.probe, report.format()
    assert {a.name: a for a in report.allocations}["S"].grows


# -- CUDA tensors the way a torch caller hands them (the CUDA path run on the CPU device) -------
class _FakeCudaTensor:
    """A CPU array that says it lives on a CUDA device (DLPack device type 2), as a torch CUDA
    tensor would; ``aligned=False`` makes TVM's from_dlpack refuse it, as it refuses a misaligned
    CUDA view. ``contiguous``/``clone``/``copy_`` as torch's."""

    __module__ = "torch"

    def __init__(self, arr, aligned=True):
        self.arr, self.aligned, self.copies = arr, aligned, 0

    def __dlpack__(self, *args, **kwargs):
        if not self.aligned:
            raise ValueError("FromDLPack: Data is not aligned to 64 bytes.")
        return self.arr.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return (2, 0)

    def contiguous(self):
        return self

    def clone(self):
        self.copies += 1
        from tvm_attention.loader import aligned_empty

        a = aligned_empty(self.arr.shape, self.arr.dtype)
        a[...] = self.arr
        return _FakeCudaTensor(a)

    def copy_(self, src):
        self.arr[...] = np.asarray(src.numpy() if hasattr(src, "numpy") else src)
        return self


def test_cuda_path_copies_misaligned_tensors_and_uses_the_callers_stream(monkeypatch):
    import contextlib

    import tvm

    torch = pytest.importorskip("torch")
    b = built(SPEC)
    entered = []

    class OnCpu(AttentionKernel):
        def _cuda_device(self):
            return tvm.cpu(0)

    @contextlib.contextmanager
    def fake_stream():
        entered.append("torch stream")
        yield

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import tvm_ffi

    monkeypatch.setattr(tvm_ffi, "use_torch_stream", fake_stream)
    kernel = OnCpu(SPEC, b.function, device="cuda")
    q, k, v = random_inputs(SPEC, seed=5)
    want = reference_attention(SPEC, q, k, v)
    args = [_FakeCudaTensor(_aligned(x), aligned=(i != 1)) for i, x in enumerate((q, k, v))]
    out = _FakeCudaTensor(np.zeros(SPEC.o_shape, np.float32), aligned=False)
    assert kernel(*args, out=out) is out
    np.testing.assert_allclose(out.arr, want, atol=1e-4, rtol=1e-4)
    assert args[1].copies == 1 and out.copies == 1 and args[0].copies == 0  # only the misaligned ones
    assert entered == ["torch stream"]  # the kernel ran inside the caller's stream context

    class NoCopy:  # a DLPack CUDA tensor TVM refuses and that cannot be copied: named
        __dlpack__ = _FakeCudaTensor(q, aligned=False).__dlpack__

        def __dlpack_device__(self):
            return (2, 0)

    with pytest.raises(KernelArgumentError, match=r"^q: FromDLPack: Data is not aligned.*contiguous, 64-byte"):
        kernel(NoCopy(), *args[1:])


def _aligned(x):
    from tvm_attention.loader import aligned_empty

    a = aligned_empty(x.shape, x.dtype)
    a[...] = x
    return a
