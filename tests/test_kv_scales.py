"""Finer scales of an 8-bit K/V cache (``AttentionSpec.kv_scale``, issue 42 item 3): one scale per
(token, kv head) and one per 32 elements of head_dim, besides one per kv head. ``quantize_kv``
(NumPy and torch, bit for bit), the spec and the CLI, the kernels against the float64 reference in
every layout (the validation poisons every scale a kernel must not read with NaN), the append that
writes the new keys' own scales bit for bit, a bad scale as data (its rows NaN), the loader's
shape check, the families that refuse them by name, and what finer scales buy on a cache with
outliers."""
from __future__ import annotations

import argparse
import re

import numpy as np
import pytest

from tvm_attention import quantize_kv
from tvm_attention.artifact import kernel_of, validate_built
from tvm_attention.quant import KV_SCALES, QMAX, dequantize, scale_shape
from tvm_attention.spec import KV_DTYPES, AttentionSpec, SpecError

from conftest import built


def _outlier_cache(seed=0, shape=(2, 4, 64, 64)):
    """K/V-like data with what finer scales are for: one token 30x louder than the rest (an
    attention sink's key) and one channel 10x louder (a rotary dimension's)."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x[:, :, 3] *= 30
    x[..., 5] *= 10
    return x


def test_quantize_kv_finer_scales_numpy_and_torch():
    x = _outlier_cache()
    for name in KV_DTYPES:
        errs = {}
        for g in KV_SCALES:
            q, s = quantize_kv(x, name, granularity=g)
            assert s.shape == scale_shape(x.shape, 1, g) and s.dtype == np.float32 and (s > 0).all()
            assert s.shape == {"head": (4,), "token": (2, 4, 64), "group": (2, 4, 64, 2)}[g]
            per = q.astype(np.float32).reshape(*s.shape, -1) if g != "head" else None
            if per is not None:  # each token's (group's) largest magnitude lands on QMAX
                np.testing.assert_allclose(np.abs(per).max(-1), QMAX[name])
            errs[g] = np.abs(dequantize(q, s, 1, g) - x).mean()
        # finer scales follow the outliers: int8's quiet tokens keep their precision (a float8
        # element's error is relative to itself, whatever the scale, short of the subnormals)
        if name == "int8":
            assert errs["token"] < 0.5 * errs["head"] and errs["group"] < errs["token"], errs
        else:
            assert errs["group"] <= errs["token"] <= errs["head"] * 1.01, (name, errs)
    # a page pool (pages, page_size, KH, D): per token (pages, page_size, KH), whatever head_axis says
    pool = x.reshape(8, 16, 4, 64)
    q, s = quantize_kv(pool, "int8", head_axis=2, granularity="group")
    assert s.shape == (8, 16, 4, 2)
    np.testing.assert_array_equal(dequantize(q, s, 2, "group"), dequantize(*quantize_kv(x, "int8", granularity="group"),
                                                                          1, "group").reshape(8, 16, 4, 64))
    # a zero token takes scale 1; a given scale is used as it is
    z = np.zeros((1, 1, 2, 64), np.float32)
    assert (quantize_kv(z, "int8", granularity="token")[1] == 1).all()
    q, s = quantize_kv(x[:1, :1, :2], "int8", granularity="token", scale=np.full((1, 1, 2), 0.5, np.float32))
    assert (s == 0.5).all() and (q == np.rint(np.clip(x[:1, :1, :2] / 0.5, -127, 127))).all()
    with pytest.raises(SpecError, match=r"expected shape \(1, 1, 2\)"):
        quantize_kv(x[:1, :1, :2], "int8", granularity="token", scale=np.ones(1, np.float32))
    with pytest.raises(SpecError, match="not a multiple of 32"):
        quantize_kv(x[..., :48], "int8", granularity="group")
    with pytest.raises(SpecError, match="granularity 'channel'"):
        quantize_kv(x, "int8", granularity="channel")
    torch = pytest.importorskip("torch")
    for name in KV_DTYPES:
        for g in ("token", "group"):
            tq, ts = quantize_kv(torch.from_numpy(x), name, granularity=g)
            nq, ns = quantize_kv(x, name, granularity=g)
            np.testing.assert_array_equal(ts.numpy(), ns)
            np.testing.assert_array_equal(tq.to(torch.float32).numpy(), nq.astype(np.float32))


def test_spec_and_cli():
    from tvm_attention.cli import _add_spec_flags, _spec_from_args

    kw = dict(batch=1, heads=4, kv_heads=2, seq_q=1, seq_kv=64, head_dim=64, layout="paged", kv_dtype="int8")
    s = AttentionSpec(**kw, kv_scale="token")
    assert "_kvi8_stok_" in s.short_name() and s.scale_groups == 1
    assert AttentionSpec.from_dict(s.to_dict()) == s and "kv_scale" not in AttentionSpec(**kw).to_dict()
    args = {a["name"]: a for a in s.arg_specs()}
    assert args["k_scale"]["shape"] == ["num_pages", 16, 2] and args["v_scale"]["dtype"] == "float32"
    g = AttentionSpec(**{**kw, "layout": "kvcache"}, kv_scale="group")
    assert "_sg32" in g.short_name() and {a["name"]: a for a in g.arg_specs()}["k_scale"]["shape"] == [
        "batch", 2, "max_len", 2]
    assert g.io_bytes() == AttentionSpec(**{**kw, "layout": "kvcache"}).io_bytes() + 2 * 2 * 64 * 2 * 4
    with pytest.raises(SpecError, match="needs kv_dtype"):
        AttentionSpec(**{**kw, "kv_dtype": None}, kv_scale="token")
    with pytest.raises(SpecError, match="head_dim=48 is not a multiple of 32"):
        AttentionSpec(**{**kw, "head_dim": 48}, kv_scale="group")
    with pytest.raises(SpecError, match="kv_scale='row'"):
        AttentionSpec(**kw, kv_scale="row")
    p = argparse.ArgumentParser()
    _add_spec_flags(p)
    flags = ["--layout", "kvcache", "--heads", "8", "--head-dim", "64", "--kv-dtype", "int8"]
    assert _spec_from_args(p.parse_args(flags + ["--kv-scale", "group"])).kv_scale == "group"
    assert _spec_from_args(p.parse_args(flags)).kv_scale == "head"


#: name -> (spec fields, knobs): each layout; every dot-product form a finer scale meets (QKᵀ on
#: bf16 dots, PV on them with P times the value scale rounded, int8 dots with qk_int8; per group the
#: float32 products, or with qk_int8 one int8 dot product per group); split-KV and not (per token:
#: paged_token_qk8_variants_lse, per group: kvcache_group_f16_qk8_mha; the others without it, half
#: a build's time); the prefill nests (seq_q 4 and 37 of the validation cases) and the decode
#: nests; append; lse and the variants. The three appending kernels are
#: test_append_writes_each_new_keys_scales's too (the new keys written first, then the same nests)
GQA = dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64, causal=True)
KERNELS = {
    "kvcache_token_bf16_pv_dots_append": (dict(GQA, layout="kvcache", dtype="bfloat16", kv_dtype="float8_e5m2",
                                               kv_scale="token", append=True), (("decode_dot", 2), ("split_tasks", 0))),
    # the variants beside qk_int8, lse and split-KV: one build (the scale loads, and their NaN for
    # a bad scale, are one macro whichever product form reads them: workloads.fused._scale_macro)
    "paged_token_qk8_variants_lse": (dict(GQA, layout="paged", kv_dtype="int8", kv_scale="token", qk_int8=True,
                                          return_lse=True, window=(100, 0), softcap=30.0, alibi=True, sinks=True), ()),
    # MHA: one row per kv head, the per-group dot product's one-row form
    "kvcache_group_f16_qk8_mha": (dict(GQA, heads=4, kv_heads=4, layout="kvcache", dtype="float16", kv_dtype="int8",
                                       kv_scale="group", qk_int8=True), ()),
    "paged_group_qk8_append": (dict(GQA, layout="paged", dtype="bfloat16", kv_dtype="int8", kv_scale="group",
                                    qk_int8=True, append=True, return_lse=True), (("split_tasks", 0),)),
    "paged_group_e4m3_bf16_append": (dict(GQA, layout="paged", dtype="bfloat16", kv_dtype="float8_e4m3fn",
                                          kv_scale="group", append=True), (("split_tasks", 0),)),
    "bhsd_token_e4m3": (dict(batch=1, heads=2, seq_q=70, seq_kv=45, head_dim=64, kv_dtype="float8_e4m3fn",
                             causal=True, kv_scale="token"), ()),
    "varlen_group_e5m2": (dict(batch=2, heads=4, kv_heads=2, seq_q=40, seq_kv=40, head_dim=64, layout="varlen",
                               kv_dtype="float8_e5m2", kv_scale="group"), ()),
}


def kernel_build(name):
    """``(spec, knobs, build)`` of a KERNELS entry (one build each, whichever test asks first)."""
    from tvm_attention.target import resolve_target, target_features

    kw, knobs = KERNELS[name]
    if "avx512bf16" not in target_features(resolve_target("llvm")):  # PV on bf16 dots: AVX512-BF16 only
        knobs = tuple((n, v) for n, v in knobs if n != "decode_dot")
    spec = AttentionSpec(**kw)
    return spec, knobs, built(spec, knobs=knobs or None)


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matches_the_reference(name):
    """Every validation case of a cache layout holds NaN in the scales past each sequence's
    length and in spare pages (``Layout._poison_unused_scales``): a kernel that read one would
    fail with NaN rows."""
    from tvm_attention.target import resolve_target, target_features

    spec, knobs, b = kernel_build(name)
    assert b.audit.fused, b.audit
    if "decode_dot" in dict(knobs):
        assert b.knobs.decode_dot == dict(knobs)["decode_dot"]
    if spec.kv_scale == "group" and spec.qk_int8 and spec.layout != "varlen":
        # one int8 dot product per (key, group), 32 bytes: VNNI's vpdpbusd on a ymm where the host
        # has AVX512-VNNI and AVX512-VL, else AVX2's form (test_group_dots_avx2_form)
        asm = b.module.inspect_source("asm")
        vnni = {"avx512vnni", "avx512vl"} <= target_features(resolve_target("llvm"))
        assert b.knobs.decode_dot == 3, b.knobs
        assert (re.search(r"vpdpbusd\s[^\n]*ymm", asm) and "vpmaddubsw" not in asm) if vnni else "vpmaddubsw" in asm
    r = validate_built(b)
    assert r.passed and r.finite, r


def test_group_dots_avx2_form():
    """Per-group int8 dot products on AVX2 vectors (a Zen 3's code, runnable on every host seen):
    ``vpmaddubsw``'s sign trick, no VNNI, no zmm; the same answers as the reference."""
    from tvm_attention.build import build_kernel
    from tvm_attention.target import resolve_target

    spec = AttentionSpec(**dict(GQA, layout="kvcache", dtype="bfloat16", kv_dtype="int8", kv_scale="group",
                                qk_int8=True))
    # without split-KV (half the build): the split nests' AVX2 form is every group kernel's on an
    # AVX2 host (KERNELS' kvcache_group_f16_qk8_mha splits), and this one is the only AVX2 code an
    # AVX-512 host builds
    b = build_kernel(spec, target=resolve_target({"kind": "llvm", "mcpu": "x86-64-v3"}), knobs={"split_tasks": 0})
    asm = b.module.inspect_source("asm")
    assert b.knobs.decode_dot == 3 and "vpmaddubsw" in asm and "vpdpbusd" not in asm and "zmm" not in asm
    r = validate_built(b)
    assert r.passed and r.finite, r


#: the appending kernels of KERNELS: kvcache and paged, per token and per group, int8 and both
#: float8 dtypes, bf16 queries (the dot products where the CPU has them) and float32 ones
APPENDING = [name for name, (kw, _) in KERNELS.items() if kw.get("append")]


@pytest.mark.parametrize("name", APPENDING)
def test_append_writes_each_new_keys_scales(name):
    """An appending kernel quantizes each new key with its own scales, computed from it in
    float32 as ``quantize_kv`` does, and writes keys and scales bit for bit where the reference
    does (across a page, from an empty sequence); it touches no other scale. (Built without
    split-KV: what appending adds comes before any nest; test_kv8.py appends beside split-KV.
    test_kernel_matches_the_reference validates each build.)"""
    spec, _, b = kernel_build(name)
    lay, k = spec.layout_info, kernel_of(b)
    case = {"seq_q": 4, "cache_seqlens": [0, 15]}
    if spec.layout == "kvcache":
        case["max_len"] = 40
    x = lay.random_inputs(spec, case, seed=9)
    x["k_new"][0, 0, 1, :2] = [6e4, 1e-3]  # a loud token: its own scale, the cache's others unchanged
    x["k_new"][1, 1, 2] = 0  # a zero token: scale 1
    want = lay.appended(spec, x)
    out = k(*x.values())
    for n in lay.kv_names + ("k_scale", "v_scale"):
        np.testing.assert_array_equal(x[n].view(np.uint8), want[n].view(np.uint8), err_msg=n)
    ks = x["k_scale"]
    assert np.isnan(ks).sum() < np.isnan(lay.random_inputs(spec, case, seed=9)["k_scale"]).sum()
    o = out[0] if spec.return_lse else out
    ref = lay.reference(spec, x)
    np.testing.assert_allclose(np.asarray(o).astype(np.float64), ref, atol=2e-2, rtol=2e-2)


def test_exported_library_takes_them(tmp_path):
    """The product path: an exported per-token build, loaded by the loader, its manifest naming
    the scales' shapes; called with NumPy and with torch tensors."""
    import json

    from tvm_attention.artifact import export
    from tvm_attention.loader import load

    spec, _, b = kernel_build("paged_token_qk8_variants_lse")
    export(b, tmp_path, validate_built(b))
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["spec"]["kv_scale"] == "token"
    assert {a["name"]: a["shape"] for a in m["args"]}["v_scale"] == ["num_pages", spec.page_size, spec.kv_heads]
    k = load(tmp_path)
    lay = spec.layout_info
    x = lay.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [37, 200]}, seed=5)
    ref, ref_lse = lay.reference_outputs(spec, x)
    o, lse = k(*x.values())
    np.testing.assert_allclose(o, ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)
    torch = pytest.importorskip("torch")
    o, _ = k(*(torch.from_numpy(a) for a in x.values()))
    np.testing.assert_allclose(o.numpy(), ref, atol=1e-4, rtol=1e-4)


