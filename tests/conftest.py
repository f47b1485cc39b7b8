import atexit
import functools
import os
import shutil
import tempfile

import numpy as np
import pytest

# Every test sees its own per-user cache (tuning logs): nothing reads or writes the real one.
_CACHE = tempfile.mkdtemp(prefix="tvma-test-cache-")
os.environ["TVM_ATTENTION_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)
# One build cache (tvm_attention.build_cache) for the whole run: the first process to load this file
# (pytest-xdist's controller, or the only process with -n 0) makes it and removes it at exit; the
# workers it starts, and the CLI subprocesses of the tests, inherit the variables. Never the user's.
if "_TVMA_TEST_BUILD_CACHE" not in os.environ:
    os.environ["_TVMA_TEST_BUILD_CACHE"] = tempfile.mkdtemp(prefix="tvma-test-builds-")
    atexit.register(shutil.rmtree, os.environ["_TVMA_TEST_BUILD_CACHE"], True)
os.environ["TVM_ATTENTION_BUILD_CACHE_DIR"] = os.environ["_TVMA_TEST_BUILD_CACHE"]
# Likewise one folder for what the run's files share read-only across workers (the serving venv:
# serving_env.shared), made by the first process, inherited by the workers, removed at exit.
if "_TVMA_TEST_SHARED" not in os.environ:
    os.environ["_TVMA_TEST_SHARED"] = tempfile.mkdtemp(prefix="tvma-test-shared-")
    atexit.register(shutil.rmtree, os.environ["_TVMA_TEST_SHARED"], True)
os.environ["TVM_ATTENTION_BUILD_CACHE"] = "1"
# every measurement (tuning candidates, run's timing, benchmarks) runs a tenth of its least time:
# the tests check what a tune or a benchmark does, never its figures (tvm_attention.timing)
os.environ["TVM_ATTENTION_MEASURE_SCALE"] = "0.1"
os.environ["TVM_ATTENTION_BUILD_CACHE_MAX_MB"] = "16384"  # a run's builds: a few GB at most, never evicted
# Tests tune many times per process: keep the tuner's worker processes between tunes
# (tvm_attention.tune.driver.keep_workers; test_tune checks both settings).
os.environ["TVM_ATTENTION_KEEP_WORKERS"] = "1"

from xdist_crash_once import pytest_xdist_make_scheduler  # noqa: F401 - a hook: a crash fails its test once

from tvm_attention.build import build_kernel
from tvm_attention.artifact import kernel_of
from tvm_attention.threads import set_num_threads


@pytest.fixture(scope="session", autouse=True)
def _threads():
    set_num_threads()


class LazyModule:
    """Module ``name``, imported when a test first reads an attribute of it. Every xdist worker
    collects every file and one of them runs it: a heavy import at a test module's top (transformers'
    model code, 4-6 s of CPU) is paid by each worker at collection, for nothing in all but one.
    ``available`` says whether it is installed, without importing it (for a module-level skip)."""

    def __init__(self, name: str):
        self._name = name

    @property
    def available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec(self._name) is not None

    def __getattr__(self, attr: str):
        import importlib

        return getattr(importlib.import_module(self._name), attr)


def preset_takes_bf16_dots() -> bool:
    """Whether this host's bf16 presets are the dot-product forms (``dot_bf16``, ``decode_dot``
    1 and 2): AVX512-BF16 and dot products that outrun the FMAs (``schedules.cpu_balance``: a Zen
    4, not an Intel core, which issues vdpbf16ps on one port)."""
    from tvm_attention.schedules.cpu_balance import dots_outrun_fmas
    from tvm_attention.target import resolve_target

    return dots_outrun_fmas(resolve_target("llvm"))


def make_tasks_once(around=None):
    """A ``make_tasks(spec, target, schedule)`` that makes each triple's tasks once (the tuner's
    ``tvm_attention.tune.tasks.make_tasks``: a workload generated per task, ~0.3 s of CPU for a small
    spec) and hands out a new list of the same tasks each call: a file's tunes of one spec, patched
    into ``driver.make_tasks``, get what they made before. ``around(target)``: a context the tasks
    are made in (e.g. patching the task list's source)."""
    import contextlib

    from tvm_attention.tune.tasks import make_tasks

    made = {}

    def once(spec, target, schedule):
        key = (spec, str(target), schedule)
        if key not in made:
            with around(target) if around else contextlib.nullcontext():
                made[key] = make_tasks(spec, target, schedule)
        return list(made[key])

    return once


def built(spec, schedule="fused", knobs=None):
    """Build once per (spec, schedule, knobs) for the whole session, however they are passed
    (lru_cache alone keys ``built(s)`` and ``built(s, knobs=None)`` apart)."""
    return _built(spec, schedule, knobs)


@functools.lru_cache(maxsize=None)
def _built(spec, schedule, knobs):
    # through the run's build cache: a kernel another file (another worker) built is loaded
    return build_kernel(spec, schedule=schedule, knobs=dict(knobs) if knobs else None, cache=True)


def run_kernel(spec, q, k, v, schedule="fused", knobs=None):
    return kernel_of(built(spec, schedule, knobs))(q, k, v)


#: (batch, seq_q, seq_kv) a symbolic CUDA kernel meets: one key, a key tail, Sq > Skv, decode rows
#: over a long cache, no key at all (zero rows)
SYMBOLIC_SHAPES = [(1, 1, 1), (3, 37, 45), (1, 113, 203), (3, 1, 517), (1, 300, 45), (2, 37, 1), (1, 5, 0)]


def check_emulated_symbolic(ex, spec) -> None:
    """Run an emulated symbolic BHSD kernel ``ex`` (compiled for the CPU) at every shape of
    ``SYMBOLIC_SHAPES`` against the reference; a row that sees no key must be exactly zero."""
    import tvm

    from tvm_attention.layouts import LAYOUTS
    from tvm_attention.reference import reference_attention
    from tvm_attention.validate import TOLERANCES

    atol, rtol = TOLERANCES[spec.dtype]
    for b, sq, sk in SYMBOLIC_SHAPES:
        x = LAYOUTS["bhsd"].random_inputs(spec, {"batch": b, "seq_q": sq, "seq_kv": sk}, seed=sq * 7 + sk)
        o = tvm.runtime.empty((b, spec.heads, sq, spec.head_dim), spec.dtype)
        lse = [tvm.runtime.empty((b, spec.heads, sq), "float32")] if spec.return_lse else []
        ex["attention"](*[tvm.runtime.tensor(x[n]) for n in ("q", "k", "v")], o, *lse)
        out = o.numpy().astype(np.float64)
        ref, ref_lse = reference_attention(spec, x["q"], x["k"], x["v"], return_lse=True)
        if lse:
            check_lse(lse[0].numpy(), ref_lse, (b, sq, sk))
        assert np.isfinite(out).all(), (b, sq, sk)
        assert np.allclose(out, ref, atol=atol, rtol=rtol), ((b, sq, sk), np.abs(out - ref).max())
        if sk == 0:
            assert not out.any()  # no key: zero rows


#: varlen batches (seq_q, seq_kv per sequence) for the emulated CUDA kernels: empty sequences,
#: one row, Sq above and below Skv, no keys, tails, a long one among short ones
VARLEN_BATCHES = [[(0, 7), (1, 1), (70, 33), (33, 70), (5, 0), (129, 129), (0, 0), (3, 200)], [(37, 45)],
                  [(1, 1)] * 3, [(300, 45), (5, 0)]]


#: the attention variants on the CUDA kernels, one spread of them per case (emulated, GQA 4:2,
#: 37 × 45): (layout, page size, dynamic dims, variants); each test picks the dtypes
CUDA_VARIANT_SPREADS = [
    ("bhsd", None, (), dict(window=(16, 0), causal=True)),
    ("bhsd", None, ("batch", "seq_q", "seq_kv"), dict(window=(8, 3), softcap=30.0)),
    ("bhsd", None, ("batch", "seq_q", "seq_kv"), dict(kv_start=True, alibi=True, causal=True)),
    ("varlen", None, (), dict(alibi=True, sinks=True, causal=True)),
    ("kvcache", None, (), dict(kv_start=True, window=(20, 0), causal=True, return_lse=True)),
    ("paged", 16, (), dict(alibi=True, softcap=20.0, sinks=True, causal=True)),
]
CUDA_VARIANT_IDS = [f"{c[0]}-{'-'.join(c[3])}" for c in CUDA_VARIANT_SPREADS]

#: a window open on the left and bounded on the right, ``(-1, 23)``, on the CUDA kernels (emulated,
#: GQA 4:2, with lse): rows at positions p < -23 see no key and must give zeros and -inf, not NaN.
#: (layout, seq_q, seq_kv): static bhsd, 40 rows over 9 keys (its first 8 rows: the build-time
#: test); kvcache, symbolic (run time), whose validation cases hold 27 new tokens over 1 and 3 keys
RIGHT_WINDOW_SHAPES = [("bhsd", 40, 9), ("kvcache", 1, 64)]


def right_window_spec(layout: str, seq_q: int, seq_kv: int, dtype: str) -> "AttentionSpec":
    """The spec of a ``RIGHT_WINDOW_SHAPES`` entry."""
    from tvm_attention.spec import AttentionSpec

    return AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=seq_q, seq_kv=seq_kv, head_dim=64, layout=layout,
                         dtype=dtype, window=(-1, 23), return_lse=True)

