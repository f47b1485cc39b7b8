"""The attention variants' speed goals (issue 26), each a pair of kernels timed side by side in
one run, alternating rounds on the same threads:

* **window, prefill**: causal at ``S`` with a window of ``W`` keys against plain causal at ``S``
  (goal: ≥ 3× faster at 16k with 4k): whole key tiles outside the window are skipped;
* **window, decode**: a decode step against a cache of ``long`` keys with a window of ``W``
  against a step against a cache of ``W`` keys (goal: within 1.3×): it reads only the window;
* **softcap**: the same prefill with a softcap (goal: ≥ 0.8× the speed: a tanh per score);
* **alibi, sinks, kv_start**: the same prefill and decode step with each (goal: within 5 %);
  ``kv_start`` is 0 for every sequence, so the work is the plain kernel's.
* **user-written modifiers** (goals of ours; the issue sets none): a ``score_mod`` (a relative
  bias per head, read from a tensor) and a ``mask_mod`` (document ids from a tensor, one document:
  the plain kernel's work) against the plain prefill (≥ 0.8, as the softcap's tanh); and
  **documents**: a causal prefill at ``S`` packing documents of ``doc_len`` tokens, with the
  document mask and its key bounds, against plain causal at ``S`` (≥ half the work ratio: whole
  tiles outside a row tile's document are skipped).

Each pair's ratio is ``baseline time / variant time`` per round (> 1: the variant is faster);
the report gives the best time of each kernel and the median of the rounds' ratios.
"""
from __future__ import annotations

import dataclasses
import datetime
import statistics
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..build import build_kernel
from ..layouts import alibi_slopes
from ..loader import aligned_empty, kernel_arg
from ..spec import AttentionSpec
from ..target import host_cpu
from ..threads import set_num_threads
from . import write_report


@dataclasses.dataclass(frozen=True)
class Config:
    seq: int = 16384  # prefill length of the window pair
    window: int = 4096  # keys a row sees (the window (window - 1, 0))
    short_seq: int = 4096  # prefill length of the softcap / alibi / sinks / kv_start pairs
    heads: int = 8  # prefill: H = KH
    head_dim: int = 64
    long_cache: int = 32768  # decode: the cache the windowed step reads a window of
    decode_heads: tuple[int, int] = (32, 8)  # GQA 32:8
    decode_head_dim: int = 128
    decode_batch: int = 4
    softcap: float = 50.0  # Gemma-2's
    doc_len: int = 1024  # tokens per document of the documents pair (S / doc_len documents)
    # 3 rounds moved single pairs by ±8 % on a 2-core VM (alibi 0.94 with 3, 0.97 with 9)
    rounds: int = 7
    min_repeat_ms: int = 200


def quick_config() -> Config:
    """A smoke run for CI: small shapes, one round."""
    return Config(seq=512, window=128, short_seq=256, heads=2, head_dim=32, long_cache=1024, decode_heads=(8, 2),
                  decode_head_dim=64, decode_batch=2, rounds=1, min_repeat_ms=5, doc_len=128)


#: pair name -> (goal ratio, how the ratio is read)
GOALS = {"window_prefill": (3.0, ">="), "window_decode": (1 / 1.3, ">="), "softcap_prefill": (0.8, ">="),
         "alibi_prefill": (0.95, ">="), "sinks_prefill": (0.95, ">="), "kv_start_prefill": (0.95, ">="),
         "softcap_decode": (0.8, ">="), "alibi_decode": (0.95, ">="), "sinks_decode": (0.95, ">="),
         "kv_start_decode": (0.95, ">="), "score_mod_prefill": (0.8, ">="), "mask_mod_prefill": (0.8, ">="),
         "documents_prefill": (None, ">=")}  # None: half the pair's work ratio

#: the modifiers the bench builds (tvm_attention.modifiers)
REL_BIAS = "lambda s, b, h, q, kv: s - slope[h] * abs(q - kv)"
DOC_MASK = "lambda b, h, q, kv: doc[b, q] == doc[b, kv]"


