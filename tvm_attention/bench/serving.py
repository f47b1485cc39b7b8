"""Serving benchmarks of symbolic shapes and the varlen layout: ratios measured side by side.

Three questions, each answered by variants timed in the same run, alternated round by round (the
order flips every round, so neither variant always runs first after the other warmed the caches),
each variant's time the best of the rounds' medians (these VMs are shared: a round that another
process slowed is dropped rather than averaged in):

a. dynamic vs static: the fused hand schedule built with batch, seq_q and seq_kv symbolic
   (representative = the timed shape) against the static build; ratio static/dynamic time
   (goal >= 0.95).
b. varlen vs dense: mixed batches in FlashAttention's packed layout against the dense kernel at
   B=1, S=the longest sequence; useful GFLOP/s (``layout.useful_flops(spec, case) / time``: only the
   visible (query, key) pairs count) for both and their ratio (goal >= 0.75).
c. loader overhead per call at decode size (Sq=1, Skv=64): ``tvm_attention.load(dir)``'s
   ``kernel(q, k, v)`` (NumPy arrays 64-byte aligned or not, and torch when installed) against the
   bare packed-function call on preallocated TVM tensors; also the varlen loader on a small batch.
   Overhead = loader - bare (medians of the repeats).

Every variant runs on the same thread count (``threads.set_num_threads``, default all cores).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..artifact import export, validate_built
from ..build import build_kernel
from ..layouts import LAYOUTS
from ..loader import aligned_empty, load
from ..spec import DYNAMIC_DIMS, AttentionSpec
from ..target import host_cpu
from ..threads import set_num_threads
from ..timing import time_built
from . import write_report

GOAL_DYNAMIC = 0.95
GOAL_VARLEN = 0.75


@dataclasses.dataclass(frozen=True)
class Config:
    heads: int = 8
    head_dim: int = 64
    causals: tuple[bool, ...] = (False, True)
    #: (a) sequence lengths (B=1, Sq = Skv)
    dyn_seqs: tuple[int, ...] = (1024, 4096)
    #: (b) the dense comparison's length, and name -> [(seq_q, seq_kv), ...] of each mixed batch
    dense_seq: int = 2048
    mixes: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()
    #: (a, b) alternated rounds; per round and variant, time_module's repeat and min_repeat_ms
    rounds: int = 5
    repeat: int = 3
    min_repeat_ms: int = 200
    #: (c) decode shape (Sq, Skv), the varlen small batch, calls per measurement, measurements
    decode: tuple[int, int] = (1, 64)
    varlen_small: tuple[tuple[int, int], ...] = ((1, 64),) * 4
    calls: int = 2000
    call_repeats: int = 5


def log_uniform_mix(n: int, lo: int, hi: int, seed: int) -> tuple[tuple[int, int], ...]:
    """``n`` self-attention sequences with lengths log-uniform in [lo, hi] (seeded: every run
    times the same batch)."""
    rng = np.random.default_rng(seed)
    lens = np.exp(rng.uniform(math.log(lo), math.log(hi), n)).round().astype(int)
    return tuple((int(s), int(s)) for s in lens)


def full_config() -> Config:
    return Config(mixes=(("1x2048 + 32x64", ((2048, 2048),) + ((64, 64),) * 32),
                         ("16 log-uniform 16..2048 (seed 0)", log_uniform_mix(16, 16, 2048, seed=0))))


def quick_config() -> Config:
    """Smoke run: every row of the full report on short lengths, few rounds and calls."""
    return Config(dyn_seqs=(128,), dense_seq=256,
                  mixes=(("1x256 + 8x16", ((256, 256),) + ((16, 16),) * 8),
                         ("6 log-uniform 16..256 (seed 0)", log_uniform_mix(6, 16, 256, seed=0))),
                  rounds=2, repeat=1, min_repeat_ms=5, calls=50, call_repeats=3)


def alternate(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Call every fn once per round, reversing the order on odd rounds; samples per name."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            samples[k].append(fns[k]())
    return samples


def _timer(built, spec: AttentionSpec, cfg: Config, case: dict | None = None) -> Callable[[], float]:
    """One round's median seconds per call of ``built`` at ``case`` (time_module warms up first)."""
    return lambda: time_built(built, spec, repeat=cfg.repeat,
                              min_repeat_ms=cfg.min_repeat_ms, case=case).median_s


