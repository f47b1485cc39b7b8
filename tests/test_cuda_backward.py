"""The attention backward on CUDA tensor cores (issue 65, item 6): FlashAttention-2's scheme on
``mma.sync`` (``workloads/backward_mma.py``), BHSD, float16/bfloat16, causal or not, GQA, a value
head size of its own, and every variant the CPU backward takes through its score math (a window,
ALiBi, ``kv_start``, sinks with their gradient, a softcap, key bounds, a custom mask, ``mask_mod``,
``score_mod``). Emulated on the CPU against the float64 reference's gradients (rows that see no
key, tails of both lengths); a kernel that skips a query tile it needs fails; ``build_backward``
for a CUDA target: audited, no spill at head_dim 64 and 128 on sm_80 and sm_90, exported; what it
does not build yet refused by name."""
import numpy as np
import pytest
import tvm

from tvm_attention.backward import BackwardKernel, CudaBackwardKnobs, _call_args, build_backward
from tvm_attention.cuda_tools import find_nvcc
from tvm_attention.errors import SpecError
from tvm_attention.reference import reference_attention, reference_attention_backward
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target
from tvm_attention.workloads import backward_mma as bm

from test_cuda import EMULATION_TARGET

#: the largest error against the float64 gradients, as a share of the gradient's largest value:
#: fp16 rounds P and dS to 11 bits, bf16 to 8
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}


def emulated(spec, warps, block_m, grad_tensors=()) -> BackwardKernel:
    """The CUDA backward of ``spec``, emulated (compiled for the CPU), behind ``BackwardKernel``'s
    call (its scratch, dq_accum and delta, allocated by the call; a learned bias's partials
    summed by it)."""
    func = bm.backward_mma(spec, warps, block_m, emulate=True, grad_tensors=tuple(grad_tensors))
    ex = tvm.compile(func, target=EMULATION_TARGET)
    return BackwardKernel(spec, CudaBackwardKnobs(warps, block_m), {bm.ENTRY: ex[bm.ENTRY]}, None, _call_args(func))