#: KV-cache lengths that split-KV cuts (chunks of ``fused.MIN_SPLIT_KEYS`` = 256 keys at least):
#: none, under one chunk, at and past a chunk's edge, several chunks; a tiny one beside them
SPLIT_KV_LENGTHS = [0, 1, 255, 256, 257, 700, 1100, 3]


def split_kv_cases(layout: str) -> list[dict]:
    """Calls of a KV-cache layout (GQA 4:2) at which a split-KV build with ``split_tasks=64``
    splits: a decode step of 8 sequences (4 chunks each), 4 new tokens, one long sequence alone
    (32 chunks, most of them past its keys), and a 37-token prefill chunk whose packed rows
    fill more than one row tile (no split: it stores its rows itself), and a batch of 32 whose
    32 · 2 (sequence, KV head) tasks reach ``split_tasks`` (no split: the workspace is one
    tile, which no chunk may write)."""
    cases = [{"seq_q": 1, "cache_seqlens": SPLIT_KV_LENGTHS}, {"seq_q": 4, "cache_seqlens": SPLIT_KV_LENGTHS},
             {"seq_q": 1, "cache_seqlens": [1100]}, {"seq_q": 37, "cache_seqlens": [0, 37, 600, 20]},
             {"seq_q": 1, "cache_seqlens": [(37 * i) % 300 for i in range(32)]}]
    if layout == "kvcache":
        for c in cases:
            c["max_len"] = max(c["cache_seqlens"]) + 11
    return cases


