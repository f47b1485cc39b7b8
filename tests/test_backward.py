"""The fused CPU backward, first step (issue 46; ``tvm_attention.backward``): dQ, dK, dV of
BHSD float32 static specs against the float64 reference backward at awkward lengths (GQA, Sq ≠
Skv, tails of both tiles, rows that see no key), causal, a window and a softcap; its audit
passes, and fails when a tile is the whole score matrix; what it does not build yet is refused."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tvm.target import Target

from tvm_attention.artifact import kernel_of
from tvm_attention.backward import BackwardKnobs, build_backward
from tvm_attention.masks import pack_mask
from tvm_attention.reference import reference_attention, reference_attention_backward
from tvm_attention.spec import AttentionSpec, SpecError
from tvm_attention.target import TargetError, resolve_target

from conftest import built

CASES = {  # (batch, heads, kv_heads, seq_q, seq_kv, head_dim, spec keywords)
    "gqa_tails": (2, 4, 2, 45, 77, 16, dict()),
    "causal_softcap_sq_gt_skv": (1, 2, 1, 70, 40, 32, dict(causal=True, softcap=5.0)),  # 30 rows see no key
    "window_mha": (1, 3, 3, 64, 96, 24, dict(window=(20, 3))),
    "alibi_sinks_causal_gqa": (2, 4, 1, 50, 50, 16, dict(causal=True, alibi=True, sinks=True, softcap=8.0)),
    "kv_start_window": (3, 2, 2, 40, 90, 16, dict(kv_start=True, window=(50, -1))),  # starts: 0, a tile's middle, past all
    # documents by mask_mod over a tensor, key bounds (a row with none), random custom bits, causal
    "masks_mod_bounds_custom": (2, 4, 2, 37, 70, 16, dict(
        causal=True, key_bounds=True, custom_mask=True, mod_tensors=(("doc", "int32", ("batch", "seq_kv")),),
        mask_mod="lambda b, h, q_idx, kv_idx: (doc[b, kv_idx] == doc[b, q_idx]) | (h == 3)")),
    # score_mod's derivative after a softcap and ALiBi: a learned relative bias (a float tensor),
    # smooth words, and a -inf arm hiding keys by the score
    "score_mod_bias": (2, 4, 2, 45, 70, 16, dict(
        causal=True, softcap=6.0, alibi=True, mod_tensors=(("bias", "float32", ("heads", 160)),),
        score_mod="lambda s, b, h, q, kv: where(q - kv > 40, -inf, s * sigmoid(s) + bias[h, q - kv + 80] "
                  "- 0.1 * sqrt(s * s + 1))")),
}


def _mask_args(spec, rng):
    """The spec's key bounds (rows 0–5 of sequence 0 see none), custom mask (~70 % of the
    pairs), documents of 1–30 keys and a relative bias: the kernel's arguments and the reference's."""
    b, sq, skv = spec.batch, spec.seq_q, spec.seq_kv
    kernel, ref = {}, {}
    if spec.key_bounds:  # non-decreasing along the positions (the library checks it, as the forward's)
        lo = np.sort(rng.integers(0, skv // 2, (b, skv)), axis=1).astype(np.int32)
        hi = np.sort(lo + rng.integers(10, skv, (b, skv)), axis=1).astype(np.int32)
        if sq > 5 and 0 <= skv - sq + 5 < skv:
            hi[0, :skv - sq + 6] = 0  # rows 0..5 of sequence 0 see no key
        kernel.update(key_lo=lo, key_hi=hi)
        ref.update(key_lo=lo, key_hi=hi)
    if spec.custom_mask:
        packed, indptr = pack_mask(rng.random((b, sq, skv)) < 0.7)
        kernel.update(custom_mask=packed, mask_indptr=indptr)
        ref["custom_mask"] = (packed, indptr)
    tensors = {"doc": np.cumsum(rng.integers(1, 30, (b, skv)) == 1, axis=1).astype(np.int32),
               "bias": rng.standard_normal((spec.heads, 160)).astype(np.float32)}
    tensors = {n: tensors[n] for n, _, _ in spec.mod_tensors}
    if tensors:
        kernel.update(tensors)
        ref["mod_tensors"] = tensors
    return kernel, ref



@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_the_reference(case):
    b, h, kh, sq, skv, d, kw = CASES[case]
    spec = AttentionSpec(batch=b, heads=h, kv_heads=kh, seq_q=sq, seq_kv=skv, head_dim=d, **kw)
    kern = build_backward(spec)
    rng = np.random.default_rng(3)
    q, do = (rng.standard_normal((b, h, sq, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, kh, skv, d)).astype(np.float32) for _ in range(2))
    args = {}
    if spec.alibi:
        args["alibi_slopes"] = np.abs(rng.standard_normal(h)).astype(np.float32) * 0.1
    if spec.sinks:
        args["sinks"] = rng.standard_normal(h).astype(np.float32)
    if spec.kv_start:
        args["kv_start"] = np.asarray([0, 45, skv], np.int32)[:b]  # the last: past every key
    kargs, rargs = _mask_args(spec, rng) if spec.has_modifiers else ({}, {})
    o, lse = reference_attention(spec, q, k, v, return_lse=True, **args, **rargs)
    got = kern(q, k, v, o.astype(np.float32), lse.astype(np.float32), do, **args, **kargs)
    want = reference_attention_backward(spec, q, k, v, do, **args, **rargs)
    names = ("dq", "dk", "dv") + ("dsinks",) * spec.sinks
    assert len(got) == len(names)
    for name, g in zip(names, got):
        np.testing.assert_allclose(g, want[name], atol=2e-5, rtol=1e-4, err_msg=name)
    dq = got[0]
    if case == "causal_softcap_sq_gt_skv":
        assert not dq[:, :, :30].any()  # rows that see no key take no gradient
    if spec.key_bounds:
        assert not dq[0, :, 5].any() and np.abs(want["dk"]).max() > 0.1
    if spec.kv_start:  # the library's own check (int64): a start past the keys is refused by name
        with pytest.raises(ValueError, match="kv_start: an entry is negative or larger than the sequence's keys"):
            kern(q, k, v, o.astype(np.float32), lse.astype(np.float32), do,
                 **dict(args, kv_start=np.asarray([0, 45, 2**31 - 1], np.int32)))
    if spec.custom_mask:  # mask_indptr is checked before the kernel reads a byte (in int64)
        bad = kargs["mask_indptr"].copy()
        bad[1] = 2**31 - 1
        with pytest.raises(Exception, match="mask_indptr: sequence 0 holds bytes"):
            kern(q, k, v, o.astype(np.float32), lse.astype(np.float32), do, **args, **dict(kargs, mask_indptr=bad))
    assert kern.report.verdict == "fused"
    # the largest local is a tile (the dQ task's rows × max(D, block_n)), whatever the lengths
    kn = kern.knobs
    assert max(a.elements for a in kern.report.allocations) <= kn.block_m_dq * max(d, kn.block_n)


def test_with_the_forward_kernels_lse():
    """The pair as training uses it: the built forward's o and lse (float32) feed the backward."""
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=96, seq_kv=96, head_dim=32, causal=True, return_lse=True)
    rng = np.random.default_rng(4)
    q, do = (rng.standard_normal((1, 4, 96, 32)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 96, 32)).astype(np.float32) for _ in range(2))
    o, lse = kernel_of(built(spec))(q, k, v)
    dq, dk, dv = build_backward(spec)(q, k, v, o, lse, do)
    want = reference_attention_backward(spec, q, k, v, do)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        np.testing.assert_allclose(got, want[name], atol=5e-5, rtol=1e-4, err_msg=name)


