"""A value head size of its own (``AttentionSpec.head_dim_v``, issue 44 item 1): v and o have
``head_dim_v`` columns, q and k ``head_dim`` (DeepSeek's unabsorbed prefill is 192 / 128). The
spec and its shapes, the float64 reference, the CPU fused kernels in every layout (static and
symbolic, the half dtypes, the 8-bit caches at every scale granularity, split-KV, append, the
variants and a modifier) against it, both CUDA kernels (emulated, and built offline for sm_90),
the exported library and the loader's shape check, the CLI and the families that refuse it by
name."""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest

from tvm_attention.artifact import export, validate_built
from tvm_attention.schedules._knobs import KnobError
from tvm_attention.reference import reference_attention
from tvm_attention.spec import MAX_HEAD_DIM, AttentionSpec, SpecError

from conftest import built


def test_spec_shapes_and_what_stays_as_it_was():
    s = AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=5, seq_kv=7, head_dim=192, head_dim_v=128)
    assert s.v_dim == 128 and s.q_shape == (2, 8, 5, 192) and s.kv_shape == (2, 2, 7, 192)
    assert s.v_shape == (2, 2, 7, 128) and s.o_shape == (2, 8, 5, 128)
    assert s.scale == pytest.approx(192 ** -0.5)  # the scale follows q·k's length
    assert s.flops() == 2 * (192 + 128) * 2 * 8 * 5 * 7  # QKᵀ and PV, each 2 FLOP per element
    assert s.io_bytes() == 4 * (2 * 8 * 5 * (192 + 128) + 2 * 2 * 7 * (192 + 128))
    assert s.short_name() == "b2_h8_kv2_q5_k7_d192v128_float32_full"
    assert [a["shape"][-1] for a in s.arg_specs()] == [192, 192, 128, 128]  # q, k, v, o
    # equal to head_dim is the default, stored as None: names, manifests and fingerprints of
    # every spec written before head_dim_v existed are unchanged
    same = AttentionSpec(batch=2, heads=8, seq_q=5, head_dim=64, head_dim_v=64)
    assert same.head_dim_v is None and same == AttentionSpec(batch=2, heads=8, seq_q=5, head_dim=64)
    assert "head_dim_v" not in same.to_dict() and s.to_dict()["head_dim_v"] == 128
    assert AttentionSpec.from_dict(s.to_dict()) == s and s.fingerprint() != dataclasses.replace(s, head_dim_v=None).fingerprint()
    # replace() of head_dim keeps an equal V equal
    assert dataclasses.replace(same, head_dim=128).v_dim == 128
    paged = AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64, head_dim_v=32,
                          layout="paged", kv_dtype="int8", kv_scale="group")
    by_name = {a["name"]: a["shape"] for a in paged.arg_specs()}
    assert by_name["k_scale"][-1] == 2 and by_name["v_scale"][-1] == 1  # head_dim / 32, head_dim_v / 32
    assert by_name["v_pages"][-1] == 32 and by_name["k_pages"][-1] == 64


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim_v=0), "head_dim_v must be positive"),
    (dict(head_dim_v=64.0), "head_dim_v must be an int"),
    (dict(head_dim_v=MAX_HEAD_DIM + 32), f"head_dim_v={MAX_HEAD_DIM + 32} is larger than the supported {MAX_HEAD_DIM}"),
    (dict(head_dim_v=48, kv_dtype="int8", kv_scale="group"), "multiple of 32"),
])
def test_bad_head_dim_v_is_named(kw, match):
    with pytest.raises(SpecError, match=match):
        AttentionSpec(batch=1, heads=2, seq_q=4, head_dim=64, **kw)


