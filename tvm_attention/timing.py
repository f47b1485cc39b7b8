"""Timing helpers shared by the CLI and the benchmarks (TVM's time_evaluator and a wall clock)."""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import TYPE_CHECKING, Callable

from .loader import aligned_empty
from .spec import AttentionSpec

if TYPE_CHECKING:
    import tvm


#: ``TVM_ATTENTION_MEASURE_SCALE``: a factor on every measurement's least running time (tuning
#: candidates, ``run``'s timing, the benchmarks), default 1. Below 1 measures faster and noisier:
#: the test suite sets 0.1, since its tests check what a tune or benchmark does, not its figures.
MEASURE_SCALE_ENV = "TVM_ATTENTION_MEASURE_SCALE"


def measure_ms(ms: float) -> int:
    """``ms`` milliseconds scaled by ``TVM_ATTENTION_MEASURE_SCALE`` (at least 1)."""
    raw = os.environ.get(MEASURE_SCALE_ENV, "1")
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"{MEASURE_SCALE_ENV}={raw!r}: expected a number > 0 (the factor on each "
                         "measurement's least running time; 1 by default)") from None
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"{MEASURE_SCALE_ENV}={raw!r}: expected a finite number > 0")
    return max(1, round(ms * scale))


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float
    std_s: float
    repeats: int

    def gflops(self, spec: AttentionSpec) -> float:
        return spec.flops() / self.median_s / 1e9


def aligned_inputs(spec: AttentionSpec, seed: int = 0, case: dict | None = None):
    """Seeded inputs of the layout (bhsd: q, k, v) and an output buffer, all 64-byte aligned, at
    ``case`` (default: the spec's representative shape, its layout's first validation case)."""
    layout = spec.layout_info
    case = layout.validation_cases(spec)[0] if case is None else case
    arrays = []
    for x in layout.random_inputs(spec, case, seed).values():
        a = aligned_empty(x.shape, x.dtype)
        a[...] = x
        arrays.append(a)
    # o has q's shape in every layout, with head_dim_v columns
    arrays.append(aligned_empty(arrays[0].shape[:-1] + (spec.v_dim,), spec.dtype))
    return arrays


def time_module(module: tvm.runtime.Module, entry: str, spec: AttentionSpec, repeat: int = 5,
                min_repeat_ms: int = 200, device=None, case: dict | None = None) -> Timing:
    """Median ± std of ``repeat`` measurements, each running at least ``min_repeat_ms``
    (after one warm-up call), on ``device`` (default: the CPU), at ``case`` (see
    :func:`aligned_inputs`)."""
    import tvm  # here: a peer's fresh process (bench.memory) times NumPy without importing TVM

    device = device or tvm.cpu()
    args = [tvm.runtime.tensor(a, device) for a in aligned_inputs(spec, case=case)]
    module[entry](*args)  # warm-up: page in, build the thread pool / load the CUDA module
    te = module.time_evaluator(entry, device, number=1, repeat=repeat, min_repeat_ms=measure_ms(min_repeat_ms))
    res = te(*args)
    results = list(res.results)
    return Timing(statistics.median(results), statistics.pstdev(results), len(results))


def time_built(built, spec: AttentionSpec | None = None, **kw) -> Timing:
    """:func:`time_module` of a :class:`~tvm_attention.build.BuiltKernel`, after checking that
    this host can run its code (a cross-compiled build raises ``HostCPUError``, never SIGILL)."""
    built.check_runnable()
    return time_module(built.runtime_module, built.entry, built.spec if spec is None else spec, **kw)


def time_callable(fn: Callable[[], object], repeat: int = 5, min_repeat_ms: int = 200) -> Timing:
    """Same protocol for a Python callable (NumPy, PyTorch)."""
    fn()
    results, min_repeat_ms = [], measure_ms(min_repeat_ms)
    for _ in range(repeat):
        n = 0
        t0 = time.perf_counter()
        while True:
            fn()
            n += 1
            el = time.perf_counter() - t0
            if el * 1e3 >= min_repeat_ms:
                break
        results.append(el / n)
    return Timing(statistics.median(results), statistics.pstdev(results), len(results))
