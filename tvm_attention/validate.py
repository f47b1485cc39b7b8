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
#: fp8 inputs (``spec.q_dtype``): the reference attends to the dequantized q, K and V exactly, but
#: the kernel multiplies P by V on e4m3 products, P rounded to e4m3 (3 mantissa bits: a relative
#: step of 2^-4, FlashAttention-3's fp8 forward does the same); the wgmma model's error on random
#: inputs is up to about 0.4 of this (tests/test_hopper_fp8.py)
FP8_TOLERANCE = (4e-2, 4e-2)


def tolerances(spec: AttentionSpec) -> tuple[float, float]:
    """``(atol, rtol)`` a kernel of ``spec`` is held to: its output dtype's, or with fp8 inputs
    :data:`FP8_TOLERANCE`."""
    return FP8_TOLERANCE if getattr(spec, "q_dtype", None) else TOLERANCES[spec.dtype]
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
    #: what failed beyond the errors, in words: NaN or inf where the reference is finite (which the
    #: errors above skip), a log-sum-exp finite where the reference's is -inf; each naming its
    #: case and rows ('' when nothing)
    problem: str = ""
    #: the pass criterion's margin: max over elements of |out - ref| / (atol + rtol·|ref|); ≤ 1 is
    #: within tolerance (None: not run, or every element NaN). The relative error alone misleads
    #: where |ref| is near 0, which atol covers.
    tolerance_used: float | None = None
    #: ``qk_int8`` builds: max |reference − the reference without q's rounding to int8| over the
    #: validation cases: how far the option itself moves the output, on top of the dtype's
    #: tolerance the kernel is held to against its own (rounding) reference (None otherwise)
    model_error: float | None = None

    @classmethod
    def not_run(cls, spec: AttentionSpec, reason: str, seed: int = 0) -> "ValidationResult":
        atol, rtol = tolerances(spec)
        return cls(None, None, None, atol, rtol, False, False, "none", seed, ran=False, reason=reason)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        # added after manifests existed: written only when set
        if not d["problem"]:
            del d["problem"]
        if d["tolerance_used"] is None:
            del d["tolerance_used"]
        if d["model_error"] is None:
            del d["model_error"]
        return d

    def format(self) -> str:
        if not self.ran:
            return f"validation: NOT RUN ({self.reason})"
        # PASS says which criterion passed, in words (a max rel err above rtol is no failure: the
        # criterion is atol + rtol·|ref| per element, and relative errors blow up where |ref| is
        # near 0). FAIL puts the problem first: the errors skip NaN, so alone they may read small.
        bound = f"|out - ref| <= atol + rtol·|ref| (atol {self.atol:g}, rtol {self.rtol:g})"
        used = self.tolerance_used
        margin = ("" if used is None or used != used else f", the worst at {used:.1%} of its bound" if used <= 1
                  else f", the worst at {used:.3g}× its bound")
        errors = (f"max abs err {self.max_abs_err:.3e}, max rel err {self.max_rel_err:.3e}, mean abs err "
                  f"{self.mean_abs_err:.3e} (rows: {self.rows_checked}; seed {self.seed})")
        if self.passed:
            return f"validation: PASS  every element within {bound}{margin}; {errors}"
        problem = f"{self.problem}; elsewhere " if self.problem else ""
        return f"validation: FAIL  {problem}{errors}; wanted every element within {bound}{margin}"


def sample_rows(spec: AttentionSpec, seed: int, case: dict | None = None) -> np.ndarray | None:
    """None (check all rows) for small shapes, else a seeded sample incl. the first/last rows."""
    b, sq, sk = (spec.batch, spec.seq_q, spec.seq_kv) if case is None else (case["batch"], case["seq_q"], case["seq_kv"])
    if b * spec.heads * sq * sk <= FULL_CHECK_LIMIT:
        return None
    rng = np.random.default_rng(seed + 1)
    n = min(SAMPLED_ROWS, sq)
    rows = rng.choice(sq, size=n, replace=False)
    return np.unique(np.concatenate([rows, [0, sq - 1]]))


#: Rows a problem names before it says how many more there are.
NAMED_ROWS = 3


def _row_names(name_row: Callable[[tuple], str] | None, index: np.ndarray) -> str:
    """The first :data:`NAMED_ROWS` rows of ``index`` (``(n, ndim)``) in words."""
    name = name_row or (lambda ix: "index " + ", ".join(str(i) for i in ix))
    names = [name(tuple(int(i) for i in ix)) for ix in index[:NAMED_ROWS]]
    more = len(index) - len(names)
    return ", ".join(names) + (f" and {more} more" if more else "")


