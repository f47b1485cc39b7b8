"""Row-cached two-pass attention: QKᵀ, softmax and PV fused per query row block, no online
correction. A research family to compare with the fused kernel.

For each (batch, head, row block of ``block_m`` queries) the whole score row block
``S[seq_kv, block_m]`` (key-major) and its probabilities ``P`` sit in ``local`` buffers: pass 1
computes every score and the row max, pass 2 exponentiates and sums, then ``acc = P·V``.
Nothing of size seq_q × seq_kv is ever allocated, but the local row buffers grow with seq_kv —
``2 · seq_kv · block_m`` floats per row block (256 KiB at 1k keys, 4 MiB at 16k with
block_m=32) — so it falls out of L1/L2 as sequences grow, where the online-softmax kernel's
tile stays the same size. Same masking, guard and ``exp2`` as the fused kernel.

Named blocks: ``row_tile``, ``Q_load``, ``S_gemm``, ``row_max``, ``P_exp``,
``row_sum``, ``PV_gemm``, ``O_store``.
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ..spec import DATA_ALIGNMENT as A
from ..spec import ENTRY, AttentionSpec
from ..visibility import Visibility
from ._math import LOG2E, exp2_fast, guarded, normalize
from ..tvm_internals import fast_macros
from .knob_attrs import ROWCACHE, record


@fast_macros  # TVMScript macro expansion without its costly stack walk, only while this generates
def rowcache_attention(spec: AttentionSpec, block_m: int) -> tirx.PrimFunc:
    """Arguments (call order): ``Q (B, H, Sq, D)``, ``K (B, KH, Skv, D)``, ``V (B, KH, Skv, D)``,
    ``O (B, H, Sq, D)``, compact row-major ``spec.dtype``."""
    B, H, KH = spec.batch, spec.heads, spec.kv_heads
    SQ, SK, D = spec.seq_q, spec.seq_kv, spec.head_dim
    G = spec.group_size
    BM = block_m
    NR = math.ceil(SQ / BM)
    vis = Visibility.of(spec)
    OFF = vis.offset(SQ, SK)
    dtype = spec.dtype
    qscale = float(spec.scale * LOG2E)
    neg_inf = T.float32(float("-inf"))

    def masked_score(S, vj, vi, vr):
        seen = vis.sees(vj, vis.position(vr * BM + vi, OFF))
        return S[vj, vi] if seen is None else T.Select(seen, S[vj, vi], neg_inf)

    attrs = {"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "rowcache",
             **record(ROWCACHE, block_m=BM), "attn.data_alignment": A}

    @T.prim_func(s_tir=True)
    def attention(
        Q: T.Buffer((B, H, SQ, D), dtype, align=A),
        K: T.Buffer((B, KH, SK, D), dtype, align=A),
        V: T.Buffer((B, KH, SK, D), dtype, align=A),
        O: T.Buffer((B, H, SQ, D), dtype, align=A),
    ):
        T.func_attr(attrs)
        for b, h, r in T.grid(B, H, NR):
            with T.sblock("row_tile"):
                vb, vh, vr = T.axis.remap("SSS", [b, h, r])
                T.reads(Q[vb, vh, 0:SQ, 0:D], K[vb, vh // G, 0:SK, 0:D], V[vb, vh // G, 0:SK, 0:D])
                T.writes(O[vb, vh, 0:SQ, 0:D])
                Qt = T.sblock_alloc_buffer((D, BM), "float32", scope="local")  # q block, transposed
                S = T.sblock_alloc_buffer((SK, BM), "float32", scope="local")  # whole score rows
                P = T.sblock_alloc_buffer((SK, BM), "float32", scope="local")  # whole prob. rows
                m = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # row max (log2 units)
                l = T.sblock_alloc_buffer((BM,), "float32", scope="local")  # row sum
                acc = T.sblock_alloc_buffer((BM, D), "float32", scope="local")

                for d, i in T.grid(D, BM):
                    with T.sblock("Q_load"):
                        vd, vi = T.axis.remap("SS", [d, i])
                        Qt[vd, vi] = Q[vb, vh, T.min(vr * BM + vi, SQ - 1), vd] * T.float32(qscale)
                # -- pass 1: every score of the row block, and the row max --------------------
                for j, d, i in T.grid(SK, D, BM):
                    with T.sblock("S_gemm"):
                        vj, vd, vi = T.axis.remap("SRS", [j, d, i])
                        with T.init():
                            S[vj, vi] = T.float32(0)
                        S[vj, vi] = S[vj, vi] + K[vb, vh // G, vj, vd] * Qt[vd, vi]
                for j, i in T.grid(SK, BM):
                    with T.sblock("row_max"):
                        vj, vi = T.axis.remap("RS", [j, i])
                        with T.init():
                            m[vi] = neg_inf
                        m[vi] = T.max(m[vi], masked_score(S, vj, vi, vr))
                # -- pass 2: exponentiate against the final max, sum -------------------------
                for j, i in T.grid(SK, BM):
                    with T.sblock("P_exp"):
                        vj, vi = T.axis.remap("SS", [j, i])
                        P[vj, vi] = exp2_fast(masked_score(S, vj, vi, vr) - guarded(m[vi]))
                for j, i in T.grid(SK, BM):
                    with T.sblock("row_sum"):
                        vj, vi = T.axis.remap("RS", [j, i])
                        with T.init():
                            l[vi] = T.float32(0)
                        l[vi] = l[vi] + P[vj, vi]
                for i, j, d in T.grid(BM, SK, D):
                    with T.sblock("PV_gemm"):
                        vi, vj, vd = T.axis.remap("SRS", [i, j, d])
                        with T.init():
                            acc[vi, vd] = T.float32(0)
                        acc[vi, vd] = acc[vi, vd] + P[vj, vi] * V[vb, vh // G, vj, vd]
                for i, d in T.grid(BM, D):
                    with T.sblock("O_store"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        T.where(vr * BM + i < SQ)
                        O[vb, vh, vr * BM + vi, vd] = normalize(acc[vi, vd], l[vi], vr * BM + vi, spec)

    return attention