def assert_split_stores_guarded(func) -> None:
    """Every store of a split-KV kernel ``func`` into its workspace (``Op``, ``St``) sits under a
    condition on the batch (the chunk count ``ns``): an unsplit step (``ns`` 1) has a token
    workspace of one tile, and a store past it corrupts the heap (on a GPU, an illegal address).
    Structural, so it fails where an emulated overrun may go unnoticed."""
    import tvm_ffi
    from tvm import tirx

    def stores(node):
        found = []
        tvm_ffi.structural_walk(node, [(tirx.BufferStore, lambda n: found.append(n) if n.buffer.name in ("Op", "St")
                                        else None)])
        return found

    def on_batch(cond):
        names = []
        tvm_ffi.structural_walk(cond, [(tirx.Var, lambda n: names.append(n.name))])
        return "batch" in names

    guarded = []
    tvm_ffi.structural_walk(func.body, [(tirx.IfThenElse, lambda n: guarded.extend(stores(n)) if on_batch(n.condition)
                                         else None)])
    every = stores(func.body)
    assert every, "no store into the split-KV workspace"
    loose = [s for s in every if not any(s.same_as(g) for g in guarded)]
    into = sorted({s.buffer.name for s in loose})
    assert not loose, f"{len(loose)} of {len(every)} workspace stores not conditioned on the batch (into {into})"


def check_lse(got: np.ndarray, ref: np.ndarray, where) -> None:
    """A kernel's log-sum-exp against the reference's: -inf exactly where a row sees no key."""
    assert np.array_equal(np.isneginf(got), np.isneginf(ref)), where
    seen = np.isfinite(ref)
    assert np.allclose(got[seen], ref[seen], atol=2e-5, rtol=1e-5), (where, np.abs(got[seen] - ref[seen]).max())


