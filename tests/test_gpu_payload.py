"""The GPU check's payload (issue 23, item 7), built offline: its size, its self-contained CUDA
artifacts (a precompiled fatbin, the runtime once), and a device script that imports neither
``tvm`` nor the build path; the script's reference and validation checked on the CPU."""
import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tvm_attention.cuda_tools import find_nvcc

REPO = Path(__file__).resolve().parents[1]
#: modules the device side must never import: the compiler and everything that needs it
BUILD_SIDE = ("tvm", "tvm_attention.build", "tvm_attention.artifact", "tvm_attention.pipeline",
              "tvm_attention.target", "tvm_attention.lowering", "tvm_attention.audit", "tvm_attention.tune",
              "tvm_attention.workloads", "tvm_attention.schedules")

def _build_side(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in BUILD_SIDE)


pytestmark = pytest.mark.skipif(find_nvcc() is None, reason="nvcc is needed to compile the payload's kernels")


#: the payload the fixture builds: one shape (sm_90, 256 tokens, D=64, fp16, causal) of every kind of
#: build the script makes (static, symbolic, varlen, kvcache, paged, float8 paged, variants)
PAYLOAD_ARGS = ["--arch", "sm_90", "--seq", "256", "--head-dim", "64", "--dtype", "float16", "--causal", "true"]


class _Planned(Exception):
    """Raised by :func:`planned_jobs`'s ``jobs_for`` once it has the script's plan: nothing is built."""


def planned_jobs(tmp_path, args) -> list[dict]:
    """The jobs ``scripts/gpu_payload.py args`` would build, in its order: its own argument parsing
    and ``jobs_for``, stopped before the build pool (no kernel is built)."""
    gp = scripts_module("gpu_payload")
    real, seen = gp.jobs_for, []

    def plan_only(a, kernels_dir):
        seen.extend(real(a, kernels_dir))
        raise _Planned

    gp.jobs_for = plan_only
    try:
        with pytest.raises(_Planned):
            gp.main([*args, "--out", str(tmp_path / "plan")])
    finally:
        gp.jobs_for = real
    return seen


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
    """The payload of ``PAYLOAD_ARGS`` with its CUDA-core kernels only (``--kernels fused_simt``):
    one build of every kind, each exported with its fatbin through the script's pool, the runtime,
    package, device script and run.sh, at a fifth of the full payload's build time (its
    tensor-core builds are the slow ones: 2.4x a CUDA-core build, the paged variants' 6x). The
    list of all 22 kernels the same arguments build is asserted from the script's plan
    (:func:`planned_jobs`); tensor-core builds exported with a fatbin by the same pool worker
    (``gpu_payload.build_job``) are test_cuda_mma's gpu_check test; test_dirrunner's CUDA payload
    checks a tensor-core fatbin too. One pool worker (``--jobs 1``): the script's spawned worker
    is what is checked, not builds side by side, and each worker costs its own import of tvm (a
    second worker: ~3.5 s more CPU for the same 8 builds)."""
    out = tmp_path_factory.mktemp("payload") / "p"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_payload.py"), "--out", str(out), *PAYLOAD_ARGS,
                        "--kernels", "fused_simt", "--jobs", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_payload_plans_every_kernel_kind(tmp_path):
    """The kernels the payload's arguments build, in order (the script's own plan, nothing
    built): the static kernels, then the symbolic build of each that serves every length of
    the same heads, the varlen build of each that serves every packed batch, the decode builds
    (a float8 e4m3 page pool, then the same appending its new token), and the variants (then
    what the call decides: modifiers, a verify step's custom mask and key bounds); each
    tensor-core kernel beside its CUDA-core twin."""
    jobs = planned_jobs(tmp_path, PAYLOAD_ARGS)
    specs = [j["spec"] for j in jobs]
    assert [j["kernel"] for j in jobs] == ["fused_tc", "fused_simt"] * 11
    assert {j["arch"] for j in jobs} == {"sm_90"}
    assert [s.get("layout", "bhsd") for s in specs] == \
        ["bhsd"] * 4 + ["varlen"] * 2 + ["kvcache"] * 2 + ["paged"] * 6 + ["paged"] * 2 + ["bhsd"] * 4 + ["paged"] * 2
    assert [s.get("kv_dtype") for s in specs] == [None] * 10 + ["float8_e4m3fn"] * 4 + [None] * 8
    assert [bool(s.get("append")) for s in specs] == [False] * 12 + [True] * 2 + [False] * 6 + [True] * 2
    assert [bool(s.get("window")) for s in specs] == [False] * 14 + [True] * 4 + [False] * 4
    assert [bool(s.get("score_mod")) for s in specs] == [False] * 18 + [True] * 2 + [False] * 2
    assert [bool(s.get("custom_mask")) for s in specs] == [False] * 20 + [True] * 2
    assert [bool(s.get("dynamic")) for s in specs[:4]] == [False, False, True, True]
    for s in specs[6:14]:  # the decode goal's step: GQA 32:8, batch 64, 4096 keys
        assert (s["heads"], s["kv_heads"], s["batch"], s["seq_kv"]) == (32, 8, 64, 4096)
    # a kernel's twin is the same build on the other kernel; every build its own folder
    assert all(a["spec"] == b["spec"] for a, b in zip(jobs[::2], jobs[1::2]))
    assert len({j["dir"] for j in jobs}) == len(jobs)


