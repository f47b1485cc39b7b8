"""A prefix shared by many sequences, read once (issue 45 item 4, ``tvm_attention.cascade``): the
stacked queries attend to the prefix in one pass, each sequence to its own suffix, and the
merged states equal the reference over prefix + suffix, in the kvcache and paged layouts, with
sinks (joined once), lse, several tokens per sequence and a suffix of the new tokens alone."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from tvm_attention import cascade
from tvm_attention.artifact import kernel_of
from tvm_attention.layouts import paged_from_contiguous
from tvm_attention.masks import pack_mask
from tvm_attention.reference import reference_attention
from tvm_attention.spec import AttentionSpec, SpecError

from conftest import built

N, H, KH, D, P = 4, 8, 2, 32, 300
SUFFIX = [5, 0, 17, 40]

#: ``scripts/variant_sweep.py`` sets this: the plain paged cascade too, every kernel at its preset
#: knobs
SWEEP = os.environ.get("TVMA_VARIANT_SWEEP") == "1"
#: knobs that never split the keys (split-KV's nests left out: about half the build time)
UNSPLIT = (("split_tasks", 0),)


def kernels(spec):
    """The prefix and suffix kernels of ``spec``, built once per session. Split-KV's nests only
    where a call here splits: the prefix pass of 16 stacked rows (N·Sq·G, Sq 1) runs a packed decode
    tier that reads its 300 keys in two chunks; 32 and 48 rows (Sq 2 and 3) run the prefill nest,
    which never splits (the same output bit for bit); the suffixes hold at most 43 keys, under one
    chunk (``fused.MIN_SPLIT_KEYS``: 256), where a split nest reads a sequence's keys as the
    unsplit one does. A suffix kernel is the serving spec's own (its modifiers shifted by the
    prefix's length, read alike by every nest), whose split-KV over several chunks with each
    variant test_variants (paged_all), test_modifiers (paged_doc_bounds_split) and
    test_custom_mask (test_split_kv_and_rows_without_a_key) check."""
    stacked = N * spec.seq_q * spec.group_size
    prefix_knobs = None if SWEEP or stacked <= 16 else UNSPLIT
    return (kernel_of(built(cascade.prefix_spec(spec), knobs=prefix_knobs)),
            kernel_of(built(cascade.suffix_spec(spec), knobs=None if SWEEP else UNSPLIT)))


#: (layout, Sq, sinks) of the plain cascade. The kernels take no sinks (the merge joins them once):
#: the kvcache case's are the error tests' too. A paged cache: the variant case
#: ``append-mods-bounds-mask`` (its prefix and suffix read through block tables as a plain one's do;
#: ``scripts/variant_sweep.py`` runs the plain paged case, 2 tokens per sequence, beside it); several
#: tokens per sequence: both variant cases
PLAIN_CASES = [("kvcache", 1, True)] + ([("paged", 2, True)] if SWEEP else [])


@pytest.mark.parametrize("layout, sq, sinks", PLAIN_CASES)
def test_shared_prefix_equals_the_reference(layout, sq, sinks):
    spec = AttentionSpec(batch=N, heads=H, kv_heads=KH, seq_q=sq, seq_kv=64, head_dim=D, causal=True, layout=layout,
                         sinks=sinks, page_size=16 if layout == "paged" else None)
    kp, ks = kernels(spec)
    rng = np.random.default_rng(sq)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, pk, pv = f32(N, H, sq, D), f32(1, KH, P, D), f32(1, KH, P, D)
    lens = np.asarray([n + sq for n in SUFFIX], np.int32)  # the suffixes hold the new tokens' keys too
    sk, sv = f32(N, KH, int(lens.max()), D), f32(N, KH, int(lens.max()), D)
    sink = f32(H) if sinks else None
    if layout == "kvcache":
        prefix = (pk, pv, np.asarray([P], np.int32))
        suffix = (sk, sv, lens)
    else:
        kpp, table = paged_from_contiguous(pk, 16, np.random.default_rng(1))
        vpp, _ = paged_from_contiguous(pv, 16, np.random.default_rng(1))
        prefix = (kpp, vpp, table, np.asarray([P], np.int32))
        skp, stable = paged_from_contiguous(sk, 16, np.random.default_rng(2))
        svp, _ = paged_from_contiguous(sv, 16, np.random.default_rng(2))
        suffix = (skp, svp, stable, lens)
    o, lse = cascade.attend(kp, ks, q, prefix, suffix, sinks=sink)
    for n in range(N):  # each sequence over prefix + its suffix, causal bottom-right
        k = np.concatenate([pk, sk[n:n + 1, :, :lens[n]]], axis=2)
        v = np.concatenate([pv, sv[n:n + 1, :, :lens[n]]], axis=2)
        ref, ref_lse = reference_attention(spec, q[n:n + 1], k, v, return_lse=True, sinks=sink)
        np.testing.assert_allclose(o[n:n + 1], ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(lse[n:n + 1], ref_lse, atol=1e-5, rtol=1e-5)


#: the variants' pairs: (layout, Sq, spec keywords). Each pair turns on several at once (a build
#: per pair): what hides keys (a left window, kv_start, key bounds, a custom mask) becomes the
#: prefix kernel's bits, ALiBi and the modifiers read each stacked row's position, the suffix's
#: shift by the prefix's length, append writes the new keys
VARIANT_CASES = [
    ("kvcache", 2, dict(window=(40, 0), alibi=True, kv_start=True, softcap=20.0, sinks=True)),
    ("paged", 3, dict(append=True, key_bounds=True, custom_mask=True, mod_tensors=(("w", "float32", ("batch",)),),
                      score_mod="def f(s, b, h, q, kv):\n    t = s + w[b] * 0.5\n    return t - 0.002 * (q - kv) * (h % 3)",
                      mask_mod="lambda b, h, q, kv: (q + kv + h) % 5 != 0")),
]


def variant_spec(layout, sq, kw, dtype="float32"):
    return AttentionSpec(batch=N, heads=H, kv_heads=KH, seq_q=sq, seq_kv=64, head_dim=D, causal=True, layout=layout,
                         page_size=16 if layout == "paged" else None, dtype=dtype, **kw)


def variant_inputs(spec, seed=7):
    """``(q, prefix, suffix, args, sinks)`` of a cascade call of ``spec`` (a variant case): ``P``
    prefix keys, the suffixes of ``SUFFIX``, the variants' arguments over whole sequences (a window
    that hides NaN prefix keys from every query, key bounds starting inside the prefix, a row that
    sees no key), NumPy arrays of the spec's dtype."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    dt = lambda x: x.astype(spec.np_dtype)  # noqa: E731
    sq, append = spec.seq_q, spec.append
    q, pk, pv = dt(f32(N, H, sq, D)), dt(f32(1, KH, P, D)), dt(f32(1, KH, P, D))
    lens = np.asarray([n + (0 if append else sq) for n in SUFFIX], np.int32)
    cap = int(lens.max()) + sq * append
    sk, sv = dt(f32(N, KH, cap, D)), dt(f32(N, KH, cap, D))
    keys = [P + int(x) + sq * append for x in lens]  # each sequence's whole keys
    args = {}
    if spec.alibi:
        args["alibi_slopes"] = np.abs(f32(H)) * 0.05
    if spec.kv_start:  # inside the prefix, at its end, inside a suffix
        args["kv_start"] = np.asarray([0, 120, P, P + 9], np.int32)
    if spec.append:
        args["k_new"], args["v_new"] = dt(f32(N, KH, sq, D)), dt(f32(N, KH, sq, D))
    if spec.key_bounds:  # documents over whole sequences, some starting inside the prefix
        lo = np.sort(rng.integers(-5, P + 30, (N, 360)), axis=1).astype(np.int32)
        args["key_lo"], args["key_hi"] = lo, np.maximum(lo + rng.integers(40, 400, (N, 1)), lo).astype(np.int32)
        args["key_hi"][:, -1] = np.iinfo(np.int32).max
        args["key_lo"][0] = np.iinfo(np.int32).min
    if spec.custom_mask:
        args["custom_mask"] = [rng.random((sq, k)) < 0.8 for k in keys]
        args["custom_mask"][1][0, :] = False  # a row with no visible key: zeros
    for name, _, _ in spec.mod_tensors:
        args[name] = f32(N)
    sink = f32(H) if spec.sinks else None
    if spec.layout == "kvcache":  # NaN in the prefix keys the window hides from every query: never read
        hidden = np.where(np.arange(P)[:, None] < 200, np.float32(np.nan), np.float32(0))
        prefix, suffix = (dt(pk + hidden), dt(pv + hidden), np.asarray([P], np.int32)), (sk, sv, lens)
    else:
        kpp, table = paged_from_contiguous(pk, 16, np.random.default_rng(1))
        vpp, _ = paged_from_contiguous(pv, 16, np.random.default_rng(1))
        skp, stable = paged_from_contiguous(sk, 16, np.random.default_rng(2))
        svp, _ = paged_from_contiguous(sv, 16, np.random.default_rng(2))
        prefix, suffix = (kpp, vpp, table, np.asarray([P], np.int32)), (skp, svp, stable, lens)
    return q, prefix, suffix, args, sink


