"""The full sweeps the CPU kernel tests trim to covering sets (issue 43: "Long sweeps live in
benchmarks, not tests"): every shape × head_dim × mask of the fused kernel, both group sizes ×
both masks, the rowcache schedule at every shape and mask, the 8192-key rows both masked and not
(tests/test_correctness.py), and the half-precision dtypes at every awkward shape
(tests/test_halfprec.py), each against the float64 reference.

    python scripts/kernel_sweep.py [correctness|halfprec|all]

Prints one line per case and exits 1 if any case fails.
"""
from __future__ import annotations

import itertools
import sys

import numpy as np

from tvm_attention.artifact import kernel_of
from tvm_attention.build import build_kernel
from tvm_attention.reference import random_inputs, reference_attention
from tvm_attention.spec import AttentionSpec
from tvm_attention.validate import TOLERANCES, validate_callable

SEQ_PAIRS = [(1, 1), (1, 517), (113, 203), (1023, 1024), (300, 45), (128, 128)]
HALF_PAIRS = [(1, 1, False), (1, 517, False), (113, 203, True), (300, 45, True)]


def cases(which: str):
    """(name, spec, schedule, logit_scale) of a sweep."""
    if which in ("correctness", "all"):
        for (sq, sk), d, causal in itertools.product(SEQ_PAIRS, (64, 128), (False, True)):
            yield f"fused {sq}x{sk} D{d} causal={causal}", AttentionSpec(
                batch=1, heads=2, seq_q=sq, seq_kv=sk, head_dim=d, causal=causal), "fused", 1.0
        for (h, kh), causal in itertools.product([(8, 2), (4, 1)], (False, True)):
            yield f"grouped {h}:{kh} causal={causal}", AttentionSpec(
                batch=2, heads=h, kv_heads=kh, seq_q=77, seq_kv=150, head_dim=64, causal=causal), "fused", 1.0
        for causal in (False, True):
            yield f"large logits causal={causal}", AttentionSpec(
                batch=1, heads=2, seq_q=200, seq_kv=333, head_dim=64, causal=causal), "fused", 30.0
            yield f"long 8192 causal={causal}", AttentionSpec(
                batch=1, heads=1, seq_q=8192, head_dim=64, causal=causal), "fused", None
        for (sq, sk), causal in itertools.product([(1, 517), (113, 203), (300, 45)], (False, True)):
            yield f"rowcache {sq}x{sk} causal={causal}", AttentionSpec(
                batch=1, heads=4, kv_heads=2, seq_q=sq, seq_kv=sk, head_dim=64, causal=causal), "rowcache", 1.0
    if which in ("halfprec", "all"):
        for dtype, (sq, sk, causal) in itertools.product(("bfloat16", "float16"), HALF_PAIRS):
            yield f"{dtype} {sq}x{sk} causal={causal}", AttentionSpec(
                batch=1, heads=4, kv_heads=2, seq_q=sq, seq_kv=sk, head_dim=64, causal=causal, dtype=dtype), \
                "fused", 1.0


def run_case(spec: AttentionSpec, schedule: str, logit_scale: float | None) -> tuple[bool, str]:
    kernel = kernel_of(build_kernel(spec, schedule=schedule))
    if logit_scale is None:  # too long for the full reference: validation samples rows
        r = validate_callable(spec, kernel, seed=0)
        return r.passed and r.finite, r.format()
    q, k, v = random_inputs(spec, seed=spec.seq_q + spec.seq_kv)
    if logit_scale != 1.0:
        q = (q.astype(np.float32) * logit_scale).astype(q.dtype)
    ref = reference_attention(spec, *(x.astype(np.float64) for x in (q, k, v)))
    out = np.asarray(kernel(q, k, v)).astype(np.float64)
    atol, rtol = TOLERANCES[spec.dtype]
    ok = bool(np.isfinite(out).all() and np.allclose(out, ref, atol=atol, rtol=rtol))
    if spec.causal and spec.seq_q > spec.seq_kv:
        ok = ok and not out[:, :, : spec.seq_q - spec.seq_kv].any()  # rows with no key
    return ok, f"max abs err {np.abs(out - ref).max():.3e}"


def main(argv: list[str]) -> int:
    which = argv[0] if argv else "all"
    if which not in ("correctness", "halfprec", "all"):
        print(__doc__)
        return 2
    failed = 0
    for name, spec, schedule, scale in cases(which):
        ok, what = run_case(spec, schedule, scale)
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {what}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
