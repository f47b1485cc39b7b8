#!/usr/bin/env python3
"""Run the full products behind tests/test_cuda_mma.py's covering sets.

Long sweeps live here, not in the default test run (issue 43). Each point runs the test's own
function, so a sweep asserts exactly what the test does at its covering set.

    python scripts/sweep_cuda_mma.py                 # every sweep
    python scripts/sweep_cuda_mma.py static          # one: static | symbolic

static:   the static tensor-core preset builds, arch × head_dim × dtype × causal (16 builds, nvcc
          for the ptxas report; the test builds the 5 of ``STATIC_BUILDS``)
symbolic: the emulated symbolic kernel, dtype × causal × stages (1 and 2 warps; 12 compiles)
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # runnable from a source checkout; the tests' helpers


def sweeps() -> dict:
    import test_cuda_mma as t  # noqa: E402 - after the path: the test module and its conftest helpers

    return {
        "static": (t.test_tensor_core_builds_offline,
                   [dict(arch=a, head_dim=d, dtype=dt, causal=c)
                    for a, d, dt, c in itertools.product(("sm_80", "sm_90"), (64, 128), ("float16", "bfloat16"),
                                                         (False, True))]),
        "symbolic": (t.test_tensor_core_symbolic_algorithm_on_cpu,
                     [dict(dtype=dt, causal=c, warps=w, block_n=16, stages=s)
                      for dt, c, s in itertools.product(("float16", "bfloat16"), (False, True), (1, 2, 3))
                      for w in ((2,) if s == 2 else (1,))]),
    }


def main(argv: list[str] | None = None) -> int:
    all_sweeps = sweeps()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", choices=[[], *all_sweeps], default=[], metavar="SWEEP",
                   help=f"{', '.join(all_sweeps)} (default: every sweep)")
    a = p.parse_args(argv)
    failed = 0
    for name in a.names or list(all_sweeps):
        fn, points = all_sweeps[name]
        for kw in points:
            t0 = time.time()
            try:
                fn(**kw)
                status = "ok"
            except AssertionError:
                failed += 1
                status = "FAILED\n" + traceback.format_exc(limit=3)
            print(f"{name} {kw} {time.time() - t0:.1f} s {status}", flush=True)
    print(f"sweep_cuda_mma: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