def nonfinite_rows(out: np.ndarray, ref: np.ndarray, case: str = "", name_row: Callable[[tuple], str] | None = None,
                   row_axis: bool = True) -> str:
    """Where ``out`` holds NaN or ±inf that ``ref`` does not, in words ('' where nowhere): per kind,
    how many rows, the case and the first rows (``NaN in 1 row where the reference is finite: case
    batch=1, seq_q=25, seq_kv=1, batch 0 head 0 row 0``). The errors skip NaN, so without this a
    NaN row reads as a small error and FAIL. ``row_axis``: ``out``'s last axis is head_dim (a row
    is the rest of the index; else every element is one, as in lse); ``name_row(index)`` names a
    row (default: its index)."""
    with np.errstate(invalid="ignore"):
        # what the reference has too is right: -inf (lse of a row that sees no key), NaN (NaN in)
        bad = ~np.isfinite(out) & ~(out == ref) & ~(np.isnan(out) & np.isnan(ref))
    if not bad.any():
        return ""
    kinds = {"NaN": np.isnan, "inf": np.isposinf, "-inf": np.isneginf}
    parts = []
    for kind, is_kind in kinds.items():
        for ref_kind, is_ref_kind in (("finite", np.isfinite), *kinds.items()):
            hit = bad & is_kind(out) & is_ref_kind(ref)
            if not hit.any():
                continue
            rows = hit.any(axis=-1) if row_axis else hit
            index = np.argwhere(rows)
            n = len(index)
            parts.append(f"{kind} in {n} row{'s' if n != 1 else ''} where the reference is {ref_kind}: "
                         f"{'case ' + case + ', ' if case else ''}{_row_names(name_row, index)}")
    return "; ".join(parts)


def compare(spec: AttentionSpec, out: np.ndarray, ref: np.ndarray, seed: int, rows_label: str, case: str = "",
            name_row: Callable[[tuple], str] | None = None) -> ValidationResult:
    """``out`` against the reference ``ref`` within the dtype's tolerances. ``case`` (its
    description) and ``name_row`` (a row's index in ``out`` without head_dim -> words) name what
    is NaN or infinite where the reference is not (:func:`nonfinite_rows`)."""
    atol, rtol = tolerances(spec)
    out64 = out.astype(np.float64)
    finite = bool(np.isfinite(out64).all())
    diff = np.abs(out64 - ref)
    rel = diff / (np.abs(ref) + atol)
    bound = atol + rtol * np.abs(ref)
    passed = finite and bool((diff <= bound).all())
    return ValidationResult(
        max_abs_err=_nan_skipping(np.nanmax, diff),
        max_rel_err=_nan_skipping(np.nanmax, rel),
        mean_abs_err=_nan_skipping(np.nanmean, diff),
        atol=atol,
        rtol=rtol,
        passed=passed,
        finite=finite,
        rows_checked=rows_label,
        seed=seed,
        problem=nonfinite_rows(out64, ref, case, name_row),
        tolerance_used=_nan_skipping(np.nanmax, diff / bound),
    )


def _nan_skipping(fn, x: np.ndarray) -> float:
    """``fn`` (nanmax, nanmean) of ``x``: 0 for no element, NaN (without NumPy's warning) when
    every one is NaN (the problem then says where)."""
    if not x.size:
        return 0.0
    if np.isnan(x).all():
        return float("nan")
    return float(fn(x))


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
        problem="; ".join(r.problem for r in results if r.problem),
        tolerance_used=_max_known(r.tolerance_used for r in results),
    )


def _max_known(values) -> float | None:
    """The largest of ``values`` that is a number (None when none is; NaN counts as known)."""
    known = [v for v in values if v is not None]
    return max(known, key=lambda v: float("inf") if v != v else v) if known else None


