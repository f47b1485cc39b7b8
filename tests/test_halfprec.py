"""Half precision on the CPU (issue 11): bfloat16 and float16 inputs, caches and outputs with
float32 softmax and accumulation, for every layout, against the float64 reference of the
rounded inputs. The awkward shapes are a covering set; both dtypes at every shape is
``python scripts/kernel_sweep.py halfprec``."""
import dataclasses

import numpy as np
import pytest

from tvm_attention.artifact import kernel_of, validate_built
from tvm_attention.layouts import KernelArgumentError
from tvm_attention.reference import random_inputs, reference_attention
from tvm_attention.spec import AttentionSpec, numpy_dtype
from tvm_attention.validate import TOLERANCES

from conftest import at_offset, built, preset_takes_bf16_dots, report

HALF = ["bfloat16", "float16"]


def check(spec, out, ref):
    atol, rtol = TOLERANCES[spec.dtype]
    out = np.asarray(out).astype(np.float64)
    assert np.isfinite(out).all(), "non-finite output"
    assert np.allclose(out, ref, atol=atol, rtol=rtol), report(out, ref)


def rounded_inputs(spec, seed, logit_scale=1.0):
    """q, k, v in the spec's dtype (the kernel's inputs) and their exact float64 values (the
    reference's: it checks the kernel, not the rounding of its inputs)."""
    q, k, v = random_inputs(spec, seed=seed)
    if logit_scale != 1.0:
        q = (q.astype(np.float32) * logit_scale).astype(q.dtype)
    return (q, k, v), [x.astype(np.float64) for x in (q, k, v)]


# A covering set (``python scripts/kernel_sweep.py halfprec`` runs both dtypes at all four shapes):
# a single key and row and key tails in fp16; a decode row over a key tail, row and key tails and
# Sq > Skv (rows with no key) in bf16. Each shape once, each dtype at a decode row and at tails;
# bf16's (113, 203) and (300, 45) are test_bf16_dot_products_...'s dot-product builds, fp16's
# (113, 203) test_half_inputs_at_numpy_alignment_run_in_place's.
@pytest.mark.parametrize("dtype, seq_q, seq_kv, causal", [
    ("float16", 1, 1, False), ("float16", 113, 203, True),
    ("bfloat16", 1, 517, False), ("bfloat16", 113, 203, True), ("bfloat16", 300, 45, True)])
def test_awkward_shapes_match_the_reference(dtype, seq_q, seq_kv, causal):
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=seq_q, seq_kv=seq_kv, head_dim=64, causal=causal,
                         dtype=dtype)
    b = built(spec)
    assert b.audit.fused, b.audit.reasons  # the score tile stays local whatever the input dtype
    (q, k, v), exact = rounded_inputs(spec, seed=seq_q + seq_kv)
    assert q.dtype == numpy_dtype(dtype)
    out = kernel_of(b)(q, k, v)
    assert out.dtype == numpy_dtype(dtype)
    check(spec, out, reference_attention(spec, *exact))
    if causal and seq_q > seq_kv:
        assert np.all(out.astype(np.float32)[:, :, : seq_q - seq_kv] == 0)  # rows with no key


@pytest.mark.parametrize("dtype", HALF)
def test_large_logits_and_d128(dtype):
    spec = AttentionSpec(batch=1, heads=2, seq_q=200, seq_kv=333, head_dim=128, causal=True, dtype=dtype)
    (q, k, v), exact = rounded_inputs(spec, seed=7, logit_scale=30.0)
    check(spec, kernel_of(built(spec))(q, k, v), reference_attention(spec, *exact))


# one symbolic build per layout in bf16 (fp16 shares every line but the dtype: bhsd only): the
# validation runs the layout's own cases (mixed lengths, empty sequences, shuffled pages)
# against the reference of the rounded inputs. Where the CPU has AVX512-BF16 the bf16 builds are
# the dot-product form (the preset): symbolic bhsd and varlen with vdpbf16ps are checked here (they
# were two more builds at head_dim 128; the dot products at 128 are test_large_logits_and_d128's).
# kvcache without split-KV (half its build time): bf16 split-KV is paged's
LAYOUT_SPECS = {
    "bhsd-bf16": dict(layout="bhsd", dtype="bfloat16", dynamic=("batch", "seq_q", "seq_kv"), seq_q=128, seq_kv=128),
    "bhsd-fp16": dict(layout="bhsd", dtype="float16", dynamic=("batch", "seq_q", "seq_kv"), seq_q=128, seq_kv=128),
    "varlen-bf16": dict(layout="varlen", dtype="bfloat16", seq_q=128, seq_kv=128),
    "kvcache-bf16": dict(layout="kvcache", dtype="bfloat16", seq_q=1, seq_kv=256, return_lse=True,
                         knobs=(("split_tasks", 0),)),
    "paged-bf16": dict(layout="paged", dtype="bfloat16", seq_q=1, seq_kv=256),
}


