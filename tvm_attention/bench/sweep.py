"""``tvm-attention bench``: every variant of every point, side by side in one process.

A point is a spec; a variant is one implementation of it:

* ``fused`` (hand schedule), ``fused-tuned`` (best validated record of the tuning log, when there
  is one), ``fused-dyn`` (the hand schedule built with batch, seq_q and seq_kv symbolic, timed at
  the point's shape: what one artifact for every shape costs), ``materialized`` (TVM, hand
  schedule), ``rowcache`` (two-pass row-cached family);
* ``numpy`` (float32 matmuls) and ``torch`` (PyTorch SDPA, CPU) as peers — recorded as missing
  when torch is not installed.

Per (point, variant): median ± std time (TVM's ``time_evaluator`` for TVM builds, the same
protocol in Python for peers), GFLOP/s (4·B·H·Sq·Skv·D, halved for causal), modeled DRAM bytes
(fused: q, k, v, o once; materialized and NumPy: plus six float32 passes over the score
matrices), operational intensity, the fractions of the machine's roofs it attains (GFLOP/s of the
FMA peak, modeled bytes per second of the streaming-read bandwidth; see ``cpu.measure_ceilings``),
measured peak extra memory (the first call's peak RSS above the inputs, every variant in a fresh
process: allocators in this one hold memory freed by earlier points — ``memory.py``), and max abs
error against the float64 reference on sampled rows. A variant that fails or runs out of memory is
recorded with its error and the sweep goes on.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from ..build import build_kernel
from ..logs import TUNE_HINT_SHORT, best_records, default_work_dir
from ..pipeline import build_best
from ..reference import reference_attention
from ..spec import DYNAMIC_DIMS, AttentionSpec
from ..target import resolve_target
from ..timing import Timing, aligned_inputs, time_built, time_callable
from . import Interrupted, Progress, partial_line
from .peers import numpy_attention_fn, torch_sdpa_fn
from .memory import peer_first_call_peak, tvm_first_call_peak

TVM_VARIANTS = ("fused", "materialized", "rowcache")
ALL_VARIANTS = ("fused", "fused-tuned", "fused-dyn", "materialized", "rowcache", "numpy", "torch")
#: Variants whose score matrices go through memory (byte model).
MATERIALIZING = ("materialized", "numpy")
ERROR_ROWS = 32


@dataclasses.dataclass
class Result:
    spec: AttentionSpec
    mode: str  # "seq" (sweep over S at fixed batch) or "tokens" (batch = tokens / S)
    variant: str
    timing: Timing | None = None
    peak_extra_bytes: int | None = None
    max_abs_err: float | None = None
    error: str | None = None
    detail: str = ""  # knobs or source of the build

    @property
    def gflops(self) -> float | None:
        return self.timing.gflops(self.spec) if self.timing else None

    @property
    def modeled_bytes(self) -> int:
        return self.spec.materialized_bytes() if self.variant in MATERIALIZING else self.spec.io_bytes()

    @property
    def intensity(self) -> float:
        return self.spec.flops() / self.modeled_bytes

    @property
    def modeled_gbps(self) -> float | None:
        """Modeled DRAM bytes per second of the median call, in GB/s."""
        return self.modeled_bytes / self.timing.median_s / 1e9 if self.timing else None

    def roof_fractions(self, meta: dict[str, Any]) -> tuple[float | None, float | None]:
        """(GFLOP/s ÷ compute peak, modeled GB/s ÷ read bandwidth), with the roofs of ``meta``: the
        compute peak is the FMA peak, for bfloat16 points the bf16 dot-product peak where measured."""
        peak, bw = meta.get("fma_peak_gflops"), meta.get("read_gbps")
        if self.spec.dtype == "bfloat16" and meta.get("bf16_dot_peak_gflops"):
            peak = meta["bf16_dot_peak_gflops"]
        if not self.timing:
            return None, None
        return (self.gflops / peak if peak else None, self.modeled_gbps / bw if bw else None)

    def to_row(self, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        s = self.spec
        fma_frac, bw_frac = self.roof_fractions(meta or {})
        return {
            "mode": self.mode, "variant": self.variant, "batch": s.batch, "heads": s.heads,
            "seq_q": s.seq_q, "seq_kv": s.seq_kv, "head_dim": s.head_dim, "dtype": s.dtype,
            "causal": s.causal,
            "median_ms": self.timing.median_s * 1e3 if self.timing else None,
            "std_ms": self.timing.std_s * 1e3 if self.timing else None,
            "gflops": self.gflops, "flops": s.flops(), "modeled_bytes": self.modeled_bytes,
            "intensity_flop_per_byte": self.intensity, "modeled_gbps": self.modeled_gbps,
            "fma_peak_frac": fma_frac, "read_bw_frac": bw_frac, "peak_extra_bytes": self.peak_extra_bytes,
            "max_abs_err": self.max_abs_err, "error": self.error, "detail": self.detail,
        }


class Skip(Exception):
    """A variant that does not apply to this point (recorded, not a failure)."""


def _error_rows(spec: AttentionSpec) -> np.ndarray:
    rows = np.linspace(0, spec.seq_q - 1, num=min(ERROR_ROWS, spec.seq_q)).astype(int)
    return np.unique(rows)


def _tvm_runner(spec: AttentionSpec, variant: str) -> tuple[Any, str]:
    if variant == "fused-tuned":
        work = default_work_dir(spec, resolve_target("llvm"))
        if not best_records(spec, resolve_target("llvm"), "fused", work, k=1):
            raise Skip(f"no tuning log for this spec ({TUNE_HINT_SHORT})")
        built, validation = build_best(spec, schedule="fused", log_dir=work)  # the log's record itself
        if not validation.passed:
            raise RuntimeError("tuned build failed validation")
    elif variant == "fused-dyn":
        # The point's shape stays the representative (knob choice, tuning-log lookup); only the
        # compiled signature changes. Timed on the point's static inputs like every variant.
        built = build_kernel(dataclasses.replace(spec, dynamic=DYNAMIC_DIMS), schedule="fused", cache=True)
    else:
        built = build_kernel(spec, schedule=variant, cache=True)
    detail = f"{built.source} {json.dumps(built.knobs.to_dict()) if built.knobs else ''}".strip()
    return built, detail


def _peer(spec: AttentionSpec, variant: str, threads: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray], Any]:
    if variant == "numpy":
        return numpy_attention_fn(spec)
    fn = torch_sdpa_fn(spec, threads)
    if fn is None:
        raise Skip("torch not installed")
    return fn


def run_variant(spec: AttentionSpec, mode: str, variant: str, threads: int, repeat: int,
                min_repeat_ms: int) -> Result:
    res = Result(spec, mode, variant)
    try:
        q, k, v, o = aligned_inputs(spec, seed=0)
        rows = _error_rows(spec)
        if variant in TVM_VARIANTS or variant in ("fused-tuned", "fused-dyn"):
            import tvm

            built, res.detail = _tvm_runner(spec, variant)
            args = [tvm.runtime.tensor(x) for x in (q, k, v, o)]
            built.function(*args)
            out = args[3].numpy()
            res.peak_extra_bytes = tvm_first_call_peak(built.library or built.module, built.entry, spec, threads)
            res.timing = time_built(built, spec, repeat=repeat, min_repeat_ms=min_repeat_ms)
        else:
            fn = _peer(spec, variant, threads)
            res.peak_extra_bytes = peer_first_call_peak(spec, variant, threads)
            out = np.asarray(fn(q, k, v))
            res.timing = time_callable(lambda: fn(q, k, v), repeat=repeat, min_repeat_ms=min_repeat_ms)
        ref = reference_attention(spec, q, k, v, rows=rows)
        res.max_abs_err = float(np.abs(out[:, :, rows, :].astype(np.float64) - ref).max())
    except Skip as e:
        res.error = f"skipped: {e}"
    except MemoryError as e:
        res.error = f"out of memory: {e}"
    except Exception as e:  # recorded; the sweep goes on
        res.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return res


def points(seqs: Iterable[int], head_dims: Iterable[int], causals: Iterable[bool], heads: int,
           batch: int, tokens: int | None, dtypes: Iterable[str] = ("float32",)) -> list[tuple[str, AttentionSpec]]:
    out = []
    for dt in dtypes:
        for d in head_dims:
            for c in causals:
                for s in seqs:
                    out.append(("seq", AttentionSpec(batch=batch, heads=heads, seq_q=s, head_dim=d, causal=c, dtype=dt)))
                if tokens:
                    for s in seqs:
                        if tokens % s == 0:
                            out.append(("tokens", AttentionSpec(batch=tokens // s, heads=heads, seq_q=s,
                                                                head_dim=d, causal=c, dtype=dt)))
    return out


def run_sweep(pts: list[tuple[str, AttentionSpec]], variants: Iterable[str], threads: int, repeat: int = 3,
              min_repeat_ms: int = 100, say: Callable[[str], None] = print,
              skip_materializing_above: int | None = None, progress: Progress | None = None) -> list[Result]:
    """Every variant of every point, one progress line per point: ``[i/N, elapsed, ETA]`` (units:
    (point, variant) measurements; ``progress`` shares one count among several sweeps, by default
    this one's), the point, each variant's GFLOP/s or error. Ctrl-C raises :class:`Interrupted`
    whose ``partial`` holds the results measured so far (the interrupted point's finished
    variants too)."""
    variants = list(variants)
    progress = progress if progress is not None else Progress(len(pts) * len(variants))
    results: list[Result] = []
    try:
        for mode, spec in pts:
            line = []
            for variant in variants:
                if (skip_materializing_above and variant in MATERIALIZING
                        and spec.seq_q * spec.seq_kv > skip_materializing_above ** 2):
                    r = Result(spec, mode, variant, error=f"skipped: S×S past {skip_materializing_above}²")
                else:
                    r = run_variant(spec, mode, variant, threads, repeat, min_repeat_ms)
                results.append(r)
                progress.advance()
                line.append(f"{variant}={r.gflops:.1f}" if r.timing else f"{variant}=({r.error})")
            say(f"{progress.tag()} [{mode} B={spec.batch} S={spec.seq_q} D={spec.head_dim} {spec.dtype} "
                f"causal={spec.causal}] " + "  ".join(line))
    except KeyboardInterrupt:
        raise Interrupted(results, progress.done, progress.total) from None
    return results


def write_outputs(results: list[Result], out_dir: str | os.PathLike, meta: dict[str, Any]) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.to_row(meta) for r in results]
    paths = {"json": out / "bench.json", "csv": out / "bench.csv", "md": out / "bench.md"}
    paths["json"].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    paths["md"].write_text(markdown_table(results, meta) + "\n")
    return paths


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def markdown_table(results: list[Result], meta: dict[str, Any]) -> str:
    variants = list(dict.fromkeys(r.variant for r in results))
    lines = [f"Machine: {meta.get('cpu')} ({meta.get('threads')} threads), {meta.get('date')}; "
             f"roofs: FMA peak {meta.get('fma_peak_gflops', 0):.0f} GFLOP/s (TVM FMA loop), streaming-read "
             f"bandwidth {meta.get('read_gbps', 0):.1f} GB/s (TVM parallel sum); NumPy sgemm "
             f"{meta.get('sgemm_gflops', 0):.0f} GFLOP/s for comparison. Cells: GFLOP/s (% of FMA peak, "
             "% of read BW: modeled bytes / time)"
             + (f"; bfloat16 rows: % of the bf16 dot-product peak, {meta['bf16_dot_peak_gflops']:.0f} GFLOP/s"
                if meta.get("bf16_dot_peak_gflops") else "") + ".", ""]
    lines[:0] = partial_line(meta, "measurements")  # a partial run says so first
    head = ["mode", "B", "S", "D", "dtype", "causal"] + [f"{v} GFLOP/s (% of FMA peak, % of read BW)" for v in variants]
    # fused-dyn/fused = static time / dynamic time (the cost of symbolic shapes), only when asked for
    speedups = [("fused", "materialized"), ("fused", "torch")] + ([("fused-dyn", "fused")] if "fused-dyn" in variants else [])
    head += [f"{a}/{b}" for a, b in speedups] + [f"{v} peak mem" for v in variants]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    by_point: dict[tuple, dict[str, Result]] = {}
    for r in results:
        by_point.setdefault((r.mode, r.spec), {})[r.variant] = r
    for (mode, spec), d in by_point.items():
        cells = [mode, str(spec.batch), str(spec.seq_q), str(spec.head_dim), spec.dtype, "yes" if spec.causal else "no"]
        for v in variants:
            r = d.get(v)
            if r is None:
                cells.append("-")
            elif r.timing:
                f, b = r.roof_fractions(meta)
                pct = f" ({100 * f:.0f}%, {100 * b:.1f}%)" if f is not None and b is not None else ""
                cells.append(f"{r.gflops:.1f}{pct}")
            else:
                cells.append("skip" if r.error and r.error.startswith("skipped") else "fail")

        def ratio(a, b):
            ra, rb = d.get(a), d.get(b)
            if ra and rb and ra.timing and rb.timing:
                return f"{rb.timing.median_s / ra.timing.median_s:.2f}x"
            return "-"

        cells += [ratio(a, b) for a, b in speedups]
        cells += [_fmt_bytes(d[v].peak_extra_bytes) if v in d else "-" for v in variants]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
