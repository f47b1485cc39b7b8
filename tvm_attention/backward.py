"""The fused attention backward on the CPU (issue 46), first step: BHSD, float32, static shapes.

FlashAttention-2's scheme. The forward saves ``lse``; the backward recomputes each score tile
from Q and K, ``P = exp(T − lse)`` for the final score ``T``, and never holds more than a
``block_m × block_n`` tile of it (the audit proves it, as for the forward). One PrimFunc, two
parallel phases, each task writing its own rows (no atomics):

1. **dK, dV**, one task per (sequence, kv head, key tile): over every query head of the group and
   every query tile that can see the key tile, ``dV += Pᵀ·dO``, ``dP = dO·Vᵀ``, ``dS = P ∘ (dP −
   delta) ∘ T'(X)``, ``dK += dSᵀ·Q·scale`` (GQA's sum over the group happens in the task);
2. **dQ**, one task per (sequence, head, query tile): over every key tile it can see, the same
   ``dS`` again, ``dQ += dS·K·scale`` (the issue's "second pass over query tiles"; the other
   strategy, per-thread partial sums, is a later knob).

``delta = rowsum(dO ∘ O)`` is recomputed per query tile where a phase needs it: 2·Dv FLOP per row
against the tile's 4·block_n·D, no workspace. ``T'(X)`` is the softcap's ``1 − tanh²(X / c)`` (1
without one). Which keys a row sees comes from :class:`~tvm_attention.visibility.Visibility`, as
everywhere; a row that sees no key (``lse = −inf``) takes no gradient. The semantics are
``reference_attention_backward``'s. ALiBi subtracts its constant in ``T``; with sinks each row's
denominator takes the sink (``row_lse``) and a third phase sums ``dsink_h = −Σ p_sink·delta``.
``kv_start`` hides each sequence's keys before it (the dQ phase starts its key tiles there).
Key bounds, a custom mask, ``mask_mod`` and ``score_mod`` are the forward's own hooks
(``workloads/variants.py``) over the same arguments, evaluated per score (no tile is skipped by
them); ``score_mod``'s derivative is :mod:`tvm_attention.modifier_grad`'s. What this step does not
build yet (other layouts and dtypes, symbolic shapes) is refused by name.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .errors import SpecError
from .spec import AttentionSpec
from .visibility import Visibility

#: query rows whose score products share each K/V tile row load (4 rows × block_n 32: 8 vector
#: accumulators); block_m and block_m_dq must be multiples of it
PRODUCT_ROWS = 4
#: the input and gradient dtypes it builds (float32 arithmetic; bf16 gradients rounded once, at the store)
DTYPES = ("float32", "bfloat16")
#: the variants this step's kernel takes
SUPPORTED_VARIANTS = ("window", "softcap", "alibi", "sinks", "kv_start", "key_bounds", "custom_mask", "mask_mod",
                      "score_mod")


@dataclasses.dataclass(frozen=True)
class BackwardKnobs:
    #: query rows per tile: a dK/dV task reads its Q/dO rows this many at a time; 32 keeps the
    #: tile's three score-sized locals (S, P, dS: 3·32·32 floats, 12 KiB) in L1 beside Q's rows
    block_m: int = 32
    #: keys per tile, and so per dK/dV task: its dK and dV accumulators (block_n × D each) live in
    #: local scope for the whole task
    block_n: int = 32
    #: query rows per dQ task: each key tile it visits is transposed for the score rows, so more
    #: rows share that cost (64: dQ accumulators of 64 × D, 16 KiB at D = 64)
    block_m_dq: int = 64

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_m_dq"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise SpecError(f"backward knobs: {name} must be a positive int, got {x!r}")
        for name in ("block_m", "block_m_dq"):
            if getattr(self, name) % PRODUCT_ROWS:
                raise SpecError(f"backward knobs: {name}={getattr(self, name)} must be a multiple of {PRODUCT_ROWS} "
                                "(the rows whose products share a K/V row load)")


def check_spec(spec: AttentionSpec) -> None:
    """Refuse, by name, what this step's kernel does not build."""
    if spec.layout != "bhsd":
        raise SpecError(f"backward: layout {spec.layout!r} is not built yet (bhsd only)")
    if spec.dtype not in DTYPES:
        raise SpecError(f"backward: dtype {spec.dtype} is not built yet ({', '.join(DTYPES)})")
    other = [v for v in spec.variants if v not in SUPPORTED_VARIANTS]
    if other:
        raise SpecError(f"backward: {', '.join(other)} not built yet (this step takes {', '.join(SUPPORTED_VARIANTS)})")
    if spec.score_mod is not None:  # a step in it is refused by name before any TIR is made
        from .modifier_grad import score_derivative  # NumPy here: no TVM

        tensors = {n: np.zeros((1,) * len(dims), dtype) for n, dtype, dims in spec.mod_tensors}
        with np.errstate(all="ignore"):
            score_derivative(spec.score_mod, tensors)(np.zeros(2), 0, 0, np.arange(2), np.arange(2))


