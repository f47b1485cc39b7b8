"""Device-side index checks (``spec.device_checks``, docs/cuda.md#index-checks-on-the-device):
the option through spec, CLI and manifest; the check kernel and the guards of
``workloads.index_checks.with_device_index_checks`` run emulated on the CPU (each broken rule
sets its bit and leaves the output untouched; valid calls compute what the reference does); real
CUDA builds compiled offline (ptxas: no spill); the loader's flag handling."""
import argparse

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from tvm_attention.build import build_kernel, with_checks
from tvm_attention.cli import _add_spec_flags, _spec_from_args
from tvm_attention.cuda_tools import find_nvcc
from tvm_attention.layouts import (INDEX_ERROR_BITS, LAYOUTS, KernelArgumentError, describe_index_error,
                                   has_index_arrays)
from tvm_attention.loader import AttentionKernel
from tvm_attention.spec import AttentionSpec, SpecError
from tvm_attention.target import resolve_target
from tvm_attention.validate import TOLERANCES
from tvm_attention.workloads.fused_cuda import fused_attention_cuda
from tvm_attention.workloads.index_checks import BITS, CHECK_THREADS, with_device_index_checks

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed: no ptxas report")

SENTINEL = 7.0


def _spec(layout, **kw):
    base = dict(batch=2, heads=4, kv_heads=2, seq_q=37, seq_kv=45, head_dim=32, layout=layout, device_checks=True,
                page_size=16 if layout == "paged" else None)
    return AttentionSpec(**{**base, **kw})


_EMULATED = {}


def emulated(spec):
    """The SIMT kernel of ``spec``, emulated, with the device checks, compiled for the CPU (once)."""
    if spec not in _EMULATED:
        func = fused_attention_cuda(spec, 16, 16, 4, emulate=True)
        mod = with_device_index_checks(tvm.IRModule({"main": func}), spec, emulate=True)
        _EMULATED[spec] = tvm.compile(mod, target=resolve_target("llvm"))
    return _EMULATED[spec]


def call(ex, spec, x):
    """Run ``ex`` on inputs ``x`` with the output filled with a sentinel and ``index_error`` with
    garbage (the kernel must always write it): (output, flag)."""
    names = [a.name for a in LAYOUTS[spec.layout].all_args(spec) if not a.output]
    o = tvm.runtime.tensor(np.full(x["q"].shape, SENTINEL, spec.np_dtype))
    err = tvm.runtime.tensor(np.array([-12345], np.int32))
    q = x["q"]
    lse = [tvm.runtime.empty((spec.heads, q.shape[0]) if spec.layout == "varlen" else q.shape[:3], "float32")] \
        if spec.return_lse else []
    ex["attention"](*[tvm.runtime.tensor(np.ascontiguousarray(x[n])) for n in names], o, *lse, err)
    return o.numpy(), int(err.numpy()[0])


# -- the option -------------------------------------------------------------------------------

def test_bits_table_and_message():
    assert all(bit & (bit - 1) == 0 for bit in INDEX_ERROR_BITS)  # one bit per rule
    assert BITS == {"cu_seqlens_q": 1, "cu_seqlens_k": 2, "cache_seqlens": 4, "block_table": 8, "kv_start": 16,
                    "k_scale": 32, "v_scale": 64, "alignment": 128, "q_scale": 256, "mask_indptr": 512}
    msg = describe_index_error(4 | 8)
    assert "index_error=12" in msg and "cache_seqlens:" in msg and "block_table:" in msg and "kv_start" not in msg
    assert "unknown bits 0x400" in describe_index_error(1024 | 1) and "cu_seqlens_q:" in describe_index_error(1024 | 1)
    assert "16-byte boundary" in describe_index_error(128)


def test_spec_records_the_option():
    spec = _spec("paged", return_lse=True)
    plain = _spec("paged", return_lse=True, device_checks=False)
    assert "device_checks" not in plain.to_dict()  # older manifests and logs compare equal
    assert spec.to_dict()["device_checks"] is True and spec.fingerprint() != plain.fingerprint()
    assert spec.short_name() == plain.short_name() + "_devchk"
    assert AttentionSpec.from_dict(spec.to_dict()) == spec
    args = spec.arg_specs()
    assert [a["name"] for a in args[-3:]] == ["o", "lse", "index_error"]
    assert args[-1] == {"name": "index_error", "shape": [1], "dtype": "int32"}
    assert "index_error" not in [a["name"] for a in plain.arg_specs()]
    assert not spec.representative().device_checks


