"""A continuous-batching simulation: the attention of a small serving engine, step by step.

Requests arrive over time with random prompt and output lengths. Every step the engine

1. admits waiting requests while the page pool has room for their prompt (FIFO), runs one
   **varlen prefill** over all admitted prompts (packed ``(total, H, D)`` + ``cu_seqlens``) and
   writes their keys and values into freshly allocated pages;
2. runs one **paged decode** step for every running request: its new token's key and value are
   written into its pages (a new page when the last one is full), then one query per request
   attends to its whole cache through the block table (``cache_seqlens`` = tokens so far);
3. frees the pages of requests that produced their last token.

Both kernels are tvm-attention artifacts of the same configuration (heads, kv_heads, head_dim,
causal); q/k/v are random (no model): what is measured is attention. Reported: tokens/s of
attention (prefill + decode tokens over the time spent in the two kernels), the peak KV memory
(pages in use × page bytes) and the pool, and on sampled steps the outputs against the float64
reference.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from ..artifact import kernel_of
from ..build import build_kernel
from ..layouts import LAYOUTS
from ..spec import AttentionSpec
from ..threads import set_num_threads


@dataclasses.dataclass(frozen=True)
class SimConfig:
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    num_pages: int = 2048  # the KV pool: 2048 pages × 16 tokens
    steps: int = 200
    arrival_rate: float = 0.5  # mean new requests per step (Poisson)
    prompt: tuple[int, int] = (16, 512)  # log-uniform prompt lengths
    output: tuple[int, int] = (8, 128)  # log-uniform output lengths
    max_running: int = 32
    check_every: int = 25  # compare with the reference every this many steps
    seed: int = 0


def tiny_config() -> SimConfig:
    return SimConfig(heads=4, kv_heads=2, num_pages=64, steps=12, arrival_rate=1.0, prompt=(4, 40), output=(2, 8),
                     check_every=3)


def _log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(round(np.exp(rng.uniform(np.log(lo), np.log(hi)))))


@dataclasses.dataclass
class _Request:
    rid: int
    prompt: int
    output: int
    pages: list[int] = dataclasses.field(default_factory=list)
    length: int = 0  # tokens in the cache
    produced: int = 0


def run(cfg: SimConfig, threads: int | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    threads = set_num_threads(threads)
    common = dict(batch=1, heads=cfg.heads, kv_heads=cfg.kv_heads, seq_q=64, head_dim=cfg.head_dim, causal=True)
    prefill_spec = AttentionSpec(layout="varlen", **common)
    decode_spec = AttentionSpec(layout="paged", page_size=cfg.page_size, **{**common, "seq_q": 1})
    prefill, decode = (kernel_of(build_kernel(s, cache=True)) for s in (prefill_spec, decode_spec))
    rng = np.random.default_rng(cfg.seed)
    P, KH, D, H = cfg.page_size, cfg.kv_heads, cfg.head_dim, cfg.heads
    k_pages = np.zeros((cfg.num_pages, P, KH, D), np.float32)
    v_pages = np.zeros_like(k_pages)
    free = list(range(cfg.num_pages))[::-1]
    waiting: list[_Request] = []
    running: list[_Request] = []
    stats = {"prefill_tokens": 0, "decode_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0, "checked_steps": 0,
             "max_err": 0.0, "peak_pages": 0, "finished": 0, "arrived": 0}
    next_id = 0

    def pages_for(n: int) -> int:
        return -(-n // P)

    def write_kv(req: _Request, k: np.ndarray, v: np.ndarray) -> None:
        """Append ``k``/``v (n, KH, D)`` to the request's pages (allocating as needed)."""
        for t in range(k.shape[0]):
            pos = req.length + t
            if pos // P >= len(req.pages):
                req.pages.append(free.pop())
            k_pages[req.pages[pos // P], pos % P] = k[t]
            v_pages[req.pages[pos // P], pos % P] = v[t]
        req.length += k.shape[0]

    for step in range(cfg.steps):
        check = cfg.check_every and step % cfg.check_every == 0
        for _ in range(rng.poisson(cfg.arrival_rate)):
            waiting.append(_Request(next_id, _log_uniform(rng, *cfg.prompt), _log_uniform(rng, *cfg.output)))
            next_id += 1
            stats["arrived"] += 1
        # 1. admit and prefill (pages reserved for the prompt and the first output token)
        admitted = []
        while (waiting and len(running) + len(admitted) < cfg.max_running
               and pages_for(waiting[0].prompt + 1) <= len(free) - sum(pages_for(r.prompt + 1) for r in admitted)):
            admitted.append(waiting.pop(0))
        if admitted:
            lens = [r.prompt for r in admitted]
            cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            q = rng.standard_normal((int(cu[-1]), H, D), dtype=np.float32)
            k = rng.standard_normal((int(cu[-1]), KH, D), dtype=np.float32)
            v = rng.standard_normal((int(cu[-1]), KH, D), dtype=np.float32)
            t0 = time.perf_counter()
            o = prefill(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
            stats["prefill_s"] += time.perf_counter() - t0
            stats["prefill_tokens"] += int(cu[-1])
            if check:
                ref = LAYOUTS["varlen"].reference(prefill_spec, {"q": q, "k": k, "v": v, "cu_seqlens_q": cu,
                                                                 "cu_seqlens_k": cu})
                stats["max_err"] = max(stats["max_err"], float(np.abs(o - ref).max()))
            for r, a, b in zip(admitted, cu[:-1], cu[1:]):
                write_kv(r, k[a:b], v[a:b])
            running += admitted
        # 2. one decode step for every running request that was already running
        active = [r for r in running if r not in admitted]
        if active:
            for r in active:
                write_kv(r, rng.standard_normal((1, KH, D), dtype=np.float32),
                         rng.standard_normal((1, KH, D), dtype=np.float32))
            lens = np.array([r.length for r in active], np.int32)
            table = np.full((len(active), max(len(r.pages) for r in active)), -1, np.int32)
            for i, r in enumerate(active):
                table[i, :len(r.pages)] = r.pages
            q = rng.standard_normal((len(active), H, 1, D), dtype=np.float32)
            t0 = time.perf_counter()
            o = decode(q, k_pages, v_pages, block_table=table, cache_seqlens=lens)
            stats["decode_s"] += time.perf_counter() - t0
            stats["decode_tokens"] += len(active)
            if check:
                ref = LAYOUTS["paged"].reference(decode_spec, {"q": q, "k_pages": k_pages, "v_pages": v_pages,
                                                               "block_table": table, "cache_seqlens": lens})
                stats["max_err"] = max(stats["max_err"], float(np.abs(o - ref).max()))
                stats["checked_steps"] += 1
            for r in active:
                r.produced += 1
        stats["peak_pages"] = max(stats["peak_pages"], cfg.num_pages - len(free))
        # 3. retire finished requests, free their pages
        for r in [r for r in running if r.produced >= r.output]:
            free.extend(r.pages)
            running.remove(r)
            stats["finished"] += 1
        if step % max(1, cfg.steps // 10) == 0:
            say(f"step {step}: running {len(running)}, waiting {len(waiting)}, pages in use "
                f"{cfg.num_pages - len(free)}/{cfg.num_pages}")
    page_bytes = 2 * P * KH * D * 4
    attn_s = stats["prefill_s"] + stats["decode_s"]
    tokens = stats["prefill_tokens"] + stats["decode_tokens"]
    stats.update({
        "threads": threads, "config": dataclasses.asdict(cfg), "attention_s": attn_s,
        "tokens_per_s": tokens / attn_s if attn_s else 0.0,
        "decode_tokens_per_s": stats["decode_tokens"] / stats["decode_s"] if stats["decode_s"] else 0.0,
        "peak_kv_bytes": stats["peak_pages"] * page_bytes, "pool_bytes": cfg.num_pages * page_bytes,
        "passed": stats["max_err"] <= 1e-4,
    })
    return stats


def summary(s: dict[str, Any]) -> str:
    return (f"{s['arrived']} requests arrived, {s['finished']} finished; {s['prefill_tokens']} prefill + "
            f"{s['decode_tokens']} decode tokens in {s['attention_s'] * 1e3:.1f} ms of attention: "
            f"{s['tokens_per_s']:.0f} tokens/s ({s['decode_tokens_per_s']:.0f} decode tokens/s); peak KV "
            f"{s['peak_kv_bytes'] / 2**20:.1f} MiB of a {s['pool_bytes'] / 2**20:.1f} MiB pool; "
            f"{s['checked_steps']} steps checked against the reference, max abs err {s['max_err']:.2e} "
            f"({'PASS' if s['passed'] else 'FAIL'})")
