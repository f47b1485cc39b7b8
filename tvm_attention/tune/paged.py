"""Tuning the paged decode kernel in its own memory order.

Symbolic kernels are tuned at a static representative shape (``AttentionSpec.representative``,
a contiguous bhsd spec): their knobs are tile sizes and register blocks, the same at every length.
A paged decode step is different: which kv heads a task takes, how far ahead it prefetches and how
the key range is split decide how it walks the page pool (``block_table[b, j // page_size]``,
``page_size · kv_heads · head_dim`` elements per page), and a contiguous cache says nothing about
that. So a paged spec whose representative step is a decode step is tuned as itself:

* each task's workload is the symbolic paged kernel, with only the decode tier the step runs,
  **specialized** to the representative step's shapes (``batch`` sequences of ``seq_q`` new
  tokens and ``seq_kv`` cached keys each, in ``num_pages`` shuffled pages) and simplified:
  MetaSchedule measures concrete shapes, and what is left is the nest the symbolic kernel runs
  at that step (the tier and split branches fold to constants and the others are dropped);
* its measurements run on the layout's own representative inputs (shuffled pages, every
  ``cache_seqlens`` entry ``seq_kv``: :meth:`Paged.random_inputs`), not MetaSchedule's random
  fill, which would make the block table point anywhere;
* its log folder names the representative step, as a bhsd representative's name does
  (``paged_p16_h32_kv8_d128_float32_causal_at_b4_q1_k4096``).

A record tuned this way keeps its kv heads per task and prefetch when built
(``cpu_fused.for_layout``); one tuned at the bhsd representative (a prefill-shaped paged spec)
keeps the paged preset's.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..spec import AttentionSpec
from ..task_mods import arg_shapes, step_case


def tuning_inputs(spec: AttentionSpec, seed: int = 0) -> list[np.ndarray]:
    """The representative step's arguments in call order (inputs from the layout's
    ``random_inputs``, then zeroed outputs): what a candidate is measured on."""
    layout = spec.layout_info
    arrays = layout.random_inputs(spec, step_case(spec), seed=seed)
    return [np.zeros(shape, a.dtype or spec.np_dtype) if a.output else arrays[a.name]
            for a, shape in zip(layout.all_args(spec), arg_shapes(spec))]


class AllocInputs:
    """MetaSchedule's ``f_alloc_argument`` for a paged task: every repeat gets the representative
    step's inputs (:func:`tuning_inputs`), copied to the device. Picklable (it is sent to the
    runner's worker processes): it keeps the spec as a dict and makes the arrays there.

    Called as ``(device, args_info, repeat)`` by ``LocalRunner`` and ``(session, device,
    args_info, repeat)`` by ``RPCRunner``."""

    def __init__(self, spec: AttentionSpec, seed: int = 0):
        self.spec = spec.to_dict()
        self.seed = seed

    def __call__(self, *call: Any) -> list[list[Any]]:
        import tvm

        device, args_info, repeat = call[-3:]
        spec = AttentionSpec.from_dict(self.spec)
        shapes = [tuple(int(x) for x in info[2]) for info in args_info]
        if shapes != arg_shapes(spec):
            raise ValueError(f"{spec.short_name()}: the task's arguments {shapes} are not the representative "
                             f"step's {arg_shapes(spec)}")
        arrays = _inputs(spec, self.seed)
        return [[tvm.runtime.tensor(a, device) for a in arrays] for _ in range(repeat)]


@functools.lru_cache(maxsize=1)
def _inputs(spec: AttentionSpec, seed: int) -> list[np.ndarray]:
    """:func:`tuning_inputs`, made once per runner worker (a worker measures every candidate of
    a tune: 134-268 MB of random K/V at the held-out decode shapes took 1-2 s to make)."""
    return tuning_inputs(spec, seed)