def check_variant_outputs(spec, inputs, o, lse, atol=2e-5, rtol=1e-5):
    """``(o, lse)`` of the cascade over ``inputs`` (:func:`variant_inputs`; the caches after the
    call) against the float64 reference, each sequence over prefix + its suffix (+ its new keys),
    causal bottom-right; appended keys written after each sequence's own."""
    q, prefix, suffix, args, sink = inputs
    sq, append = spec.seq_q, spec.append
    lens = suffix[-1]
    if spec.layout == "kvcache":  # the NaN keys the window hides, as any value to the reference
        pk, pv = (np.nan_to_num(x, nan=0.0) for x in prefix[:2])
        sk, sv = suffix[0], suffix[1]
    else:  # the pages back in order (the prefix's table is one sequence's)
        unpage = lambda pages, table: pages[table].transpose(0, 3, 1, 2, 4).reshape(  # noqa: E731
            table.shape[0], KH, -1, D)
        pk, pv = unpage(prefix[0], prefix[2])[:, :, :P], unpage(prefix[1], prefix[2])[:, :, :P]
        sk, sv = unpage(suffix[0], suffix[2]), unpage(suffix[1], suffix[2])
    ref_spec = dataclasses.replace(spec, layout="bhsd", append=False, page_size=None)
    for n in range(N):
        k = np.concatenate([pk, sk[n:n + 1, :, :lens[n]]] + ([args["k_new"][n:n + 1]] if append else []), axis=2)
        v = np.concatenate([pv, sv[n:n + 1, :, :lens[n]]] + ([args["v_new"][n:n + 1]] if append else []), axis=2)
        extra = {key: args[key] for key in ("key_lo", "key_hi") if key in args}  # seq_index picks row n
        if spec.kv_start:
            extra["kv_start"] = args["kv_start"][n:n + 1]
        if spec.custom_mask:
            extra["custom_mask"] = pack_mask(args["custom_mask"])  # the batch's: seq_index picks n's
        ref, ref_lse = reference_attention(ref_spec, q[n:n + 1], k, v, return_lse=True, sinks=sink,
                                           alibi_slopes=args.get("alibi_slopes"), seq_index=n,
                                           mod_tensors={t[0]: args[t[0]] for t in spec.mod_tensors}, **extra)
        np.testing.assert_allclose(np.asarray(o[n:n + 1], np.float64), ref, atol=atol, rtol=rtol)
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[n:n + 1][finite], ref_lse[finite], atol=atol, rtol=rtol)
    if spec.custom_mask:
        assert not o[1, :, 0].any()  # the row with no visible key
    if append:  # the new keys were written into the suffix cache, after each sequence's own
        for n in range(N):
            np.testing.assert_array_equal(sk[n, :, lens[n]:lens[n] + sq], args["k_new"][n])