def pairs(cfg: Config) -> dict[str, tuple[tuple[AttentionSpec, dict], tuple[AttentionSpec, dict]]]:
    """name -> ((variant spec, case), (baseline spec, case))."""
    def prefill(seq, **kw):
        spec = AttentionSpec(batch=1, heads=cfg.heads, seq_q=seq, head_dim=cfg.head_dim, causal=True, **kw)
        return spec, {"batch": 1, "seq_q": seq, "seq_kv": seq}

    def decode(cache, **kw):
        h, kh = cfg.decode_heads
        spec = AttentionSpec(batch=cfg.decode_batch, heads=h, kv_heads=kh, seq_q=1, seq_kv=cache,
                             head_dim=cfg.decode_head_dim, causal=True, layout="kvcache", **kw)
        return spec, {"seq_q": 1, "cache_seqlens": [cache] * cfg.decode_batch, "max_len": cache}

    win = (cfg.window - 1, 0)
    out = {"window_prefill": (prefill(cfg.seq, window=win), prefill(cfg.seq)),
           "window_decode": (decode(cfg.long_cache, window=win), decode(cfg.window))}
    for name, kw in (("softcap", {"softcap": cfg.softcap}), ("alibi", {"alibi": True}), ("sinks", {"sinks": True}),
                     ("kv_start", {"kv_start": True})):
        out[f"{name}_prefill"] = (prefill(cfg.short_seq, **kw), prefill(cfg.short_seq))
        out[f"{name}_decode"] = (decode(cfg.window, **kw), decode(cfg.window))
    doc = {"mask_mod": DOC_MASK, "mod_tensors": (("doc", "int32", ("batch", "seq_kv")),)}
    out["score_mod_prefill"] = (prefill(cfg.short_seq, score_mod=REL_BIAS,
                                        mod_tensors=(("slope", "float32", ("heads",)),)), prefill(cfg.short_seq))
    one_doc = prefill(cfg.short_seq, **doc)
    out["mask_mod_prefill"] = ((one_doc[0], {**one_doc[1], "doc_len": cfg.short_seq}), prefill(cfg.short_seq))
    docs = prefill(cfg.seq, key_bounds=True, **doc)
    out["documents_prefill"] = ((docs[0], {**docs[1], "doc_len": cfg.doc_len}), prefill(cfg.seq))
    return out


