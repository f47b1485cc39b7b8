"""Functions that run in MetaSchedule's builder/runner worker processes.

MetaSchedule's ``default_build`` imports ``tvm.s_tir.tensor_intrin`` (parsing ~500 TVMScript
functions, ~30 s here) in every fresh worker, and LocalBuilder restarts its workers on every
batch: that was 35 s per 4 candidates. Our kernels use no tensor intrinsics, so this build skips
that import and is otherwise the same, but for the ConvertSSA that ``lowering.lower_final`` runs
too.

A terminal's Ctrl-C goes to the whole foreground process group, workers included. The tuner
starts its workers with SIGINT blocked (they inherit the mask, see ``driver._workers_spawn``) and
their initializer ignores it as well, so a Ctrl-C never kills a build or a measurement half way:
the tuner alone decides what to keep.
"""
from __future__ import annotations

import signal
from ..threads import set_num_threads


def lean_build(mod, target, _params=None):
    import tvm
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    # a schedule may copy a Let binding: one var each, as lowering.lower_final does
    return tvm_build(tvm.tirx.transform.ConvertSSA()(mod), target=target)


def ignore_sigint() -> None:
    """Worker initializer: SIGINT is the tuner's business, not the worker's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def runner_init(threads: int) -> None:
    """LocalRunner's initializer: ignore SIGINT and size TVM's thread pool for measuring."""
    ignore_sigint()
    set_num_threads(threads)