@pytest.mark.parametrize("layout, sq, kw", VARIANT_CASES, ids=["window-alibi-kvstart", "append-mods-bounds-mask"])
def test_shared_prefix_with_positional_variants(layout, sq, kw):
    spec = variant_spec(layout, sq, kw)
    kp, ks = kernels(spec)
    x = variant_inputs(spec)
    o, lse = cascade.attend(kp, ks, *x[:3], sinks=x[4], **x[3])
    check_variant_outputs(spec, x, o, lse)


def test_torch_tensors_are_answered_in_torch():
    """Torch tensors in, torch tensors out: ``q`` stacked and the outputs unstacked with torch's
    ops, the states merged with torch's (on a GPU they stay on it: ``merge_states``), the host
    reading lengths, key bounds and masks from the tensors; the results are the NumPy call's."""
    torch = pytest.importorskip("torch")
    spec = variant_spec(*VARIANT_CASES[1])
    kp, ks = kernels(spec)
    x = variant_inputs(spec)
    t = lambda a: torch.from_numpy(np.asarray(a)).clone()  # noqa: E731 - torch's (aligned) copy: append writes it
    tx = (t(x[0]), tuple(map(t, x[1])), tuple(map(t, x[2])),
          {k: [t(m) for m in v] if isinstance(v, list) else t(v) for k, v in x[3].items()}, None)
    o, lse = cascade.attend(kp, ks, *tx[:3], **tx[3])
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor) and o.dtype == torch.float32
    check_variant_outputs(spec, (x[0], tuple(a.numpy() for a in tx[1]), tuple(a.numpy() for a in tx[2]), x[3], None),
                          o.numpy(), lse.numpy())
    o_np, lse_np = cascade.attend(kp, ks, *x[:3], **x[3])
    np.testing.assert_allclose(o.numpy(), o_np, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(lse_np))