def variant_args(spec, rng) -> tuple[dict, dict]:
    """The variants' arguments (the kernel's by name, the reference's): ALiBi slopes and sinks per
    head, a first key per sequence inside the keys, key bounds that hide a band of each row's keys,
    a custom mask of ~80 % of the pairs, the modifiers' float tensors (small normals)."""
    from tvm_attention.masks import pack_mask

    k, r = {}, {}
    b, h, sq, skv = spec.batch, spec.heads, spec.seq_q, spec.seq_kv
    if spec.alibi:
        k["alibi_slopes"] = r["alibi_slopes"] = (np.abs(rng.standard_normal(h)) * 0.1).astype(np.float32)
    if spec.sinks:
        k["sinks"] = r["sinks"] = rng.standard_normal(h).astype(np.float32)
    if spec.kv_start:
        k["kv_start"] = r["kv_start"] = np.asarray([3, 11][:b] + [0] * max(0, b - 2), np.int32)
    if spec.key_bounds:
        lo = np.sort(rng.integers(0, skv // 2, (b, skv)), axis=1).astype(np.int32)
        k["key_lo"] = r["key_lo"] = lo
        k["key_hi"] = r["key_hi"] = np.minimum(lo + 20, skv).astype(np.int32)
    if spec.custom_mask:
        packed, indptr = pack_mask([rng.random((sq, skv)) < 0.8 for _ in range(b)])
        k.update(custom_mask=packed, mask_indptr=indptr)
        r["custom_mask"] = (packed, indptr)
    tensors = {n: (rng.standard_normal(tuple(getattr(spec, d) if isinstance(d, str) else d for d in dims)) * 0.1)
               .astype(np.float32) for n, _, dims in spec.mod_tensors}
    if tensors:
        k.update(tensors)
        r["mod_tensors"] = tensors
    return k, r


def check(spec, kernel, seed=0, grad_tensors=()):
    """The kernel's gradients (and dsinks, with sinks; a learned bias's, ``grad_tensors``) against
    the float64 reference's, each within :data:`TOLERANCE` of the largest value."""
    rng = np.random.default_rng(seed)
    kargs, rargs = variant_args(spec, rng)
    dt = spec.np_dtype
    q, k, v = (rng.standard_normal(s).astype(dt) for s in (spec.q_shape, spec.kv_shape, spec.v_shape))
    do = rng.standard_normal(spec.o_shape).astype(dt)
    f64 = [x.astype(np.float64) for x in (q, k, v)]
    o, lse = reference_attention(spec, *f64, return_lse=True, **rargs)
    ref = reference_attention_backward(spec, *f64, do.astype(np.float64), grad_tensors=tuple(grad_tensors), **rargs)
    got = kernel(q, k, v, o.astype(dt), lse.astype(np.float32), do, **kargs)
    names = ("dq", "dk", "dv") + (("dsinks",) if spec.sinks else ()) + tuple(f"d_{n}" for n in grad_tensors)
    assert len(got) == len(names)
    for name, got in zip(names, got):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), name
        err = np.abs(got - ref[name]).max()
        assert err <= TOLERANCE[spec.dtype] * np.abs(ref[name]).max(), (name, err, np.abs(ref[name]).max())


#: (spec fields, warps, block_m): GQA 4:2 with tails in both lengths (37 rows, 45 keys), causal and
#: not; bf16 with more rows than keys (causal: the first 28 rows see no key, lse −inf); a value
#: head size of its own
MOD = "def score_mod(score, b, h, q_idx, kv_idx):\n    return score + bias[h] * (q_idx - kv_idx)\n"
CASES = [
    (dict(batch=2, heads=4, kv_heads=2, seq_q=37, seq_kv=45, head_dim=32, causal=True), 2, 32),
    (dict(batch=2, heads=4, kv_heads=2, seq_q=37, seq_kv=45, head_dim=32, window=(20, 0), alibi=True, kv_start=True,
          sinks=True, softcap=30.0), 2, 32),
    (dict(batch=2, heads=4, kv_heads=2, seq_q=37, seq_kv=45, head_dim=32, key_bounds=True, custom_mask=True,
          mask_mod="lambda b, h, q, kv: (q + kv) % 5 != 0"), 2, 32),
    (dict(batch=1, heads=4, kv_heads=2, seq_q=37, seq_kv=45, head_dim=32, causal=True, score_mod=MOD,
          mod_tensors=(("bias", "float32", ("heads",)),)), 2, 32),
    (dict(batch=1, heads=4, kv_heads=2, seq_q=37, seq_kv=45, head_dim=32), 2, 32),
    (dict(batch=1, heads=2, kv_heads=1, seq_q=45, seq_kv=17, head_dim=32, dtype="bfloat16", causal=True), 2, 32),
    (dict(batch=1, heads=2, seq_q=40, seq_kv=50, head_dim=32, head_dim_v=16, causal=True), 2, 16),
]


@pytest.mark.parametrize("fields, warps, block_m", CASES, ids=["gqa-causal", "window-alibi-kvstart-sinks-softcap",
                                                                "bounds-mask-mask_mod", "score_mod-learned-bias",
                                                                "gqa-full", "bf16-rows-without-keys", "dv16"])
def test_backward_matches_the_reference(fields, warps, block_m):
    """Every case against the reference; with a score_mod over a tensor, the tensor's gradient too
    (a learned bias: each read's derivative scattered into its query head's partials)."""
    spec = AttentionSpec(**{"dtype": "float16", **fields})
    wrt = tuple(n for n, dt, _ in spec.mod_tensors if spec.score_mod is not None and dt == "float32")
    check(spec, emulated(spec, warps, block_m, wrt), grad_tensors=wrt)


def test_a_kernel_that_skips_a_query_tile_fails(monkeypatch):
    """Under causality a key tile's first query tile is computed (``first_query_tile``); one past
    it leaves the diagonal's gradients out, and the check fails."""
    spec = AttentionSpec(batch=1, heads=2, seq_q=64, seq_kv=64, head_dim=32, dtype="float16", causal=True)
    real = bm.first_query_tile
    monkeypatch.setattr(bm, "first_query_tile", lambda key0, off, block_m, causal: real(key0, off, block_m, causal) + 1)
    with pytest.raises(AssertionError):
        check(spec, emulated(spec, 2, 32))


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found: the CUDA builds are compiled offline")
@pytest.mark.parametrize("arch, head_dim, dtype, variants", [
    ("sm_90", 128, "bfloat16", dict(softcap=30.0, alibi=True, sinks=True, window=(255, 0))),
    ("sm_80", 64, "float16", dict(causal=True))])
def test_builds_for_cuda_without_a_spill(arch, head_dim, dtype, variants):
    """``build_backward`` for a CUDA target: the preset (4 warps; 64 query rows at head_dim 64, 32 at
    128), fused by the audit (the dQ accumulator and delta are the call's scratch, no score-sized
    buffer), tensor cores (HMMA) and no local memory; the call refuses arrays that are not torch
    CUDA tensors by name."""
    spec = AttentionSpec(batch=2, heads=16, kv_heads=4, seq_q=1024, seq_kv=1024, head_dim=head_dim, dtype=dtype,
                         dynamic=("batch", "seq_q", "seq_kv"), **variants)
    kern = build_backward(spec, target=resolve_target("cuda", arch=arch))
    assert kern.knobs == CudaBackwardKnobs(4, 64 if head_dim <= 64 else 32)
    assert kern.report.verdict == "fused"
    r = kern.resources
    assert r["spills"] == 0 and r["registers"] <= 255 and r["sass_instructions"]["HMMA"] > 0, r
    assert r["sass_instructions"]["LDL"] == 0 and r["sass_instructions"]["LDSM"] > 0
    names = ["q", "k", "v", "o", "lse", "do", "dq", "dk", "dv", "dq_accum", "delta"]
    if spec.sinks:  # the variants' arguments after do, dsinks after dv
        names = names[:6] + ["alibi_slopes", "sinks"] + names[6:9] + ["dsinks"] + names[9:]
    assert [a[0] for a in kern.args] == names
    z = np.zeros((1, 16, 8, head_dim), np.float16)
    with pytest.raises(SpecError, match="q: a CUDA build takes torch CUDA tensors, got ndarray"):
        kern(z, z, z, z, np.zeros((1, 16, 8), np.float32), z)


def test_what_it_does_not_build_is_refused_by_name():
    sm90 = resolve_target("cuda", arch="sm_90")
    base = dict(batch=1, heads=2, seq_q=64, seq_kv=64, head_dim=64, dtype="float16")
    for over, what in ((dict(layout="kvcache", seq_q=1), "layout 'kvcache' is not built"),
                       (dict(dtype="float32"), "dtype float32 is not built"),
                       (dict(score_mod="lambda s, b, h, q, k: floor(s)"), "floor of the score"),
                       (dict(head_dim=256), "head_dim=256 must be a multiple of 16 up to 128")):
        with pytest.raises(SpecError, match=what):
            build_backward(AttentionSpec(**{**base, **over}), target=sm90)
    with pytest.raises(SpecError, match="arch sm_75: the tensor-core backward needs sm_80"):
        build_backward(AttentionSpec(**base), target=tvm.target.Target({"kind": "cuda", "arch": "sm_75"}))
    with pytest.raises(SpecError, match="block_m=48 must be a multiple of 16 whose row groups"):
        CudaBackwardKnobs(warps=4, block_m=48)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found: the CUDA builds are compiled offline")
def test_a_cuda_backward_exports_and_its_artifact_names_what_it_needs(tmp_path):
    """``export_backward`` of a CUDA build: the library, TVM's runtime with CUDA, the CUDA C and
    the fatbin compiled offline (``kernel_binary``: no compiler on the GPU machine), the manifest
    naming the arch, knobs, workspaces and ptxas's report, its validation left to a GPU; loading
    it on a machine without a GPU is refused by name."""
    import json

    from tvm_attention.backward_artifact import export_backward, load_backward
    from tvm_attention.loader import ArtifactError

    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=64, seq_kv=64, head_dim=64, dtype="float16", causal=True,
                         dynamic=("batch", "seq_q", "seq_kv"))
    manifest = export_backward(build_backward(spec, target=resolve_target("cuda", arch="sm_90")), tmp_path / "bwd")
    assert manifest["target"] == {"kind": "cuda", "arch": "sm_90"} and manifest["knobs"] == {"warps": 4, "block_m": 64}
    assert manifest["validation"]["ran"] is False and manifest["workspaces"] == ["dq_accum", "delta"]
    assert manifest["kernel_binary"]["file"] == "kernel.fatbin" and manifest["resources"]["spills"] == 0
    files = {p.name for p in (tmp_path / "bwd").iterdir()}
    assert {"attention_backward.so", "kernel.cu", "kernel.fatbin", "manifest.json"} <= files
    assert json.loads((tmp_path / "bwd" / "manifest.json").read_text())["spec_hash"] == spec.fingerprint()
    from tvm_attention import runtime

    if runtime.cuda_arch() is None:
        with pytest.raises(ArtifactError, match="a CUDA backward artifact \\(sm_90\\); this machine has no CUDA device"):
            load_backward(tmp_path / "bwd")


