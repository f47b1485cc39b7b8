"""knobs ↔ attrs: every family's ``workload(spec, knobs)`` records the knobs that shape it in its
function's ``attn.*`` attrs (``workloads/knob_attrs.py``, one table per generator), and
``from_attrs`` reads them back into knobs that generate the same function: the one round trip
by which a tuning log's workload is regenerated (``task_mods.regenerate``). A record whose
attrs are corrupt is an error, not "not this spec's kernel"."""
import dataclasses

import pytest
import tvm_ffi

from tvm_attention.schedules import (WORKLOAD_FAMILIES, cpu_fused, cpu_materialized, cpu_rowcache, cuda_fused,
                                     cuda_materialized, cuda_mma, cuda_simt)
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target
from tvm_attention.workloads import knob_attrs
from tvm_attention.workloads.knob_attrs import WorkloadAttrsError

# AVX-512 (staged decode tiers). Workloads are only generated (TIR), never compiled or run: safe on an AVX2 host.
CPU = resolve_target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
CUDA = resolve_target("cuda", arch="sm_90")

BHSD = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=64, seq_kv=96, head_dim=64, causal=True)
KV = AttentionSpec(batch=1, heads=8, kv_heads=4, seq_q=1, seq_kv=256, head_dim=64, causal=True, layout="kvcache")
KV_STEP = KV.representative()  # its static decode step (bhsd, seq_q 1): one decode tier, no main nest
PAGED = AttentionSpec(batch=2, heads=8, kv_heads=4, seq_q=1, seq_kv=100, head_dim=64, causal=True, layout="paged",
                      page_size=16)  # symbolic batch, seq_q, seq_kv: both decode tiers and the main nest
HALF = dataclasses.replace(BHSD, dtype="float16")
#: the attrs that are no knob: what the function is, and the layout's buffer alignment
NOT_KNOBS = {"attn.workload", "attn.data_alignment"}
#: every generator's table: no knob attr is written outside them
TABLES = {
    "fused": knob_attrs.FUSED + knob_attrs.FUSED_DECODE,
    "rowcache": knob_attrs.ROWCACHE,
    "materialized": (),
    "fused_cuda": knob_attrs.FUSED_CUDA + knob_attrs.CUDA_SPLIT,
    "fused_mma": knob_attrs.FUSED_MMA + knob_attrs.CUDA_SPLIT,
}


def _cases():
    """(name, family, spec, knobs, target): every family, the fused CPU kernel's decode tiers
    with split-KV, prefetch and kv heads per task, its bf16 product form, CUDA split-KV."""
    fused = cpu_fused.preset(BHSD, CPU)
    step = cpu_fused.preset(KV_STEP, CPU)
    paged = cpu_fused.preset(PAGED, CPU)
    bf16 = dataclasses.replace(BHSD, dtype="bfloat16")
    simt_paged = cuda_simt.preset(dataclasses.replace(PAGED, head_dim=32), CUDA)
    mma_kv = cuda_mma.preset(dataclasses.replace(KV, dtype="float16"), CUDA)
    return [
        ("fused prefill", cpu_fused, BHSD, dataclasses.replace(fused, block_m=16, block_n=32), CPU),
        ("fused varlen", cpu_fused, dataclasses.replace(BHSD, layout="varlen", dynamic=("seq_q", "seq_kv")), fused, CPU),
        ("fused bf16 dots", cpu_fused, bf16, dataclasses.replace(cpu_fused.preset(bf16, CPU), dot_bf16=1, pv_cols=0), CPU),
        ("fused decode split", cpu_fused, KV_STEP, dataclasses.replace(step, block_n=32, split_tasks=16), CPU),
        ("fused decode prefetch heads", cpu_fused, KV_STEP, dataclasses.replace(step, prefetch=2, decode_heads=2), CPU),
        ("fused symbolic tiers", cpu_fused, KV, dataclasses.replace(step, split_tasks=4, decode_heads=4), CPU),
        ("fused paged", cpu_fused, PAGED, paged, CPU),
        ("rowcache", cpu_rowcache, BHSD, dataclasses.replace(cpu_rowcache.preset(BHSD, CPU), block_m=16), CPU),
        ("materialized", cpu_materialized, BHSD, cpu_materialized.preset(BHSD, CPU), CPU),
        ("materialized cuda", cuda_materialized, BHSD, cuda_materialized.preset(BHSD, CUDA), CUDA),
        ("simt", cuda_simt, BHSD, dataclasses.replace(cuda_simt.preset(BHSD, CUDA), block_m=32, threads_per_row=8), CUDA),
        ("simt split", cuda_simt, dataclasses.replace(PAGED, head_dim=32), simt_paged, CUDA),
        ("mma", cuda_mma, HALF, dataclasses.replace(cuda_mma.preset(HALF, CUDA), m_tiles=2, stages=3), CUDA),
        ("mma split", cuda_mma, dataclasses.replace(KV, dtype="float16"),
         dataclasses.replace(mma_kv, split_tasks=64), CUDA),
    ]


CASES = _cases()


