"""KV-cache decode (issue 10): the kvcache and paged layouts, GQA packing, split-KV with its
merge, the LSE output and merge_states."""
import dataclasses
import functools
import importlib.util
import json

import numpy as np
import pytest

from tvm_attention import cli, merge_states
from tvm_attention.artifact import export, kernel_of, validate_built
from tvm_attention.layouts import LAYOUTS, paged_from_contiguous
from tvm_attention.loader import KernelArgumentError, load
from tvm_attention.reference import reference_attention
from tvm_attention.spec import AttentionSpec, SpecError

from conftest import built

KVCACHE, PAGED = LAYOUTS["kvcache"], LAYOUTS["paged"]
TOL = dict(atol=1e-4, rtol=1e-4)


def spec_of(layout, heads=8, kv_heads=2, causal=True, lse=True, batch=2, seq_kv=256, **kw):
    return AttentionSpec(batch=batch, heads=heads, kv_heads=kv_heads, seq_q=1, seq_kv=seq_kv, head_dim=64,
                         causal=causal, layout=layout, return_lse=lse, **kw)


# name -> (layout, heads, kv_heads, causal, knobs[, other spec fields]): GQA, MQA and MHA, both
# layouts, split-KV and not (split_tasks=0 never splits: kvcache GQA and paged MHA; the others
# split, MQA's kvcache one the split-KV test below compares with its unsplit build)
CONFIGS = {
    "kvcache_gqa_causal_nosplit": ("kvcache", 8, 2, True, (("split_tasks", 0),)),
    "paged_gqa_causal": ("paged", 8, 2, True, None),
    "kvcache_mqa_full": ("kvcache", 4, 1, False, None),
    "paged_mha_causal_nosplit": ("paged", 4, 4, True, (("split_tasks", 0),)),
    # the paged preset takes every kv head per task (the page order, in the paged GQA config
    # above); one head per task, with a software prefetch two key tiles ahead, is the other end
    # of the decode space. Batch 1 at 4 kv heads, 300 keys: the representative step (and this
    # very build) of test_page_order_and_prefetch_are_points_of_the_decode_space, whose tasks
    # test_split_count_and_page_order_are_tasks_of_a_kvcache_step reads too; 4 tasks of one head
    # are fewer than split_tasks, so one sequence's keys are split ("one_long" below)
    "paged_per_head_prefetch": ("paged", 8, 4, True, (("decode_heads", 1), ("prefetch", 2)), dict(batch=1, seq_kv=300)),
}


def config_spec(name):
    layout, h, kh, causal, _, *fields = CONFIGS[name]
    return spec_of(layout, h, kh, causal, **(fields[0] if fields else {}))


def config_build(name):
    """The config's build (conftest ``built``: one per run, whichever test asks first)."""
    return built(config_spec(name), knobs=CONFIGS[name][4])


@pytest.fixture(scope="module", params=list(CONFIGS))
def kernel(request):
    from tvm_attention.schedules import cpu_fused
    from tvm_attention.target import resolve_target

    spec, knobs = config_spec(request.param), CONFIGS[request.param][4]
    target = resolve_target("llvm")
    if dict(knobs or ()).get("prefetch") and not cpu_fused.stages_decode(spec, cpu_fused.preset(spec, target)):
        pytest.skip("the prefetch is a knob of the staged (dot-product) decode nest, which needs avx512f: "
                    "this target's decode nest is one vector of rows")
    b = config_build(request.param)
    assert b.audit.fused, b.audit.reasons
    return spec, kernel_of(b), knobs


#: cache_seqlens mixes: empty, one key, page edges (16), tile edges (64), lengths that are no
#: multiple of anything, a prefix shorter than the new tokens (causal rows with no key)
LENGTHS = {
    "mixed": [0, 1, 15, 16, 17, 63, 65, 129, 3],
    "one_long": [1000],  # batch 1: few (batch, kv head) tiles, so the key range is split
    "two": [333, 2],
    "all_empty": [0, 0],
}


def call(spec, kernel, x):
    names = [a.name for a in spec.layout_info.index_args]
    return kernel(*(x[n] for n in ("q",) + tuple(a.name for a in spec.layout_info.inputs[1:3])),
                  **{n: x[n] for n in names})


@pytest.mark.parametrize("seq_q", [1, 4])
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_matches_the_reference(kernel, seq_q, lengths):
    spec, k, _ = kernel
    lens = LENGTHS[lengths]
    case = {"seq_q": seq_q, "cache_seqlens": lens, "max_len": max(lens + [1]) + 5}
    if spec.layout == "paged":
        case = {"seq_q": seq_q, "cache_seqlens": lens, "shared_prefix": lengths == "mixed"}
    x = spec.layout_info.random_inputs(spec, case, seed=len(lens) + seq_q)
    o, lse = call(spec, k, x)
    ref, ref_lse = spec.layout_info.reference_outputs(spec, x)
    np.testing.assert_allclose(o, ref, **TOL)
    # lse: -inf exactly for rows that see no key, else the reference's log-sum-exp
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
    seen = ~np.isneginf(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], **TOL)
    for b, n in enumerate(lens):  # a sequence with an empty cache outputs exact zeros
        if n == 0:
            assert not o[b].any()


