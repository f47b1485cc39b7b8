"""8-bit K/V caches (float8_e4m3fn, float8_e5m2, int8) with per-kv-head scales: the element
conversion against ml_dtypes for every bit pattern, ``quantize_kv`` (NumPy and torch), the kernel
against the float64 reference of the dequantized cache in every layout and query dtype, the
loader (ml_dtypes and torch float8 arrays) and the library's own scale checks, and the families
that refuse them by name."""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from tvm_attention import quantize_kv
from tvm_attention.artifact import kernel_of, validate_built
from tvm_attention.loader import KernelArgumentError
from tvm_attention.quant import QMAX, dequantize
from tvm_attention.spec import KV_DTYPES, AttentionSpec, SpecError

from conftest import built, preset_takes_bf16_dots

FP8 = ("float8_e4m3fn", "float8_e5m2")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_every_bit_pattern_converts_as_ml_dtypes_reads_it(kv_dtype):
    """``kv_to_f32`` (integer bit operations, vectorized) gives ml_dtypes' float32 value of each
    of the 256 bytes: zeros, subnormals, the largest normals, e4m3fn's NaN, e5m2's inf and NaN."""
    import tvm
    from tvm.script import tirx as T

    from tvm_attention.loader import aligned_empty
    from tvm_attention.runtime import cpu_view
    from tvm_attention.target import resolve_target
    from tvm_attention.workloads._math import kv_to_f32

    fp8 = kv_dtype in FP8
    read = "uint8" if fp8 else "int8"

    @T.prim_func(s_tir=True, check_well_formed=False)
    def convert(a: T.handle, b: T.handle):
        T.func_attr({"global_symbol": "convert", "tirx.noalias": True})
        X = T.match_buffer(a, (256,), kv_dtype, align=64)
        Y = T.match_buffer(b, (256,), "float32", align=64)
        Xb = T.decl_buffer((256,), read, data=X.data)
        for i in T.vectorized(256):
            with T.sblock("c"):
                vi = T.axis.remap("S", [i])
                Y[vi] = kv_to_f32(Xb[vi], kv_dtype)

    mod = tvm.compile(convert, target=resolve_target("llvm"))
    bits = np.arange(256, dtype=np.uint8)
    x = aligned_empty((256,), np.dtype(getattr(ml_dtypes, kv_dtype)) if fp8 else np.int8)
    x.view(np.uint8)[...] = bits
    y = aligned_empty((256,), np.float32)
    mod["convert"](cpu_view(x), y)
    want = x.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(y[ok], want[ok])
    assert (np.signbit(y[ok]) == np.signbit(want[ok])).all()  # -0 stays -0


def test_quantize_kv_numpy_and_torch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float32) * np.array([1, 10, 0.01], np.float32)[None, :, None, None]
    for name in KV_DTYPES:
        q, s = quantize_kv(x, name)
        assert q.dtype == (np.dtype(getattr(ml_dtypes, name)) if name in FP8 else np.int8) and s.shape == (3,)
        assert s.dtype == np.float32 and (s > 0).all()
        np.testing.assert_allclose(np.abs(q.astype(np.float32)).reshape(2, 3, -1).transpose(1, 0, 2).reshape(3, -1).max(1),
                                   QMAX[name])  # each head's largest magnitude lands on QMAX
        deq = dequantize(q, s)
        head = s[None, :, None, None]
        # float8: half an ulp of the mantissa, relative; below the smallest normal (2^-6, 2^-14,
        # times the head's scale) half a subnormal step, the same bound relative to that normal
        rel, normal = {"float8_e4m3fn": (2 ** -4, 2 ** -6), "float8_e5m2": (2 ** -3, 2 ** -14)}.get(name, (None, None))
        if rel is not None:
            err = np.abs(deq - x) / np.maximum(np.abs(x), head * normal)
            assert err.max() <= rel
        else:  # int8: half a step of the head's scale
            assert (np.abs(deq - x) <= 0.5001 * head).all()
    # the caller's scale is used as given; a pool's kv heads on axis 2
    q, s = quantize_kv(x[:, :, :2], "float8_e4m3fn", scale=np.full(3, 0.5, np.float32))
    assert (s == 0.5).all() and q.astype(np.float32)[1, 0, 0, 0] == np.float32(ml_dtypes.float8_e4m3fn(x[1, 0, 0, 0] / 0.5))
    q, s = quantize_kv(x.transpose(0, 2, 1, 3), "int8", head_axis=2)
    assert s.shape == (3,)
    # saturating, not wrapping (TVM's plain cast turns 500 into -0.0); NaN stays NaN in float8
    big = np.array([[[[500.0, -1e6, np.nan, 1.0]]]], np.float32)
    q, _ = quantize_kv(big, "float8_e4m3fn", scale=np.ones(1, np.float32))
    np.testing.assert_array_equal(q.astype(np.float32)[0, 0, 0, :2], [448.0, -448.0])
    assert np.isnan(q.astype(np.float32)[0, 0, 0, 2])
    q, _ = quantize_kv(big[..., :2], "float8_e5m2", scale=np.ones(1, np.float32))
    np.testing.assert_array_equal(q.astype(np.float32).ravel(), [512.0, -57344.0])
    with pytest.raises(SpecError, match="int8 has no NaN"):
        quantize_kv(big, "int8")
    with pytest.raises(SpecError, match="not an 8-bit K/V dtype"):
        quantize_kv(x, "float16")
    with pytest.raises(SpecError, match=r"scale\[1\]"):
        quantize_kv(x, "int8", scale=np.array([1.0, 0.0, 1.0], np.float32))
    torch = pytest.importorskip("torch")
    for name in KV_DTYPES:
        tq, ts = quantize_kv(torch.from_numpy(x), name)
        nq, ns = quantize_kv(x, name)
        assert str(tq.dtype) == f"torch.{name}"
        np.testing.assert_allclose(ts.numpy(), ns, rtol=1e-6)
        np.testing.assert_array_equal(tq.to(torch.float32).numpy(), nq.astype(np.float32))