@pytest.mark.parametrize("name", list(LAYOUT_SPECS))
def test_every_layout_validates(name):
    kw = dict(LAYOUT_SPECS[name])
    knobs = kw.pop("knobs", None)
    spec = AttentionSpec(batch=2, heads=8, kv_heads=2, head_dim=64, causal=True, **kw)
    b = built(spec, knobs=knobs)
    assert b.audit.fused, b.audit.reasons
    if spec.dtype == "bfloat16" and spec.layout in ("bhsd", "varlen") and preset_takes_bf16_dots():
        assert b.knobs.dot_bf16 == 1 and "vdpbf16ps" in b.module.inspect_source("asm")
    result = validate_built(b, seed=3)
    assert result.passed and result.rows_checked.count(":") >= 1, result.format()
    assert (result.atol, result.rtol) == TOLERANCES[spec.dtype]


def test_loader_names_a_wrong_dtype_and_takes_torch_half_tensors():
    # the build of test_awkward_shapes_match_the_reference[bfloat16-113-203-True]: the loader's
    # checks and conversions do not depend on the shape
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=113, seq_kv=203, head_dim=64, causal=True,
                         dtype="bfloat16")
    kernel = kernel_of(built(spec))
    (q, k, v), exact = rounded_inputs(spec, seed=1)
    with pytest.raises(KernelArgumentError, match=r"^k: .*bfloat16"):
        kernel(q, k.astype(np.float32), v)
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16) for x in (q, k, v))
    out = kernel(tq, tk, tv)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    check(spec, out.float().numpy(), reference_attention(spec, *exact))
    with pytest.raises(KernelArgumentError, match=r"^q: "):
        kernel(tq.half(), tk, tv)


def test_families_that_compute_only_float32_say_so():
    from tvm_attention.schedules._knobs import KnobError
    from tvm_attention.build import build_kernel

    spec = AttentionSpec(batch=1, heads=2, seq_q=64, seq_kv=64, head_dim=64, dtype="bfloat16")
    for family in ("materialized", "rowcache"):
        with pytest.raises(KnobError, match=f"the {family} schedule builds dtype\\(s\\) float32, not 'bfloat16'"):
            build_kernel(spec, schedule=family)


def _has_bf16_dots():
    from tvm_attention.target import resolve_target, target_features

    return "avx512bf16" in target_features(resolve_target("llvm"))


def _has_amx():
    from tvm_attention.target import resolve_target, target_features

    return {"amx-tile", "amx-bf16"} <= target_features(resolve_target("llvm"))


needs_bf16_dots = pytest.mark.skipif(not _has_bf16_dots(), reason="this CPU has no AVX512-BF16 (vdpbf16ps)")


@needs_bf16_dots
@pytest.mark.parametrize("seq_q, seq_kv, causal", [(3, 517, False), (113, 203, True), (300, 45, True)])
def test_bf16_dot_products_match_the_reference_and_emit_vdpbf16ps(seq_q, seq_kv, causal):
    """dot_bf16=1 (the preset on an AVX512-BF16 CPU whose dot products outrun its FMAs): QKᵀ and
    PV on vdpbf16ps, P rounded to bf16; the fp32-product form of the same spec gives the same
    answer within the bf16 tolerance. (seq_q 3: one row per head more than a packed decode nest
    takes, so the main nest runs.)"""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=seq_q, seq_kv=seq_kv, head_dim=64, causal=causal,
                         dtype="bfloat16")
    # each form named (the preset is one of them: on a Zen 4 the dots, on an Intel core not)
    if preset_takes_bf16_dots():
        dots, plain = built(spec), built(spec, knobs=(("dot_bf16", 0),))
    else:
        dots, plain = built(spec, knobs=(("dot_bf16", 1), ("block_m", 64))), built(spec, knobs=(("dot_bf16", 0),))
    assert dots.knobs.dot_bf16 == 1 and plain.knobs.dot_bf16 == 0
    assert dots.audit.fused, dots.audit.reasons
    assert dots.module.inspect_source("asm").count("vdpbf16ps") >= 2  # QKᵀ and PV
    assert "vdpbf16ps" not in plain.module.inspect_source("asm")
    (q, k, v), exact = rounded_inputs(spec, seed=11, logit_scale=4.0)
    ref = reference_attention(spec, *exact)
    for b in (dots, plain):
        check(spec, kernel_of(b)(q, k, v), ref)