def test_paged_equals_contiguous_on_the_same_keys():
    # the fixture's builds (no cache here is long enough to split: both compute each row whole)
    kc, kp = kernel_of(config_build("kvcache_gqa_causal_nosplit")), kernel_of(config_build("paged_gqa_causal"))
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 8, 1, 64), dtype=np.float32)
    k = rng.standard_normal((3, 2, 100, 64), dtype=np.float32)
    v = rng.standard_normal((3, 2, 100, 64), dtype=np.float32)
    lens = np.array([100, 37, 64], np.int32)
    kpages, table = paged_from_contiguous(k, 16, np.random.default_rng(2))
    vpages, vtable = paged_from_contiguous(v, 16, np.random.default_rng(2))  # same seed: same pages
    np.testing.assert_array_equal(table, vtable)
    a, lse_a = kc(q, k, v, cache_seqlens=lens)
    b, lse_b = kp(q, kpages, vpages, block_table=table, cache_seqlens=lens)
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(lse_a, lse_b, atol=1e-6, rtol=1e-6)


def test_split_and_unsplit_agree():
    """One long sequence (batch 1): the split-KV path and the never-split build give the same
    output and lse."""
    spec = spec_of("kvcache", 4, 1, causal=False)  # the fixture's MQA build
    split, whole = kernel_of(built(spec)), kernel_of(built(spec, knobs=(("split_tasks", 0),)))
    assert built(spec).knobs.split_tasks > 0
    assert f'"attn.split_tasks": {built(spec).knobs.split_tasks}' in built(spec).lowered.script()
    assert '"attn.split_tasks": 0' in built(spec, knobs=(("split_tasks", 0),)).lowered.script()
    x = KVCACHE.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [3000], "max_len": 3000}, seed=5)
    (o1, l1), (o2, l2) = call(spec, split, x), call(spec, whole, x)
    np.testing.assert_allclose(o1, o2, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(l1, l2, atol=1e-5, rtol=1e-5)


def test_merge_states_of_two_halves_of_a_key_range():
    """Cascade attention: the kernel on keys [0, 700) and on [700, 1500) separately, merged,
    equals the reference on all 1500."""
    spec = spec_of("kvcache", 4, 1, causal=False)  # the fixture's MQA build (no causal mask: halves of one range)
    k = kernel_of(built(spec))
    x = KVCACHE.random_inputs(spec, {"seq_q": 4, "cache_seqlens": [1500, 1500], "max_len": 1500}, seed=7)
    q, kc, vc = x["q"], x["k_cache"], x["v_cache"]
    cut = 700
    oa, la = k(q, np.ascontiguousarray(kc[:, :, :cut]), np.ascontiguousarray(vc[:, :, :cut]),
               cache_seqlens=np.full(2, cut, np.int32))
    ob, lb = k(q, np.ascontiguousarray(kc[:, :, cut:]), np.ascontiguousarray(vc[:, :, cut:]),
               cache_seqlens=np.full(2, 1500 - cut, np.int32))
    o, lse = merge_states(oa, la, ob, lb)
    ref, ref_lse = reference_attention(spec, q, kc, vc, return_lse=True)
    np.testing.assert_allclose(o, ref, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    # an empty side contributes nothing; two empty sides give zeros and -inf; NaN stays NaN
    empty = np.full_like(la, -np.inf)
    o2, l2 = merge_states(oa, la, np.zeros_like(ob), empty)
    np.testing.assert_array_equal(o2, oa)
    o3, l3 = merge_states(np.zeros_like(oa), empty, np.zeros_like(ob), empty)
    assert not o3.any() and np.isneginf(l3).all()
    la[0, 0, 0] = np.nan
    o4, l4 = merge_states(oa, la, ob, lb)
    assert np.isnan(o4[0, 0, 0]).all() and np.isnan(l4[0, 0, 0]) and np.isfinite(o4[1]).all()
    with pytest.raises(ValueError, match="lse_b: expected shape"):
        merge_states(oa, la, ob, lb[..., :2])


@pytest.fixture(scope="module")
def paged_artifact(tmp_path_factory):
    spec = spec_of("paged")
    b = built(spec)
    out = tmp_path_factory.mktemp("paged")
    export(b, out, validate_built(b))
    return spec, out


def test_manifest_and_loader_keywords(paged_artifact):
    spec, out = paged_artifact
    m = json.loads((out / "manifest.json").read_text())
    assert m["layout"] == "paged" and m["audit"]["verdict"] == "fused"
    assert [a["name"] for a in m["args"]] == ["q", "k_pages", "v_pages", "block_table", "cache_seqlens", "o", "lse"]
    assert m["args"][1]["shape"] == ["num_pages", 16, 2, 64]
    kernel = load(out)
    x = PAGED.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [20, 5]}, seed=1)
    ref = PAGED.reference(spec, x)
    np.testing.assert_allclose(kernel(x["q"], x["k_pages"], x["v_pages"], block_table=x["block_table"],
                                      cache_seqlens=x["cache_seqlens"])[0], ref, **TOL)
    # positional index arrays, in the manifest's order, work too
    np.testing.assert_allclose(kernel(x["q"], x["k_pages"], x["v_pages"], x["block_table"], x["cache_seqlens"])[0],
                               ref, **TOL)


def _bad(x, **change):
    y = {k: v.copy() for k, v in x.items()}
    y.update(change)
    return y


