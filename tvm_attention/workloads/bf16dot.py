"""The fused kernel's products on bf16 pairs: AVX512-BF16's ``vdpbf16ps`` (``dot_bf16`` 1, and
the decode nests' ``decode_dot`` 2), and the staging the AMX form (:mod:`.amx`) shares with it.

``vdpbf16ps`` adds two bf16 products per float32 lane (``acc[l] += a[2l]·b[2l] +
a[2l+1]·b[2l+1]``): its operands are pairs along the reduction, bf16 values handled as their
uint16 bits (TVM legalizes bfloat16 arithmetic to float32 and stores a bfloat16 local buffer as
float32; the bits are what the instruction reads).

* ``S = Q·Kᵀ`` (:func:`pair_macros`' ``s_gemm``): ``K_load`` copies the key tile's bits to
  ``Kb (BN, D)`` (``k_bits``); ``Qp (D/2, BM, 2)`` holds q unscaled in pairs along head_dim
  (``q_pairs``, once per row tile: the scale multiplies the float32 scores instead, no extra
  rounding); ``S_gemm`` sums over (d pair, t).
* ``acc = acc·alpha + P·V`` (``pv_gemm``): ``P_round`` rounds P to bf16 (nearest even), as
  FlashAttention does before PV, and ``P_ilv`` pairs it along the keys (``Pb (BN/2, BM, 2)``,
  ``p_pairs``); ``V_load`` copies the value tile's bits to ``Vb (BN, DV)`` (an 8-bit cache's
  values widened to bf16: ``_TileShape.bits``) and ``V_ilv`` interleaves pairs of its rows into
  ``Vt (BN/2, DV, 2)`` (``v_pairs``); ``acc_rescale`` applies the correction as a block of its
  own (``rescale``); ``PV_gemm`` sums over (key pair, t).
* ``pv_gemm_heads``: the same on a decode tile of ``HT`` kv heads (the page order), ``Vb (HT,
  BN, DV)`` and ``Vt (HT, BN/2, DV, 2)`` (the head first: the interleave and the dot product take
  a contiguous region of one head), row ``i`` reading head ``i // R``.

The schedules tensorize ``S_gemm`` and ``PV_gemm`` with intrinsics that call a three-line LLVM IR
function (``schedules/cpu_bf16.py``); the AMX form (:mod:`.amx`) takes ``k_bits``'s staged keys
(where it cannot read them in place) and ``q_pairs``, and packs P's and V's pairs as 32-bit
words itself.
"""
from __future__ import annotations

import types

from tvm.script import tirx as T

from ._math import bf16_bits, bf16_value


