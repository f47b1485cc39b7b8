"""What the exported library checks by itself (issue 23): the CPU features it needs, the spec it
was built from, every index it reads; the small bad inputs found by trying them; a crashed test
worker failing its test instead of hanging the run."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tvm_attention import cli
from tvm_attention.artifact import export, validate_built
from tvm_attention.build import build_kernel
from tvm_attention.hostcpu import HOST_CPU_ENV, HostCPUError, host_features, missing_features
from tvm_attention.layouts import LAYOUTS
from tvm_attention.loader import ArtifactError, KernelArgumentError, aligned_empty, load
from tvm_attention.spec import AttentionSpec

from conftest import built

TESTS = Path(__file__).parent
ZNVER4 = {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}


def _aligned(x):
    a = aligned_empty(x.shape, x.dtype)
    a[...] = x
    return a


def _raw(kernel, *args):
    """Call the exported function itself, as a C++ caller would: no loader checks."""
    kernel.function(*map(_aligned, args))


# -- the index arrays: checked by the library before any K/V read --------------------------------
PAGED = AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=64, head_dim=64, causal=True, layout="paged")
KVCACHE = AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=64, head_dim=64, causal=True, layout="kvcache")
VARLEN = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=64, head_dim=64, layout="varlen")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    out = {}
    for spec in (PAGED, KVCACHE, VARLEN):
        b = built(spec)
        d = tmp_path_factory.mktemp(spec.layout)
        export(b, d, validate_built(b))
        out[spec.layout] = d
    return out


def _paged_inputs():
    """An 8-page pool (page_size 16, 2 kv heads), sequences of 64 and 40 keys in pages 0-3, 4-7."""
    rng = np.random.default_rng(0)
    k_pages, v_pages = (rng.standard_normal((8, 16, 2, 64), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((2, 8, 1, 64), dtype=np.float32)
    table = np.arange(8, dtype=np.int32).reshape(2, 4)
    return q, k_pages, v_pages, table, np.array([64, 40], np.int32), np.zeros((2, 8, 1, 64), np.float32)


@pytest.mark.parametrize("entry", [-1, -2, 8, 9, 10**7])
def test_paged_block_table_entries_are_checked_by_the_library(artifacts, entry):
    kernel = load(artifacts["paged"])
    q, kp, vp, table, lens, o = _paged_inputs()
    _raw(kernel, q, kp, vp, table, lens, o)  # valid
    bad = table.copy()
    bad[1, 2] = entry  # the third page of the 40-key sequence: read
    with pytest.raises(ValueError, match=r"block_table: an entry a sequence uses .* \[0, num_pages\)"):
        _raw(kernel, q, kp, vp, bad, lens, o)
    bad = table.copy()
    bad[1, 3] = entry  # past the sequence's last page: never read, whatever it holds
    _raw(kernel, q, kp, vp, bad, lens, o)


@pytest.mark.parametrize("length", [65, 10**6, -1])
def test_paged_and_kvcache_lengths_are_checked_by_the_library(artifacts, length):
    kernel = load(artifacts["paged"])
    q, kp, vp, table, _, o = _paged_inputs()
    with pytest.raises(ValueError, match="cache_seqlens: an entry is negative or larger than max_pages"):
        _raw(kernel, q, kp, vp, table, np.array([length, 3], np.int32), o)
    kernel = load(artifacts["kvcache"])
    kc, vc = (np.zeros((2, 2, 64, 64), np.float32) for _ in range(2))  # max_len 64
    bad = 128 if length == 65 else length
    with pytest.raises(ValueError, match=r"cache_seqlens: an entry is negative or larger than max_len"):
        _raw(kernel, q, kc, vc, np.array([3, bad], np.int32), o)


@pytest.mark.parametrize("cu_q, cu_k, message", [
    ([0, 16], [0, 64], "cu_seqlens_k: last entry must equal total_k"),  # 16 rows of k
    ([0, 8, 16], [0, 10, 8], "cu_seqlens_k: must be non-decreasing"),
    ([1, 16], [0, 16], "cu_seqlens_q: must start at 0"),
    ([0, 9, 15], [0, 8, 16], "cu_seqlens_q: last entry must equal total_q"),
])
def test_varlen_offsets_are_checked_by_the_library(artifacts, cu_q, cu_k, message):
    kernel = load(artifacts["varlen"])
    rng = np.random.default_rng(0)
    q = rng.standard_normal((16, 4, 64), dtype=np.float32)
    k = rng.standard_normal((16, 2, 64), dtype=np.float32)
    o = np.zeros_like(q)
    _raw(kernel, q, k, k, np.array([0, 16], np.int32), np.array([0, 16], np.int32), o)
    with pytest.raises(ValueError, match=message):
        _raw(kernel, q, k, k, np.array(cu_q, np.int32), np.array(cu_k, np.int32), o)
    with pytest.raises(ValueError, match="cu_seqlens_q: empty"):
        _raw(kernel, q, k, k, np.zeros(0, np.int32), np.zeros(0, np.int32), o)


# -- item 6: small bad inputs ------------------------------------------------------------------
def test_paged_with_every_sequence_empty_and_no_table_column_gives_zeros(artifacts):
    kernel = load(artifacts["paged"], num_threads=1)
    q, kp, vp, _, _, _ = _paged_inputs()
    o = kernel(q, kp, vp, block_table=np.zeros((2, 0), np.int32), cache_seqlens=np.zeros(2, np.int32))
    assert o.shape == (2, 8, 1, 64) and not o.any()


def test_varlen_bad_options_and_empty_offsets_are_named(artifacts):
    kernel = load(artifacts["varlen"])
    q = np.zeros((16, 4, 64), np.float32)
    k = np.zeros((16, 2, 64), np.float32)
    cu = np.array([0, 16], np.int32)
    with pytest.raises(KernelArgumentError, match="cu_seqlens_q: empty"):
        kernel(q, k, k, cu_seqlens_q=np.zeros(0, np.int32), cu_seqlens_k=np.zeros(0, np.int32))
    with pytest.raises(KernelArgumentError, match=r"max_seqlen_q: expected an int .*'abc'"):
        kernel(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q="abc")
    with pytest.raises(KernelArgumentError, match=r"softmax_scale: expected a number, got 'x'"):
        kernel(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, softmax_scale="x")
    kernel(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=np.int32(16))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit(d, fn):
    path = d / "manifest.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def test_manifest_entry_and_library_must_be_the_artifacts_own(artifacts, tmp_path, capsys):
    d = _copy(artifacts["kvcache"], tmp_path / "entry")
    # another name, or the library's other function (it loaded, then every call failed with
    # "Expected 0 arguments"): refused at load (issue 41)
    for entry in ("nope", AttentionSpec.SPEC_FUNCTION):
        _edit(d, lambda m: m.update(entry=entry))
        with pytest.raises(ArtifactError, match=f"entry '{entry}' is not the attention function"):
            load(d)
        assert cli.main(["validate", str(d)]) == 2  # not 1: 1 means "the kernel computes wrong results"
        assert f"entry '{entry}' is not the attention function" in capsys.readouterr().err
    outside = tmp_path / "elsewhere.so"
    shutil.copy(d / "attention.so", outside)
    d2 = _copy(artifacts["kvcache"], tmp_path / "lib")
    for name in ("../elsewhere.so", str(outside), "..", ""):
        _edit(d2, lambda m: m.update(library=name))
        with pytest.raises(ArtifactError, match="must be a file name inside the artifact directory"):
            load(d2)


@pytest.mark.parametrize("field, value", [("causal", False), ("scale", 0.5), ("kv_heads", 8)])
def test_an_edited_manifest_is_refused_by_the_library(artifacts, tmp_path, capsys, field, value):
    d = _copy(artifacts["kvcache"], tmp_path / "a")
    m = json.loads((d / "manifest.json").read_text())
    assert m["spec_hash"] == AttentionSpec.from_dict(m["spec"]).fingerprint()

    def edit(m):
        m["spec"][field] = value
        m["args"] = AttentionSpec.from_dict(m["spec"]).arg_specs()  # a consistent lie

    _edit(d, edit)
    with pytest.raises(ArtifactError, match="is not the one the library was built from"):
        load(d)
    assert cli.main(["inspect", str(d)]) == 2
    assert "is not the one the library was built from" in capsys.readouterr().err
    assert cli.main(["inspect", str(artifacts["kvcache"])]) == 0
    assert "spec check: confirmed by the library's attention_spec_hash()" in capsys.readouterr().out


def test_cli_rejects_dyn_zero(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's usage error: exit 2, naming the flag
        cli.main(["build", "--heads", "2", "--head-dim", "64", "--batch", "1", "--seq-q", "dyn:0",
                  "--out", "unused"])
    assert e.value.code == 2
    assert "--seq-q: 'dyn:0': expected dyn or dyn:N with N a positive int" in capsys.readouterr().err


def test_transformers_head_dim_past_the_limit_is_unsupported():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tvm_attention.integrations import transformers as tx

    q = torch.zeros(1, 2, 4, 1024)

    class M(torch.nn.Module):
        is_causal = True

    with pytest.raises(tx.UnsupportedAttention, match="head_dim"):
        tx.attention_forward(M(), q, q, q, None)


# -- CPU features: never execute what the host cannot run ---------------------------------------
def test_host_features_are_what_the_cpu_offers():
    have = host_features()
    assert {"sse2", "avx2", "fma"} <= have  # every machine this project runs on
    assert missing_features(["avx2", "fma", "fast-scalar-fsqrt", "64bit"]) == []  # tuning flags ignored


def test_the_override_makes_this_host_an_avx2_one(monkeypatch):
    monkeypatch.setenv(HOST_CPU_ENV, "x86-64-v3")
    from tvm_attention.target import resolve_target, runnable_here, vector_lanes

    assert "avx512f" not in host_features()
    target = resolve_target("llvm")
    assert target.attrs["mcpu"] == "x86-64-v3" and vector_lanes(target) == 8 and runnable_here(target)
    assert not runnable_here(resolve_target(ZNVER4))
    monkeypatch.setenv(HOST_CPU_ENV, "not-a-cpu")
    with pytest.raises(HostCPUError, match="not-a-cpu"):
        host_features()


def test_a_build_for_a_cpu_the_host_lacks_is_cross_compiled_never_run(tmp_path, monkeypatch):
    """Under the AVX2 override (any host): a znver4 build exports with its validation not run,
    refuses to run, and its artifact is refused by ``load``, naming avx512f."""
    monkeypatch.setenv(HOST_CPU_ENV, "x86-64-v3")
    spec = AttentionSpec(batch=1, heads=2, seq_q=64, head_dim=64)
    b = build_kernel(spec, target=ZNVER4)
    assert "avx512f" in b.cpu_features
    v = validate_built(b)
    assert not v.ran and "avx512f" in v.reason
    with pytest.raises(HostCPUError, match="avx512f"):
        b.function
    export(b, tmp_path / "a", v)
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert "avx512f" in m["cpu_features"] and m["validation"]["ran"] is False
    with pytest.raises(ArtifactError, match=r"needs CPU features .*avx512f.* TVM_ATTENTION_HOST_CPU=x86-64-v3"):
        load(tmp_path / "a")


def test_cli_cross_compiles_and_refuses_to_run_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(HOST_CPU_ENV, "x86-64-v3")
    flags = ["--heads", "2", "--seq-q", "64", "--head-dim", "64", "--batch", "1", "--target", json.dumps(ZNVER4)]
    assert cli.main(["build", *flags, "--out", str(tmp_path / "a"), "--no-log"]) == 0
    out = capsys.readouterr().out
    assert "validation: NOT RUN (cross-compiled: this CPU lacks" in out and "avx512f" in out
    assert cli.main(["validate", str(tmp_path / "a")]) == 2
    assert "avx512f" in capsys.readouterr().err
    assert cli.main(["inspect", str(tmp_path / "a")]) == 0
    assert "spec check: not checked (this CPU lacks" in capsys.readouterr().out
    assert cli.main(["tune", *flags, "--trials", "1", "--work-dir", str(tmp_path / "log")]) == 2
    assert "avx512f" in capsys.readouterr().err and not (tmp_path / "log").exists()


# -- the suite itself: a crash fails its test, it never hangs the run ---------------------------
def test_a_crashing_test_fails_once_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_crash.py").write_text(textwrap.dedent("""
        import os, signal
        def test_before(): pass
        def test_sigill(): os.kill(os.getpid(), signal.SIGILL)
        def test_after(): pass
    """))
    (tmp_path / "test_other.py").write_text("def test_other(): pass\n")
    env = dict(os.environ, PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist_crash_once", "-n", "2",
                        "--dist", "loadfile", "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "1 failed, 3 passed" in r.stdout, r.stdout[-2000:]
    assert "crashed while running 'test_crash.py::test_sigill'" in r.stdout


def test_known_cpus_are_what_llvm_gives():
    """The override's table (serving processes have no compiler to ask) is LLVM's answer."""
    from tvm_attention.hostcpu import KNOWN_CPUS, _llvm_cpu_features, isa_subset

    for cpu, features in KNOWN_CPUS.items():
        assert sorted(features.split()) == isa_subset(_llvm_cpu_features(cpu)), cpu
