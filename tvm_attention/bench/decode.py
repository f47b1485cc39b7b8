"""Decode benchmark: one new token per sequence against a KV cache, judged against memory.

A decode step streams every K/V byte once (about 0.5 FLOP per byte), so its roof is the
streaming-read bandwidth, not the FMA peak. For each point (batch, cache length, heads, head_dim,
contiguous ``kvcache`` or ``paged`` layout) this reports the GB/s of K/V the kernel reads, that as
a fraction of the machine's streaming-read bandwidth (``bench.bandwidth``, measured in the same
run, before and after the points: the best is the roof), and two peers on the same data side by
side: torch SDPA (``enable_gqa``) and llama.cpp's CPU flash attention (``ggml_flash_attn_ext``,
:class:`~tvm_attention.bench.peers.GgmlDecode`; with the ``ggml-python`` package, else skipped
with the reason in the report's ``meta``), its cache at our bytes per element: fp32 as F32, bf16
and fp16 as F16, int8 as Q8_0 (no float8 type). ``kvcache_vs_llamacpp`` is its time over ours
(issue 42's goal: ≥ 2×). Every variant is timed alternately, on the same threads.

K/V bytes = 2 · batch · kv_heads · cache · head_dim · itemsize: what any kernel must read. With
several dtypes (``float32``, ``bfloat16``, ``float16``: caches and q stored in that dtype) each
point is measured in each, and ``vs_fp32`` is the fp32 step time over this one (a half-precision
cache read at the same fraction of the roof takes half the time).

8-bit caches (``float8_e4m3fn``, ``float8_e5m2``, ``int8`` among the dtypes): q and o in
``Config.kv8_query_dtype`` (bfloat16, as a bf16 model serving an fp8 cache), K/V one byte per
element with per-kv-head scales (``quantize_kv``); ``vs_bf16`` is the bf16 step time over this one
(issue 27's goal: the 8-bit step ≤ 0.6× the bf16 one, i.e. ``vs_bf16`` ≥ 1.67), and the GB/s count
the bytes actually read (one per element). torch has no 8-bit SDPA on the CPU: no torch column
there. ``append_cost`` (8-bit rows): the same step through the ``--append`` kernel (one new key
written into the cache, quantized, and attended to in the call) over the plain step, minus 1
(goal ≤ 5%).

Finer scales (``int8_token``, ``int8_qk8_group``...: :data:`SCALE_SUFFIXES`): their bytes count in
the K/V bytes, and ``scale_cost`` is the kvcache step over the same step with one scale per kv
head (the two alternated at each point), minus 1.

The compute floor, measured in the same run: a step is ``4 · batch · heads · cache · head_dim``
FLOP (QKᵀ and PV, one multiply-add per query head and K or V element), all float32 FMAs in every
cache dtype, so it takes at least ``fma_floor_ms`` at the FMA peak (``bench.cpu.fma_peak``, same
threads). With GQA the FLOP per byte grow with the group (4 query heads per kv head: 2 FLOP per
fp32 byte, 8 per 8-bit byte), and where the floor passes the stream time the roof is out of reach
for any kernel: ``roof_cap`` is the highest fraction of the roof the FMA peak allows (stream time
over ``max(stream time, FMA floor)``), and ``vs_bf16_cap`` the highest ``vs_bf16`` (the bf16
step's ``max(stream, floor)`` over the 8-bit step's), both as if compute and memory overlapped
perfectly.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..build import build_kernel
from ..layouts import paged_from_contiguous
from ..loader import _from_framework, aligned_empty, kernel_arg
from ..quant import KV_DTYPES, quantize_kv

#: a ``Config.dtypes`` entry: the int8 cache with ``qk_int8`` (q rounded to int8 per row, QKᵀ on
#: integer dot products), the same bytes as int8; llama.cpp's Q8_0 path does the same
QK8 = "int8_qk8"
#: an 8-bit entry's suffix for finer scales (``AttentionSpec.kv_scale``): ``int8_token``,
#: ``int8_qk8_group``, ``float8_e4m3fn_token``... (the scales' bytes count in the bytes read)
SCALE_SUFFIXES = {"_token": "token", "_group": "group"}
#: the timer of such an entry's kvcache step with one scale per kv head instead (``scale_cost``:
#: the finer scales' step over it, minus 1, the two alternated at each point)
PER_HEAD = "kvcache_per_head_scales"


def entry(name: str) -> tuple[str, bool, str]:
    """``(kv dtype, qk_int8, kv_scale)`` of a ``Config.dtypes`` entry."""
    granularity = "head"
    for suffix, g in SCALE_SUFFIXES.items():
        if name.endswith(suffix) and name[:-len(suffix)] in KV_DTYPES + (QK8,):
            name, granularity = name[:-len(suffix)], g
    return ("int8" if name == QK8 else name), name == QK8, granularity


def cache_dtype(name: str) -> str:
    """The K/V dtype of a ``Config.dtypes`` entry (``QK8`` reads an int8 cache)."""
    return entry(name)[0]
from ..runtime import is_ml_dtype
from ..spec import AttentionSpec, numpy_dtype
from ..target import host_cpu
from ..threads import set_num_threads
from ..timing import time_callable
from . import Interrupted, Progress, mark_interrupted, partial_line, write_report
from .bandwidth import stream_read_gbps
from .peers import GGML_KV_TYPES, GgmlDecode
from .cpu import fma_peak

#: Speed goals of issue 10, checked in the report (never by a test): fraction of the streaming
#: roof at (batch 4, 4k cache) and (batch 1, 16k cache), GQA 32:8, D=128; speed-up over torch.
GOALS = {"roof_b4_4k": 0.80, "roof_b1_16k": 0.70, "vs_torch": 2.0, "paged_vs_contiguous": 0.90,
         # issue 27: an 8-bit step against the bf16 one (time ≤ 0.6×), its roof, append's cost
         "kv8_vs_bf16": 1 / 0.6, "kv8_roof": 0.70, "append_cost": 0.05,
         # issue 42: against llama.cpp's CPU flash attention at the same bytes per element
         "vs_llamacpp": 2.0}


@dataclasses.dataclass(frozen=True)
class Config:
    heads: tuple[tuple[int, int], ...] = ((32, 8), (32, 32))  # (H, KH): GQA 32:8 and MHA
    head_dims: tuple[int, ...] = (128, 64)
    batches: tuple[int, ...] = (1, 4, 16)
    caches: tuple[int, ...] = (1024, 4096, 16384, 32768)
    # "paged_per_head": the paged kernel with one kv head per task (decode_heads=1), the order
    # the paged preset had before the page order: the page order's gain, side by side
    layouts: tuple[str, ...] = ("kvcache", "paged", "paged_per_head")
    page_size: int = 16
    max_kv_bytes: int = 3 << 30  # skip points whose K/V exceed this (memory of a 24 GiB VM)
    rounds: int = 2
    min_repeat_ms: int = 100
    stream_bytes: int = 512 << 20
    dtypes: tuple[str, ...] = ("float32",)
    kv8_query_dtype: str = "bfloat16"  # q and o of the 8-bit cache rows
    append: bool = True  # time the --append kernel of each 8-bit kvcache point too (append_cost)
    llamacpp: bool = True  # llama.cpp's flash attention beside ours, where ggml-python is installed


def quick_config() -> Config:
    """A smoke run for CI: one small point per layout."""
    return Config(heads=((8, 2),), head_dims=(64,), batches=(2,), caches=(512,), rounds=1, min_repeat_ms=5,
                  stream_bytes=256 << 20)  # past the L3: a smaller buffer measures the cache


def kv_bytes(b: int, kh: int, cache: int, d: int, itemsize: int = 4) -> int:
    return 2 * b * kh * cache * d * itemsize


def _tvm_timer(built, args, min_repeat_ms: int) -> Callable[[], float]:
    import tvm

    te = built.runtime_module.time_evaluator(built.entry, tvm.cpu(), number=1, repeat=3, min_repeat_ms=min_repeat_ms)
    built.function(*args)  # warm-up
    return lambda: float(np.median(te(*args).results))


def _torch_timer(q, k, v, min_repeat_ms: int) -> Callable[[], float] | None:
    try:
        import torch
    except ImportError:
        return None

    tq, tk, tv = (_from_framework("torch", x) for x in (q, k, v))  # bf16 too (NumPy has none)
    gqa = tq.shape[1] != tk.shape[1]

    def once():
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=gqa)

    def timer():
        return time_callable(once, repeat=3, min_repeat_ms=min_repeat_ms).median_s

    return timer


def run(cfg: Config, threads: int | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    import tvm

    threads = set_num_threads(threads)
    try:
        import torch

        torch.set_num_threads(threads)
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": host_cpu(), "threads": threads,
            "torch": torch_version, "config": dataclasses.asdict(cfg), "goals": GOALS,
            "llamacpp": {}}  # dtype -> the ggml type llama.cpp read the cache in, or why it did not run
    say(f"# {meta['date']} cpu={meta['cpu']} threads={threads} torch={torch_version}")
    streams = [stream_read_gbps(cfg.stream_bytes)]
    say(f"streaming read: {streams[0]:.1f} GB/s")
    peak = fma_peak(threads).gflops
    say(f"FMA peak: {peak:.0f} GFLOP/s")

    def tensor(x):
        a = aligned_empty(x.shape, x.dtype)
        a[...] = x
        return kernel_arg(a) if is_ml_dtype(x.dtype) else tvm.runtime.tensor(a)

    rows: list[dict[str, Any]] = []
    progress = Progress(len(cfg.heads) * len(cfg.head_dims) * len(cfg.dtypes) * len(cfg.batches) * len(cfg.caches))
    say(f"{progress.total} point{'s' * (progress.total != 1)}")
    try:
        for h, kh in cfg.heads:
            for d in cfg.head_dims:
                for dtype in cfg.dtypes:
                    _points(cfg, h, kh, d, dtype, tensor, say, rows, progress, threads, meta["llamacpp"])
        streams.append(stream_read_gbps(cfg.stream_bytes))
    except KeyboardInterrupt:
        # what was measured, against the roof measured at the start (the closing one is skipped)
        mark_interrupted(meta, progress.done, progress.total)
        raise Interrupted(_finish(cfg, meta, rows, streams, peak), progress.done, progress.total) from None
    say(f"streaming read again: {streams[-1]:.1f} GB/s; roof = {max(streams):.1f} GB/s")
    return _finish(cfg, meta, rows, streams, peak)


def _finish(cfg: Config, meta: dict[str, Any], rows: list[dict[str, Any]], streams: list[float],
            peak: float) -> dict[str, Any]:
    """The report: each row's ratios and fractions of the roof (the best streaming read)."""
    roof = max(streams)
    fp32 = {_key(r): r for r in rows if r["dtype"] == "float32"}
    bf16 = {_key(r): r for r in rows if r["dtype"] == "bfloat16"}
    for row in rows:
        _floors(row, roof, peak, half=bf16.get(_key(row)))
        base = fp32.get(_key(row))
        if base is not None and "kvcache_ms" in row and "kvcache_ms" in base:
            row["vs_fp32"] = base["kvcache_ms"] / row["kvcache_ms"]
        half = bf16.get(_key(row))
        if cache_dtype(row["dtype"]) in KV_DTYPES and half is not None and "kvcache_ms" in row and "kvcache_ms" in half:
            row["vs_bf16"] = half["kvcache_ms"] / row["kvcache_ms"]
        if f"{PER_HEAD}_ms" in row and "kvcache_ms" in row:
            row["scale_cost"] = row["kvcache_ms"] / row[f"{PER_HEAD}_ms"] - 1
        if "kvcache_append_ms" in row and "kvcache_ms" in row:
            row["append_cost"] = row["kvcache_append_ms"] / row["kvcache_ms"] - 1
        for name in cfg.layouts:
            if f"{name}_gbps" in row:
                row[f"{name}_roof"] = row[f"{name}_gbps"] / roof
                if "torch_ms" in row:
                    row[f"{name}_vs_torch"] = row["torch_ms"] / row[f"{name}_ms"]
                if "llamacpp_ms" in row:
                    row[f"{name}_vs_llamacpp"] = row["llamacpp_ms"] / row[f"{name}_ms"]
        if "paged_ms" in row and "kvcache_ms" in row:
            row["paged_vs_contiguous"] = row["kvcache_ms"] / row["paged_ms"]
        if "paged_ms" in row and "paged_per_head_ms" in row:
            row["page_order_gain"] = row["paged_per_head_ms"] / row["paged_ms"]
    meta["stream_gbps"] = streams
    meta["roof_gbps"] = roof
    meta["fma_gflops"] = peak
    return {"meta": meta, "rows": rows}


