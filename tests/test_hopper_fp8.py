"""fp8 (e4m3) inputs on the Hopper kernel (``spec.q_dtype``; FlashAttention-3's fp8 forward),
offline: the spec and its arguments, the NumPy model of the kernel's data movement (Q and K
as bytes into the 128B swizzle, the producer warpgroup's transpose of V into ``Vᵀ`` with its
keys in P's register order, wgmma's k32 e4m3 fragments) against the float64 reference and
against faults planted in it, and sm_90a builds whose SASS holds the fp8 warpgroup products."""
import dataclasses

import numpy as np
import pytest
from tvm_attention.schedules import cuda_hopper, cpu_fused
from tvm_attention.schedules._knobs import KnobError

from tvm_attention.errors import SpecError
from tvm_attention.layouts import KernelArgumentError, get_layout
from tvm_attention.quant import dequantize, quantize_kv
from tvm_attention.reference import reference_attention
from tvm_attention.spec import AttentionSpec
from tvm_attention.validate import FP8_TOLERANCE, tolerances
from tvm_attention.workloads import wgmma_layout, wgmma_model
from tvm_attention.workloads.wgmma_layout import ROW_BYTES, SmemPlan, p_byte, vt_eval, vt_text
from tvm_attention.workloads.wgmma_model import ModelError, run

from test_hopper import SM90, hopper_build, needs_nvcc

E4M3 = "float8_e4m3fn"


def fp8_spec(**kw) -> AttentionSpec:
    """A spec of fp8 inputs (B=2, H=4 over KH=2, 200 rows over 333 keys, D=128, o bf16), ``kw``
    changed."""
    fields = dict(batch=2, heads=4, kv_heads=2, seq_q=200, seq_kv=333, head_dim=128, dtype="bfloat16",
                  kv_dtype=E4M3, q_dtype=E4M3)
    return AttentionSpec(**{**fields, **kw})


# -- the spec and its arguments ----------------------------------------------------------------------
def test_spec_takes_fp8_inputs_with_their_scales():
    """q, K, V e4m3 with per-head scales, o in dtype: the call takes ``q_scale (heads,)`` before
    the cache scales; the short name and the modeled bytes say so."""
    spec = fp8_spec(causal=True)
    assert spec.short_name() == "b2_h4_kv2_q200_k333_d128_bfloat16_qe4m3_kve4m3_causal"
    args = spec.arg_specs()
    assert [(a["name"], a["dtype"]) for a in args] == [
        ("q", E4M3), ("k", E4M3), ("v", E4M3), ("q_scale", "float32"), ("k_scale", "float32"),
        ("v_scale", "float32"), ("o", "bfloat16")]
    assert args[3]["shape"] == [4]
    rows = 2 * 4 * 200
    assert spec.io_bytes() == rows * 128 * (1 + 2) + 2 * 2 * 333 * 256
    assert AttentionSpec.from_dict(spec.to_dict()) == spec
    assert "q_dtype" not in dataclasses.replace(spec, q_dtype=None, kv_dtype=None).to_dict()


@pytest.mark.parametrize("change, match", [
    ({"q_dtype": "float8_e5m2"}, "q_dtype='float8_e5m2' is not supported"),
    ({"kv_dtype": "int8"}, "give kv_dtype='float8_e4m3fn'"),
    ({"kv_dtype": None}, "give kv_dtype='float8_e4m3fn'"),
    ({"kv_scale": "token", "layout": "kvcache"}, "kv_scale='head'"),
    ({"layout": "kvcache", "append": True}, "prefill form"),
])
def test_spec_refusals_name_what(change, match):
    with pytest.raises(SpecError, match=match):
        fp8_spec(**change)


