"""Attention variants (issue 26): sliding window, logit softcap, ALiBi, attention sinks and left
padding (kv_start) — the reference against the formulas written out, the spec and CLI forms, the
fused CPU kernel in every layout (its prefill nest, decode tiers and split-KV), and the loader's
and the library's checks."""
import argparse
import os

import numpy as np
import pytest

from tvm_attention import cli
from tvm_attention.artifact import kernel_of, validate_built
from tvm_attention.layouts import alibi_slopes
from tvm_attention.loader import KernelArgumentError
from tvm_attention.reference import reference_attention
from tvm_attention.spec import AttentionSpec, SpecError
from tvm_attention.visibility import Visibility

from conftest import built

ALL = dict(softcap=5.0, alibi=True, sinks=True, kv_start=True)


# -- the reference, written out ----------------------------------------------------------------
def naive(q, k, v, scale, left=-1, right=-1, softcap=None, slopes=None, sinks=None, start=None):
    """One (batch, head) of every variant, a loop per row: the semantics of docs/semantics.md."""
    sq, sk = q.shape[0], k.shape[0]
    o = np.zeros((sq, v.shape[1]))
    for i in range(sq):
        p = i + sk - sq
        js = [j for j in range(sk) if (right < 0 or j <= p + right) and (left < 0 or j >= p - left)
              and (start is None or j >= start)]
        if not js:
            continue
        x = np.array([q[i] @ k[j] * scale for j in js])
        if softcap:
            x = softcap * np.tanh(x / softcap)
        if slopes is not None:
            x = x - slopes * np.abs(p - np.array(js))
        w = np.exp(x - x.max())
        den = w.sum() + (np.exp(sinks - x.max()) if sinks is not None else 0.0)
        o[i] = (w[:, None] * v[js]).sum(0) / den
    return o


@pytest.mark.parametrize("sq, sk", [(5, 9), (9, 5), (7, 7), (1, 12)])
@pytest.mark.parametrize("window", [None, (0, 0), (2, 0), (3, 1), (-1, 2), (100, 0), (2, -1)])
def test_reference_matches_the_formulas(sq, sk, window):
    rng = np.random.default_rng(sq * 31 + sk)
    causal = window is not None and window[1] == 0
    spec = AttentionSpec(batch=2, heads=2, seq_q=sq, seq_kv=sk, head_dim=4, causal=causal, window=window, **ALL)
    q, k, v = (rng.standard_normal(s) for s in ((2, 2, sq, 4), (2, 2, sk, 4), (2, 2, sk, 4)))
    slopes, sinks, start = np.array([0.5, 0.25]), np.array([0.3, -2.0]), np.array([0, min(3, sk)])
    o, lse = reference_attention(spec, q, k, v, return_lse=True, alibi_slopes=slopes, sinks=sinks, kv_start=start)
    left, right = spec.window or (-1, 0 if causal else -1)
    for b in range(2):
        for h in range(2):
            want = naive(q[b, h], k[b, h], v[b, h], spec.scale, left, right, 5.0, slopes[h], sinks[h], start[b])
            np.testing.assert_allclose(o[b, h], want, atol=1e-12)
    assert np.isneginf(lse[~np.isfinite(lse)]).all()  # rows with no key: -inf, never NaN


@pytest.mark.parametrize("starts", [True, False], ids=["starts", "no-start"])
def test_visibility_with_a_window_agrees_with_its_mask(starts):
    """Every form of "does the row see a key" agrees with the mask: with a start (the general
    form) and without (a window open on the left, ``(-1, R)``, takes the plain kernels' forms
    unless R > 0: rows at p < −R see none; (30, 4) has such rows at R = 23)."""
    for left, right in [(0, 0), (3, 0), (2, 5), (-1, 1), (-1, 23), (4, -1), (40, 0), (-1, 0), (-1, -1)]:
        vis = Visibility(causal=right == 0, left=left, right=right, starts=starts)
        for sq, sk in [(1, 9), (6, 4), (9, 9), (13, 30), (30, 4)]:
            for start in (None, 0, 2, sk):
                mask = vis.mask(sq, sk, start)
                off = vis.offset(sq, sk)
                got = [bool(vis.sees_a_key(vis.position(i, off), sk, start)) for i in range(sq)]
                assert got == mask.any(axis=1).tolist(), (left, right, sq, sk, start)
                if start is None:
                    assert (vis.keys_seen(sq, sk) == mask.sum(1)).all()
                for r0 in range(sq):  # the key-tile range of rows r0.. covers every key they see
                    seen = np.nonzero(mask[r0:].any(0))[0]
                    begin = vis.key_begin(vis.position(r0, off), start)
                    assert seen.size == 0 or begin is None or seen.min() >= begin