def test_spec_fields():
    s = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1, seq_kv=64, head_dim=32, layout="kvcache",
                      kv_dtype="float8_e4m3fn")
    assert s.kv_quantized and s.kv_itemsize == 1 and "_kve4m3_" in s.short_name()
    assert [a["name"] for a in s.arg_specs()] == ["q", "k_cache", "v_cache", "cache_seqlens", "k_scale", "v_scale", "o"]
    assert s.arg_specs()[1]["dtype"] == "float8_e4m3fn" and s.arg_specs()[0]["dtype"] == "float32"
    assert AttentionSpec.from_dict(s.to_dict()) == s
    plain = AttentionSpec(batch=1, heads=4, seq_q=8, head_dim=32, kv_dtype="float32")
    assert plain.kv_dtype is None and "kv_dtype" not in plain.to_dict()  # K/V in dtype: no change
    with pytest.raises(SpecError, match="kv_dtype='uint8'"):
        AttentionSpec(batch=1, heads=4, seq_q=8, head_dim=32, kv_dtype="uint8")


#: name -> spec fields: every layout (static bhsd, the tuner's representative), each kv dtype,
#: each query dtype, GQA decode tiers and split-KV (kvcache/paged validation cases: seq_q 1, 4
#: and 37, cache_seqlens 0, 1, page and tile edges), sinks and a window beside them. Split-KV
#: (two more nests per decode tier: half a build's time) on a float8 cache in each KV-cache
#: layout: kvcache_e4m3_fp32_append and paged_e5m2_bf16_append; paged_int8_fp16_append is built
#: without it (KNOBS) and holds the sinks, which beside split-KV and bf16 queries made the paged
#: build three times as long (sinks beside split-KV: test_variants.py's paged_all). The cache
#: kernels append (the new keys written first, then the same nests attend to them):
#: test_append_writes_the_cache_and_attends_to_the_new_keys runs them too
KERNELS = {
    "kvcache_e4m3_fp32_append": dict(batch=1, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64,
                                     layout="kvcache", causal=True, kv_dtype="float8_e4m3fn", return_lse=True,
                                     append=True),
    "paged_e5m2_bf16_append": dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64, layout="paged",
                                   causal=True, dtype="bfloat16", kv_dtype="float8_e5m2", append=True),
    "paged_int8_fp16_append": dict(batch=1, heads=4, kv_heads=4, seq_q=1, seq_kv=200, head_dim=32, layout="paged",
                                   page_size=64, dtype="float16", kv_dtype="int8", window=(100, 0), sinks=True,
                                   append=True),
    "bhsd_e4m3_static": dict(batch=1, heads=2, seq_q=70, seq_kv=45, head_dim=64, kv_dtype="float8_e4m3fn",
                             causal=True),
    "varlen_int8": dict(batch=2, heads=4, kv_heads=2, seq_q=40, seq_kv=40, head_dim=32, layout="varlen",
                        kv_dtype="int8"),
}