def step_flop(b: int, h: int, cache: int, d: int) -> float:
    """FLOP of one causal decode step (one new token per sequence, ``cache`` keys each) of ``h``
    query heads: the kvcache layout's useful FLOP (QKᵀ and PV, 4·D·H per visible pair)."""
    spec = AttentionSpec(batch=b, heads=h, kv_heads=1, seq_q=1, seq_kv=cache, head_dim=d, layout="kvcache",
                         causal=True)
    return spec.layout_info.useful_flops(spec, {"seq_q": 1, "cache_seqlens": [cache] * b})


def _floors(row: dict[str, Any], roof_gbps: float, peak_gflops: float, half: dict[str, Any] | None) -> None:
    """The point's compute floor and what it leaves of the roof (see the module docstring)."""
    floor = step_flop(row["batch"], row["heads"], row["cache"], row["head_dim"]) / peak_gflops / 1e9
    stream = row["kv_bytes"] / roof_gbps / 1e9
    row["fma_floor_ms"] = floor * 1e3
    row["roof_cap"] = min(1.0, stream / floor)
    if half is not None and cache_dtype(row["dtype"]) in KV_DTYPES:
        row["vs_bf16_cap"] = max(half["kv_bytes"] / roof_gbps / 1e9, floor) / max(stream, floor)