def test_hopper_payload_plan(tmp_path):
    """``--hopper``: sm_90 only; each static shape on the Hopper kernel beside the mma.sync one,
    and a symbolic Hopper build per (dtype, head_dim, causal); the decode steps and variants; the
    mma.sync kernel's builds of what the call decides (one short run)."""
    jobs = planned_jobs(tmp_path, ["--hopper", "--seq", "1024", "4096", "--head-dim", "64", "--dtype", "float16"])
    goal = [j for j in jobs if "twin" in j]  # the modifier goal's (test_device_check_of_the_modifier_goal...)
    assert [(j["kernel"], j["spec"]["seq_q"], j["spec"]["causal"], j["twin"]) for j in goal] == \
        [("fused_tc", 4096, True, "relative_bias")]
    jobs = [j for j in jobs if j not in goal]
    casc = [j for j in jobs if "cascade" in j]  # the cascade's (test_device_check_of_the_cascade_on_the_cpu)
    assert [(j["kernel"], j["cascade"], j["spec"]["heads"], j["spec"]["return_lse"]) for j in casc] == \
        [("fused_tc", "prefix", 8, True), ("fused_tc", "suffix", 32, True)]
    assert all(j["serving"]["batch"] == 64 and j["lengths"] == [8192, 512] for j in casc)
    jobs = [j for j in jobs if j not in casc]
    backs = [j for j in jobs if j.get("backward")]  # the backward goal's (test_device_side_of_the_backward_goal)
    assert [(j["kernel"], j["spec"]["head_dim"], j["spec"]["causal"], j["shapes"]) for j in backs] == \
        [("backward_mma", 64, c, [(16, 32, 1024), (4, 32, 4096)]) for c in (False, True)]
    jobs = [j for j in jobs if j not in backs]
    masks = [j for j in jobs if "mask_goal" in j]  # the mask goals' (test_device_check_of_the_mask_goals_on_the_cpu)
    assert [(j["kernel"], j["mask_goal"], j["spec"].get("custom_mask", False)) for j in masks] == \
        [("fused_tc", "sparse", True), ("fused_tc", "verify", True), ("fused_tc", "append", False)]
    jobs = [j for j in jobs if j not in masks]
    mla = [j for j in jobs if "mla" in j]  # the MLA goal's (test_device_check_of_the_mla_goal_on_the_cpu)
    assert [(j["kernel"], j["spec"]["layout"], j["spec"]["heads"], j["spec"].get("kv_dtype")) for j in mla] == \
        [("fused_mla", "mla_paged", 128, None), ("fused_mla", "mla_paged", 128, "float8_e4m3fn")]
    jobs = [j for j in jobs if j not in mla]
    fp8 = [j for j in jobs if j["spec"].get("q_dtype")]  # the fp8 prefill's (the test below)
    assert [(j["kernel"], j["spec"]["seq_q"], j["spec"]["causal"]) for j in fp8] == \
        [("fused_hopper", s, c) for c in (False, True) for s in (1024, 4096)]
    jobs = [j for j in jobs if j not in fp8]
    assert {j["arch"] for j in jobs} == {"sm_90"}
    kinds = [(j.get("column", j["kernel"]), bool(j["spec"].get("dynamic")), j["spec"]["seq_q"]) for j in jobs]
    per_causal = [("fused_hopper", False, 1024), ("hopper_seq", False, 1024), ("fused_tc", False, 1024),
                  ("fused_hopper", False, 4096), ("hopper_seq", False, 4096), ("fused_tc", False, 4096),
                  ("fused_hopper", True, 4096), ("fused_hopper", True, 4096)]  # symbolic, then varlen
    assert kinds[:16] == per_causal * 2
    assert [j["spec"].get("layout", "bhsd") for j in jobs[:16]] == (["bhsd"] * 7 + ["varlen"]) * 2
    # the decode steps: kvcache, paged and an e4m3 page pool on both kernels; then the variants'
    # bhsd build on the Hopper kernel alone (the paged one is the mma.sync kernel's)
    assert [(j["kernel"], j["spec"].get("layout", "bhsd"), j["spec"].get("kv_dtype"), bool(j["spec"].get("window")))
            for j in jobs[16:]] == \
        [("fused_hopper", "kvcache", None, False), ("fused_tc", "kvcache", None, False),
         ("fused_hopper", "paged", None, False), ("fused_tc", "paged", None, False),
         ("fused_hopper", "paged", "float8_e4m3fn", False), ("fused_tc", "paged", "float8_e4m3fn", False),
         ("fused_hopper", "paged", "float8_e4m3fn", False), ("fused_tc", "paged", "float8_e4m3fn", False),
         ("fused_hopper", "bhsd", None, True), ("fused_tc", "bhsd", None, False), ("fused_tc", "paged", None, False)]
    # the variant builds the Hopper kernel does not take (what the call decides): the mma.sync kernel's
    assert [bool(j["spec"].get("append")) for j in jobs[16:]] == [False] * 6 + [True] * 2 + [False] * 2 + [True]
    assert all(j["knobs"] == {"overlap": 0} for j in jobs if j.get("column") == "hopper_seq")



def test_hopper_payload_plans_fp8_prefill(tmp_path):
    """``--hopper`` at head_dim 128 (and 64): an fp8 (e4m3) prefill build of each static shape on
    the Hopper kernel alone (no mma.sync build, no second form), o in the last --dtype."""
    jobs = planned_jobs(tmp_path, ["--hopper", "--seq", "1024", "4096", "--head-dim", "128", "--dtype", "float16",
                                   "--causal", "false"])
    fp8 = [j for j in jobs if j["spec"].get("q_dtype")]
    assert [(j["kernel"], j.get("column"), j["spec"]["seq_q"], j["spec"]["kv_dtype"]) for j in fp8] == \
        [("fused_hopper", None, 1024, "float8_e4m3fn"), ("fused_hopper", None, 4096, "float8_e4m3fn")]
    same = {(j["spec"]["batch"], j["spec"]["heads"], j["spec"]["seq_q"]) for j in jobs
            if j["kernel"] == "fused_hopper" and not j["spec"].get("q_dtype") and not j["spec"].get("dynamic")}
    assert {(j["spec"]["batch"], j["spec"]["heads"], j["spec"]["seq_q"]) for j in fp8} <= same
    assert not [j for j in planned_jobs(tmp_path, ["--hopper", "--seq", "1024", "--head-dim", "96"])
                if j["spec"].get("q_dtype")]


