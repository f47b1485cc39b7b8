"""Machine ceilings for the benchmarks (the CPU peers are ``bench.peers``).

The roofline's roofs are measured with TVM's own code for the local target: the compute roof is
the FMA peak (:func:`fma_peak`), the memory roof streaming-read bandwidth (:func:`read_bandwidth`).
NumPy's sgemm is kept as an informative number only: a fused kernel can beat OpenBLAS sgemm.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import statistics
import time
from typing import Any, Callable

import numpy as np

from ..schedules.cpu_bf16 import DPBF16_IR, FEATURE
from ..target import host_cpu, resolve_target, target_features, vector_lanes
from ..threads import num_threads
from ..timing import time_callable
from ..workloads import amx


def sgemm_ceiling(n: int = 2048) -> float:
    """GFLOP/s of a NumPy n×n float32 matmul (OpenBLAS). Informative only: it is not the roof —
    a fused kernel with a better register tile can beat it (see :func:`fma_peak`)."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)  # x @ x.T: a slower path
    t = time_callable(lambda: a @ b, repeat=5, min_repeat_ms=200)
    return 2 * n**3 / t.median_s / 1e9


#: x86 and AArch64 spellings of a fused multiply-add in LLVM's assembly.
_FMA_ASM = re.compile(r"^\s*(v?f(?:n?madd|n?msub)\w*|fmla)\s+([^\n]*)", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class FmaPeak:
    """The compute roof: GFLOP/s of a TVM-generated loop that does nothing but vector FMAs."""

    gflops: float  # best of the timed calls (interference only ever lowers a peak)
    median_gflops: float
    threads: int
    lanes: int  # fp32 lanes per vector (16 with AVX-512)
    chains: int  # independent accumulator vectors per thread (cover the FMA latency × pipes)
    iters: int  # loop trips per thread per call
    fma_instructions: int  # FMA instructions in the generated assembly (0: no fp contraction)
    fma_sample: str  # one of them, e.g. "vfmadd213ps %zmm13, %zmm12, %zmm11"
    cpu: str
    seconds: float  # wall time of the whole measurement, build included

    @property
    def method(self) -> str:
        return (f"TVM PrimFunc for {self.cpu}: parallel loop over {self.threads} threads, each "
                f"{self.iters} trips of {self.chains} independent {self.lanes}-lane fp32 chains "
                f"acc = acc*x + y held in registers ({self.fma_instructions} FMA instructions in the "
                f"assembly, e.g. `{self.fma_sample}`); FLOP = 2·lanes·chains·iters·threads; best of "
                "the repeats")

    def to_meta(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["method"] = self.method
        return d


@dataclasses.dataclass(frozen=True)
class ReadBandwidth:
    """The memory roof: GB/s of streaming reads (a TVM parallel vectorized sum over a large array)."""

    gbps: float  # bytes read / time, best of the timed calls
    median_gbps: float
    bytes_read: int
    threads: int
    lanes: int
    accumulators: int
    seconds: float

    @property
    def method(self) -> str:
        return (f"TVM PrimFunc: parallel ({self.threads} threads) vectorized sum over a "
                f"{self.bytes_read / 2**20:.0f} MiB float32 array, {self.accumulators} {self.lanes}-lane "
                "accumulators per thread; bandwidth = bytes read / time (nothing written); best of the "
                "repeats")

    def to_meta(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["method"] = self.method
        return d


def _threads_and_target(threads: int | None, target=None):
    threads = threads or num_threads()
    target = resolve_target(target or "llvm")  # another llvm target: that ISA's roof (`run --target`)
    return threads, target, vector_lanes(target)


def fma_peak(threads: int | None = None, chains: int = 12, iters: int = 1 << 22, repeat: int = 15,
             target=None) -> FmaPeak:
    """Measure the FMA peak of this CPU with TVM's own code for the local target (about 0.5 s).

    ``threads`` defaults to TVM's current pool size (``set_num_threads`` first). Each call runs
    about 10 ms here; the best of ``repeat`` calls is the peak, since another process taking a
    core for a moment only ever lowers it. 12 chains: an FMA
    has a latency of about 4 cycles and x86 cores issue up to 2 per cycle, so fewer independent
    accumulators would measure latency, not throughput; 12 + x + y fit in 16 vector registers.
    """
    import tvm
    from tvm.script import tirx as T

    t0 = time.perf_counter()
    threads, target, lanes = _threads_and_target(threads, target)
    width = chains * lanes

    @T.prim_func
    def fma_loop(xy: T.Buffer((2,), "float32"), out: T.Buffer((threads, width), "float32"), n: T.int32):
        T.func_attr({"global_symbol": "fma_loop", "tirx.noalias": True})
        for t in T.parallel(threads):
            acc = T.alloc_buffer((width,), "float32", scope="local")
            for c in T.unroll(chains):
                for l in T.vectorized(lanes):
                    acc[c * lanes + l] = T.float32(1) + T.Cast("float32", c)
            for _ in range(n):
                # x, y come from memory so LLVM cannot fold the chain; mul + add contracts to FMA.
                for c in T.unroll(chains):
                    for l in T.vectorized(lanes):
                        acc[c * lanes + l] = acc[c * lanes + l] * xy[0] + xy[1]
            for c in T.unroll(chains):
                for l in T.vectorized(lanes):
                    out[t, c * lanes + l] = acc[c * lanes + l]

    ex = tvm.compile(tvm.IRModule({"fma_loop": fma_loop}), target=target)
    fmas = _FMA_ASM.findall(ex.mod.inspect_source("asm"))
    xy = tvm.runtime.tensor(np.array([0.999, 0.001], np.float32))  # acc → y / (1 - x) = 1: no overflow
    out = tvm.runtime.empty((threads, width), "float32")
    ex.mod["fma_loop"](xy, out, 1000)
    te = ex.mod.time_evaluator("fma_loop", tvm.cpu(), number=1, repeat=repeat)
    secs = list(te(xy, out, iters).results)
    if not np.isfinite(out.numpy()).all():
        raise RuntimeError("FMA peak loop produced non-finite values")
    flop = 2 * lanes * chains * iters * threads
    return FmaPeak(gflops=flop / min(secs) / 1e9, median_gflops=flop / statistics.median(secs) / 1e9,
                   threads=threads, lanes=lanes, chains=chains, iters=iters, fma_instructions=len(fmas),
                   fma_sample=" ".join(fmas[0]).strip() if fmas else "", cpu=str(target.attrs.get("mcpu", "")),
                   seconds=time.perf_counter() - t0)


def bf16_dot_peak(threads: int | None = None, chains: int = 12, iters: int = 1 << 21,
                  repeat: int = 15, target=None) -> dict[str, Any] | None:
    """The bf16 compute roof: GFLOP/s of a TVM loop of AVX512-BF16 ``vdpbf16ps`` on register
    accumulators (64 FLOP per instruction: 16 lanes × 2 bf16 products, added), the instruction
    the ``dot_bf16`` kernels run on (the same imported LLVM helper); None without avx512bf16.
    12 independent chains cover the instruction's latency, as in :func:`fma_peak`."""
    import tvm
    from tvm.script import tirx as T



    t0 = time.perf_counter()
    threads, target, _ = _threads_and_target(threads, target)
    if FEATURE not in target_features(target):
        return None
    lanes = 16
    width = chains * lanes

    @T.prim_func
    def dp_loop(ab: T.Buffer((2, lanes), "int32"), out: T.Buffer((threads, width), "float32"), n: T.int32):
        T.func_attr({"global_symbol": "dp_loop", "tirx.noalias": True})
        for t in T.parallel(threads):
            acc = T.alloc_buffer((width,), "float32", scope="local")
            for c in T.unroll(chains):
                acc[T.ramp(c * lanes, 1, lanes)] = T.Broadcast(T.float32(0), lanes)
            for _ in T.serial(n, annotations={"pragma_import_llvm": DPBF16_IR}):
                for c in T.unroll(chains):
                    acc[T.ramp(c * lanes, 1, lanes)] = T.call_pure_extern(
                        "float32x16", "tvma_dpbf16", acc[T.ramp(c * lanes, 1, lanes)],
                        ab[0, T.ramp(0, 1, lanes)], ab[1, T.ramp(0, 1, lanes)])
            for c in T.unroll(chains):
                out[t, T.ramp(c * lanes, 1, lanes)] = acc[T.ramp(c * lanes, 1, lanes)]

    ex = tvm.compile(tvm.IRModule({"dp_loop": dp_loop}), target=target)
    n_dp = ex.mod.inspect_source("asm").count("vdpbf16ps")
    # pairs of bf16 1.0 (0x3F80) and 2^-24 (0x3380): each step adds 2^-23, no overflow
    ab = tvm.runtime.tensor(np.array([[0x3F803F80] * lanes, [0x33803380] * lanes], np.int32))
    out = tvm.runtime.empty((threads, width), "float32")
    ex.mod["dp_loop"](ab, out, 1000)
    te = ex.mod.time_evaluator("dp_loop", tvm.cpu(), number=1, repeat=repeat)
    secs = list(te(ab, out, iters).results)
    flop = 64 * chains * iters * threads
    return {"gflops": flop / min(secs) / 1e9, "median_gflops": flop / statistics.median(secs) / 1e9,
            "threads": threads, "chains": chains, "iters": iters, "vdpbf16ps_instructions": n_dp,
            "seconds": time.perf_counter() - t0,
            "method": f"TVM loop over {threads} threads, each {iters} trips of {chains} independent vdpbf16ps "
                      "chains on zmm accumulators (64 FLOP each); best of the repeats"}


def amx_tile_peak(threads: int | None = None, iters: int = 1 << 16, repeat: int = 9,
                  target=None, ksteps: int = 8, zero: bool = False) -> dict[str, Any] | None:
    """The AMX roof: GFLOP/s of the fused kernel's own micro-kernel (``workloads.amx.MM``: a
    32 × 32 block of ``C``, two ``A`` and two ``B`` tiles loaded per 32-deep step) on operands
    that stay in L1, ``iters`` calls of 8 steps per thread (16384 FLOP per ``tdpbf16ps``). What
    the kernel's products can reach with their loads; the instruction alone runs faster (held in
    tiles: ``../shared/examples/amx_probe.py``). ``ksteps``: steps per call (8, a 256-deep
    product as a D=256 QKᵀ block, is the roof; ``scripts/amx_microkernel.py`` sweeps it);
    ``zero``: each call starts from zero (QKᵀ's calls) rather than loading C (PV's). None
    without AMX-BF16."""
    import tvm
    from tvm.script import tirx as T

    t0 = time.perf_counter()
    threads, target, _ = _threads_and_target(threads, target)
    if not {"amx-tile", "amx-bf16"} <= target_features(target):
        return None
    ks, z = ksteps, int(zero)

    @T.prim_func
    def tile_loop(a: T.Buffer((32, 32 * ks), "uint16"), b: T.Buffer((16 * ks, 64), "uint16"),
                  c: T.Buffer((threads, 32, 32), "float32"), n: T.int32):
        T.func_attr({"global_symbol": "tile_loop", "tirx.noalias": True})
        T.evaluate(T.call_extern("int32", amx.PERMIT))
        for t in T.parallel(threads, annotations={"pragma_import_llvm": amx.IR}):
            T.evaluate(T.call_extern("int32", amx.BEGIN))
            for _ in T.serial(n):
                T.evaluate(T.call_extern("int32", amx.MM, c.data, T.int64(t * 4096), T.int64(128), a.data,
                                         T.int64(0), T.int64(64 * ks), b.data, T.int64(0), T.int64(128),
                                         T.int64(ks), T.int32(z)))
            T.evaluate(T.call_extern("int32", amx.END))

    ex = tvm.compile(tvm.IRModule({"tile_loop": tile_loop}), target=target)
    a = tvm.runtime.tensor(np.zeros((32, 32 * ks), np.uint16))
    b = tvm.runtime.tensor(np.zeros((16 * ks, 64), np.uint16))
    c = tvm.runtime.tensor(np.zeros((threads, 32, 32), np.float32))
    ex.mod["tile_loop"](a, b, c, 100)
    te = ex.mod.time_evaluator("tile_loop", tvm.cpu(), number=1, repeat=repeat)
    secs = list(te(a, b, c, iters).results)
    flop = 2 * 32 * 32 * 32 * ks * iters * threads
    return {"gflops": flop / min(secs) / 1e9, "median_gflops": flop / statistics.median(secs) / 1e9,
            "threads": threads, "iters": iters, "seconds": time.perf_counter() - t0,
            "method": f"TVM loop over {threads} threads, each {iters} calls of the fused kernel's AMX "
                      f"micro-kernel (32 × 32 × {32 * ks}, operands in L1); best of the repeats"}


def read_bandwidth(mib: int = 256, threads: int | None = None, accumulators: int = 8,
                   repeat: int = 20) -> ReadBandwidth:
    """Measure streaming-read bandwidth with TVM's own code (about 1.5 s at 256 MiB).

    A read-only stream is the memory traffic a roofline's intensity counts (the kernels read far
    more than they write); a copy would mix in write-allocate traffic. ``mib`` must be well past
    the last-level cache.
    """
    import tvm
    from tvm.script import tirx as T

    t0 = time.perf_counter()
    threads, target, lanes = _threads_and_target(threads)
    width = accumulators * lanes
    steps = mib * 2**20 // 4 // (threads * width)  # per-thread trips, each reading `width` floats
    per = steps * width
    n = per * threads

    @T.prim_func
    def read_sum(a: T.Buffer((n,), "float32"), out: T.Buffer((threads, width), "float32")):
        T.func_attr({"global_symbol": "read_sum", "tirx.noalias": True})
        for t in T.parallel(threads):
            acc = T.alloc_buffer((width,), "float32", scope="local")
            for j in T.vectorized(width):
                acc[j] = T.float32(0)
            for i in range(steps):
                for c in T.unroll(accumulators):
                    for l in T.vectorized(lanes):
                        acc[c * lanes + l] = acc[c * lanes + l] + a[t * per + i * width + c * lanes + l]
            for j in T.vectorized(width):
                out[t, j] = acc[j]

    ex = tvm.compile(tvm.IRModule({"read_sum": read_sum}), target=target)
    a = tvm.runtime.tensor(np.ones(n, np.float32))  # paged in here, not in the timed calls
    out = tvm.runtime.empty((threads, width), "float32")
    te = ex.mod.time_evaluator("read_sum", tvm.cpu(), number=1, repeat=repeat)
    secs = list(te(a, out).results)
    if out.numpy().sum(dtype=np.float64) != n:  # every element read exactly once (exact in fp32)
        raise RuntimeError("read-bandwidth loop did not read the whole array")
    return ReadBandwidth(gbps=4 * n / min(secs) / 1e9, median_gbps=4 * n / statistics.median(secs) / 1e9,
                         bytes_read=4 * n, threads=threads, lanes=lanes, accumulators=accumulators,
                         seconds=time.perf_counter() - t0)


def measure_ceilings(threads: int | None = None, say: Callable[[str], None] | None = None,
                     earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """The roofline's two roofs (FMA peak, streaming-read bandwidth) plus NumPy's sgemm for
    comparison, measured in this run: the bench metadata's ceiling keys.

    Pass the metadata measured at the start of a sweep as ``earlier`` to measure the roofs again
    at its end and keep the better of the two: a peak can only be underestimated (another process
    holding a core for the second or so of one measurement halves it), and the roof must not sit
    under points measured in between. sgemm is measured once.
    """
    peak = fma_peak(threads)
    bw = read_bandwidth(threads=threads)
    if earlier is None:
        sgemm = sgemm_ceiling()
        dots = bf16_dot_peak(threads)  # None without AVX512-BF16
        meta = {
            "fma_peak_gflops": peak.gflops, "read_gbps": bw.gbps, "sgemm_gflops": sgemm,
            "bf16_dot_peak_gflops": dots["gflops"] if dots else None,
            "ceilings": {
                "fma_peak": {**peak.to_meta(), "measured_gflops": [peak.gflops]},
                "read_bandwidth": {**bw.to_meta(), "measured_gbps": [bw.gbps]},
                "sgemm": {"gflops": sgemm, "method": "NumPy (OpenBLAS) 2048×2048 float32 a @ b, median; "
                                                      "informative, not a roof"},
                "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            },
        }
    else:
        meta = {k: earlier.get(k) for k in ("fma_peak_gflops", "read_gbps", "sgemm_gflops", "bf16_dot_peak_gflops")}
        old = earlier["ceilings"]
        fp = old["fma_peak"] if old["fma_peak"]["gflops"] >= peak.gflops else peak.to_meta()
        rb = old["read_bandwidth"] if old["read_bandwidth"]["gbps"] >= bw.gbps else bw.to_meta()
        meta["ceilings"] = {
            **old,
            "fma_peak": {**fp, "measured_gflops": old["fma_peak"]["measured_gflops"] + [peak.gflops]},
            "read_bandwidth": {**rb, "measured_gbps": old["read_bandwidth"]["measured_gbps"] + [bw.gbps]},
        }
        meta["fma_peak_gflops"], meta["read_gbps"] = fp["gflops"], rb["gbps"]
    if say:
        sgemm = meta["sgemm_gflops"]
        say(f"# roofs{' (again, after the sweep)' if earlier else ''}: FMA peak {peak.gflops:.1f} GFLOP/s "
            f"({peak.fma_instructions} FMA instr., {peak.chains}×{peak.lanes} lanes × {peak.threads} threads, "
            f"{peak.seconds:.1f} s), read bandwidth {bw.gbps:.1f} GB/s ({bw.bytes_read / 2**20:.0f} MiB, "
            f"{bw.seconds:.1f} s); NumPy sgemm {sgemm:.1f} GFLOP/s ({100 * sgemm / meta['fma_peak_gflops']:.0f}% "
            "of the FMA peak)")
    return meta


def compute_roofs_meta(cfg: Any, threads: int, goals: dict, say: Callable[[str], None]) -> dict[str, Any]:
    """The header of a compute-bound benchmark's report (``bench --halfprec``, ``--mla``): date,
    CPU, threads, its config and goals, and the two roofs measured now, the fp32 FMA peak and the
    bf16 dot-product peak (None without AVX512-BF16), said as its first line."""
    has_dots = "avx512bf16" in target_features(resolve_target("llvm"))
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": host_cpu(), "threads": threads,
            "config": dataclasses.asdict(cfg), "goals": goals, "avx512bf16": has_dots}
    fma, dots, tiles = fma_peak(threads).gflops, bf16_dot_peak(threads), amx_tile_peak(threads)
    meta["fma_peak_gflops"], meta["bf16_dot_peak_gflops"] = fma, (dots or {}).get("gflops")
    meta["amx_tile_peak_gflops"] = (tiles or {}).get("gflops")
    say(f"# {meta['date']} cpu={meta['cpu']} threads={threads}: FMA peak {fma:.0f} GFLOP/s, bf16 dot peak "
        f"{meta['bf16_dot_peak_gflops'] or 0:.0f} GFLOP/s, AMX tile peak {meta['amx_tile_peak_gflops'] or 0:.0f} GFLOP/s")
    return meta
