"""The shared-memory race checker (``scripts/cuda_race.py``, ``scripts/smem_race_check.py``),
offline: the generated CUDA kernels (SIMT and mma.sync at small tiles and lengths, in the bhsd,
varlen, kvcache and paged layouts: the last three run on given index arrays; the MLA kernel in
the latent layouts; the backward's main kernel) have no race in any block,
and the checker can fail: a barrier, a cp.async wait or a stage's barrier removed from the
lowered kernel is reported with the buffer, the two threads and the barrier interval. Small
hand-written kernels pin down its semantics (cp.async groups, barriers, warp collectives,
values from index arguments)."""
import functools
import re
import sys
from pathlib import Path
from unittest import mock

import pytest
import tvm
import tvm_ffi
from tvm.script import tirx as T

from tvm_attention.workloads.fused_mma import _cuda_sources

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # the checker is a development tool beside its script, not shipped
try:
    import cuda_race as cr
finally:
    sys.path.remove(str(ROOT / "scripts"))
QUICK = cr.configs(quick=True)


@functools.lru_cache(maxsize=None)
def _built(name: str):
    # the checker reads the lowered IR and the CUDA C, never ptxas's report: no nvcc run (half
    # of a build's time); nor the audit, so neither its probe (the schedule lowered again at
    # doubled lengths: a sixth of what is left, 0.9 s of CPU over the quick set)
    with mock.patch("tvm_attention.build.cuda_resources", lambda built: {"unavailable": "not asked"}), \
            mock.patch("tvm_attention.build._probe", lambda *args: "not asked: the race check reads no audit"):
        return _config(name).build()


def _config(name: str) -> cr.RaceConfig:
    return next(c for c in cr.CONFIGS if c.name == name)


def _check(name: str, func=None, block=None) -> cr.RaceReport:
    """The check of config ``name`` (``func``: a faulty copy of its kernel) in every block of its
    grid, or in ``block`` alone: a fault test's block, one whose key tiles show the hazard (the
    clean check, test_generated_kernels_have_no_shared_memory_race, covers every block)."""
    if block is None:
        return cr.check_config(_config(name), _built(name), func=func)
    cfg = _config(name)
    return cr.check_built(_built(name), cfg.lengths, blocks=[block], func=func, index_data=cfg.data)


def _func(name: str):
    return cr.device_function(_built(name))


def test_the_quick_set_covers_both_kernels_dtypes_stages_row_groups_masks_and_symbolic_lengths():
    simt = [c for c in QUICK if c.kernel == "fused_simt"]
    tc = [c for c in QUICK if c.kernel == "fused_tc"]
    assert {c.spec["dtype"] for c in simt} >= {"float32", "float16"}
    assert {c.knobs["stages"] for c in tc} >= {1, 2} and {c.knobs["m_tiles"] for c in tc} == {1, 2}
    for group in (simt, tc):
        assert {c.spec["causal"] for c in group} == {False, True}
        assert any(c.lengths for c in group) and any(not c.lengths for c in group)
    assert all(c.spec["heads"] > c.spec["kv_heads"] for c in QUICK)  # GQA
    assert any(c.spec["seq_q"] == 37 and c.spec["seq_kv"] == 45 for c in QUICK)  # tails


def _layout(c: cr.RaceConfig) -> str:
    return c.spec.get("layout", "bhsd")


def test_the_quick_set_covers_the_serving_layouts():
    """varlen with ragged sequences (no rows, no keys, more rows than a tile; causal and not),
    kvcache and paged (shuffled pages, unused table entries -1, a sequence with no key, GQA
    packing) at a decode step and a prefill chunk, for both kernels, tensor-core stages 1 and 2."""
    for kernel in ("fused_simt", "fused_tc"):
        assert {_layout(c) for c in QUICK if c.kernel == kernel} == {"bhsd", "varlen", "kvcache", "paged"}
    varlen = [c for c in cr.configs() if _layout(c) == "varlen"]
    assert {c.spec["causal"] for c in varlen} == {False, True}
    for c in varlen:
        cq, ck = c.data["CQ"], c.data["CK"]
        rows = [b - a for a, b in zip(cq, cq[1:])]
        keys = [b - a for a, b in zip(ck, ck[1:])]
        assert 0 in rows and 0 in keys and max(rows) > 32 and max(keys) > 2 * c.knobs["block_n"]
    cache = [c for c in QUICK if _layout(c) in ("kvcache", "paged")]
    assert {c.lengths["seq_q"] for c in cache} == {1, 5}
    assert {c.knobs["stages"] for c in cache + varlen if c.kernel == "fused_tc"} >= {1, 2}
    for c in cache:
        assert 0 in c.data["CS"] and c.spec["heads"] // c.spec["kv_heads"] >= 2
        if _layout(c) == "paged":
            pages = [p for row in c.data["BT"] for p in row if p >= 0]
            assert pages != sorted(pages) and any(-1 in row for row in c.data["BT"])