def test_payload_is_small_and_self_contained(payload, tmp_path):
    size = sum(f.stat().st_size for f in payload.rglob("*") if f.is_file())
    # 8 CUDA-core kernels and the runtime; the 16 with the tensor-core ones stayed under 12 MiB, and
    # the full sweep stays under 56 MiB (the script refuses more)
    assert size < 8 * 2**20
    info = json.loads((payload / "payload.json").read_text())
    # what was built is the plan's CUDA-core half, in its order (test_payload_plans_every_kernel_kind)
    plan = [j for j in planned_jobs(tmp_path, PAYLOAD_ARGS) if j["kernel"] == "fused_simt"]
    assert [(k["kernel"], k["spec"]) for k in info["kernels"]] == [(j["kernel"], j["spec"]) for j in plan]
    assert [bool(k["spec"].get("dynamic")) for k in info["kernels"][:2]] == [False, True]
    dims = [["batch", "seq_q", "seq_kv"], ["total_q", "total_k", "batch"]]
    for k, want in zip(info["kernels"][1:3], dims):  # the symbolic and the varlen build
        assert json.loads((payload / k["dir"] / "manifest.json").read_text())["symbolic_dims"] == want
    assert sorted(p.name for p in (payload / "runtime").iterdir()) == ["libtvm_runtime.so", "libtvm_runtime_cuda.so"]
    for k in info["kernels"]:
        d = payload / k["dir"]
        assert "error" not in k and sorted(p.name for p in d.iterdir()) == ["attention.so", "kernel.fatbin", "manifest.json"]
        m = json.loads((d / "manifest.json").read_text())
        assert m["kernel_binary"]["arch"] == "sm_90" and m["kernel_binary"]["format"] == "fatbin"
        # the fatbin is for exactly the source embedded in the library (what TVM's runtime would JIT)
        src = m["kernel_binary"]["source_sha256"]
        assert src and (d / "kernel.fatbin").read_bytes()[:4] == b"\x50\xed\x55\xba"  # fatbin magic
        assert {e["file"] for e in m["runtime_libraries"]} == {"libtvm_runtime.so", "libtvm_runtime_cuda.so"}
    assert (payload / "run.sh").stat().st_mode & 0o111 and "--no-index" in (payload / "run.sh").read_text()


def test_device_script_imports_neither_tvm_nor_the_build_path(payload):
    # statically: its imports, and the package modules they reach
    tree = ast.parse((payload / "gpu_device_check.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not [n for n in names if _build_side(n)], names
    # dynamically: with tvm made unimportable, the script runs up to the GPU it does not find here,
    # after importing tvm_attention and tvm_ffi, and then the loader side it uses
    probe = f"""
import runpy, sys
sys.modules["tvm"] = None
sys.argv = ["gpu_device_check.py", "--payload", {str(payload)!r}, "--out", {str(payload / "out")!r}]
try:
    runpy.run_path({str(payload / "gpu_device_check.py")!r}, run_name="__main__")
except SystemExit as e:
    code = e.code
import tvm_attention.loader, tvm_attention.runtime, tvm_attention.spec, tvm_attention.validate
bad = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in {BUILD_SIDE!r})
             and sys.modules[m] is not None)
print("exit", code, "bad", bad)
"""
    env = dict(os.environ, PYTHONPATH=str(payload))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env,
                       cwd=payload)
    assert "bad []" in r.stdout, r.stdout + r.stderr
    assert "exit 2" in r.stdout and "torch sees no CUDA GPU" in r.stderr


def test_device_reference_and_validation_on_the_cpu(tmp_path):
    """The device script's float64 reference of sampled rows and its validation, run on CPU
    tensors against a CPU artifact (a right kernel passes, a wrong one fails)."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_device_check as dc
    finally:
        sys.path.pop(0)
    from tvm_attention.loader import load
    from tvm_attention.spec import AttentionSpec

    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=100, seq_kv=160, head_dim=64, causal=True)
    exported(tmp_path, "a", spec)
    kernel = load(tmp_path / "a")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(spec.q_shape, generator=g)
    k, v = torch.randn(spec.kv_shape, generator=g), torch.randn(spec.kv_shape, generator=g)
    assert dc.validate(torch, spec, kernel, q, k, v, seed=1)["passed"]
    wrong = lambda q_, k_, v_: kernel(q_, k_, v_) * 1.01  # noqa: E731
    assert not dc.validate(torch, spec, wrong, q, k, v, seed=1)["passed"]
    from tvm_attention.reference import reference_attention

    rows = [0, 7, 99]
    want = reference_attention(spec, q.numpy(), k.numpy(), v.numpy())[:, :, rows]
    np.testing.assert_allclose(dc.reference_rows(torch, spec, q, k, v, rows).numpy(), want, atol=1e-9)


def test_device_check_of_a_symbolic_kernel_on_the_cpu(tmp_path):
    """The device script's check of a symbolic kernel at its awkward shapes, run on CPU tensors
    against a CPU symbolic artifact: every shape passes; a kernel wrong at one length fails
    there, and only there."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_device_check as dc
    finally:
        sys.path.pop(0)
    from tvm_attention.spec import AttentionSpec

    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=64, head_dim=32, causal=True,
                         dynamic=("batch", "seq_q", "seq_kv"))
    entry = [exported(tmp_path, "a", spec)]
    checks = dc.check_symbolic(torch, entry, tmp_path, {"float32": torch.float32}, device="cpu")
    assert [tuple(c["shape"]) for c in checks] == dc.AWKWARD
    assert all(c["passed"] for c in checks), [c for c in checks if not c["passed"]]
    import tvm_attention

    real = tvm_attention.load

    class WrongAt37:  # right everywhere but at seq_q 37
        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, q, k, v):
            o = self.kernel(q, k, v)
            return o * 1.01 if q.shape[2] == 37 else o

    tvm_attention.load = lambda path: WrongAt37(real(path))
    try:
        checks = dc.check_symbolic(torch, entry, tmp_path, {"float32": torch.float32}, device="cpu")
    finally:
        tvm_attention.load = real
    assert [tuple(c["shape"]) for c in checks if not c["passed"]] == [(3, 37, 45), (2, 37, 1)]


