"""Serving without the compiler (issue 23, item 3): in an environment holding only tvm-ffi, NumPy,
ml_dtypes and this project (``serving_env``), ``tvm_attention.load`` runs every CPU layout and
dtype and gives what the loader gives in a process with TVM; nothing imports ``tvm``."""
import json
import subprocess
import textwrap

import numpy as np
import pytest

import serving_env
from tvm_attention.artifact import export, validate_built
from tvm_attention.loader import load
from tvm_attention.spec import AttentionSpec

from conftest import built

#: every layout, every dtype, static and symbolic, with and without lse
SPECS = {
    "bhsd_f32": AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=100, seq_kv=160, head_dim=64, causal=True),
    "bhsd_bf16_dyn": AttentionSpec(batch=1, heads=4, seq_q=64, head_dim=64, dtype="bfloat16",
                                   dynamic=("batch", "seq_q", "seq_kv")),
    "varlen_f16_lse": AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=64, head_dim=64, layout="varlen",
                                    dtype="float16", causal=True, return_lse=True),
    "kvcache_f32": AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=64, head_dim=64, causal=True,
                                 layout="kvcache"),
    "paged_bf16": AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=64, head_dim=64, causal=True,
                                layout="paged", dtype="bfloat16"),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    python = serving_env.shared()
    arts = {}
    for name, spec in SPECS.items():
        b = built(spec)
        export(b, root / name, validate_built(b))
        arts[name] = root / name
    return python, root, arts


def _inputs(spec, seed):
    layout = spec.layout_info
    case = layout.validation_cases(spec)[-1]
    return layout.random_inputs(spec, case, seed)


def test_every_cpu_artifact_runs_with_tvm_ffi_alone_and_matches(env):
    python, root, arts = env
    want = {}
    for name, spec in SPECS.items():  # today's loader, in this process (TVM imported)
        x = _inputs(spec, seed=7)
        np.savez(root / f"{name}_in.npz", **{k: (v.view(np.uint16) if v.dtype.name == "bfloat16" else v)
                                             for k, v in x.items()})
        out = load(arts[name])(*x.values())
        want[name] = out if isinstance(out, tuple) else (out,)
    script = textwrap.dedent(f"""
        import json, sys, time
        t0 = time.perf_counter()
        import numpy as np, ml_dtypes, tvm_attention
        root = {str(root)!r}
        for name in {list(SPECS)!r}:
            k = tvm_attention.load(root + "/" + name)
            x = dict(np.load(root + "/" + name + "_in.npz"))
            if k.spec.dtype == "bfloat16":
                x = {{n: (a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a) for n, a in x.items()}}
            out = k(*x.values())
            out = out if isinstance(out, tuple) else (out,)
            np.savez(root + "/" + name + "_out.npz", *[o.view(np.uint16) if o.dtype.name == "bfloat16" else o
                                                       for o in out])
        print(json.dumps({{"tvm": [m for m in sys.modules if m == "tvm" or m.startswith("tvm.")],
                          "seconds": time.perf_counter() - t0}}))
    """)
    r = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=300, env=serving_env.env())
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["tvm"] == []  # nothing imported tvm
    for name, outs in want.items():
        got = np.load(root / f"{name}_out.npz")
        for i, o in enumerate(outs):
            g = got[f"arr_{i}"]
            o = o.view(np.uint16) if o.dtype.name == "bfloat16" else o
            np.testing.assert_array_equal(g, o, err_msg=name)  # bit for bit: the same library


def test_the_serving_env_cannot_import_the_compiler(env):
    python, _, _ = env
    r = subprocess.run([str(python), "-c", "import tvm"], capture_output=True, text=True, env=serving_env.env())
    assert r.returncode != 0 and "No module named 'tvm'" in r.stderr
    r = subprocess.run([str(python), "-c", "import xgboost"], capture_output=True, text=True, env=serving_env.env())
    assert r.returncode != 0


def test_an_artifact_carries_its_runtime(env):
    _, _, arts = env
    m = json.loads((arts["bhsd_f32"] / "manifest.json").read_text())
    assert [e["file"] for e in m["runtime_libraries"]] == ["libtvm_runtime.so"]
    assert (arts["bhsd_f32"] / "libtvm_runtime.so").stat().st_size > 1 << 20


def test_cpp_example_serves_a_kvcache_artifact(tmp_path, env):
    """examples/cpp/serve_kvcache.cc: tvm-ffi's C API alone loads the artifact, reads its spec,
    runs a decode step that matches its C++ reference, and gets the library's named error for a
    cache_seqlens entry past the cache. (The artifact the module's fixture exported: the same
    validated export, not a second one.)"""
    import os
    import shutil
    from pathlib import Path

    import tvm_ffi

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler here")
    ffi = Path(tvm_ffi.__file__).parent
    exe = tmp_path / "serve_kvcache"
    src = Path(__file__).resolve().parents[1] / "examples" / "cpp" / "serve_kvcache.cc"
    subprocess.run([cxx, "-O2", "-std=c++17", str(src), f"-I{ffi / 'include'}", f"-L{ffi / 'lib'}", "-ltvm_ffi", "-ldl",
                    f"-Wl,-rpath,{ffi / 'lib'}", "-o", str(exe)], check=True, capture_output=True, timeout=300)
    spec = SPECS["kvcache_f32"]
    _, _, arts = env
    r = subprocess.run([str(exe), str(arts["kvcache_f32"]), "3", str(spec.heads), str(spec.kv_heads), "100",
                        str(spec.head_dim)], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stdout + r.stderr
    out = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert int(out["spec_hash"]) == spec.fingerprint()
    assert float(out["max_abs_err"]) < 1e-4
    assert out["error"].startswith("ValueError: cache_seqlens: an entry is negative or larger than max_len")


def test_importing_tvm_after_a_load_keeps_one_runtime(env):
    """Where apache-tvm is installed, load() takes its runtime, not the artifact's copy: a later
    ``import tvm`` then finds it loaded (a second copy would register every function twice and
    abort the process)."""
    import sys

    _, _, arts = env
    script = textwrap.dedent(f"""
        import numpy as np, tvm_attention
        k = tvm_attention.load({str(arts["bhsd_f32"])!r})
        import tvm
        from tvm_attention.validate import validate_callable
        assert validate_callable(k.spec, k).passed
        print(tvm.runtime.tensor(np.ones(3, np.float32)).numpy().sum())
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "3.0", r.stdout + r.stderr[-2000:]


def test_an_installed_package_ships_the_committed_tuning_logs(env):
    """``pip install .`` (not editable) installs the committed logs as package data of
    ``tvm_attention.tuning_logs``, where ``logs.repo_logs_root`` finds them from any folder; before
    (issue 41) they were not shipped, and the checkout's were looked for two folders above the
    package, so a build run from elsewhere silently used the untuned schedule."""
    from tvm_attention.logs import LOGS_PACKAGE, repo_logs_root

    python, root, _ = env
    script = textwrap.dedent(f"""
        import importlib.util, json
        from pathlib import Path
        spec = importlib.util.find_spec({LOGS_PACKAGE!r})
        base = Path(list(spec.submodule_search_locations)[0])
        print(json.dumps(sorted(str(p.relative_to(base)) for p in base.rglob("*.json"))))
    """)
    out = subprocess.run([str(python), "-c", script], cwd=root, capture_output=True, text=True, env=serving_env.env())
    assert out.returncode == 0, out.stderr
    shipped = json.loads(out.stdout)
    committed = sorted(str(p.relative_to(repo_logs_root())) for p in repo_logs_root().rglob("*.json"))
    assert committed and shipped == committed