class _ScoreMath:
    """The backward's per-score TIR expressions for ``spec``: which keys a row sees (and the row
    and key ranges a tile may skip to), ``P`` from a raw product, and the chain rule's factor."""

    def __init__(self, spec: AttentionSpec):
        from .modifier_grad import score_derivative  # TIR derivatives (imports TVM)
        from .workloads.variants import ExtraParams, Variants  # the forward's mask hooks (imports TVM)

        from .workloads.kv import dim  # a dim's int, or its symbolic var (imports TVM)

        # the lengths (ints, or the kernel's one var each: every expression shares them)
        self.b, self.sq, self.skv = (dim(spec, n) for n in ("batch", "seq_q", "seq_kv"))
        self.vis, self.off = Visibility.of(spec), self.skv - self.sq
        self.scale, self.cap = float(spec.scale), spec.softcap
        # key bounds, the custom mask and the modifiers' tensors: the forward's buffers
        # (parameters before the outputs: _keep_params) and hooks over them
        self.extra = x = ExtraParams(spec, self.b)
        self.var = Variants(spec, LO=x.LO, HI=x.HI, tensors=x.tensors, cmask=x.cmask)
        self.d_score = score_derivative(spec.score_mod, x.tensors) if spec.score_mod is not None else None

    def sees(self, i, j, b=None, h=None):
        """Whether row i of sequence b, query head h, sees key j (both in range): Visibility's
        predicate, and the key bounds, ``mask_mod`` and the custom mask (the forward's hooks)."""
        from tvm.script import tirx as T  # TVM: this module's specs and checks load without it

        from .visibility import all_of  # the mask's conjunction, as the forward's

        conds = [self.vis.sees(j, i + self.off)]
        if b is not None:  # the tile's own call (the row ranges ask Visibility alone)
            conds += [self.var.sees(b, h, i + self.off, j), self.var.custom(b, i, j, self.sq, self.skv)]
        ok = all_of([c for c in conds if c is not None])
        return T.bool(True) if ok is None else ok

    def first_row(self, j0):  # the first row that may see key j0 (a right bound): rows before skip
        from tvm.script import tirx as T  # TVM: as above

        return T.max(0, j0 - self.off - self.vis.right) if self.vis.right >= 0 else 0

    def last_row(self, j1):  # one past the last row that may see key j1 − 1 (a left bound)
        from tvm.script import tirx as T  # TVM: as above

        return T.min(self.sq, j1 - 1 - self.off + self.vis.left + 1) if self.vis.left >= 0 else self.sq

    # exp2_fast and tanh_fast, the forward's: vectorizable (LLVM calls libm per lane for exp, tanh)
    def _score(self, s, i, j, slope):
        """The score of the raw product ``s = q·k`` before ``score_mod``: scaled, softcapped, less
        ALiBi's ``slope·|p − j|`` (natural-log units)."""
        from tvm.script import tirx as T  # TVM: as above

        from .workloads._math import tanh_fast  # TIR's math (imports TVM)

        x = s * T.float32(self.scale)
        t = x if self.cap is None else T.float32(self.cap) * tanh_fast(x / T.float32(self.cap))
        if slope is not None:
            t = t - slope * T.Cast("float32", T.abs(i + self.off - j))
        return t

    def prob(self, s, lse, in_tile, i, j, slope, start=None, b=None, h=None):
        """P of the raw product ``s = q·k``: ``exp(T(s·scale) − lse)``, 0 where hidden. ``lse``: the
        row's :meth:`row_lse` (+inf for a row that sees no key: P is then 0); ``slope``: its
        head's ALiBi slope (None without); ``start``: the sequence's ``kv_start`` (keys before it
        are hidden; None without); ``b``, ``h``: the sequence and query head (the mask hooks' and
        ``score_mod``'s; a modified score of −inf gives P = 0)."""
        from tvm.script import tirx as T  # TVM: as above

        from .workloads._math import LOG2E, exp2_fast  # TIR's math (imports TVM)

        t = self._score(s, i, j, slope)
        if self.var.score_fn is not None:
            t = _f32(self.var.score_fn(t, b, h, i + self.off, j))
        seen = T.And(in_tile, self.sees(i, j, b, h))
        seen = seen if start is None else T.And(seen, j >= start)
        return T.Select(seen, exp2_fast((t - lse) * T.float32(LOG2E)), T.float32(0))

    def grad(self, p, dpd, s, i, j, slope, b, h):
        """dS on the raw product ``s``: ``p ∘ (dP − delta)`` (``dpd``) times the chain rule's
        factor, ``scale · T'(s·scale)`` (the softcap's ``1 − tanh²``) and ``score_mod``'s
        derivative at the score (``tvm_attention.modifier_grad``); 0 where P is 0 under a
        modifier (a hidden key's derivative may be ±inf or NaN; NaN in P passes)."""
        from tvm.script import tirx as T  # TVM: as above

        from .workloads._math import tanh_fast  # TIR's math (imports TVM)

        if self.cap is None:
            factor = T.float32(self.scale)
        else:
            t = tanh_fast(s * T.float32(self.scale / self.cap))
            factor = (T.float32(1) - t * t) * T.float32(self.scale)
        if self.d_score is None:
            return p * dpd * factor
        d = _f32(self.d_score(self._score(s, i, j, slope), b, h, i + self.off, j)[1])
        return T.Select(p != T.float32(0), p * dpd * (factor * d), T.float32(0))

    @staticmethod
    def row_lse(lse, sink):
        """The denominator's log for P: the forward's ``lse`` (no sink), with the sink's ``exp``
        joined when there is one; +inf for a row that saw no key (``lse = −inf``)."""
        from tvm.script import tirx as T  # TVM: as above

        if sink is None:
            full = lse
        else:
            top = T.max(lse, sink)
            full = top + T.log(T.exp(lse - top) + T.exp(sink - top))
        return T.Select(lse > T.float32(-np.inf), full, T.float32(np.inf))