def test_bad_inputs_are_rejected(paged_artifact):
    spec, out = paged_artifact
    kernel = load(out)
    x = PAGED.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [20, 5]}, seed=1)

    def run(y):
        return kernel(y["q"], y["k_pages"], y["v_pages"], block_table=y["block_table"], cache_seqlens=y["cache_seqlens"])

    table = x["block_table"].copy()
    table[0, 1] = x["k_pages"].shape[0]  # one past the pool
    with pytest.raises(KernelArgumentError, match=r"block_table\[0, 1\]=.* is not a page"):
        run(_bad(x, block_table=table))
    table[0, 1] = -1
    with pytest.raises(KernelArgumentError, match=r"block_table\[0, 1\]=-1 is not a page"):
        run(_bad(x, block_table=table))
    with pytest.raises(KernelArgumentError, match=r"cache_seqlens\[1\]=33 exceeds the cache"):
        run(_bad(x, cache_seqlens=np.array([20, 33], np.int32)))  # 2 pages of 16 per sequence
    with pytest.raises(KernelArgumentError, match=r"cache_seqlens\[0\]=-1 is negative"):
        run(_bad(x, cache_seqlens=np.array([-1, 5], np.int32)))
    with pytest.raises(KernelArgumentError, match="cache_seqlens: expected dtype int32"):
        run(_bad(x, cache_seqlens=x["cache_seqlens"].astype(np.int64)))
    with pytest.raises(KernelArgumentError, match="k_pages: expected shape"):
        run(_bad(x, k_pages=np.zeros((4, 8, 2, 64), np.float32)))  # page_size 8, built for 16
    with pytest.raises(KernelArgumentError, match=r"cache_seqlens: dim 0 \(batch\) is 3"):
        run(_bad(x, cache_seqlens=np.array([1, 1, 1], np.int32)))
    with pytest.raises(KernelArgumentError, match="missing cache_seqlens"):
        kernel(x["q"], x["k_pages"], x["v_pages"], block_table=x["block_table"])
    # entries past a sequence's last page are never read, whatever they hold
    table = x["block_table"].copy()
    table[1, 1:] = 10**6
    run(_bad(x, block_table=table))


def test_kvcache_rejects_a_length_past_the_cache():
    spec = config_spec("kvcache_gqa_causal_nosplit")
    k = kernel_of(config_build("kvcache_gqa_causal_nosplit"))
    x = KVCACHE.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [10, 10], "max_len": 10}, seed=0)
    with pytest.raises(KernelArgumentError, match=r"cache_seqlens\[1\]=11 exceeds the cache: max_len=10"):
        k(x["q"], x["k_cache"], x["v_cache"], cache_seqlens=np.array([3, 11], np.int32))
    with pytest.raises(KernelArgumentError, match="causal=False"):
        k(x["q"], x["k_cache"], x["v_cache"], cache_seqlens=x["cache_seqlens"], causal=False)


def test_families_without_lse_say_so():
    from tvm_attention.schedules._knobs import KnobError

    spec = AttentionSpec(batch=1, heads=4, seq_q=64, head_dim=64, return_lse=True)
    for schedule in ("materialized", "rowcache"):
        with pytest.raises(KnobError, match=f"the {schedule} schedule does not write lse"):
            built(spec, schedule)


def test_spec_and_cli(tmp_path, capsys):
    with pytest.raises(SpecError, match="page_size=8 applies to the paged layout only"):
        AttentionSpec(batch=1, heads=4, seq_q=1, head_dim=64, page_size=8)
    assert spec_of("paged").page_size == 16 and spec_of("paged").short_name() == "paged_p16_h8_kv2_d64_float32_causal_lse"
    # the fixture's kvcache_mqa_full spec: the CLI loads that build from the run's build cache
    rc = cli.main(["build", "--layout", "kvcache", "--batch", "2", "--seq-q", "1", "--seq-kv", "256", "--heads", "4",
                   "--kv-heads", "1", "--head-dim", "64", "--return-lse", "--out", str(tmp_path / "kv")])
    text = capsys.readouterr().out
    assert rc == 0 and "validation: PASS" in text
    m = json.loads((tmp_path / "kv" / "manifest.json").read_text())
    assert m["layout"] == "kvcache" and m["spec"]["return_lse"] is True
    assert [a["name"] for a in m["args"]] == ["q", "k_cache", "v_cache", "cache_seqlens", "o", "lse"]
    assert m["args"][-1] == {"name": "lse", "shape": ["batch", 4, "seq_q"], "dtype": "float32"}
    # the other layouts' lse, float32 whatever the dtype (their kernels' lse against the reference:
    # test_variants.py's return_lse builds, bhsd_static_all and varlen_all among them)
    bhsd = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=40, seq_kv=70, head_dim=64, dtype="bfloat16", return_lse=True)
    assert bhsd.arg_specs()[-1] == {"name": "lse", "shape": [2, 4, 40], "dtype": "float32"}
    varlen = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=40, head_dim=64, layout="varlen", return_lse=True)
    assert varlen.arg_specs()[-1] == {"name": "lse", "shape": [4, "total_q"], "dtype": "float32"}


def bench_builds(monkeypatch, module):
    """Route a benchmark's builds (``module.build_kernel``) through the run's build cache (conftest
    ``built``), without split-KV (``split_tasks=0``): these tiny runs check what the benchmark
    builds, runs and reports, never a kernel's speed, and split-KV's nests are half of a decode
    build's time (the kernel tests above validate the split presets; the calls are the same).
    Returns the ``(spec, knobs)`` the benchmark asked for."""
    asked = []

    def build(spec, knobs=None, cache=True):  # (always through the build cache)
        asked.append((spec, knobs))
        return built(spec, knobs=tuple(sorted({**(knobs or {}), "split_tasks": 0}.items())))

    monkeypatch.setattr(module, "build_kernel", build)
    return asked