def test_the_audit_fails_a_tile_that_grows_with_the_lengths(monkeypatch):
    """A tile sized by the lengths (block_m = Sq, block_n = Skv: the whole score matrix) is what
    the audit exists to catch: the probe build at doubled lengths shows S and P growing."""
    from tvm_attention import backward

    real = backward.backward_func
    monkeypatch.setattr(backward, "backward_func", lambda spec, knobs=None, wrt=(): real(
        spec, BackwardKnobs(block_m=spec.seq_q, block_n=spec.seq_kv), wrt))
    with pytest.raises(RuntimeError, match="not fused.*S .*grows with the sequence length"):
        build_backward(AttentionSpec(batch=1, heads=1, seq_q=24, seq_kv=40, head_dim=16))


@pytest.mark.parametrize("kw, what", [(dict(layout="kvcache"), "layout 'kvcache'"), (dict(dtype="float16"), "float16"),
                                      (dict(score_mod="lambda s, b, h, q, k: floor(s)"), "floor of the score"),
                                      ])
def test_what_is_not_built_yet_is_refused_by_name(kw, what):
    spec = AttentionSpec(batch=1, heads=2, seq_q=8, seq_kv=8, head_dim=16, **kw)
    with pytest.raises(SpecError, match=what):
        build_backward(spec)