def test_stacking_round_trips_and_bad_input_is_named():
    q = np.random.default_rng(0).standard_normal((3, 8, 2, 4)).astype(np.float32)
    s = cascade.stack_queries(q, 2)
    assert s.shape == (1, 2, 3 * 2 * 4, 4)
    np.testing.assert_array_equal(s[0, 1, (2 * 2 + 1) * 4 + 3], q[2, 1 * 4 + 3, 1])  # row (n·Sq + s)·G + g
    np.testing.assert_array_equal(cascade.unstack(s, 3, 8, 2), q)
    torch = pytest.importorskip("torch")  # on the tensor's device, with torch's ops (meta: no data to copy)
    np.testing.assert_array_equal(cascade.stack_queries(torch.from_numpy(q), 2).numpy(), s)
    st = cascade.stack_queries(torch.empty(3, 8, 2, 4, device="meta"), 2)
    assert st.device.type == "meta" and cascade.unstack(st, 3, 8, 2).shape == (3, 8, 2, 4)
    base = dict(batch=1, heads=8, kv_heads=2, seq_q=1, head_dim=32, causal=True, layout="kvcache")
    with pytest.raises(SpecError, match="kvcache or paged"):
        cascade.prefix_spec(AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=1, head_dim=32))
    with pytest.raises(SpecError, match="'cascade_x'.*the cascade's own"):
        cascade.suffix_spec(AttentionSpec(**base, mask_mod="lambda b, h, q, cascade_x: q >= cascade_x"))
    with pytest.raises(SpecError, match="'cascade_pos'.*the cascade's own"):
        cascade.prefix_spec(AttentionSpec(**base, score_mod="lambda s, b, h, q, kv: s + cascade_pos[b]",
                                          mod_tensors=(("cascade_pos", "float32", ("batch",)),)))


def test_a_query_inside_the_prefix_and_stray_arguments_are_refused():
    spec = AttentionSpec(batch=N, heads=H, kv_heads=KH, seq_q=1, seq_kv=64, head_dim=D, causal=True, layout="kvcache")
    kp, ks = kernels(spec)  # the first test's (built once)
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    prefix = (z(1, KH, P, D), z(1, KH, P, D), np.asarray([P], np.int32))
    with pytest.raises(SpecError, match="sequence 1's suffix holds 0 keys, fewer than its 1 queries"):
        cascade.attend(kp, ks, z(N, H, 1, D), prefix, (z(N, KH, 8, D), z(N, KH, 8, D), np.asarray([2, 0, 2, 2], np.int32)))
    with pytest.raises(SpecError, match="unexpected argument.*kv_start"):
        cascade.attend(kp, ks, z(N, H, 1, D), prefix, (z(N, KH, 8, D), z(N, KH, 8, D), np.full(N, 2, np.int32)),
                       kv_start=np.zeros(N, np.int32))