def test_decode_bench_times_int8_with_qk_int8(monkeypatch):
    """The bench's ``int8_qk8_token`` entry: the int8 cache with ``qk_int8`` and per-token scales,
    its bytes an int8 cache's and the scales', its step against the bf16 one (× bf16) and against
    the same step with per-head scales, alternated with it (``scale_cost``). One layout, no
    append, no peers: the smoke test below covers those."""
    import dataclasses

    from tvm_attention.bench import decode

    # stream_bytes: the roof only has to be measured (its two reads, 256 MiB each in quick_config,
    # took ~2.3 s of this test); nothing here reads its value, and the smoke test below checks
    # the roof's fields
    cfg = dataclasses.replace(decode.quick_config(), dtypes=("bfloat16", decode.QK8 + "_token"),
                              layouts=("kvcache",), append=False, llamacpp=False, stream_bytes=16 << 20)
    asked = bench_builds(monkeypatch, decode)
    half, tok = decode.run(cfg, threads=2, say=lambda _: None)["rows"]
    assert [(s.dtype, s.kv_dtype, s.qk_int8, s.kv_scale) for s, _ in asked] == [
        ("bfloat16", None, False, "head"), ("bfloat16", "int8", True, "token"), ("bfloat16", "int8", True, "head")]
    assert tok["dtype"] == "int8_qk8_token" and tok["kv_bytes"] * 2 == half["kv_bytes"] * (1 + 4 / tok["head_dim"])
    assert tok["kvcache_gbps"] > 0 and tok["vs_bf16"] > 0 and "scale_cost" not in half
    assert tok["scale_cost"] > -1 and tok[f"{decode.PER_HEAD}_ms"] > 0  # the int8_qk8 step, per-head scales


def test_decode_bench_smoke(tmp_path, capsys, monkeypatch):
    """``bench --decode --tiny``: both layouts and torch on one point, an fp32 and an 8-bit
    (e4m3fn, bf16 queries) cache with its appending kernel, the roof measured."""
    from tvm_attention.bench import decode

    # The roof's two streaming reads at 16 MiB instead of --tiny's 256 MiB (~2.3 s of this test):
    # the assertions below hold at any positive roof (roof_cap is clamped to (0, 1], and the
    # 8-bit row's cap stays under the fp32 row's: a quarter of the bytes against the same roof).
    read = decode.stream_read_gbps
    monkeypatch.setattr(decode, "stream_read_gbps", lambda nbytes: read(min(nbytes, 16 << 20)))
    asked = bench_builds(monkeypatch, decode)
    rc = cli.main(["bench", "--decode", "--tiny", "--threads", "2", "--decode-dtype", "float32", "float8_e4m3fn",
                   "--out", str(tmp_path)])
    assert rc == 0
    # per dtype: kvcache, paged, paged with one kv head per task; the 8-bit cache's appending kernel
    assert [(s.layout, s.kv_dtype, s.append, k) for s, k in asked] == [
        ("kvcache", None, False, None), ("paged", None, False, None), ("paged", None, False, {"decode_heads": 1}),
        ("kvcache", "float8_e4m3fn", False, None), ("paged", "float8_e4m3fn", False, None),
        ("paged", "float8_e4m3fn", False, {"decode_heads": 1}), ("kvcache", "float8_e4m3fn", True, None)]
    report = json.loads((tmp_path / "decode.json").read_text())
    row, kv8 = report["rows"]
    assert report["meta"]["roof_gbps"] > 0 and len(report["meta"]["stream_gbps"]) == 2
    assert row["kvcache_gbps"] > 0 and row["paged_gbps"] > 0 and 0 < row["kvcache_roof"]
    assert "paged_vs_contiguous" in row and row["paged_per_head_gbps"] > 0 and row["page_order_gain"] > 0
    assert kv8["dtype"] == "float8_e4m3fn" and kv8["kv_bytes"] * 4 == row["kv_bytes"] and kv8["vs_fp32"] > 0
    assert "append_cost" in kv8 and "append_cost" not in row and "torch_ms" not in kv8
    assert report["meta"]["fma_gflops"] > 0 and row["fma_floor_ms"] > 0 and 0 < kv8["roof_cap"] <= row["roof_cap"] <= 1
    assert "| H:KH |" in (tmp_path / "decode.md").read_text()
    # llama.cpp beside ours where ggml-python is installed; float8 never (ggml has no such type)
    llama = report["meta"]["llamacpp"]
    assert "float8_e4m3fn" in llama["float8_e4m3fn"] and "llamacpp_ms" not in kv8
    if importlib.util.find_spec("ggml") is not None:
        assert llama["float32"] == "F32" and row["llamacpp_ms"] > 0 and row["kvcache_vs_llamacpp"] > 0
    else:
        assert "ggml-python is not installed" in llama["float32"] and "llamacpp_ms" not in row


def test_decode_compute_floor_caps_the_roof_and_the_8bit_gain():
    # Issue 27's goals against the FMA peak (bench.decode._floors): GQA 32:8, D=128, batch 4,
    # 4k keys is 268 MFLOP, 1.13 ms at the 237 GFLOP/s of two Zen 4 cores. At the 49 GB/s the
    # stream read there, bf16's 67 MB take 1.37 ms (memory-bound) but int8's 34 MB 0.68 ms:
    # below the floor, so no fp32-FMA kernel reads 8-bit at more than 60 % of the roof or runs
    # faster than 1/1.21 of the bf16 step (goals: 70 %, 1/1.67).
    from tvm_attention.bench.decode import _floors, kv_bytes, step_flop

    b, h, kh, cache, d = 4, 32, 8, 4096, 128
    half = {"batch": b, "heads": h, "kv_heads": kh, "cache": cache, "head_dim": d, "dtype": "bfloat16",
            "kv_bytes": kv_bytes(b, kh, cache, d, 2)}
    kv8 = {**half, "dtype": "int8", "kv_bytes": kv_bytes(b, kh, cache, d, 1)}
    _floors(half, 49.0, 237.0, half=None)
    _floors(kv8, 49.0, 237.0, half=half)
    floor_s = step_flop(b, h, cache, d) / 237e9
    assert step_flop(b, h, cache, d) == 268_435_456 and kv8["fma_floor_ms"] == pytest.approx(floor_s * 1e3)
    assert half["roof_cap"] == 1.0 and "vs_bf16_cap" not in half
    assert kv8["roof_cap"] == pytest.approx(kv8["kv_bytes"] / 49e9 / floor_s) and 0.59 < kv8["roof_cap"] < 0.61
    assert kv8["vs_bf16_cap"] == pytest.approx(half["kv_bytes"] / 49e9 / floor_s) and kv8["vs_bf16_cap"] < 1 / 0.6
    # at half the bandwidth both dtypes are memory-bound: the caps are the byte ratios
    _floors(kv8, 24.5, 237.0, half=half)
    assert kv8["roof_cap"] == 1.0 and kv8["vs_bf16_cap"] == pytest.approx(2.0)