def pair_macros(k, p_of):
    """The bf16-pair form's macros for one tile (``k``: the tile's ``_TileShape``; ``p_of(P, Vsc,
    vj, vi)``: P as PV reads it, times a key's value scale where the cache has them):
    ``q_pairs``, ``k_bits``, ``s_gemm``, ``p_pairs``, ``v_pairs``, ``rescale``, ``pv_gemm``,
    ``pv_gemm_heads`` (the module docstring)."""
    N, BM, BN, D, DV, HT, R = k.N, k.BM, k.BN, k.D, k.DV, k.HT, k.R

    @T.macro
    def q_pairs(Qu, Qp, t):
        for dp, i, tt in T.grid(D // 2, BM, 2):
            with T.sblock(N["Q_load"]):
                vp, vi, vt = T.axis.remap("SSS", [dp, i, tt])
                Qp[vp, vi, vt] = Qu[t.q_at(vi, 2 * vp + vt)]

    @T.macro
    def k_bits(Ku, Kb, t, vc):
        # the key tile's bf16 bits, (key, d): the dot-product and AMX forms' staged keys
        for j, d in T.grid(BN, D):
            with T.sblock(N["K_load"]):
                vj, vd = T.axis.remap("SS", [j, d])
                Kb[vj, vd] = Ku[t.kv_at(vc, vj, vd)]

    @T.macro
    def s_gemm(Ku, Kb, Qp, S, t, vc):  # bf16 pairs along head_dim: vdpbf16ps operands
        k_bits(Ku, Kb, t, vc)
        for j, dp, i, tt in T.grid(BN, D // 2, BM, 2):
            with T.sblock(N["S_gemm"]):
                vj, vp, vi, vt = T.axis.remap("SRSR", [j, dp, i, tt])
                with T.init():
                    S[vj, vi] = T.float32(0)
                S[vj, vi] = S[vj, vi] + bf16_value(Kb[vj, 2 * vp + vt]) * bf16_value(Qp[vp, vi, vt])

    @T.macro
    def p_pairs(P, Pr, Pb, Vsc):
        for j, i in T.grid(BN, BM):
            with T.sblock(N["P_round"]):
                vj, vi = T.axis.remap("SS", [j, i])
                Pr[vj, vi] = bf16_bits(p_of(P, Vsc, vj, vi))
        for jp, i, tt in T.grid(BN // 2, BM, 2):
            with T.sblock(N["P_ilv"]):
                vp, vi, vt = T.axis.remap("SSS", [jp, i, tt])
                Pb[vp, vi, vt] = Pr[2 * vp + vt, vi]

    @T.macro
    def rescale(acc, alpha):
        # the correction as a block of its own: the tensorized update reads only
        # what the intrinsic does (an init reading alpha would not match it)
        for i, d in T.grid(BM, DV):
            with T.sblock(N["acc_rescale"]):
                vi, vd = T.axis.remap("SS", [i, d])
                acc[vi, vd] = acc[vi, vd] * alpha[vi]

    @T.macro
    def v_pairs(Vu, Vb, Vt, t, vc):
        for j, d in T.grid(BN, DV):
            with T.sblock(N["V_load"]):
                vj, vd = T.axis.remap("SS", [j, d])
                Vb[vj, vd] = k.bits(Vu[t.kv_at(vc, vj, vd)])
        for jp, d, tt in T.grid(BN // 2, DV, 2):
            with T.sblock(N["V_ilv"]):
                vp, vd, vt = T.axis.remap("SSS", [jp, d, tt])
                Vt[vp, vd, vt] = Vb[2 * vp + vt, vd]

    @T.macro
    def pv_gemm(Vu, P, Pr, Pb, Vb, Vt, acc, alpha, t, vc, Vsc):
        p_pairs(P, Pr, Pb, Vsc)
        v_pairs(Vu, Vb, Vt, t, vc)
        rescale(acc, alpha)
        for i, jp, d, tt in T.grid(BM, BN // 2, DV, 2):
            with T.sblock(N["PV_gemm"]):
                vi, vp, vd, vt = T.axis.remap("SRSR", [i, jp, d, tt])
                acc[vi, vd] = acc[vi, vd] + bf16_value(Pb[vp, vi, vt]) * bf16_value(Vt[vp, vd, vt])

    @T.macro
    def pv_gemm_heads(Vu, P, Pr, Pb, Vb, Vt, acc, alpha, t, vc, Vsc):
        p_pairs(P, Pr, Pb, Vsc)
        for j, h, d in T.grid(BN, HT, DV):
            with T.sblock(N["V_load"]):
                vj, vh, vd = T.axis.remap("SSS", [j, h, d])
                Vb[vh, vj, vd] = k.bits(Vu[t.kv_at(vc, vj, vd, vh)])
        for h, jp, d, tt in T.grid(HT, BN // 2, DV, 2):
            with T.sblock(N["V_ilv"]):
                vh, vp, vd, vt = T.axis.remap("SSSS", [h, jp, d, tt])
                Vt[vh, vp, vd, vt] = Vb[vh, 2 * vp + vt, vd]
        rescale(acc, alpha)
        for i, jp, d, tt in T.grid(BM, BN // 2, DV, 2):
            with T.sblock(N["PV_gemm"]):
                vi, vp, vd, vt = T.axis.remap("SRSR", [i, jp, d, tt])
                acc[vi, vd] = acc[vi, vd] + bf16_value(Pb[vp, vi, vt]) * bf16_value(
                    Vt[T.floordiv(vi, R), vp, vd, vt])

    return types.SimpleNamespace(q_pairs=q_pairs, k_bits=k_bits, s_gemm=s_gemm, p_pairs=p_pairs, v_pairs=v_pairs,
                                 rescale=rescale, pv_gemm=pv_gemm, pv_gemm_heads=pv_gemm_heads)
