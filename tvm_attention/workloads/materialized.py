"""The materialized baseline: every stage goes through global memory.

``S = Q·Kᵀ`` is written to a global ``(B, H, Sq, Skv)`` score buffer, the softmax writes a
global ``(B, H, Sq, Skv)`` probability buffer ``P``, and ``O = P·V`` reads it back. This is the
honest baseline the fused kernel is compared with, and the negative control of the fusion audit.
It uses the same masking, guard and fast ``exp2`` as the fused kernel so that comparisons
measure data movement, not a different exponential.

Named blocks: ``S_gemm``, ``row_max``, ``row_sum``, ``softmax``, ``PV_gemm``.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..spec import DATA_ALIGNMENT as A
from ..spec import ENTRY, AttentionSpec
from ..visibility import Visibility
from .kv import dim
from ..tvm_internals import fast_macros
from ._math import LOG2E, exp2_fast, guarded, normalize, normalize_where


@fast_macros  # TVMScript macro expansion without its costly stack walk, only while this generates
def materialized_attention(spec: AttentionSpec) -> tirx.PrimFunc:
    """Arguments (call order): ``Q (B, H, Sq, D)``, ``K (B, KH, Skv, D)``, ``V (B, KH, Skv, D)``,
    ``O (B, H, Sq, D)``, compact row-major ``spec.dtype``."""
    B, H, KH = dim(spec, "batch"), spec.heads, spec.kv_heads
    SQ, SK, D = dim(spec, "seq_q"), dim(spec, "seq_kv"), spec.head_dim
    G = spec.group_size
    vis = Visibility.of(spec)
    OFF = vis.offset(SQ, SK)
    dynamic_len = not (isinstance(SQ, int) and isinstance(SK, int))
    dtype = spec.dtype
    qscale = float(spec.scale * LOG2E)
    neg_inf = T.float32(float("-inf"))

    def logit(S, vb, vh, vi, vj):
        # Scaled score in log2 units, -inf where the row does not see the key.
        x = S[vb, vh, vi, vj] * T.float32(qscale)
        seen = vis.sees(vj, vis.position(vi, OFF))
        return x if seen is None else T.Select(seen, x, neg_inf)

    def pv(x, vi):
        # A row that sees no key stays exactly 0 even where V holds NaN (0·NaN would be NaN).
        if vis.hides_keys and (dynamic_len or OFF < 0):
            return T.Select(vis.sees_a_key(vis.position(vi, OFF), SK), x, T.float32(0))
        return x

    def out(p, l, vi):
        if not dynamic_len:
            return normalize(p, l, vi, spec)
        return normalize_where(p, l, vis.sees_a_key(vis.position(vi, OFF), SK))

    @T.prim_func(s_tir=True)
    def attention(
        Q: T.Buffer((B, H, SQ, D), dtype, align=A),
        K: T.Buffer((B, KH, SK, D), dtype, align=A),
        V: T.Buffer((B, KH, SK, D), dtype, align=A),
        O: T.Buffer((B, H, SQ, D), dtype, align=A),
    ):
        T.func_attr({"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "materialized",
                     "attn.data_alignment": A})
        S = T.sblock_alloc_buffer((B, H, SQ, SK), "float32")  # scores: the S×S matrix, global
        P = T.sblock_alloc_buffer((B, H, SQ, SK), "float32")  # probabilities, global
        M = T.sblock_alloc_buffer((B, H, SQ), "float32")  # row max (log2 units)
        L = T.sblock_alloc_buffer((B, H, SQ), "float32")  # row sum
        for b, h, i, j, d in T.grid(B, H, SQ, SK, D):
            with T.sblock("S_gemm"):
                vb, vh, vi, vj, vd = T.axis.remap("SSSSR", [b, h, i, j, d])
                with T.init():
                    S[vb, vh, vi, vj] = T.float32(0)
                S[vb, vh, vi, vj] = S[vb, vh, vi, vj] + Q[vb, vh, vi, vd] * K[vb, vh // G, vj, vd]
        for b, h, i, j in T.grid(B, H, SQ, SK):
            with T.sblock("row_max"):
                vb, vh, vi, vj = T.axis.remap("SSSR", [b, h, i, j])
                with T.init():
                    # max's identity as TVM's reducer registry knows it (so rfactor applies);
                    # a fully masked row keeps it, and exp2(-inf - it) is still 0.
                    M[vb, vh, vi] = T.min_value("float32")
                M[vb, vh, vi] = T.max(M[vb, vh, vi], logit(S, vb, vh, vi, vj))
        for b, h, i, j in T.grid(B, H, SQ, SK):
            with T.sblock("row_sum"):
                vb, vh, vi, vj = T.axis.remap("SSSR", [b, h, i, j])
                with T.init():
                    L[vb, vh, vi] = T.float32(0)
                L[vb, vh, vi] = L[vb, vh, vi] + exp2_fast(
                    logit(S, vb, vh, vi, vj) - guarded(M[vb, vh, vi])
                )
        for b, h, i, j in T.grid(B, H, SQ, SK):
            with T.sblock("softmax"):
                vb, vh, vi, vj = T.axis.remap("SSSS", [b, h, i, j])
                P[vb, vh, vi, vj] = out(
                    exp2_fast(logit(S, vb, vh, vi, vj) - guarded(M[vb, vh, vi])), L[vb, vh, vi], vi
                )
        for b, h, i, d, j in T.grid(B, H, SQ, D, SK):
            with T.sblock("PV_gemm"):
                vb, vh, vi, vd, vj = T.axis.remap("SSSSR", [b, h, i, d, j])
                with T.init():
                    O[vb, vh, vi, vd] = T.float32(0)
                O[vb, vh, vi, vd] = O[vb, vh, vi, vd] + pv(P[vb, vh, vi, vj] * V[vb, vh // G, vj, vd], vi)

    return attention
