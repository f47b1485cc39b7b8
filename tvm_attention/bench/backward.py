"""Backward benchmark (issue 46): our fused forward (with lse) plus the fused backward
(``tvm_attention.backward``) against torch SDPA's forward and backward (its CPU flash kernel),
side by side in one run: B1, ``heads`` heads, fp32 and bf16, each head size × length × causal or
not. The other peer the issue names, FlexAttention, has no CPU backward (eager: it raises
``NotImplementedError``): the report records what it says, tried once per run.

Goals (issue 46, read in the report, never asserted by a test): forward + backward ≥ 1.2× torch's
speed, and ≥ 60 % of this CPU's FMA peak counting the backward as 2.5× the forward's FLOP. Each
point also records the largest difference between our dQ and torch's. Both sides are timed
alternately over ``rounds`` rounds (best kept).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..spec import AttentionSpec
from ..threads import set_num_threads
from ..timing import time_callable
from . import Interrupted, Progress, best_of_alternated, mark_interrupted, partial_line, write_report

#: the issue's goals: forward + backward against torch's, and the share of the FMA peak
GOALS = {"vs_torch": 1.2, "roof_share": 0.60}
#: the backward's FLOP as a multiple of the forward's (FlashAttention's count: 5 matmuls to 2)
BACKWARD_FLOP = 2.5


@dataclasses.dataclass(frozen=True)
class Config:
    heads: int = 8
    head_dims: tuple[int, ...] = (64, 128)
    seqs: tuple[int, ...] = (1024, 2048, 4096, 8192)
    causal: tuple[bool, ...] = (False, True)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    rounds: int = 2
    min_repeat_ms: int = 100


def quick_config() -> Config:
    return Config(heads=2, head_dims=(32,), seqs=(128,), dtypes=("float32",), rounds=1, min_repeat_ms=5)


def run(cfg: Config, threads: int | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    import datetime

    from ..target import host_cpu  # the compiler's view of this CPU, as every report names it
    from .cpu import fma_peak  # this CPU's FMA roof, measured in this run

    threads = set_num_threads(threads)
    meta: dict[str, Any] = {"cpu": host_cpu(), "threads": threads, "date": datetime.datetime.now().isoformat(
        timespec="seconds"), "config": dataclasses.asdict(cfg), "goals": GOALS}
    meta["fma_gflops"] = fma_peak(threads).gflops
    meta["flex_attention"] = flex_attention_backward()
    rows: list[dict[str, Any]] = []
    points = [(t, d, s, c) for t in cfg.dtypes for d in cfg.head_dims for s in cfg.seqs for c in cfg.causal]
    progress = Progress(len(points))
    try:
        for t, d, s, c in points:
            rows.append(_point(cfg, d, s, c, meta["fma_gflops"], t))
            progress.advance()
            r = rows[-1]
            say(f"{progress.tag()} {t} D={d} S={s} causal={c}: ours {r['ours_ms']:.1f} ms, torch {r['torch_ms']:.1f} "
                f"ms, {r['vs_torch']:.2f}×, {r['roof_share']:.0%} of the FMA peak")
        memory = memory_rows(cfg, threads)
    except KeyboardInterrupt:
        mark_interrupted(meta, progress.done, progress.total)
        raise Interrupted({"meta": meta, "rows": rows}, progress.done, progress.total) from None
    return {"meta": meta, "rows": rows, "memory": memory}


def memory_rows(cfg: Config, threads: int) -> list[dict[str, Any]]:
    """The backward's peak extra memory (one call, a fresh process: ``bench.memory``) at each of
    ``cfg.seqs``, D = the first head size, fp32, not causal, beside the bytes of its outputs
    (dQ, dK, dV, first touched by the call) and of one head's S×S float32 scores: a fused
    backward grows with S as its outputs do."""
    from ..backward import build_backward  # the compiler's side (imports TVM)
    from .memory import library_first_call_peak  # the forward benchmark's measurement

    out = []
    d = cfg.head_dims[0]
    for s in cfg.seqs:
        kern = build_backward(AttentionSpec(batch=1, heads=cfg.heads, seq_q=s, seq_kv=s, head_dim=d))
        shapes = [list(shape) for _, shape, _ in kern.args]
        peak = library_first_call_peak(kern.library or kern.module, "attention_backward", shapes, "float32", threads)
        out.append({"seq": s, "head_dim": d, "peak_extra_bytes": peak, "outputs_bytes": 3 * cfg.heads * s * d * 4,
                    "scores_bytes": s * s * 4})
    return out


def flex_attention_backward() -> str:
    """What eager FlexAttention's backward does on this CPU, tried once on a tiny input: "runs",
    or the error it raises (torch 2.x: ``NotImplementedError``)."""
    import torch  # the peer (an optional extra: this benchmark needs it)

    try:
        from torch.nn.attention.flex_attention import flex_attention
        q = torch.randn(1, 1, 16, 16, requires_grad=True)
        flex_attention(q, q, q).sum().backward()
    except Exception as e:  # noqa: BLE001 - whatever it raises is the finding
        return f"not available: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return "runs"


def _point(cfg: Config, d: int, s: int, causal: bool, fma_gflops: float, dtype: str = "float32") -> dict[str, Any]:
    import torch  # the peer (an optional extra: this benchmark needs it)

    from ..artifact import kernel_of  # the built kernel as serving calls it
    from ..backward import build_backward  # the compiler's side (imports TVM)
    from ..build import build_kernel  # the compiler's side (imports TVM)

    spec = AttentionSpec(batch=1, heads=cfg.heads, seq_q=s, seq_kv=s, head_dim=d, causal=causal, return_lse=True,
                         dtype=dtype)
    fwd, bwd = kernel_of(build_kernel(spec, cache=True)), build_backward(spec)
    rng = np.random.default_rng(0)
    tq, tk, tv, tdo = (torch.from_numpy(rng.standard_normal((1, cfg.heads, s, d), dtype=np.float32)).to(
        getattr(torch, dtype)) for _ in range(4))
    q, k, v, do = (spec_array(t) for t in (tq, tk, tv, tdo))
    tq, tk, tv = (t.clone().requires_grad_() for t in (tq, tk, tv))

    def ours():
        o, lse = fwd(q, k, v)
        return bwd(q, k, v, o, lse, do)

    def theirs():
        tq.grad = tk.grad = tv.grad = None
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).backward(tdo)

    dq = ours()[0].astype(np.float32)
    theirs()
    t = best_of_alternated({n: (lambda fn=fn: time_callable(fn, repeat=3, min_repeat_ms=cfg.min_repeat_ms).median_s)
                            for n, fn in (("ours", ours), ("torch", theirs))}, cfg.rounds)
    flop = spec.flops() * (1 + BACKWARD_FLOP)
    return {"dtype": dtype, "head_dim": d, "seq": s, "causal": causal, "ours_ms": t["ours"] * 1e3,
            "torch_ms": t["torch"] * 1e3,
            "vs_torch": t["torch"] / t["ours"], "gflops": flop / t["ours"] / 1e9,
            "roof_share": flop / t["ours"] / 1e9 / fma_gflops,
            "max_abs_diff_dq": float(np.abs(dq - tq.grad.float().numpy()).max())}


def spec_array(t) -> np.ndarray:
    """A torch tensor as the NumPy array the kernels take, a copy (bf16: ml_dtypes', through its bits)."""
    from ..torch import to_numpy  # the torch function's conversion

    return to_numpy(t).copy()


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = partial_line(m, "points") + [
        f"Machine: {m['cpu']}, {m['threads']} threads, {m['date']}; FMA peak {m['fma_gflops']:.0f} GFLOP/s. B1, "
        f"H{m['config']['heads']}; forward + backward, the backward counted as {BACKWARD_FLOP:g}× the forward's "
        f"FLOP (goals: ≥ {GOALS['vs_torch']:g}× torch SDPA's forward + backward, ≥ {GOALS['roof_share']:.0%} of the "
        "peak). Eager FlexAttention's backward on this CPU: " + m.get("flex_attention", "not tried") + ".", "",
        "| dtype | D | S | causal | ours ms | torch ms | × torch | GFLOP/s | of peak | max \\|dQ − torch's\\| |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r.get('dtype', 'float32')} | {r['head_dim']} | {r['seq']} | {'yes' if r['causal'] else 'no'} | "
                     f"{r['ours_ms']:.1f} | "
                     f"{r['torch_ms']:.1f} | {r['vs_torch']:.2f} | {r['gflops']:.0f} | {r['roof_share']:.0%} | "
                     f"{r['max_abs_diff_dq']:.1e} |")
    mem = report.get("memory") or []
    if mem:
        lines += ["", "Peak extra memory of one backward call (fp32, not causal, a fresh process), beside its "
                  "outputs' bytes and one head's S×S float32 scores:", "",
                  "| D | S | peak extra MiB | dQ+dK+dV MiB | one head's S×S MiB |", "|---|---|---|---|---|"]
        lines += [f"| {r['head_dim']} | {r['seq']} | "
                  f"{'n/a' if r['peak_extra_bytes'] is None else format(r['peak_extra_bytes'] / 2**20, '.1f')} | "
                  f"{r['outputs_bytes'] / 2**20:.1f} | {r['scores_bytes'] / 2**20:.1f} |" for r in mem]
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    return write_report(report, out_dir, "backward", markdown)