def test_spec_forms_and_errors():
    s = AttentionSpec(batch=1, heads=2, seq_q=4, head_dim=8, window=(3, 0))
    assert s.causal and s.window == (3, 0) and "_w3_0" in s.short_name()
    assert AttentionSpec(batch=1, heads=2, seq_q=4, head_dim=8, causal=True, window=(-1, -1)).window is None
    assert AttentionSpec(batch=1, heads=2, seq_q=4, head_dim=8, causal=True, window=(5, -1)).window == (5, 0)
    assert AttentionSpec.from_dict(AttentionSpec(batch=1, heads=2, seq_q=4, head_dim=8, window=(2, 1),
                                                 **ALL).to_dict()).variants == ("window",) + tuple(ALL)
    plain = AttentionSpec(batch=1, heads=2, seq_q=4, head_dim=8)
    assert "window" not in plain.to_dict() and plain.variants == ()  # old manifests and logs compare equal
    for kw, word in [(dict(causal=True, window=(3, 2)), "causal"), (dict(window=(3,)), "window"),
                     (dict(window=(-2, 0)), "window"), (dict(softcap=-1.0), "softcap"),
                     (dict(alibi=1), "alibi"), (dict(layout="varlen", kv_start=True), "varlen")]:
        with pytest.raises(SpecError, match=word):
            AttentionSpec(batch=1, heads=2, seq_q=4, head_dim=8, **kw)


def test_cli_window_follows_causal():
    p = argparse.ArgumentParser()
    cli._add_spec_flags(p)
    base = ["--batch", "1", "--heads", "2", "--seq-q", "8", "--head-dim", "8"]
    assert cli._spec_from_args(p.parse_args(base + ["--window", "4"])).window == (4, -1)
    assert cli._spec_from_args(p.parse_args(base + ["--window", "4", "--causal"])).window == (4, 0)
    s = cli._spec_from_args(p.parse_args(base + ["--window", "4,2", "--softcap", "30", "--alibi", "--sinks",
                                                 "--kv-start"]))
    assert s.window == (4, 2) and s.softcap == 30.0 and s.alibi and s.sinks and s.kv_start
    with pytest.raises(SpecError, match="causal"):
        cli._spec_from_args(p.parse_args(base + ["--window", "4,2", "--causal"]))


def test_cli_takes_a_window_open_on_the_left_without_equals():
    """``--window -1,23`` as the docs write it: argparse takes a value that begins with "-" for an
    option ("expected one argument") unless it is a plain number; every command that takes a spec
    parses it, and ``-1`` alone, the ``=`` form and a window after ``--`` are as they were."""
    base = ["--batch", "1", "--heads", "2", "--seq-q", "8", "--head-dim", "8"]
    for argv in (["build", *base, "--window", "-1,23", "--out", "x"], ["run", "--window", "-1,23"],
                 ["tune", *base, "--window", "-1,23"], ["compare", *base, "--window", "-1,23", "fused", "materialized"],
                 ["build", *base, "--window=-1,23", "--out", "x"]):
        a = cli.parse_args(argv)
        assert cli._spec_from_args(a).window == (-1, 23), argv
    a = cli.parse_args(["compare", *base, "--window", "-1,23", "fused", "materialized"])
    assert a.schedules == ["fused", "materialized"]
    assert cli._spec_from_args(cli.parse_args(["run", "--window", "-1", "--causal"])).window is None  # (-1, 0): causal
    assert cli._join_negative_values(["--", "--window", "-1,2"]) == ["--", "--window", "-1,2"]
    with pytest.raises(SystemExit):  # a bad value still gets _window's message
        cli.parse_args(["run", "--window", "-1,2,3"])


def test_alibi_slopes_are_the_papers():
    assert np.allclose(alibi_slopes(8), [2 ** (-(i + 1)) for i in range(8)])
    assert np.allclose(alibi_slopes(4), [2 ** (-2 * (i + 1)) for i in range(4)])
    assert alibi_slopes(12).shape == (12,) and len(set(alibi_slopes(12).tolist())) == 12


