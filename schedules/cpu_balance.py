"""The balance of this host's cores, measured, not read from the CPU's name: whether bf16 dot
products pay, and whether its AVX-512 FMAs are full width.

``vdpbf16ps`` does twice the multiply-adds of an fp32 FMA per instruction, but how many a core
issues per cycle differs by vendor: a Zen 4 issues it at the FMA's rate (twice the FMA's FLOP/s:
its bf16 prefill on dots ran 1.54× the fp32 kernel), an Intel Sapphire Rapids core on one port
against the FMA's two (:func:`dot_to_fma_rate` 0.49 on a 2-core VM; the dot form's bf16 prefill
ran 0.82× (D=64) and 0.93× (D=128) the fp32-product form there, 2 threads, S=2048, H=8,
2026-12-07). A VM may also
report a model that is not the real CPU. So the prefill preset takes the dot form where a
measurement on this host says the dot products outrun the FMAs (:func:`dots_outrun_fmas`).

The measurement (:func:`dot_to_fma_rate`): two TVM loops on one core, 12 independent chains of
``vdpbf16ps`` and of FMAs on zmm accumulators (enough to cover either's latency), the best of a
few runs each; the ratio of their FLOP rates. About 0.3 s, once per process. Code built for a
target this host does not run as its default (another ``mcpu``, cross-compiled) is not
measured: there the features decide, as before.

The same loop at 8 lanes (ymm) against 16 (zmm) says whether the core's FMAs are 512 bits wide
(:func:`wide_fmas`): an Intel core issues two zmm FMAs a cycle (2.0× the ymm loop's FLOP/s), a
Zen 4 core splits each into two 256-bit halves (1.0×). There the fp32 prefill takes 64-row tiles
(``cpu_fused.preset``).
"""
from __future__ import annotations

import functools

import numpy as np
from tvm.target import Target

from ..target import host_cpu, runnable_here, target_features
from .cpu_bf16 import DPBF16_IR, FEATURE

#: the dot form is the preset where the dot products' FLOP rate is above the FMAs' times this: the
#: ratio is 0.49 on Sapphire Rapids (where the form lost) and 2 by design on Zen 4, far from 1 either way
DOTS_OVER_FMAS = 1.0
_CHAINS, _LANES, _ITERS, _REPEAT = 12, 16, 1 << 19, 5


def dots_outrun_fmas(target: Target) -> bool:
    """Whether bf16 dot products outrun fp32 FMAs for code built for ``target``: measured where
    ``target`` is this host's own code (:func:`dot_to_fma_rate`), else assumed wherever the
    target has AVX512-BF16."""
    if FEATURE not in target_features(target):
        return False
    rate = dot_to_fma_rate(target)
    return rate is None or rate > DOTS_OVER_FMAS


def dot_to_fma_rate(target: Target) -> float | None:
    """The FLOP rate of ``vdpbf16ps`` over the fp32 FMA's on one core of this host, or None where
    ``target`` is not code this host runs as its own (another ``mcpu``, features it lacks)."""
    return _rate(target, "dot_loop", "fma_loop", FEATURE)


#: zmm FMAs are full width where the zmm loop's FLOP rate is above the ymm loop's times this
#: (2.0 on a Sapphire Rapids VM, 1.0 by design on Zen 4)
WIDE_OVER_HALVES = 1.5


def wide_fmas(target: Target) -> bool:
    """Whether ``target``'s AVX-512 FMAs run at twice the FLOP rate of its 256-bit ones: measured
    where ``target`` is this host's own code (:func:`zmm_to_ymm_rate`); elsewhere False (the
    presets of before)."""
    rate = zmm_to_ymm_rate(target)
    return rate is not None and rate > WIDE_OVER_HALVES


def zmm_to_ymm_rate(target: Target) -> float | None:
    """The FLOP rate of 16-lane fp32 FMAs over 8-lane ones on one core of this host, or None where
    ``target`` is not this host's own AVX-512 code."""
    return _rate(target, "fma_loop", "fma8_loop", "avx512f")


def _rate(target: Target, loop: str, over: str, feature: str) -> float | None:
    mcpu = str(target.attrs["mcpu"]) if "mcpu" in target.attrs else ""
    if (target.kind.name != "llvm" or mcpu != host_cpu() or not runnable_here(target)
            or feature not in target_features(target)):
        return None
    flops = _measured(str(target))
    return flops[loop] / flops[over]


