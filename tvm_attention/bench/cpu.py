"""Side-by-side CPU benchmark: fused, materialized and rowcache (hand schedules; ``*-tuned``
variants use the best validated record of the tuning log), NumPy, PyTorch SDPA.

All variants run in one process at the same thread count, on the same inputs, so the ratios
are fair on a noisy machine. GFLOP/s use 4·B·H·Sq·Skv·D, halved for causal.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable

import numpy as np

from ..spec import AttentionSpec
from ..timing import Timing, aligned_inputs, time_callable, time_module


@dataclasses.dataclass
class Row:
    spec: AttentionSpec
    variant: str
    timing: Timing | None
    error: str | None = None

    def gflops(self) -> float | None:
        return self.timing.gflops(self.spec) if self.timing else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "variant": self.variant,
            "median_ms": self.timing.median_s * 1e3 if self.timing else None,
            "std_ms": self.timing.std_s * 1e3 if self.timing else None,
            "gflops": self.gflops(),
            "error": self.error,
        }


def numpy_attention(spec: AttentionSpec) -> Callable[[], Any]:
    """Float32 NumPy attention (matmul-based, per (b, h)); a peer, not the reference."""
    q, k, v, _ = aligned_inputs(spec)
    g = spec.group_size
    mask = None
    if spec.causal:
        i = np.arange(spec.seq_q)[:, None]
        j = np.arange(spec.seq_kv)[None, :]
        mask = j > i + spec.kv_offset

    def run():
        out = np.empty(spec.o_shape, np.float32)
        for b in range(spec.batch):
            for h in range(spec.heads):
                s = (q[b, h] @ k[b, h // g].T) * np.float32(spec.scale)
                if mask is not None:
                    s[mask] = -np.inf
                m = s.max(axis=-1, keepdims=True)
                m[~np.isfinite(m)] = 0
                p = np.exp(s - m)
                l = p.sum(axis=-1, keepdims=True)
                out[b, h] = (p @ v[b, h // g]) / np.where(l > 0, l, 1)
        return out

    return run


def torch_sdpa(spec: AttentionSpec, threads: int) -> Callable[[], Any] | None:
    """PyTorch's CPU scaled_dot_product_attention, or None when torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    q, k, v, _ = (torch.from_numpy(x) for x in aligned_inputs(spec))
    if spec.group_size > 1:
        k = k.repeat_interleave(spec.group_size, dim=1)
        v = v.repeat_interleave(spec.group_size, dim=1)
    if spec.causal and spec.seq_q != spec.seq_kv:
        # torch's is_causal is top-left aligned; pass the bottom-right mask explicitly.
        i = torch.arange(spec.seq_q)[:, None]
        j = torch.arange(spec.seq_kv)[None, :]
        mask = j <= i + spec.kv_offset
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=spec.causal, scale=spec.scale)


def bench_spec(spec: AttentionSpec, threads: int, variants: list[str], repeat: int = 5,
               min_repeat_ms: int = 200) -> list[Row]:
    from ..build import build_kernel

    rows = []
    for variant in variants:
        try:
            if variant in ("fused", "materialized", "rowcache"):
                k = build_kernel(spec, schedule=variant)
                t = time_module(k.module, k.entry, spec, repeat=repeat, min_repeat_ms=min_repeat_ms)
            elif variant.endswith("-tuned"):
                from ..pipeline import build_best

                k, validation = build_best(spec, schedule=variant[: -len("-tuned")])
                if k.source != "tuned":
                    rows.append(Row(spec, variant, None, "no tuning log for this spec"))
                    continue
                if not validation.passed:
                    rows.append(Row(spec, variant, None, "tuned build failed validation"))
                    continue
                t = time_module(k.module, k.entry, spec, repeat=repeat, min_repeat_ms=min_repeat_ms)
            elif variant == "numpy":
                t = time_callable(numpy_attention(spec), repeat=repeat, min_repeat_ms=min_repeat_ms)
            elif variant == "torch":
                fn = torch_sdpa(spec, threads)
                if fn is None:
                    rows.append(Row(spec, variant, None, "torch not installed"))
                    continue
                t = time_callable(fn, repeat=repeat, min_repeat_ms=min_repeat_ms)
            else:
                raise ValueError(f"unknown variant {variant!r}")
            rows.append(Row(spec, variant, t))
        except MemoryError as e:
            rows.append(Row(spec, variant, None, f"out of memory: {e}"))
        except Exception as e:  # a failing variant is recorded; the sweep goes on
            rows.append(Row(spec, variant, None, f"{type(e).__name__}: {e}"))
    return rows


def sgemm_ceiling(threads: int, n: int = 2048) -> float:
    """GFLOP/s of a NumPy n×n float32 matmul (the machine's practical compute ceiling)."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    t = time_callable(lambda: a @ a, repeat=5, min_repeat_ms=200)
    return 2 * n**3 / t.median_s / 1e9


def format_table(rows: list[Row], ceiling: float | None) -> str:
    by_spec: dict[AttentionSpec, dict[str, Row]] = {}
    for r in rows:
        by_spec.setdefault(r.spec, {})[r.variant] = r
    variants = list(dict.fromkeys(r.variant for r in rows))
    head = f"| {'S':>6} | causal | " + " | ".join(f"{v} GFLOP/s" for v in variants)
    head += " | fused/materialized | fused/torch | fused/numpy |"
    if ceiling:
        head += " fused % of sgemm |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for spec, d in by_spec.items():
        cells = []
        for v in variants:
            r = d.get(v)
            g = r.gflops() if r else None
            cells.append(f"{g:.1f}" if g else (r.error[:24] if r and r.error else "-"))

        def ratio(a, b):
            ra, rb = d.get(a), d.get(b)
            if ra and rb and ra.timing and rb.timing:
                return f"{rb.timing.median_s / ra.timing.median_s:.2f}x"
            return "-"

        line = f"| {spec.seq_q:>6} | {'yes' if spec.causal else 'no':>6} | " + " | ".join(cells)
        line += f" | {ratio('fused', 'materialized')} | {ratio('fused', 'torch')} | {ratio('fused', 'numpy')} |"
        if ceiling:
            f = d.get("fused")
            line += f" {100 * f.gflops() / ceiling:.0f}% |" if f and f.timing else " - |"
        lines.append(line)
    return "\n".join(lines)


def write_json(path: str, rows: list[Row], meta: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [r.to_dict() for r in rows]}, f, indent=2)