def test_spec_refuses_where_meaningless():
    with pytest.raises(SpecError, match="device_checks: a bhsd kernel without kv_start"):
        _spec("bhsd")
    with pytest.raises(SpecError, match="device_checks must be a bool"):
        _spec("kvcache", device_checks=1)
    assert has_index_arrays(_spec("bhsd", kv_start=True)) and not has_index_arrays(AttentionSpec(1, 1, 1, 8))
    for target in ("llvm",):  # CPU kernels always check on the host
        with pytest.raises(ValueError, match="device_checks: .* built for llvm"):
            with_checks(None, _spec("kvcache"), resolve_target(target))
        with pytest.raises(ValueError, match="device_checks"):
            build_kernel(_spec("varlen"), target=target)


def test_cli_flag():
    p = argparse.ArgumentParser()
    _add_spec_flags(p)
    a = p.parse_args(["--layout", "kvcache", "--heads", "8", "--head-dim", "64", "--device-checks"])
    assert _spec_from_args(a).device_checks
    a = p.parse_args(["--layout", "kvcache", "--heads", "8", "--head-dim", "64"])
    assert not _spec_from_args(a).device_checks


# -- emulated: the check kernel's rules and the guards -------------------------------------------

def _mutations(spec, x):
    """(name of the broken rule, inputs that break it) for ``spec``'s index arrays."""
    out = []

    def bad(name, edit):
        y = {k: v.copy() for k, v in x.items()}
        edit(y)
        out.append((name, y))

    sq = x["q"].shape[-2]
    # values at the ends of int32 (docs/artifact_checks.md: no rule may add or multiply them in int32)
    huge = (2**31 - 1, 2**31 - sq, -2**31)
    if spec.layout == "varlen":
        bad("cu_seqlens_q", lambda y: y["cu_seqlens_q"].__setitem__(0, 1))  # must start at 0
        bad("cu_seqlens_k", lambda y: y["cu_seqlens_k"].__setitem__(1, y["cu_seqlens_k"][2] + 1))  # decreasing
        bad("cu_seqlens_k", lambda y: y["cu_seqlens_k"].__setitem__(-1, y["cu_seqlens_k"][-1] - 1))  # != total_k
        for v in huge:  # a step through ±2**31: its int32 difference would wrap to a small positive one
            bad("cu_seqlens_k", lambda y, v=v: y["cu_seqlens_k"].__setitem__(2, v))
    if spec.layout in ("kvcache", "paged"):
        bad("cache_seqlens", lambda y: y["cache_seqlens"].__setitem__(1, 10**6))
        bad("cache_seqlens", lambda y: y["cache_seqlens"].__setitem__(0, -1))
        for v in huge:
            bad("cache_seqlens", lambda y, v=v: y["cache_seqlens"].__setitem__(1, v))
    if spec.layout == "paged":
        last = int(np.argmax(x["cache_seqlens"]))
        pages = -(-int(x["cache_seqlens"][last]) // spec.page_size)
        bad("block_table", lambda y: y["block_table"].__setitem__((last, pages - 1), y["k_pages"].shape[0]))
        bad("block_table", lambda y: y["block_table"].__setitem__((last, 0), -1))
        for v in huge:  # a page index times page_size would pass 2**31
            bad("block_table", lambda y, v=v: y["block_table"].__setitem__((last, pages - 1), v))
    if spec.kv_start:
        keys = x["cache_seqlens"] if "cache_seqlens" in x else [x["k"].shape[2]] * x["q"].shape[0]
        bad("kv_start", lambda y: y["kv_start"].__setitem__(0, int(keys[0]) + 1))
        bad("kv_start", lambda y: y["kv_start"].__setitem__(-1, -1))
        for v in huge:
            bad("kv_start", lambda y, v=v: y["kv_start"].__setitem__(0, v))
    return out


CASES = [("kvcache", dict(kv_start=True, causal=True)), ("paged", dict(kv_start=True, return_lse=True)),
         ("varlen", dict(causal=True)), ("bhsd", dict(kv_start=True, dynamic=("batch", "seq_q", "seq_kv")))]


@pytest.mark.parametrize("layout, variants", CASES, ids=[c[0] for c in CASES])
def test_emulated_checks_set_the_bit_and_skip_the_kernel(layout, variants):
    spec = _spec(layout, **variants)
    ex = emulated(spec)
    lay = LAYOUTS[layout]
    atol, rtol = TOLERANCES[spec.dtype]
    case = {"seqlens": [(0, 7), (1, 1), (70, 33), (33, 70), (5, 0)]} if layout == "varlen" else \
        lay.validation_cases(spec)[1 if layout != "bhsd" else 0]
    x = lay.random_inputs(spec, case, seed=3)
    out, flag = call(ex, spec, x)
    assert flag == 0
    ref = lay.reference(spec, x)
    assert np.allclose(out, ref, atol=atol, rtol=rtol), np.abs(out - ref).max()
    for name, y in _mutations(spec, x):
        with pytest.raises(KernelArgumentError, match=name):  # the host rules refuse the same call
            lay.check_indices(y, {"total_q": y["q"].shape[0], "total_k": y["k"].shape[0] if "k" in y else 0,
                                  "max_len": y["k_cache"].shape[2] if "k_cache" in y else 0,
                                  "num_pages": y["k_pages"].shape[0] if "k_pages" in y else 0,
                                  "max_pages": y["block_table"].shape[1] if "block_table" in y else 0,
                                  "seq_q": y["q"].shape[-2]}, spec)
        out, flag = call(ex, spec, y)
        assert flag == BITS[name], (name, flag)
        assert (out == SENTINEL).all(), name  # no kernel ran


def test_emulated_checks_cover_more_sequences_than_threads():
    """A batch past the check block's threads: each thread takes every 256th sequence and
    block-table entry; a bad entry of the last sequence is found."""
    spec = _spec("paged", seq_q=1)
    ex = emulated(spec)
    lay = LAYOUTS["paged"]
    n = CHECK_THREADS + 3
    x = lay.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [17] * n}, seed=1)
    _, flag = call(ex, spec, x)
    assert flag == 0
    x["block_table"][n - 1, 1] = 10**6
    assert call(ex, spec, x)[1] == BITS["block_table"]