def test_reference_columns_of_v_are_independent():
    """The reference with ``Dv`` columns is the same attention weights times each column of V:
    splitting V's columns splits the output's, and a V as wide as K gives the equal-size result."""
    rng = np.random.default_rng(0)
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=9, seq_kv=13, head_dim=16, head_dim_v=24, causal=True)
    q, k = rng.standard_normal(spec.q_shape), rng.standard_normal(spec.kv_shape)
    v = rng.standard_normal(spec.v_shape)
    o, lse = reference_attention(spec, q, k, v, return_lse=True)
    assert o.shape == (1, 4, 9, 24)
    np.testing.assert_allclose(o[..., :16], reference_attention(spec, q, k, v[..., :16]), rtol=1e-12)
    wide = dataclasses.replace(spec, head_dim_v=None)
    o16, lse16 = reference_attention(wide, q, k, v[..., 8:], return_lse=True)
    np.testing.assert_allclose(o[..., 8:], o16, rtol=1e-12)
    np.testing.assert_array_equal(lse, lse16)
    assert reference_attention(spec, q, k[:, :, :0], v[:, :, :0]).shape == (1, 4, 9, 24)  # no key: zeros, Dv wide


GQA = dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300, causal=True)
#: name -> spec fields: V narrower and wider than K in every layout; the main nest, the packed
#: decode nests (split-KV at batch 2, V narrower: kvcache_bf16, wider: paged_lse_wider; the other
#: cache kernels without it, half a build's time) and the page order; fp32, fp16 and bf16 (the
#: bf16 decode dot products, QKᵀ and PV); 8-bit caches per head (kvcache), per token and per
#: group (paged; V's group count its own), int8 and float8, qk_int8 (QKᵀ only: once); append;
#: lse; the variants and a score_mod (one kernel: neither touches V)
KERNELS = {
    "bhsd_192_128": dict(batch=1, heads=2, seq_q=70, seq_kv=45, head_dim=192, head_dim_v=128, causal=True),
    "bhsd_dyn_wider_v_bf16": dict(batch=1, heads=4, kv_heads=2, seq_q=70, seq_kv=90, head_dim=32, head_dim_v=64,
                                  dtype="bfloat16", dynamic=("batch", "seq_q", "seq_kv")),
    "bhsd_variants_score_mod_f16": dict(batch=1, heads=4, kv_heads=2, seq_q=70, seq_kv=90, head_dim=64, head_dim_v=32,
                                        causal=True, dtype="float16", window=(30, 0), softcap=30.0, alibi=True,
                                        sinks=True, kv_start=True,
                                        score_mod="def score_mod(s, b, h, q, k):\n    return s - 0.1 * abs(q - k)\n"),
    "varlen": dict(batch=2, heads=4, kv_heads=2, seq_q=37, seq_kv=50, head_dim=64, head_dim_v=32, layout="varlen",
                   causal=True),
    "kvcache_bf16": dict(GQA, head_dim=128, head_dim_v=64, layout="kvcache", dtype="bfloat16"),
    # also test_exported_library_names_the_shapes_and_the_loader_checks_v's (float32: the loader's fast path)
    "kvcache_int8_qk8_append": dict(GQA, head_dim=96, head_dim_v=64, layout="kvcache", kv_dtype="int8", qk_int8=True,
                                    append=True),
    "paged_lse_wider": dict(GQA, head_dim=64, head_dim_v=128, layout="paged", return_lse=True),
    "paged_token_append": dict(GQA, head_dim=64, head_dim_v=32, layout="paged", kv_dtype="int8", kv_scale="token",
                               append=True),
    "paged_group_e4m3_append": dict(GQA, head_dim=64, head_dim_v=128, layout="paged", kv_dtype="float8_e4m3fn",
                                    kv_scale="group", append=True, dtype="bfloat16"),
}
#: the builds that keep split-KV (the preset's); the others are built without it
SPLIT = ("kvcache_bf16", "paged_lse_wider")