def test_families_refuse_fp8_inputs_by_name():
    """The CPU kernels and the mma.sync kernel say who builds fp8 inputs; the Hopper kernel
    builds them in the prefill layouts at head_dim 128."""
    spec = fp8_spec()
    assert "the Hopper kernel builds them" in cpu_fused.CAPABILITIES.refusal(spec)
    assert cuda_hopper.CAPABILITIES.refusal(spec) is None
    assert "reads fp8 queries (q_dtype) in the bhsd and varlen" in cuda_hopper.CAPABILITIES.refusal(
        fp8_spec(layout="kvcache"))
    with pytest.raises(KnobError, match="head_dim 64 or 128 and block_n=128"):
        cuda_hopper.check(cuda_hopper.HopperKnobs(block_n=64), spec, SM90)
    for d in (64, 128):
        knobs = cuda_hopper.preset(fp8_spec(head_dim=d), SM90)
        cuda_hopper.check(knobs, fp8_spec(head_dim=d), SM90)
        assert (knobs.block_m, knobs.block_n, knobs.stages) == (128, 128, 2)
    knobs = cuda_hopper.preset(spec, SM90)
    # a record tuned at the 16-bit representative: kept where it builds fp8 inputs, else the preset
    assert cuda_hopper.for_layout(cuda_hopper.HopperKnobs(block_n=64), spec, SM90) == knobs


@pytest.mark.parametrize("layout", ["bhsd", "varlen"])
def test_random_inputs_quantize_q_and_the_reference_reads_its_values(layout):
    """The validation's inputs: q quantized per query head beside K and V (``q_scale``); the
    reference attends to ``q_scale · q`` (dequantized); a bad ``q_scale`` is refused by name."""
    spec = fp8_spec(layout=layout, seq_q=64, seq_kv=64)
    lay = get_layout(layout)
    case = lay.validation_cases(spec)[0]
    arrays = lay.random_inputs(spec, case)
    assert arrays["q"].dtype.name == E4M3 and arrays["q_scale"].shape == (4,)
    seen = lay.dequantized(spec, arrays)
    np.testing.assert_array_equal(seen["q"], dequantize(arrays["q"], arrays["q_scale"], lay.q_head_axis))
    assert tolerances(spec) == FP8_TOLERANCE
    if layout == "bhsd":
        bad = dict(arrays, q_scale=np.array([1, 1, 0, 1], np.float32))
        with pytest.raises(KernelArgumentError, match="q_scale"):
            lay.check_indices(bad, {}, spec)


# -- the model ---------------------------------------------------------------------------------------
def fp8_inputs(shapes, seed=0):
    """q, k, v quantized to e4m3 per head (axis 1: bhsd and packed alike) and their scales."""
    rng = np.random.default_rng(seed)
    return [quantize_kv(rng.standard_normal(s).astype(np.float32), E4M3, 1) for s in shapes]