@functools.lru_cache(maxsize=None)
def _clean(name: str) -> cr.RaceReport:
    """The check of config ``name`` as built, every block (shared by the tests that ask it)."""
    return _check(name)


@pytest.mark.parametrize("cfg", QUICK, ids=lambda c: c.name)
def test_generated_kernels_have_no_shared_memory_race(cfg):
    report = _clean(cfg.name)
    assert report.ok, report.format()
    # every block of the grid, all its threads, several barrier intervals, real accesses
    assert len(report.blocks) > 1 and report.threads >= 32 and report.intervals > 2 and report.accesses > 1000
    # the premise: CUDA codegen adds no barrier and no shared memory the checked IR lacks
    func = _func(cfg.name)
    src = _built(cfg.name).module.imports[0].inspect_source()
    shared = []
    tvm_ffi.structural_walk(func.body, [(tvm.tirx.AllocBuffer, lambda a: shared.append(a.buffer.name)
                                         if a.buffer.scope() in cr.SHARED_SCOPES else None)])
    assert sorted(re.findall(r"__shared__ [^;]* (\w+)_ptr\[", src)) == sorted(shared)
    assert src.count("__syncthreads()") == cr.barrier_sites(func) and "__syncwarp" not in src


def _race_between_threads(report: cr.RaceReport, buffer=None, kind=None) -> cr.Race:
    assert not report.ok, "the fault was not reported"
    for r in report.races:
        if len(r.threads) == 2 and r.threads[0] != r.threads[1] and (buffer is None or r.buffer == buffer) \
                and (kind is None or kind in r.kind):
            assert r.interval >= 0 and r.interval_desc and r.byte >= 0, r.format()
            text = r.format()
            assert f"in {r.buffer} at byte" in text and "barrier interval" in text and "between thread" in text
            return r
    raise AssertionError("no race between two threads" + (f" in {buffer}" if buffer else "") + ":\n" + report.format())


def test_each_barrier_of_the_simt_kernel_is_needed():
    """fp32: P reuses the K tile's memory, so each of the four barriers of a key tile guards a
    hazard; each removed alone is a race."""
    name = "simt_f32_causal_37x45"
    func = _func(name)
    n = cr.barrier_sites(func)
    assert n == 4
    for k in range(n):
        faulty = cr.drop_barrier(func, k)
        assert cr.barrier_sites(faulty) == n - 1
        _race_between_threads(_check(name, faulty, block=(9, 0, 0)))  # the last row tile: every key tile


def test_simt_barrier_before_the_p_tile_is_read():
    # fp16: P has its own shared tile; the barrier between its store and P·V's reads
    name = "simt_f16_full_37x45"
    r = _race_between_threads(_check(name, cr.drop_barrier(_func(name), 2), block=(5, 0, 0)), buffer="Ps")
    assert {s.what.split()[0] for s in r.sites} == {"write", "read"}


def test_tensor_core_stage_overwritten_while_another_thread_reads_it():
    """stages=1: the barrier at the end of a key tile keeps the next tile's cp.async off the
    buffer ldmatrix still reads."""
    name = "tc_f16_s1_m1_causal_37x45"
    func = _func(name)
    assert cr.barrier_sites(func) == 2
    r = _race_between_threads(_check(name, cr.drop_barrier(func, 1)), kind="cp.async copy and another thread")
    assert r.buffer in ("Ks", "Vs")
    whats = sorted(s.what for s in r.sites)
    assert whats[0].startswith("cp.async (attn_cp_async16)") and whats[1].startswith("ldmatrix (attn_ldsm_x4")
    assert "after barrier __syncthreads #0" in r.interval_desc  # the one left