def _macros(spec: AttentionSpec, kn: BackwardKnobs, m: _ScoreMath):
    """The backward's TVMScript macros for ``spec``: a key tile's K and V transposed
    (``load_tiles``), a row's products against them (``products``), a row tile's deltas and
    effective lse (``row_deltas``), the sinks' gradient phase (``dsinks_phase``)."""
    from tvm.script import tirx as T  # TVM: this module's specs and checks load without it

    from .workloads._math import f32 as wide  # a load of a bf16 input as float32 (float32: unchanged)

    D, DV, SKV, BN, sinks, row_lse = spec.head_dim, spec.v_dim, m.skv, kn.block_n, spec.sinks, m.row_lse
    SQ, UP, B, H = m.sq, PRODUCT_ROWS, m.b, spec.heads

    @T.macro
    def load_tiles(K, V, Kt, Vt, b, kh, j0, nj):  # K and V's key tile, transposed, zero past the keys
        for c, d in T.grid(BN, D):
            Kt[d, c] = T.if_then_else(c < nj, wide(K[b, kh, T.min(j0 + c, SKV - 1), d]), T.float32(0))
        for c, d in T.grid(BN, DV):
            Vt[d, c] = T.if_then_else(c < nj, wide(V[b, kh, T.min(j0 + c, SKV - 1), d]), T.float32(0))

    @T.macro
    def products(Q, DO, Kt, Vt, S, dP, b, h, i0, r0):
        # rows r0 .. r0 + UP − 1's q·k (S) and dO·v (dP), vectors over keys, UP rows per K/V tile
        # row load; rows past Sq read its last row (their results are never used)
        for rr in T.serial(UP):
            for c in T.vectorized(BN):
                S[r0 + rr, c] = T.float32(0)
                dP[r0 + rr, c] = T.float32(0)
        for d in T.serial(D):
            for rr in T.unroll(UP):
                for c in T.vectorized(BN):
                    S[r0 + rr, c] = S[r0 + rr, c] + wide(Q[b, h, T.min(i0 + r0 + rr, SQ - 1), d]) * Kt[d, c]
        for d in T.serial(DV):
            for rr in T.unroll(UP):
                for c in T.vectorized(BN):
                    dP[r0 + rr, c] = dP[r0 + rr, c] + wide(DO[b, h, T.min(i0 + r0 + rr, SQ - 1), d]) * Vt[d, c]

    @T.macro
    def row_deltas(DO, O, LSE, SK, dl, le, b, h, i0, ni):  # the tile's rows' delta = rowsum(dO ∘ O), row_lse
        for r in T.serial(ni):
            dl[r] = T.float32(0)
            for d in T.serial(DV):
                dl[r] = dl[r] + wide(DO[b, h, i0 + r, d]) * wide(O[b, h, i0 + r, d])
            le[r] = row_lse(LSE[b, h, i0 + r], SK[h] if sinks else None)

    @T.macro
    def dsinks_phase(O, DO, LSE, SK, DSK):
        for h in T.parallel(H):  # dsink_h = −Σ p_sink·delta over the head's rows
            with T.sblock("dsinks"):
                vh = T.axis.spatial(H, h)
                T.reads(O[0:B, vh, 0:SQ, 0:DV], DO[0:B, vh, 0:SQ, 0:DV], LSE[0:B, vh, 0:SQ], SK[vh])
                T.writes(DSK[vh])
                acc = T.sblock_alloc_buffer((2,), "float32", scope="local")  # [0] the sum, [1] a row's delta
                acc[0] = T.float32(0)
                for b, i in T.grid(B, SQ):
                    acc[1] = T.float32(0)
                    for d in T.serial(DV):
                        acc[1] = acc[1] + wide(DO[b, vh, i, d]) * wide(O[b, vh, i, d])
                    acc[0] = acc[0] - T.exp(SK[vh] - row_lse(LSE[b, vh, i], SK[vh])) * acc[1]
                DSK[vh] = acc[0]

    return load_tiles, products, row_deltas, dsinks_phase