def test_device_check_of_a_varlen_kernel_on_the_cpu(tmp_path):
    """The device script's check of a varlen kernel on its ragged batches, run on CPU tensors
    against a CPU varlen artifact: every batch passes (every row of every sequence, exact zeros
    where a sequence has no key); a kernel wrong on one sequence length fails on the batches
    holding it, and only there."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_device_check as dc
    finally:
        sys.path.pop(0)
    from tvm_attention.spec import AttentionSpec

    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=64, head_dim=32, causal=True, layout="varlen")
    entry = [exported(tmp_path, "a", spec)]
    checks = dc.check_varlen(torch, entry, tmp_path, {"float32": torch.float32}, device="cpu")
    assert [c["seqlens"] for c in checks] == [[list(p) for p in lens] for lens in dc.VARLEN_BATCHES]
    assert all(c["passed"] for c in checks), [c for c in checks if not c["passed"]]
    import tvm_attention

    real = tvm_attention.load

    class WrongAt37:  # right everywhere but on a 37-row sequence
        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
            o = self.kernel(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
            lens = torch.diff(cu_seqlens_q).tolist()
            return o * 1.01 if 37 in lens else o

    tvm_attention.load = lambda path: WrongAt37(real(path))
    try:
        checks = dc.check_varlen(torch, entry, tmp_path, {"float32": torch.float32}, device="cpu")
    finally:
        tvm_attention.load = real
    assert [c["seqlens"] for c in checks if not c["passed"]] == [[[37, 45]]]


def scripts_module(name: str):
    """A script of scripts/ as a module (the device check's functions, run here on the CPU)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def exported(tmp_path, name: str, spec) -> dict:
    """A CPU build of ``spec`` exported to ``tmp_path / name``: a payload entry for the checks.
    Exported without ``validate_built``'s run (its result went into the manifest, which nothing
    here reads: 0.2-0.3 s of CPU a kernel): the device script's check each test runs validates the
    kernel against its reference, and asserts it passed."""
    from tvm_attention.artifact import export
    from tvm_attention.validate import ValidationResult

    from conftest import built

    export(built(spec), tmp_path / name, ValidationResult.not_run(spec, "validated by the device script's check"))
    return {"spec": spec.to_dict(), "dir": name}


def test_device_check_of_cache_kernels_on_the_cpu(tmp_path):
    """The device script's check of KV-cache kernels (kvcache, paged) on its mixed cases, run on
    CPU tensors against CPU artifacts: every case passes; a kernel wrong for one cache length
    fails on the cases holding it, and only there. The kernels are test_self_checks.py's PAGED
    and KVCACHE (test_serving_env.py's kvcache_f32 too): one build of each serves the run, through
    its build cache (``conftest.built``; 1.5 s of CPU each)."""
    torch = pytest.importorskip("torch")
    dc = scripts_module("gpu_device_check")
    from tvm_attention.spec import AttentionSpec

    entries = [exported(tmp_path, layout, AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=64, head_dim=64,
                                                        causal=True, layout=layout, page_size=page))
               for layout, page in (("kvcache", None), ("paged", 16))]
    checks = dc.check_cache(torch, entries, tmp_path, {"float32": torch.float32}, device="cpu")
    assert len(checks) == 2 * len(dc.CACHE_CASES)
    assert all(c["passed"] for c in checks), [c for c in checks if not c["passed"]]
    import tvm_attention

    real = tvm_attention.load

    class WrongAt37Keys:  # right everywhere but for a sequence of 37 cached keys
        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, q, *rest):
            o = self.kernel(q, *rest)
            o[rest[-1] == 37] *= 1.01
            return o

    tvm_attention.load = lambda path: WrongAt37Keys(real(path))
    try:
        checks = dc.check_cache(torch, entries, tmp_path, {"float32": torch.float32}, device="cpu")
    finally:
        tvm_attention.load = real
    assert [(c["kernel"], c["case"][0]) for c in checks if not c["passed"]] == [("kvcache", 37), ("paged", 37)]


def test_device_check_of_an_8bit_cache_on_the_cpu(tmp_path):
    """The device script's KV-cache check with a float8 e4m3 page pool (the payload's ``KV8``
    builds), on CPU tensors against a CPU artifact: K and V quantized per KV head in torch, the
    scales passed last, the reference on the dequantized pool; every case passes, and a kernel
    that ignores the value scale fails them."""
    torch = pytest.importorskip("torch")
    dc = scripts_module("gpu_device_check")
    payload = scripts_module("gpu_payload")
    from tvm_attention.spec import AttentionSpec

    spec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=1, seq_kv=64, head_dim=32, causal=True, layout="paged",
                         page_size=16, kv_dtype=payload.KV8)
    entries = [exported(tmp_path, "paged_e4m3", spec)]
    checks = dc.check_cache(torch, entries, tmp_path, {"float32": torch.float32}, device="cpu")
    assert len(checks) == len(dc.CACHE_CASES)
    assert all(c["passed"] for c in checks), [c for c in checks if not c["passed"]]
    import tvm_attention

    real = tvm_attention.load

    class UnitValueScale:  # reads the values as if their scale were 1
        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, *args):
            return self.kernel(*args[:-1], torch.ones_like(args[-1]))

    tvm_attention.load = lambda path: UnitValueScale(real(path))
    try:
        checks = dc.check_cache(torch, entries, tmp_path, {"float32": torch.float32}, device="cpu")
    finally:
        tvm_attention.load = real
    assert not any(c["passed"] for c in checks if any(c["case"][1])), checks