#: name -> knobs of its build (the others: the preset, split-KV on)
KNOBS = {"paged_int8_fp16_append": (("split_tasks", 0),), "kvcache_append_bf16": (("split_tasks", 0),)}


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matches_the_reference(name):
    spec = AttentionSpec(**KERNELS[name])
    b = built(spec, knobs=KNOBS.get(name))
    assert b.audit.fused, b.audit
    r = validate_built(b)
    assert r.passed and r.finite, r


def test_loader_takes_ml_dtypes_and_torch_float8_and_checks_the_scales(tmp_path):
    """Through the loader (the kvcache float8 kernel, which appends its 4 new keys first: each
    call writes the same keys at the same places, so the outputs stay the reference's)."""
    import tvm_ffi

    from tvm_attention.artifact import export
    from tvm_attention.loader import load

    spec = AttentionSpec(**KERNELS["kvcache_e4m3_fp32_append"])
    b = built(spec)
    export(b, tmp_path, validate_built(b))
    k = load(tmp_path)
    lay = spec.layout_info
    x = lay.random_inputs(spec, {"seq_q": 4, "cache_seqlens": [0, 17, 300], "max_len": 304}, seed=3)
    ref, ref_lse = lay.reference_outputs(spec, x)
    names = ("q", "k_cache", "v_cache", "cache_seqlens", "k_scale", "v_scale", "k_new", "v_new")
    o, lse = k(*(x[n] for n in names))
    np.testing.assert_allclose(o, ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)
    # NaN in the cache gives NaN rows (those that see the key), not a silent zero
    xn = dict(x, k_cache=x["k_cache"].copy())
    xn["k_cache"][2, 0, 5, 3] = np.nan
    o, _ = k(*(xn[n] for n in names))
    assert np.isnan(o[2, :spec.group_size]).all() and np.isfinite(o[2, spec.group_size:]).all()
    for bad, word in [(np.array([1.0, np.nan], np.float32), r"k_scale\[1\]"),
                      (np.array([0.0, 1.0], np.float32), r"k_scale\[0\]"),
                      (np.array([-1.0, 1.0], np.float32), r"k_scale\[0\]"),
                      (np.ones(3, np.float32), "k_scale")]:
        with pytest.raises(KernelArgumentError, match=word):
            k(*(x[n] for n in names[:4]), bad, *(x[n] for n in names[5:]))
    with pytest.raises(KernelArgumentError, match="k_cache: expected dtype float8_e4m3fn"):
        k(x["q"], x["k_cache"].astype(np.float32), *(x[n] for n in names[2:]))
    # the library checks the scales itself (C++ callers skip the loader)
    o = np.empty_like(x["q"])
    lse = np.empty(x["q"].shape[:3], np.float32)
    from tvm_attention.runtime import cpu_view

    args = [cpu_view(x[n]) if n in ("k_cache", "v_cache") else tvm_ffi.from_dlpack(x[n]) for n in names]
    for bad in (np.inf, np.nan, 0.0):
        args[5] = tvm_ffi.from_dlpack(np.array([1.0, bad], np.float32))  # v_scale
        with pytest.raises(ValueError, match="v_scale: an entry is not a positive finite number"):
            k.function(*args, tvm_ffi.from_dlpack(o), tvm_ffi.from_dlpack(lse))
    torch = pytest.importorskip("torch")
    t = {n: torch.from_numpy(np.ascontiguousarray(x[n].view(np.uint8))).view(torch.float8_e4m3fn)
         if n in ("k_cache", "v_cache") else torch.from_numpy(x[n]) for n in names}
    o, lse = k(*(t[n] for n in names))
    assert isinstance(o, torch.Tensor)
    np.testing.assert_allclose(o.numpy(), ref, atol=1e-4, rtol=1e-4)


def test_other_families_refuse_an_8bit_cache_by_name():
    from tvm_attention.schedules import check, get_schedule
    from tvm_attention.schedules._knobs import KnobError
    from tvm_attention.target import resolve_target

    spec = AttentionSpec(batch=1, heads=2, seq_q=64, head_dim=64, dtype="float16", kv_dtype="float8_e4m3fn")
    for name, target in [("fused", "cuda"), ("materialized", "llvm")]:
        t = resolve_target(target, arch="sm_90") if target == "cuda" else resolve_target(target)
        fam = get_schedule(name, t)
        s = spec if target == "cuda" else AttentionSpec(**{**spec.to_dict(), "dtype": "float32"})
        with pytest.raises(KnobError, match="8-bit K/V caches"):
            check(fam, fam.preset(s, t), s, t)