def test_varlen_gradients_match_the_reference_per_sequence():
    """FlashAttention's packed layout on the CUDA backward (emulated): a (tile slot, kv head) grid,
    each slot's sequence found on cu_seqlens_k; sequences of 45×77, 0×5 (no rows), 70×40 (Sq > Skv),
    1×1 and 33×0 (no keys: zero gradients), causal with a softcap, sinks, ALiBi, key bounds, a custom
    mask and a score_mod reading a tensor; each sequence against the reference's BHSD backward of
    its own rows; a cu_seqlens that falls is refused before the kernel reads a byte."""
    import dataclasses

    from tvm_attention.masks import pack_mask

    lens = [(45, 77), (0, 5), (70, 40), (1, 1), (33, 0)]
    spec = AttentionSpec(layout="varlen", batch=len(lens), heads=4, kv_heads=2, seq_q=64, seq_kv=64, head_dim=32,
                         dtype="float16", causal=True, softcap=5.0, sinks=True, alibi=True, key_bounds=True,
                         custom_mask=True, mod_tensors=(("bias", "float32", ("heads", 160)),),
                         score_mod="lambda s, b, h, q, kv: s + bias[h, q - kv + 80]")
    kern = emulated(spec, 2, 32)
    rng = np.random.default_rng(11)
    cq, ck = (np.concatenate([[0], np.cumsum([x[i] for x in lens])]).astype(np.int32) for i in (0, 1))
    q, do = (rng.standard_normal((cq[-1], 4, 32)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((ck[-1], 2, 32)).astype(np.float16) for _ in range(2))
    args = {"sinks": rng.standard_normal(4).astype(np.float32),
            "alibi_slopes": (np.abs(rng.standard_normal(4)) * 0.1).astype(np.float32)}
    lo = np.sort(rng.integers(0, 40, (len(lens), 80)), axis=1).astype(np.int32)
    hi = np.sort(lo + rng.integers(5, 80, lo.shape), axis=1).astype(np.int32)
    packed, indptr = pack_mask([rng.random(x) < 0.7 for x in lens])
    bias = (rng.standard_normal((4, 160)) * 0.1).astype(np.float32)
    kargs = dict(key_lo=lo, key_hi=hi, custom_mask=packed, mask_indptr=indptr, bias=bias)
    rargs = dict(key_lo=lo, key_hi=hi, custom_mask=(packed, indptr), mod_tensors={"bias": bias})
    o = np.zeros((cq[-1], 4, 32), np.float16)
    lse = np.zeros((4, cq[-1]), np.float32)
    wants = []
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    for b, (sq, skv) in enumerate(lens):  # the reference of each sequence, BHSD
        one = dataclasses.replace(spec, layout="bhsd", batch=1, seq_q=max(sq, 1), seq_kv=max(skv, 1))
        bq, bdo = (f64(x[cq[b]:cq[b + 1]].transpose(1, 0, 2)[None]) for x in (q, do))
        bk, bv = (f64(x[ck[b]:ck[b + 1]].transpose(1, 0, 2)[None]) for x in (k, v))
        bo, bl = reference_attention(one, bq, bk, bv, return_lse=True, seq_index=b, **args, **rargs)
        o[cq[b]:cq[b + 1]] = bo[0].transpose(1, 0, 2)
        lse[:, cq[b]:cq[b + 1]] = bl[0]
        wants.append(reference_attention_backward(one, bq, bk, bv, bdo, seq_index=b, **args, **rargs))
    got = kern(q, k, v, o, lse, do, cu_seqlens_q=cq, cu_seqlens_k=ck, **args, **kargs)
    for name, g, rows, i in (("dq", got[0], cq, 0), ("dk", got[1], ck, 1), ("dv", got[2], ck, 2)):
        largest = max(np.abs(w[name]).max(initial=0.0) for w in wants)
        for b, w in enumerate(wants):
            err = np.abs(g[rows[b]:rows[b + 1]].transpose(1, 0, 2).astype(np.float64) - w[name][0]).max(initial=0.0)
            assert err <= TOLERANCE["float16"] * largest, (name, b, err, largest)
    ds = sum(w["dsinks"] for w in wants)
    assert np.abs(got[3] - ds).max() <= TOLERANCE["float16"] * np.abs(ds).max()
    bad = ck.copy()
    bad[2] = bad[3] + 1  # falls: the kernel would read past its keys
    with pytest.raises(Exception, match="cu_seqlens_k: must be non-decreasing"):
        kern(q, k, v, o, lse, do, cu_seqlens_q=cq, cu_seqlens_k=bad, **args, **kargs)


def test_torch_attention_takes_the_cuda_pair_for_cuda_tensors(monkeypatch):
    """``tvm_attention.torch.attention`` on CUDA tensors runs the CUDA pair: the spec in float16, the
    tensor-core forward with lse and the tensor-core backward, tensors in and out (no NumPy), the
    variants' arrays beside the data. Here the pair's two kernels are emulated on the CPU and the
    call's tensors taken for CUDA ones (``device_of``): gradients and ``dsinks`` against the
    float64 reference; a learned bias's gradient too."""
    torch = pytest.importorskip("torch")
    from tvm_attention import torch as tt
    from tvm_attention.loader import AttentionKernel
    from tvm_attention.workloads.fused_mma import fused_attention_mma

    made = []

    def emulated_pair(spec, grad_tensors):
        fwd = AttentionKernel(spec, tvm.compile(fused_attention_mma(spec, 2, 16, 2, 1, emulate=True),
                                                target=EMULATION_TARGET)["attention"])
        bwd = emulated(spec, 2, 32, grad_tensors)
        made.append(spec)
        return fwd, lambda *a, **k: tuple(torch.from_numpy(np.asarray(g)) for g in bwd(*a, **k))

    monkeypatch.setattr(tt, "device_of", lambda q: "cuda")
    monkeypatch.setattr(tt, "_cuda_pair", emulated_pair)
    tt._pair.cache_clear()
    rng = np.random.default_rng(5)
    q, k, v = (torch.from_numpy(rng.standard_normal(s).astype(np.float16)).requires_grad_()
               for s in ((2, 4, 37, 32), (2, 2, 45, 32), (2, 2, 45, 32)))
    sinks = torch.from_numpy(rng.standard_normal(4).astype(np.float32)).requires_grad_()
    slopes = torch.from_numpy((np.abs(rng.standard_normal(4)) * 0.1).astype(np.float32))
    o = tt.attention(q, k, v, causal=True, sinks=sinks, alibi_slopes=slopes)
    assert made and made[0].dtype == "float16" and made[0].sinks and made[0].alibi
    do = rng.standard_normal(o.shape).astype(np.float16)
    o.backward(torch.from_numpy(do))
    spec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=37, seq_kv=45, head_dim=32, causal=True, sinks=True,
                         alibi=True)
    f64 = [t.detach().numpy().astype(np.float64) for t in (q, k, v)]
    ref = reference_attention_backward(spec, *f64, do.astype(np.float64), sinks=sinks.detach().numpy(),
                                       alibi_slopes=slopes.numpy())
    for name, t in (("dq", q), ("dk", k), ("dv", v), ("dsinks", sinks)):
        err = np.abs(t.grad.numpy().astype(np.float64) - ref[name]).max()
        assert err <= TOLERANCE["float16"] * np.abs(ref[name]).max(), (name, err)
    # a learned bias takes its gradient through the CUDA branch too
    bias = torch.from_numpy((rng.standard_normal(4) * 0.1).astype(np.float32)).requires_grad_()
    o = tt.attention(q, k, v, causal=True, score_mod="lambda s, b, h, q, kv: s + bias[h] * (q - kv)",
                     mod_tensors={"bias": bias})
    o.backward(torch.from_numpy(do))
    mspec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=37, seq_kv=45, head_dim=32, causal=True,
                          score_mod="lambda s, b, h, q, kv: s + bias[h] * (q - kv)",
                          mod_tensors=(("bias", "float32", (4,)),))
    want = reference_attention_backward(mspec, *f64, do.astype(np.float64), grad_tensors=("bias",),
                                        mod_tensors={"bias": bias.detach().numpy()})["d_bias"]
    assert np.abs(bias.grad.numpy() - want).max() <= TOLERANCE["float16"] * np.abs(want).max()
    tt._pair.cache_clear()