def fp8_model(plan, causal=False, layout="bhsd", lens=((200, 333), (77, 64)), nan_seq=None, seed=0, **variants):
    """The model's output and the float64 reference on the dequantized inputs; bhsd ``B=2, H=4,
    KH=2`` of ``lens[0]``, or a packed batch of ``lens``; ``nan_seq``: NaN planted in that
    sequence's V rows (packed)."""
    H, KH, D = 4, 2, plan.head_dim
    if layout == "varlen":
        cq = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
        ck = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
        shapes = ((cq[-1], H, D), (ck[-1], KH, D), (ck[-1], KH, D))
    else:
        (sq, sk), = lens[:1]
        shapes = ((2, H, sq, D), (2, KH, sk, D), (2, KH, sk, D))
    (q, qs), (k, ks), (v, vs) = fp8_inputs(shapes, seed)
    if nan_seq is not None:
        v = v.copy()
        v[ck[nan_seq]: ck[nan_seq + 1], 0, 5] = np.nan
    spec = fp8_spec(causal=causal, layout=layout, head_dim=D,
                    **({"batch": len(lens), "seq_q": 64, "seq_kv": 64} if layout == "varlen" else
                       {"seq_q": sq, "seq_kv": sk}), **variants)
    rng = np.random.default_rng(seed + 1)
    args = {"sinks": rng.uniform(-1, 3, H) if spec.sinks else None,
            "alibi_slopes": rng.uniform(0.01, 0.2, H) if spec.alibi else None}
    out = run(q, k, v, plan, spec, "bfloat16", plan.consumers == 2, True,
              cu_seqlens=(cq, ck) if layout == "varlen" else None, q_scale=qs, k_scale=ks, v_scale=vs, **args)
    qd, kd, vd = (dequantize(x, s, 1) for x, s in ((q, qs), (k, ks), (v, vs)))
    one = dataclasses.replace(spec, layout="bhsd", batch=1, q_dtype=None, kv_dtype=None)
    if layout == "varlen":
        ref = np.zeros_like(out)
        for b, (sq, sk) in enumerate(lens):
            sl = lambda x, c: x[c[b]: c[b + 1]].transpose(1, 0, 2)[None]  # noqa: E731
            if sq and sk:
                ref[cq[b]: cq[b + 1]] = reference_attention(
                    dataclasses.replace(one, seq_q=sq, seq_kv=sk), sl(qd, cq), sl(kd, ck), sl(vd, ck),
                    **args)[0].transpose(1, 0, 2)
    else:
        ref = reference_attention(dataclasses.replace(one, batch=2), qd, kd, vd, **args)
    return out, ref


def exact_p(monkeypatch):
    """P left in float (no e4m3 rounding): the model is then the reference to float64's rounding,
    so what remains of an error is the data movement's."""
    monkeypatch.setattr(wgmma_model, "to_e4m3", lambda x: np.asarray(x, np.float64))


#: (head_dim, block_m, causal, layout, variants): two consumers in ping-pong and one, causal or
#: not, bhsd (tails in both lengths, rows that see no key) and packed sequences (empty ones, one
#: row), a softcap and sinks through the scores' factor (q_scale · k_scale); head_dim 128 (the
#: 128B swizzle) and 64 (Q, K and V's staging in the 64B swizzle)
FP8_CASES = [
    (128, 128, False, "bhsd", {}),
    (128, 128, True, "bhsd", {"softcap": 20.0}),
    (128, 64, True, "varlen", {"sinks": True}),
    (64, 128, True, "bhsd", {}),
    (64, 128, False, "varlen", {}),
]


@pytest.mark.parametrize("d, bm, causal, layout, variants", FP8_CASES)
def test_model_fp8_matches_reference(monkeypatch, d, bm, causal, layout, variants):
    """fp8 inputs: Q and K land as bytes in the 128B swizzle, V in a staging stage; the producer
    warpgroup transposes V into ``Vᵀ`` (keys in P's register order) lane by lane; the products
    read k32 e4m3 steps. With P rounded to e4m3 (the kernel's) the output is within
    ``FP8_TOLERANCE``; with P left in float it is the reference to 1e-12: every byte went where
    the descriptors and fragments read it."""
    lens = ((0, 5), (1, 300), (300, 130), (77, 77)) if layout == "varlen" else ((200, 333),)
    plan = SmemPlan(d, bm, 128, 2, 1, vt8=True)
    out, ref = fp8_model(plan, causal, layout, lens, **variants)
    atol, rtol = FP8_TOLERANCE
    assert np.isfinite(out).all()
    assert (np.abs(out - ref) <= atol + rtol * np.abs(ref)).all()
    assert np.abs(out - ref).max() > 1e-4  # P's rounding shows: the model rounds as the kernel does
    exact_p(monkeypatch)
    out, ref = fp8_model(plan, causal, layout, lens, **variants)
    assert np.abs(out - ref).max() < 1e-12


