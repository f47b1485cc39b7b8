#!/usr/bin/env python3
"""What the library's own index checks cost: a decode step with and without them, side by side.

The CPU function checks ``cache_seqlens`` and every ``block_table`` entry in use in a serial
prologue before any K/V read (``tvm_attention/workloads/index_checks.py``). This builds the same
decode kernel twice — as exported, and with the prologue left out (for this comparison only) —
and times both alternately on the same inputs (GQA 32:8, D=128, fp32, batch 8, 4k keys by
default: the issue's point), each variant's time the best of the rounds' medians. Prints the
ratio checked/unchecked per layout; within noise means within the rounds' spread.

A script, not a ``tvm-attention bench`` mode like every other benchmark: it builds a kernel with
the library's index checks patched out, which no shipped command should do.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a source checkout

from tvm_attention import build as build_mod  # noqa: E402
from tvm_attention.bench.serving import alternate  # noqa: E402
from tvm_attention.spec import AttentionSpec  # noqa: E402
from tvm_attention.threads import set_num_threads  # noqa: E402
from tvm_attention.timing import time_built  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cache", type=int, default=4096, help="keys per sequence")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--layouts", nargs="+", default=["kvcache", "paged"])
    a = p.parse_args(argv)
    threads = set_num_threads(a.threads)
    print(f"threads={threads} batch={a.batch} keys={a.cache} GQA 32:8 D=128 float32")
    for layout in a.layouts:
        spec = AttentionSpec(batch=a.batch, heads=32, kv_heads=8, seq_q=1, seq_kv=a.cache, head_dim=128,
                             causal=True, layout=layout)
        checked = build_mod.build_kernel(spec)
        real = build_mod.with_index_checks
        build_mod.with_index_checks = lambda mod, spec: mod  # this comparison only
        try:
            unchecked = build_mod.build_kernel(spec)
        finally:
            build_mod.with_index_checks = real
        assert "cache_seqlens: an entry" in checked.lowered.script()
        assert "cache_seqlens: an entry" not in unchecked.lowered.script()
        fns = {name: (lambda b=b: time_built(b, repeat=3, min_repeat_ms=100).median_s)
               for name, b in (("checked", checked), ("unchecked", unchecked))}
        samples = alternate(fns, a.rounds)
        best = {k: min(v) for k, v in samples.items()}
        spread = {k: (max(v) - min(v)) / min(v) for k, v in samples.items()}
        print(f"{layout}: checked {best['checked'] * 1e3:.3f} ms, unchecked {best['unchecked'] * 1e3:.3f} ms, "
              f"checked/unchecked {best['checked'] / best['unchecked']:.3f} "
              f"(rounds' spread: checked {spread['checked']:.1%}, unchecked {spread['unchecked']:.1%}; "
              f"medians {statistics.median(samples['checked']) * 1e3:.3f} / "
              f"{statistics.median(samples['unchecked']) * 1e3:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
