"""PNG plots of a sweep (matplotlib, an optional extra): throughput and peak memory against
sequence length, and a roofline."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .sweep import Result

COLORS = {"fused": "C0", "fused-tuned": "C1", "materialized": "C3", "rowcache": "C4", "numpy": "C7", "torch": "C2"}


#: How to get the plotting dependency (an optional extra).
INSTALL_HINT = 'pip install "tvm-attention[plots]"'


def plots_available() -> bool:
    """Whether matplotlib imports: checked before a sweep or comparison, whose plots are skipped
    (with one note up front) rather than failing after the measurements."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def missing_note(what: str) -> str:
    """The note printed up front when matplotlib is missing: ``what`` runs, its plots are skipped."""
    return f"note: matplotlib is not installed ({INSTALL_HINT}): {what}"


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # optional: pip install matplotlib
        raise RuntimeError(f"plots need matplotlib ({INSTALL_HINT})") from e
    return plt


def _panels(results: list[Result], mode: str) -> dict[tuple[int, bool], list[Result]]:
    out: dict[tuple[int, bool], list[Result]] = {}
    for r in results:
        if r.mode == mode:
            out.setdefault((r.spec.head_dim, r.spec.causal), []).append(r)
    return out


def _series_plot(results: list[Result], mode: str, value, ylabel: str, path: Path, logy: bool) -> list[str]:
    plt = _plt()
    panels = _panels(results, mode)
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    labels: set[str] = set()
    for ax, ((d, causal), rs) in zip(axes[0], sorted(panels.items())):
        for variant in dict.fromkeys(r.variant for r in rs):
            pts = sorted((r.spec.seq_q, value(r)) for r in rs if r.variant == variant and value(r) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=variant, color=COLORS.get(variant))
                labels.add(variant)
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("sequence length" + (" (batch × S = const tokens)" if mode == "tokens" else ""))
        ax.set_ylabel(ylabel)
        ax.set_title(f"D={d}, {'causal' if causal else 'full'}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return sorted(labels)


def throughput_plot(results, path: Path, mode: str = "seq") -> list[str]:
    return _series_plot(results, mode, lambda r: r.gflops, "GFLOP/s", path, logy=False)


def memory_plot(results, path: Path, mode: str = "seq") -> list[str]:
    return _series_plot(results, mode, lambda r: r.peak_extra_bytes / 2**20 if r.peak_extra_bytes else None,
                        "peak extra memory (MiB)", path, logy=True)


def roofs(meta: dict[str, Any]) -> tuple[float, float]:
    """(compute roof GFLOP/s, memory roof GB/s): the measured FMA peak and streaming-read bandwidth."""
    return meta["fma_peak_gflops"], meta["read_gbps"]


def roofline_plot(results: list[Result], meta: dict[str, Any], path: Path) -> list[str]:
    """Operational intensity (FLOP / modeled byte) vs attained GFLOP/s under the machine's
    measured roofs: the FMA peak and streaming-read bandwidth (NumPy's sgemm, which a fused kernel
    can beat, drawn dashed for comparison)."""
    import numpy as np

    plt = _plt()
    peak, bw = roofs(meta)
    fig, ax = plt.subplots(figsize=(7, 5))
    xs = np.logspace(-1, 5, 200)
    ax.plot(xs, np.minimum(peak, xs * bw), "k-", lw=1.5,
            label=f"roof: FMA peak {peak:.0f} GFLOP/s, read {bw:.1f} GB/s")
    if meta.get("sgemm_gflops"):
        ax.axhline(meta["sgemm_gflops"], color="0.5", ls="--", lw=1,
                   label=f"NumPy sgemm {meta['sgemm_gflops']:.0f} GFLOP/s (not a roof)")
    labels = []
    for variant in dict.fromkeys(r.variant for r in results):
        pts = [(r.intensity, r.gflops) for r in results if r.variant == variant and r.gflops]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=variant, color=COLORS.get(variant), s=18)
            labels.append(variant)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("operational intensity (FLOP / modeled DRAM byte)")
    ax.set_ylabel("attained GFLOP/s")
    ax.set_title(f"roofline: {meta.get('cpu')}, {meta.get('threads')} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return labels


def write_plots(results: list[Result], meta: dict[str, Any], out_dir: Path) -> dict[str, list[str]]:
    """Write the PNGs; returns {file name: series plotted}."""
    out = {}
    for mode in ("seq", "tokens"):
        if any(r.mode == mode for r in results):
            out[f"throughput_{mode}.png"] = throughput_plot(results, out_dir / f"throughput_{mode}.png", mode)
            out[f"memory_{mode}.png"] = memory_plot(results, out_dir / f"memory_{mode}.png", mode)
    out["roofline.png"] = roofline_plot(results, meta, out_dir / "roofline.png")
    return out