def bench_dynamic(cfg: Config, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    rows = []
    for causal in cfg.causals:
        for s in cfg.dyn_seqs:
            spec = AttentionSpec(batch=1, heads=cfg.heads, seq_q=s, head_dim=cfg.head_dim, causal=causal)
            static = build_kernel(spec, "fused", cache=True)
            dyn = build_kernel(dataclasses.replace(spec, dynamic=DYNAMIC_DIMS), "fused", cache=True)
            # both timed on the static spec's inputs: the same arrays, only the signature differs
            samples = alternate({"static": _timer(static, spec, cfg), "dynamic": _timer(dyn, spec, cfg)},
                                cfg.rounds)
            st, dy = min(samples["static"]), min(samples["dynamic"])
            row = {"seq": s, "causal": causal, "static_ms": st * 1e3, "dynamic_ms": dy * 1e3,
                   "ratio": st / dy, "static_gflops": spec.flops() / st / 1e9,
                   "dynamic_gflops": spec.flops() / dy / 1e9,
                   "static_rounds_ms": [x * 1e3 for x in samples["static"]],
                   "dynamic_rounds_ms": [x * 1e3 for x in samples["dynamic"]]}
            rows.append(row)
            say(f"[dynamic S={s} causal={causal}] static {row['static_ms']:.3f} ms, dynamic "
                f"{row['dynamic_ms']:.3f} ms, static/dynamic {row['ratio']:.3f}")
    return rows


def bench_varlen(cfg: Config, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    rows = []
    s = cfg.dense_seq
    for causal in cfg.causals:
        dense_spec = AttentionSpec(batch=1, heads=cfg.heads, seq_q=s, head_dim=cfg.head_dim, causal=causal)
        # KH = H (no GQA) as in the dense kernel; the representative batch only matters to validation
        var_spec = AttentionSpec(batch=1, heads=cfg.heads, kv_heads=cfg.heads, seq_q=s, head_dim=cfg.head_dim,
                                 causal=causal, layout="varlen")
        dense = build_kernel(dense_spec, "fused", cache=True)
        varlen = build_kernel(var_spec, "fused", cache=True)
        dense_case = {"batch": 1, "seq_q": s, "seq_kv": s}
        cases = {name: {"seqlens": [list(p) for p in lens]} for name, lens in cfg.mixes}
        fns = {"dense": _timer(dense, dense_spec, cfg, dense_case)}
        fns.update({name: _timer(varlen, var_spec, cfg, case) for name, case in cases.items()})
        samples = alternate(fns, cfg.rounds)
        dense_t = min(samples["dense"])
        dense_gf = LAYOUTS["bhsd"].useful_flops(dense_spec, dense_case) / dense_t / 1e9
        for name, case in cases.items():
            t = min(samples[name])
            gf = LAYOUTS["varlen"].useful_flops(var_spec, case) / t / 1e9
            lens = case["seqlens"]
            row = {"mix": name, "causal": causal, "sequences": len(lens),
                   "tokens": int(sum(q for q, _ in lens)), "seqlens": lens,
                   "varlen_ms": t * 1e3, "dense_ms": dense_t * 1e3, "dense_seq": s,
                   "varlen_gflops": gf, "dense_gflops": dense_gf, "ratio": gf / dense_gf,
                   "varlen_rounds_ms": [x * 1e3 for x in samples[name]],
                   "dense_rounds_ms": [x * 1e3 for x in samples["dense"]]}
            rows.append(row)
            say(f"[varlen {name} causal={causal}] {gf:.1f} vs dense {dense_gf:.1f} useful GFLOP/s, "
                f"ratio {row['ratio']:.3f}")
    return rows


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _export_and_load(built, directory: Path, threads: int):
    export(built, directory, validate_built(built))
    return load(directory, num_threads=threads)


def _misaligned_copy(x: np.ndarray) -> np.ndarray:
    """``x`` copied to memory that is not even 16-byte aligned (a view at an odd element
    offset): the loader then copies it to aligned memory each call."""
    raw = np.empty(x.nbytes + 64, dtype=np.uint8)
    off = next(o for o in range(x.itemsize, 64, x.itemsize) if (raw.ctypes.data + o) % 16)
    a = raw[off: off + x.nbytes].view(x.dtype).reshape(x.shape)
    a[...] = x
    return a


def _call_variants(kernel, inputs: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    """bare: the packed function on preallocated TVM tensors; the loader's ``kernel(q, k, v,
    *index)`` with 64-byte-aligned NumPy arrays (``numpy``), misaligned ones (``numpy-unaligned``:
    the loader adds a copy per input) and torch tensors when torch is installed (``torch``,
    sharing the aligned arrays' memory)."""
    import tvm


    aligned = []
    for x in inputs.values():
        a = aligned_empty(x.shape, x.dtype)
        a[...] = x
        aligned.append(a)
    out = aligned_empty(aligned[0].shape, aligned[0].dtype)  # o has q's shape in every layout
    tensors = [tvm.runtime.tensor(a) for a in aligned] + [tvm.runtime.tensor(out)]
    fn = kernel.function
    unaligned = [_misaligned_copy(a) for a in aligned]
    variants: dict[str, Callable[[], Any]] = {
        "bare": lambda: fn(*tensors),
        "numpy": lambda: kernel(*aligned),
        "numpy-unaligned": lambda: kernel(*unaligned),
    }
    try:
        import torch
    except ImportError:
        return variants
    targs = [torch.from_numpy(a) for a in aligned]
    variants["torch"] = lambda: kernel(*targs)
    return variants


def bench_loader(cfg: Config, threads: int, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    sq, skv = cfg.decode
    decode = AttentionSpec(batch=1, heads=cfg.heads, seq_q=sq, seq_kv=skv, head_dim=cfg.head_dim)
    small = [list(p) for p in cfg.varlen_small]
    var_spec = AttentionSpec(batch=len(small), heads=cfg.heads, kv_heads=cfg.heads, seq_q=sq, seq_kv=skv,
                             head_dim=cfg.head_dim, layout="varlen")
    artifacts = [
        (f"static B=1 Sq={sq} Skv={skv}", decode, {"batch": 1, "seq_q": sq, "seq_kv": skv}),
        (f"dynamic B=1 Sq={sq} Skv={skv}", dataclasses.replace(decode, dynamic=DYNAMIC_DIMS),
         {"batch": 1, "seq_q": sq, "seq_kv": skv}),
        (f"varlen {len(small)}×({sq}, {skv})" if all(p == [sq, skv] for p in small)
         else f"varlen {len(small)} seqs", var_spec, {"seqlens": small}),
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tvma-serving-") as tmp:
        fns: dict[tuple[str, str], Callable[[], Any]] = {}
        for i, (label, spec, case) in enumerate(artifacts):
            kernel = _export_and_load(build_kernel(spec, "fused", cache=True), Path(tmp) / f"a{i}", threads)
            inputs = spec.layout_info.random_inputs(spec, case, seed=0)
            for inp, fn in _call_variants(kernel, inputs).items():
                fns[(label, inp)] = fn
        for fn in fns.values():  # warm-up: thread pool, torch's DLPack path, caches
            for _ in range(max(10, cfg.calls // 20)):
                fn()
        # every artifact and input kind in one alternation: a slow spell (another process on a
        # core) spreads over all of them instead of landing on whichever was measured then
        samples = alternate({key: (lambda f=f: per_call_us(f, cfg.calls)) for key, f in fns.items()},
                            cfg.call_repeats)
        for label, _, _ in artifacts:
            bare_samples = samples[(label, "bare")]
            bare = statistics.median(bare_samples)
            for (lab, inp), loader_samples in samples.items():
                if lab != label or inp == "bare":
                    continue
                loader = statistics.median(loader_samples)
                rows.append({"artifact": label, "inputs": inp, "bare_us": bare, "loader_us": loader,
                             "overhead_us": loader - bare, "calls": cfg.calls, "repeats": cfg.call_repeats,
                             "bare_samples_us": bare_samples, "loader_samples_us": loader_samples})
                say(f"[loader {label} {inp}] bare {bare:.1f} us, loader {loader:.1f} us, "
                    f"overhead {loader - bare:.1f} us")
    return rows


def run(cfg: Config, threads: int | None = None, quick: bool = False,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    threads = set_num_threads(threads)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": host_cpu(),
            "threads": threads, "quick": quick, "config": dataclasses.asdict(cfg),
            "goals": {"dynamic_ratio": GOAL_DYNAMIC, "varlen_ratio": GOAL_VARLEN}}
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:
        meta["torch"] = None
    say(f"# {meta['date']} cpu={meta['cpu']} threads={threads}{' (quick)' if quick else ''}")
    return {"meta": meta, "dynamic": bench_dynamic(cfg, say), "varlen": bench_varlen(cfg, say),
            "loader": bench_loader(cfg, threads, say)}


def _goal(ratio: float, goal: float) -> str:
    return "yes" if ratio >= goal else "no"


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    c = m["config"]
    lines = [f"Machine: {m['cpu']}, {m['threads']} threads, {m['date']}"
             f"{' (quick smoke run)' if m['quick'] else ''}. fp32, H={c['heads']}, D={c['head_dim']}. "
             f"Variants alternated over {c['rounds']} rounds; each time is the best round's median.", "",
             f"**a. dynamic vs static** (B=1, batch/seq_q/seq_kv symbolic, timed at the built shape)", "",
             "| S | causal | static ms | dynamic ms | static/dynamic | goal >= 0.95 |", "|---|---|---|---|---|---|"]
    for r in report["dynamic"]:
        lines.append(f"| {r['seq']} | {'yes' if r['causal'] else 'no'} | {r['static_ms']:.3f} | "
                     f"{r['dynamic_ms']:.3f} | {r['ratio']:.3f} | {_goal(r['ratio'], GOAL_DYNAMIC)} |")
    lines += ["", f"**b. varlen mixed batch vs dense** (KH=H; dense B=1 S={c['dense_seq']}; useful GFLOP/s = "
              "4·D·H·visible pairs / time)", "",
              "| batch | causal | seqs | tokens | varlen ms | varlen GFLOP/s | dense ms | dense GFLOP/s | "
              "varlen/dense | goal >= 0.75 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["varlen"]:
        lines.append(f"| {r['mix']} | {'yes' if r['causal'] else 'no'} | {r['sequences']} | {r['tokens']} | "
                     f"{r['varlen_ms']:.3f} | {r['varlen_gflops']:.1f} | {r['dense_ms']:.3f} | "
                     f"{r['dense_gflops']:.1f} | {r['ratio']:.3f} | {_goal(r['ratio'], GOAL_VARLEN)} |")
    lines += ["", f"**c. loader overhead per call** (median of {c['call_repeats']} × {c['calls']} calls, all rows "
              "alternated; bare = packed function on preallocated TVM tensors; numpy = 64-byte-aligned arrays, "
              "numpy-unaligned = the loader copies each input, torch = `torch.from_numpy` of the aligned arrays)", "",
              "| artifact | inputs | bare µs | loader µs | overhead µs |", "|---|---|---|---|---|"]
    for r in report["loader"]:
        lines.append(f"| {r['artifact']} | {r['inputs']} | {r['bare_us']:.1f} | {r['loader_us']:.1f} | "
                     f"{r['overhead_us']:.1f} |")
    return "\n".join(lines)


def write(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    return write_report(report, out_dir, "serving", markdown)