#: appending kernels: every kv dtype, plain and 8-bit, both layouts, every query dtype, with
#: split-KV in each layout (kvcache_e4m3_fp32_append and kvcache_int8_qk8_split_append, whose
#: cache is int8 as for qk_int8 or not; paged_e5m2_bf16_append) and without it; seq_q 4 over
#: cache_seqlens 0, 1, 15 (an append that crosses a page of 16), 63 (one of 64), 200 in the
#: validation cases. The 8-bit ones are KERNELS' and QK_INT8's (one build each, validated there);
#: the plain bf16 cache's is built without split-KV (KNOBS): what it adds is its dtype's writes,
#: which come before any nest
APPEND_ONLY = {
    "kvcache_append_bf16": dict(batch=1, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64, layout="kvcache",
                                causal=True, dtype="bfloat16", append=True),
}
APPENDING = ["kvcache_append_bf16", "kvcache_e4m3_fp32_append", "paged_e5m2_bf16_append", "paged_int8_fp16_append",
             "kvcache_int8_qk8_split_append"]


def appending(name):
    """``(spec, knobs)`` of the appending kernel ``name`` of APPENDING, as its own table's test
    builds it (one build)."""
    if name in QK_INT8:
        kw, knobs = QK_INT8[name]
        return AttentionSpec(kv_dtype="int8", qk_int8=True, **kw), knobs
    return AttentionSpec(**(KERNELS.get(name) or APPEND_ONLY[name])), KNOBS.get(name)


@pytest.mark.parametrize("name", APPENDING)
def test_append_writes_the_cache_and_attends_to_the_new_keys(name):
    """The kernel validates (the reference appends the new keys, quantized by ``quantize_kv``
    with the call's scales, then attends over cache_seqlens + seq_q; KERNELS' and QK_INT8's
    tests validate theirs), and after the call the cache holds exactly that, bit for bit: the
    new keys at their positions (across a page boundary, from an empty sequence), saturated and
    NaN kept for float8, nothing else touched."""
    spec, knobs = appending(name)
    b = built(spec, knobs=knobs)
    if name in APPEND_ONLY:
        assert b.audit.fused, b.audit
        r = validate_built(b)
        assert r.passed and r.finite, r
    lay, k = spec.layout_info, kernel_of(b)
    case = {"seq_q": 4, "cache_seqlens": [0, 15, 63, 200][:3 if spec.layout == "paged" else 4]}
    if spec.layout == "kvcache":
        case["max_len"] = 205
    x = lay.random_inputs(spec, case, seed=9)
    x["k_new"][0, 0, 1, :3] = [6e4, -6e4, np.nan if spec.kv_dtype != "int8" else 0.0]  # saturate; NaN kept
    want = lay.appended(spec, x)
    before = {n: x[n].copy() for n in lay.kv_names}
    out = k(*x.values())
    o = out[0] if spec.return_lse else out
    names = lay.kv_names
    for n in names:  # the caches were written in place, exactly as the reference's copy
        np.testing.assert_array_equal(x[n].view(np.uint8), want[n].view(np.uint8))
    assert not np.array_equal(x[names[0]].view(np.uint8), before[names[0]].view(np.uint8))
    ref = lay.reference(spec, dict(x, k_new=x["k_new"], cache_seqlens=x["cache_seqlens"]))
    rows = np.isfinite(ref)
    np.testing.assert_allclose(o[rows].astype(np.float64), ref[rows], atol=2e-2, rtol=2e-2)
    assert np.isnan(o[~rows]).all() if spec.kv_dtype != "int8" else rows.all()