def test_device_check_of_an_appending_kernel_on_the_cpu(tmp_path):
    """The device script's KV-cache check of an appending build (the payload's e4m3 page pool
    that appends its new tokens), on CPU tensors against a CPU artifact: the caches made with
    room, ``k_new``/``v_new`` passed last, the reference on the keys held before the call and
    the new ones quantized by the script, and the cache holding those bit for bit after it;
    every case passes, and a kernel handed other new keys than the call's fails them."""
    torch = pytest.importorskip("torch")
    dc = scripts_module("gpu_device_check")
    payload = scripts_module("gpu_payload")
    from tvm_attention.spec import AttentionSpec

    spec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=1, seq_kv=64, head_dim=32, causal=True, layout="paged",
                         page_size=16, kv_dtype=payload.KV8, append=True)
    entries = [exported(tmp_path, "paged_e4m3_append", spec)]
    checks = dc.check_cache(torch, entries, tmp_path, {"float32": torch.float32}, device="cpu")
    assert len(checks) == len(dc.CACHE_CASES)
    assert all(c["passed"] for c in checks), [c for c in checks if not c["passed"]]
    import tvm_attention

    real = tvm_attention.load

    class OtherKeys:  # appends keys other than the call's
        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, *args):
            return self.kernel(*args[:-2], args[-2] + 1, args[-1])

    tvm_attention.load = lambda path: OtherKeys(real(path))
    try:
        checks = dc.check_cache(torch, entries, tmp_path, {"float32": torch.float32}, device="cpu")
    finally:
        tvm_attention.load = real
    assert not any(c["passed"] for c in checks), checks


def test_device_reference_of_the_call_variants_runs_without_tvm():
    """The device check validates the builds of what the call decides (modifiers, custom masks,
    key bounds) against the package's NumPy reference on a machine without TVM: a subprocess
    that cannot import ``tvm`` computes it for the payload's specs (a modifier once reached for
    TVM's expression types to tell TIR from NumPy)."""
    code = """
import sys
class Block:
    def find_spec(self, name, path, target=None):
        if name == "tvm" or name.startswith("tvm."):
            raise ImportError("no TVM on the GPU machine: " + name)
sys.meta_path.insert(0, Block())
sys.path.insert(0, sys.argv[1])
from tvm_attention.layouts import LAYOUTS
from tvm_attention.spec import AttentionSpec
sys.path.insert(0, sys.argv[1] + "/scripts")
import gpu_payload
for extra in gpu_payload.VARIANT_SPECS:
    spec = AttentionSpec(head_dim=32, dtype="float16", causal=True, **{**extra, "seq_q": min(extra["seq_q"], 16),
                                                                       "seq_kv": 40})
    layout = LAYOUTS[spec.layout]
    for i, case in enumerate(layout.validation_cases(spec)):
        layout.reference_outputs(spec, layout.random_inputs(spec, case, seed=i))
assert "tvm" not in sys.modules
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_device_check_of_variant_kernels_on_the_cpu(tmp_path):
    """The device script's check of builds with attention variants, against the package's
    NumPy reference on their layouts' cases, run on CPU tensors against CPU artifacts: the
    payload's variant specs pass; a kernel 1 % off fails every case."""
    torch = pytest.importorskip("torch")
    dc = scripts_module("gpu_device_check")
    from tvm_attention.spec import AttentionSpec

    entries = [exported(tmp_path, f"v{i}", AttentionSpec(head_dim=32, dtype="float32", causal=True,
                                                         **{**extra, "seq_kv": 64, "seq_q": min(extra["seq_q"], 64)}))
               for i, extra in enumerate(scripts_module("gpu_payload").VARIANT_SPECS)]
    checks = dc.check_variants(torch, entries, tmp_path, device="cpu")
    assert len(checks) >= 3 and all(c["passed"] for c in checks), [c for c in checks if not c["passed"]]
    import tvm_attention

    real = tvm_attention.load

    class Off:  # off by a little everywhere
        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, *args):
            out = self.kernel(*args)
            return (out[0] * 1.01, *out[1:]) if isinstance(out, tuple) else out * 1.01

    tvm_attention.load = lambda path: Off(real(path))
    try:
        checks = dc.check_variants(torch, entries, tmp_path, device="cpu")
    finally:
        tvm_attention.load = real
    assert not any(c["passed"] for c in checks)


def test_prefill_table_with_the_hopper_columns():
    """The device check's table, from rows as its main loop fills them: the Hopper kernel's
    columns and ratios where the payload has it, its first runs' failures listed."""
    check = scripts_module("gpu_device_check")
    spec = {"batch": 4, "heads": 16, "seq_q": 4096, "head_dim": 128, "dtype": "bfloat16", "causal": False}
    rows = {"a": {"spec": spec, "tflops": {"fused_hopper": 600.0, "hopper_seq": 500.0, "fused_tc": 250.0,
                                           "flash": 400.0, "cudnn": 650.0, "flex": 450.0},
                  "errors": {}, "validation": {"fused_hopper": {"passed": True}, "fused_tc": {"passed": True}}}}
    lines = check.prefill_table(rows, "NVIDIA H200", "sm_90", 989.5, [{"dir": "x"}, {"dir": "y"}], {"y": "hang"})
    head = lines[2].split(" | ")
    cells = lines[4].split(" | ")
    assert len(head) == len(cells) and lines[3].count("---") == len(head)
    at = {h.strip("| "): c.strip("| ") for h, c in zip(head, cells)}
    assert at["ours (hopper)"] == "600.0" and at["hopper, no overlap"] == "500.0"
    assert at["hopper/flash"] == "1.50" and at["hopper/cuDNN"] == "0.92" and at["tc/flash"] == "0.62"
    assert at["best ours % peak"] == "60.6" and at["valid"] == "True"
    assert "1/2 passed" in lines[-2] and lines[-1] == "- y: hang"
    plain = check.prefill_table({"a": {**rows["a"], "tflops": {"fused_tc": 250.0}}}, "H200", "sm_90", 989.5, [], {})
    assert "hopper" not in plain[2]
    rows["a"]["tflops"]["hopper_fp8"] = 900.0  # fp8 inputs at the same shape: the fp8 goal's ratio
    lines = check.prefill_table(rows, "NVIDIA H200", "sm_90", 989.5, [], {})
    head, cells = lines[2].split(" | "), lines[4].split(" | ")
    assert len(head) == len(cells) and lines[3].count("---") == len(head)
    at = {h.strip("| "): c.strip("| ") for h, c in zip(head, cells)}
    assert at["hopper fp8"] == "900.0" and at["fp8/fp16"] == "1.50"