def _two_kernels(emulate: bool):
    """A kvcache-signature function of two kernels (o = q, then o += 1), as a split-KV decode
    with its merge kernel is: each guarded by the pass."""
    block = (lambda n: T.serial(n)) if emulate else (lambda n: T.thread_binding(n, thread="blockIdx.x"))
    thread = (lambda n: T.serial(n)) if emulate else (lambda n: T.thread_binding(n, thread="threadIdx.x"))
    B, ML = tvm.tirx.Var("batch", "int32"), tvm.tirx.Var("max_len", "int32")

    f32, i32 = "float32", "int32"  # names: pyflakes reads a string in an annotation as a type

    @T.prim_func(s_tir=True)
    def attention(Q: T.Buffer((B, 1, 1, 32), f32), K: T.Buffer((B, 1, ML, 32), f32),
                  V: T.Buffer((B, 1, ML, 32), f32), CS: T.Buffer((B,), i32), O: T.Buffer((B, 1, 1, 32), f32)):
        T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
        for b in block(B):
            for t in thread(32):
                O[b, 0, 0, t] = Q[b, 0, 0, t]
        for b in block(B):
            for t in thread(32):
                O[b, 0, 0, t] = O[b, 0, 0, t] + T.float32(1)

    return attention


def test_every_kernel_is_guarded():
    spec = AttentionSpec(batch=2, heads=1, seq_q=1, seq_kv=8, head_dim=32, layout="kvcache", device_checks=True)
    mod = with_device_index_checks(tvm.IRModule({"main": _two_kernels(True)}), spec, emulate=True)
    ex = tvm.compile(mod, target=resolve_target("llvm"))
    q = np.arange(64, dtype=np.float32).reshape(2, 1, 1, 32)
    kv = np.zeros((2, 1, 8, 32), np.float32)

    def run(lens):
        o = tvm.runtime.tensor(np.full(q.shape, SENTINEL, np.float32))
        err = tvm.runtime.tensor(np.array([-1], np.int32))
        ex["attention"](*(tvm.runtime.tensor(a) for a in (q, kv, kv, np.asarray(lens, np.int32))), o, err)
        return o.numpy(), int(err.numpy()[0])

    out, flag = run([8, 0])
    assert flag == 0 and np.array_equal(out, q + 1)  # both kernels ran
    out, flag = run([9, 0])
    assert flag == BITS["cache_seqlens"] and (out == SENTINEL).all()  # neither did
    # on CUDA: three kernels (the check first), the two given ones each guarded inside
    cuda = with_device_index_checks(tvm.IRModule({"main": _two_kernels(False)}), spec)
    src = tvm.compile(cuda, target=resolve_target("cuda", arch="sm_80")).mod.imports[0].inspect_source()
    assert src.count("__global__") == 3 * 2  # declarations, then definitions
    assert src.count("(index_error_ptr[0] == 0)") == 2 and "index_error_ptr[0] = red_ptr[0];" in src