def test_append_checks_its_room_and_never_copies_the_cache():
    spec, knobs = appending("kvcache_int8_qk8_split_append")  # an int8 cache's: NaN has no place in it
    k = kernel_of(built(spec, knobs=knobs))
    lay = spec.layout_info
    x = lay.random_inputs(spec, {"seq_q": 4, "cache_seqlens": [3, 17], "max_len": 21})
    with pytest.raises(KernelArgumentError, match=r"cache_seqlens\[1\]=18 \+ seq_q=4 appended exceeds"):
        k(*{**x, "cache_seqlens": np.array([3, 18], np.int32)}.values())
    bad = x["k_new"].copy()
    bad[1, 0, 0, 0] = np.nan
    with pytest.raises(KernelArgumentError, match="k_new: holds NaN, which an int8 cache cannot store"):
        k(*{**x, "k_new": bad}.values())
    ro = x["v_cache"].copy()
    ro.flags.writeable = False
    with pytest.raises(KernelArgumentError, match="v_cache: read-only"):
        k(*{**x, "v_cache": ro}.values())
    from conftest import at_offset

    with pytest.raises(KernelArgumentError, match="k_cache: data at 8 mod 64 bytes"):
        k(*{**x, "k_cache": at_offset(x["k_cache"], 8)}.values())
    # the library checks the room itself
    import tvm_ffi

    args = [tvm_ffi.from_dlpack(a) for a in (*x.values(), np.empty_like(x["q"]), np.empty(x["q"].shape[:3], np.float32))]
    args[3] = tvm_ffi.from_dlpack(np.array([3, 18], np.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens: .*with append"):
        k.function(*args)
    args[3] = tvm_ffi.from_dlpack(x["cache_seqlens"])
    args[6] = tvm_ffi.from_dlpack(bad)  # k_new
    with pytest.raises(ValueError, match="k_new: holds NaN"):
        k.function(*args)


def test_append_is_refused_where_it_does_not_apply():
    with pytest.raises(SpecError, match="append .* kvcache, paged, mla and mla_paged layouts, not 'bhsd'"):
        AttentionSpec(batch=1, heads=2, seq_q=4, head_dim=32, append=True)
    s = AttentionSpec(**KERNELS["paged_e5m2_bf16_append"])
    assert "_append" in s.short_name() and not s.representative().append  # tuned without it
    assert [a["name"] for a in s.arg_specs()][-3:] == ["k_new", "v_new", "o"]


def test_tuning_a_cuda_8bit_cache_is_refused_by_name():
    """A CUDA KV-cache spec is tuned at its bhsd representative, which has no 8-bit form on CUDA:
    the workload generator failed deep in TVM's parser (``Reinterpret requires size match``);
    now the family's capabilities name it before any workload is made (issue 41's review)."""
    from tvm_attention.target import resolve_target
    from tvm_attention.task_mods import tuning_spec
    from tvm_attention.tune.tasks import make_tasks

    target = resolve_target("cuda", arch="sm_90")
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1, seq_kv=256, head_dim=128, dtype="float16",
                         causal=True, layout="kvcache", kv_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match=r"cannot tune .*_kve4m3_causal \[fused\] .* 8-bit K/V caches .* not 'bhsd'"):
        make_tasks(tuning_spec(spec, target), target, "fused")


def _has_bf16_dots():
    from tvm_attention.target import resolve_target, target_features

    return "avx512bf16" in target_features(resolve_target("llvm"))


#: decode_dot (QKᵀ of the staged decode nests on vdpbf16ps): every 8-bit dtype with bf16 queries,
#: both cache layouts, split-KV and not, append, GQA and MHA, lse; paged with its page order (all
#: heads). Each entry holds several of them: int8 with kvcache, split-KV and append; e4m3 with
#: paged and MHA; e5m2 is KERNELS' paged_e5m2_bf16_append (paged, split, append), whose preset
#: here this is: knobs None, its build (the same object: a build loaded from the build cache
#: has no assembly to read)
DECODE_DOT = {  # name: (spec, decode_dot, other knobs, or None: the preset)
    "kvcache_int8_split_append": (dict(layout="kvcache", batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300,
                                       head_dim=64, causal=True, dtype="bfloat16", kv_dtype="int8", return_lse=True,
                                       append=True), 1, ()),
    # MHA: one row per kv head, the dot product's one-lane form
    "paged_e4m3_mha": (dict(layout="paged", batch=2, heads=4, kv_heads=4, seq_q=1, seq_kv=200, head_dim=64,
                            causal=True, dtype="bfloat16", kv_dtype="float8_e4m3fn", return_lse=True), 1,
                       (("split_tasks", 0),)),
    "paged_e5m2_bf16_append": (KERNELS["paged_e5m2_bf16_append"], 1, None),
    # PV on the dot products too (decode_dot 2): one head per task with an 8-bit cache widened
    # to bf16; a tile of every kv head (the paged preset's page order), split: the bf16 cache of
    # test_decode_dot_is_the_bf16_preset_and_matches_the_float32_products
    "kvcache_e4m3_pv_append": (dict(layout="kvcache", batch=1, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64,
                                    causal=True, dtype="bfloat16", kv_dtype="float8_e4m3fn", append=True), 2,
                               (("split_tasks", 0),)),
}


@pytest.mark.skipif(not _has_bf16_dots(), reason="this CPU has no AVX512-BF16 (vdpbf16ps)")
@pytest.mark.parametrize("name", list(DECODE_DOT))
def test_decode_dot_products_match_the_reference(name):
    """``decode_dot`` 1: the 8-bit values and bf16 queries are exact in bf16, so QKᵀ's dot products
    round nothing the float32 products did not (the float32 tolerances of the LSE hold too).
    ``decode_dot`` 2: PV too, on P rounded to bf16 and V's pairs (an 8-bit cache's values
    widened), within the bf16 tolerances."""
    kw, level, knobs = DECODE_DOT[name]
    if knobs is None and not preset_takes_bf16_dots():  # the preset here is the float32 products: name the form
        knobs = ()
    b = built(AttentionSpec(**kw), knobs=None if knobs is None else (("decode_dot", level),) + knobs)
    assert b.knobs.decode_dot == level and b.audit.fused, b.audit
    assert "vdpbf16ps" in b.module.inspect_source("asm")
    r = validate_built(b)
    assert r.passed and r.finite, r


@pytest.mark.skipif(not _has_bf16_dots(), reason="this CPU has no AVX512-BF16 (vdpbf16ps)")
def test_decode_dot_is_the_bf16_preset_and_matches_the_float32_products():
    """A bf16 cache's decode step takes both dot products by default (``cpu_fused.preset``), an
    8-bit cache's QKᵀ only, and gives what the float32 FMAs give up to the order of the sums and
    P's rounding to bf16 (the log-sum-exp adds the unrounded P); the knob is refused where the
    operands are not exact in bf16, the CPU has no vdpbf16ps, or (2) block_n is odd. The build:
    the paged preset's tile of every kv head, split-KV (batch 2 · 2 kv heads: 299 keys in two
    chunks), against the reference as DECODE_DOT's."""
    from tvm_attention.schedules import cpu_fused
    from tvm_attention.schedules._knobs import KnobError
    from tvm_attention.target import resolve_target

    spec = AttentionSpec(layout="paged", batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64,
                         causal=True, dtype="bfloat16", return_lse=True)
    host = resolve_target("llvm")
    contiguous = dataclasses.replace(spec, layout="kvcache", page_size=None)
    # the preset where the dot products outrun the FMAs (a Zen 4; an Intel core's preset is the
    # float32 products: cpu_balance), the knob named elsewhere
    dots = preset_takes_bf16_dots()
    # (an AMX host's GQA decode takes the tiles: test_amx_decode)
    for s in (spec, contiguous):
        tiles = cpu_fused.amx_decode_heads(s, cpu_fused.preset(s, host), host)
        assert cpu_fused.preset(s, host).decode_dot == (cpu_fused.DECODE_AMX if tiles else 2 * dots)
    assert cpu_fused.preset(dataclasses.replace(spec, kv_dtype="int8"), host).decode_dot == int(dots)  # QKᵀ: exact
    if dots:
        dot, fma = built(spec), built(spec, knobs=(("decode_dot", 0),))
    else:  # (an AMX host's preset is the tiles: both forms named)
        dot, fma = built(spec, knobs=(("decode_dot", 2),)), built(spec, knobs=(("decode_dot", 0),))
    assert (dot.knobs.decode_dot, fma.knobs.decode_dot) == (2, 0)
    assert dot.audit.fused and dot.knobs.decode_heads == spec.kv_heads and dot.knobs.split_tasks > 0, dot.knobs
    r = validate_built(dot)
    assert r.passed and r.finite, r
    n_dot, n_fma = (x.module.inspect_source("asm").count("vdpbf16ps") for x in (dot, fma))
    assert n_dot > n_fma  # the decode nests' on top of the main nest's
    lay = spec.layout_info
    x = lay.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [0, 299]}, seed=1)
    (o1, l1), (o0, l0) = (kernel_of(b)(*x.values()) for b in (dot, fma))
    o1, o0 = (np.asarray(o).astype(np.float32) for o in (o1, o0))
    np.testing.assert_allclose(o1, o0, atol=1e-2, rtol=1e-2)  # a bf16 rounding of the output and of P apart
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), atol=1e-5, rtol=1e-5)
    for bad, target in ((dict(dtype="float16"), host), (dict(dtype="float32"), host),
                        (dict(dtype="float32", kv_dtype="int8"), host),
                        ({}, resolve_target({"kind": "llvm", "mcpu": "x86-64-v3"}))):
        s = AttentionSpec(**{**spec.to_dict(), **bad})
        with pytest.raises(KnobError, match="decode_dot=1 needs"):
            cpu_fused.check(dataclasses.replace(cpu_fused.preset(s, target), decode_dot=1), s, target)
    with pytest.raises(KnobError, match="block_n=33 must be even"):
        odd = dataclasses.replace(cpu_fused.preset(spec, host), decode_dot=2, block_n=33, s_rows=1, decode_block_n=0)
        cpu_fused.check(odd, spec, host)
    with pytest.raises(KnobError, match="decode_dot=2 rounds P to bf16"):
        s = AttentionSpec(**{**spec.to_dict(), "dtype": "float32", "kv_dtype": "int8", "qk_int8": True})
        cpu_fused.check(dataclasses.replace(cpu_fused.preset(s, host), decode_dot=2), s, host)


