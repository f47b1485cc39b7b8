"""Compute layer: PrimFunc factories with named blocks, and the registry that maps names to them.

Every room (CLI, tests, tuning, benchmarks) gets its PrimFuncs from here.
"""
from __future__ import annotations

from .fused import fused_attention
from .fused_cuda import fused_attention_cuda
from .fused_mla import fused_attention_mla
from .fused_mma import fused_attention_mma
from .fused_wgmma import fused_attention_wgmma
from .materialized import materialized_attention
from .rowcache import rowcache_attention

#: workload name -> (factory, names of the score buffers the audit checks, description)
WORKLOADS = {
    "fused": (fused_attention, ("S", "P"), "online-softmax flash attention; score tile in local scope"),
    "materialized": (materialized_attention, ("S", "P"), "QKᵀ, softmax and PV through global S×S buffers"),
    "fused_cuda": (fused_attention_cuda, ("S", "Ps"), "online-softmax flash attention for CUDA; scores in registers, P in shared"),
    "fused_mma": (fused_attention_mma, ("S", "Pf"), "flash attention on CUDA tensor cores (mma.sync); scores and P in registers"),
    "fused_mla": (fused_attention_mla, ("S", "Ps"), "MLA on CUDA tensor cores (mma.sync): heads as the tile's rows, "
                  "scores in registers, P in shared"),
    "fused_wgmma": (fused_attention_wgmma, ("S",), "flash attention on Hopper (TMA, wgmma, warp specialization); scores in registers"),
    "rowcache": (rowcache_attention, ("S", "P"), "per row block, whole score rows in local scope, two-pass softmax"),
}

__all__ = ["WORKLOADS", "fused_attention", "fused_attention_cuda", "fused_attention_mla", "fused_attention_mma", "fused_attention_wgmma", "materialized_attention", "rowcache_attention"]