# -- the kernel ------------------------------------------------------------------------------------
#: name -> spec: every layout; static and symbolic; the decode tiers and split-KV (kvcache, paged);
#: rows that see no key (seq_q > seq_kv, a start past them); window 0 and one wider than the
#: sequence; the dtypes (bf16: the dot-product form where the CPU has it; the decode tiers of a
#: bf16 cache)
KERNELS = {
    "bhsd_static_all": dict(batch=2, heads=4, kv_heads=2, seq_q=70, seq_kv=45, head_dim=32, causal=True,
                            window=(20, 0), return_lse=True, **ALL),
    "bhsd_dynamic_window_softcap": dict(batch=2, heads=4, kv_heads=2, seq_q=64, seq_kv=96, head_dim=32,
                                        window=(7, 3), softcap=2.0, dynamic=("batch", "seq_q", "seq_kv")),
    "bhsd_window0_alibi": dict(batch=1, heads=2, seq_q=33, head_dim=16, causal=True, window=(0, 0), alibi=True),
    "bhsd_wide_window_sinks_fp16": dict(batch=1, heads=2, seq_q=40, seq_kv=50, head_dim=32, causal=True,
                                        window=(500, 0), sinks=True, dtype="float16"),
    "bhsd_bf16_dynamic_all": dict(batch=1, heads=4, kv_heads=1, seq_q=64, seq_kv=64, head_dim=64, causal=True,
                                  window=(16, 0), dtype="bfloat16", dynamic=("seq_q", "seq_kv"), return_lse=True,
                                  **ALL),
    "kvcache_all_bf16": dict(layout="kvcache", batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=256, head_dim=64,
                             causal=True, window=(40, 0), return_lse=True, dtype="bfloat16", **ALL),
    "paged_all": dict(layout="paged", batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=256, head_dim=64,
                      causal=True, window=(33, 0), return_lse=True, **ALL),
    "varlen_all": dict(layout="varlen", batch=2, heads=4, kv_heads=2, seq_q=70, seq_kv=70, head_dim=32,
                       causal=True, window=(9, 0), softcap=2.0, alibi=True, sinks=True, return_lse=True),
    # a window open on the left and bounded on the right: rows at p < −R see no key (zeros, lse
    # −inf; they gave NaN). Static: 40 rows over 9 keys, the first 8; the others through the rows
    # their validation cases hold for it (the decode tiers: kvcache's 4 new tokens over 1 key)
    "bhsd_static_right_window": dict(batch=1, heads=2, seq_q=40, seq_kv=9, head_dim=16, window=(-1, 23),
                                     return_lse=True),
    "bhsd_dynamic_right_window": dict(batch=1, heads=4, kv_heads=2, seq_q=64, head_dim=16, window=(-1, 23),
                                      dynamic=("batch", "seq_q", "seq_kv"), return_lse=True),
    "varlen_right_window": dict(layout="varlen", batch=2, heads=4, kv_heads=2, seq_q=32, head_dim=16,
                                window=(-1, 40), return_lse=True),
    "kvcache_right_window": dict(layout="kvcache", batch=2, heads=4, kv_heads=2, seq_q=1, seq_kv=64, head_dim=16,
                                 window=(-1, 2), return_lse=True),
    "paged_right_window": dict(layout="paged", batch=2, heads=4, kv_heads=2, seq_q=1, seq_kv=64, head_dim=16,
                               window=(-1, 23), return_lse=True),
}


#: knobs of a build: kvcache without split-KV (three nests instead of five, half the build
#: time); paged keeps it (its split nests are the test of split-KV with the variants). The right
#: windows' rows without a key are in no split (a split needs 256 keys and more). The symbolic
#: bhsd builds' split-KV is their decode tiers', which no validation case of theirs runs (seq_q 64
#: and more: the prefill nest): built without it, about half their build time
#: (``scripts/variant_sweep.py`` builds them at the preset's knobs)
UNSPLIT = (("split_tasks", 0),)
KNOBS = {"kvcache_all_bf16": UNSPLIT, "kvcache_right_window": UNSPLIT, "paged_right_window": UNSPLIT}
if os.environ.get("TVMA_VARIANT_SWEEP") != "1":
    KNOBS.update(dict.fromkeys(("bhsd_dynamic_window_softcap", "bhsd_bf16_dynamic_all", "bhsd_dynamic_right_window"),
                               UNSPLIT))


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matches_the_reference(name):
    """validate_built runs every validation case of the layout (mixed lengths, empty caches,
    seq_q > seq_kv, several new tokens: the decode tiers, a long sequence: split-KV) with the
    variant arguments, against the float64 reference, o and lse."""
    b = built(AttentionSpec(**KERNELS[name]), knobs=KNOBS.get(name))
    assert b.audit.fused, b.audit.reasons
    r = validate_built(b)
    assert r.passed, r.format()