def test_device_check_of_fp8_inputs_on_the_cpu():
    """The device script's fp8 check on CPU tensors, with stand-in kernels (no CPU kernel takes
    fp8 inputs): q, k, v quantized per head in torch and their scales passed after them; a kernel
    that computes the attention of ``scale · stored`` (P rounded to e4m3, as the Hopper kernel's)
    passes; one that ignores ``q_scale`` fails."""
    torch = pytest.importorskip("torch")
    dc = scripts_module("gpu_device_check")
    payload = scripts_module("gpu_payload")
    from tvm_attention.spec import AttentionSpec

    spec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=96, seq_kv=160, head_dim=128, dtype="bfloat16",
                         causal=True, q_dtype=payload.FP8, kv_dtype=payload.FP8)
    x = dc.fp8_inputs(torch, spec, torch.bfloat16, "cpu", torch.Generator().manual_seed(0))
    assert [t.dtype for t in x] == [torch.float8_e4m3fn] * 3 + [torch.float32] * 3
    assert [tuple(t.shape) for t in x[3:]] == [(4,), (2,), (2,)]

    def kernel(q, k, v, qs, ks, vs, use_q_scale=True):  # the attention of the dequantized inputs
        g = spec.heads // spec.kv_heads
        qd = q.float() * (qs if use_q_scale else torch.ones_like(qs)).view(1, -1, 1, 1)
        kd, vd = ((t.float() * s.view(1, -1, 1, 1)).repeat_interleave(g, 1) for t, s in ((k, ks), (v, vs)))
        s_ = (qd @ kd.transpose(-1, -2)) * spec.scale
        j, i = torch.arange(spec.seq_kv), torch.arange(spec.seq_q).view(-1, 1)
        p = torch.softmax(s_.masked_fill(j > i + spec.seq_kv - spec.seq_q, float("-inf")), -1)
        p8 = (p / p.amax(-1, keepdim=True)).to(torch.float8_e4m3fn).float() * p.amax(-1, keepdim=True)
        return (p8 @ vd).to(torch.bfloat16)

    good = dc.validate_fp8(torch, spec, kernel, x, seed=0)
    assert good["passed"] and good["max_abs_err"] > 0, good
    bad = dc.validate_fp8(torch, spec, lambda *a: kernel(*a, use_q_scale=False), x, seed=0)
    assert not bad["passed"], bad


def test_device_check_of_the_modifier_goal_on_the_cpu():
    """The modifier goal's pieces of the device script, on the CPU: its FlexAttention twin of the
    payload's relative bias computes what the package's reference does (FlexAttention's
    ``score_mod`` semantics written out in torch: the modifier on each scaled score, then the
    causal mask and the softmax); the validation on sampled rows passes a kernel that computes
    it and fails one that drops the bias; the table's line sets the build against the plain one
    and against FlexAttention."""
    torch = pytest.importorskip("torch")
    dc = scripts_module("gpu_device_check")
    gp = scripts_module("gpu_payload")
    from tvm_attention.spec import AttentionSpec

    spec = AttentionSpec(batch=2, heads=4, seq_q=48, head_dim=16, dtype="float32", causal=True, **gp.MODIFIER_GOAL)
    x = dc.modifier_inputs(torch, spec, torch.float32, "cpu", torch.Generator().manual_seed(0))
    x["bias"] = x["bias"] * 20  # a slope that moves the softmax

    def flex_like(q, k, v, score_mod):  # FlexAttention's semantics in eager torch
        b, h, i, j = (torch.arange(n).view(*[-1 if d == a else 1 for d in range(4)])
                      for a, n in enumerate((q.shape[0], q.shape[1], q.shape[2], k.shape[2])))
        s = score_mod(q @ k.transpose(-1, -2) * spec.scale, b, h, i, j)
        return torch.softmax(s.masked_fill(j > i, float("-inf")), -1) @ v

    twin = dc.FLEX_TWINS[gp.MODIFIER_TWIN](x)
    out = flex_like(x["q"], x["k"], x["v"], twin)
    good = dc.validate_modifier(torch, spec, out, x, seed=0)
    assert good["passed"] and good["max_abs_err"] < 1e-5, good
    plain = flex_like(x["q"], x["k"], x["v"], lambda s, *idx: s)
    assert not dc.validate_modifier(torch, spec, plain, x, seed=0)["passed"]
    key = "b1_h32_kv32_q4096_k4096_d64_float16_causal"
    rows = {key: {"spec": {"batch": 1, "heads": 32, "seq_q": 4096, "head_dim": 64, "dtype": "float16",
                           "causal": True}, "tflops": {"fused_tc": 200.0, "tc_mod": 190.0, "flex_mod": 150.0},
                  "errors": {}, "validation": {"tc_mod": {"passed": True}}}}
    lines = dc.modifier_lines(rows)
    head, cells = lines[3].split(" | "), lines[5].split(" | ")
    at = {h.strip("| "): c.strip("| ") for h, c in zip(head, cells)}
    assert at["time over plain"] == "1.05" and at["ours / flex"] == "1.27" and at["valid"] == "True"
    assert dc.modifier_lines({key: {**rows[key], "tflops": {"fused_tc": 200.0}}}) == []