def test_a_kernel_without_grid_is_refused():
    spec = AttentionSpec(batch=2, heads=1, seq_q=1, seq_kv=8, head_dim=32, layout="kvcache", device_checks=True)
    with pytest.raises(ValueError, match="no kernel"):  # CUDA mode: the emulated loops bind no blockIdx
        with_device_index_checks(tvm.IRModule({"main": _two_kernels(True)}), spec)


# -- real CUDA builds, offline -------------------------------------------------------------------

def test_emulated_checks_of_an_8bit_split_kv_build():
    """A split-KV build (a chunk kernel and a merge kernel, both guarded) with an 8-bit cache: a
    valid call splits and matches the reference on the dequantized cache; a scale that is not a
    positive finite number sets its own bit (k_scale 32, v_scale 64) and nothing runs."""
    spec = _spec("kvcache", seq_q=1, kv_dtype="float8_e4m3fn", causal=True, return_lse=True)
    func = fused_attention_cuda(spec, 16, 16, 4, emulate=True, split_tasks=64)
    ex = tvm.compile(with_device_index_checks(tvm.IRModule({"main": func}), spec, emulate=True),
                     target=resolve_target("llvm"))
    lay = LAYOUTS["kvcache"]
    x = lay.random_inputs(spec, {"seq_q": 1, "cache_seqlens": [0, 700, 1100, 3], "max_len": 1111}, seed=4)
    out, flag = call(ex, spec, x)
    assert flag == 0
    atol, rtol = TOLERANCES[spec.dtype]
    ref = lay.reference(spec, x)
    assert np.allclose(out, ref, atol=atol, rtol=rtol), np.abs(out - ref).max()
    for name, value in (("k_scale", 0.0), ("v_scale", np.nan), ("k_scale", -1.0)):
        y = {k: v.copy() for k, v in x.items()}
        y[name][1] = value
        out, flag = call(ex, spec, y)
        assert flag == BITS[name], (name, flag)
        assert (out == SENTINEL).all(), name


@pytest.mark.parametrize("layout, variants", [("varlen", {}), ("paged", dict(append=True, causal=True)),
                                              ("bhsd", dict(dynamic=("batch", "seq_q", "seq_kv")))])
def test_emulated_checks_of_a_custom_mask(layout, variants):
    """A custom mask's ``mask_indptr`` is read by the kernels to find each sequence's bits: the
    check kernel judges it as the host rule does (batch + 1 entries; each sequence's bytes from 0
    or more, ``ceil(rows · keys / 8)`` of them, in int64, within ``custom_mask``), bit 512, and
    then nothing runs; a valid call matches the reference (a bhsd build takes device checks for
    its mask alone)."""
    spec = _spec(layout, custom_mask=True, **variants)
    ex = emulated(spec)
    lay = LAYOUTS[layout]
    case = {"seqlens": [(0, 7), (1, 1), (70, 33), (33, 70)]} if layout == "varlen" else \
        lay.validation_cases(spec)[-1]
    x = lay.random_inputs(spec, case, seed=3)
    out, flag = call(ex, spec, x)
    assert flag == 0
    ref = lay.reference(spec, x)
    atol, rtol = TOLERANCES[spec.dtype]
    assert np.allclose(out, ref, atol=atol, rtol=rtol), np.abs(out - ref).max()
    mi = x["mask_indptr"]
    for what, edit in (("negative", lambda m: m.__setitem__(0, -1)),
                       ("too few bytes", lambda m: m.__setitem__(-2, m[-1])),
                       ("past the bytes", lambda m: m.__setitem__(-1, m[-1] + 1)),
                       ("int32's end", lambda m: m.__setitem__(-1, 2**31 - 1)),
                       ("one entry short", None)):
        y = {k: v.copy() for k, v in x.items()}
        if edit is None:
            y["mask_indptr"] = mi[:-1].copy()
        else:
            edit(y["mask_indptr"])
        out, flag = call(ex, spec, y)
        assert flag == BITS["mask_indptr"], (what, flag)
        assert (out == SENTINEL).all(), what


