"""Functions that run in MetaSchedule's builder/runner worker processes.

MetaSchedule's ``default_build`` imports ``tvm.s_tir.tensor_intrin`` (parsing ~500 TVMScript
functions, ~30 s here) in every fresh worker, and LocalBuilder restarts its workers on every
batch: that was 35 s per 4 candidates. Our kernels use no tensor intrinsics, so this build skips
that import and is otherwise the same.
"""
from __future__ import annotations


def lean_build(mod, target, _params=None):
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)