def test_device_check_of_the_cascade_on_the_cpu(tmp_path):
    """The device script's cascade step on the CPU (CPU builds of a small serving spec's prefix and
    suffix kernels, torch CPU tensors): the step over a shared prefix equals the same kernel over
    whole block tables and the reference; a suffix kernel that is wrong for the plain call's
    length fails it; the table's line sets the cascade against the plain step."""
    torch = pytest.importorskip("torch")
    dc = scripts_module("gpu_device_check")
    import tvm_attention
    from tvm_attention import cascade
    from tvm_attention.spec import AttentionSpec

    serving = AttentionSpec(batch=3, heads=4, kv_heads=2, seq_q=1, seq_kv=88, head_dim=16, causal=True,
                            layout="paged", page_size=16)
    entries = {w: exported(tmp_path, w, f(serving)) for w, f in (("prefix", cascade.prefix_spec),
                                                                  ("suffix", cascade.suffix_spec))}
    kp, ks = (tvm_attention.load(tmp_path / entries[w]["dir"]) for w in ("prefix", "suffix"))
    x = dc.cascade_inputs(torch, serving, 64, 24, torch.float32, "cpu", torch.Generator().manual_seed(0))
    result, calls = dc.cascade_run(torch, serving, kp, ks, x)
    assert result["passed"] and result["max_abs_err"] < 1e-5, result
    assert set(calls) == {"cascade", "plain", "prefix", "suffix", "merge"}
    o, lse = calls["cascade"]()
    assert o.shape == (3, 4, 1, 16) and torch.isfinite(lse).all()

    class WrongOnWholeKeys:  # right on the suffixes, wrong over a sequence's whole 88 keys
        def __init__(self, kernel):
            self.kernel, self.spec = kernel, kernel.spec

        def __call__(self, q, *rest):
            o, lse = self.kernel(q, *rest)
            return (o * 1.01, lse) if int(rest[-1][0]) == 88 else (o, lse)

    assert not dc.cascade_run(torch, serving, kp, WrongOnWholeKeys(ks), x)[0]["passed"]
    lines = dc.cascade_lines([{"kernel": "fused_tc", "serving": serving.to_dict(), "lengths": [64, 24],
                               "us": {"plain": 90.0, "cascade": 30.0, "prefix": 10.0, "suffix": 12.0, "merge": 5.0},
                               "bytes": {"plain": 900, "cascade": 100}, "validation": result}])
    head, cells = lines[3].split(" | "), lines[5].split(" | ")
    at = {h.strip("| "): c.strip("| ") for h, c in zip(head, cells)}
    assert at["plain / cascade"] == "3.00" and at["bytes plain / cascade"] == "9.0" and at["valid"] == "True"
    assert dc.cascade_lines([]) == []


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn", "int8"])
def test_device_check_of_the_mla_goal_on_the_cpu(tmp_path, kv_dtype):
    """The device script's MLA step on the CPU (a CPU build of a small latent page pool, torch CPU
    tensors): the call over shuffled pages equals the float64 reference of every head (an 8-bit
    cache dequantized by its scale); a kernel wrong in one head fails it; the table's line names
    the binding roof and the share of it."""
    torch = pytest.importorskip("torch")
    dc = scripts_module("gpu_device_check")
    import tvm_attention
    from tvm_attention.spec import AttentionSpec

    spec = AttentionSpec(batch=2, heads=16, kv_heads=1, seq_q=1, seq_kv=100, head_dim=64, head_dim_v=32, scale=0.1,
                         causal=True, layout="mla_paged", page_size=16, kv_dtype=kv_dtype)
    kernel = tvm_attention.load(tmp_path / exported(tmp_path, "mla", spec)["dir"])
    x = dc.mla_inputs(torch, spec, 3, 70, "cpu", torch.Generator().manual_seed(0))
    assert x[1].shape == (15, 16, 64) and x[2].shape == (3, 5) and len(x) == 4 + spec.kv_quantized
    good = dc.validate_mla(torch, spec, kernel, x, sequences=[0, 1, 2])
    assert good["passed"] and good["max_abs_err"] < 1e-4, good

    def wrong_in_head_5(*args):
        o = kernel(*args)
        o[:, 5] += 0.01
        return o

    assert not dc.validate_mla(torch, spec, wrong_in_head_5, x)["passed"]
    entry = {"dir": "d", "spec": spec.to_dict(), "batch": 64, "keys": 4096, "us": 400.0, "gbps": 1000.0,
             "tflops": 320.0, "binds": "tensor", "of_roof": 0.32, "validation": good}
    lines = dc.mla_lines([entry], 3.0e12, 989.5)
    head, cells = lines[3].split(" | "), lines[5].split(" | ")
    at = {h.strip("| "): c.strip("| ") for h, c in zip(head, cells)}
    assert at["binds"] == "tensor" and at["of that roof"] == "0.32" and at["batch × keys"] == "64 × 4096"
    assert dc.mla_lines([], None, None) == []