def test_continuous_batching_simulation_smoke(monkeypatch):
    from tvm_attention.bench import sim

    # without split-KV (bench_builds): its caches of 48 tokens at most fill one 256-key chunk, and
    # the split nests on such short caches are the fixture's (paged_gqa_causal, "two", "all_empty")
    asked = bench_builds(monkeypatch, sim)
    stats = sim.run(sim.tiny_config(), threads=2, say=lambda m: None)
    assert [(s.layout, k) for s, k in asked] == [("varlen", None), ("paged", None)]  # the prefill, the decode step
    assert stats["passed"] and stats["checked_steps"] >= 1 and stats["decode_tokens"] > 0
    assert stats["prefill_tokens"] > 0 and 0 < stats["peak_kv_bytes"] <= stats["pool_bytes"]
    assert stats["tokens_per_s"] > 0


def test_static_decode_shape_builds_its_packed_nest_alone():
    # A static seq_q whose seq_q·group rows fit a decode nest compiles that nest and no main nest;
    # the audit probes it at a doubled seq_kv (a longer seq_q would be another kernel).
    spec = AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64, causal=True)
    b = built(spec)
    assert b.audit.fused and b.audit.probe == {"seq_q": 1, "seq_kv": 600}, b.audit
    from tvm_attention.schedules import cpu_fused

    # the 4-row dot-product nest (group 4; AVX-512 and AVX2); else one vector of rows
    rows = 4 if cpu_fused.stages_decode(spec, b.knobs) else b.knobs.vector_lanes
    script = cpu_fused.workload(spec, b.knobs).script()
    assert f'sblock("row_tile_dec{rows}' in script and 'sblock("row_tile")' not in script
    assert validate_built(b).passed


def test_decode_presets_prefetch_and_heads_per_task():
    """The preset prefetches the next key tile (into L2) where the step does not stream at memory
    speed without it: bf16, fp16 and 8-bit caches, AVX2 code; not a float32 cache on AVX-512, not
    MHA's kvcache (``cpu_fused.decode_prefetch``, with the measurements behind it). And it stages
    keys for several kv heads per task where that was measured faster."""
    from tvm_attention.schedules import cpu_fused

    gqa = dict(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, layout="kvcache")
    for kw, lanes, want in ((dict(dtype="bfloat16"), 16, 1), (dict(dtype="float16"), 16, 1), (dict(kv_dtype="int8"), 16, 1),
                            (dict(), 16, 0), (dict(), 8, 1), (dict(layout="paged", dtype="bfloat16"), 16, 1),
                            (dict(kv_heads=32, dtype="bfloat16"), 16, 0), (dict(kv_heads=32, kv_dtype="int8"), 8, 0),
                            (dict(kv_heads=32, layout="paged", dtype="bfloat16"), 16, 1)):
        spec = AttentionSpec(**{**gqa, **kw})
        assert cpu_fused.decode_prefetch(spec, lanes) == want, (kw, lanes)
    # kv heads per task (cpu_fused.page_order_heads): paged all; contiguous on AVX-512 2 for a 16/32-bit
    # cache, all for an 8-bit GQA cache, 1 for an 8-bit MHA cache; AVX2 code 1
    for kw, lanes, want in ((dict(layout="paged", dtype="bfloat16"), 16, 8), (dict(layout="paged"), 8, 8),
                            (dict(dtype="bfloat16"), 16, 2), (dict(), 16, 2), (dict(kv_heads=32), 16, 2),
                            (dict(kv_dtype="int8"), 16, 8), (dict(kv_heads=32, kv_dtype="int8"), 16, 1),
                            (dict(dtype="bfloat16"), 8, 1), (dict(kv_dtype="int8"), 8, 1)):
        assert cpu_fused.page_order_heads(AttentionSpec(**{**gqa, **kw}), 64, lanes) == want, (kw, lanes)
    # a bf16 cache's value tile counts its bits: a paged MHA task takes whole rows (32 heads at D=128,
    # fp32: 16), and prefetches nothing then (1 MiB of K/V one tile ahead: > MAX_PREFETCH_AHEAD)
    mha = AttentionSpec(**{**gqa, "kv_heads": 32, "layout": "paged", "dtype": "bfloat16"})
    assert cpu_fused.page_order_heads(mha, 64, 16) == 32 and cpu_fused.decode_prefetch(mha, 16, 64, 32) == 0
    assert cpu_fused.page_order_heads(dataclasses.replace(mha, dtype="float32"), 64, 16) == 16
    assert cpu_fused.decode_prefetch(dataclasses.replace(mha, dtype="float16"), 16, 64, 16) == 1
    # with PV on dots (decode_dot 2: Vb and its pairs Vt, two copies of the bits) half as many
    assert cpu_fused.page_order_heads(mha, 64, 16, decode_dot=2) == 16