@pytest.mark.parametrize("name,family,spec,knobs,target", CASES, ids=[c[0] for c in CASES])
def test_knobs_attrs_knobs_generate_the_same_workload(name, family, spec, knobs, target):
    """knobs → workload → its attrs → from_attrs (on the preset, as regenerate reads a record,
    and on the dataclass defaults where the attrs say all) → the same workload; the attrs it
    records are its generator's table's, nothing else."""
    func = family.workload(spec, knobs)
    kind = str(func.attrs["attn.workload"])
    assert WORKLOAD_FAMILIES[kind].from_attrs is not None
    table_keys = {a.key for a in TABLES[kind]}
    written = {k for k in func.attrs.keys() if str(k).startswith("attn.")} - NOT_KNOBS
    assert written <= table_keys, written - table_keys
    back = family.from_attrs(func.attrs, family.preset(spec, target))
    assert tvm_ffi.structural_equal(family.workload(spec, back), func), name
    if family in (cuda_simt, cuda_mma) or family is cpu_fused and "attn.decode_rows" in func.attrs:
        # everything that shapes it is recorded: the defaults are base enough
        assert tvm_ffi.structural_equal(family.workload(spec, family.from_attrs(func.attrs)), func), name
    if family in (cuda_simt, cuda_mma):
        assert cuda_fused.from_attrs(func.attrs) == dataclasses.replace(knobs, **(
            {"unroll": 0} if family is cuda_simt else {}))


def test_fused_attrs_read_back_the_workload_knobs():
    """What the fused CPU kernel's attrs record, read back: the tiles and product form always,
    the decode knobs with its tiers (``stage_k_below`` is ``vector_lanes``; ``decode_heads``
    only where a staged tier takes them); without tiers those are ``base``'s."""
    step = dataclasses.replace(cpu_fused.preset(KV_STEP, CPU), block_n=32, split_tasks=16, prefetch=1, decode_heads=2)
    back = cpu_fused.from_attrs(cpu_fused.workload(KV_STEP, step).attrs)
    assert (back.block_m, back.block_n, back.split_tasks, back.prefetch, back.decode_heads, back.vector_lanes) == \
        (step.block_m, 32, 16, 1, 2, step.vector_lanes)
    base = cpu_fused.FlashCPUKnobs(vector_lanes=8, split_tasks=0, decode_heads=4)
    back = cpu_fused.from_attrs(cpu_fused.workload(BHSD, cpu_fused.preset(BHSD, CPU)).attrs, base)
    assert (back.vector_lanes, back.split_tasks, back.decode_heads) == (8, 0, 4)


def test_regenerate_round_trips_every_task_kind():
    """``task_mods.regenerate`` makes each kind of tuning task's module again from its attrs: the
    prefill tile tasks, a static decode step's, a paged step's (only its tier, specialized) and
    the CUDA kernels' with split-KV."""
    from tvm_attention.task_mods import fused_task_mod, normalize, regenerate, task_mod

    mods = [
        (BHSD, CPU, normalize(cpu_fused.workload(BHSD, dataclasses.replace(cpu_fused.preset(BHSD, CPU), block_m=64)))),
        (KV_STEP, CPU, fused_task_mod(KV_STEP, dataclasses.replace(cpu_fused.preset(KV_STEP, CPU), split_tasks=32))),
        (PAGED, CPU, fused_task_mod(PAGED, dataclasses.replace(cpu_fused.preset(PAGED, CPU), prefetch=1))),
        (BHSD, CPU, normalize(cpu_rowcache.workload(BHSD, cpu_rowcache.preset(BHSD, CPU)))),
        (HALF, CUDA, task_mod(HALF, cuda_mma.workload(HALF, cuda_mma.preset(HALF, CUDA)))),
    ]
    # the paged step's task holds one decode tier: the one its representative step runs
    assert [int(r) for r in mods[2][2]["main"].attrs["attn.decode_rows"]] == \
        [cpu_fused.decode_step_rows(PAGED, CPU)]
    for spec, target, mod in mods:
        for on in (target, None):
            again = regenerate(spec, mod["main"], on)
            assert again is not None and tvm_ffi.structural_equal(again, mod), (spec.short_name(), on)


def test_a_corrupt_record_raises_and_a_foreign_one_is_none():
    """A record of spec's own kernel whose knob attrs are missing or malformed raises
    ``WorkloadAttrsError`` naming the attr (it was "log not usable" at best); a record of another
    spec's kernel, or no workload of ours, is None."""
    from tvm_attention.task_mods import regenerate, workload_matches

    step = cpu_fused.preset(KV_STEP, CPU)
    func = cpu_fused.workload(KV_STEP, step)
    corrupt = [
        (func.without_attr("attn.block_n"), "have no attn\\.block_n"),
        (func.with_attr("attn.block_m", "32"), "attn.block_m='32'.*no int"),
        (func.with_attr("attn.split_tasks", True), "attn.split_tasks=True.*no int"),
        (func.with_attr("attn.decode_rows", 4), "attn.decode_rows=4.*no list of ints"),
        (func.without_attr("attn.stage_k_below"), "have no attn\\.stage_k_below"),
    ]
    for bad, message in corrupt:
        with pytest.raises(WorkloadAttrsError, match=message):
            regenerate(KV_STEP, bad, CPU)
    mma = cuda_mma.workload(HALF, cuda_mma.preset(HALF, CUDA))
    with pytest.raises(WorkloadAttrsError, match="have no attn\\.warps"):
        workload_matches(HALF, _mod(mma.without_attr("attn.warps")))
    with pytest.raises(WorkloadAttrsError, match="no fused workload"):
        cpu_fused.from_attrs(mma.attrs)
    assert regenerate(dataclasses.replace(KV_STEP, seq_kv=128), func, CPU) is None  # another spec's kernel
    assert regenerate(KV_STEP, func.without_attr("attn.workload"), CPU) is None  # no workload of ours
    assert regenerate(KV_STEP, func.with_attr("attn.workload", "tiled"), CPU) is None


def _mod(func):
    from tvm_attention.task_mods import normalize

    return normalize(func)