def _refused(call, match: str):
    """``call()`` raises a ValueError matching ``match`` (which names the caller's argument) that
    names nothing of the prefix pass's own: neither its batch of 1 nor a ``cascade_*`` tensor."""
    with pytest.raises(ValueError, match=match) as e:
        call()
    text = str(e.value)
    assert "batch=1" not in text and "cascade_" not in text, text


def test_errors_name_the_callers_arguments_not_the_stacked_rows(monkeypatch):
    """The prefix pass calls its kernel with every sequence's rows stacked as one sequence, ``q
    (1, KH, N·Sq·G, D)``: its errors named that shape (``q: expected shape (batch, 2, seq_q, 32)
    ..., got (1, 2, 16, 16)``, ``k_cache: dim 0 (batch) is 2, but q has batch=1``; issue 62). The
    cascade checks the caller's arguments first and names them, and says which pass a kernel's
    own error comes from."""
    spec = AttentionSpec(batch=N, heads=H, kv_heads=KH, seq_q=1, seq_kv=64, head_dim=D, causal=True, layout="kvcache")
    kp, ks = kernels(spec)  # the first test's (built once)
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    prefix = (z(1, KH, P, D), z(1, KH, P, D), np.asarray([P], np.int32))
    suffix = (z(N, KH, 8, D), z(N, KH, 8, D), np.full(N, 2, np.int32))
    q = z(N, H, 1, D)
    for bad, match in ((z(N, H, 1, 16), r"cascade: q: expected float32 \(N, 8, Sq, 32\) \(N sequences of Sq queries\), "
                                        r"got float32 \(4, 8, 1, 16\)"),
                       (z(N, H, D), r"cascade: q: expected .*, got float32 \(4, 8, 32\)"),
                       (z(N, 6, 1, D), r"cascade: q: expected .*, got float32 \(4, 6, 1, 32\)"),
                       (np.zeros((N, H, 1, D)), r"cascade: q: expected float32 .*, got float64 \(4, 8, 1, 32\)")):
        _refused(lambda: cascade.attend(kp, ks, bad, prefix, suffix), match)
    two = (z(2, KH, P, D), z(2, KH, P, D), np.asarray([P, P], np.int32))
    _refused(lambda: cascade.attend(kp, ks, q, two, suffix),
             r"cascade: prefix: cache_seqlens holds 2 lengths; the shared prefix is one sequence")
    _refused(lambda: cascade.attend(kp, ks, q, (two[0], two[1], prefix[2]), suffix),
             r"cascade: prefix: k_cache: dim 0 is 2; the shared prefix is one sequence "
             r"\(k_cache \(1, 2, max_len, 32\)\)")
    _refused(lambda: cascade.attend(kp, ks, z(3, H, 1, D), prefix, suffix),
             r"cascade: suffix: cache_seqlens holds 4 lengths, q 3 sequences")
    _refused(lambda: cascade.attend(kp, ks, q, (z(1, KH, P, 16), z(1, KH, P, 16), prefix[2]), suffix),
             r"cascade: prefix: k_cache: expected shape \(batch, 2, max_len, 32\) .*got \(1, 2, 300, 16\)")
    _refused(lambda: cascade.attend(kp, ks, q, prefix, (z(N, KH, 8, 16), *suffix[1:])),
             r"cascade: suffix: k_cache: expected shape")
    _refused(lambda: cascade.attend(kp, ks, q, prefix, suffix, sinks=z(H - 1)),
             r"cascade: sinks: expected \(8,\) \(one per query head\), got float32 \(7,\)")
    # the stacked rows are one sequence, of at most MAX_SEQ_LEN rows (16 here; 4 sequences · 2 queries · 4 query
    # heads per kv head stack 32)
    monkeypatch.setattr(cascade, "MAX_SEQ_LEN", 16)
    _refused(lambda: cascade.attend(kp, ks, z(N, H, 2, D), prefix, suffix),
             r"cascade: q \(4, 8, 2, 32\) stacks 4 · 2 · 4 = 32 rows .*more than the 16 .*split the batch")