def test_qk_int8_rounds_each_query_row_as_the_kernels_do():
    """``quant.qk_int8_query``, the reference's model of ``qk_int8``: a row's largest magnitude
    maps to ±127, the others round to nearest (ties to even) in float32; a row of zeros stays
    zeros; NaN or inf makes the row NaN. The spec takes it with an int8 cache only, and the
    families that cannot build it say so."""
    from tvm_attention.quant import qk_int8_query
    from tvm_attention.schedules import cuda_fused

    q = np.array([[1.0, -0.5, 0.25, 0.0], [0, 0, 0, 0], [1.0, np.nan, 0, 0], [np.inf, 1.0, 0, 0]], np.float32)
    got = qk_int8_query(q)
    np.testing.assert_allclose(got[0] * 127, [127, -64, 32, 0], rtol=1e-6)  # -63.5 to even: -64; 31.75: 32
    assert not got[1].any() and np.isnan(got[2:]).all()
    assert AttentionSpec(batch=1, heads=2, seq_q=1, head_dim=64, layout="kvcache", kv_dtype="int8",
                         qk_int8=True).short_name().endswith("kvi8_qk8_full")
    with pytest.raises(SpecError, match="qk_int8 rounds q to int8.*kv_dtype='int8'"):
        AttentionSpec(batch=1, heads=2, seq_q=1, head_dim=64, layout="kvcache", kv_dtype="float8_e4m3fn", qk_int8=True)
    cuda = AttentionSpec(batch=1, heads=2, seq_q=1, head_dim=64, layout="kvcache", dtype="float16", kv_dtype="int8",
                         qk_int8=True)
    assert "does not round q to int8 (qk_int8)" in cuda_fused.CAPABILITIES.refusal(cuda)
    from tvm_attention import logs, tvm_internals  # a tuning log naming the int8 dot product registers it
    from tvm_attention.schedules import cpu_fused
    from tvm_attention.schedules._knobs import KnobError
    from tvm_attention.target import resolve_target

    logs._register_intrinsics('{"intrin": "attn_decode_i8dot_d192_r4"}')
    assert tvm_internals.tensor_intrin_registered("attn_decode_i8dot_d192_r4")
    plain = dataclasses.replace(cuda, dtype="float32", qk_int8=False)
    with pytest.raises(KnobError, match="decode_dot=3 needs qk_int8"):
        cpu_fused.check(dataclasses.replace(cpu_fused.preset(plain, resolve_target("llvm")), decode_dot=3), plain,
                        resolve_target("llvm"))