#: targets the backward does not build for, as a caller names them: name -> (the target, made
#: when the test runs; its kind). A CUDA target builds the tensor-core backward
#: (tests/test_cuda_backward.py)
OTHER_TARGETS = {
    "c": (lambda: Target("c"), "c"),
    "dict": (lambda: {"kind": "opencl"}, "opencl"),
}


@pytest.mark.parametrize("name", list(OTHER_TARGETS))
def test_a_target_it_does_not_build_for_is_refused_by_name(name, monkeypatch):
    """The backward builds for LLVM (the CPU kernel) and CUDA (tensor cores); any other kind is
    refused by name, before any TIR is made, and a bare ``"cuda"`` on a machine without a GPU
    names the architecture it needs."""
    from tvm_attention import backward

    target, kind = OTHER_TARGETS[name]
    monkeypatch.setattr(backward, "backward_func", lambda *a, **k: pytest.fail("the backward's TIR was made"))
    with pytest.raises(TargetError, match=rf"backward: target kind '{kind}' is not built: llvm .* or cuda"):
        build_backward(AttentionSpec(batch=1, heads=2, seq_q=8, seq_kv=8, head_dim=16), target=target())


def test_a_bare_cuda_target_without_a_gpu_names_its_arch(monkeypatch):
    from tvm_attention import target as targets

    monkeypatch.setattr(targets, "local_cuda_arch", lambda: None)  # this machine has none (a GPU one too)
    with pytest.raises(TargetError, match="no GPU on this machine to take the architecture from; name it with --arch"):
        build_backward(AttentionSpec(batch=1, heads=2, seq_q=8, seq_kv=8, head_dim=16, dtype="float16"), target="cuda")


def test_knobs_are_checked():
    for kw, what in ((dict(block_m=30), "block_m=30 must be a multiple of 4"), (dict(block_n=0), "block_n must be"),
                     (dict(block_m_dq=True), "block_m_dq must be")):
        with pytest.raises(SpecError, match=what):
            BackwardKnobs(**kw)


def test_inputs_are_checked():
    spec = AttentionSpec(batch=1, heads=2, seq_q=8, seq_kv=8, head_dim=16)
    kern = build_backward(spec)
    z = np.zeros((1, 2, 8, 16), np.float32)
    with pytest.raises(SpecError, match=r"lse must be float32 \(1, 2, 8\)"):
        kern(z, z, z, z, np.zeros((1, 2, 9), np.float32), z)
    with pytest.raises(SpecError, match="do must be float32"):
        kern(z, z, z, z, np.zeros((1, 2, 8), np.float32), z.astype(np.float64))
    with pytest.raises(SpecError, match="this spec takes no sinks"):
        kern(z, z, z, z, np.zeros((1, 2, 8), np.float32), z, sinks=np.zeros(2, np.float32))


def test_bench_backward_tiny(tmp_path):
    """``bench --backward --tiny``: a point each way, side by side with torch SDPA, its report."""
    pytest.importorskip("torch")
    import json

    from tvm_attention.cli import main

    assert main(["bench", "--backward", "--tiny", "--threads", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "backward.json").read_text())
    assert [(r["seq"], r["causal"]) for r in report["rows"]] == [(128, False), (128, True)]
    for r in report["rows"]:
        assert r["ours_ms"] > 0 and r["torch_ms"] > 0 and 0 < r["roof_share"] and r["max_abs_diff_dq"] < 1e-4
    assert report["meta"]["fma_gflops"] > 0 and "| dtype | D | S | causal |" in (tmp_path / "backward.md").read_text()
    mem = report["memory"]  # the backward's peak extra memory, a fresh process
    assert [m["seq"] for m in mem] == [128] and (mem[0]["peak_extra_bytes"] is None or mem[0]["peak_extra_bytes"] >= 0)
    # the other peer: eager FlexAttention has no CPU backward, and the report says what it raised
    assert report["meta"]["flex_attention"] == "runs" or report["meta"]["flex_attention"].startswith("not available")