def test_variant_argument_errors_name_the_callers_values():
    """ALiBi's slopes went to the prefix kernel as its ``cascade_slopes``, ``kv_start`` was checked
    after its shift by the prefix's length (``kv_start[1]=999700 must be in [0, 7]`` for a caller's
    1000000 against 307 keys), a short ``kv_start`` raised NumPy's IndexError and a missing argument
    a KeyError; the key bounds were checked over the suffix's shifted columns only: each is now
    named as the caller passed it (issue 62)."""
    layout, sq, kw = VARIANT_CASES[0]  # window, alibi, kv_start, softcap, sinks (built by its test)
    spec = AttentionSpec(batch=N, heads=H, kv_heads=KH, seq_q=sq, seq_kv=64, head_dim=D, causal=True, layout=layout,
                         **kw)
    kp, ks = kernels(spec)
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    lens = np.full(N, 7, np.int32)
    prefix = (z(1, KH, P, D), z(1, KH, P, D), np.asarray([P], np.int32))
    suffix = (z(N, KH, 8, D), z(N, KH, 8, D), lens)
    good = dict(alibi_slopes=np.full(H, 0.1, np.float32), kv_start=np.zeros(N, np.int32))
    for bad, match in (
            (dict(alibi_slopes=np.full((1, H), 0.1, np.float32)),
             r"cascade: alibi_slopes: expected \(8,\) \(one per query head\), got float32 \(1, 8\)"),
            (dict(alibi_slopes=None), r"cascade: missing alibi_slopes"),
            (dict(kv_start=np.zeros(N - 1, np.int32)),
             r"cascade: kv_start: expected integers \(4,\) \(one per sequence\), got int32 \(3,\)"),
            (dict(kv_start=np.zeros(N, np.float32)), r"cascade: kv_start: expected integers .*, got float32 \(4,\)"),
            (dict(kv_start=np.asarray([0, 10**6, 0, 0], np.int32)),
             r"cascade: kv_start\[1\]=1000000 must be in \[0, 307\] \(the sequence's keys"),
            (dict(kv_start=np.asarray([0, -1, 0, 0], np.int32)), r"cascade: kv_start\[1\]=-1 must be in \[0, 307\]")):
        args = {k: v for k, v in {**good, **bad}.items() if v is not None}
        _refused(lambda: cascade.attend(kp, ks, z(N, H, sq, D), prefix, suffix, sinks=z(H), **args), match)
    # the key bounds over whole sequences (prefix columns included), as the caller passed them
    bounds = AttentionSpec(batch=N, heads=H, kv_heads=KH, seq_q=sq, seq_kv=64, head_dim=D, layout="kvcache",
                           key_bounds=True)
    lo, hi = np.zeros((N, 400), np.int32), np.tile(np.arange(400, dtype=np.int32), (N, 1))
    falls = hi.copy()
    falls[2, 7] = 3  # inside the prefix's positions
    for bad, match in ((dict(key_lo=lo[:3]), r"cascade: key_lo: expected integers \(4, positions\) \(a row per "
                                              r"sequence\), got int32 \(3, 400\)"),
                       (dict(key_hi=hi[0]), r"cascade: key_hi: expected integers .*, got int32 \(400,\)"),
                       (dict(key_hi=falls), r"cascade: key_hi: must be non-decreasing along the positions, but "
                                            r"key_hi\[2, 7\]=3 < key_hi\[2, 6\]=6")):
        args = {"key_lo": lo, "key_hi": hi, **bad}
        _refused(lambda: cascade._check_variant_args(bounds, N, H, np.full(N, P + 9), args), match)
