"""The Hopper kernel (``workloads/fused_wgmma.py``, ``schedules/cuda_hopper.py``), offline: the
NumPy model of its data movement (TMA boxes into 128B-swizzled shared memory, wgmma descriptors,
fragments, mbarrier parities, the ping-pong's named barriers) against the float64 reference and
against faults planted in it; sm_90a builds whose SASS holds the warpgroup products and the TMA
loads without spills or serialized products; the refusals. Its GPU run is the payload's
(``scripts/gpu_payload.py --hopper``)."""
import dataclasses
import functools
import os
import re

import numpy as np
import pytest
from tvm_attention.schedules import check as check_family
from tvm_attention.schedules import cuda_hopper
from tvm_attention.schedules._knobs import KnobError

from tvm_attention.build import build_kernel
from tvm_attention.cuda_tools import find_cuobjdump, find_nvcc
from tvm_attention.reference import reference_attention
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target
from tvm_attention.workloads import wgmma_layout, wgmma_model
from tvm_attention.workloads.wgmma_layout import SmemPlan, decode_desc, encode_desc
from tvm_attention.workloads.wgmma_model import (
    ModelError,
    from_bits,
    pingpong_turns,
    run,
    to_bits,
)

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed: no sm_90a build")
SM90 = resolve_target("cuda", arch="sm_90")