def _key(row: dict[str, Any]) -> tuple:
    return row["heads"], row["kv_heads"], row["head_dim"], row["batch"], row["cache"]


def _points(cfg: Config, h: int, kh: int, d: int, dtype: str, tensor, say, rows: list[dict[str, Any]],
            progress: Progress, threads: int, llamacpp: dict[str, str]) -> None:
    """Every (batch, cache) point of one (heads, head_dim, dtype), appended to ``rows`` as it is
    measured: the layouts' kernels built once, each point's variants timed alternately.
    ``llamacpp``: dtype -> the ggml type of llama.cpp's cache, or why it did not run (said once)."""
    kernels = {}
    row_dtype = dtype  # the row keeps the entry's name
    dtype, qk8, granularity = entry(dtype)
    kv8 = dtype in KV_DTYPES  # an 8-bit cache: q and o in kv8_query_dtype
    qdtype = cfg.kv8_query_dtype if kv8 else dtype
    names = list(cfg.layouts) + (["kvcache_append"] if cfg.append and kv8 and "kvcache" in cfg.layouts else [])
    if granularity != "head" and "kvcache" in cfg.layouts:
        names.append(PER_HEAD)  # the same step with one scale per kv head, alternated with it
    specs = {}
    for name in names:
        layout = "paged" if name.startswith("paged") else "kvcache" if name.startswith("kvcache") else name
        spec = AttentionSpec(batch=1, heads=h, kv_heads=kh, seq_q=1, seq_kv=1024, head_dim=d, layout=layout,
                             causal=True, dtype=qdtype, page_size=cfg.page_size if layout == "paged" else None,
                             kv_dtype=dtype if kv8 else None, append=name == "kvcache_append", qk_int8=qk8,
                             kv_scale="head" if name == PER_HEAD else granularity)
        specs[name] = spec
        t0 = time.perf_counter()
        kernels[name] = build_kernel(spec, knobs={"decode_heads": 1} if name == "paged_per_head" else None,
                                     cache=True)
        say(f"built {spec.short_name()}{' (one kv head per task)' if name == 'paged_per_head' else ''} "
            f"in {time.perf_counter() - t0:.1f} s")
    dt, qt = numpy_dtype(dtype), numpy_dtype(qdtype)
    groups = specs[names[0]].scale_groups  # per-token or per-group scales per (key, kv head); 0 per kv head
    for b in cfg.batches:
        for cache in cfg.caches:
            nbytes = kv_bytes(b, kh, cache, d, dt.itemsize) + kv_bytes(b, kh, cache, groups, 4)  # and the scales
            tag = f"[H{h}:KH{kh} D{d} {row_dtype} B{b} cache {cache}]"
            if nbytes > cfg.max_kv_bytes:
                progress.advance()
                say(f"{progress.tag()} {tag} skipped: K/V {nbytes / 2**30:.1f} GiB")
                continue
            rng = np.random.default_rng(b * 7 + cache)
            q = rng.standard_normal((b, h, 1, d), dtype=np.float32).astype(qt)
            # one spare key per sequence: the appending kernel writes its new key there
            k = rng.standard_normal((b, kh, cache + 1, d), dtype=np.float32)
            v = rng.standard_normal((b, kh, cache + 1, d), dtype=np.float32)
            llama = None
            if cfg.llamacpp:  # from the float32 values: ggml converts or quantizes them itself
                llama, why = GgmlDecode.create(q.astype(np.float32), k[:, :, :cache], v[:, :, :cache], dtype,
                                               1 / math.sqrt(d), threads)
                if dtype not in llamacpp:
                    llamacpp[dtype] = why
                    say(f"llama.cpp peer for {dtype}: " + (f"ggml {why} cache" if llama else f"skipped: {why}"))
            scales = []
            if PER_HEAD in kernels:  # its cache, quantized per kv head (the bytes counted are ours)
                per_head = [quantize_kv(x, dtype) for x in (k, v)]
            if kv8:
                (k, ks), (v, vs) = (quantize_kv(x, dtype, granularity=granularity) for x in (k, v))
                scales = [ks, vs]
            else:
                k, v = k.astype(dt), v.astype(dt)
            lens = np.full(b, cache, np.int32)
            o = np.empty((b, h, 1, d), qt)
            timers: dict[str, Callable[[], float]] = {}
            if "kvcache" in kernels:
                timers["kvcache"] = _tvm_timer(kernels["kvcache"], [tensor(x) for x in (q, k, v, lens, *scales, o)],
                                               cfg.min_repeat_ms)
            if PER_HEAD in kernels:
                (kh_, ksh), (vh_, vsh) = per_head
                timers[PER_HEAD] = _tvm_timer(kernels[PER_HEAD], [tensor(x) for x in (q, kh_, vh_, lens, ksh, vsh, o)],
                                              cfg.min_repeat_ms)
                del per_head, kh_, vh_
            if "kvcache_append" in kernels:
                new = [rng.standard_normal((b, kh, 1, d), dtype=np.float32).astype(qt) for _ in range(2)]
                timers["kvcache_append"] = _tvm_timer(
                    kernels["kvcache_append"], [tensor(x) for x in (q, k, v, lens, *scales, *new, o)], cfg.min_repeat_ms)
            paged = [n for n in kernels if n.startswith("paged")]
            if paged:
                kp, table = paged_from_contiguous(k[:, :, :cache], cfg.page_size, np.random.default_rng(1))
                vp, _ = paged_from_contiguous(v[:, :, :cache], cfg.page_size, np.random.default_rng(1))
                if groups:  # the scales in the same pages: (pages, page_size, KH[, groups])
                    scales = [paged_scales(x[:, :, :cache], granularity, cfg.page_size) for x in scales]
                args = [tensor(x) for x in (q, kp, vp, table, lens, *scales, o)]
                for n in paged:
                    timers[n] = _tvm_timer(kernels[n], args, cfg.min_repeat_ms)
                del kp, vp, args
            torch_timer = None if kv8 else _torch_timer(q, np.ascontiguousarray(k[:, :, :cache]),
                                                         np.ascontiguousarray(v[:, :, :cache]), cfg.min_repeat_ms)
            if torch_timer is not None:
                timers["torch"] = torch_timer
            if llama is not None:
                timers["llamacpp"] = lambda: time_callable(llama.call, repeat=3, min_repeat_ms=cfg.min_repeat_ms).median_s
            best = {name: float("inf") for name in timers}
            for r in range(cfg.rounds):
                for name in (list(timers) if r % 2 == 0 else list(reversed(timers))):
                    best[name] = min(best[name], timers[name]())
            row = {"heads": h, "kv_heads": kh, "head_dim": d, "dtype": row_dtype, "batch": b, "cache": cache,
                   "kv_bytes": nbytes}
            for name, t in best.items():
                row[f"{name}_ms"] = t * 1e3
                row[f"{name}_gbps"] = nbytes / t / 1e9
            rows.append(row)
            progress.advance()
            say(f"{progress.tag()} {tag} " + ", ".join(
                f"{name} {best[name] * 1e3:.3f} ms {nbytes / best[name] / 1e9:.1f} GB/s" for name in best))
            del timers
            if llama is not None:
                llama.close()