def validate_callable(spec: AttentionSpec, kernel: Callable[..., np.ndarray], seed: int = 0) -> ValidationResult:
    """Run ``kernel`` (called as the loader's kernel is: ``kernel(q, k, v, *index arrays)``) on
    seeded random inputs of every validation shape of the layout (a dynamic kernel also at a shape
    it was not built at) and compare with the reference; the worst shape decides."""
    layout = spec.layout_info
    results, labels, model = [], [], []
    for case in layout.validation_cases(spec):
        arrays = layout.random_inputs(spec, case, seed)
        got = kernel(*arrays.values())
        out, lse = (got[0], got[1]) if spec.return_lse else (got, None)
        out = np.asarray(out).astype(np.float32)
        rows = sample_rows(spec, seed, case) if layout.name == "bhsd" else None
        ref, ref_lse = _reference(spec, layout, arrays, rows)
        if spec.qk_int8:  # what rounding q to int8 does to the output, beside the kernel's check
            exact, _ = _reference(dataclasses.replace(spec, qk_int8=False), layout, arrays, rows)
            model.append(_nan_skipping(np.nanmax, np.abs(ref - exact)))
        if rows is not None:
            out = out[:, :, rows, :]
            lse = None if lse is None else np.asarray(lse)[:, :, rows]
            label = f"{len(rows)} sampled"
        else:
            label = "all"
        what = layout.describe_case(case)
        results.append(compare(spec, out, ref, seed, label, what, _namer(layout, arrays, rows)))
        labels.append(what)
        if lse is not None:
            results.append(compare_lse(spec, np.asarray(lse), ref_lse, seed, label, what,
                                       _namer(layout, arrays, rows, lse=True)))
            labels.append(what + " (lse)")
    worst = _worst(results, labels)
    return dataclasses.replace(worst, model_error=_max_known(model)) if model else worst


def _reference(spec: AttentionSpec, layout, arrays: dict, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The float64 ``(o, lse)`` a kernel of ``spec`` is compared with: of every row (the layout's
    reference), or of the sampled BHSD ``rows`` only, on what the reference attends to either
    way (``layout.dequantized``: an 8-bit cache's values times their scales, q rounded with
    ``qk_int8``; the sampled path read the stored bytes unscaled before, and failed every large
    BHSD spec with an 8-bit cache)."""
    if rows is None:
        return layout.reference_outputs(spec, arrays)
    seen = layout.dequantized(spec, arrays)
    return reference_attention(spec, seen["q"], seen["k"], seen["v"], rows=rows, return_lse=True,
                               **variant_kwargs(spec, arrays))


def _namer(layout, arrays: dict, rows: np.ndarray | None, lse: bool = False) -> Callable[[tuple], str]:
    """A row's index in the compared ``o`` (or ``lse``) -> the layout's words for it; ``rows``:
    the sampled rows the comparison kept (BHSD), mapped back to the kernel's."""
    def name(index: tuple) -> str:
        if rows is not None:
            index = index[:2] + (int(rows[index[2]]),)
        return layout.name_row(arrays, index, lse)

    return name


def compare_lse(spec: AttentionSpec, lse: np.ndarray, ref: np.ndarray, seed: int, rows_label: str, case: str = "",
                name_row: Callable[[tuple], str] | None = None) -> ValidationResult:
    """``lse`` against the reference: ``-inf`` exactly where the row sees no key, elsewhere within
    the float32 tolerances (log-sum-exp is accumulated in float32 whatever the dtype). ``case``
    and ``name_row`` name the rows that are not (as :func:`compare`)."""
    atol, rtol = TOLERANCES["float32"]
    lse64 = lse.astype(np.float64)
    none = np.isneginf(ref)
    same_inf = bool((np.isneginf(lse64) == none).all())
    diff = np.where(none, 0.0, np.abs(np.where(none, 0.0, lse64) - np.where(none, 0.0, ref)))
    finite = bool(np.isfinite(lse64[~none]).all())
    bound = atol + rtol * np.abs(np.where(none, 0.0, ref))
    passed = same_inf and finite and bool((diff <= bound).all())
    problems = []
    nonfinite = nonfinite_rows(lse64, ref, case, name_row, row_axis=False)
    if nonfinite:
        problems.append("lse: " + nonfinite)
    keyless = none & np.isfinite(lse64)  # rows that see no key, given a finite log-sum-exp
    if keyless.any():
        index = np.argwhere(keyless)
        problems.append(f"lse: finite in {len(index)} row{'s' if len(index) != 1 else ''} where the reference is -inf "
                        f"(no key seen): {'case ' + case + ', ' if case else ''}{_row_names(name_row, index)}")
    return ValidationResult(
        max_abs_err=_nan_skipping(np.nanmax, diff),
        max_rel_err=_nan_skipping(np.nanmax, diff / (np.abs(np.where(none, 0.0, ref)) + atol)),
        mean_abs_err=_nan_skipping(np.nanmean, diff),
        atol=atol, rtol=rtol, passed=passed, finite=finite, rows_checked=rows_label, seed=seed,
        problem="; ".join(problems), tolerance_used=_nan_skipping(np.nanmax, diff / bound),
    )