def test_qk_int8_cli_flag():
    """``--qk-int8`` reaches the spec, and without an int8 cache it is refused by name."""
    import argparse

    from tvm_attention.cli import _add_spec_flags, _spec_from_args

    p = argparse.ArgumentParser()
    _add_spec_flags(p)
    flags = ["--layout", "kvcache", "--heads", "8", "--head-dim", "64", "--qk-int8"]
    assert _spec_from_args(p.parse_args(flags + ["--kv-dtype", "int8"])).qk_int8
    assert not _spec_from_args(p.parse_args(flags[:-1] + ["--kv-dtype", "int8"])).qk_int8
    with pytest.raises(SpecError, match="qk_int8"):
        _spec_from_args(p.parse_args(flags))


#: qk_int8: both cache layouts, every query dtype, split-KV and not, append (kvcache: APPENDING's
#: int8 cache with split-KV), lse, the int8 dot products (the preset, decode_dot 3) and the float32
#: products (0), GQA and MHA, the variants
QK_INT8 = {  # name: (spec, knobs)
    "kvcache_int8_qk8_split_append": (dict(layout="kvcache", batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300,
                                           head_dim=64, causal=True, dtype="float32", return_lse=True, append=True),
                                      ()),
    "paged_bf16_append": (dict(layout="paged", batch=1, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64,
                               causal=True, dtype="bfloat16", append=True), (("split_tasks", 0),)),
    "kvcache_f16_fma": (dict(layout="kvcache", batch=2, heads=4, kv_heads=4, seq_q=1, seq_kv=200, head_dim=64,
                             causal=True, dtype="float16"), (("decode_dot", 0),)),
    # the variants: s_q scales the scores before the softcap, ALiBi and the window's mask. Without
    # split-KV: with the sinks it made the build 2.5 times as long (the variants beside split-KV:
    # test_variants.py's paged_all; qk_int8 beside split-KV: the kvcache entry above)
    "paged_f32_variants": (dict(layout="paged", batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64,
                                causal=True, dtype="float32", window=(100, 0), softcap=30.0, alibi=True, sinks=True,
                                return_lse=True), (("split_tasks", 0),)),
}