@pytest.mark.parametrize("window", [(-1, 23), (-1, 50), (100, 40)])
@pytest.mark.parametrize("layout, dynamic", [("bhsd", ("batch", "seq_q", "seq_kv")), ("bhsd", ("seq_kv",)),
                                             ("varlen", ()), ("kvcache", ()), ("paged", ())])
def test_validation_cases_hold_rows_a_right_window_leaves_without_a_key(layout, dynamic, window):
    """A window bounded on the right (R > 0) is validated on a row it leaves without a key while
    its sequence has keys (p < −R), in every layout whose lengths allow one (seq_q compiled in:
    60 rows over 60 − R − 3 keys); other specs' cases are as they were (a (7, 3) window's cases
    already hold such rows, but for seq_q compiled in)."""
    def rows_without_a_key(spec, case):
        vis = Visibility.of(spec)
        if layout == "bhsd":
            seqs = [(case["seq_q"], case["seq_kv"])]
        elif layout == "varlen":
            seqs = case["seqlens"]
        else:
            seqs = [(case["seq_q"], n) for n in case["cache_seqlens"]]
        return any(sk > 0 and (vis.keys_seen(sq, sk) == 0).any() for sq, sk in seqs)

    kw = dict(batch=1, heads=2, seq_q=60, head_dim=8, layout=layout, dynamic=dynamic)
    spec = AttentionSpec(window=window, **kw)
    assert any(rows_without_a_key(spec, c) for c in spec.layout_info.validation_cases(spec)), (layout, window)
    others = [dict(causal=True), dict(window=(5, -1)), {}] + ([dict(window=(7, 3))] if "seq_q" in spec.dynamic else [])
    for other in others:
        s = AttentionSpec(**kw, **other)
        assert s.layout_info.validation_cases(s) == AttentionSpec(**kw).layout_info.validation_cases(AttentionSpec(**kw))
    appending = AttentionSpec(**{**kw, "layout": "kvcache", "dynamic": ()}, window=window, append=True)
    assert len(appending.layout_info.validation_cases(appending)) == 4  # a row sees its own key: none to add