def paged_scales(scale: np.ndarray, granularity: str, page_size: int) -> np.ndarray:
    """Per-token ``(B, KH, L)`` or per-group ``(B, KH, L, G)`` scales of a contiguous cache laid
    out as :func:`~tvm_attention.layouts.paged_from_contiguous` lays out its keys (the same rng)."""
    x = scale[..., None] if granularity == "token" else scale
    pages, _ = paged_from_contiguous(x, page_size, np.random.default_rng(1))
    return pages[..., 0] if granularity == "token" else pages


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = [f"Machine: {m['cpu']}, {m['threads']} threads, {m['date']}; torch {m['torch']}. Causal, one new "
             f"token per sequence. Streaming read measured {', '.join(f'{g:.1f}' for g in m['stream_gbps'])} GB/s "
             f"in this run: roof = {m['roof_gbps']:.1f} GB/s; FMA peak {m.get('fma_gflops', float('nan')):.0f} "
             "GFLOP/s. Variants alternated; each time is the best round; "
             "torch SDPA runs in the same dtype; × fp32: the fp32 step time over this one.", "",
             "llama.cpp: its CPU flash attention (ggml_flash_attn_ext), cache as "
             + (", ".join(f"{k} → {v if v in set(GGML_KV_TYPES.values()) else 'not run'}"
                          for k, v in m.get("llamacpp", {}).items()) or "—")
             + "; kvcache/llama.cpp: its time over ours (goal ≥ 2×).", "",
             "paged: all kv heads of a page per task (the preset); per head: one kv head per task.", "",
             "8-bit caches (float8_e4m3fn, float8_e5m2, int8): q and o in bfloat16, one byte per K/V element read; "
             "× bf16: the bf16 step time over this one (goal ≥ 1.67: ≤ 0.6× the time); append: the --append "
             "kernel's step (one new key written and attended) over the plain one, minus 1 (goal ≤ 5%). _token, "
             "_group: per-token or per-group scales (their bytes counted); finer scales: the step over the same "
             "step with one scale per kv head, alternated with it, minus 1.", "",
             "FMA floor: the step's FLOP (4·batch·heads·cache·D) at the FMA peak; roof cap: the highest "
             "fraction of the roof that floor allows; × bf16 cap: the highest × bf16 it allows (both with "
             "compute and memory fully overlapped).", "",
             "| H:KH | D | dtype | batch | cache | K/V MB | kvcache ms | GB/s | of roof | FMA floor ms | roof cap | "
             "× fp32 | × bf16 | × bf16 cap | append | finer scales | "
             "paged ms | of roof | paged/contig. | paged per head ms | page order gain | torch ms | kvcache/torch | "
             "llama.cpp ms | kvcache/llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines[:0] = partial_line(m, "points")  # a partial run says so first

    def f(row, key, fmt):
        return format(row[key], fmt) if key in row else "—"

    for r in report["rows"]:
        lines.append(
            f"| {r['heads']}:{r['kv_heads']} | {r['head_dim']} | {r.get('dtype', 'float32')} | {r['batch']} | "
            f"{r['cache']} | {r['kv_bytes'] / 1e6:.0f} | {f(r, 'kvcache_ms', '.3f')} | {f(r, 'kvcache_gbps', '.1f')} | "
            f"{f(r, 'kvcache_roof', '.0%')} | {f(r, 'fma_floor_ms', '.3f')} | {f(r, 'roof_cap', '.0%')} | "
            f"{f(r, 'vs_fp32', '.2f')} | {f(r, 'vs_bf16', '.2f')} | {f(r, 'vs_bf16_cap', '.2f')} | "
            f"{f(r, 'append_cost', '+.1%')} | {f(r, 'scale_cost', '+.1%')} | {f(r, 'paged_ms', '.3f')} | "
            f"{f(r, 'paged_roof', '.0%')} | "
            f"{f(r, 'paged_vs_contiguous', '.2f')} | {f(r, 'paged_per_head_ms', '.3f')} | "
            f"{f(r, 'page_order_gain', '.2f')} | {f(r, 'torch_ms', '.3f')} | {f(r, 'kvcache_vs_torch', '.2f')}× | "
            f"{f(r, 'llamacpp_ms', '.3f')} | {f(r, 'kvcache_vs_llamacpp', '.2f')}× |")
    return "\n".join(lines)


def write(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    return write_report(report, out_dir, "decode", markdown)
