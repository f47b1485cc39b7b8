"""A custom mask (issue 45, item 1, first step): FlashInfer's packed bits (``custom_mask``,
``mask_indptr``) ANDed into the CPU fused kernel's mask in every layout, static and symbolic,
the decode tiers and split-KV, the latent layouts; the float64 reference applies the same bits;
the library and the loader check the bytes each sequence needs (at 2³¹−1 too); the loader packs
a boolean mask; tree attention over a cache with the drafts appended in the same call."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from tvm_attention.artifact import kernel_of, validate_built
from tvm_attention.bench import masks as masks_bench
from tvm_attention.layouts import KernelArgumentError
from tvm_attention.masks import pack_mask, tree_masks
from tvm_attention.reference import reference_attention
from tvm_attention.spec import AttentionSpec

from conftest import built

GQA = dict(heads=4, kv_heads=2, head_dim=32)


def test_spec_arguments_and_names():
    s = AttentionSpec(batch=2, seq_q=64, **GQA, custom_mask=True, layout="kvcache")
    names = [(a["name"], a["shape"]) for a in s.arg_specs()]
    assert names[4:6] == [("custom_mask", ["mask_bytes"]), ("mask_indptr", ["mask_rows"])]  # after cache_seqlens
    assert s.short_name().endswith("_cm") and s.variants == ("custom_mask",) and s.has_modifiers
    static = AttentionSpec(batch=2, seq_q=10, seq_kv=13, **GQA, custom_mask=True, dynamic=())
    assert [a["shape"] for a in static.arg_specs()][3:5] == [[2 * 17], [3]]  # 130 bits: 17 bytes a sequence
    assert "custom_mask" not in AttentionSpec(batch=1, seq_q=8, **GQA).to_dict()


def test_cuda_kernels_take_it_and_hopper_refuses_it_by_name():
    """The SIMT and mma.sync kernels build custom masks (tests/test_cuda_call_masks.py runs them);
    the Hopper kernel, whose masking is its own, refuses them by name."""
    from tvm_attention.build import build_kernel
    from tvm_attention.schedules import cuda_mma, cuda_simt
    from tvm_attention.schedules._knobs import KnobError
    from tvm_attention.target import resolve_target

    spec = AttentionSpec(batch=1, seq_q=64, **GQA, dtype="float16", custom_mask=True)
    assert cuda_mma.CAPABILITIES.refusal(spec) is None and cuda_simt.CAPABILITIES.refusal(spec) is None
    with pytest.raises(KnobError, match="does not build the attention variant.s. custom_mask"):
        build_kernel(spec, "fused_hopper", resolve_target("cuda", arch="sm_90"))


#: ``bench --masks --tiny``'s shapes: its kernels are built through the run's build cache, so the
#: specs below that are its (the symbolic bhsd one: its skipping point's masked kernel; the tree
#: test's: its tree point's) are built once for both (GQA is its heads, kv heads and head_dim)
TINY = masks_bench.quick_config()
assert (TINY.heads, TINY.kv_heads, TINY.head_dim) == (GQA["heads"], GQA["kv_heads"], GQA["head_dim"])

#: name -> spec fields: each layout's validation cases (random masks: 3 of 4 bits set, a quarter
#: of the keys hidden from every row, a row that sees no key), static and symbolic bhsd (the
#: symbolic one's decode tier too; its representative, one sequence of 1280 × 1280, the tiny
#: benchmark's), the KV caches with lse, append and split-KV, varlen, MLA, bf16
KERNELS = {
    "bhsd_static_causal": dict(batch=2, seq_q=100, seq_kv=130, causal=True, dynamic=()),
    "bhsd_symbolic": dict(batch=1, seq_q=TINY.seq, seq_kv=TINY.seq, dynamic=("batch", "seq_q", "seq_kv")),
    "kvcache_lse": dict(batch=2, seq_q=1, seq_kv=300, causal=True, layout="kvcache", return_lse=True),
    "paged_append_bf16": dict(batch=2, seq_q=4, seq_kv=300, causal=True, layout="paged", append=True,
                              dtype="bfloat16"),
    "varlen_window": dict(batch=2, seq_q=64, causal=True, layout="varlen", window=(40, 0)),
    "mla": dict(batch=2, heads=16, kv_heads=1, seq_q=1, seq_kv=100, head_dim=96, head_dim_v=64, scale=0.1,
                causal=True, layout="mla"),
}
#: The MLA build never splits the keys (``split_tasks=0``: a third of the split build's time): its
#: validation caches hold at most 211 keys, under one split-KV chunk (``fused.MIN_SPLIT_KEYS``: 256),
#: where a split nest reads the keys as the unsplit one does; split-KV with a mask over several
#: chunks is the KV caches' (their validation's 300 keys, test_split_kv_and_rows_without_a_key), of
#: the latent layouts test_mla's split test. ``scripts/variant_sweep.py`` builds it at the preset's
#: knobs.
KNOBS = {} if os.environ.get("TVMA_VARIANT_SWEEP") == "1" else {"mla": (("split_tasks", 0),)}


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matches_the_reference(name):
    spec = AttentionSpec(**{**GQA, **KERNELS[name], "custom_mask": True})
    b = built(spec, knobs=KNOBS.get(name))
    assert b.audit.fused, b.audit
    r = validate_built(b)
    assert r.passed and r.finite, r


def call_names(spec):
    return [a["name"] for a in spec.arg_specs() if a["name"] not in ("o", "lse")]


def test_split_kv_and_rows_without_a_key():
    """One long sequence (split-KV into chunks), the mask's bits over all of its keys: the split
    build equals the reference; a row whose bits are all zero outputs zeros (lse -inf)."""
    spec = AttentionSpec(**{**GQA, **KERNELS["kvcache_lse"], "custom_mask": True})
    k, lay = kernel_of(built(spec)), spec.layout_info
    assert built(spec).knobs.split_tasks > 0
    x = lay.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [3000, 700], "max_len": 3000}, seed=3)
    rng = np.random.default_rng(0)
    masks = [rng.random((1, 3000)) < 0.6, np.zeros((1, 700), bool)]  # the second sequence sees nothing
    x["custom_mask"], x["mask_indptr"] = pack_mask(masks)
    o, lse = k(*[x[n] for n in call_names(spec)])
    ref, ref_lse = lay.reference_outputs(spec, x)
    np.testing.assert_allclose(o, ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse[0], ref_lse[0], atol=1e-5, rtol=1e-5)
    assert not o[1].any() and np.isneginf(lse[1]).all()


def test_tree_attention_with_the_drafts_appended():
    """Speculative decoding's verify step: 7 draft tokens per sequence, a tree of them
    (``parents``), appended to the cache in the same call; each draft attends to the prefix,
    itself and its ancestors: the tree written out as ancestors, per row, in float64. A tree of
    one node is the plain decode step. (The spec of ``bench --masks --tiny``'s tree point: built
    once for both.)"""
    spec = AttentionSpec(batch=TINY.batch, seq_q=TINY.drafts, seq_kv=TINY.cache, **GQA, layout="kvcache", append=True,
                         custom_mask=True)
    k, lay = kernel_of(built(spec)), spec.layout_info
    trees = [[-1, 0, 0, 1, 1, 2, -1], [-1, 0, 1, 2, 3, 4, 5]]  # branching with two roots; a chain
    prefix = [40, 13]
    x = lay.random_inputs(spec, {"seq_q": 7, "cache_seqlens": prefix, "max_len": 50}, seed=1)
    x["custom_mask"], x["mask_indptr"] = tree_masks(trees, prefix)
    before = {n: x[n].copy() for n in ("k_cache", "v_cache")}
    o = k(*[x[n] for n in call_names(spec)])
    for b, (parents, n) in enumerate(zip(trees, prefix)):
        keys = np.concatenate([before["k_cache"][b, :, :n], x["k_new"][b]], axis=1).astype(np.float64)
        vals = np.concatenate([before["v_cache"][b, :, :n], x["v_new"][b]], axis=1).astype(np.float64)
        for i in range(7):
            seen, j = list(range(n)), i
            while j >= 0:  # the draft and its ancestors
                seen.append(n + j)
                j = parents[j]
            for h in range(4):
                s = keys[h // 2, seen] @ x["q"][b, h, i].astype(np.float64) * spec.scale
                p = np.exp(s - s.max())
                np.testing.assert_allclose(o[b, h, i], p @ vals[h // 2, seen] / p.sum(), atol=1e-5, rtol=1e-5)
    # a tree of one node per sequence (one draft: the prefix and itself) is the plain decode step
    one = lay.random_inputs(spec, {"seq_q": 1, "cache_seqlens": prefix, "max_len": 50}, seed=2)
    one["custom_mask"], one["mask_indptr"] = tree_masks([[-1], [-1]], prefix)
    want = lay.reference_outputs(dataclasses.replace(spec, custom_mask=False),
                                 {n: a for n, a in one.items() if n not in ("custom_mask", "mask_indptr")})[0]
    np.testing.assert_allclose(k(*[one[n] for n in call_names(spec)]), want, atol=1e-5, rtol=1e-5)


def test_the_library_and_the_loader_check_the_bytes():
    """``mask_indptr`` must give each sequence ``ceil(rows · keys / 8)`` bytes from a start >= 0,
    inside ``custom_mask``; checked by the library itself (a C++ caller) and by the loader, in
    int64 (2³¹−1 does not wrap), with the shape of ``mask_indptr``."""
    import tvm

    spec = AttentionSpec(**{**GQA, **KERNELS["kvcache_lse"], "custom_mask": True})
    k, lay = kernel_of(built(spec)), spec.layout_info
    x = lay.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [30, 17], "max_len": 40}, seed=2)
    names = call_names(spec)
    need = [4, 3]  # ceil(30 / 8), ceil(17 / 8)
    assert np.diff(x["mask_indptr"]).tolist() == need
    bad = {"short": [0, 3, 6], "negative": [-1, 3, 6], "past the end": [0, 4, 8], "huge": [0, 4, 2 ** 31 - 1],
           "falls": [0, 4, 2]}
    out = [np.zeros((2, 4, 1, 32), np.float32), np.zeros((2, 4, 1), np.float32)]
    for what, ind in bad.items():
        given = dict(x, mask_indptr=np.asarray(ind, np.int32))
        with pytest.raises(ValueError, match="mask_indptr: a sequence's bytes"):
            k.function(*[tvm.runtime.tensor(given[n]) for n in names], *map(tvm.runtime.tensor, out))
        with pytest.raises(KernelArgumentError, match="mask_indptr: sequence"):
            k(*[given[n] for n in names])
    given = dict(x, mask_indptr=np.asarray([0, 4], np.int32))
    with pytest.raises(ValueError, match="mask_indptr: must hold batch . 1 entries"):
        k.function(*[tvm.runtime.tensor(given[n]) for n in names], *map(tvm.runtime.tensor, out))
    with pytest.raises(KernelArgumentError, match=r"mask_indptr: expected shape \(3,\)"):
        k(*[given[n] for n in names])


def test_the_loader_packs_a_boolean_mask(tmp_path):
    """``custom_mask=`` booleans ``(batch, rows, keys)`` (each sequence its first ``(rows,
    cache_seqlens[b])``), or a list of them, without ``mask_indptr``: the same result as the
    packed bytes; a wrong shape is named."""
    from tvm_attention.artifact import export
    from tvm_attention.loader import load

    spec = AttentionSpec(**{**GQA, **KERNELS["kvcache_lse"], "custom_mask": True})
    b = built(spec)
    export(b, tmp_path, validate_built(b))
    kernel = load(tmp_path)
    lens = [30, 17]
    x = spec.layout_info.random_inputs(spec, {"seq_q": 1, "cache_seqlens": lens, "max_len": 40}, seed=4)
    dense = np.random.default_rng(5).random((2, 1, 40)) < 0.5
    packed = pack_mask([dense[i, :, :n] for i, n in enumerate(lens)])
    want = kernel(x["q"], x["k_cache"], x["v_cache"], cache_seqlens=x["cache_seqlens"], custom_mask=packed[0],
                  mask_indptr=packed[1])
    got = kernel(x["q"], x["k_cache"], x["v_cache"], cache_seqlens=x["cache_seqlens"], custom_mask=dense)
    listed = kernel(x["q"], x["k_cache"], x["v_cache"], cache_seqlens=x["cache_seqlens"],
                    custom_mask=[dense[i, :, :n] for i, n in enumerate(lens)])
    for o in (got, listed):
        np.testing.assert_array_equal(o[0], want[0])
    with pytest.raises(KernelArgumentError, match=r"custom_mask: expected \(batch=2, rows, keys\) booleans"):
        kernel(x["q"], x["k_cache"], x["v_cache"], cache_seqlens=x["cache_seqlens"], custom_mask=dense[:, :, :20])


def test_cli_flag():
    import argparse

    from tvm_attention.cli import _add_spec_flags, _spec_from_args

    p = argparse.ArgumentParser()
    _add_spec_flags(p)
    a = p.parse_args(["--layout", "kvcache", "--heads", "8", "--head-dim", "64", "--custom-mask"])
    assert _spec_from_args(a).custom_mask


@pytest.mark.parametrize("name, rows, keys, hidden", [
    ("bhsd_symbolic", 64, 512, (128, 384)),  # the prefill nest, 2 row tiles
    ("kvcache_lse", 1, 3000, (1024, 2048)),  # a decode step: the packed tier, split into chunks
])
def test_key_tiles_no_row_sees_are_skipped(name, rows, keys, hidden):
    """Key tiles whose bits are all zero for every row of a row tile are not read: NaN in the
    K and V rows of the hidden keys (tile-aligned) leaves the output finite and equal to the
    reference's (as the key-bounds test proves its skipping)."""
    spec = AttentionSpec(**{**GQA, **KERNELS[name], "custom_mask": True})
    k, lay = kernel_of(built(spec)), spec.layout_info
    case = {"seq_q": rows, "cache_seqlens": [keys], "max_len": keys} if lay.is_cache else \
        {"batch": 1, "seq_q": rows, "seq_kv": keys}
    x = lay.random_inputs(spec, case, seed=6)
    m = np.random.default_rng(1).random((rows, keys)) < 0.7
    m[:, hidden[0]:hidden[1]] = False
    x["custom_mask"], x["mask_indptr"] = pack_mask([m])
    ref = lay.reference_outputs(spec, x)[0]
    kname, vname = lay.kv_names
    for n in (kname, vname):
        x[n] = x[n].copy()
        x[n][:, :, hidden[0]:hidden[1]] = np.nan  # (batch, kv heads, keys, d) in both layouts
    out = k(*[x[n] for n in call_names(spec)])
    o = out[0] if spec.return_lse else out
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, ref, atol=1e-5, rtol=1e-5)


def test_bench_masks_tiny(tmp_path):
    """``bench --masks --tiny``: the skipping point (no mask, all ones, mostly hidden), the tree
    verify against a causal append step and a shared prefix read once against each sequence
    reading it, written as masks.md/json (goals are the benchmark's). Its masked bhsd and tree
    kernels are bhsd_symbolic's and the tree test's builds (``TINY``), loaded from the run's build
    cache."""
    import json

    from tvm_attention import cli

    assert cli.main(["bench", "--masks", "--tiny", "--threads", "2", "--out", str(tmp_path)]) == 0
    skip, tree, shared = json.loads((tmp_path / "masks.json").read_text())["rows"]
    assert shared["point"] == "shared prefix" and shared["cascade_ms"] > 0 and shared["max_abs_diff"] < 1e-5
    assert skip["point"] == "skipping" and skip["hidden_share"] > 0.5
    assert min(skip["plain_ms"], skip["ones_ms"], skip["hidden_ms"]) > 0 and skip["hidden_vs_ones"] > 0
    assert tree["point"] == "tree verify" and tree["tree_ms"] > 0 and tree["causal_ms"] > 0
    assert "Tree verify" in (tmp_path / "masks.md").read_text()