def kernel_build(name):
    """``(spec, build)`` of a KERNELS entry (conftest ``built``: one build, whichever test asks first)."""
    spec = AttentionSpec(**KERNELS[name])
    return spec, built(spec, knobs=None if name in SPLIT or not spec.layout_info.is_cache else (("split_tasks", 0),))


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matches_the_reference(name):
    """Each layout's validation cases (symbolic lengths at awkward values, empty caches, a key
    tail, pages shared and spare, per-token and per-group scales of unused rows poisoned with
    NaN) against the float64 reference; the audit finds no score-sized buffer."""
    spec, b = kernel_build(name)
    assert b.audit.fused, b.audit
    assert (b.knobs.split_tasks > 0) == (name in SPLIT) or not spec.layout_info.is_cache, b.knobs
    r = validate_built(b)
    assert r.passed and r.finite, r


def test_exported_library_names_the_shapes_and_the_loader_checks_v(tmp_path):
    from tvm_attention.layouts import KernelArgumentError
    from tvm_attention.loader import _SLOW, load

    spec, b = kernel_build("kvcache_int8_qk8_append")  # float32: the loader's fast path
    manifest = export(b, tmp_path, validate_built(b))
    shapes = {a["name"]: a["shape"] for a in manifest["args"]}
    assert shapes["v_cache"][-1] == 64 and shapes["o"][-1] == 64 and shapes["k_cache"][-1] == 96
    assert shapes["v_new"][-1] == 64 and shapes["k_new"][-1] == 96
    kernel = load(tmp_path)
    layout = spec.layout_info
    case = layout.validation_cases(spec)[1]  # ragged cache lengths, zero among them
    arrays = layout.random_inputs(spec, case)
    names = [a["name"] for a in spec.arg_specs() if a["name"] != "o"]
    ref = layout.reference_outputs(spec, arrays)[0]
    out = kernel(*[arrays[n] for n in names])  # (appends its new keys: a call again writes the same)
    assert out.shape == ref.shape and out.shape[-1] == 64
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)
    # the fast path (no Python checks; the library checks what it reads) allocates o Dv wide too
    fast = kernel._fast_call(tuple(arrays[n] for n in names), None)
    assert fast is not _SLOW and fast.shape == out.shape
    np.testing.assert_array_equal(fast, out)
    # V as wide as K (the mistake a caller makes): refused by name, nothing read
    wrong = dict(arrays, v_cache=np.ascontiguousarray(arrays["k_cache"]))
    with pytest.raises(KernelArgumentError, match=r"v_cache: expected shape \(batch, 2, max_len, 64\)"):
        kernel(*[wrong[n] for n in names])


def test_cli_flag():
    from tvm_attention.cli import _add_spec_flags, _spec_from_args

    p = argparse.ArgumentParser()
    _add_spec_flags(p)
    flags = ["--batch", "1", "--seq-q", "64", "--heads", "8", "--head-dim", "192"]
    assert _spec_from_args(p.parse_args(flags + ["--head-dim-v", "128"])).v_dim == 128
    assert _spec_from_args(p.parse_args(flags)).head_dim_v is None


#: the CUDA kernels with head_dim_v, emulated on the CPU (kernel, layout, page size, dtype, spec
#: fields): V's own shared tile and width (fewer columns than K, and more), its 8-bit forms, the
#: output and the split-KV partials of head_dim_v columns, varlen's packed V
CUDA_CASES = {
    "simt_varlen_lse": ("simt", "varlen", None, "float16", dict(causal=True, return_lse=True)),
    "simt_paged_int8_split": ("simt", "paged", 16, "bfloat16", dict(kv_dtype="int8", sinks=True, window=(300, 0),
                                                                    return_lse=True)),
    "mma_kvcache_e4m3_split": ("mma", "kvcache", None, "float16", dict(causal=True, kv_dtype="float8_e4m3fn")),
    "mma_bhsd_wider_v": ("mma", "bhsd", None, "float16", dict(causal=True, head_dim=16, head_dim_v=32)),
}