def test_model_fp8_varlen_keeps_a_neighbours_nan_out(monkeypatch):
    """The transpose writes the keys past a sequence's as zeros: a NaN in the next sequence's V
    never meets a P of 0 (and the check can fail: transposing every key lets it through)."""
    plan = SmemPlan(128, 128, 128, 2, 1, vt8=True)
    lens = ((100, 70), (60, 90))
    out, _ = fp8_model(plan, True, "varlen", lens, nan_seq=1)
    assert np.isfinite(out[:100]).all() and np.isnan(out[100:, 0]).any()
    transpose = wgmma_model.Smem.transpose8
    monkeypatch.setattr(wgmma_model.Smem, "transpose8", lambda self, s, d, p, valid: transpose(self, s, d, p, 128))
    out, _ = fp8_model(plan, True, "varlen", lens, nan_seq=1)
    assert np.isnan(out[:100]).any()


@pytest.mark.parametrize("fault", ["natural_key_order", "unswizzled_dst", "p_byte", "one_lane_mapping"])
def test_model_fp8_catches_faults(monkeypatch, fault):
    """The checks can fail (faults planted in the layout's texts, which the kernel's helper and
    the model both read): V's keys in their natural order (P's registers then meet the wrong
    values), ``Vᵀ`` written without the swizzle's XOR, P's bytes packed in another order, a lane
    mapping that writes some columns twice and others never."""
    exact_p(monkeypatch)
    if fault == "natural_key_order":
        monkeypatch.setattr(wgmma_layout, "VT_KEY", "4 * pg + i")
    elif fault == "unswizzled_dst":
        monkeypatch.setattr(wgmma_layout, "VT_DST",
                            "(pg / 32) * {vt_slab} + d * 128 + ((pg % 32) / 4) * 16 + (pg % 4) * 4")
    elif fault == "p_byte":
        monkeypatch.setattr(wgmma_model, "p_byte", lambda kk, q, b: 16 * kk + 4 * q + b)
    else:
        monkeypatch.setattr(wgmma_layout, "VT_DG", "32 * (n / 32 % {dslabs}) + n % 16 * 2")
    plan = SmemPlan(128, 128, 128, 2, 1, vt8=True)
    try:
        out, ref = fp8_model(plan, False, "bhsd", ((130, 200),))
    except ModelError:
        return
    assert np.abs(out - ref).max() > 0.05