@pytest.mark.parametrize("name, block", [("tc_f16_s2_m1_full_37x45", (3, 0, 0)), ("tc_f16_s2_m2_causal_sym", (0, 1, 1))])
def test_tensor_core_read_before_the_copy_landed(name, block):
    """Two stages: without cp.async.wait_group the next tile is read while in flight; without
    the barrier after the wait, other threads' copies are read unordered (in the grid's last
    block, which sees every key tile)."""
    func = _func(name)
    waited = _check(name, cr.drop_helper_calls(func, "attn_cp_wait0"), block)
    r = _race_between_threads(waited, kind="still in flight")
    assert r.buffer in ("Ks", "Vs") and any("ldmatrix" in s.what for s in r.sites)
    assert any("never waited" in x.kind for x in waited.races)
    assert cr.barrier_sites(func) == 1  # one barrier per key tile
    r = _race_between_threads(_check(name, cr.drop_barrier(func, 0), block), kind="cp.async")
    assert r.interval == 0 and r.interval_desc == "kernel start, to kernel end"  # the only barrier gone


@pytest.mark.parametrize("name, fault, buffer, block", [
    ("simt_f16_varlen_causal", 2, "Ps", (6, 1, 0)),  # the barrier between P's store and P·V
    ("simt_f16_paged_chunk5_causal", 1, "Ks", (1, 1, 3)),  # the barrier between the K tile's store and S = Q·Kᵀ
    ("tc_f16_s2_m1_varlen_causal", "attn_cp_wait0", None, (3, 1, 0)),
    ("tc_f16_s2_m1_paged_chunk5_causal", 0, None, (0, 1, 3)),
])
def test_faults_in_the_serving_layouts_are_reported(name, fault, buffer, block):
    """The kernels of the index-driven layouts fail the check as the bhsd ones do, in the blocks
    and key tiles their index arrays give them: ``block``, the last of the grid's blocks whose
    sequence has several key tiles (the whole grid's check reports the fault there too)."""
    func = _func(name)
    faulty = cr.drop_barrier(func, fault) if isinstance(fault, int) else cr.drop_helper_calls(func, fault)
    report = _check(name, faulty, block)
    kind = "still in flight" if isinstance(fault, str) else None
    r = _race_between_threads(report, buffer=buffer, kind=kind)
    assert r.buffer in ("Ks", "Vs", "Ps") and len(r.sites) == 2
    if isinstance(fault, str) or _config(name).kernel == "fused_simt":  # a race inside the key loop
        assert "[c=" in r.interval_desc, r.format()


@pytest.mark.parametrize("fault, buffer", [(1, "red"), (2, "Ps"), (3, "red")])
def test_each_barrier_of_the_mla_kernel_is_needed(fault, buffer):
    """The MLA kernel's barriers: after each warp's row maxima go to ``red`` (the row group's
    other slices read them), after P goes to the P tile (every warp of the row group reads all of
    it for P·V), and after the row sums go to ``red`` at the end; each one removed is a race in
    that buffer between two threads (the grid's blocks: a step of two row tiles, split)."""
    name = "mla_f16_decode_split"
    func = _func(name)
    assert cr.barrier_sites(func) == 4  # the key tile's wait, the two exchanges, the sums
    r = _race_between_threads(_check(name, cr.drop_barrier(func, fault)), buffer=buffer)
    assert len(r.sites) == 2


@pytest.mark.parametrize("fault, buffer", [(0, "buf_dyn_shmem"), (1, "Ss")])
def test_each_barrier_of_the_backward_is_needed(fault, buffer):
    """The backward's main kernel, two barriers a query tile: after its Q and dO land (every warp
    reads all of them; the dynamic tiles are one merged buffer) and after dS is written (the dQ
    product reads other warps' columns of it); each one removed is a race. (A third, before the
    copies of Q and dO, was never needed: the checker found no race without it.)"""
    name = "bwd_f16_causal_37x45"
    func = _func(name)
    assert cr.barrier_sites(func) == 2
    r = _race_between_threads(_check(name, cr.drop_barrier(func, fault)), buffer=buffer)
    assert len(r.sites) == 2


def _paged(name="tc_f16_s2_m1_paged_chunk5_causal"):
    cfg = _config(name)
    return cfg, _built(name), {k: [list(r) for r in v] if k == "BT" else list(v) for k, v in cfg.data.items()}