@functools.lru_cache(maxsize=4)
def _measured(target_text: str) -> dict[str, float]:
    import tvm  # the compiler: a runtime-only install never picks a preset
    from tvm.script import tirx as T

    L, C = _LANES, _CHAINS

    @T.prim_func
    def fma_loop(xy: T.Buffer((2,), "float32"), out: T.Buffer((C * L,), "float32"), n: T.int32):
        T.func_attr({"global_symbol": "fma_loop", "tirx.noalias": True})
        acc = T.alloc_buffer((C * L,), "float32", scope="local")
        for c in T.unroll(C):
            acc[T.ramp(c * L, 1, L)] = T.Broadcast(T.float32(1), L)
        for _ in range(n):  # x, y from memory: LLVM cannot fold the chains; mul + add contract to FMAs
            for c in T.unroll(C):
                acc[T.ramp(c * L, 1, L)] = acc[T.ramp(c * L, 1, L)] * T.Broadcast(xy[0], L) + T.Broadcast(xy[1], L)
        for c in T.unroll(C):
            out[T.ramp(c * L, 1, L)] = acc[T.ramp(c * L, 1, L)]

    @T.prim_func
    def fma8_loop(xy: T.Buffer((2,), "float32"), out: T.Buffer((C * L,), "float32"), n: T.int32):
        T.func_attr({"global_symbol": "fma8_loop", "tirx.noalias": True})
        acc = T.alloc_buffer((C * 8,), "float32", scope="local")
        for c in T.unroll(C):
            acc[T.ramp(c * 8, 1, 8)] = T.Broadcast(T.float32(1), 8)
        for _ in range(n):
            for c in T.unroll(C):
                acc[T.ramp(c * 8, 1, 8)] = acc[T.ramp(c * 8, 1, 8)] * T.Broadcast(xy[0], 8) + T.Broadcast(xy[1], 8)
        for c in T.unroll(C):
            out[T.ramp(c * 8, 1, 8)] = acc[T.ramp(c * 8, 1, 8)]

    @T.prim_func
    def dot_loop(ab: T.Buffer((2, L), "int32"), out: T.Buffer((C * L,), "float32"), n: T.int32):
        T.func_attr({"global_symbol": "dot_loop", "tirx.noalias": True})
        acc = T.alloc_buffer((C * L,), "float32", scope="local")
        for c in T.unroll(C):
            acc[T.ramp(c * L, 1, L)] = T.Broadcast(T.float32(0), L)
        for _ in T.serial(n, annotations={"pragma_import_llvm": DPBF16_IR}):
            for c in T.unroll(C):
                acc[T.ramp(c * L, 1, L)] = T.call_pure_extern("float32x16", "tvma_dpbf16", acc[T.ramp(c * L, 1, L)],
                                                              ab[0, T.ramp(0, 1, L)], ab[1, T.ramp(0, 1, L)])
        for c in T.unroll(C):
            out[T.ramp(c * L, 1, L)] = acc[T.ramp(c * L, 1, L)]

    target = Target(target_text)
    loops = {"fma_loop": fma_loop, "fma8_loop": fma8_loop}
    if FEATURE in target_features(target):
        loops["dot_loop"] = dot_loop
    lib = tvm.compile(tvm.IRModule(loops), target=target)
    out = tvm.runtime.empty((C * L,), "float32")
    xy = tvm.runtime.tensor(np.array([0.999, 0.001], np.float32))  # acc → 1: no overflow
    ab = tvm.runtime.tensor(np.array([[0x3F803F80] * L, [0x33803380] * L], np.int32))  # 1.0 × 2^-24 pairs
    # FLOPs per lane per instruction: an FMA 2, a dot 4 (2 products, 2 adds)
    work = {"fma_loop": 2 * L, "fma8_loop": 2 * 8, "dot_loop": 4 * L}
    flops = {}
    for name in loops:
        arg = ab if name == "dot_loop" else xy
        lib.mod[name](arg, out, 1000)  # warm
        secs = min(lib.mod.time_evaluator(name, tvm.cpu(), number=1, repeat=_REPEAT)(arg, out, _ITERS).results)
        flops[name] = work[name] * C * _ITERS / secs
    return flops