def test_split_kv_sees_only_the_window():
    """A decode step against a long cache with a window: one sequence, so split-KV chunks the
    window's keys (not the cache's); rows see exactly the reference's keys."""
    spec = AttentionSpec(**KERNELS["paged_all"])
    k = kernel_of(built(spec, knobs=KNOBS.get("paged_all")))
    case = {"seq_q": 1, "cache_seqlens": [3000]}
    x = spec.layout_info.random_inputs(spec, case, seed=3)
    x["kv_start"] = np.array([1000], np.int32)
    o, lse = k(*x.values())
    ref, ref_lse = spec.layout_info.reference_outputs(spec, x)
    np.testing.assert_allclose(o, ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_loader_keywords_and_checks():
    spec = AttentionSpec(**KERNELS["bhsd_static_all"])
    k = kernel_of(built(spec))
    x = spec.layout_info.random_inputs(spec, {"batch": 2, "seq_q": 70, "seq_kv": 45})
    q, kk, v = x["q"], x["k"], x["v"]
    kw = dict(alibi_slopes=x["alibi_slopes"], sinks=x["sinks"])
    o, _ = k(q, kk, v, cache_leftpad=x["kv_start"], window_size=(20, 0), softcap=5.0, causal=True, **kw)
    np.testing.assert_allclose(o, spec.layout_info.reference(spec, x), atol=1e-4, rtol=1e-4)
    for bad, word in [(dict(window_size=(10, 0)), "window"), (dict(softcap=3.0), "softcap"),
                      (dict(kv_start=np.array([0, 46], np.int32)), "kv_start")]:
        with pytest.raises(KernelArgumentError, match=word):
            k(q, kk, v, **{"kv_start": x["kv_start"], **kw, **bad})
    # the library checks kv_start itself (serving code calls it without our loader)
    import tvm_ffi

    args = [q, kk, v, x["alibi_slopes"], x["sinks"], np.array([0, 46], np.int32),
            np.empty_like(q), np.empty((2, 4, 70), np.float32)]
    with pytest.raises(ValueError, match="kv_start"):
        k.function(*[tvm_ffi.from_dlpack(a) for a in args])


def test_plain_kernel_names_a_variant_it_was_not_built_with():
    spec = AttentionSpec(batch=1, heads=2, seq_q=8, head_dim=16)
    k = kernel_of(built(spec))
    q = np.zeros((1, 2, 8, 16), np.float32)
    assert k(q, q, q, alibi_slopes=None, cache_leftpad=None).shape == q.shape  # FlashAttention's defaults
    with pytest.raises(KernelArgumentError, match="alibi"):
        k(q, q, q, alibi_slopes=np.ones(2, np.float32))


def test_other_families_refuse_variants_by_name():
    from tvm_attention.schedules import check, get_schedule
    from tvm_attention.schedules._knobs import KnobError
    from tvm_attention.target import resolve_target

    base = dict(batch=1, heads=2, seq_q=64, head_dim=64, causal=True)
    # the CUDA kernels build the five variants (test_cuda.py) and what the call decides
    # (test_cuda_call_masks.py), but the Hopper kernel not the latter; the baselines none
    for name, target, over, refused in [
        ("fused_hopper", "cuda", dict(dtype="float16", window=(8, 0), key_bounds=True), "key_bounds"),
        ("materialized", "llvm", dict(window=(8, 0), softcap=30.0), "window, softcap"),
    ]:
        t = resolve_target(target, arch="sm_90") if target == "cuda" else resolve_target(target)
        fam = get_schedule(name, t)
        s = AttentionSpec(**base, **over)
        with pytest.raises(KnobError, match=f"variant\\(s\\) {refused} "):
            check(fam, fam.preset(s, t), s, t)


def test_variants_bench_smoke(tmp_path):
    """The speed-goal benchmark (`tvm-attention bench --variant-costs`) at tiny shapes: every pair it runs
    times both kernels side by side and reports a ratio against its goal; the report is written.
    The window pair at the softcap pair's length (256, a window of 128): both pairs' baseline, the
    plain causal prefill, is one build (the benchmark builds each spec once; tiny's 512 is a fourth)."""
    import dataclasses
    import json

    from tvm_attention.bench import variants

    names = ("window_prefill", "softcap_prefill")
    tiny = variants.quick_config()
    report = variants.run(dataclasses.replace(tiny, seq=tiny.short_seq), threads=1, only=names, say=lambda m: None)
    assert [r["name"] for r in report["rows"]] == list(names)
    for r in report["rows"]:
        assert r["variant_ms"] > 0 and r["baseline_ms"] > 0 and r["ratio"] > 0 and r["goal"] == variants.GOALS[r["name"]][0]
    assert "_w127_0" in report["rows"][0]["variant"] and "_cap" in report["rows"][1]["variant"]
    paths = variants.write(report, tmp_path)
    assert json.loads(paths["json"].read_text())["rows"][0]["name"] == "window_prefill"
    assert "| window_prefill |" in paths["md"].read_text()


def test_merge_states_applies_sinks_once():
    """Two key halves' states (computed without sinks) merged with sinks= equal attention with
    sinks over all the keys; lse stays the keys'."""
    from tvm_attention import merge_states

    spec = AttentionSpec(batch=2, heads=3, seq_q=5, seq_kv=12, head_dim=8)
    with_sinks = AttentionSpec(**{**spec.to_dict(), "sinks": True})
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 5, 8), (2, 3, 12, 8), (2, 3, 12, 8)))
    sinks = np.array([0.5, -1.0, 3.0])
    oa, la = reference_attention(spec, q, k[:, :, :7], v[:, :, :7], return_lse=True)
    ob, lb = reference_attention(spec, q, k[:, :, 7:], v[:, :, 7:], return_lse=True)
    o, lse = merge_states(oa, la, ob, lb, sinks=sinks.reshape(3, 1))
    want, want_lse = reference_attention(with_sinks, q, k, v, return_lse=True, sinks=sinks)
    np.testing.assert_allclose(o, want, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5)
    with pytest.raises(ValueError, match="sinks"):
        merge_states(oa, la, ob, lb, sinks=np.zeros(4))