def check_emulated_layout(ex, spec, cases=None) -> None:
    """Run an emulated kernel ``ex`` (compiled for the CPU) against the reference with its
    variants' arguments: varlen on every batch of ``VARLEN_BATCHES``, the other layouts on their
    ``validation_cases`` (bhsd: the representative shape and awkward ones) (a decode step, mixed cache lengths with empty ones and tile and page
    edges, 4 new tokens, a prefill chunk of 37 over shorter caches; paged through shuffled
    pages with a shared prefix page), or on ``cases``. A sequence that sees no key must give exact zeros (and a
    log-sum-exp of -inf, with ``return_lse``)."""
    import tvm

    from tvm_attention.layouts import LAYOUTS
    from tvm_attention.validate import TOLERANCES

    layout = LAYOUTS[spec.layout]
    atol, rtol = TOLERANCES[spec.dtype]
    names = [a.name for a in layout.all_args(spec) if not a.output]
    varlen = spec.layout == "varlen"
    if cases is None:
        cases = [{"seqlens": lens} for lens in VARLEN_BATCHES] if varlen else layout.validation_cases(spec)
    for i, case in enumerate(cases):
        x = layout.random_inputs(spec, case, seed=i)
        ref, ref_lse = layout.reference_outputs(spec, x)
        o = tvm.runtime.empty(x["q"].shape[:-1] + (spec.v_dim,), spec.dtype)  # head_dim_v columns
        lse = [tvm.runtime.empty(ref_lse.shape, "float32")] if spec.return_lse else []
        ex["attention"](*[tvm.runtime.tensor(x[n]) for n in names], o, *lse)
        out = o.numpy().astype(np.float64)
        if lse:
            check_lse(lse[0].numpy(), ref_lse, case)
        assert np.isfinite(out).all(), case
        assert np.allclose(out, ref, atol=atol, rtol=rtol), (case, np.abs(out - ref).max())
        if varlen:
            keyless = [slice(x["cu_seqlens_q"][b], x["cu_seqlens_q"][b + 1])
                       for b, (_, sk) in enumerate(case["seqlens"]) if sk == 0]
        else:  # bhsd: the reference's zero rows are checked by the comparison (appending: none)
            keyless = [b for b, n in enumerate(x.get("cache_seqlens", ())) if n == 0 and not spec.append]
        for rows in keyless:  # no key: zero rows
            assert not out[rows].any(), case


def at_offset(x: np.ndarray, offset: int) -> np.ndarray:
    """A C-contiguous copy of ``x`` whose data starts ``offset`` bytes past a 64-byte boundary
    (NumPy's own arrays sit at 16 mod 64)."""
    raw = np.empty(x.nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    out = raw[start : start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    assert out.ctypes.data % 64 == offset
    return out


def report(out, ref):
    diff = np.abs(out.astype(np.float64) - ref)
    return f"max abs err {diff.max():.3e}, mean abs err {diff.mean():.3e}"


#: The files that take longest, longest first (seconds summed per file from the JUnit report of a
#: 2-core znver4 run, 2026-12-04, less what the trims of that day saved: kvcache 87, cuda_mma 83,
#: kv8 63, transformers 58, rpc 52, cuda 50, tune_hardening 46, bench 44, tune 40, gpu_payload 40,
#: dirrunner 35, kv_scales 35, halfprec 28, smem_race 28, search 25, readme 25, variants 25, cli 23,
#: serving_env 20, install 21, modifiers 21), started first: `--dist loadfile` hands files to
#: workers in collection order (with --no-loadscope-reorder, pyproject: xdist's default queues them
#: by test count instead), and a long file collected last ran alone for minutes at the end of the
#: run while the other worker sat idle.
LONG_FILES = ("test_kvcache.py", "test_cuda_mma.py", "test_kv8.py", "test_transformers.py", "test_rpc.py",
              "test_cuda.py", "test_tune_hardening.py", "test_bench.py", "test_tune.py", "test_gpu_payload.py",
              "test_hopper.py", "test_dirrunner.py", "test_kv_scales.py", "test_halfprec.py", "test_smem_race.py",
              "test_search.py", "test_readme.py", "test_variants.py", "test_cli.py", "test_install.py",
              "test_modifiers.py", "test_serving_env.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: the rest keep their order