@functools.lru_cache(maxsize=None)
def decode_tasks(rep):
    """The tuner's tasks of the representative decode step ``rep``, made once: the page-order and
    the split-count tests below read the same step's."""
    from tvm_attention.target import resolve_target
    from tvm_attention.tune.tasks import make_tasks

    return make_tasks(rep, resolve_target("llvm"), "fused")


def test_page_order_and_prefetch_are_points_of_the_decode_space():
    """kv heads per decode task (the page order) and the software prefetch change the workload:
    the paged preset takes all heads, the tuner's tasks include both orders and the prefetch,
    every point validates and passes the audit, the per-head workload is exactly the one earlier
    logs recorded (no new attrs), and a paged build keeps its page order whatever a record tuned
    at the contiguous representative chose. The spec is the fixture's paged_per_head_prefetch
    (one sequence, 4 kv heads): its per-head build is that config's."""
    from tvm_attention.schedules import cpu_fused
    from tvm_attention.target import resolve_target, vector_lanes
    from tvm_attention.task_mods import workload_matches

    target = resolve_target("llvm")
    spec = config_spec("paged_per_head_prefetch")
    if not cpu_fused.stages_decode(spec, cpu_fused.preset(spec, target)):
        return _no_staged_decode_nest(spec, target)
    assert cpu_fused.preset(spec, target).decode_heads == 4
    contiguous = AttentionSpec(**{**spec.to_dict(), "layout": "kvcache", "page_size": None})
    assert cpu_fused.preset(contiguous, target).decode_heads == (2 if vector_lanes(target) == 16 else 1)  # page_order_heads
    rep = spec.representative()
    tasks = {t.name: t for t in decode_tasks(rep)}
    names = list(tasks)
    pf = cpu_fused.preset(rep, target).prefetch  # fp32: 0 on AVX-512, 1 as AVX2 code (decode_prefetch)

    def sfx(p):
        return f"_pf{p}" if p else ""
    h0 = cpu_fused.preset(rep, target).decode_heads  # the preset's task comes first
    assert names[0] == f"fused_dec_n64_s8_h{h0}{sfx(pf)}", names
    assert f"fused_dec_n64_s8_h1{sfx(pf)}" in names and f"fused_dec_n64_s8_h2{sfx(pf)}" in names, names
    assert f"fused_dec_n64_s8_h4{sfx(pf)}" in names and f"fused_dec_n32_s0_h2{sfx(pf)}" in names, names
    assert all(f"fused_dec_n64_s8_h{h0}{sfx(p)}" in names for p in cpu_fused.PREFETCH_CHOICES), names
    # the per-head point at the preset's prefetch is the workload logs recorded before the page
    # order existed: no attn.decode_heads, and attn.prefetch only where the preset prefetches
    attrs = tasks[f"fused_dec_n64_s8_h1{sfx(pf)}"].mod["main"].attrs
    assert "attn.decode_heads" not in attrs and ("attn.prefetch" in attrs) == (pf > 0), attrs
    per_head = cpu_fused.preset(rep, target)
    assert cpu_fused.for_layout(per_head, spec, target).decode_heads == 4
    assert cpu_fused.for_layout(per_head, rep, target) == per_head
    # one head per task, prefetching two tiles ahead (the fixture's build); 2 of 4 heads per
    # task, one tile ahead: two head blocks per sequence (the split path too: batch 1)
    per_head_knobs = CONFIGS["paged_per_head_prefetch"][4]
    for knobs in (per_head_knobs, (("decode_heads", 2), ("prefetch", 1))):
        b = built(spec, knobs=knobs)
        assert b.audit.fused and validate_built(b).passed
        x = PAGED.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [0, 700, 17], "shared_prefix": False}, seed=3)
        o, _ = call(spec, kernel_of(b), x)
        np.testing.assert_allclose(o, PAGED.reference_outputs(spec, x)[0], **TOL)
        wl = cpu_fused.workload(rep, b.knobs)
        assert workload_matches(rep, tvm_normalize(wl))
        assert ("attn.decode_heads" in wl.attrs) == (b.knobs.decode_heads > 1)
        assert ("attn.prefetch" in wl.attrs) == (b.knobs.prefetch > 0)
    module = built(spec, knobs=(("decode_heads", 2), ("prefetch", 1))).module
    assert "prefetcht1" in getattr(module, "mod", module).inspect_source("asm")  # into L2 (fused.PF_LOCALITY)
    with pytest.raises(Exception, match="decode_heads=3 must divide kv_heads=4"):
        built(spec, knobs=(("decode_heads", 3),))
    _no_staged_decode_nest(dataclasses.replace(spec, head_dim=12), target, tasks=False)  # 12: 1½ ymm, ¾ zmm


