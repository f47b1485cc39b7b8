"""DeepSeek's multi-head latent attention (issue 44, item 2): the ``mla`` and ``mla_paged`` layouts,
one latent row per token shared by every query head, K the whole row and V its first
``head_dim_v`` columns. The spec's rules, the kernels against the float64 reference (decode,
multi-token steps, chunked prefill against the cache, page sizes 1, 16 and 64, lse, the variants
that act per query head), the loader's call forms and checks, and the exported library's own
check of the index arrays (at 2³¹−1 too)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tvm_attention.artifact import export, validate_built
from tvm_attention.layouts import KernelArgumentError
from tvm_attention.spec import AttentionSpec, SpecError

from conftest import built

#: a small latent shape: 16 heads over one 96-wide latent row, V its first 64 columns
M = dict(batch=2, heads=16, seq_q=1, seq_kv=100, head_dim=96, head_dim_v=64, scale=0.1, causal=True)


def test_spec_rules():
    s = AttentionSpec(**M, layout="mla")
    assert s.kv_heads == 1 and s.group_size == 16 and s.v_dim == 64
    assert [(a["name"], a["shape"]) for a in s.arg_specs()] == [
        ("q", ["batch", 16, "seq_q", 96]), ("kv_cache", ["batch", "max_len", 96]), ("cache_seqlens", ["batch"]),
        ("o", ["batch", 16, "seq_q", 64])]
    p = AttentionSpec(**M, layout="mla_paged", page_size=64)
    assert [a["shape"] for a in p.arg_specs()][1] == ["num_pages", 64, 96]
    assert s.layout_info.kv_bytes(s, {"seq_q": 1, "cache_seqlens": [10, 20]}) == 30 * 96 * 4  # each row read once
    a = AttentionSpec(**M, layout="mla", append=True)  # the new tokens' latent rows, one per token
    assert [(x["name"], x["shape"]) for x in a.arg_specs()][3] == ("kv_new", ["batch", "seq_q", 96])
    # an 8-bit latent cache has one scale array, K's and V's (V's groups: its first Dv / 32)
    for kv_scale, shape in (("head", ["kv_heads"]), ("token", ["batch", "max_len"]),
                            ("group", ["batch", "max_len", 3])):
        q8 = AttentionSpec(**M, layout="mla", kv_dtype="int8", kv_scale=kv_scale)
        assert [(x["name"], x["shape"]) for x in q8.arg_specs()][3] == ("kv_scale", shape)
    p8 = AttentionSpec(**M, layout="mla_paged", kv_dtype="int8", kv_scale="token")
    assert [x["shape"] for x in p8.arg_specs()][4] == ["num_pages", 16]
    for kw, match in ((dict(kv_heads=2), "one kv head"), (dict(head_dim_v=None), "give head_dim_v < head_dim"),
                      (dict(scale=None), "give the scale"), (dict(kv_dtype="int8", qk_int8=True), "qk_int8")):
        with pytest.raises(SpecError, match=match):
            AttentionSpec(**{**M, **kw}, layout="mla")


#: ``scripts/variant_sweep.py`` sets this: the kernels below take the whole matrix (every
#: page size plain and 8-bit, every build at its preset knobs) instead of the covering set
SWEEP = os.environ.get("TVMA_VARIANT_SWEEP") == "1"

#: name -> spec fields: decode steps, multi-token steps and a chunked prefill (each layout's
#: validation cases: seq_q 1, 4 and 37 against caches of 0 to 211 keys), page sizes 1, 16 and 64,
#: bf16 with lse, DeepSeek-V3's 128 heads × 576 / 512, and the variants that act per query head
#: (ALiBi's slope, the sink) on packed rows
KERNELS = {
    "mla": dict(M, layout="mla"),
    "mla_bf16_lse": dict(M, layout="mla", dtype="bfloat16", return_lse=True),
    "mla_paged_16": dict(M, layout="mla_paged"),
    "mla_paged_1_variants": dict(M, layout="mla_paged", page_size=1, heads=20, window=(50, 0), softcap=20.0,
                                 alibi=True, sinks=True),
    # split-KV's merge adds the sink once (the split test)
    "mla_paged_1_sinks": dict(M, layout="mla_paged", page_size=1, heads=20, sinks=True, return_lse=True),
    # the new tokens' latent rows written into the cache and attended to (across a page of 16)
    "mla_append": dict(M, layout="mla", append=True, return_lse=True),
    "mla_paged_append_bf16": dict(M, layout="mla_paged", append=True, dtype="bfloat16"),
    # 8-bit latent caches, their one kv_scale per cache, token or group (V reads the first groups);
    # the unused rows' scales are NaN in every validation case (only the keys attended to are read).
    # Pages of 64 here (a token scale per slot of a page: (num_pages, 64)); pages of 16 are the plain
    # and appending caches'
    "mla_paged_e4m3_token": dict(M, layout="mla_paged", page_size=64, kv_dtype="float8_e4m3fn", kv_scale="token"),
    "mla_bf16_e4m3_group_lse": dict(M, layout="mla", dtype="bfloat16", kv_dtype="float8_e4m3fn", kv_scale="group",
                                    return_lse=True),
    "mla_int8_append": dict(M, layout="mla", kv_dtype="int8", append=True),
    "mla_paged_int8_group_append": dict(M, layout="mla_paged", kv_dtype="int8", kv_scale="group", append=True),
    "deepseek_v3": dict(M, layout="mla", heads=128, head_dim=576, head_dim_v=512, dtype="bfloat16",
                        scale=192 ** -0.5),
}
if SWEEP:  # the page sizes beside the 8-bit one: a plain cache of pages of 64, e4m3 over pages of 16
    KERNELS["mla_paged_64"] = dict(M, layout="mla_paged", page_size=64)
    KERNELS["mla_paged_16_e4m3_token"] = dict(KERNELS["mla_paged_e4m3_token"], page_size=16)

#: knobs that never split the keys (split-KV's nests left out: a third of the split build's time)
UNSPLIT = (("split_tasks", 0),)
#: Row tiles of 16 packed rows for the 20-head builds: every mask expression of theirs holds the
#: packed row's position p // 20 (a shift for 16 or 128 heads), and LLVM's code for it is most of
#: their build time (the split build's: 10 s with the preset's tiles of 32 rows, 4.8 s with 16;
#: 2.3 s for 16 heads). Tiles of 16 rows straddle positions of 20 rows as tiles of 32 do.
TILE16 = (("block_m", 16),)
#: The knobs of each build the tests take (``build(name)``); the others are the preset's. Split-KV
#: over several chunks is the split test's (f32, bf16 with lse, pages of one key with a sink over
#: 20 heads: their builds keep it), and mla_int8_append keeps it (an 8-bit cache and appended rows
#: in the split nest). The other builds validate against caches of at most 211 keys, under one
#: chunk (``fused.MIN_SPLIT_KEYS``: 256 keys), where a split nest reads a sequence's keys as the
#: unsplit nest does: they are built without it. (The 20-head variants' split form took 17 s to
#: compile with the preset's tiles: the split test covers split-KV with a sink instead.)
KNOBS = {"mla_paged_1_variants": UNSPLIT} if SWEEP else {
    "mla_paged_1_variants": TILE16 + UNSPLIT, "mla_paged_1_sinks": TILE16,
    **{n: UNSPLIT for n in ("mla_paged_16", "mla_append", "mla_paged_append_bf16", "mla_paged_e4m3_token",
                            "mla_bf16_e4m3_group_lse", "mla_paged_int8_group_append", "deepseek_v3")}}


def build(name: str):
    """``KERNELS[name]`` built with its ``KNOBS`` (once per session)."""
    return built(AttentionSpec(**KERNELS[name]), knobs=KNOBS.get(name))


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matches_the_reference(name):
    b = build(name)
    assert b.audit.fused, b.audit
    r = validate_built(b)
    assert r.passed and r.finite, r


#: (seq_q, cache_seqlens) of the split-KV cases: one long sequence (8 chunks of 256 keys, the
#: last three empty), a multi-token step whose causal rows end in different chunks, and a batch
#: of a long and an empty cache
SPLIT_CASES = ((1, [1100]), (3, [777]), (1, [900, 0]))


@pytest.mark.parametrize("name", ["mla", "mla_bf16_lse", "mla_paged_1_sinks"])
def test_split_kv_matches_the_reference_and_the_unsplit_build(name):
    """Few row tiles (a small batch, 16 or 20 heads: DeepSeek's 128 over 8 devices) split each
    sequence's keys into chunks whose partials the merge combines (flash-decoding, as the
    decode tiers do): the split build matches the float64 reference and the never-split build
    (``split_tasks=0``) over caches long enough for several chunks, with a sink (joined once, by
    the merge) on pages of one key, bf16, and lse."""
    from tvm_attention.artifact import kernel_of

    spec = AttentionSpec(**KERNELS[name])
    b, whole = build(name), built(spec, knobs=KNOBS.get(name, ()) + UNSPLIT)
    # the split form's workload records split_tasks (a never-split one has no split form)
    assert b.knobs.split_tasks > 0 and f'"attn.split_tasks": {b.knobs.split_tasks}' in b.lowered.script()
    assert "attn.split_tasks" not in whole.lowered.script()
    assert b.audit.fused and b.audit.verdict == "fused", b.audit  # the workspace grows with nothing
    split, unsplit = kernel_of(b), kernel_of(whole)
    layout = spec.layout_info
    names = [a["name"] for a in spec.arg_specs() if a["name"] not in ("o", "lse")]
    for i, (seq_q, lens) in enumerate(SPLIT_CASES):
        case = {"seq_q": seq_q, "cache_seqlens": lens, "max_len": max(lens)}
        x = layout.random_inputs(spec, case, seed=i)
        got, want = split(*[x[n] for n in names]), unsplit(*[x[n] for n in names])
        ref = layout.reference_outputs(spec, x)
        if spec.return_lse:
            (got, lse), (want, want_lse), (ref, ref_lse) = got, want, ref
            np.testing.assert_allclose(lse, ref_lse, atol=2e-4, rtol=2e-4)
            np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5)
        else:
            ref = ref[0]
        tol = 2e-2 if spec.dtype == "bfloat16" else 2e-4
        np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=tol, rtol=tol)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
        for bi, n in enumerate(lens):
            if n == 0:  # an empty cache outputs exact zeros, split or not
                assert not np.asarray(got[bi], np.float32).any()


@pytest.mark.parametrize("name", ["mla_append", "mla_paged_append_bf16", "mla_int8_append",
                                  "mla_paged_int8_group_append"])
def test_append_writes_the_latent_rows_in_place(name):
    """``kv_new (B, Sq, D)``: the new tokens' latent rows, written into the one cache at each
    sequence's ``cache_seqlens[b] ..`` (across a page of 16, into an empty sequence) and attended
    to in the same call; after it the cache holds exactly the reference's copy, bit for bit
    (an 8-bit cache: quantized with the call's ``kv_scale``, or per group with each row's own
    scales, written beside it), nothing else touched. The library refuses a length whose new
    rows would pass the cache, at its edge and at the ends of int32, writing nothing."""
    from tvm_attention.artifact import kernel_of

    spec = AttentionSpec(**KERNELS[name])
    k, lay = kernel_of(build(name)), spec.layout_info
    sq = 3
    case = {"seq_q": sq, "cache_seqlens": [0, 14, 40], "max_len": 43}
    x = lay.random_inputs(spec, case, seed=4)
    want = lay.appended(spec, x)
    cache = lay.kv_names[0]
    assert list(x)[-1] == "kv_new" and x["kv_new"].shape == (3, sq, spec.head_dim)
    before = x[cache].copy()
    out = k(*x.values())
    o = out[0] if spec.return_lse else out
    np.testing.assert_array_equal(x[cache].view(np.uint8), want[cache].view(np.uint8))
    assert not np.array_equal(x[cache].view(np.uint8), before.view(np.uint8))
    if spec.kv_dtype is not None and spec.kv_scale != "head":  # the new rows' own scales, beside them
        np.testing.assert_array_equal(x["kv_scale"].view(np.uint8), want["kv_scale"].view(np.uint8))
    ref = lay.reference_outputs(spec, dict(x, **{cache: before}))[0]  # (appends the new rows' scales again)
    tol = 2e-2 if spec.dtype == "bfloat16" else 1e-4
    np.testing.assert_allclose(np.asarray(o, np.float32), ref, atol=tol, rtol=tol)
    # the room for the new rows, checked by the library (a C++ caller) and the loader
    import tvm

    capacity = x["block_table"].shape[1] * spec.page_size if "block_table" in x else x[cache].shape[1]
    for bad in (capacity - sq + 1, 2 ** 31 - 1, 2 ** 31 - sq):
        given = dict(x, cache_seqlens=np.array([0, bad, 40], np.int32), **{cache: before.copy()})
        args = [tvm.runtime.tensor(a) for a in given.values()]
        o = tvm.runtime.tensor(np.zeros(x["q"].shape[:3] + (spec.v_dim,), x["q"].dtype))
        lse = [tvm.runtime.tensor(np.zeros(x["q"].shape[:3], np.float32))] if spec.return_lse else []
        with pytest.raises(ValueError, match="cache_seqlens"):
            k.function(*args, o, *lse)
        np.testing.assert_array_equal(args[1].numpy().view(np.uint8), before.view(np.uint8))  # nothing written
        with pytest.raises(KernelArgumentError, match=rf"cache_seqlens\[1\]={bad} \+ seq_q={sq} appended exceeds"):
            k(*given.values())
    if spec.kv_dtype == "int8" and spec.kv_scale == "head":  # the one scale, and no NaN for an int8 cache
        nan = x["kv_new"].copy()
        nan[1, 0, 5] = np.nan
        for given, what in ((dict(x, kv_scale=np.zeros(1, np.float32)), "kv_scale"), (dict(x, kv_new=nan), "kv_new")):
            args = [tvm.runtime.tensor(a) for a in given.values()]
            o = tvm.runtime.tensor(np.zeros(x["q"].shape[:3] + (spec.v_dim,), x["q"].dtype))
            with pytest.raises(ValueError, match=what):
                k.function(*args, o)
            with pytest.raises(KernelArgumentError, match=what):
                k(*given.values())


@pytest.mark.parametrize("name", ["mla", "mla_paged_16"])
def test_loader_and_the_librarys_own_checks(name, tmp_path):
    import tvm

    from tvm_attention.loader import _SLOW, load

    spec = AttentionSpec(**KERNELS[name])
    b = build(name)
    export(b, tmp_path, validate_built(b))
    kernel = load(tmp_path)
    layout = spec.layout_info
    arrays = layout.random_inputs(spec, layout.validation_cases(spec)[1])  # ragged lengths, 0 among them
    ref = layout.reference_outputs(spec, arrays)[0]
    names = [a["name"] for a in spec.arg_specs() if a["name"] != "o"]
    cache, *index = names[1:]
    positional = kernel(*[arrays[n] for n in names])
    keywords = kernel(arrays["q"], arrays[cache], **{n: arrays[n] for n in index})
    np.testing.assert_allclose(positional, ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(keywords, positional)
    fast = kernel._fast_call(tuple(arrays[n] for n in names), None)  # no Python checks on this path
    assert fast is not _SLOW
    np.testing.assert_array_equal(fast, positional)
    with pytest.raises(KernelArgumentError, match=f"missing {index[0]}"):
        kernel(arrays["q"], arrays[cache])
    narrow = np.ascontiguousarray(arrays[cache][..., :64])  # V's width given as the cache's
    with pytest.raises(KernelArgumentError, match=f"{cache}: expected shape"):
        kernel(arrays["q"], narrow, *[arrays[n] for n in index])
    # the library itself (a C++ caller, no loader): a length one past the cache's capacity, at
    # 2**31 - 1 and negative; the loader alike
    o = np.zeros(arrays["q"].shape[:3] + (spec.v_dim,), np.float32)
    paged = "block_table" in index
    capacity = arrays["block_table"].shape[1] * spec.page_size if paged else arrays[cache].shape[1]
    for bad in (capacity + 1, 2 ** 31 - 1, -1):
        lens = np.full_like(arrays["cache_seqlens"], bad)
        given = dict(arrays, cache_seqlens=lens)
        with pytest.raises(ValueError, match="cache_seqlens"):
            kernel.function(*[tvm.runtime.tensor(given[n]) for n in names], tvm.runtime.tensor(o))
        with pytest.raises(KernelArgumentError, match="cache_seqlens"):
            kernel(*[given[n] for n in names])
    if not paged:  # every sequence at the capacity itself: read to the last row, right
        full = dict(arrays, cache_seqlens=np.full_like(arrays["cache_seqlens"], capacity))
        np.testing.assert_allclose(kernel(*[full[n] for n in names]), layout.reference_outputs(spec, full)[0],
                                   atol=1e-4, rtol=1e-4)
    if "block_table" in index:  # an entry in use that is no page
        table = arrays["block_table"].copy()
        table[0, 0] = arrays[cache].shape[0]
        given = dict(arrays, block_table=table, cache_seqlens=np.maximum(arrays["cache_seqlens"], 1))
        with pytest.raises(ValueError, match="block_table"):
            kernel.function(*[tvm.runtime.tensor(given[n]) for n in names], tvm.runtime.tensor(o))


def test_the_block_table_rule_names_kv_pages_and_fires_first_without_pages():
    """An ``mla_paged`` block-table entry that is no page is named against the layout's one cache,
    ``kv_pages`` (the library said ``k_pages``, the paged layout's; issue 62), by the library (a
    C++ caller, its arrays through DLPack) and the loader. With no page at all, ``kv_pages (0,
    page_size, D)`` (NumPy gives an empty array strides of 0), a length of 1 is refused by that
    rule, not by TVM's check that the empty tensor's strides are compact, and a call that reads no
    page runs: empty caches, exact zeros."""
    import tvm_ffi

    from tvm_attention.artifact import kernel_of

    spec = AttentionSpec(**KERNELS["mla_paged_16"])
    k = kernel_of(build("mla_paged_16"))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, spec.heads, 1, spec.head_dim)).astype(np.float32)

    def library(*args):
        o = np.full(q.shape[:3] + (spec.v_dim,), np.nan, np.float32)
        k.function(*[tvm_ffi.from_dlpack(a) for a in (*args, o)])
        return o

    for pages in (3, 0):
        kv = np.zeros((pages, spec.page_size, spec.head_dim), np.float32)
        args = (q, kv, np.full((2, 1), pages, np.int32), np.ones(2, np.int32))  # entry `pages`: one past the last
        with pytest.raises(ValueError, match=r"block_table: an entry a sequence uses .* is not a page: it must be "
                                             r"in \[0, num_pages\) \(dim 0 of kv_pages\)"):
            library(*args)
        with pytest.raises(KernelArgumentError, match=rf"block_table\[0, 0\]={pages} is not a page: kv_pages holds "
                                                      rf"num_pages={pages} "):
            k(*args)
    empty = (q, np.zeros((0, spec.page_size, spec.head_dim), np.float32), np.zeros((2, 1), np.int32),
             np.zeros(2, np.int32))
    np.testing.assert_array_equal(library(*empty), 0)
    np.testing.assert_array_equal(k(*empty), 0)
    strided = np.zeros((3, 2 * spec.page_size, spec.head_dim), np.float32)[:, ::2]  # pages, not compact
    with pytest.raises(ValueError, match="(?s)Mismatched K.strides .*compact"):  # TVM's, for a tensor with elements
        library(q, strided, np.zeros((2, 1), np.int32), np.ones(2, np.int32))


def test_cli_layout():
    import argparse

    from tvm_attention.cli import _add_spec_flags, _spec_from_args

    p = argparse.ArgumentParser()
    _add_spec_flags(p)
    # docs/serving.md's DeepSeek-V3 command (two lines there, so test_readme does not build it)
    spec = _spec_from_args(p.parse_args(["--layout", "mla_paged", "--page-size", "64", "--heads", "128",
                                         "--head-dim", "576", "--head-dim-v", "512", "--scale", "0.0722",
                                         "--dtype", "bfloat16", "--causal"]))
    assert (spec.kv_heads, spec.page_size, spec.v_dim, spec.dynamic) == (1, 64, 512, ("batch", "seq_q", "seq_kv"))


def test_bench_mla_tiny(tmp_path):
    """``bench --mla --tiny``: the MLA decode point against its roof and peers, the head_dim_v
    prefill against the equal-dims build, split-KV against the unsplit build and an int8 latent
    cache against bf16, written as mla.md/json (speed goals are the benchmark's, never asserted
    here)."""
    import importlib.util
    import json

    from tvm_attention import cli

    assert cli.main(["bench", "--mla", "--tiny", "--threads", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "mla.json").read_text())
    dec, pre, split, q8 = report["rows"]
    assert split["point"] == "mla split" and split["split_ms"] > 0 and split["unsplit_ms"] > 0
    assert q8["point"] == "mla 8-bit" and q8["int8_ms"] > 0 and q8["int8_vs_bf16"] > 0
    assert dec["point"] == "mla decode" and dec["ours_gflops"] > 0 and 0 < dec["of_roof"]
    if dec["form"] == "AMX tiles":  # an AMX host: the tile peak, and the vdpbf16ps form side by side
        assert dec["roof"] == "AMX tile peak" and report["meta"]["amx_tile_peak_gflops"] > 0
        assert dec["bf16_dot_ms"] > 0 and dec["amx_vs_dot"] > 0
        assert "over the `vdpbf16ps` form" in (tmp_path / "mla.md").read_text()
    else:
        assert dec["roof"] == ("bf16 dot peak" if report["meta"]["bf16_dot_peak_gflops"] else "fp32 FMA peak")
        assert "amx_vs_dot" not in dec
    if importlib.util.find_spec("torch") is not None:
        assert dec["torch_ms"] > 0 and dec["vs_torch"] > 0
    if importlib.util.find_spec("ggml") is not None:  # llama.cpp at Dk != Dv, where installed
        assert dec["llamacpp_ms"] > 0 and "ggml_flash_attn_ext" in dec["llamacpp"]
    else:
        assert "ggml-python is not installed" in dec["llamacpp"]
    assert pre["point"] == "prefill" and pre["d64v32_gflops"] > 0 and pre["dv_vs_d"] > 0
    assert "| ratio |" in (tmp_path / "mla.md").read_text()


@pytest.mark.parametrize("schedule, match", [
    ("fused", r"the CUDA tensor-core MLA schedule builds dtype\(s\) float16, bfloat16, not 'float32': use --schedule "
              "fused on a CPU"),
    ("fused_simt", "not 'mla_paged': use --schedule fused_mla .*, or use --schedule fused on a CPU"),
    ("fused_tc", "not 'mla_paged': use --schedule fused_mla .*, or use --schedule fused on a CPU")])
def test_cuda_refuses_what_it_does_not_build_by_name(schedule, match):
    """On CUDA the latent layouts are the MLA tensor-core kernel's (tests/test_cuda_mla.py), in
    float16 or bfloat16: a float32 latent spec is refused naming the dtype, and the other CUDA
    kernels send the layout there, before any workload is made."""
    from tvm_attention.build import build_kernel
    from tvm_attention.schedules._knobs import KnobError
    from tvm_attention.target import resolve_target

    with pytest.raises(KnobError, match=match):
        build_kernel(AttentionSpec(**KERNELS["mla_paged_16"]), schedule, resolve_target("cuda", arch="sm_90"))