def inputs(b, h, kh, sq, sk, d, dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    q, k, v = (scale * rng.standard_normal(s) for s in ((b, h, sq, d), (b, kh, sk, d), (b, kh, sk, d)))
    return tuple(from_bits(to_bits(x, dtype), dtype) for x in (q, k, v))  # exactly the 16-bit values


def model_error(plan, sq, sk, causal, dtype="float16", kh=2, pingpong=True, seed=0, overlap=True, **variants):
    """The model's largest error against the float64 reference (and its output) for a spec of
    ``variants`` (window, softcap, alibi, sinks, kv_start), their arguments drawn here."""
    spec = AttentionSpec(batch=2, heads=4, kv_heads=kh, seq_q=sq, seq_kv=sk, head_dim=plan.head_dim,
                         dtype="float16", causal=causal, **variants)
    q, k, v = inputs(2, 4, kh, sq, sk, plan.head_dim, dtype, seed)
    rng = np.random.default_rng(seed + 1)
    args = {"alibi_slopes": rng.uniform(0.01, 0.2, 4) if spec.alibi else None,
            "sinks": rng.uniform(-1, 3, 4) if spec.sinks else None,
            "kv_start": np.array([0, min(sk, 77)], np.int32) if spec.kv_start else None}
    out = run(q, k, v, plan, spec, dtype, pingpong, overlap, **args)
    ref = reference_attention(spec, q, k, v, **args)
    return float(np.abs(out - ref).max()), out


#: (head_dim, block_m, block_n, stages, seq_q, seq_kv, causal, dtype, overlap): the presets' tiles and
#: the search's, tails in both lengths, seq_q above seq_kv under causal masking (rows that see no
#: key), several key tiles per stage (the parities' second and third rounds), one consumer
#: warpgroup, each tile in turn or overlapped (S of tile j with P·V of tile j − 1)
MODEL_CASES = [
    (64, 128, 128, 2, 200, 333, False, "float16", True),
    (128, 128, 128, 2, 130, 300, True, "float16", True),
    (128, 128, 64, 2, 300, 130, True, "bfloat16", False),
    (64, 128, 176, 3, 128, 700, True, "bfloat16", True),
    (128, 64, 128, 2, 77, 520, False, "float16", False),
    (64, 128, 64, 4, 256, 1000, False, "bfloat16", False),
    (128, 64, 64, 2, 64, 1000, True, "bfloat16", True),
    (64, 128, 64, 1, 200, 333, True, "float16", False),
]


@pytest.mark.parametrize("d, bm, bn, ns, sq, sk, causal, dtype, overlap", MODEL_CASES)
def test_model_matches_reference(d, bm, bn, ns, sq, sk, causal, dtype, overlap):
    """The kernel's data movement, run through the hardware's definitions, computes attention:
    every row within the rounding of P to 16 bits; rows that see no key exactly zero."""
    err, out = model_error(SmemPlan(d, bm, bn, ns), sq, sk, causal, dtype, pingpong=bm == 128, overlap=overlap)
    assert err < (2e-3 if dtype == "float16" else 1.5e-2), err
    if causal and sq > sk:
        assert not out[:, :, : sq - sk].any()


#: (head_dim, block_n, seq_q, seq_kv, variants): a left window with causal (tiles skipped before
#: the first a block's rows may see), a two-sided window, softcap and ALiBi (scores in log2 units
#: before the max), sinks (the denominator), a first key per sequence (rows past it only)
VARIANT_CASES = [
    (64, 64, 300, 700, {"causal": True, "window": (100, 0)}),
    (128, 64, 200, 520, {"window": (64, 32)}),
    (64, 128, 130, 300, {"causal": True, "softcap": 20.0, "alibi": True}),
    (128, 64, 150, 260, {"sinks": True, "alibi": True}),
    (64, 64, 90, 400, {"causal": True, "kv_start": True, "window": (150, 0), "sinks": True}),
]


@pytest.mark.parametrize("d, bn, sq, sk, variants", VARIANT_CASES)
def test_model_matches_reference_with_variants(d, bn, sq, sk, variants):
    variants = dict(variants)
    causal = variants.pop("causal", False)
    err, _ = model_error(SmemPlan(d, 128, bn, 2), sq, sk, causal, **variants)
    assert err < 2e-3, err


def test_descriptor_encoding_round_trips():
    d = encode_desc(0x1C480, 16384, 1024)
    assert decode_desc(d) == (0x1C480, 16384, 1024, wgmma_layout.MODE_SWIZZLE_128B)
    with pytest.raises(ValueError, match="multiple of 16"):
        encode_desc(0x1C488, 16, 1024)


def test_kernel_fragments_are_the_isa_fragments():
    """The kernel's own indexing of accumulator registers (softmax, store) is the ISA's."""
    t = np.arange(128)[:, None]
    r = np.arange(64)[None, :]
    rows, cols = wgmma_model.isa_acc(t, r)
    assert (wgmma_layout.acc_row(t, r) == rows).all() and (wgmma_layout.acc_col(t, r) == cols).all()


class _Plan(SmemPlan):
    pass


@pytest.mark.parametrize("fault", ["v_lbo", "q_step", "k_step", "v_step", "p_pair", "box_rows", "q_rows"])
def test_model_catches_data_movement_faults(monkeypatch, fault):
    """A planted fault in an address, stride, box or packing order gives wrong rows (or breaks a
    rule the model checks: boxes short of the bytes a barrier expects)."""
    plan = SmemPlan(128, 128, 64, 2)
    if fault == "v_lbo":  # V's slabs read as if adjacent (the K-major LBO)
        monkeypatch.setattr(SmemPlan, "v_lbo", property(lambda self: 16))
    elif fault == "q_step":  # the k16 step inside a slab as 16 bytes
        monkeypatch.setattr(SmemPlan, "q_step", lambda self, kk: self.q_slab(kk // 4) + kk % 4 * 16)
    elif fault == "k_step":  # the next slab missed
        monkeypatch.setattr(SmemPlan, "k_step", lambda self, kk: kk % 4 * 32)
    elif fault == "v_step":  # 8 keys a step
        monkeypatch.setattr(SmemPlan, "v_step", lambda self, kk: kk * 8 * 128)
    elif fault == "p_pair":  # P's registers packed a2 before a1
        monkeypatch.setattr(wgmma_model, "p_pair", lambda kk, q: 4 * kk + [0, 2, 1, 3][q])
    elif fault == "box_rows":  # K/V boxes of 64 rows for a tile of block_n
        real = wgmma_layout.tensor_map
        monkeypatch.setattr(wgmma_model, "tensor_map",
                            lambda c, r, p, box, isz=2, cols=None: real(c, r, p, min(box, 32), isz, cols))
    elif fault == "q_rows":  # both consumers reading the first 64 rows of Q
        monkeypatch.setattr(SmemPlan, "q_rows", lambda self, wg: 0)
    try:
        err, _ = model_error(plan, 200, 300, False)
    except ModelError:
        return
    assert err > 0.05, f"{fault}: error {err} — the model did not see it"


@pytest.mark.parametrize("fault", ["full_parity", "empty_parity", "expect_bytes", "unaligned", "one_stage"])
def test_model_catches_synchronization_faults(monkeypatch, fault):
    """A wrong mbarrier parity or transaction count, a misaligned swizzled box, or the overlap with
    one stage (tile j's K waits for the release of tile j − 1's V, which waits for tile j), is refused."""
    plan = SmemPlan(64, 128, 64, 1 if fault == "one_stage" else 2)
    if fault == "full_parity":
        monkeypatch.setattr(wgmma_model, "full_parity", lambda j, s: (j // s + 1) % 2)
    elif fault == "empty_parity":
        monkeypatch.setattr(wgmma_model, "empty_parity", lambda j, s: j // s % 2)
    elif fault == "expect_bytes":
        monkeypatch.setattr(SmemPlan, "kv_tile_bytes", property(lambda self: self.block_n * self.head_dim * 4))
    elif fault == "unaligned":
        monkeypatch.setattr(SmemPlan, "q_bytes", property(lambda self: self.block_m * self.head_dim * 2 + 512))
    with pytest.raises(ModelError):
        model_error(plan, 128, 400, False)


def test_pingpong_protocol_ends_without_deadlock():
    """The consumers' turns strictly alternate (qk, qk, pv, pv of each tile) for any tile count,
    and leave no arrival pending; without consumer 1's first arrival they deadlock."""
    for n in range(5):
        order = pingpong_turns(n)
        assert [(wg, gemm) for wg, gemm, _ in order] == [(w, g) for _ in range(n) for g in ("qk", "pv") for w in (0, 1)]
        order = pingpong_turns(n, overlap=True)
        assert [wg for wg, _, _ in order] == [0, 1] * (n + 1 if n else 0)
    with pytest.raises(ModelError, match="deadlock"):
        pingpong_turns(2, first_arrival=False)


def test_nan_in_gives_nan_out():
    plan = SmemPlan(64, 128, 64, 2)
    spec = AttentionSpec(batch=1, heads=2, kv_heads=1, seq_q=70, seq_kv=90, head_dim=64, dtype="float16")
    q, k, v = inputs(1, 2, 1, 70, 90, 64, "float16")
    k[0, 0, 5, 3] = np.nan
    out = run(q, k, v, plan, spec)
    assert np.isnan(out).all()  # key 5 is seen by every row


# -- builds ------------------------------------------------------------------------------------------
@functools.cache
def hopper_build(spec: AttentionSpec):
    return build_kernel(spec, "fused_hopper", target=SM90)


#: (head_dim, dtype, causal, symbolic, lse): each head dim and dtype, causal or not, a symbolic build;
#: the whole product (16 builds, docs/cuda.md) with TVMA_CUDA_SWEEP=1 (scripts/cuda_build_sweep.py)
BUILDS = [
    (128, "float16", True, False, False),
]  # the sweep adds bf16, D=64, symbolic and lse (and test_varlen/variants_build_offline)
if os.environ.get("TVMA_CUDA_SWEEP"):  # the whole product
    BUILDS = [(d, dt, c, dyn, dyn) for d in (64, 128) for dt in ("float16", "bfloat16") for c in (False, True)
              for dyn in (False, True)]


@needs_nvcc
@pytest.mark.parametrize("d, dtype, causal, symbolic, lse", BUILDS)
def test_sm90a_builds_offline(d, dtype, causal, symbolic, lse):
    """sm_90a builds: no spill or stack, ptxas does not serialize the wgmma products, the PTX and
    the SASS hold the warpgroup products (HGMMA) and the TMA loads (UTMALDG), and the audit finds
    no score-sized buffer."""
    spec = AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=4096, head_dim=d, dtype=dtype, causal=causal,
                         return_lse=lse, dynamic=("batch", "seq_q", "seq_kv") if symbolic else ())
    built = hopper_build(spec)
    r = built.resources
    assert r["nvcc_arch"] == "sm_90a"
    assert r["spills"] == 0 and r["stack_frame_bytes"] == 0, r
    assert not r["wgmma_serialized"], r["ptxas_notes"]
    plan = cuda_hopper.plan(built.knobs, spec)
    ptx = r["ptx_instructions"]
    # overlapped, each product is issued at two places: the first tile's S and the last P·V apart
    sites = 2 if built.knobs.overlap else 1
    assert ptx["wgmma.mma_async"] == sites * (plan.qk_steps + plan.pv_steps)
    assert ptx["cp.async.bulk.tensor"] >= 3 * plan.slabs and ptx["setmaxnreg"] == 2
    assert ptx["ld.local"] == ptx["st.local"] == 0
    if find_cuobjdump() is not None:
        assert "sass_instructions" in r, r.get("sass_error")
        sass = r["sass_instructions"]
        assert sass["HGMMA"] >= sites * (plan.qk_steps + plan.pv_steps) and sass["UTMALDG"] >= 3 * plan.slabs, sass
        assert sass["LDL"] == sass["STL"] == 0 and sass["HMMA"] == 0
    assert built.audit.fused
    assert r["dynamic_shared_bytes"] == plan.alloc_bytes
    # the allocation the launch asks for is the whole plan (a pointer to element 0 alone once let
    # TVM compact it to one byte: TMA would have written past a block's shared memory)
    smem = [a for a in built.audit.allocations if a.scope == "shared.dyn"]
    assert [a.elements for a in smem] == [plan.alloc_bytes]


#: builds of the other layouts and the variants: (name, spec fields, parameter names past K, V).
#: The default run builds one paged decode step that takes the most paths at once (4-D boxes,
#: pages, stale rows zeroed, an e4m3 cache converted by the producer warpgroup, split-KV's merge,
#: lse, device checks, the new keys appended by a kernel of their own); the sweep
#: (``scripts/cuda_build_sweep.py``) adds the 16-bit paged step,
#: varlen, every variant at once and an int8 cache.
LAYOUT_BUILDS = [
    ("paged_e4m3", dict(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, dtype="bfloat16",
                        causal=True, layout="paged", page_size=16, kv_dtype="float8_e4m3fn", return_lse=True,
                        device_checks=True, append=True), ["BT", "CS", "KSC", "VSC", "KN", "VN", "O", "LSE"]),
]
if os.environ.get("TVMA_CUDA_SWEEP"):
    LAYOUT_BUILDS += [
        ("paged", dict(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, dtype="float16",
                       causal=True, layout="paged", page_size=16, return_lse=True, device_checks=True),
         ["BT", "CS", "O", "LSE"]),
        ("varlen", dict(batch=3, heads=8, kv_heads=2, seq_q=512, head_dim=128, dtype="bfloat16", causal=True,
                        layout="varlen", return_lse=True), ["CQ", "CK", "O", "LSE"]),
        ("variants", dict(batch=2, heads=8, kv_heads=2, seq_q=512, seq_kv=700, head_dim=64, dtype="float16",
                          causal=True, window=(127, 0), softcap=30.0, alibi=True, sinks=True, kv_start=True,
                          return_lse=True, dynamic=("batch", "seq_q", "seq_kv")), ["AL", "SN", "KS", "O", "LSE"]),
        ("kvcache_int8", dict(batch=2, heads=8, kv_heads=2, seq_q=16, seq_kv=1024, head_dim=64, dtype="bfloat16",
                              causal=True, layout="kvcache", kv_dtype="int8", sinks=True, return_lse=True),
         ["CS", "SN", "KSC", "VSC", "O", "LSE"]),
    ]


@needs_nvcc
@pytest.mark.parametrize("name, fields, params", LAYOUT_BUILDS, ids=[b[0] for b in LAYOUT_BUILDS])
def test_layout_builds_offline(name, fields, params):
    """The other layouts' builds: no spill, the products not serialized, the arguments in the
    layouts' call order. Paged: a KV head's 4 query heads in the tile's rows (Q by a 4-D box), a
    box per page of 16 through the block table, the index checks' kernel first; the cache's (or,
    varlen, the next sequence's) rows past a sequence's keys zeroed in V (st.shared, the async
    proxy's fence, a warpgroup barrier)."""
    from tvm_attention.cuda_tools import kernel_source

    spec = AttentionSpec(**fields)
    built = hopper_build(spec)
    r = built.resources
    assert r["spills"] == 0 and not r["wgmma_serialized"] and built.audit.fused, r
    assert "sass_error" not in r, r["sass_error"]
    func = cuda_hopper.workload(spec, built.knobs)
    assert [p.name for p in func.params] == ["Q", "K", "V", *params]
    src = kernel_source(built.module)
    if spec.layout != "bhsd":
        assert "hop_zero_rows(" in src and "fence.proxy.async.shared::cta" in src
    if spec.layout == "paged":
        assert "cp.async.bulk.tensor.4d" in src
        assert ("index_error_ptr" in src) == spec.device_checks
        # the index checks' kernel first, the append's, the tiles, split-KV's merge (each declared,
        # then defined)
        kernels = set(re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([\d, ]+\) )?(\w+)\(', src))
        assert len(kernels) == 2 + spec.device_checks + spec.append, kernels
        if "sass_instructions" in r:  # Q's 2 slabs, K's and V's 8 pages (a slab each; 8-bit: whole rows)
            assert r["sass_instructions"]["UTMALDG"] >= 2 + 2 * 8 * (1 if spec.kv_dtype else 2)
    if spec.kv_dtype == "float8_e4m3fn":  # the producer warpgroup's conversion, by the hardware's cvt
        assert "hop_cvt8_e4m3fn_bf16" in src and "cvt.rn.f16x2.e4m3x2" in src
    elif spec.kv_dtype == "int8":  # by its bits
        assert "hop_cvt8_i8_bf16" in src and "__byte_perm" in src


@pytest.mark.skipif(find_cuobjdump() is None and find_nvcc() is not None,
                    reason="cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
def test_cuobjdump_available_with_nvcc():
    """Where nvcc is, the test extra's cuobjdump is too: the SASS checks above are not skipped."""
    assert find_nvcc() is None or find_cuobjdump() is not None


@pytest.mark.parametrize("change, match", [
    (dict(layout="mla", head_dim=576, head_dim_v=512, heads=16, kv_heads=1, scale=0.0723), "builds layout"),
    (dict(layout="paged", page_size=12), "page_size=12"),
    (dict(layout="kvcache", kv_dtype="int8", kv_scale="token"), "per token"),
    (dict(kv_dtype="int8"), "8-bit K/V caches"),
    (dict(layout="kvcache", heads=24, kv_heads=2), "group size 12"),
    (dict(dtype="float32"), "builds dtype"),
    (dict(head_dim_v=64), "one head size"),
    (dict(head_dim=96), "head_dim=96"),
])
def test_refusals_name_what(change, match):
    base = dict(batch=1, heads=8, kv_heads=2, seq_q=1024, head_dim=128, dtype="float16")
    spec = AttentionSpec(**{**base, **change})
    with pytest.raises(KnobError, match=match):
        check_family(cuda_hopper, cuda_hopper.preset(spec, SM90), spec, SM90)


def test_knob_checks():
    spec = AttentionSpec(batch=1, heads=8, seq_q=1024, head_dim=128, dtype="bfloat16")
    k = cuda_hopper.preset(spec, SM90)
    with pytest.raises(KnobError, match="sm_90"):
        cuda_hopper.check(k, spec, resolve_target("cuda", arch="sm_80"))
    with pytest.raises(KnobError, match="pingpong takes two"):
        cuda_hopper.check(dataclasses.replace(k, block_m=64), spec, SM90)
    with pytest.raises(KnobError, match="shared memory"):
        cuda_hopper.check(dataclasses.replace(k, stages=4, block_n=192, overlap=0), spec, SM90)
    with pytest.raises(KnobError, match="overlap with block_n=176"):
        cuda_hopper.check(dataclasses.replace(k, block_n=176), spec, SM90)
    with pytest.raises(KnobError, match="stages >= 2"):
        cuda_hopper.check(dataclasses.replace(k, stages=1), spec, SM90)
    cands = cuda_hopper.tile_candidates(spec, SM90)
    assert cands[0] == k and len(cands) == len(set(cands)) > 3
    for c in cands:
        cuda_hopper.check(c, spec, SM90)
    # the workload records its knobs: the tuner's logs regenerate it from them
    func = cuda_hopper.workload(spec, cands[-1])
    assert cuda_hopper.workload_knobs(func) == cands[-1]


FAKE_CHILD = r"""
import os, sys, time
dirs = sys.argv[sys.argv.index("--smoke") + 1:]
for d in dirs:
    print("SMOKE start", d, flush=True)
    if d.startswith("hang"):
        time.sleep(60)
    if d.startswith("crash"):
        os._exit(3)
    print("SMOKE", "invalid" if d.startswith("bad") else "ok", d, "0.5", flush=True)
"""


def test_first_runs_isolate_hangs_and_crashes(tmp_path):
    """The device check runs a kernel not yet run on a GPU first in a child process: a kernel that
    hangs or kills its process costs itself alone, the others still run and pass."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        check = importlib.import_module("gpu_device_check")
    finally:
        sys.path.pop(0)
    child = tmp_path / "child.py"
    child.write_text(FAKE_CHILD)
    dirs = ["ok1", "hang1", "ok2", "crash1", "bad1", "ok3"]
    failed = check.smoke(tmp_path, [{"dir": d} for d in dirs], seconds=2, child=[sys.executable, str(child)])
    assert set(failed) == {"hang1", "crash1", "bad1"}
    assert failed["hang1"].startswith("hang") and failed["crash1"].startswith("crash (exit 3)")
    assert failed["bad1"] == "invalid 0.5"


def test_tune_tasks_are_the_candidates(monkeypatch):
    """``tune --schedule fused_hopper``: one task per candidate, the preset first, each workload the
    one ``build`` makes for its knobs (the logs regenerate it from its attrs). Two of the 30
    candidates (a workload each takes about a second to generate)."""
    from tvm_attention.schedules import cuda_fused
    from tvm_attention.tune.tasks import make_tasks

    spec = AttentionSpec(batch=1, heads=16, seq_q=4096, head_dim=128, dtype="bfloat16", causal=True)
    every = cuda_hopper.tile_candidates(spec, SM90)
    assert len(every) == 30 and every[0] == cuda_hopper.preset(spec, SM90)
    monkeypatch.setattr(cuda_hopper, "tile_candidates", lambda s, t: [every[0], every[-1]])
    tasks = make_tasks(spec, SM90, "fused_hopper")
    cands = cuda_hopper.tile_candidates(spec, SM90)
    assert [t.name for t in tasks] == [f"fused_hopper_m{k.block_m}_n{k.block_n}_s{k.stages}_p{k.pingpong}"
                                       f"_o{k.overlap}" for k in cands]
    assert [cuda_fused.workload_knobs(t.mod["main"]) for t in tasks] == cands


def varlen_model(plan, lens, causal, dtype="float16", nan_seq=None, seed=0, **variants):
    """The model's output and the float64 reference, sequence by sequence, on a packed batch of
    ``lens`` ((q_len, k_len) each); ``nan_seq``: a NaN planted in that sequence's V rows."""
    H, KH, D = 4, 2, plan.head_dim
    cq = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    rng = np.random.default_rng(seed)
    q, k, v = (from_bits(to_bits(rng.standard_normal(s), dtype), dtype)
               for s in ((cq[-1], H, D), (ck[-1], KH, D), (ck[-1], KH, D)))
    if nan_seq is not None:
        v[ck[nan_seq]: ck[nan_seq + 1], 0, 5] = np.nan
        v[ck[nan_seq], 1, 0] = np.inf
    spec = AttentionSpec(batch=len(lens), heads=H, kv_heads=KH, seq_q=64, head_dim=D, dtype="float16", causal=causal,
                         layout="varlen", **variants)
    rng = np.random.default_rng(seed + 1)
    args = {"alibi_slopes": rng.uniform(0.01, 0.2, H) if spec.alibi else None,
            "sinks": rng.uniform(-1, 3, H) if spec.sinks else None}
    out = run(q, k, v, plan, spec, dtype, plan.consumers == 2, True, cu_seqlens=(cq, ck), **args)
    ref = np.zeros_like(out)
    for b, (sq, sk) in enumerate(lens):
        one = dataclasses.replace(spec, layout="bhsd", batch=1)  # lengths from the arrays
        sl = lambda x, c: x[c[b]: c[b + 1]].transpose(1, 0, 2)[None]  # noqa: E731
        if sq and sk:
            ref[cq[b]: cq[b + 1]] = reference_attention(one, sl(q, cq), sl(k, ck), sl(v, ck),
                                                        **args)[0].transpose(1, 0, 2)
    return out, ref, cq


@pytest.mark.parametrize("batch, causal", [(0, False), (0, True), (1, True), (2, False), (3, True)])
def test_model_varlen_matches_reference(batch, causal):
    """Packed sequences (conftest.VARLEN_BATCHES: empty ones, one row, Sq above and below Skv, no
    keys, tails, a long one among short ones): TMA boxes of one head's rows at each sequence's
    offset, the kernel's slot numbering covering every row tile once, each row against the
    reference; a sequence with no key exactly zero."""
    from conftest import VARLEN_BATCHES

    lens = VARLEN_BATCHES[batch]
    out, ref, cq = varlen_model(SmemPlan(64, 128, 64, 2), lens, causal)
    assert np.abs(out - ref).max() < 2e-3
    for b, (sq, sk) in enumerate(lens):
        if sk == 0:
            assert not out[cq[b]: cq[b + 1]].any()


def test_model_varlen_keeps_a_neighbours_nan_out():
    """NaN and inf in one sequence's V stay there: the tail tile of the sequence before reads those
    rows through TMA and zeroes them before P·V (0 · NaN would be NaN)."""
    lens = [(40, 45), (30, 50), (70, 33)]
    plan = SmemPlan(128, 128, 64, 2)
    out, ref, cq = varlen_model(plan, lens, False, nan_seq=1, softcap=20.0)
    assert np.isnan(out[cq[1]: cq[2]]).any()  # NaN in, NaN out
    for b in (0, 2):
        assert np.isfinite(out[cq[b]: cq[b + 1]]).all()
        assert np.abs(out[cq[b]: cq[b + 1]] - ref[cq[b]: cq[b + 1]]).max() < 2e-3


def test_model_varlen_without_the_zeroing_leaks_nan(monkeypatch):
    """The zeroing is what keeps it out: without it the sequence before turns NaN."""
    monkeypatch.setattr(wgmma_model.Smem, "zero_rows", lambda self, *a: None)
    out, _, cq = varlen_model(SmemPlan(128, 128, 64, 2), [(40, 45), (30, 50)], False, nan_seq=1)
    assert np.isnan(out[: cq[1]]).any()


def _const(e):
    """A TIR expression of constants (or a Python value) as a Python int or bool."""
    from tvm.sym import Analyzer

    if isinstance(e, (bool, int, np.integer)):
        return int(e)
    return int(Analyzer().simplify(e).value)


@pytest.mark.parametrize("layout", ["bhsd", "kvcache"])
@pytest.mark.parametrize("variants", [{}, {"causal": True}, {"causal": True, "window": (100, 0)},
                                      {"window": (40, 70)}, {"causal": True, "kv_start": True, "window": (150, 0)}])
def test_kernel_index_math_is_the_models(layout, variants):
    """The kernel's own TIR expressions — its key-tile range, which tiles it masks and which scores
    it hides, through a KV-cache tile's packing of positions and heads into rows — evaluated at
    constants equal the model's (which the reference checks): a typo in the kernel's index math
    fails here, not only on a GPU."""
    from tvm import tirx

    from tvm_attention.workloads.fused_wgmma import Seq, _context

    BM, BN, H, KH = 128, 64, 8, 2
    cache = layout == "kvcache"
    for sq, sk in ((300, 700), (700, 300), (128, 128), (1, 520)):
        spec = AttentionSpec(batch=2, heads=H, kv_heads=KH, seq_q=sq, seq_kv=sk, head_dim=64, dtype="float16",
                             layout=layout, **variants)
        x = _context(spec, BM, BN, 2, True, True)
        plan = SmemPlan(64, BM, BN, 2)
        q, k, v = (np.zeros(s) for s in ((2, H, sq, 64), (2, KH, sk, 64), (2, KH, sk, 64)))
        r = wgmma_model._Run(q, k, v, plan, spec, "float16", kv_start=np.array([0, 33]) if spec.kv_start else None,
                             cache_seqlens=np.array([sk, sk]) if cache else None)
        c = lambda v: tirx.const(v, "int32")  # noqa: E731 - as the kernel's loop vars are
        for b in (0, 1):
            start = r.start(b)
            seq = Seq(b=b, q0=0, q_len=sq, k0=0, k_len=sk)
            mseq = {"b": b, "q0": 0, "k0": 0, "q_len": sq, "k_len": sk}
            for row0 in range(0, sq * (H // KH if cache else 1), BM):
                first, nt = (_const(e) for e in x.tile_range(seq, c(row0), start))
                assert (first, nt) == r.tiles(mseq, row0), (sq, sk, row0)
                t, reg = np.arange(128)[:, None], np.arange(BN // 2)[None, :]
                for wg in (0, 1):
                    wrow0 = row0 + wg * 64
                    rows = r.pos(wrow0 + wgmma_layout.acc_row(t, reg))
                    for j in range(first, first + nt):
                        keys = j * BN + wgmma_layout.acc_col(t, reg)
                        sees = r.vis.sees(keys, rows + sk - sq, start)
                        want = (keys < sk) if sees is None else (keys < sk) & sees
                        if not _const(x.needs_mask(seq, c(j), c(wrow0), start)):
                            assert want.all(), (j, wrow0)  # a tile left unmasked hides nothing
                        for ti, ri in ((0, 0), (37, 5), (127, BN // 2 - 1), (64, 17)):
                            assert _const(x.visible(seq, c(ti), c(ri), c(j), c(wrow0), start)) == want[ti, ri]
                    if cache:  # the store's row -> (position, head)
                        for row in (0, 5, 63):
                            assert _const(x.pos(c(wrow0 + row))) == r.pos(wrow0 + row)
                            assert _const(x.head(c(1), c(wrow0 + row))) == r.head(1, wrow0 + row)


@pytest.mark.parametrize("batch", range(4))
def test_kernel_slot_search_is_the_models(batch):
    """The kernel's own slot search (``fused_wgmma.locate``, TIR), compiled for this CPU and run
    on ``cu_seqlens``: each slot's (first row, q0, q_len, k0, k_len, sequence) are the model's,
    whose slots cover every row tile once."""
    import tvm
    from conftest import VARLEN_BATCHES
    from tvm.script import tirx as T

    from tvm_attention.workloads.fused_wgmma import locate

    lens, BM = VARLEN_BATCHES[batch], 128
    cq = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    nb1, slots = len(cq), int(cq[-1]) // BM + len(lens)

    @T.prim_func(s_tir=True)
    def search(CQ: T.Buffer((nb1,), "int32"), CK: T.Buffer((nb1,), "int32"), OUT: T.Buffer((slots, 6), "int32")):
        for s in range(slots):
            with T.sblock("slot"):
                T.reads()
                T.writes()
                sq = T.sblock_alloc_buffer((6,), "int32", scope="local")
                locate(sq, CQ, CK, s, nb1, BM)
                for i in range(6):
                    OUT[s, i] = sq[i]

    f = tvm.compile(search, target="llvm")
    out = tvm.runtime.empty((slots, 6), "int32")
    f(tvm.runtime.tensor(cq), tvm.runtime.tensor(ck), out)
    got = {(int(r[5]), int(r[0])): tuple(int(v) for v in r[1:5]) for r in out.numpy() if r[0] < r[2]}
    q, k, v = np.zeros((int(cq[-1]), 2, 64)), np.zeros((int(ck[-1]), 2, 64)), np.zeros((int(ck[-1]), 2, 64))
    spec = AttentionSpec(batch=len(lens), heads=2, seq_q=64, head_dim=64, dtype="float16", layout="varlen")
    model = wgmma_model._Run(q, k, v, SmemPlan(64, BM, 64, 2), spec, "float16", cu_seqlens=(cq, ck))
    want = {(s["b"], row0): (s["q0"], s["q_len"], s["k0"], s["k_len"]) for s, row0 in model.blocks()}
    assert got == want


def kvcache_model(plan, sq, lens, max_len=320, H=8, KH=2, dtype="bfloat16", seed=0, page_size=None, split_tasks=0,
                  kv_dtype=None, **variants):
    """The model's output and the reference, batch by batch, for a KV cache ``(B, KH, max_len,
    D)`` holding ``lens`` keys each, the rest NaN (stale memory a kernel must never let through);
    with ``page_size``, the same keys in a shuffled page pool ``(pages, page_size, KH, D)``
    through a block table (its unused entries −1, the pool's stale rows NaN); ``split_tasks``:
    split-KV; ``kv_dtype``: an 8-bit cache quantized per KV head (int8's stale rows ±127, it has
    no NaN), the reference reading its dequantized values."""
    D, B = plan.head_dim, len(lens)
    rng = np.random.default_rng(seed)
    q = from_bits(to_bits(rng.standard_normal((B, H, sq, D)), dtype), dtype)
    k, v = (from_bits(to_bits(rng.standard_normal((B, KH, max_len, D)), dtype), dtype) for _ in range(2))
    for b, n in enumerate(lens):
        k[b, :, n:], v[b, :, n:] = np.nan, np.nan
    scales = {}
    if kv_dtype:
        from tvm_attention.quant import dequantize, quantize_kv

        stale = np.isnan(k)
        if kv_dtype == "int8":  # no NaN: the stale rows' codes become the largest, once scaled
            k, v = np.where(stale, 0.0, k), np.where(stale, 0.0, v)
        (k, ks), (v, vs) = quantize_kv(k, kv_dtype), quantize_kv(v, kv_dtype)
        if kv_dtype == "int8":
            k[stale], v[stale] = 127, -127
        scales = {"k_scale": ks, "v_scale": vs}
    spec = AttentionSpec(batch=B, heads=H, kv_heads=KH, seq_q=sq, seq_kv=max_len, head_dim=D, dtype="float16",
                         layout="paged" if page_size else "kvcache", page_size=page_size, kv_dtype=kv_dtype,
                         **variants)
    args = {"alibi_slopes": rng.uniform(0.01, 0.2, H) if spec.alibi else None,
            "sinks": rng.uniform(-1, 3, H) if spec.sinks else None,
            "kv_start": np.array([min(n, 7 * b) for b, n in enumerate(lens)], np.int32) if spec.kv_start else None}
    table = None
    kc, vc = k, v
    if page_size:  # each sequence's pages scattered through a pool with a spare page of NaN
        mp = max_len // page_size
        order = rng.permutation(B * mp + 1)
        kc, vc = (np.full((B * mp + 1, page_size, KH, D), np.nan).astype(k.dtype) if kv_dtype != "int8" else
                  np.full((B * mp + 1, page_size, KH, D), 127, np.int8) for _ in range(2))
        table = np.full((B, mp), -1, np.int32)
        for b, n in enumerate(lens):
            for i in range(-(-n // page_size)):
                page = order[b * mp + i]
                table[b, i] = page
                kc[page] = k[b, :, i * page_size:(i + 1) * page_size].transpose(1, 0, 2)
                vc[page] = v[b, :, i * page_size:(i + 1) * page_size].transpose(1, 0, 2)
    out = run(q, kc, vc, plan, spec, dtype, plan.consumers == 2, True, cache_seqlens=np.array(lens, np.int32),
              block_table=table, split_tasks=split_tasks, **scales, **args)
    if kv_dtype:  # the reference reads the cache's values
        k, v = dequantize(k, scales["k_scale"]), dequantize(v, scales["v_scale"])
    ref = np.zeros_like(out)
    for b, n in enumerate(lens):
        if n:
            one = dataclasses.replace(spec, layout="bhsd", batch=1, page_size=None, kv_dtype=None)
            a = {**args, "kv_start": None if args["kv_start"] is None else args["kv_start"][b: b + 1]}
            ref[b: b + 1] = reference_attention(one, q[b: b + 1], k[b: b + 1, :, :n], v[b: b + 1, :, :n], **a)
    return out, ref


@pytest.mark.parametrize("sq, variants, page_size", [
    (1, {"causal": True}, None),  # a decode step: 4 query heads of a KV head in 4 rows of the tile
    (1, {"causal": True}, 16),
    (5, {"causal": True, "return_lse": True}, 256),  # a chunk of 5 new tokens: 20 rows
    (37, {"causal": True, "window": (40, 0), "sinks": True}, None),  # 148 rows: two blocks, a window
    (37, {"causal": True, "window": (40, 0), "sinks": True}, 16),
    (3, {"alibi": True, "softcap": 20.0, "kv_start": True, "causal": True}, 256),
])
def test_model_kvcache_matches_reference(sq, variants, page_size):
    """A KV cache: a KV head's query heads packed into the tile's rows (position · group + g, a
    4-D TMA box of Q), each sequence's own length (0, 1, a tile edge, tails), the stale rows past
    it NaN and never let through (masked scores, V's tail rows zeroed); paged, through shuffled
    pages of 16 (a box a page, 4 a tile) and 256 (a tile's share of a page), the table's unused
    entries −1 never read."""
    lens = [0, 1, 64, 130, 300, 77]
    if page_size == 256:
        lens = [0, 1, 64, 130, 256, 77]  # within two pages of 256
    out, ref = kvcache_model(SmemPlan(64, 128, 64, 2), sq, lens, max_len=512 if page_size == 256 else 320,
                             page_size=page_size, **variants)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() < 1.5e-2
    assert not out[0].any()  # no key: zeros


#: split-KV decode steps: (block_m, block_n, page_size, variants): the decode preset's one
#: consumer and two in ping-pong, contiguous and pages of 16 and 256, the variants (the sink is
#: the merge's, the window and the start skip tiles before the chunks)
SPLIT_CASES = [
    (64, 64, None, {"causal": True}),
    (128, 64, 16, {"causal": True, "sinks": True, "window": (300, 0)}),
    (64, 128, 256, {"causal": True, "alibi": True, "softcap": 20.0, "kv_start": True}),
]


@pytest.mark.parametrize("bm, bn, page_size, variants", SPLIT_CASES)
def test_model_split_kv_matches_reference(bm, bn, page_size, variants):
    """Split-KV of a decode step (6 sequences × 2 KV heads for 48 tasks: 4 chunks a sequence): each
    chunk of at least 256 keys stores its unnormalised output, max and sum where the kernel's
    fragments put them, the merge weighs them by ``2^(m − max)``; chunks past a sequence's keys
    (m = −inf) weigh nothing, a sequence of no key outputs zeros, stale NaN stays out."""
    lens = [0, 1, 300, 1024, 513, 77]
    plan = SmemPlan(64, bm, bn, 2)
    out, ref = kvcache_model(plan, 1, lens, max_len=1024, page_size=page_size, split_tasks=48, **variants)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() < 1.5e-2
    assert not out[0].any()


def test_model_split_kv_catches_a_lost_tile(monkeypatch):
    """The split's check can fail: chunks of floor(tiles / chunks) drop a sequence's last tiles."""
    monkeypatch.setattr(wgmma_model._Run, "chunk", lambda self, nt, c, n: (c * (nt // n), nt // n))
    out, ref = kvcache_model(SmemPlan(64, 64, 64, 2), 1, [900, 700], max_len=1024, split_tasks=16)
    assert np.abs(out - ref).max() > 0.05


def test_kernel_split_math_is_the_models():
    """The kernel's split-KV at constants: its chunk count (``n_splits`` of batch · KV heads, and
    1 once a sequence's rows pass one row tile) and each chunk's key tiles (``chunk_span``) equal
    the model's, the chunks covering a block's tiles once; a batch of 0 divides by no zero."""
    from tvm import tirx
    from tvm.sym import Analyzer

    from tvm_attention.workloads.fused_cuda import chunk_span
    from tvm_attention.workloads.fused_wgmma import _context

    c = lambda v: tirx.const(v, "int32")  # noqa: E731
    spec = AttentionSpec(batch=6, heads=8, kv_heads=2, seq_q=1, seq_kv=1024, head_dim=64, dtype="float16",
                         layout="kvcache", causal=True)
    x = _context(spec, 64, 64, 2, False, True, split_tasks=48)
    for b, sq, want in ((6, 1, 4), (1, 1, 24), (24, 1, 1), (25, 1, 1), (6, 16, 4), (6, 17, 1), (0, 1, 48)):
        a = Analyzer()
        a.bind(x.B, b)
        a.bind(x.SQ, sq)
        assert int(a.simplify(x.NSA).value) == want, (b, sq)
        if b:
            z = np.zeros
            r = wgmma_model._Run(z((b, 8, sq, 64)), z((b, 2, 64, 64)), z((b, 2, 64, 64)), SmemPlan(64, 64, 64, 2),
                                 spec, "float16", cache_seqlens=np.full(b, 64))
            assert r.splits(48) == want
    for n in range(40):
        for ns in (1, 2, 3, 4, 24):
            spans = [r.chunk(n, s, ns) for s in range(ns)]
            assert [(_const(f), _const(k)) for f, k in (chunk_span(c(n), c(s), c(ns), 64) for s in range(ns))] == spans
            assert sorted(t for f, k in spans for t in range(f, f + k)) == list(range(n))


#: 8-bit caches: (kv_dtype, block_n, page_size, split_tasks, variants): each 8-bit dtype, contiguous
#: and paged (pages of 16: 8 staging boxes a tile; 256), split and not, the variants
KV8_CASES = [
    ("float8_e4m3fn", 64, None, 0, {"causal": True}),
    ("float8_e5m2", 128, 16, 48, {"causal": True, "sinks": True}),
    ("int8", 64, 256, 48, {"causal": True, "alibi": True, "softcap": 20.0, "window": (300, 0)}),
]


@pytest.mark.parametrize("kv_dtype, bn, page_size, split_tasks, variants", KV8_CASES)
def test_model_8bit_cache_matches_reference(kv_dtype, bn, page_size, split_tasks, variants):
    """An 8-bit cache (scaled per KV head): TMA lands each tile's bytes unswizzled in its staging
    stage, the producer warpgroup's 128 threads convert them (exactly) into the 128B-swizzled 16-bit
    stage at ``wgmma_layout.CVT_DST``'s addresses and arrive on its full barriers; the key scale
    in the scores' factor, the value scale once per output (after the merge when split); the
    stale rows (NaN in float8, ±127 in int8) never let through."""
    lens = [0, 1, 300, 1024, 513, 77]
    out, ref = kvcache_model(SmemPlan(64, 64, bn, 2, kv8=True), 1, lens, max_len=1024, dtype="float16",
                             page_size=page_size, split_tasks=split_tasks, kv_dtype=kv_dtype, **variants)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() < 1.5e-2
    assert not out[0].any()


def test_model_8bit_cache_catches_an_unswizzled_conversion(monkeypatch):
    """The conversion's check can fail: writing a row's chunks without the 128B swizzle's XOR puts
    them where the descriptors do not read them."""
    monkeypatch.setattr(wgmma_layout, "CVT_DST", "(i % {cpr} / 4) * {slab_bytes} + (i / {cpr}) * 128 + "
                                                 "(((i % {cpr}) % 4) * 2 + h) * 16")
    out, ref = kvcache_model(SmemPlan(64, 64, 64, 2, kv8=True), 1, [200, 77], max_len=256, dtype="float16",
                             kv_dtype="float8_e4m3fn", causal=True)
    assert np.abs(out - ref).max() > 0.05


def test_kernel_conversion_is_the_layouts():
    """The kernel's converter is generated from ``wgmma_layout.CVT_DST`` (the model's addresses),
    and its int8 bit trick (bytes under 0x64, sign flipped, less 1152 in float16) is exact for
    every int8, emulated here on the words as the helper builds them."""
    from tvm_attention.workloads.fused_wgmma import _helpers

    plan = SmemPlan(128, 64, 128, 2, kv8=True)
    src = "".join(_helpers(plan, "float16", 1, "int8").values())
    for h in (0, 1):
        assert wgmma_layout.CVT_DST.format(cpr=8, slab_bytes=plan.kv_slab(1)).replace("h", str(h)) in src
    assert "0x4140u" in src and "0x4342u" in src and "0x00800080u" in src and "0x64806480u" in src

    def byte_perm(x, y, sel):  # CUDA's __byte_perm, as the model defines it
        return int(wgmma_model.isa_byte_perm(np.uint32(x), np.uint32(y), sel))

    import ml_dtypes

    codes = np.arange(256, dtype=np.uint8)
    for name in ("float8_e4m3fn", "float8_e5m2"):  # the model's decoding of the cache's bits
        want = codes.view(getattr(ml_dtypes, name)).astype(np.float64)
        np.testing.assert_array_equal(wgmma_model.isa_cvt8(codes, name), want)
    for x in range(256):
        w = x | (x ^ 0x55) << 8 | (255 - x) << 16 | (x * 7 % 256) << 24  # four bytes of int8
        halves = []
        for sel in (0x4140, 0x4342):
            word = byte_perm(w, 0x64646464, sel) ^ 0x00800080
            pair = np.array([word & 0xFFFF, word >> 16], np.uint16).view(np.float16)
            halves += list(pair.astype(np.float32) - np.float32(1152))  # sub.f16x2: exact (ints)
        want = [((w >> 8 * i) & 0xFF) - 256 * ((w >> 8 * i) & 0x80 > 0) for i in range(4)]
        assert halves == want, (x, halves, want)


def test_an_8bit_cache_takes_a_tuned_tile_it_fits_or_the_preset():
    """A KV-cache spec is tuned at its 16-bit bhsd representative: built with an 8-bit cache, its
    record's tile runs with one consumer (the producer warpgroup converts), kept where the
    staging fits the shared memory, else the preset."""
    spec = AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, dtype="float16",
                         causal=True, layout="paged", page_size=16, kv_dtype="int8")
    fits = cuda_hopper.for_layout(cuda_hopper.HopperKnobs(block_m=128, block_n=64, stages=2, pingpong=1), spec, SM90)
    assert (fits.block_m, fits.pingpong, fits.block_n, fits.stages) == (64, 0, 64, 2)
    assert fits.split_tasks == cuda_hopper.preset(spec, SM90).split_tasks > 0
    too_big = cuda_hopper.for_layout(cuda_hopper.HopperKnobs(block_m=128, block_n=128, stages=3), spec, SM90)
    assert too_big == cuda_hopper.preset(spec, SM90)
    with pytest.raises(KnobError, match="block_m=64"):
        check_family(cuda_hopper, cuda_hopper.HopperKnobs(block_m=128, split_tasks=264), spec, SM90)
