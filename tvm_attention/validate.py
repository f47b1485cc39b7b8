"""Numerical validation against the float64 NumPy reference, with per-dtype tolerances."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from .layouts import variant_kwargs
from .reference import reference_attention
from .spec import AttentionSpec

#: dtype -> (atol, rtol): |out - ref| <= atol + rtol·|ref| elementwise. float32 kernels land
#: around 1e-6 here; the margin covers long rows (16k keys) and ×30 logits.
TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}
#: Above this many reference scores (B·H·Sq·Skv) we check a sample of rows, not every row.
FULL_CHECK_LIMIT = 1 << 24
SAMPLED_ROWS = 64


@dataclasses.dataclass(frozen=True)
class ValidationResult:
    max_abs_err: float | None  # None when not run
    max_rel_err: float | None
    mean_abs_err: float | None
    atol: float
    rtol: float
    passed: bool
    finite: bool
    rows_checked: str  # "all" or "N sampled"
    seed: int
    ran: bool = True  # False: not run (e.g. a CUDA build on a machine without a GPU)
    reason: str = ""

    @classmethod
    def not_run(cls, spec: AttentionSpec, reason: str, seed: int = 0) -> "ValidationResult":
        atol, rtol = TOLERANCES[spec.dtype]
        return cls(None, None, None, atol, rtol, False, False, "none", seed, ran=False, reason=reason)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def format(self) -> str:
        if not self.ran:
            return f"validation: NOT RUN ({self.reason})"
        status = "PASS" if self.passed else "FAIL"
        return (
            f"validation: {status}  max abs err {self.max_abs_err:.3e}, max rel err "
            f"{self.max_rel_err:.3e}, mean abs err {self.mean_abs_err:.3e} "
            f"(atol {self.atol:g}, rtol {self.rtol:g}; rows: {self.rows_checked}; seed {self.seed})"
        )


def sample_rows(spec: AttentionSpec, seed: int, case: dict | None = None) -> np.ndarray | None:
    """None (check all rows) for small shapes, else a seeded sample incl. the first/last rows."""
    b, sq, sk = (spec.batch, spec.seq_q, spec.seq_kv) if case is None else (case["batch"], case["seq_q"], case["seq_kv"])
    if b * spec.heads * sq * sk <= FULL_CHECK_LIMIT:
        return None
    rng = np.random.default_rng(seed + 1)
    n = min(SAMPLED_ROWS, sq)
    rows = rng.choice(sq, size=n, replace=False)
    return np.unique(np.concatenate([rows, [0, sq - 1]]))


def compare(spec: AttentionSpec, out: np.ndarray, ref: np.ndarray, seed: int, rows_label: str) -> ValidationResult:
    atol, rtol = TOLERANCES[spec.dtype]
    out64 = out.astype(np.float64)
    finite = bool(np.isfinite(out64).all())
    diff = np.abs(out64 - ref)
    rel = diff / (np.abs(ref) + atol)
    passed = finite and bool((diff <= atol + rtol * np.abs(ref)).all())
    return ValidationResult(
        max_abs_err=float(np.nanmax(diff)) if diff.size else 0.0,
        max_rel_err=float(np.nanmax(rel)) if rel.size else 0.0,
        mean_abs_err=float(np.nanmean(diff)) if diff.size else 0.0,
        atol=atol,
        rtol=rtol,
        passed=passed,
        finite=finite,
        rows_checked=rows_label,
        seed=seed,
    )


def _worst(results: list[ValidationResult], labels: list[str]) -> ValidationResult:
    """One result for several shapes: the largest errors, passed only if every shape passed."""
    first = results[0]
    if len(results) == 1:
        return first
    return dataclasses.replace(
        first,
        max_abs_err=max(r.max_abs_err for r in results),
        max_rel_err=max(r.max_rel_err for r in results),
        mean_abs_err=max(r.mean_abs_err for r in results),
        passed=all(r.passed for r in results),
        finite=all(r.finite for r in results),
        rows_checked="; ".join(f"{lab}: {r.rows_checked}" for lab, r in zip(labels, results)),
    )


def validate_callable(spec: AttentionSpec, kernel: Callable[..., np.ndarray], seed: int = 0) -> ValidationResult:
    """Run ``kernel`` (called as the loader's kernel is: ``kernel(q, k, v, *index arrays)``) on
    seeded random inputs of every validation shape of the layout (a dynamic kernel also at a shape
    it was not built at) and compare with the reference; the worst shape decides."""
    layout = spec.layout_info
    results, labels = [], []
    for case in layout.validation_cases(spec):
        arrays = layout.random_inputs(spec, case, seed)
        got = kernel(*arrays.values())
        out, lse = (got[0], got[1]) if spec.return_lse else (got, None)
        out = np.asarray(out).astype(np.float32)
        rows = sample_rows(spec, seed, case) if layout.name == "bhsd" else None
        if rows is not None:
            ref, ref_lse = reference_attention(spec, arrays["q"], arrays["k"], arrays["v"], rows=rows, return_lse=True,
                                               **variant_kwargs(spec, arrays))
            out = out[:, :, rows, :]
            lse = None if lse is None else np.asarray(lse)[:, :, rows]
            label = f"{len(rows)} sampled"
        else:
            ref, ref_lse = layout.reference_outputs(spec, arrays)
            label = "all"
        results.append(compare(spec, out, ref, seed, label))
        labels.append(layout.describe_case(case))
        if lse is not None:
            results.append(compare_lse(spec, np.asarray(lse), ref_lse, seed, label))
            labels.append(layout.describe_case(case) + " (lse)")
    return _worst(results, labels)


def compare_lse(spec: AttentionSpec, lse: np.ndarray, ref: np.ndarray, seed: int, rows_label: str) -> ValidationResult:
    """``lse`` against the reference: ``-inf`` exactly where the row sees no key, elsewhere within
    the float32 tolerances (log-sum-exp is accumulated in float32 whatever the dtype)."""
    atol, rtol = TOLERANCES["float32"]
    lse64 = lse.astype(np.float64)
    none = np.isneginf(ref)
    same_inf = bool((np.isneginf(lse64) == none).all())
    diff = np.where(none, 0.0, np.abs(np.where(none, 0.0, lse64) - np.where(none, 0.0, ref)))
    finite = bool(np.isfinite(lse64[~none]).all())
    passed = same_inf and finite and bool((diff <= atol + rtol * np.abs(np.where(none, 0.0, ref))).all())
    return ValidationResult(
        max_abs_err=float(diff.max()) if diff.size else 0.0,
        max_rel_err=float((diff / (np.abs(np.where(none, 0.0, ref)) + atol)).max()) if diff.size else 0.0,
        mean_abs_err=float(diff.mean()) if diff.size else 0.0,
        atol=atol, rtol=rtol, passed=passed, finite=finite, rows_checked=rows_label, seed=seed,
    )