@pytest.mark.parametrize("name", list(CUDA_CASES))
def test_cuda_kernels_on_the_cpu(name):
    """Both CUDA kernels build a value head size of their own: emulated on the CPU
    (``conftest.check_emulated_layout``) against the float64 reference in their layouts, with
    split-KV in the cache layouts (``conftest.split_kv_cases``)."""
    import tvm

    from conftest import check_emulated_layout, split_kv_cases
    from tvm_attention.target import resolve_target
    from tvm_attention.workloads.fused_cuda import fused_attention_cuda
    from tvm_attention.workloads.fused_mma import fused_attention_mma

    kernel, layout, page, dtype, kw = CUDA_CASES[name]
    fields = dict(batch=1, heads=4, kv_heads=2, seq_q=64, head_dim=32, head_dim_v=16, dtype=dtype, layout=layout,
                  page_size=page)
    spec = AttentionSpec(**{**fields, **kw})
    split = 64 if spec.layout_info.is_cache else 0
    func = (fused_attention_cuda(spec, 16, 16, 4, emulate=True, split_tasks=split) if kernel == "simt" else
            fused_attention_mma(spec, 2, 16, 2, 1, emulate=True, split_tasks=split))
    ex = tvm.compile(func, target=resolve_target("llvm"))
    check_emulated_layout(ex, spec)
    if split:
        check_emulated_layout(ex, spec, split_kv_cases(layout))


@pytest.mark.skipif(__import__("tvm_attention.cuda_tools", fromlist=["find_nvcc"]).find_nvcc() is None,
                    reason="nvcc not installed: no ptxas report")
@pytest.mark.parametrize("schedule, fields", [
    ("fused", dict(dtype="bfloat16")),  # tensor cores, bhsd prefill
    ("fused_simt", dict(dtype="float32", layout="kvcache", kv_heads=16, seq_q=1, seq_kv=4096)),  # decode, split-KV
], ids=["tensor_cores_bf16", "simt_fp32_kvcache"])
def test_deepseek_dims_build_for_sm90_without_spills(schedule, fields):
    """DeepSeek's unabsorbed 192 / 128 on sm_90, offline: ptxas reports no spill and no local
    memory, the audit proves the build fused; the tensor-core one issues (block_n/16)·(D/16)
    ldmatrix for K and (block_n/16)·(Dv/16) for V per key tile, two mma pairs each per row group."""
    from tvm_attention.build import build_kernel
    from tvm_attention.schedules import cuda_mma
    from tvm_attention.target import resolve_target

    spec = AttentionSpec(**{**dict(batch=1, heads=16, seq_q=2048, head_dim=192, head_dim_v=128, causal=True),
                            **fields})
    b = build_kernel(spec, schedule, target=resolve_target("cuda", arch="sm_90"))
    r = b.resources
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0 and 0 < r["registers"] <= 255, r
    assert b.audit.fused, b.audit.format()
    if isinstance(b.knobs, cuda_mma.MMAKnobs):
        k, ptx = b.knobs, r["ptx_instructions"]
        loads = (k.block_n // 16) * (spec.head_dim // 16) + (k.block_n // 16) * (spec.v_dim // 16)
        assert ptx["ldmatrix"] == loads and ptx["mma.sync"] == 2 * loads * k.m_tiles, ptx
        assert r["shared_bytes"] == cuda_mma.shared_bytes(k, spec)
    else:
        assert b.knobs.split_tasks > 0


@pytest.mark.parametrize("schedule, target", [("materialized", "llvm"), ("rowcache", "llvm")])
def test_families_without_it_refuse_by_name(schedule, target):
    from tvm_attention.build import build_kernel

    spec = AttentionSpec(batch=1, heads=2, seq_q=64, head_dim=192, head_dim_v=128)
    with pytest.raises(KnobError, match="one head size for q, k, v and o, not head_dim=192 with head_dim_v=128"):
        build_kernel(spec, schedule, target)