def documents(arrays: dict, doc_len: int) -> None:
    """Set the modifiers' arrays of a bhsd case to documents of ``doc_len`` tokens: ``doc``
    ids, and the key bounds of each position's document."""
    b, n = arrays["q"].shape[0], arrays["k"].shape[2]
    pos = np.arange(n)
    if "doc" in arrays:
        arrays["doc"][...] = np.broadcast_to((pos // doc_len).astype(np.int32), (b, n))
    if "key_lo" in arrays:
        lo = (pos // doc_len) * doc_len
        arrays["key_lo"][...] = np.broadcast_to(lo.astype(np.int32), (b, n))
        arrays["key_hi"][...] = np.broadcast_to(np.minimum(lo + doc_len, n).astype(np.int32), (b, n))


def work(spec: AttentionSpec, case: dict) -> float:
    """The useful FLOPs of ``case``: 4·D·H per visible pair (a documents case: within documents)."""
    if "doc_len" not in case:
        return spec.layout_info.useful_flops(spec, case)
    n, L = case["seq_kv"], case["doc_len"]
    per_doc = [min(L, n - a) for a in range(0, n, L)]
    pairs = sum(m * (m + 1) // 2 for m in per_doc) if spec.causal else sum(m * m for m in per_doc)
    return 4.0 * spec.head_dim * spec.heads * case["batch"] * pairs


def _timer(built, case: dict, min_repeat_ms: int) -> Callable[[], float]:
    import tvm

    spec = built.spec
    arrays = spec.layout_info.random_inputs(spec, case, seed=0)
    if "kv_start" in arrays:
        arrays["kv_start"][:] = 0  # every key visible: the plain kernel's work
    if "slope" in arrays:
        arrays["slope"][...] = alibi_slopes(spec.heads)
    if "doc_len" in case:
        documents(arrays, case["doc_len"])
    args = []
    for x in list(arrays.values()) + [np.zeros(arrays["q"].shape, spec.np_dtype)]:
        a = aligned_empty(x.shape, x.dtype)
        a[...] = x
        args.append(kernel_arg(a))
    te = built.runtime_module.time_evaluator(built.entry, tvm.cpu(), number=1, repeat=3, min_repeat_ms=min_repeat_ms)
    built.function(*args)  # warm-up
    return lambda: float(np.median(te(*args).results))


def run(cfg: Config, threads: int | None = None, only: tuple[str, ...] = (),
        say: Callable[[str], None] = print) -> dict[str, Any]:
    threads = set_num_threads(threads)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": host_cpu(), "threads": threads,
            "config": dataclasses.asdict(cfg)}
    say(f"# {meta['date']} cpu={meta['cpu']} threads={threads}")
    built: dict[AttentionSpec, Any] = {}
    rows = []
    for name, ((spec_a, case_a), (spec_b, case_b)) in pairs(cfg).items():
        if only and name not in only:
            continue
        timers = []
        for spec, case in ((spec_a, case_a), (spec_b, case_b)):
            if spec not in built:
                built[spec] = build_kernel(spec, cache=True)
            timers.append(_timer(built[spec], case, cfg.min_repeat_ms))
        times: list[list[float]] = [[], []]
        for r in range(cfg.rounds):  # alternate: the variant, then the baseline, each round
            for i in (r % 2, 1 - r % 2):
                times[i].append(timers[i]())
        ratios = [b / a for a, b in zip(*times)]
        goal, _ = GOALS[name]
        # the useful work's ratio (visible pairs, 4·D·H FLOPs each): what skipping tiles can reach
        work_ratio = work(spec_b, case_b) / work(spec_a, case_a)
        goal = work_ratio / 2 if goal is None else goal
        row = {"name": name, "variant": spec_a.short_name(), "baseline": spec_b.short_name(),
               "variant_ms": min(times[0]) * 1e3, "baseline_ms": min(times[1]) * 1e3,
               "ratio": statistics.median(ratios), "ratios": ratios, "goal": goal, "work_ratio": work_ratio}
        row["met"] = row["ratio"] >= goal
        rows.append(row)
        say(f"{name}: {row['variant_ms']:.3f} ms vs {row['baseline_ms']:.3f} ms: ratio {row['ratio']:.2f} "
            f"(goal >= {goal:.2f}: {'met' if row['met'] else 'MISSED'}; useful work ratio {work_ratio:.2f})")
    return {"meta": meta, "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    c = m["config"]
    lines = [f"Machine: {m['cpu']}, {m['threads']} threads, {m['date']}. Each pair timed side by side, "
             f"alternating, {c['rounds']} rounds; times are the best round, the ratio (baseline time / variant time) "
             "the median of the rounds'. Prefill: B1, H=KH={}, D={}, causal, fp32; decode: kvcache, batch {}, "
             "GQA {}:{}, D={}, fp32.".format(c["heads"], c["head_dim"], c["decode_batch"], *c["decode_heads"],
                                             c["decode_head_dim"]), "",
             "work ratio: the baseline's visible (query, key) pairs over the variant's — the ratio skipping "
             "whole tiles can reach.", "",
             "| pair | variant | ms | baseline | ms | ratio | work ratio | goal |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['name']} | `{r['variant']}` | {r['variant_ms']:.3f} | `{r['baseline']}` | "
                     f"{r['baseline_ms']:.3f} | {r['ratio']:.2f} | {r['work_ratio']:.2f} | "
                     f"≥ {r['goal']:.2f} {'met' if r['met'] else 'missed'} |")
    return "\n".join(lines)


def write(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    return write_report(report, out_dir, "variants", markdown)