def backward_func(spec: AttentionSpec, knobs: BackwardKnobs | None = None):
    """The PrimFunc ``attention_backward(q, k, v, o, lse, do, [alibi_slopes], [sinks], [kv_start],
    [key_lo, key_hi], [custom_mask, mask_indptr], [mod tensors...], dq, dk, dv, [dsinks])`` (the
    bracketed ones where the spec takes them): BHSD ``q, do, o, dq (B, H, Sq, D)`` (Dv for
    ``o``/``do``), ``k, dk (B, KH, Skv, D)``, ``v, dv (B, KH, Skv, Dv)``, ``lse (B, H, Sq)`` the
    forward's (natural log, ``−inf`` for a row that sees no key), ``alibi_slopes``, ``sinks``,
    ``dsinks (H,)`` float32, ``kv_start (B,)`` int32, the others as the forward's
    (``workloads.variants.ExtraParams``)."""
    from tvm.script import tirx as T  # TVM: this module's specs and checks load without it

    check_spec(spec)
    kn = knobs or BackwardKnobs()
    from .workloads._math import cast_to, f32 as wide  # TIR's math (imports TVM): stores and bf16 loads

    m = _ScoreMath(spec)
    B, H, KH, G = m.b, spec.heads, spec.kv_heads, spec.group_size  # B, SQ, SKV: ints or symbolic vars
    SQ, SKV, D, DV, BM, BN = m.sq, m.skv, spec.head_dim, spec.v_dim, kn.block_m, kn.block_n
    BMQ, MTQ, NT = kn.block_m_dq, (SQ + kn.block_m_dq - 1) // kn.block_m_dq, (SKV + BN - 1) // BN
    vis, OFF = m.vis, m.off  # row i's position is i + OFF (bottom-right)
    f32, dt = "float32", spec.dtype  # dt: the inputs' and gradients' (bf16 rounded at the stores)
    first_row, last_row, prob, grad, row_lse = m.first_row, m.last_row, m.prob, m.grad, m.row_lse
    alibi, sinks, starts = spec.alibi, spec.sinks, spec.kv_start

    load_tiles, products, row_deltas, dsinks_phase = _macros(spec, kn, m)
    # accumulation blocking: head-dim columns (dK/dV) or rows (dQ) held in registers at once
    UK, UV, UR = _unroll(D), _unroll(DV), _unroll(BMQ, 4 if D <= 64 else 2)  # dQ: UR rows × D/16 vectors

    # not checked well-formed, as the forward's: tanh_fast's let variable appears in both arms of
    # exp2_fast's select, the same value bound twice
    @T.prim_func(s_tir=True, check_well_formed=False)
    def attention_backward(Q: T.Buffer((B, H, SQ, D), dt), K: T.Buffer((B, KH, SKV, D), dt),
                           V: T.Buffer((B, KH, SKV, DV), dt), O: T.Buffer((B, H, SQ, DV), dt),
                           LSE: T.Buffer((B, H, SQ), f32), DO: T.Buffer((B, H, SQ, DV), dt),
                           SL: T.Buffer((H,), f32), SK: T.Buffer((H,), f32), KS: T.Buffer((B,), "int32"),
                           DQ: T.Buffer((B, H, SQ, D), dt), DK: T.Buffer((B, KH, SKV, D), dt),
                           DV_: T.Buffer((B, KH, SKV, DV), dt), DSK: T.Buffer((H,), f32)):
        T.func_attr({"global_symbol": "attention_backward", "tirx.noalias": True})
        for task in T.parallel(B * KH * NT):
            with T.sblock("dkdv"):
                vt = T.axis.spatial(B * KH * NT, task)
                T.reads(Q[0:B, 0:H, 0:SQ, 0:D], K[0:B, 0:KH, 0:SKV, 0:D], V[0:B, 0:KH, 0:SKV, 0:DV],
                        O[0:B, 0:H, 0:SQ, 0:DV], LSE[0:B, 0:H, 0:SQ], DO[0:B, 0:H, 0:SQ, 0:DV])
                T.writes(DK[0:B, 0:KH, 0:SKV, 0:D], DV_[0:B, 0:KH, 0:SKV, 0:DV])
                S = T.sblock_alloc_buffer((BM, BN), f32, scope="local")
                P = T.sblock_alloc_buffer((BM, BN), f32, scope="local")
                dP = T.sblock_alloc_buffer((BM, BN), f32, scope="local")
                dl = T.sblock_alloc_buffer((BM,), f32, scope="local")
                le = T.sblock_alloc_buffer((BM,), f32, scope="local")
                acc_k = T.sblock_alloc_buffer((D, BN), f32, scope="local")  # dKᵀ, dVᵀ of the key tile
                acc_v = T.sblock_alloc_buffer((DV, BN), f32, scope="local")
                Kt = T.sblock_alloc_buffer((D, BN), f32, scope="local")
                Vt = T.sblock_alloc_buffer((DV, BN), f32, scope="local")
                b = vt // (KH * NT)
                kh = vt // NT % KH
                j0 = vt % NT * BN
                nj = T.min(BN, SKV - j0)
                for d, c in T.grid(D, BN):
                    acc_k[d, c] = T.float32(0)
                for d, c in T.grid(DV, BN):
                    acc_v[d, c] = T.float32(0)
                load_tiles(K, V, Kt, Vt, b, kh, j0, nj)  # once per task: the score rows are vectors over keys
                for g in T.serial(G):
                    for it in T.serial(first_row(j0) // BM, (last_row(j0 + nj) + BM - 1) // BM):
                        i0 = it * BM
                        ni = T.min(BM, SQ - i0)
                        row_deltas(DO, O, LSE, SK, dl, le, b, kh * G + g, i0, ni)
                        for r0 in T.serial((ni + PRODUCT_ROWS - 1) // PRODUCT_ROWS):
                            products(Q, DO, Kt, Vt, S, dP, b, kh * G + g, i0, r0 * PRODUCT_ROWS)
                        for r in T.serial(ni):
                            # no names bound here: a let inside a vectorized loop is taken as one lane's
                            for c in T.vectorized(BN):
                                P[r, c] = prob(S[r, c], le[r], c < nj, i0 + r, j0 + c, SL[kh * G + g] if alibi else None,
                                               KS[b] if starts else None, b, kh * G + g)
                            for c in T.vectorized(BN):  # dP becomes dS
                                dP[r, c] = grad(P[r, c], dP[r, c] - dl[r], S[r, c], i0 + r, j0 + c,
                                                SL[kh * G + g] if alibi else None, b, kh * G + g)
                        # dVᵀ += dOᵀ·P, dKᵀ += Qᵀ·dS: vectors over keys, UV/UK head-dim columns held
                        # across the rows (each P/dS row load feeds that many FMAs)
                        for d0, r in T.grid(DV // UV, ni):
                            for dd in T.unroll(UV):
                                for c in T.vectorized(BN):
                                    acc_v[d0 * UV + dd, c] = acc_v[d0 * UV + dd, c] \
                                        + wide(DO[b, kh * G + g, i0 + r, d0 * UV + dd]) * P[r, c]
                        for d0, r in T.grid(D // UK, ni):
                            for dd in T.unroll(UK):
                                for c in T.vectorized(BN):
                                    acc_k[d0 * UK + dd, c] = acc_k[d0 * UK + dd, c] \
                                        + wide(Q[b, kh * G + g, i0 + r, d0 * UK + dd]) * dP[r, c]
                for c, d in T.grid(nj, D):
                    DK[b, kh, j0 + c, d] = cast_to(DK, acc_k[d, c])
                for c, d in T.grid(nj, DV):
                    DV_[b, kh, j0 + c, d] = cast_to(DV_, acc_v[d, c])
        for task in T.parallel(B * H * MTQ):
            with T.sblock("dq"):
                vt = T.axis.spatial(B * H * MTQ, task)
                T.reads(Q[0:B, 0:H, 0:SQ, 0:D], K[0:B, 0:KH, 0:SKV, 0:D], V[0:B, 0:KH, 0:SKV, 0:DV],
                        O[0:B, 0:H, 0:SQ, 0:DV], LSE[0:B, 0:H, 0:SQ], DO[0:B, 0:H, 0:SQ, 0:DV])
                T.writes(DQ[0:B, 0:H, 0:SQ, 0:D])
                S = T.sblock_alloc_buffer((BMQ, BN), f32, scope="local")
                dP = T.sblock_alloc_buffer((BMQ, BN), f32, scope="local")
                dl = T.sblock_alloc_buffer((BMQ,), f32, scope="local")
                le = T.sblock_alloc_buffer((BMQ,), f32, scope="local")
                acc_q = T.sblock_alloc_buffer((BMQ, D), f32, scope="local")
                Kt = T.sblock_alloc_buffer((D, BN), f32, scope="local")
                Vt = T.sblock_alloc_buffer((DV, BN), f32, scope="local")
                b = vt // (H * MTQ)
                h = vt // MTQ % H
                i0 = vt % MTQ * BMQ
                ni = T.min(BMQ, SQ - i0)
                for r, d in T.grid(BMQ, D):
                    acc_q[r, d] = T.float32(0)
                for r, c in T.grid(BMQ, BN):
                    dP[r, c] = T.float32(0)
                row_deltas(DO, O, LSE, SK, dl, le, b, h, i0, ni)
                for jt in T.serial(T.max(_first_key(vis, OFF, i0), T.min(T.max(KS[b], 0), SKV) if starts else 0) // BN,
                                   (_last_key(vis, OFF, SKV, i0 + ni) + BN - 1) // BN):
                    j0 = jt * BN
                    nj = T.min(BN, SKV - j0)
                    load_tiles(K, V, Kt, Vt, b, h // G, j0, nj)
                    for r0 in T.serial((ni + PRODUCT_ROWS - 1) // PRODUCT_ROWS):
                        products(Q, DO, Kt, Vt, S, dP, b, h, i0, r0 * PRODUCT_ROWS)
                    for r in T.serial(ni):
                        for c in T.vectorized(BN):  # dP becomes dS (no names bound: see above)
                            dP[r, c] = grad(prob(S[r, c], le[r], c < nj, i0 + r, j0 + c, SL[h] if alibi else None,
                                                 KS[b] if starts else None, b, h),
                                            dP[r, c] - dl[r], S[r, c], i0 + r, j0 + c, SL[h] if alibi else None, b, h)
                    # dQ += dS·K: UR rows held across the keys (each K row load feeds UR of them);
                    # dS rows past ni hold leftovers (their dQ rows are never stored)
                    for r0, c in T.grid(BMQ // UR, nj):
                        for rr in T.unroll(UR):
                            for d in T.vectorized(D):
                                acc_q[r0 * UR + rr, d] = acc_q[r0 * UR + rr, d] + dP[r0 * UR + rr, c] * wide(K[b, h // G, j0 + c, d])
                for r in T.serial(ni):
                    for d in T.vectorized(D):
                        DQ[b, h, i0 + r, d] = cast_to(DQ, acc_q[r, d])
        if sinks:  # static: a spec without sinks has no such phase (nor SK, DSK)
            dsinks_phase(O, DO, LSE, SK, DSK)

    from .workloads.fused import _keep_params  # the forward's: drop the parameters a spec does not take

    return _keep_params(attention_backward, [True] * 6 + [alibi, sinks, starts] + [True] * 3 + [sinks],
                        extra=m.extra.params, n_outputs=3 + sinks)


def _f32(x):
    """A modifier's result (or derivative) as a float32 expression: a number becomes a constant."""
    from tvm.script import tirx as T  # TVM: this module's specs and checks load without it

    from .workloads._math import f32  # TIR's math (imports TVM)

    return T.float32(float(x)) if isinstance(x, (bool, int, float)) else f32(x)


def _unroll(n: int, most: int = 4) -> int:
    """The largest of ``most``, 2, 1 dividing ``n``: 4 columns of 2 vectors each (block_n 32,
    AVX-512) are 8 accumulators, leaving registers for the loads."""
    return next(u for u in (most, 2, 1) if n % u == 0)


def _first_key(vis: Visibility, off: int, i0):
    """The first key row ``i0`` may see (a left bound), as a TIR expression."""
    from tvm.script import tirx as T  # TVM: this module's specs and checks load without it

    return T.max(0, i0 + off - vis.left) if vis.left >= 0 else 0


def _last_key(vis: Visibility, off: int, skv: int, i1):
    """One past the last key row ``i1 − 1`` may see (a right bound)."""
    from tvm.script import tirx as T  # TVM: this module's specs and checks load without it

    return T.min(skv, i1 - 1 + off + vis.right + 1) if vis.right >= 0 else skv


#: the backward's template buffers' argument names (the others are named as the arguments)
_ARG_NAMES = {"Q": "q", "K": "k", "V": "v", "O": "o", "LSE": "lse", "DO": "do", "SL": "alibi_slopes", "SK": "sinks",
              "KS": "kv_start", "DQ": "dq", "DK": "dk", "DV_": "dv", "DSK": "dsinks"}
#: the outputs, in call order
OUTPUTS = ("dq", "dk", "dv", "dsinks")


@dataclasses.dataclass
class BackwardKernel:
    """A built backward: ``kernel(q, k, v, o, lse, do, **variant_args) -> (dq, dk, dv[, dsinks])``
    on NumPy arrays (BHSD, C-contiguous), with its lowered IR's audit. ``args``: each parameter's
    ``(name, shape, dtype)`` in call order, outputs last."""

    spec: AttentionSpec
    knobs: BackwardKnobs
    module: Any
    report: Any
    args: tuple

    def __call__(self, q, k, v, o, lse, do, **variant_args):
        """``(dq, dk, dv)``, and ``dsinks (H,)`` last with sinks. ``variant_args`` where the spec
        takes them, as the forward's: ``alibi_slopes``/``sinks (H,)`` float32, ``kv_start (B,)``
        int32 (any value: keys before it are hidden), ``key_lo``/``key_hi (B, Skv)`` int32,
        ``custom_mask``/``mask_indptr`` (the packed bits, ``tvm_attention.masks.pack_mask``), the
        modifiers' tensors by name."""
        import tvm  # a built kernel: TVM is loaded

        given = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do, **variant_args}
        takes = {n for n, _, _ in self.args}
        stray = sorted(n for n, a in given.items() if n not in takes and a is not None)
        if stray:
            raise SpecError(f"backward: this spec takes no {', '.join(stray)}")
        arrays, outs, bound = [], [], {}
        for name, shape, dtype in self.args:
            if name in OUTPUTS:
                outs.append(tvm.runtime.tensor(np.empty(tuple(bound.get(x, x) for x in shape), dtype)))
                continue
            a = given.get(name)
            if a is None:
                raise SpecError(f"backward: missing {name} ({dtype} {shape})")
            a = np.asarray(a)
            # a symbolic dim is bound by the first array that has it, and must agree after
            want = tuple(bound.setdefault(x, n) if isinstance(x, str) else x for x, n in zip(shape, a.shape))
            if a.ndim != len(shape) or a.shape != want or a.dtype != dtype:
                raise SpecError(f"backward: {name} must be {dtype} {tuple(bound.get(x, x) for x in shape)}, got "
                                f"{a.dtype} {a.shape}")
            arrays.append(tvm.runtime.tensor(np.ascontiguousarray(a)))
        if self.spec.custom_mask:  # the bytes the kernel reads: each sequence's, inside custom_mask
            from .layouts import check_custom_mask  # the forward loader's rule (int64 sums)

            nb, sq, skv = np.shape(q)[0], np.shape(q)[2], np.shape(k)[2]
            check_custom_mask({n: np.asarray(given[n]) for n in ("custom_mask", "mask_indptr")},
                              [sq] * nb, [skv] * nb, nb)
        self.module["attention_backward"](*arrays, *outs)
        return tuple(x.numpy() for x in outs)


def _call_args(func) -> tuple:
    """``(name, shape, dtype)`` of each of ``func``'s parameters, in call order (static shapes)."""
    import ml_dtypes  # TVM's own dependency: NumPy's bfloat16

    def dtype(name):
        return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)

    def extent(x):  # an int, or a symbolic dim's name (bound by the first array that has it)
        return int(x) if hasattr(x, "value") or isinstance(x, int) else str(x)

    # TVM 0.27: a PrimFunc's parameters are its buffers (no buffer_map)
    return tuple((_ARG_NAMES.get(p.name, p.name), tuple(extent(x) for x in p.shape), dtype(str(p.dtype)))
                 for p in func.params)


def build_backward(spec: AttentionSpec, knobs: BackwardKnobs | None = None, target: Any = "llvm") -> BackwardKernel:
    """Lower, audit and compile the backward of ``spec`` for ``target`` (default: this CPU).
    The audit must find no buffer that grows with the lengths or, probed, holds the score
    matrix's elements (``score_buffers`` S, P)."""
    from .audit import audit, list_allocations, probe_spec  # the compiler's side (imports TVM)
    from .lowering import codegen, lower_final  # the compiler's side (imports TVM)
    from .target import resolve_target  # the compiler's side (imports TVM)

    knobs = knobs or BackwardKnobs()
    target = resolve_target(target)
    func = backward_func(spec, knobs)
    lowered = lower_final(func, target)
    # as the forward's: the same kernel lowered at doubled lengths tells a tile (fixed) from a
    # buffer that grows with them, so that short sequences' tiles are not taken for score matrices
    probe = list_allocations(lower_final(backward_func(probe_spec(spec), knobs), target))
    report = audit(lowered, spec, probe=probe)
    if report.verdict != "fused":
        raise RuntimeError(f"backward: the audit found it not fused: {'; '.join(report.reasons)}")
    return BackwardKernel(spec, knobs, codegen(lowered), report, _call_args(func))