def test_bf16_dot_products_are_refused_where_they_cannot_run():
    from tvm_attention.schedules._knobs import KnobError
    from tvm_attention.build import build_kernel

    # that the preset on AVX2 is fp32 products (dot_bf16=0) is
    # test_half_inputs_without_dot_products_convert_in_vectors_on_avx2's (it builds one there)
    spec = AttentionSpec(batch=1, heads=2, seq_q=64, seq_kv=64, head_dim=64, dtype="bfloat16")
    avx2 = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
    with pytest.raises(KnobError, match="dot_bf16=1 needs .*avx512bf16"):
        build_kernel(spec, target=avx2, knobs={"dot_bf16": 1})
    with pytest.raises(KnobError, match="dot_bf16=1 needs bfloat16 inputs"):
        build_kernel(dataclasses.replace(spec, dtype="float16"), knobs={"dot_bf16": 1})


def test_half_inputs_without_dot_products_convert_in_vectors_on_avx2():
    """With float32 products (AVX2, or fp16 anywhere) the inputs convert to float32 in vector
    instructions (fp16: F16C's vcvtph2ps; bf16: a widening shift); fp16's main nest stages each
    key tile converted once (Kt) rather than converting one K element per broadcast, bf16's does
    not (its shift is cheaper than the copy); both match the reference at a tail-tile shape."""
    from tvm_attention.build import build_kernel
    from tvm_attention.workloads.fused import fused_attention, stages_half_keys

    avx2 = {"kind": "llvm", "mcpu": "x86-64-v3", "num-cores": 2}
    spec = AttentionSpec(batch=1, heads=2, kv_heads=1, seq_q=70, seq_kv=133, head_dim=64, causal=True)
    for dtype, instr, staged in (("float32", "vfmadd", False), ("float16", "vcvtph2ps", True),
                                 ("bfloat16", "vpslld", False)):
        half = dataclasses.replace(spec, dtype=dtype)
        assert stages_half_keys(half, False) == staged
        assert ("Kt = T.sblock_alloc_buffer((64, 64)" in fused_attention(half, 32, 64).script()) == staged
        b = build_kernel(half, target=avx2)
        assert b.knobs.dot_bf16 == 0  # the preset on AVX2: fp32 products (bf16 too)
        asm = b.module.inspect_source("asm")
        assert instr in asm and "zmm" not in asm  # AVX2 code: ymm vectors only
        assert validate_built(b, seed=5).passed  # every host this project runs on has AVX2


@pytest.mark.parametrize("dtype, knobs", [("bfloat16", None), ("bfloat16", {"dot_bf16": 0}), ("float16", None)])
def test_half_inputs_at_numpy_alignment_run_in_place(dtype, knobs):
    """Every half-precision form (the bf16 dot products read their inputs through uint16 aliases
    of the arguments) runs on inputs 16, 32 and 48 bytes past a 64-byte boundary, which the loader
    passes without a copy, with the output of 64-byte aligned inputs. (The builds of
    test_awkward_shapes_match_the_reference[113-203] and of test_bf16_dot_products_...[113-203]'s
    fp32-product form.)"""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=113, seq_kv=203, head_dim=64, causal=True, dtype=dtype)
    kernel = kernel_of(built(spec, knobs=tuple(knobs.items()) if knobs else None))
    assert kernel.alignment == 16
    inputs, _ = rounded_inputs(spec, seed=9)
    want = np.asarray(kernel(*(at_offset(x, 0) for x in inputs))).astype(np.float32)
    for offset in (16, 32, 48):
        got = np.asarray(kernel(*(at_offset(x, offset) for x in inputs))).astype(np.float32)
        np.testing.assert_array_equal(got, want)