def _no_staged_decode_nest(spec, target, tasks=True):
    """No dot-product decode nest (a head_dim that is no multiple of the lanes, or SSE): the
    decode nest is one vector of rows (nothing stages K/V), so the page order and the prefetch
    have nothing to change: the preset and the decode space hold neither, a knob set asking for
    them is refused by name, and the preset is right on shuffled pages. ``tasks``: read the space
    as the tuner's tasks, else as their knobs (on a host whose other decode steps' tasks the page
    order's test reads)."""
    from tvm_attention.schedules import cpu_fused
    from tvm_attention.tune.tasks import make_tasks

    assert cpu_fused.preset(spec, target).decode_heads == 1
    if tasks:
        names = [t.name for t in make_tasks(spec.representative(), target, "fused")]
        assert names and all(n.endswith("_h1") for n in names), names
    else:  # the space's points: the knobs make_tasks names its tasks by (one task each), no workloads made
        points = cpu_fused.decode_candidates(spec.representative(), target)
        assert points and all(k.decode_heads == 1 and not k.prefetch for k in points), points
    with pytest.raises(Exception, match="apply to the staged decode nests"):
        built(spec, knobs=(("decode_heads", 2),))
    with pytest.raises(Exception, match="apply to the staged decode nests"):
        built(spec, knobs=(("prefetch", 1),))
    b = built(spec)
    assert b.audit.fused and validate_built(b).passed
    x = PAGED.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [0, 700, 17], "shared_prefix": False}, seed=3)
    o = call(spec, kernel_of(b), x)
    np.testing.assert_allclose(o[0] if spec.return_lse else o, PAGED.reference_outputs(spec, x)[0], **TOL)


def tvm_normalize(func):
    from tvm_attention.task_mods import normalize

    return normalize(func)