@needs_nvcc
@pytest.mark.parametrize("arch, dtype, layout, variants", [
    ("sm_80", "float32", "paged", dict(kv_start=True)),  # CUDA cores
    ("sm_90", "float16", "varlen", dict(return_lse=True)),  # tensor cores
])
def test_cuda_builds_offline_with_the_check_kernel(arch, dtype, layout, variants):
    spec = AttentionSpec(batch=8, heads=32, kv_heads=8, seq_q=1 if layout == "paged" else 512, seq_kv=4096,
                         head_dim=128, dtype=dtype, causal=True, layout=layout,
                         page_size=16 if layout == "paged" else None, device_checks=True, **variants)
    built = build_kernel(spec, "fused", target=resolve_target("cuda", arch=arch))
    r = built.resources
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0, r
    assert built.audit.fused, built.audit.format()
    src = built.module.imports[0].inspect_source()
    kernels = [s for s in src.split("extern \"C\" __global__")[1:] if "{" in s.split(";")[0]]
    assert "index_error_ptr[0] = red_ptr[0];" in kernels[0]  # the check kernel runs first
    # ... and tests the low bits of q, k, v and o's pointers (bit 128), which the host cannot
    names = [a.name for a in LAYOUTS[layout].all_args(spec)[:3]] + [LAYOUTS[layout].output.name]
    assert kernels[0].count("attn_misaligned16(") == len(names) == 4 and "? 128 : 0" in kernels[0]
    assert all("(index_error_ptr[0] == 0)" in k for k in kernels[1:]) and len(kernels) >= 2
    assert "index_error" in built.lowered.host.script()  # the exported function takes it


# -- the loader ----------------------------------------------------------------------------------

class OnCpu(AttentionKernel):
    """The loader's CUDA path on the CPU device (an emulated kernel is a CPU function)."""

    def _cuda_device(self):
        return tvm.cpu(0)


def test_loader_passes_and_reads_the_flag():
    spec = _spec("paged", kv_start=True, return_lse=True)
    ex = emulated(spec)
    calls = []
    kernel = OnCpu(spec, lambda *a: (calls.append(len(a)), ex["attention"](*a)), device="cuda")
    lay = LAYOUTS["paged"]
    names = [a.name for a in lay.all_args(spec) if not a.output]
    x = lay.random_inputs(spec, lay.validation_cases(spec)[1], seed=2)
    o, lse = kernel(*[x[n] for n in names])
    np.testing.assert_allclose(o, lay.reference(spec, x), atol=1e-5, rtol=1e-5)
    assert calls == [len(names) + 3]  # o, lse, index_error
    # a flag the device set: refused after the call, naming the arrays (host arrays passed the
    # host checks here, so a kernel that reports a violation stands in for a GPU-resident one)
    bad = OnCpu(spec, lambda *a: a[-1].copyfrom(np.array([BITS["block_table"] | BITS["kv_start"]], np.int32)),
                device="cuda")
    with pytest.raises(KernelArgumentError, match="index_error=24.*block_table: .*kv_start: "):
        bad(*[x[n] for n in names])


def test_loader_skips_host_reads_only_when_the_device_checks_cover_them():
    def kernel(spec):
        return OnCpu(spec, lambda *a: None, device="cuda")

    assert kernel(_spec("paged", kv_start=True, alibi=True))._skips_host_reads({})
    assert not kernel(_spec("paged", device_checks=False))._skips_host_reads({})
    assert not kernel(_spec("kvcache", key_bounds=True))._skips_host_reads({})  # key bounds: host rules only
    varlen = kernel(_spec("varlen"))
    assert varlen._skips_host_reads({"causal": False}) and not varlen._skips_host_reads({"max_seqlen_q": 5})


@needs_nvcc
def test_cli_build_records_the_option_in_the_manifest(tmp_path, capsys):
    import json

    from tvm_attention.cli import main

    flags = ["build", "--layout", "paged", "--heads", "8", "--kv-heads", "2", "--head-dim", "64", "--device-checks"]
    assert main([*flags, "--target", "cuda", "--arch", "sm_80", "--out", str(tmp_path / "a")]) == 0
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["spec"]["device_checks"] is True and m["args"][-1] == {"name": "index_error", "shape": [1], "dtype": "int32"}
    assert "_devchk" in AttentionSpec.from_dict(m["spec"]).short_name()
    assert main([*flags, "--out", str(tmp_path / "b")]) == 2  # a CPU build
    assert "device_checks: " in capsys.readouterr().err and not (tmp_path / "b").exists()
