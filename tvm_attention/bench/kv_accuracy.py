"""What an 8-bit cache costs in accuracy, per scale granularity, on a cache with outliers.

For each 8-bit cache dtype (``float8_e4m3fn``, ``float8_e5m2``, ``int8``) and each scale
granularity (``AttentionSpec.kv_scale``: one scale per kv head, per (token, kv head), per 32
elements of head_dim) a decode step (one new token per sequence, causal, GQA) against a cache whose
K and V carry the outliers real models have:

* an attention-sink token (token 0) whose key and value are ``sink_gain`` times louder than the
  rest (the first token of Llama-style models),
* ``outlier_channels`` channels of K ``channel_gain`` times louder (rotary dimensions of keys),
* ``loud_tokens`` value rows ``token_gain`` times louder, anywhere in the cache.

Reported per (dtype, granularity), against the float64 reference over the float32 cache before
quantization (``o64``): ``model_*``, the float64 reference over the values the cache holds (what
quantizing costs, whatever kernel reads it) and ``kernel_*``, our kernel's output (the model plus
its own float32 rounding), each as the largest absolute error and the RMS error over the RMS of
``o64``; and the bytes per element the cache and its scales take (``1 + 4·scales/head_dim``;
llama.cpp's Q8_0 takes 34 bytes per 32 elements, 1.0625, with a float16 scale per group).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..quant import KV_DTYPES, KV_SCALES, quantize_kv
from ..spec import AttentionSpec
from ..target import host_cpu


@dataclasses.dataclass(frozen=True)
class Config:
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    batch: int = 2
    cache: int = 4096
    dtypes: tuple[str, ...] = KV_DTYPES
    scales: tuple[str, ...] = KV_SCALES
    query_dtype: str = "float32"  # q and o: the kernel's rounding is then the cache's alone
    sink_gain: float = 30.0
    channel_gain: float = 20.0
    outlier_channels: int = 4
    token_gain: float = 10.0
    loud_tokens: int = 8
    seed: int = 0
    kernel: bool = True  # build and run our kernel at each point (False: the model alone)


def quick_config() -> Config:
    """A smoke run for CI: a small cache, every dtype and granularity."""
    return Config(heads=8, kv_heads=2, head_dim=64, batch=1, cache=256, loud_tokens=2)


def outlier_cache(cfg: Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``q (B, H, 1, D)``, ``k``/``v (B, KH, cache, D)`` float32 with the module docstring's
    outliers."""
    rng = np.random.default_rng(cfg.seed)
    b, h, kh, d, n = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.cache
    q = rng.standard_normal((b, h, 1, d)).astype(np.float32)
    k = rng.standard_normal((b, kh, n, d)).astype(np.float32)
    v = rng.standard_normal((b, kh, n, d)).astype(np.float32)
    k[:, :, 0] *= cfg.sink_gain
    v[:, :, 0] *= cfg.sink_gain
    k[..., rng.choice(d, cfg.outlier_channels, replace=False)] *= cfg.channel_gain
    v[:, :, rng.choice(np.arange(1, n), cfg.loud_tokens, replace=False)] *= cfg.token_gain
    return q, k, v


def _spec(cfg: Config, dtype: str | None, granularity: str) -> AttentionSpec:
    return AttentionSpec(batch=cfg.batch, heads=cfg.heads, kv_heads=cfg.kv_heads, seq_q=1, seq_kv=cfg.cache,
                         head_dim=cfg.head_dim, layout="kvcache", causal=True, dtype=cfg.query_dtype,
                         kv_dtype=dtype, kv_scale=granularity if dtype else "head")


def _errors(o: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    diff = np.asarray(o, np.float64) - exact
    return {"max": float(np.abs(diff).max()), "rms": float(np.sqrt(np.mean(diff ** 2) / np.mean(exact ** 2)))}


def run(cfg: Config, say: Callable[[str], None] = print) -> dict[str, Any]:
    from ..artifact import kernel_of  # TVM loads only when the benchmark runs
    from ..build import build_kernel  # (likewise)

    q, k, v = outlier_cache(cfg)
    lens = np.full(cfg.batch, cfg.cache, np.int32)
    plain = _spec(cfg, None, "head")
    lay = plain.layout_info
    exact = lay.reference(plain, {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": lens})
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": host_cpu(),
            "config": dataclasses.asdict(cfg)}
    say(f"# {meta['date']} cpu={meta['cpu']}: H{cfg.heads}:KH{cfg.kv_heads} D{cfg.head_dim} B{cfg.batch} "
        f"cache {cfg.cache}, outliers: sink x{cfg.sink_gain:g}, {cfg.outlier_channels} K channels "
        f"x{cfg.channel_gain:g}, {cfg.loud_tokens} V tokens x{cfg.token_gain:g}")
    rows = []
    for dtype in cfg.dtypes:
        for granularity in cfg.scales:
            spec = _spec(cfg, dtype, granularity)
            (kq, ks), (vq, vs) = (quantize_kv(x, dtype, granularity=granularity) for x in (k, v))
            arrays = {"q": q, "k_cache": kq, "v_cache": vq, "cache_seqlens": lens, "k_scale": ks, "v_scale": vs}
            model = lay.reference(spec, arrays)
            row = {"dtype": dtype, "kv_scale": granularity,
                   "bytes_per_element": 1 + 4 * spec.scale_groups / cfg.head_dim}  # per head: a few scales in all
            row.update({f"model_{n}": e for n, e in _errors(model, exact).items()})
            if cfg.kernel:
                o = kernel_of(build_kernel(spec, cache=True))(*arrays.values())
                row.update({f"kernel_{n}": e for n, e in _errors(o, exact).items()})
                row["kernel_vs_model_max"] = _errors(o, model)["max"]
            rows.append(row)
            say(f"{dtype} per {granularity}: model max {row['model_max']:.2e} rms {row['model_rms']:.2e}"
                + (f"; kernel max {row['kernel_max']:.2e} rms {row['kernel_rms']:.2e}" if cfg.kernel else ""))
    return {"meta": meta, "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    m, c = report["meta"], report["meta"]["config"]
    kernel = any("kernel_max" in r for r in report["rows"])
    lines = [f"Machine: {m['cpu']}, {m['date']}. Decode step, causal, H{c['heads']}:KH{c['kv_heads']} "
             f"D{c['head_dim']}, batch {c['batch']} × {c['cache']} keys, q and o {c['query_dtype']}. Outliers: "
             f"token 0 (a sink) ×{c['sink_gain']:g} in K and V, {c['outlier_channels']} K channels "
             f"×{c['channel_gain']:g}, {c['loud_tokens']} V tokens ×{c['token_gain']:g}. Errors against the "
             "float64 reference over the float32 cache: model = the float64 reference over the values the cache "
             "holds; kernel = ours. rms = RMS error / RMS of the output.", "",
             "| cache | scales | bytes / element | model max | model rms |"
             + (" kernel max | kernel rms | kernel − model |" if kernel else ""),
             "|---|---|---|---|---|" + ("---|---|---|" if kernel else "")]
    for r in report["rows"]:
        line = (f"| {r['dtype']} | per {r['kv_scale']} | {r['bytes_per_element']:.4f} | {r['model_max']:.2e} | "
                f"{r['model_rms']:.2e} |")
        if kernel:
            line += f" {r['kernel_max']:.2e} | {r['kernel_rms']:.2e} | {r['kernel_vs_model_max']:.1e} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: str | Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "kv_accuracy.md", "json": out / "kv_accuracy.json"}
    paths["md"].write_text(markdown(report))
    paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    return paths