@pytest.mark.parametrize("kw", [dict(window=(20, 3), softcap=5.0, sinks=True)], ids=["window_softcap_sinks"])
def test_bfloat16_gradients(kw):
    """bf16 inputs and gradients, float32 arithmetic: against the float64 reference of the same
    (bf16-rounded) inputs, to bf16's rounding of the results (each gradient rounded once)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=45, seq_kv=77, head_dim=32, dtype="bfloat16", **kw)
    rng = np.random.default_rng(7)
    q, do = (rng.standard_normal((1, 4, 45, 32)).astype(bf16) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 77, 32)).astype(bf16) for _ in range(2))
    args = {"sinks": rng.standard_normal(4).astype(np.float32)} if spec.sinks else {}
    o, lse = reference_attention(spec, q, k, v, return_lse=True, **args)
    got = build_backward(spec)(q, k, v, o.astype(bf16), lse.astype(np.float32), do, **args)
    want = reference_attention_backward(spec, q, k, v, do, **args)
    for name, g in zip(("dq", "dk", "dv", "dsinks"), got):
        assert g.dtype == (bf16 if name != "dsinks" else np.float32), name
        w = want[name]
        err = np.abs(g.astype(np.float64) - w).max() / np.abs(w).max()
        assert err < 1e-2, (name, err)  # bf16 keeps 8 bits: 2**-8 = 0.4 % per rounding


@pytest.mark.parametrize("kw", [dict(window=(20, 3), key_bounds=True, custom_mask=True, kv_start=True, softcap=5.0,
                                     sinks=True)], ids=["window_bounds_custom_kv_start_softcap_sinks"])
def test_one_symbolic_build_serves_every_shape(kw):
    """batch, seq_q and seq_kv symbolic: one build, three shapes (Sq > Skv, tails, one row)."""
    spec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=64, seq_kv=64, head_dim=16,
                         dynamic=["batch", "seq_q", "seq_kv"], **kw)
    kern = build_backward(spec)
    assert kern.report.verdict == "fused"
    rng = np.random.default_rng(9)
    for b, sq, skv in ((2, 45, 77), (1, 70, 40), (3, 1, 33)):
        q, do = (rng.standard_normal((b, 4, sq, 16)).astype(np.float32) for _ in range(2))
        k, v = (rng.standard_normal((b, 2, skv, 16)).astype(np.float32) for _ in range(2))
        args = {"sinks": rng.standard_normal(4).astype(np.float32)} if spec.sinks else {}
        if spec.kv_start:
            args["kv_start"] = rng.integers(0, skv, b).astype(np.int32)
        shaped = dataclasses.replace(spec, batch=b, seq_q=sq, seq_kv=skv, dynamic=())
        kargs, rargs = _mask_args(shaped, rng) if spec.has_modifiers else ({}, {})
        o, lse = reference_attention(shaped, q, k, v, return_lse=True, **args, **rargs)
        got = kern(q, k, v, o.astype(np.float32), lse.astype(np.float32), do, **args, **kargs)
        want = reference_attention_backward(shaped, q, k, v, do, **args, **rargs)
        for name, g in zip(("dq", "dk", "dv", "dsinks"), got):
            np.testing.assert_allclose(g, want[name], atol=2e-5, rtol=1e-4, err_msg=f"{name} at {(b, sq, skv)}")
    with pytest.raises(SpecError, match=r"k must be float32 \(3, 2, 'seq_kv', 16\)|k must be float32 \(3, 2, \d+, 16\)"):
        kern(q, k[:2], v, o.astype(np.float32), lse.astype(np.float32), do, **args, **kargs)


@pytest.mark.parametrize("kw", [dict(causal=True, softcap=5.0, sinks=True, alibi=True, key_bounds=True,
                                     custom_mask=True, mod_tensors=(("bias", "float32", ("heads", 160)),),
                                     score_mod="lambda s, b, h, q, kv: s + bias[h, q - kv + 80]")],
                         ids=["causal_softcap_sinks_alibi_bounds_custom_score_mod"])
def test_varlen_gradients_match_the_reference_per_sequence(kw):
    """FlashAttention's packed layout: sequences of 45×77, 0×5 (no rows), 70×40 (Sq > Skv), 1×1
    and 33×0 (no keys: zero gradients), one build; each sequence against the reference's BHSD
    backward of its own rows (key bounds and the custom mask by sequence: ``seq_index``)."""
    lens = [(45, 77), (0, 5), (70, 40), (1, 1), (33, 0)]
    spec = AttentionSpec(layout="varlen", batch=len(lens), heads=4, kv_heads=2, seq_q=64, seq_kv=64, head_dim=16,
                         **kw)
    kern = build_backward(spec)
    assert kern.report.verdict == "fused"
    rng = np.random.default_rng(11)
    cq, ck = (np.concatenate([[0], np.cumsum([x[i] for x in lens])]).astype(np.int32) for i in (0, 1))
    q, do = (rng.standard_normal((cq[-1], 4, 16)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((ck[-1], 2, 16)).astype(np.float32) for _ in range(2))
    args = {n: rng.standard_normal(4).astype(np.float32) for n, on in (("sinks", spec.sinks), ("alibi_slopes", spec.alibi)) if on}
    kargs, rargs = {}, {}
    if spec.key_bounds:  # non-decreasing along the positions, as the forward asks
        lo = np.sort(rng.integers(0, 40, (len(lens), 80)), axis=1).astype(np.int32)
        hi = np.sort(lo + rng.integers(5, 80, lo.shape), axis=1).astype(np.int32)
        kargs.update(key_lo=lo, key_hi=hi)
        rargs.update(key_lo=lo, key_hi=hi)
    if spec.custom_mask:
        packed, indptr = pack_mask([rng.random(x) < 0.7 for x in lens])
        kargs.update(custom_mask=packed, mask_indptr=indptr)
        rargs["custom_mask"] = (packed, indptr)
    if spec.mod_tensors:
        kargs["bias"] = rng.standard_normal((4, 160)).astype(np.float32)
        rargs["mod_tensors"] = {"bias": kargs["bias"]}
    o = np.zeros((cq[-1], 4, 16), np.float32)
    lse = np.zeros((4, cq[-1]), np.float32)
    wants = []
    for b, (sq, skv) in enumerate(lens):  # the reference of each sequence, BHSD
        one = dataclasses.replace(spec, layout="bhsd", batch=1, seq_q=max(sq, 1), seq_kv=max(skv, 1))
        bq, bdo = (x[cq[b]:cq[b + 1]].transpose(1, 0, 2)[None] for x in (q, do))
        bk, bv = (x[ck[b]:ck[b + 1]].transpose(1, 0, 2)[None] for x in (k, v))
        bo, bl = reference_attention(one, bq, bk, bv, return_lse=True, seq_index=b, **args, **rargs)
        o[cq[b]:cq[b + 1]] = bo[0].transpose(1, 0, 2)
        lse[:, cq[b]:cq[b + 1]] = bl[0]
        wants.append(reference_attention_backward(one, bq, bk, bv, bdo, seq_index=b, **args, **rargs))
    got = kern(q, k, v, o, lse, do, cu_seqlens_q=cq, cu_seqlens_k=ck, **args, **kargs)
    for b, w in enumerate(wants):
        for name, g, rows in (("dq", got[0], cq), ("dk", got[1], ck), ("dv", got[2], ck)):
            np.testing.assert_allclose(g[rows[b]:rows[b + 1]].transpose(1, 0, 2), w[name][0], atol=2e-5, rtol=1e-4,
                                       err_msg=f"{name} of sequence {b}")
    if spec.sinks:
        np.testing.assert_allclose(got[3], sum(w["dsinks"] for w in wants), atol=2e-5, rtol=1e-4)
    bad = ck.copy()
    bad[2] = bad[3] + 1  # falls: the kernel would read past its keys
    with pytest.raises(Exception, match="cu_seqlens_k: must be non-decreasing"):
        kern(q, k, v, o, lse, do, cu_seqlens_q=cq, cu_seqlens_k=bad, **args, **kargs)


@pytest.mark.parametrize("layout", ["bhsd", "varlen"])  # varlen: the phase's sequence loop and row offsets
def test_a_learned_bias_takes_its_gradient(layout):
    """``grad_tensors``: a float tensor read twice by score_mod (a relative bias, a per-head
    temperature from its column 0) gets its gradient (each query head's share summed), against
    the float64 reference; BHSD with GQA and a window, varlen per sequence."""
    bias_mod = dict(mod_tensors=(("bias", "float32", ("heads", 96)),), window=(30, 2),
                    score_mod="lambda s, b, h, q, kv: s * (1 + 0.1 * bias[h, 0]) + tanh(bias[h, q - kv + 40])")
    rng = np.random.default_rng(13)
    bias = rng.standard_normal((4, 96)).astype(np.float32)
    lens = [(37, 50)] * 2 if layout == "bhsd" else [(37, 50), (9, 4)]
    spec = AttentionSpec(layout=layout, batch=len(lens), heads=4, kv_heads=2, seq_q=37, seq_kv=50, head_dim=16,
                         **bias_mod)
    kern = build_backward(spec, grad_tensors=("bias",))
    assert kern.report.verdict == "fused"
    one = dataclasses.replace(spec, layout="bhsd", batch=1)
    seqs = []
    for b, (sq, skv) in enumerate(lens):
        q, do = (rng.standard_normal((1, 4, sq, 16)).astype(np.float32) for _ in range(2))
        k, v = (rng.standard_normal((1, 2, skv, 16)).astype(np.float32) for _ in range(2))
        o, lse = reference_attention(dataclasses.replace(one, seq_q=sq, seq_kv=skv), q, k, v, return_lse=True,
                                     mod_tensors={"bias": bias})
        want = reference_attention_backward(dataclasses.replace(one, seq_q=sq, seq_kv=skv), q, k, v, do,
                                            grad_tensors=("bias",), mod_tensors={"bias": bias})
        seqs.append((q, k, v, o.astype(np.float32), lse.astype(np.float32), do, want))
    if layout == "bhsd":
        got = kern(*(np.concatenate([x[i] for x in seqs]) for i in range(6)), bias=bias)
    else:
        packed = [np.concatenate([x[i][0].transpose(1, 0, 2) for x in seqs]) for i in (0, 1, 2, 3, 5)]
        cq, ck = (np.asarray([0, lens[0][i], lens[0][i] + lens[1][i]], np.int32) for i in (0, 1))
        got = kern(packed[0], packed[1], packed[2], packed[3], np.concatenate([x[4][0] for x in seqs], axis=1),
                   packed[4], cu_seqlens_q=cq, cu_seqlens_k=ck, bias=bias)
    assert got[3].shape == bias.shape
    np.testing.assert_allclose(got[3], sum(x[6]["d_bias"] for x in seqs), atol=5e-5, rtol=1e-4)
    assert np.abs(got[3][:, 0]).min() > 0


@pytest.mark.parametrize("chunks", [0, 3])
def test_both_dq_strategies_match_the_reference(chunks):
    """The second pass (0) and chunked partial sums (3 chunks: not a divisor of the key tiles),
    with sinks, ALiBi, kv_start, a custom mask and score_mod; the preset's chunks are every other
    BHSD and varlen test's."""
    spec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=45, seq_kv=130, head_dim=16, causal=True, sinks=True,
                         alibi=True, kv_start=True, custom_mask=True,
                         score_mod="lambda s, b, h, q, kv: s - 0.01 * abs(q - kv)")
    kern = build_backward(spec, BackwardKnobs(dq_chunks=chunks))
    rng = np.random.default_rng(17)
    q, do = (rng.standard_normal((2, 4, 45, 16)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, 2, 130, 16)).astype(np.float32) for _ in range(2))
    args = dict(sinks=rng.standard_normal(4).astype(np.float32), kv_start=np.asarray([3, 70], np.int32),
                alibi_slopes=np.abs(rng.standard_normal(4)).astype(np.float32) * 0.1)
    kargs, rargs = _mask_args(spec, rng)
    o, lse = reference_attention(spec, q, k, v, return_lse=True, **args, **rargs)
    got = kern(q, k, v, o.astype(np.float32), lse.astype(np.float32), do, **args, **kargs)
    want = reference_attention_backward(spec, q, k, v, do, **args, **rargs)
    for name, g in zip(("dq", "dk", "dv", "dsinks"), got):
        np.testing.assert_allclose(g, want[name], atol=2e-5, rtol=1e-4, err_msg=name)
    assert [a[0] for a in kern.args].count("dq_workspace") == (chunks > 0)


def test_the_preset_takes_a_chunk_per_core_up_to_its_cap(monkeypatch):
    from tvm_attention import backward, hostcpu

    bhsd, varlen = (AttentionSpec(batch=1, heads=2, seq_q=8, seq_kv=8, head_dim=16, layout=x) for x in ("bhsd", "varlen"))
    for cores, chunks in ((1, 2), (4, 4), (backward.MAX_PRESET_CHUNKS, backward.MAX_PRESET_CHUNKS), (64, 0)):
        monkeypatch.setattr(hostcpu, "available_cores", lambda cores=cores: cores)
        assert backward.default_knobs(bhsd).dq_chunks == backward.default_knobs(varlen).dq_chunks == chunks, cores