@needs_bf16_dots
def test_tuner_searches_both_forms_of_a_bf16_spec():
    from tvm_attention.target import resolve_target
    from tvm_attention.task_mods import workload_matches
    from tvm_attention.tune.tasks import make_tasks

    spec = AttentionSpec(batch=1, heads=2, seq_q=256, seq_kv=256, head_dim=64, dtype="bfloat16")
    tasks = make_tasks(spec, resolve_target("llvm"), "fused")
    # an AMX host: the tile form's tiles first (the preset's), then both vector forms
    tiles = [t for t in tasks if t.name.endswith("_amx")]
    assert tasks[:len(tiles)] == tiles and (len(tiles) > 0) == _has_amx()
    dots = [t for t in tasks if t.name.endswith("_bf16dot")]
    assert tasks[len(tiles)] is dots[0] and 0 < len(dots) == len(tasks) - len(dots) - len(tiles)
    assert all(workload_matches(spec, t.mod) for t in tasks)


def test_halfprec_bench_smoke(tmp_path):
    """``bench --halfprec --tiny``: every variant side by side with the two roofs of this run."""
    import json

    from tvm_attention import cli

    assert cli.main(["bench", "--halfprec", "--tiny", "--threads", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "halfprec.json").read_text())
    (row,) = report["rows"]
    assert report["meta"]["fma_peak_gflops"] > 0
    for name in ("fp32", "bf16-fp32", "fp16"):
        assert row[f"{name}_gflops"] > 0 and row[f"{name}_err"] < 2e-2, name
    # the ratios compare the form the preset builds here: dot products where they outrun the FMAs
    amx = report["meta"]["amx_tile_peak_gflops"]
    assert row["bf16_form"] == ("bf16-amx" if amx else "bf16-dot" if preset_takes_bf16_dots() else "bf16-fp32")
    if amx:  # the tile form beside the others, against the tile peak measured in the run
        assert 0 < row["bf16_of_tile_peak"] and row["bf16-amx_err"] < 2e-2
    if report["meta"]["avx512bf16"]:
        assert report["meta"]["bf16_dot_peak_gflops"] > 0 and 0 < row["bf16_of_dot_peak"]
        assert row["bf16-dot_err"] < 2e-2
    assert row["bf16_vs_fp32"] > 0 and row["bf16_vs_torch_bf16"] > 0
    assert "| D | fp32 | bf16-amx | bf16-dot |" in (tmp_path / "halfprec.md").read_text()


def test_bench_sweep_points_and_torch_peer_take_the_dtype():
    from tvm_attention.bench.peers import torch_sdpa_fn
    from tvm_attention.bench.sweep import points

    pts = points([256], [64], [True], heads=2, batch=1, tokens=None, dtypes=["float32", "bfloat16"])
    assert [s.dtype for _, s in pts] == ["float32", "bfloat16"]
    spec = pts[1][1]
    fn = torch_sdpa_fn(spec, 1)
    if fn is None:
        pytest.skip("torch not installed")
    (q, k, v), exact = rounded_inputs(spec, seed=4)
    check(spec, fn(q, k, v), reference_attention(spec, *exact))  # SDPA in bf16 on the bf16 inputs


@needs_bf16_dots
def test_tuned_bf16_dot_trace_replays_and_builds(tmp_path):
    """A tune of a bf16 spec measures the preset's form first, the AMX tiles on an AMX host, else
    the dot products (its trace, with the imported LLVM IR, goes through the log) and the tuned
    build replays it. (One trial: the first measured is that form's task; that the tuner
    searches every form is test_tuner_searches_both_forms_of_a_bf16_spec's.)"""
    from tvm_attention.pipeline import build_best
    from tvm_attention.tune.driver import tune

    spec = AttentionSpec(batch=1, heads=2, seq_q=128, seq_kv=128, head_dim=64, dtype="bfloat16")
    result = tune(spec, trials=1, per_round=1, work_dir=tmp_path, progress=lambda m: None)
    form, instruction = (2, "tdpbf16ps") if _has_amx() else (1, "vdpbf16ps")
    assert result.trials_new == 1 and result.best_knobs["dot_bf16"] == form, result.best_task
    b, v = build_best(spec, log_dir=tmp_path)
    assert b.source == "tuned" and b.knobs.dot_bf16 == form and v.passed and b.audit.fused
    assert instruction in b.module.inspect_source("asm")