def test_split_count_and_page_order_are_tasks_of_a_kvcache_step():
    from tvm_attention.schedules import cpu_fused
    from tvm_attention.target import resolve_target
    from tvm_attention.task_mods import tuning_spec, workload_matches

    from tvm_attention.workloads.fused import n_splits

    # the representative step of a kvcache build: one sequence, 4 kv heads (the page-order test's
    # step: its tasks are made once). One head per task: split_tasks 0 and 4 give 1 chunk per
    # sequence, 8 two, 16 four, 32 eight: four tasks per key tile. 2 or 4 heads per task (the
    # page order): unsplit, or the preset's 8 tasks (4 and 8 chunks).
    kv = AttentionSpec(batch=1, heads=8, kv_heads=4, seq_q=1, seq_kv=300, head_dim=64, causal=True, layout="kvcache")
    rep, target = kv.representative(), resolve_target("llvm")
    assert rep == config_spec("paged_per_head_prefetch").representative()
    tasks = decode_tasks(rep)

    def point(t):
        a = t.mod["main"].attrs
        h = int(a["attn.decode_heads"]) if "attn.decode_heads" in a else 1
        return int(a["attn.block_n"]), h, n_splits(int(a["attn.split_tasks"]), 1, 4 // h)

    def prefetch_of(t):
        a = t.mod["main"].attrs
        return int(a["attn.prefetch"]) if "attn.prefetch" in a else 0

    pf = cpu_fused.preset(rep, target).prefetch  # fp32: 0 on AVX-512, 1 as AVX2 code (decode_prefetch)
    points = sorted(point(t) for t in tasks if prefetch_of(t) == pf)
    assert [p for p in points if p[1] == 1] == [(bn, 1, ns) for bn in (32, 64, 128) for ns in (1, 2, 4, 8)]
    if not cpu_fused.stages_decode(rep, cpu_fused.preset(rep, target)):  # no staged nest: one head per task
        assert {p[1] for p in points} == {1} and len(points) == len(tasks) == 12
        return
    assert [p for p in points if p[1] == 4] == [(bn, 4, ns) for bn in (32, 64, 128) for ns in (1, 8)]
    assert [p for p in points if p[1] == 2] == [(bn, 2, ns) for bn in (32, 64, 128) for ns in (1, 4)]
    assert {p[1] for p in points} == {1, 2, 4}, [t.name for t in tasks]
    assert sum(prefetch_of(t) != pf for t in tasks) == 2  # the preset at each other distance of 0, 1, 2 tiles
    assert all(t.points == 1 for t in tasks)  # one point each: the driver stops once all are measured
    # a log's records map back to them (the preset, and every kind of task)
    assert all(workload_matches(rep, t.mod) for t in tasks[:1] + tasks[-5:])

    # a kvcache build reads the log of that contiguous step (the paged one tunes in pages:
    # test_paged_decode_is_tuned_in_pages tunes, and builds from the record in a fresh process)
    assert tuning_spec(kv, target) == rep
    assert cpu_fused.for_layout(cpu_fused.preset(rep, target), kv, target, rep) == cpu_fused.preset(rep, target)


def test_paged_decode_is_tuned_in_pages(tmp_path, monkeypatch):
    """A paged decode step is tuned as itself: every task is the paged kernel specialized to the
    representative step (shuffled pages, a valid block table), its log names that step, and a
    build from the log (the CLI, in this process: test_tune's fresh-process build shows a record
    reloads from the files alone) makes the paged kernel with the record's page order, validated
    and fused. One trial: one measured record is what the build reads."""
    import tvm
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    from tvm_attention.target import resolve_target
    from tvm_attention.tune.driver import tune
    from tvm_attention.tvm_internals import skip_tensor_intrin_import
    from tvm_attention.logs import best_records, tune_work_dir
    from tvm_attention.tune.paged import AllocInputs
    from tvm_attention.task_mods import tuning_spec, workload_matches
    from tvm_attention.tune.tasks import make_tasks

    # batch 8 × 4 kv heads: 32 tasks at one head each, so no split count differs (11 tasks)
    spec = AttentionSpec(batch=8, heads=8, kv_heads=4, seq_q=1, seq_kv=300, head_dim=64, causal=True,
                         layout="paged", page_size=16)
    target = resolve_target("llvm")
    assert tuning_spec(spec, target) is spec  # not the contiguous representative
    assert tuning_spec(dataclasses.replace(spec, seq_q=64), target).layout == "bhsd"  # a prefill step is
    assert tune_work_dir(spec, target).name == "paged_p16_h8_kv4_d64_float32_causal_at_b8_q1_k300"
    tasks = make_tasks(spec, target, "fused")
    names = [t.name for t in tasks]
    from tvm_attention.schedules import cpu_fused

    if cpu_fused.stages_decode(spec, cpu_fused.preset(spec, target)):  # AVX-512, AVX2: the page order too
        pf = cpu_fused.preset(spec, target).prefetch  # fp32: 0 on AVX-512, 1 as AVX2 code (decode_prefetch)
        sfx = f"_pf{pf}" if pf else ""
        assert names[0] == f"fused_dec_n64_s8_h4{sfx}", names
        assert f"fused_dec_n64_s0_h1{sfx}" in names and f"fused_dec_n32_s0_h2{sfx}" in names, names
        assert len(tasks) == 11
    else:  # no staged decode nest (SSE): one head per task; at 32 tasks no split count differs
        assert names == ["fused_dec_n64_s8_h1", "fused_dec_n32_s0_h1", "fused_dec_n128_s0_h1"], names
    assert all(t.points == 1 for t in tasks)
    # static shapes: 8 sequences of 300 keys in 19 pages each (+3 spare), block_table (8, 19)
    infos = ms.arg_info.ArgInfo.from_prim_func(tasks[0].mod["main"])
    assert [tuple(int(x) for x in i.shape) for i in infos] == [
        (8, 8, 1, 64), (155, 16, 4, 64), (155, 16, 4, 64), (8, 19), (8,), (8, 8, 1, 64)]
    # the candidates' inputs: the layout's own, a block table the kernel may follow
    (q, kp, vp, table, lens, o), = AllocInputs(spec)(tvm.cpu(), [i.as_json() for i in infos], 1)
    PAGED.check_indices({"block_table": table.numpy(), "cache_seqlens": lens.numpy(), "k_pages": kp.numpy()},
                        {"num_pages": 155, "max_pages": 19})
    assert sorted(table.numpy().ravel()) != list(range(152)) and set(lens.numpy()) == {300}
    # RPCRunner calls it with the session first (a loopback fleet tune of this spec ran so)
    assert len(AllocInputs(spec)(None, tvm.cpu(), [i.as_json() for i in infos], 2)) == 2
    # generating the space of a task whose kernel holds the split and the unsplit nest leaves its
    # module as it was (unsimplified, it did not)
    before = tvm_ffi.structural_hash(tasks[0].mod)
    with skip_tensor_intrin_import():  # as tune() does: TuneContext's import of them takes ~30 s
        ctx = ms.TuneContext(mod=tasks[0].mod, target=target, space_generator=tasks[0].space, task_name=names[0],
                             search_strategy=ms.search_strategy.ReplayTrace(), num_threads=1)
    ctx.generate_design_space()
    assert tvm_ffi.structural_hash(tasks[0].mod) == before and workload_matches(spec, tasks[0].mod)

    work = tmp_path / "log"
    from tvm_attention.tune import driver

    # one trial of random search: every task is one point (the decode space; asserted above), so a
    # cost model has nothing to rank here (test_search.py's tunes are the search's tests)
    # the tune below makes these very tasks (same spec, target, schedule): hand it the list checked
    # above. Its target is another Target object of the same JSON (Targets compare by identity)
    monkeypatch.setattr(driver, "make_tasks", lambda s, t, sched: tasks if (s, str(t), sched) == (spec, str(target), "fused")
                        else make_tasks(s, t, sched))
    result = tune(spec, trials=1, per_round=1, work_dir=work, progress=lambda m: None, search="random")
    assert result.trials_new == 1
    (wl, rec), *_ = best_records(spec, target, "fused", work)
    attrs = wl.mod["main"].attrs
    heads = int(attrs["attn.decode_heads"]) if "attn.decode_heads" in attrs else 1
    out = tmp_path / "art"
    assert cli.main(["build", "--layout", "paged", "--batch", "8", "--heads", "8", "--kv-heads", "4", "--seq-q", "1",
                     "--seq-kv", "300", "--head-dim", "64", "--causal", "--from-log", str(work), "--out", str(out)]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["schedule"]["source"] == "tuned" and m["validation"]["passed"] and m["audit"]["verdict"] == "fused"
    knobs = m["schedule"]["knobs"]
    assert knobs["decode_heads"] == heads and knobs["block_n"] == int(attrs["attn.block_n"])
    assert knobs["split_tasks"] == int(attrs["attn.split_tasks"])


@pytest.mark.parametrize("layout", ["kvcache", "paged"])
def test_a_bf16_caches_multi_head_tile_stages_the_values_as_their_bits(layout):
    """A decode tile of several kv heads (the page order) stages a bfloat16 cache's value tile
    as its bits (block_n × heads × D uint16, read through a uint16 view of V), not as the float32
    TVM would store a bfloat16 local buffer in: half the bytes written and read back per key tile
    (GQA 32:8 D128 B60 × 4k on a 2-core Sapphire Rapids VM: kvcache 19.4 → 21.0 GB/s, paged
    14.2 → 15.7). Every validation case of the layout, lse included."""
    import re

    spec = AttentionSpec(batch=2, heads=8, kv_heads=4, seq_q=1, seq_kv=300, head_dim=64, layout=layout, causal=True,
                         dtype="bfloat16", return_lse=True)
    from tvm_attention.build import build_kernel

    b = build_kernel(spec, knobs={"decode_heads": 2, "decode_dot": 0}, cache=True)
    staged = re.findall(r"Vt = T\.decl_buffer\(\((\d+),\), \"uint16\"", str(b.lowered))
    assert str(b.knobs.block_n * 2 * spec.head_dim) in staged, staged
    result = validate_built(b)
    assert result.passed, result