def test_index_data_drives_the_paged_kernel_and_is_bounds_checked():
    cfg, built, data = _paged()
    with pytest.raises(cr.NotModelled, match="depends on data"):  # cache_seqlens unknown: the key loop's bound
        cr.check_built(built, cfg.lengths)
    assert _clean(cfg.name).ok  # with its index data (cfg.data, what ``data`` copies): no race
    # a page the sequence reads given as -1: its K/V reads go out of bounds
    b = max(range(len(data["CS"])), key=lambda i: data["CS"][i])
    bad = {**data, "BT": [row[:] for row in data["BT"]]}
    bad["BT"][b][1] = -1
    report = cr.check_built(built, cfg.lengths, index_data=bad)
    assert report.races and {r.buffer for r in report.races} <= {"K", "V"}, report.format()
    assert all(r.kind.startswith("out of bounds (global") and r.block[2] == b for r in report.races)
    # more keys than the last sequence's table row holds: the block table read goes out of bounds
    # (those threads stop there: what they would load is unknown)
    cap = cfg.lengths["max_pages"] * cfg.spec["page_size"]
    report = cr.check_built(built, cfg.lengths, index_data={**data, "CS": data["CS"][:-1] + [cap + 1]})
    assert any(r.buffer == "BT" and r.kind.startswith("out of bounds") for r in report.races), report.format()
    with pytest.raises(ValueError, match="BT: 12 elements, but the kernel's BT has 16"):
        cr.check_built(built, cfg.lengths, index_data={**data, "BT": data["BT"][:3]})
    with pytest.raises(ValueError, match="no such int argument"):
        cr.check_built(built, cfg.lengths, index_data={**data, "CQ": [0, 1]})


