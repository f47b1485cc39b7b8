"""Search tasks: one per workload PrimFunc, each with its own design space.

* ``fused``: one task per (block_m, block_n) tile pair of ``tvm_attention.schedules.cpu_fused.tile_candidates``
  (the tile sizes shape the online-softmax compute, so each pair is its own workload); inside a
  task the space is ``cpu_fused.schedule`` with its decisions sampled (register blocks, head_dim
  unroll, parallel chunk, auto-unroll). The hand preset's tile pair is the first task and the
  hand knobs are a point of its space.
* a static decode shape (``seq_q · group`` rows fit a packed decode nest, e.g. the representative
  step of a kvcache build): one task per (``block_n``, split count, kv heads per task, prefetch)
  of ``cpu_fused.decode_candidates``, each space the hand schedule of its nest. A paged decode
  spec gets the same tasks on its own kernel, specialized to its representative step
  (:mod:`.paged`).
* ``rowcache``: one task per row block ``block_m``; the same schedule function and sampled knobs.
* ``materialized``: MetaSchedule's default LLVM space, minus the write-cache fusion of
  MultiLevelTiling, which raises a ScheduleError on this graph (O's producer also reads L).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import tvm
from tvm.target import Target

from ..schedules import (SCHEDULES, UnknownScheduleError, cpu_fused, cpu_materialized, cpu_rowcache, cuda_hopper, cuda_mla, cuda_mma, cuda_simt,
                         get_schedule)
from ..schedules._knobs import KnobError
from ..spec import AttentionSpec
from ..task_mods import fused_task_mod, normalize, tunes_as_paged

TUNABLE = ("fused", "materialized", "rowcache")


@dataclasses.dataclass
class TaskDef:
    name: str
    mod: tvm.IRModule
    space: Any  # a MetaSchedule SpaceGenerator
    # MetaSchedule's default rules name tensorize intrinsics (e.g. VNNI) that must be registered
    needs_tensor_intrin: bool = False
    # distinct points of the space when known (None: sampled, unknown): the driver stops asking a
    # task for candidates once it has measured that many, instead of idling through search rounds
    points: int | None = None


def tile_space(space_fn):
    """A ScheduleFn space for our tile kernels (fused, rowcache)."""
    from tvm.s_tir import meta_schedule as ms

    return ms.space_generator.ScheduleFn(
        space_fn,
        sch_rules=[],
        postprocs=[],  # the schedule vectorizes, unrolls and decomposes itself
        mutator_probs={ms.mutator.MutateTileSize(): 1.0},
    )


def decode_space(spec: AttentionSpec, knobs):
    """The space of one static decode task: its nest scheduled as the hand build does. The
    task's workload carries its decisions (key tile, split count), so the space is one point."""
    def space_fn(sch):
        return cpu_fused.apply(sch, knobs, spec)

    return tile_space(space_fn)


def materialized_space():
    from tvm.s_tir import meta_schedule as ms

    rules = [
        ms.schedule_rule.MultiLevelTiling(structure="SSRSRS", max_innermost_factor=64, reuse_write=None)
        if isinstance(r, ms.schedule_rule.MultiLevelTiling)
        else r
        for r in ms.ScheduleRule.create("llvm")
    ]
    return ms.space_generator.PostOrderApply(
        sch_rules=rules, postprocs="from-target", mutator_probs="from-target"
    )


