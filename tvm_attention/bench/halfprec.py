"""Half-precision prefill benchmark: bf16 on AVX512-BF16 dot products against our fp32 kernel and
torch SDPA in both dtypes, side by side in one run.

Variants per point (batch 1, ``heads`` heads, ``seq`` × ``seq``, each head_dim): ``fp32`` (our
kernel, float32 inputs), ``bf16-dot`` (bfloat16 inputs, QKᵀ and PV on ``vdpbf16ps``: the preset
where the CPU has it), ``bf16-fp32`` (bfloat16 inputs converted on load, float32 products),
``fp16`` (float16 inputs, float32 products), ``torch-fp32`` and ``torch-bf16`` (SDPA). Every
variant is timed alternately over ``rounds`` rounds (best kept). The roofs are measured in the
same run: the fp32 FMA peak and the bf16 dot-product peak (``bench.cpu.bf16_dot_peak``). The
bf16 ratios compare the form the preset builds: ``bf16-dot``, else (no AVX512-BF16) ``bf16-fp32``.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from ..artifact import kernel_of
from ..build import build_kernel
from ..reference import reference_attention
from ..schedules.cpu_balance import dots_outrun_fmas
from ..spec import AttentionSpec
from ..target import resolve_target
from ..threads import set_num_threads
from ..timing import aligned_inputs, time_built, time_callable
from . import Interrupted, Progress, mark_interrupted, partial_line, write_report
from .cpu import compute_roofs_meta
from .peers import torch_sdpa_fn

#: Speed goals of issue 11 (checked in the report, never by a test).
GOALS = {"bf16_vs_fp32": 1.6, "bf16_vs_torch_bf16": 3.0}

OURS = {"fp32": ("float32", None), "bf16-amx": ("bfloat16", {"dot_bf16": 2}),
        "bf16-dot": ("bfloat16", {"dot_bf16": 1}),
        "bf16-fp32": ("bfloat16", {"dot_bf16": 0}), "fp16": ("float16", None)}
PEERS = {"torch-fp32": "float32", "torch-bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class Config:
    seq: int = 4096
    heads: int = 8
    head_dims: tuple[int, ...] = (64, 128)
    causal: bool = False
    rounds: int = 3
    min_repeat_ms: int = 100


def quick_config() -> Config:
    return Config(seq=256, heads=2, head_dims=(64,), rounds=1, min_repeat_ms=5)


def run(cfg: Config, threads: int | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    threads = set_num_threads(threads)
    meta = compute_roofs_meta(cfg, threads, GOALS, say)
    # the form the bf16 preset builds here: the dot products where they outrun the FMAs (cpu_balance)
    meta["bf16_preset_form"] = ("bf16-amx" if meta["amx_tile_peak_gflops"] else
                                "bf16-dot" if dots_outrun_fmas(resolve_target("llvm")) else "bf16-fp32")
    rows: list[dict[str, Any]] = []
    progress = Progress(len(cfg.head_dims))
    try:
        for d in cfg.head_dims:
            rows.append(_point(cfg, d, threads, meta["avx512bf16"], meta["fma_peak_gflops"], meta))
            progress.advance()
            say(f"{progress.tag()} [D={d}] " + ", ".join(
                f"{n} {rows[-1][f'{n}_gflops']:.1f}" for n in [*OURS, *PEERS] if f"{n}_gflops" in rows[-1])
                + " GFLOP/s")
    except KeyboardInterrupt:  # the points measured so far
        mark_interrupted(meta, progress.done, progress.total)
        raise Interrupted({"meta": meta, "rows": rows}, progress.done, progress.total) from None
    return {"meta": meta, "rows": rows}


def _point(cfg: Config, d: int, threads: int, has_dots: bool, fma: float, meta: dict[str, Any]) -> dict[str, Any]:
    """One head_dim: every variant built (ours) and timed alternately; its row."""
    import numpy as np

    timers, errors = {}, {}
    for name, (dtype, knobs) in OURS.items():
        if name == "bf16-dot" and not has_dots:
            errors[name] = "skipped: no AVX512-BF16 on this CPU"
            continue
        if name == "bf16-amx" and not meta["amx_tile_peak_gflops"]:
            errors[name] = "skipped: no AMX-BF16 on this CPU"
            continue
        spec = AttentionSpec(batch=1, heads=cfg.heads, seq_q=cfg.seq, head_dim=d, causal=cfg.causal, dtype=dtype)
        built = build_kernel(spec, knobs=knobs, cache=True)
        timers[name] = (spec, lambda b=built, s=spec: time_built(b, s, repeat=3,
                                                                  min_repeat_ms=cfg.min_repeat_ms).median_s)
        q, k, v, _ = aligned_inputs(spec)
        rows_ = np.arange(0, cfg.seq, max(1, cfg.seq // 16))

        out = np.asarray(kernel_of(built)(q, k, v)).astype(np.float64)[:, :, rows_]
        ref = reference_attention(spec, *(x.astype(np.float64) for x in (q, k, v)), rows=rows_)
        errors[name] = float(np.abs(out - ref).max())
    for name, dtype in PEERS.items():
        spec = AttentionSpec(batch=1, heads=cfg.heads, seq_q=cfg.seq, head_dim=d, causal=cfg.causal, dtype=dtype)
        fn = torch_sdpa_fn(spec, threads)
        if fn is None:
            errors[name] = "skipped: torch not installed"
            continue
        q, k, v, _ = aligned_inputs(spec)
        timers[name] = (spec, lambda f=fn, a=(q, k, v): time_callable(lambda: f(*a), repeat=3,
                                                                       min_repeat_ms=cfg.min_repeat_ms).median_s)
    best = {n: float("inf") for n in timers}
    for r in range(cfg.rounds):
        for n in (list(timers) if r % 2 == 0 else list(reversed(timers))):
            best[n] = min(best[n], timers[n][1]())
    row: dict[str, Any] = {"head_dim": d, "seq": cfg.seq, "heads": cfg.heads, "causal": cfg.causal}
    for n, t in best.items():
        row[f"{n}_ms"] = t * 1e3
        row[f"{n}_gflops"] = timers[n][0].flops() / t / 1e9
    for n, e in errors.items():
        row[f"{n}_err"] = e
    ratio = lambda a, b: row[f"{b}_ms"] / row[f"{a}_ms"] if f"{a}_ms" in row and f"{b}_ms" in row else None  # noqa: E731
    # our bf16: the preset's form — dot products where they outrun this CPU's FMAs, else fp32 products
    ours = meta["bf16_preset_form"]
    row["bf16_form"] = ours
    row["bf16_vs_fp32"] = ratio(ours, "fp32")
    row["bf16_vs_torch_bf16"] = ratio(ours, "torch-bf16")
    row["bf16_vs_torch_fp32"] = ratio(ours, "torch-fp32")
    if meta["bf16_dot_peak_gflops"] and "bf16-dot_gflops" in row:
        row["bf16_of_dot_peak"] = row["bf16-dot_gflops"] / meta["bf16_dot_peak_gflops"]
    if meta["amx_tile_peak_gflops"] and "bf16-amx_gflops" in row:
        row["bf16_of_tile_peak"] = row["bf16-amx_gflops"] / meta["amx_tile_peak_gflops"]
    if "fp32_gflops" in row:
        row["fp32_of_fma_peak"] = row["fp32_gflops"] / fma
    return row


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    c = m["config"]
    names = list(OURS) + list(PEERS)
    lines = [f"Machine: {m['cpu']}, {m['threads']} threads, {m['date']}. B=1, H={c['heads']}, S={c['seq']}, "
             f"{'causal' if c['causal'] else 'full'}. Roofs measured in this run: fp32 FMA peak "
             f"{m['fma_peak_gflops']:.0f} GFLOP/s, bf16 dot-product peak "
             f"{(m['bf16_dot_peak_gflops'] or 0):.0f} GFLOP/s, AMX tile peak {(m.get('amx_tile_peak_gflops') or 0):.0f} "
             "GFLOP/s. GFLOP/s per variant (best of alternated rounds).", "",
             "bf16/…: our bf16 in the preset's form (bf16-amx where the CPU has AMX-BF16, else bf16-dot where "
             "it has AVX512-BF16 and those outrun its FMAs, else bf16-fp32). On an AVX2 override (`TVM_ATTENTION_HOST_CPU`) torch keeps its own ISA unless "
             "`ATEN_CPU_CAPABILITY=avx2` is set too.", "",
             "| D | " + " | ".join(names) + " | bf16/fp32 | bf16/torch-bf16 | bf16 of dot peak |",
             "|---|" + "---|" * (len(names) + 3)]
    lines[:0] = partial_line(m, "points")  # a partial run says so first
    for r in report["rows"]:
        cells = [f"{r[f'{n}_gflops']:.1f}" if f"{n}_gflops" in r else "—" for n in names]
        fmt = lambda x, f: format(x, f) if x is not None else "—"  # noqa: E731
        lines.append(f"| {r['head_dim']} | " + " | ".join(cells) + f" | {fmt(r.get('bf16_vs_fp32'), '.2f')}× | "
                     f"{fmt(r.get('bf16_vs_torch_bf16'), '.2f')}× | {fmt(r.get('bf16_of_dot_peak'), '.0%')} |")
    return "\n".join(lines)


def write(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    return write_report(report, out_dir, "halfprec", markdown)