def test_script_lists_a_serving_layout_with_its_index_arrays_and_faults(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import smem_race_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    cfg, _, _ = _paged()
    monkeypatch.setattr(cr, "configs", lambda kernel, quick: [cfg])
    monkeypatch.setattr(cr.RaceConfig, "build", lambda self: _built(self.name))
    # the clean check is test_generated_kernels_have_no_shared_memory_race's (the same config, as
    # built): the script lists its report; the faults it checks here
    real_check = cr.check_config
    monkeypatch.setattr(cr, "check_config", lambda c, built, func=None: _clean(c.name) if func is None
                        else real_check(c, built, func=func))
    assert smem_race_check.main(["--faults"]) == 0
    out = capsys.readouterr().out
    assert "paged B4 seq_q=5 cache_seqlens=21,0,1,40 page=16 pages=8 shuffled H4/2" in out and " ok " in out
    assert "fault: __syncthreads #0: caught" in out and "fault: attn_cp_wait0: caught" in out


def test_script_lists_each_configuration_and_fails_on_a_race(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import smem_race_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    name = "tc_f16_s1_m1_causal_37x45"
    monkeypatch.setattr(cr, "configs", lambda kernel, quick: [_config(name)])
    monkeypatch.setattr(cr.RaceConfig, "build", lambda self: _built(self.name))
    assert smem_race_check.main(["--kernel", "fused_tc", "--quick"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(name) and "threads=64" in line and "intervals=7" in line and line.endswith("s)")
    assert " ok " in line
    faulty = cr.drop_barrier(_func(name), 1)
    monkeypatch.setattr(cr, "device_function", lambda built: faulty)
    real_check = cr.check_config
    monkeypatch.setattr(cr, "check_config", lambda cfg, built, func=None: real_check(cfg, built, func=faulty))
    assert smem_race_check.main([]) == 1
    out = capsys.readouterr().out
    assert "RACE" in out and "between thread" in out


# -- the checker's semantics on small hand-written kernels ---------------------------------------
SRC = _cuda_sources("float16")


def _pipeline(wait: int, stage: int, sync: bool = True, own: bool = False):
    """One warp copies two 512-byte stages with cp.async (a commit group each), waits for all
    but ``wait`` groups, then each lane reads its neighbour's 16 bytes of ``stage`` (``own``:
    its own, before the wait)."""

    @T.prim_func
    def pipeline(A_ptr: T.handle("float16", "global")):
        A = T.decl_buffer((512,), "float16", data=A_ptr)
        S = T.alloc_shared((512,), "float16")
        R = T.alloc_local((8,), "float16")
        tx = T.launch_thread("threadIdx.x", 32)
        for s in range(2):
            T.cuda.func_call("attn_cp_async16", T.address_of(S[s * 256 + tx * 8]),
                             T.address_of(A[s * 256 + tx * 8]), source_code=SRC["attn_cp_async16"])
            T.cuda.func_call("attn_cp_commit", source_code=SRC["attn_cp_commit"])
        if own:
            R[1] = S[stage * 256 + tx * 8]
        T.cuda.func_call(f"attn_cp_wait{wait}", source_code=SRC[f"attn_cp_wait{wait}"])
        if sync:
            T.tvm_storage_sync("shared")
        R[0] = S[stage * 256 + (tx + 1) % 32 * 8]
    return pipeline


@pytest.mark.parametrize("wait, stage, sync, own, kinds", [
    (0, 1, True, False, set()),  # all groups waited, then a barrier: ordered
    (1, 0, True, False, {"cp.async copy never waited for"}),  # the older group landed; the newer never waited for
    (1, 1, True, False, {"still in flight", "never waited for"}),  # wait_group 1 leaves the newest group in flight
    (0, 1, False, False, {"cp.async copy and another thread's access in one barrier interval"}),  # no barrier
    (0, 0, True, True, {"access before this thread's cp.async.wait_group"}),  # own copy read before the wait
])
def test_cp_async_groups_waits_and_barriers(wait, stage, sync, own, kinds):
    report = cr.check_function(_pipeline(wait, stage, sync, own))
    found = {r.kind for r in report.races}
    assert all(any(k in f for f in found) for k in kinds) and len(found) == len(kinds), report.format()


def _shared_kernel(variant: str):
    @T.prim_func
    def kernel():
        S = T.alloc_shared((64,), "float32")
        S2 = T.alloc_shared((64,), "float32")
        R = T.alloc_local((8,), "float16")
        tx = T.launch_thread("threadIdx.x", 64)
        S[tx] = T.float32(1)
        if variant == "divergent_barrier":
            if tx < 32:
                T.tvm_storage_sync("shared")
        elif variant != "no_barrier":
            T.tvm_storage_sync("shared")
        S2[tx] = S[(tx + 1) % 64]  # the neighbour's element: needs the barrier
        if variant == "divergent_ldmatrix":
            if tx % 32 < 16:
                T.cuda.func_call("attn_ldsm_x4", T.address_of(R[0]), T.address_of(S[0]),
                                 source_code=SRC["attn_ldsm_x4"])
        if variant == "data_branch":
            if S[tx] > T.float32(0):
                S2[tx] = T.float32(0)
    return kernel


@pytest.mark.parametrize("variant, kind", [
    ("barrier", None),
    ("no_barrier", "read-write race"),
    ("divergent_barrier", "barrier divergence"),
    ("divergent_ldmatrix", "warp-collective divergence"),
])
def test_barriers_and_warp_collectives(variant, kind):
    report = cr.check_function(_shared_kernel(variant))
    if kind is None:
        assert report.ok, report.format()
    else:
        assert any(kind in r.kind for r in report.races), report.format()


def _indexed_kernel():
    """Values from an index argument ``I`` flow through integer registers into a loop bound, a
    branch and a shared index: ``S[tx · I[1] · I[0]]``."""

    @T.prim_func
    def kernel(I_ptr: T.handle("int32", "global"), n: T.int32):
        I = T.decl_buffer((n,), "int32", data=I_ptr)
        S = T.alloc_shared((64,), "float32")
        r = T.alloc_local((2,), "int32")
        tx = T.launch_thread("threadIdx.x", 32)
        r[0] = I[0]
        r[1] = 0
        for _ in range(r[0]):
            r[1] = r[1] + I[1]
        if r[0] > 0:
            S[tx * r[1]] = T.float32(1)
    return kernel


@pytest.mark.parametrize("data, kind", [
    ([1, 2], None),
    ([2, 1], None),
    ([1, 0], "write-write race"),  # every thread writes S[0]
    ([0, 0], None),  # the branch is not taken
    ([1, 3], "out of bounds (shared"),
    ([1], "out of bounds (global"),  # I[1] past the argument: the threads stop there
])
def test_values_from_index_arguments(data, kind):
    report = cr.check_function(_indexed_kernel(), {"n": len(data)}, index_data={"I": data})
    if kind is None:
        assert report.ok, report.format()
    else:
        assert report.races and all(kind in r.kind for r in report.races), report.format()


def test_index_data_must_match_the_argument():
    with pytest.raises(cr.NotModelled, match="loop bound depends on data"):
        cr.check_function(_indexed_kernel(), {"n": 2})
    with pytest.raises(ValueError, match="I: 3 elements, but the kernel's I has 2"):
        cr.check_function(_indexed_kernel(), {"n": 2}, index_data={"I": [1, 2, 3]})
    assert cr.check_function(_indexed_kernel(), index_data={"I_ptr": [1, 2]}).ok  # its size from the data


def test_what_it_cannot_model_stops_the_check():
    with pytest.raises(cr.NotModelled, match="branch depends on data"):
        cr.check_function(_shared_kernel("data_branch"))