def test_device_check_of_the_mask_goals_on_the_cpu(tmp_path):
    """The device script's mask goals on the CPU (CPU builds, torch CPU tensors): the sparse
    pattern hides 90 % of a row's blocks, each draft of the tree sees the cache and its ancestors;
    the sparse build with every bit set and with the pattern, the verify step through the tree
    (its new keys in the cache afterwards) and the plain append step each match the reference; a
    kernel handed all bits in place of the pattern or the tree fails; the table's lines give the
    goals' ratios."""
    torch = pytest.importorskip("torch")
    dc = scripts_module("gpu_device_check")
    import numpy as np

    import tvm_attention
    from tvm_attention.spec import AttentionSpec

    m = dc.sparse_mask(1280, 1280)
    assert m.mean() == pytest.approx(0.1) and m[:128, :128].all() and not m[:128, 128:1280 - 128].any()
    t = dc.tree_mask(6, 3, seed=1)
    assert t[:, :3].all() and np.diag(t[:, 3:]).all() and not np.triu(t[:, 3:], 1).any()
    specs = {"sparse": AttentionSpec(batch=1, heads=2, seq_q=256, seq_kv=256, head_dim=32, custom_mask=True),
             "verify": AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=8, seq_kv=40, head_dim=32, causal=True,
                                     layout="paged", page_size=16, append=True, custom_mask=True),
             "append": AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=8, seq_kv=40, head_dim=32, causal=True,
                                     layout="paged", page_size=16, append=True)}
    kernels = {g: tvm_attention.load(tmp_path / exported(tmp_path, g, sp)["dir"]) for g, sp in specs.items()}
    for goal, spec in specs.items():
        result, calls = dc.mask_goal_runs(torch, spec, goal, kernels[goal], "cpu", torch.Generator().manual_seed(0))
        assert result["passed"], (goal, result)
        assert set(calls) == {"sparse": {"ones", "masked"}, "verify": {"masked"}, "append": {"plain"}}[goal]

    def all_bits(kernel, at):  # every bit set in place of the mask (the pattern, the tree) it is given
        def call(*args):
            args = list(args)
            args[at] = torch.full_like(args[at], 255)
            return kernel(*args)
        return call

    for goal, at in (("sparse", 3), ("verify", 5)):
        spec = specs[goal]
        result, _ = dc.mask_goal_runs(torch, spec, goal, all_bits(kernels[goal], at), "cpu",
                                      torch.Generator().manual_seed(0))
        assert not result["passed"], goal
    entries = [{"goal": "sparse", "us": {"ones": 1000.0, "masked": 160.0}, "validation": {"passed": True}},
               {"goal": "verify", "us": {"masked": 60.0}, "validation": {"passed": True}},
               {"goal": "append", "us": {"plain": 50.0}, "validation": {"passed": True}}]
    lines = dc.mask_lines(entries)
    head = [h.strip("| ") for h in lines[3].split(" | ")]
    rows = [{h: c.strip("| ") for h, c in zip(head, line.split(" | "))} for line in lines[5:7]]
    assert [r["ratio"] for r in rows] == ["6.25", "1.20"] and [r["goal"] for r in rows] == ["≥ 5.0", "≤ 1.3"]
    assert dc.mask_lines([]) == []


def test_device_side_of_the_backward_goal():
    """The backward goal's pieces that run without a GPU: FlashAttention's FLOP count (five products,
    halved when causal), the comparison of ours with the peer's gradients (a share of the largest
    gradient; fails past the tolerance or on a non-finite value), the table's line."""
    torch = pytest.importorskip("torch")
    dc = scripts_module("gpu_device_check")
    from tvm_attention.spec import AttentionSpec

    assert dc.backward_flops(1, 2, 1024, 64, False) == 10.0 * 2 * 1024 * 1024 * 64
    assert dc.backward_flops(1, 2, 1024, 64, True) == dc.backward_flops(1, 2, 1024, 64, False) / 2
    g = [torch.randn(2, 3, 8, 4) for _ in range(3)]
    assert dc.compare_grads(torch, [x.clone() for x in g], g)["passed"]
    off = [g[0] * 1.05, g[1], g[2]]
    bad = dc.compare_grads(torch, off, g)
    assert not bad["passed"] and 0.04 < bad["max_rel_error"] < 0.06
    nan = [g[0].clone(), g[1], g[2]]
    nan[0][0, 0, 0, 0] = float("nan")
    assert not dc.compare_grads(torch, nan, g)["passed"]
    spec = AttentionSpec(batch=1, heads=32, seq_q=4096, head_dim=64, dtype="float16", causal=True)
    lines = dc.backward_lines([{"spec": spec.to_dict(), "shape": [4, 32, 4096], "ours_tflops": 300.0,
                                "flash_tflops": 250.0, "ratio": 1.2, "validation": {"passed": True}}])
    head, cells = lines[3].split(" | "), lines[5].split(" | ")
    at = {h.strip("| "): c.strip("| ") for h, c in zip(head, cells)}
    assert at["ours / flash"] == "1.20" and at["B×H"] == "4×32" and at["valid"] == "True"
    assert dc.backward_lines([]) == []


def test_decode_table_sets_each_8bit_step_beside_the_16bit_one():
    """The device check's decode lines: every step against the streaming read, and each 8-bit
    cache's step over the 16-bit cache's of the same kernel, layout, head_dim and step (the
    e4m3 goal's ratio); a failed step is listed, never paired."""
    check = scripts_module("gpu_device_check")
    base = {"batch": 64, "heads": 32, "kv_heads": 8, "seq_q": 1, "seq_kv": 4096, "head_dim": 64, "dtype": "float16",
            "causal": True, "layout": "paged", "page_size": 16}
    e4 = {**base, "kv_dtype": "float8_e4m3fn"}
    ok = {"passed": True}
    decode = [{"kernel": "fused_hopper", "spec": base, "batch": 64, "keys": 4096, "us": 100.0, "gbps": 2.0,
               "of_stream": 0.8, "validation": ok},
              {"kernel": "fused_hopper", "spec": e4, "batch": 64, "keys": 4096, "us": 55.0, "gbps": 1.9,
               "of_stream": 0.75, "validation": ok},
              {"kernel": "fused_tc", "spec": e4, "batch": 64, "keys": 4096, "error": "RuntimeError: x"},
              {"kernel": "fused_hopper", "spec": e4, "batch": 1, "keys": 32768, "us": 9.0, "validation": ok}]
    lines = check.decode_table(decode, 3e12)
    assert "3000 GB/s" in lines[1] and sum(line.startswith("| fused_") for line in lines) == 4 + 1
    assert lines[-1] == "| fused_hopper | paged p16 | float8_e4m3fn | 64 | 64 × 4096 | 55.0 | 100.0 | 0.55 |"
    assert all(set(e) <= {"kernel", "spec", "batch", "keys", "us", "gbps", "of_stream", "validation", "error"}
               for e in decode)  # the entries (check.json's) left as they were