@pytest.mark.parametrize("name", list(QK_INT8))
def test_qk_int8_matches_its_reference_and_says_what_it_moves(name):
    """``qk_int8`` kernels (the prefill chunks' nests with the integers as float32 products, the
    decode nests on int8 dot products where the CPU has them: ``decode_dot`` 3, ``vpdpbusd`` on
    ``k + 128``, the ``128·Σq_i`` taken off the scores; else float32) match the reference
    that rounds q the same way, within the dtype's tolerance; the validation (and so the
    manifest) records how far the rounding moves the output from the unrounded reference. A
    row whose q holds NaN is NaN."""
    from tvm_attention.target import resolve_target, target_features

    kw, knobs = QK_INT8[name]
    spec = AttentionSpec(kv_dtype="int8", qk_int8=True, **kw)
    b = built(spec, knobs=knobs)
    assert b.audit.fused, b.audit
    if spec.dtype == "float32" and "avx512vnni" in target_features(resolve_target("llvm")):  # the preset: vpdpbusd
        assert b.knobs.decode_dot == 3 and "vpdpbusd" in b.module.inspect_source("asm"), b.knobs
    r = validate_built(b)
    assert r.passed and r.finite, r
    assert 1e-4 < r.model_error < 0.05, r.model_error  # the rounding is real, and small
    assert r.to_dict()["model_error"] == r.model_error
    lay = spec.layout_info
    case = {"seq_q": 1, "cache_seqlens": [7] * spec.batch, "max_len": 300}
    x = lay.random_inputs(spec, case, seed=3)
    x["q"][0, 1, 0, 5] = np.nan
    got = kernel_of(b)(*x.values())
    o = np.asarray(got[0] if spec.return_lse else got).astype(np.float32)
    assert np.isnan(o[0, 1]).all() and np.isfinite(np.delete(o.reshape(-1, spec.head_dim), 1, axis=0)).all()


def test_qk_int8_avx2_form_matches_its_reference():
    """``decode_dot`` 3 on AVX2 vectors (a Zen 3's code: no VNNI, no bf16 dots; it runs on every
    host seen) is ``vpmaddubsw``'s sign trick on the signed bytes, no unsigned keys: the same
    answers as its reference, and the preset there."""
    from tvm_attention.build import build_kernel
    from tvm_attention.schedules import cpu_fused
    from tvm_attention.target import resolve_target

    avx2 = resolve_target({"kind": "llvm", "mcpu": "x86-64-v3"})
    spec = AttentionSpec(layout="paged", batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64, causal=True,
                         dtype="float32", kv_dtype="int8", qk_int8=True, return_lse=True)
    assert cpu_fused.preset(spec, avx2).decode_dot == 3
    # without split-KV (half the build): the split nests' AVX2 form is every qk_int8 kernel's on an
    # AVX2 host (QK_INT8's kvcache entry splits), and this one is the only AVX2 code an AVX-512 host builds
    b = build_kernel(spec, target=avx2, knobs={"split_tasks": 0})
    asm = b.module.inspect_source("asm")
    assert "vpmaddubsw" in asm and "vpdpbusd" not in asm and "zmm" not in asm
    r = validate_built(b)
    assert r.passed and r.finite, r


def test_a_large_bhsd_spec_with_an_8bit_cache_validates_on_sampled_rows():
    """Past ``FULL_CHECK_LIMIT`` validation compares sampled rows with the reference; those rows
    must be of the values the cache holds (scales applied, q rounded with ``qk_int8``), as the
    full reference's are. The sampled path read the stored bytes unscaled and failed them all."""
    spec = AttentionSpec(batch=1, heads=16, kv_heads=4, seq_q=1100, head_dim=64, causal=True, kv_dtype="int8",
                         qk_int8=True)
    r = validate_built(built(spec))
    assert "sampled" in r.rows_checked and r.passed and r.finite, r
    assert 1e-4 < r.model_error < 0.05, r.model_error