def make_tasks(spec: AttentionSpec, target: Target, schedule: str) -> list[TaskDef]:
    """The tasks of ``spec``: a static spec, or a symbolic one that is tuned as itself (a paged
    decode step, :func:`tvm_attention.task_mods.tunes_as_paged`; other symbolic specs are tuned at their
    representative, which the caller passes)."""
    if spec.dynamic:
        if not tunes_as_paged(spec, target, schedule):
            raise ValueError(f"{spec.short_name()} is symbolic: tune its representative shape "
                             f"({spec.representative().short_name()}) instead")
    if schedule in SCHEDULES:
        # what the family cannot build at all, named before any workload is made (a CUDA 8-bit
        # KV cache is tuned at its bhsd representative, which has no 8-bit form there: the
        # workload generator failed deep in TVM's parser instead)
        try:
            get_schedule(schedule, target).CAPABILITIES.require(spec)
        except (KnobError, UnknownScheduleError) as e:
            raise ValueError(f"cannot tune {spec.short_name()} [{schedule}] (the spec `tune` measures for yours): "
                             f"{e}") from None
    if target.kind.name == "cuda":
        return _cuda_tasks(spec, target, schedule)
    if schedule == "fused":
        if cpu_fused.is_decode_step(spec, target):  # static, or a paged step (tunes_as_paged)
            # a paged step (symbolic): only the tier it runs (fused_task_mod; a static seq_q keeps one too)
            return [TaskDef(f"fused_dec_n{k.decode_tile}_s{k.split_tasks}_h{k.decode_heads}"
                            f"{f'_pf{k.prefetch}' if k.prefetch else ''}", fused_task_mod(spec, k),
                            decode_space(spec, k), points=1)
                    for k in cpu_fused.decode_candidates(spec, target)]
        space = tile_space(cpu_fused.design_space(spec, target))
        # bfloat16 where the CPU has AMX-BF16: the AMX form's tiles first (the preset's), then, as
        # where it has AVX512-BF16, each tile pair in both forms of its vector products (bf16 dot
        # products first), made for the target without AMX (cpu_fused.search_target); a task
        # each, as the form is in the compute. The preset's other knobs shape no prefill workload
        # (a shape without a decode step).
        def task(name, knobs):
            return TaskDef(name, normalize(cpu_fused.workload(spec, knobs)), space)

        hand = cpu_fused.preset(spec, target)
        tasks = [task(f"fused_m{bm}_n{bn}_amx", dataclasses.replace(hand, block_m=bm, block_n=bn))
                 for bm, bn in cpu_fused.tile_candidates(spec, target)] if hand.dot_bf16 == cpu_fused.AMX else []
        vectors = cpu_fused.search_target(target)
        hand = cpu_fused.preset(spec, vectors)
        forms = (True, False) if cpu_fused.bf16_dots(spec, vectors) else (False,)
        return tasks + [task(f"fused_m{bm}_n{bn}{'_bf16dot' if dot else ''}",
                             dataclasses.replace(hand, block_m=bm, block_n=bn, dot_bf16=int(dot)))
                        for bm, bn in cpu_fused.tile_candidates(spec, vectors) for dot in forms]
    if schedule == "rowcache":
        space = tile_space(cpu_rowcache.design_space(spec, target))
        hand = cpu_rowcache.preset(spec, target)
        return [
            TaskDef(f"rowcache_m{bm}", normalize(cpu_rowcache.workload(spec, dataclasses.replace(hand, block_m=bm))),
                    space)
            for bm in cpu_rowcache.block_m_candidates(spec, target)
        ]
    if schedule == "materialized":
        return [TaskDef("materialized", normalize(cpu_materialized.workload(spec, cpu_materialized.preset(spec, target))),
                        materialized_space(), needs_tensor_intrin=True)]
    raise ValueError(f"schedule {schedule!r} cannot be tuned; tunable: {', '.join(TUNABLE)}")


def _cuda_tasks(spec: AttentionSpec, target: Target, schedule: str) -> list[TaskDef]:
    """One task per knob set of the family's ``tile_candidates``, its module the family's
    ``workload(spec, knobs)``: the function ``build`` schedules for those knobs and log matching
    regenerates (``task_mods.regenerate``), every knob the workload takes included (``split_tasks``)."""
    from tvm.s_tir import meta_schedule as ms

    if schedule not in ("fused", "fused_hopper"):
        raise ValueError(f"schedule {schedule!r} cannot be tuned for cuda yet; tunable: fused, fused_hopper")
    if schedule == "fused_hopper":
        # Hopper: one task per feasible (block_m, block_n, stages, pingpong), the preset first
        family, name = cuda_hopper, "fused_hopper_m{k.block_m}_n{k.block_n}_s{k.stages}_p{k.pingpong}_o{k.overlap}"
    elif spec.layout_info.latent:
        # MLA on tensor cores: one task per feasible (row_groups, col_groups, block_n, stages)
        family, name = cuda_mla, "fused_mla_r{k.row_groups}_c{k.col_groups}_n{k.block_n}_s{k.stages}"
    elif cuda_mma.supports(spec, target):
        # tensor cores: one task per feasible (warps, block_n, stages, m_tiles), the preset first
        family, name = cuda_mma, "fused_w{k.warps}_n{k.block_n}_s{k.stages}_m{k.m_tiles}"
    else:
        family, name = cuda_simt, "fused_m{k.block_m}_n{k.block_n}_t{k.threads_per_row}"
    space = ms.space_generator.ScheduleFn(family.design_space(spec, target), sch_rules=[], postprocs=[],
                                          mutator_probs={})
    return [TaskDef(name.format(k=k), normalize(family.workload(spec, k)), space)
            for k in family.tile_candidates(spec, target)]