def test_a_bad_scale_is_data():
    """A per-token scale that is not a positive finite number makes the rows that see its key
    NaN (a NaN key does the same); one past the sequence's length, or hidden by the window, is
    never read; the loader checks the scales' shape by name."""
    from tvm_attention.loader import KernelArgumentError

    spec, _, b = kernel_build("paged_token_qk8_variants_lse")
    lay, k = spec.layout_info, kernel_of(b)
    x = lay.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [250, 40]}, seed=4)
    good = np.asarray(k(*x.values())[0]).astype(np.float64)
    np.testing.assert_allclose(good, lay.reference(spec, x), atol=1e-4, rtol=1e-4)
    table, p = x["block_table"], spec.page_size
    for bad in (0.0, -1.0, np.inf, np.nan):
        y = {n: a.copy() for n, a in x.items()}
        y["k_scale"][table[1, 37 // p], 37 % p, 1] = bad  # sequence 1, key 37, kv head 1: seen by its rows
        # sequence 0, key 3: in a key tile the window (its last 100 of 250 keys) skips
        y["v_scale"][table[0, 3 // p], 3 % p, 0] = bad
        o = np.asarray(k(*y.values())[0]).astype(np.float64)
        assert np.isnan(o[1, 4:]).all(), bad  # kv head 1's query heads of sequence 1
        np.testing.assert_array_equal(o[0], good[0])
        np.testing.assert_array_equal(o[1, :4], good[1, :4])
    with pytest.raises(KernelArgumentError, match="k_scale"):
        k(*(a if n != "k_scale" else np.ones(2, np.float32) for n, a in x.items()))


def test_families_that_read_only_per_head_scales_refuse_finer_ones_by_name():
    from tvm_attention.schedules import check, get_schedule
    from tvm_attention.schedules._knobs import KnobError
    from tvm_attention.target import resolve_target

    spec = AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=1, seq_kv=256, head_dim=64, layout="paged", causal=True,
                         dtype="float16", kv_dtype="float8_e4m3fn", kv_scale="token")
    t = resolve_target("cuda", arch="sm_90")
    fam = get_schedule("fused", t)
    with pytest.raises(KnobError, match="scales per head, not per token"):
        check(fam, fam.preset(spec, t), spec, t)
    # the CPU family keeps per-group scales off the dot products, by name
    cpu = resolve_target("llvm")
    fam = get_schedule("fused", cpu)
    g = AttentionSpec(**{**spec.to_dict(), "dtype": "bfloat16", "kv_scale": "group"})
    knobs = fam.preset(g, cpu)
    assert knobs.decode_dot == 0
    import dataclasses

    with pytest.raises(KnobError, match="kv_scale"):
        check(fam, dataclasses.replace(knobs, decode_dot=1), g, cpu)


def test_kv_accuracy_report(tmp_path, monkeypatch):
    """``bench --kv-accuracy``'s numbers are real: our kernel is the model (the float64 reference
    over the values the cache holds) to float32 rounding, and on a cache with outliers int8's
    finer scales halve the error of one scale per kv head."""
    import dataclasses

    from tvm_attention import build
    from tvm_attention.bench import kv_accuracy

    # its kernels through the run's build cache (conftest ``built``), without split-KV (half of each
    # build): what is checked is the report, and its step's 256 keys are one split-KV chunk anyway
    # (the split nests with finer scales: KERNELS'; with per-head scales: test_kv8.py's)
    asked = []

    def build_kernel(spec, knobs=None, cache=True):  # (always through the build cache)
        asked.append(spec.kv_scale)
        return built(spec, knobs=tuple(sorted({**(knobs or {}), "split_tasks": 0}.items())))

    monkeypatch.setattr(build, "build_kernel", build_kernel)  # kv_accuracy.run imports it when it runs
    cfg = dataclasses.replace(kv_accuracy.quick_config(), dtypes=("int8",))
    report = kv_accuracy.run(cfg, say=lambda m: None)
    assert sorted(asked) == sorted(KV_SCALES)
    rows = {r["kv_scale"]: r for r in report["rows"]}
    assert set(rows) == set(KV_SCALES)
    for r in rows.values():
        assert r["kernel_vs_model_max"] < 1e-4 and r["kernel_max"] == pytest.approx(r["model_max"], rel=1e-3)
    assert rows["token"]["model_rms"] < 0.6 * rows["head"]["model_rms"]
    assert rows["group"]["model_rms"] < rows["token"]["model_rms"]
    assert rows["group"]["bytes_per_element"] == 1.125 and rows["head"]["bytes_per_element"] == 1
    paths = kv_accuracy.write(report, tmp_path)
    assert "| int8 | per token | 1.0625 |" in paths["md"].read_text()


def test_decode_bench_entries_and_paged_scales():
    from tvm_attention.bench import decode
    from tvm_attention.layouts import paged_from_contiguous

    assert decode.entry("int8_qk8_group") == ("int8", True, "group")
    assert decode.entry("float8_e4m3fn_token") == ("float8_e4m3fn", False, "token")
    assert decode.entry("bfloat16") == ("bfloat16", False, "head") and decode.cache_dtype("int8_qk8") == "int8"
    x = _outlier_cache(shape=(2, 3, 40, 64))
    _, table = paged_from_contiguous(x, 16, np.random.default_rng(1))
    for g in ("token", "group"):
        s = quantize_kv(x, "int8", granularity=g)[1]
        pages = decode.paged_scales(s, g, 16)
        j = np.arange(40)
        for b in range(2):  # key j of sequence b: row j % 16 of page table[b, j // 16]
            np.testing.assert_array_equal(pages[table[b, j // 16], j % 16].swapaxes(0, 1), s[b])