@pytest.mark.parametrize("d, read_banks", [(128, 32), (64, 16)])
def test_transpose_is_bank_conflict_free(d, read_banks):
    """Each warp instruction of the transpose writes 32 words in 32 distinct banks, and reads
    32 words in 32 (head_dim 128: the two 128B swizzles' XORs spread what the byte transpose
    gathers) or 16 (head_dim 64: a staging row of 64 bytes is half the banks; a 2-way conflict)."""
    plan = SmemPlan(d, 128, 128, 2, 1, vt8=True)
    pg_text, dg_text, key_text, src_text, dst_text = wgmma_layout.vt_texts(plan)
    lane = np.arange(32)
    for n in range(plan.vt_units // 32):
        pg, dg = vt_eval(plan, pg_text, n=n, lane=lane), vt_eval(plan, dg_text, n=n, lane=lane)
        for i in range(4):
            key = vt_eval(plan, key_text, pg=pg, i=i)
            src = vt_eval(plan, src_text, dg=dg, key=key)
            assert len(set(src // 4 % 32)) == read_banks and len(set(src)) == 32, (n, i)
        for e in range(4):
            dst = vt_eval(plan, dst_text, pg=pg, d=4 * dg + e)
            assert len(set(dst // 4 % 32)) == 32, (n, e)


def test_kernel_fp8_helpers_are_the_layouts():
    """The kernel's transpose and packing are generated from ``wgmma_layout`` (the model's
    addresses, selectors and byte order); P's byte order reads the accumulator's keys ``2c, 2c+1,
    8+2c, 9+2c`` of each 16, which ``VT_KEY`` stores at the A fragment's k ``4c .. 4c+3``."""
    from tvm_attention.workloads.fused_wgmma import _helpers

    plan = SmemPlan(128, 128, 128, 2, 1, vt8=True)
    src = "".join(_helpers(plan, "bfloat16", 2).values())
    for text in (wgmma_layout.VT_PG, wgmma_layout.VT_DG, wgmma_layout.VT_KEY, wgmma_layout.VT_SRC,
                 wgmma_layout.VT_DST):
        assert vt_text(plan, text) in src
    narrow = SmemPlan(64, 128, 128, 2, 1, vt8=True)  # head_dim 64: the 64B swizzle's staging
    src64 = "".join(_helpers(narrow, "bfloat16", 2).values())
    assert all(vt_text(narrow, text) in src64 for text in wgmma_layout.vt_texts(narrow))
    assert wgmma_layout.VT_SRC64 in wgmma_layout.vt_texts(narrow) and narrow.qk_sbo == 512
    assert all(f"0x{x:04x}u" in src for x in wgmma_layout.VT_PERM)
    assert src.count("cvt.rn.satfinite.e4m3x2.f32") == 2 * 4 * plan.pv_steps
    assert "m64n128k32.f32.e4m3.e4m3" in src and "imm" not in src
    t, reg = np.arange(128)[:, None], np.arange(64)[None, :]
    keys = wgmma_layout.acc_col(t, reg)
    for kk in range(plan.pv_steps):
        for q in range(4):
            for b in range(4):
                row, k = wgmma_model.isa_a8(t[:, 0], np.array(q), np.array(b))
                key = keys[:, p_byte(kk, q, b)]  # the score register's key, as the accumulator holds it
                assert (wgmma_layout.acc_row(t[:, 0], p_byte(kk, q, b)) == row).all()
                pos = 32 * kk + k  # V^T's position the A fragment's k meets
                stored = vt_eval(plan, wgmma_layout.VT_KEY, pg=pos // 4, i=pos % 4)
                assert (stored == key).all()


# -- builds ------------------------------------------------------------------------------------------
#: (name, spec fields, parameter names past Q, K, V): the default run builds a packed causal
#: prefill with lse and device checks (cu_seqlens and the three scales checked on the device);
#: the sweep adds a symbolic bhsd build with a softcap
FP8_BUILDS = [
    ("varlen", dict(batch=3, heads=8, kv_heads=2, seq_q=512, head_dim=128, dtype="bfloat16", causal=True,
                    layout="varlen", kv_dtype=E4M3, q_dtype=E4M3, return_lse=True, device_checks=True),
     ["CQ", "CK", "QSC", "KSC", "VSC", "O", "LSE"]),
]
if __import__("os").environ.get("TVMA_CUDA_SWEEP"):
    FP8_BUILDS += [
        ("bhsd", dict(batch=2, heads=8, kv_heads=2, seq_q=4096, head_dim=128, dtype="float16", causal=False,
                      kv_dtype=E4M3, q_dtype=E4M3, softcap=30.0, dynamic=("batch", "seq_q", "seq_kv")),
         ["QSC", "KSC", "VSC", "O"]),
        ("bhsd64", dict(batch=2, heads=16, kv_heads=4, seq_q=4096, head_dim=64, dtype="bfloat16", causal=True,
                        kv_dtype=E4M3, q_dtype=E4M3, return_lse=True), ["QSC", "KSC", "VSC", "O", "LSE"]),
    ]


@needs_nvcc
@pytest.mark.parametrize("name, fields, params", FP8_BUILDS, ids=[b[0] for b in FP8_BUILDS])
def test_fp8_builds_offline(name, fields, params):
    """fp8 builds for sm_90a: no spill or stack, the products not serialized, every product on
    wgmma's e4m3 form (SASS ``QGMMA``, no 16-bit ``HGMMA``), the loads by TMA, P packed by the
    hardware's satfinite cvt, V transposed by byte permutes, the arguments in the call's order."""
    from tvm_attention.cuda_tools import kernel_source

    spec = AttentionSpec(**fields)
    built = hopper_build(spec)
    r = built.resources
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0 and not r["wgmma_serialized"], r
    assert built.audit.fused and "sass_error" not in r
    func = cuda_hopper.workload(spec, built.knobs)
    assert [p.name for p in func.params] == ["Q", "K", "V", *params]
    plan = cuda_hopper.plan(built.knobs, spec)
    assert plan.vt8 and plan.itemsize == 1 and plan.slab_cols == min(ROW_BYTES, spec.head_dim)
    products = 2 * (plan.qk_steps + plan.pv_steps)  # overlapped: each product at two places
    assert r["ptx_instructions"]["wgmma.mma_async"] == products
    src = kernel_source(built.module)
    assert "cvt.rn.satfinite.e4m3x2.f32" in src and "__byte_perm" in src and "hop_zero_rows(" not in src
    if "sass_instructions" in r:
        sass = r["sass_instructions"]
        assert sass["QGMMA"] == products and sass["HGMMA"] == 0, sass
        assert sass["UTMALDG"] >= 3 and sass["LDL"] == sass["STL"] == 0


def test_emulated_device_check_refuses_a_bad_q_scale():
    """With device checks (an fp8 varlen build), the check kernel judges ``q_scale`` beside the
    cache scales: an entry that is not a positive finite number sets bit 256 and the attention
    kernels do nothing. Emulated on the CPU around a stand-in kernel (the Hopper kernel runs
    on sm_90 only) that writes one element."""
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    from tvm_attention.layouts import INDEX_ERROR_BITS
    from tvm_attention.target import resolve_target
    from tvm_attention.workloads.index_checks import with_device_index_checks

    spec = fp8_spec(layout="varlen", seq_q=64, seq_kv=64, device_checks=True)
    TQ, TK, NB1 = (tirx.Var(n, "int32") for n in ("total_q", "total_k", "batch_plus_1"))

    @T.prim_func(s_tir=True, check_well_formed=False)
    def stand_in(Q: T.Buffer((TQ, 4, 128), E4M3), K: T.Buffer((TK, 2, 128), E4M3), V: T.Buffer((TK, 2, 128), E4M3),
                 CQ: T.Buffer((NB1,), "int32"), CK: T.Buffer((NB1,), "int32"), QSC: T.Buffer((4,), "float32"),
                 KSC: T.Buffer((2,), "float32"), VSC: T.Buffer((2,), "float32"), O: T.Buffer((TQ, 4, 128), "bfloat16")):
        T.func_attr({"global_symbol": "attention"})
        for i in T.serial(1):  # the grid (emulated: the serial loops a kernel's nest starts with)
            with T.sblock("tile"):
                O[0, 0, 0] = T.bfloat16(1)

    ex = tvm.compile(with_device_index_checks(tvm.IRModule({"main": stand_in}), spec, emulate=True),
                     target=resolve_target("llvm"))
    lay = get_layout("varlen")
    x = lay.random_inputs(spec, {"seqlens": [(5, 7), (30, 20)]})
    names = [a.name for a in lay.all_args(spec) if not a.output]
    bits = {name: bit for bit, (name, _) in INDEX_ERROR_BITS.items()}

    def call(y):
        o = tvm.runtime.tensor(np.zeros(y["q"].shape, spec.np_dtype))
        err = tvm.runtime.tensor(np.array([-1], np.int32))
        ex["attention"](*[tvm.runtime.tensor(np.ascontiguousarray(y[n])) for n in names], o, err)
        return float(o.numpy()[0, 0, 0]), int(err.numpy()[0])

    assert call(x) == (1.0, 0)
    for name, value in (("q_scale", 0.0), ("q_scale", np.inf), ("k_scale", np.nan)):
        y = dict(x, **{name: x[name].copy()})
        y[name][1] = value
        assert call(y) == (0.0, bits[name]), (name, value)
