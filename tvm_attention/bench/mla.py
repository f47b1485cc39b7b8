"""MLA and head_dim_v benchmark (issue 44): DeepSeek-style latent-attention decode and a prefill
whose V is narrower than q·k, side by side with their peers in one run.

* **MLA decode** (``mla`` layout, one new token per sequence, ``heads`` query heads over one
  latent row of ``latent`` values, V its first ``rank``): ours against torch SDPA (the same
  numerics: q, K and V in the latent dtype, K and V broadcast to the heads by ``enable_gqa``)
  and, where ``ggml-python`` is installed, llama.cpp's CPU flash attention
  (``ggml_flash_attn_ext``) at 576 / 512 (bf16 as F16: the same bytes). With 128 heads a step
  does about 240 FLOP per byte of a bf16 cache: it is compute-bound, so it is judged against the
  compute roof measured in the same run: the AMX tile peak where the CPU has AMX-BF16 (a bf16
  latent cache there takes the tiles, and the ``vdpbf16ps`` form of the same step is timed beside
  it: issue 63's goal of ≥ 3× it), the bf16 dot-product peak where it has AVX512-BF16 (a bf16
  latent cache there takes ``vdpbf16ps``), else the fp32 FMA peak.
* **Prefill with head_dim_v** (B1, ``prefill_heads`` heads, ``seq`` × ``seq``, causal): Dqk 192 /
  Dv 128 (DeepSeek's unabsorbed prefill) against a D=192 build, in FLOP/s (each counts its own
  ``2·(Dqk + Dv)`` per pair).
* **Split-KV** (``split_heads`` heads, one sequence: DeepSeek's 128 heads over 8 devices): the
  build's split nest against the same build never split (``split_tasks=0``).
* **8-bit latent caches** (``kv_dtypes``, the first batch and cache): against the bf16 cache of
  the same step (no goal: the report says what the 8-bit caches cost or save).

Every variant of a point is timed alternately over ``rounds`` rounds (best kept).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..build import build_kernel
from ..spec import AttentionSpec
from ..threads import set_num_threads
from ..timing import aligned_inputs, time_built, time_callable
from . import Interrupted, Progress, best_of_alternated, mark_interrupted, partial_line, write_report
from .cpu import compute_roofs_meta
from .peers import GgmlDecode

#: Speed goals of issue 44 (checked in the report, never by a test).
GOALS = {"mla_of_roof": 0.70, "mla_vs_torch": 3.0, "mla_vs_llamacpp": 2.0, "dv_vs_d192": 0.90,
         "mla_amx_vs_dot": 3.0}  # (issue 63: the AMX tiles over the vdpbf16ps form, bf16 cache)
#: the product forms of the fused kernel's knob ``dot_bf16`` as the report names them
FORMS = {0: "fp32 products", 1: "bf16 dots", 2: "AMX tiles"}


@dataclasses.dataclass(frozen=True)
class Config:
    heads: int = 128  # DeepSeek-V3's
    latent: int = 576  # kv_lora_rank + qk_rope_head_dim
    rank: int = 512  # kv_lora_rank: V's columns
    #: DeepSeek-V3's softmax scale: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) = 1/sqrt(128 + 64)
    scale: float = 192 ** -0.5
    batches: tuple[int, ...] = (4, 16)
    caches: tuple[int, ...] = (4096,)
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    prefill_heads: int = 8
    seq: int = 2048
    prefill_dims: tuple[tuple[int, int], ...] = ((192, 128),)
    split_heads: int = 16  # DeepSeek-V3's 128 heads over 8 devices
    kv_dtypes: tuple[str, ...] = ("float8_e4m3fn", "int8")
    llamacpp: bool = True
    rounds: int = 3
    min_repeat_ms: int = 100


def quick_config() -> Config:
    return Config(heads=16, latent=96, rank=64, batches=(2,), caches=(256,), dtypes=("bfloat16",), prefill_heads=2,
                  seq=128, prefill_dims=((64, 32),), split_heads=4, kv_dtypes=("int8",), rounds=1, min_repeat_ms=5)


def run(cfg: Config, threads: int | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    threads = set_num_threads(threads)
    meta = compute_roofs_meta(cfg, threads, GOALS, say)
    points = [("decode", dt, b, n) for dt in cfg.dtypes for b in cfg.batches for n in cfg.caches]
    points += [("prefill", dqk, dv) for dqk, dv in cfg.prefill_dims]
    points += [("split",)] + ([("8-bit",)] if cfg.kv_dtypes else [])
    measure = {"decode": lambda *a: _decode(cfg, *a, threads, meta), "prefill": lambda *a: _prefill(cfg, *a),
               "split": lambda: _split(cfg), "8-bit": lambda: _eight_bit(cfg)}
    rows: list[dict[str, Any]] = []
    progress = Progress(len(points))
    try:
        for p in points:
            row = measure[p[0]](*p[1:])
            rows.append(row)
            progress.advance()
            say(f"{progress.tag()} " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in row.items()))
    except KeyboardInterrupt:  # the points measured so far
        mark_interrupted(meta, progress.done, progress.total)
        raise Interrupted({"meta": meta, "rows": rows}, progress.done, progress.total) from None
    return {"meta": meta, "rows": rows}


#: A peer whose one call takes longer (torch's bf16 SDPA on an MLA step: seconds) is timed by one
#: call after a warm-up, outside the alternated rounds: a gap of that size swamps the noise the
#: rounds are for, and three rounds of it would take minutes.
SLOW_CALL_S = 1.0


def _once(fn: Callable[[], Any]) -> float | None:
    """The time of one call of ``fn`` after a warm-up when it is slower than :data:`SLOW_CALL_S`, else None
    (alternate it with the others)."""
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    return t if t > SLOW_CALL_S else None


def mla_spec(cfg: Config, dtype: str, batch: int, cache: int, heads: int | None = None,
             kv_dtype: str | None = None) -> AttentionSpec:
    """The ``mla`` decode step of a point (one new token; the cache's length its representative)."""
    return AttentionSpec(batch=batch, heads=heads or cfg.heads, seq_q=1, seq_kv=cache, head_dim=cfg.latent,
                         head_dim_v=cfg.rank, layout="mla", scale=cfg.scale, causal=True, dtype=dtype,
                         kv_dtype=kv_dtype)


def _steps(cfg: Config, builds: dict[str, tuple[AttentionSpec, Any]], batch: int, cache: int) -> dict[str, float]:
    """Best times (s) of decode steps ``name -> (spec, knobs)`` built and timed alternately."""
    case = {"seq_q": 1, "cache_seqlens": [cache] * batch, "max_len": cache}
    built = {n: build_kernel(s, knobs=k, cache=True) for n, (s, k) in builds.items()}
    return best_of_alternated({n: (lambda b=built[n], s=builds[n][0]: time_built(
        b, s, repeat=3, min_repeat_ms=cfg.min_repeat_ms, case=case).median_s) for n in builds}, cfg.rounds)


def _split(cfg: Config) -> dict[str, Any]:
    """One sequence of ``split_heads`` heads, bf16: the split nest against the never-split build."""
    spec, cache = mla_spec(cfg, "bfloat16", 1, cfg.caches[0], heads=cfg.split_heads), cfg.caches[0]
    best = _steps(cfg, {"split": (spec, None), "unsplit": (spec, {"split_tasks": 0})}, 1, cache)
    return {"point": "mla split", "dtype": "bfloat16", "batch": 1, "cache": cache, "heads": cfg.split_heads,
            "split_ms": best["split"] * 1e3, "unsplit_ms": best["unsplit"] * 1e3,
            "split_speedup": best["unsplit"] / best["split"]}


def _eight_bit(cfg: Config) -> dict[str, Any]:
    """The first batch and cache with each 8-bit latent cache (one kv_scale) against bf16."""
    batch, cache = cfg.batches[0], cfg.caches[0]
    builds = {"bf16": (mla_spec(cfg, "bfloat16", batch, cache), None)}
    builds.update({kd: (mla_spec(cfg, "bfloat16", batch, cache, kv_dtype=kd), None) for kd in cfg.kv_dtypes})
    best = _steps(cfg, builds, batch, cache)
    row: dict[str, Any] = {"point": "mla 8-bit", "dtype": "bfloat16", "batch": batch, "cache": cache,
                           "heads": cfg.heads, "bf16_ms": best["bf16"] * 1e3}
    for kd in cfg.kv_dtypes:
        row[f"{kd}_ms"], row[f"{kd}_vs_bf16"] = best[kd] * 1e3, best["bf16"] / best[kd]
    return row


def _decode(cfg: Config, dtype: str, batch: int, cache: int, threads: int, meta: dict[str, Any]) -> dict[str, Any]:
    spec = mla_spec(cfg, dtype, batch, cache)
    case = {"seq_q": 1, "cache_seqlens": [cache] * batch, "max_len": cache}
    built = build_kernel(spec, cache=True)
    q, kv, lens, _ = aligned_inputs(spec, case=case)
    timers = {"ours": lambda: time_built(built, spec, repeat=3, min_repeat_ms=cfg.min_repeat_ms,
                                         case=case).median_s}
    form = getattr(built.knobs, "dot_bf16", 0)
    if form == 2:  # on AMX tiles: the vdpbf16ps form of the same step beside it (issue 63's goal)
        dot = build_kernel(spec, knobs={"dot_bf16": 1}, cache=True)
        timers["bf16_dot"] = lambda: time_built(dot, spec, repeat=3, min_repeat_ms=cfg.min_repeat_ms,
                                                case=case).median_s
    row: dict[str, Any] = {"point": "mla decode", "dtype": dtype, "batch": batch, "cache": cache,
                           "heads": cfg.heads, "latent": cfg.latent, "rank": cfg.rank, "form": FORMS[form]}
    k4 = kv[:, None]  # (B, 1, cache, latent): one kv head
    torch_fn = _torch_mla(q, k4, k4[..., :cfg.rank], cfg.scale, threads)
    once = {}
    if torch_fn is None:
        row["torch"] = "skipped: torch not installed"
    elif (slow := _once(torch_fn)) is not None:
        once["torch"], row["torch"] = slow, "timed once (one call over SLOW_CALL_S)"
    else:
        timers["torch"] = lambda: time_callable(torch_fn, repeat=3, min_repeat_ms=cfg.min_repeat_ms).median_s
    ggml_step = None
    if cfg.llamacpp:
        f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731 - ggml takes float32 and stores its own type
        ggml_step, why = GgmlDecode.create(f32(q), f32(k4), f32(k4[..., :cfg.rank]), dtype, cfg.scale, threads)
        row["llamacpp"] = why if ggml_step is None else f"ggml_flash_attn_ext, {why} cache"
        if ggml_step is not None:
            timers["llamacpp"] = lambda: time_callable(ggml_step.call, repeat=3,
                                                       min_repeat_ms=cfg.min_repeat_ms).median_s
    try:
        best = {**best_of_alternated(timers, cfg.rounds), **once}
    finally:
        if ggml_step is not None:
            ggml_step.close()
    flop = 2.0 * (cfg.latent + cfg.rank) * cfg.heads * cache * batch
    for n, t in best.items():
        row[f"{n}_ms"], row[f"{n}_gflops"] = t * 1e3, flop / t / 1e9
    # the roof of the units that do the products: the tiles, the bf16 dots, else the FMAs
    tiles, dots = form == 2 and meta.get("amx_tile_peak_gflops"), dtype == "bfloat16" and meta["bf16_dot_peak_gflops"]
    row["roof"] = "AMX tile peak" if tiles else "bf16 dot peak" if dots else "fp32 FMA peak"
    row["of_roof"] = row["ours_gflops"] / (tiles or dots or meta["fma_peak_gflops"])
    if "bf16_dot_ms" in row:
        row["amx_vs_dot"] = row["bf16_dot_ms"] / row["ours_ms"]
    for peer in ("torch", "llamacpp"):
        if f"{peer}_ms" in row:
            row[f"vs_{peer}"] = row[f"{peer}_ms"] / row["ours_ms"]
    return row


def _torch_mla(q, k, v, scale: float, threads: int) -> Callable[[], Any] | None:
    """torch SDPA on one MLA step, q (B, H, 1, latent), k (B, 1, n, latent), v (B, 1, n, rank) in
    their dtype, K and V broadcast to the heads (``enable_gqa``), one sequence per call: its CPU
    path copies K and V out to every head, 18 GB for batch 16 × 4k × 128 heads in bf16 (the
    process was killed for memory), 1/B of it a sequence; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    from ..loader import _from_framework  # beside torch: the peers' conversion, once torch is known to be there

    torch.set_num_threads(threads)
    qt, kt, vt = (_from_framework("torch", x) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step():
        return [sdpa(qt[b:b + 1], kt[b:b + 1], vt[b:b + 1], scale=scale, enable_gqa=True) for b in range(qt.shape[0])]

    return step


def _prefill(cfg: Config, dqk: int, dv: int) -> dict[str, Any]:
    specs = {f"d{dqk}": AttentionSpec(batch=1, heads=cfg.prefill_heads, seq_q=cfg.seq, head_dim=dqk, causal=True),
             f"d{dqk}v{dv}": AttentionSpec(batch=1, heads=cfg.prefill_heads, seq_q=cfg.seq, head_dim=dqk,
                                           head_dim_v=dv, causal=True)}
    built = {n: build_kernel(s, cache=True) for n, s in specs.items()}
    timers = {n: (lambda b=built[n], s=s: time_built(b, s, repeat=3, min_repeat_ms=cfg.min_repeat_ms).median_s)
              for n, s in specs.items()}
    best = best_of_alternated(timers, cfg.rounds)
    row: dict[str, Any] = {"point": "prefill", "dtype": "float32", "seq": cfg.seq, "heads": cfg.prefill_heads}
    for n, t in best.items():
        row[f"{n}_ms"], row[f"{n}_gflops"] = t * 1e3, specs[n].flops() / t / 1e9
    row["dv_vs_d"] = row[f"d{dqk}v{dv}_gflops"] / row[f"d{dqk}_gflops"]
    return row


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    c = m["config"]
    fmt = lambda x, f: format(x, f) if isinstance(x, (int, float)) else "—"  # noqa: E731
    lines = partial_line(m, "points") + [
        f"Machine: {m['cpu']}, {m['threads']} threads, {m['date']}. Roofs measured in this run: fp32 FMA peak "
        f"{m['fma_peak_gflops']:.0f} GFLOP/s, bf16 dot-product peak {(m['bf16_dot_peak_gflops'] or 0):.0f} GFLOP/s, "
        f"AMX tile peak {(m.get('amx_tile_peak_gflops') or 0):.0f} GFLOP/s. "
        "Best of alternated rounds.", "",
        f"MLA decode: H={c['heads']}, latent {c['latent']}, V its first {c['rank']}, one new token per sequence; "
        "GFLOP/s count 2·(latent + rank) per (head, key). Roof: the peak of the units the build multiplies on (the "
        "AMX tiles, else the bf16 dots for a bf16 cache where the CPU has them, else the FMAs). Goals: ≥ 70 % "
        "of the roof, ≥ 3× torch SDPA, ≥ 2× llama.cpp.", "",
        "| dtype | batch × cache | ours ms | GFLOP/s | of roof | torch ms | vs torch | llama.cpp ms | vs llama.cpp |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if r["point"] != "mla decode":
            continue
        lines.append(f"| {r['dtype']} ({r['form']}) | {r['batch']} × {r['cache']} | {r['ours_ms']:.2f} | "
                     f"{r['ours_gflops']:.0f} | {r['of_roof']:.0%} of {r['roof']} | {fmt(r.get('torch_ms'), '.2f')} | "
                     f"{fmt(r.get('vs_torch'), '.2f')}× | {fmt(r.get('llamacpp_ms'), '.2f')} | "
                     f"{fmt(r.get('vs_llamacpp'), '.2f')}× |")
    amx = [r for r in report["rows"] if "amx_vs_dot" in r]
    if amx:
        lines += ["", "On AMX tiles over the `vdpbf16ps` form of the same step, side by side (goal ≥ 3×): "
                  + "; ".join(f"batch {r['batch']} × {r['cache']}: {r['bf16_dot_ms']:.2f} ms → {r['ours_ms']:.2f} ms, "
                              f"**{r['amx_vs_dot']:.2f}×**" for r in amx) + "."]
    pre = [r for r in report["rows"] if r["point"] == "prefill"]
    if pre:
        lines += ["", f"Prefill, B1 H{c['prefill_heads']} S={c['seq']} causal fp32 (goal: Dv ≠ D at ≥ 90 % of the "
                  "D build's FLOP rate):", "", "| build | ms | GFLOP/s |", "|---|---|---|"]
        for r in pre:
            for k in r:
                if k.endswith("_gflops"):
                    n = k[:-len("_gflops")]
                    lines.append(f"| {n} | {r[n + '_ms']:.2f} | {r[k]:.0f} |")
            lines.append(f"| ratio | | {r['dv_vs_d']:.2f} |")
    for r in report["rows"]:
        if r["point"] == "mla split":
            lines += ["", f"Split-KV, one sequence × {r['heads']} heads × {r['cache']}, bf16: split "
                      f"{r['split_ms']:.2f} ms, never split {r['unsplit_ms']:.2f} ms, **{r['split_speedup']:.2f}×**."]
        if r["point"] == "mla 8-bit":
            kds = [k[:-len("_vs_bf16")] for k in r if k.endswith("_vs_bf16")]
            lines += ["", f"8-bit latent caches, batch {r['batch']} × {r['cache']}, {r['heads']} heads (float32 "
                      "products on the converted values; a bf16 cache takes bf16 dot products): bf16 "
                      f"{r['bf16_ms']:.2f} ms; " + "; ".join(f"{kd} {r[kd + '_ms']:.2f} ms "
                                                            f"({r[kd + '_vs_bf16']:.2f}× bf16's speed)" for kd in kds)
                      + "."]
    return "\n".join(lines)


def write(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    return write_report(report, out_dir, "mla", markdown)
