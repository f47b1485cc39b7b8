"""The fused backward's TensorIR (issue 46): the PrimFunc :func:`backward_func` builds, for the
layouts it takes. ``tvm_attention.backward`` is its interface (knobs, checks, the built kernel).

A layout is an addressing object (:class:`_BHSDRows`, :class:`_VarlenRows`): the buffers' shapes,
how many tasks each phase has and which sequence, head and tile a task owns (``locate``), each
sequence's lengths and where its rows and keys sit in the buffers. The phases and the score math
(:class:`_ScoreMath`) are written once over it: a row ``i`` of sequence ``b`` sits at position
``i + len_k(b) − len_q(b)`` (bottom-right), as everywhere.
"""
from __future__ import annotations

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..modifier_grad import score_derivative
from ..spec import DATA_ALIGNMENT as A, AttentionSpec
from ..visibility import Visibility, all_of
from ._math import LOG2E, cast_to, exp2_fast, f32 as wide, ssa_checked, tanh_fast
from .kv import dim
from ..tvm_internals import fast_macros
from .variants import ExtraParams, Variants



class _BHSDRows:
    """BHSD addressing: ``q (B, H, Sq, D)``, ``k (B, KH, Skv, D)``, ``lse (B, H, Sq)``; every
    sequence has ``Sq`` rows and ``Skv`` keys (ints, or one symbolic var each)."""

    def __init__(self, spec: AttentionSpec, BN: int, BMQ: int):
        self.B, self.SQ, self.SKV = (dim(spec, n) for n in ("batch", "seq_q", "seq_kv"))
        H, KH, D, DV = spec.heads, spec.kv_heads, spec.head_dim, spec.v_dim
        self.qs, self.ks, self.vs = (self.B, H, self.SQ, D), (self.B, KH, self.SKV, D), (self.B, KH, self.SKV, DV)
        self.os, self.ls = (self.B, H, self.SQ, DV), (self.B, H, self.SQ)
        self.nt, self.mtq = (self.SKV + BN - 1) // BN, (self.SQ + BMQ - 1) // BMQ
        self.k_tasks, self.q_tasks = self.B * KH * self.nt, self.B * H * self.mtq
        self.KH, self.H, self.BN, self.BMQ = KH, H, BN, BMQ
        self.params = []  # the layout's own parameters (varlen's cu_seqlens)
        self.bound_rows = self.B  # key_lo's rows

    def len_q(self, b):
        return self.SQ

    def len_k(self, b):
        return self.SKV

    def q(self, b, h, i, d):  # q, o, do, dq
        return (b, h, i, d)

    def k(self, b, kh, j, d):  # k, v, dk, dv
        return (b, kh, j, d)

    def lse(self, b, h, i):
        return (b, h, i)

    def locate(self, seq, vt, keys: bool):
        """``seq[0:3] = (sequence, head, first key or row)`` of task ``vt`` of the dK/dV phase
        (``keys``: a kv head and a key tile) or the dQ phase (a query head and a row tile)."""
        n, heads, step = (self.nt, self.KH, self.BN) if keys else (self.mtq, self.H, self.BMQ)
        return _locate_dense(seq, vt, n, heads, step)


@T.macro
def _locate_dense(seq, vt, n, heads, step):
    seq[0] = vt // (heads * n)
    seq[1] = vt // n % heads
    seq[2] = vt % n * step


class _VarlenRows:
    """FlashAttention's varlen addressing: ``q (total_q, H, D)``, ``k (total_k, KH, D)``, ``lse
    (H, total_q)``, ``cu_seqlens_q``/``cu_seqlens_k (batch + 1,)`` int32. A phase's tasks are
    (head, tile slot) pairs, the forward's slot scheme: sequence ``b``'s tiles take the slots from
    ``cu[b] // tile + b`` (strictly increasing in ``b``), so ``total // tile + batch`` slots hold
    every tile and a binary search on ``cu`` finds a slot's sequence; empty slots compute nothing."""

    def __init__(self, spec: AttentionSpec, BN: int, BMQ: int):
        H, KH, D, DV = spec.heads, spec.kv_heads, spec.head_dim, spec.v_dim
        self.TQ, self.TK = tirx.Var("total_q", "int32"), tirx.Var("total_k", "int32")
        NB1 = tirx.Var("batch_plus_1", "int32")  # a buffer's shape must be a plain var to be bound
        self.B = NB1 - 1
        # named as the forward's (CQ, CK): the index checks (index_checks.with_index_checks) find them so
        self.CQ, self.CK = (tirx.decl_buffer((NB1,), "int32", n, data_alignment=A) for n in ("CQ", "CK"))
        self.params = [self.CQ, self.CK]
        self.qs, self.ks, self.vs = (self.TQ, H, D), (self.TK, KH, D), (self.TK, KH, DV)
        self.os, self.ls = (self.TQ, H, DV), (H, self.TQ)
        self.k_slots, self.q_slots = self.TK // BN + self.B, self.TQ // BMQ + self.B
        self.k_tasks, self.q_tasks = KH * self.k_slots, H * self.q_slots
        self.BN, self.BMQ = BN, BMQ
        self.bound_rows = tirx.Var("key_bound_rows", "int32")  # key_lo's rows: batch, checked by the caller

    def len_q(self, b):
        return self.CQ[b + 1] - self.CQ[b]

    def len_k(self, b):
        return self.CK[b + 1] - self.CK[b]

    def q(self, b, h, i, d):  # a row past the sequence (a tile's tail) clamps into the buffer
        return (T.min(self.CQ[b] + T.max(i, 0), self.TQ - 1), h, d)

    def k(self, b, kh, j, d):
        return (T.min(self.CK[b] + T.max(j, 0), self.TK - 1), kh, d)

    def lse(self, b, h, i):
        return (h, T.min(self.CQ[b] + T.max(i, 0), self.TQ - 1))

    def locate(self, seq, vt, keys: bool):
        slots, cu, step = (self.k_slots, self.CK, self.BN) if keys else (self.q_slots, self.CQ, self.BMQ)
        return _locate_slot(seq, vt, slots, cu, step, self.B)


@T.macro
def _locate_slot(seq, vt, slots, cu, step, nb):
    # seq[3], seq[4]: the binary search's bounds on b (the largest b with cu[b] // step + b <= slot)
    seq[1] = vt // slots
    seq[3] = 0
    seq[4] = nb - 1
    for _ in T.serial(32):  # 32 halvings cover any int32 batch
        if seq[3] < seq[4]:
            if cu[(seq[3] + seq[4] + 1) // 2] // step + (seq[3] + seq[4] + 1) // 2 <= vt % slots:
                seq[3] = (seq[3] + seq[4] + 1) // 2
            else:
                seq[4] = (seq[3] + seq[4] + 1) // 2 - 1
    seq[0] = seq[3]
    seq[2] = (vt % slots - cu[seq[3]] // step - seq[3]) * step


ROWS = {"bhsd": _BHSDRows, "varlen": _VarlenRows}


class _ScoreMath:
    """The backward's per-score TIR expressions for ``spec`` over the layout ``rows``: which keys a
    row sees (and the row and key ranges a tile may skip to), ``P`` from a raw product, and dS."""

    def __init__(self, spec: AttentionSpec, rows, wrt: tuple[str, ...] = ()):
        self.rows, self.vis = rows, Visibility.of(spec)
        self.scale, self.cap = float(spec.scale), spec.softcap
        # key bounds, the custom mask and the modifiers' tensors: the forward's buffers
        # (parameters before the outputs: _keep_params) and hooks over them
        self.extra = x = ExtraParams(spec, rows.bound_rows)
        self.var = Variants(spec, LO=x.LO, HI=x.HI, tensors=x.tensors, cmask=x.cmask)
        # the score's derivative and, for the tensors in wrt, each read's (tvm_attention.modifier_grad)
        self.d_score = score_derivative(spec.score_mod, x.tensors, wrt) if spec.score_mod is not None else None

    def off(self, b):  # row i of sequence b sits at position i + off(b)
        return self.rows.len_k(b) - self.rows.len_q(b)

    def sees(self, i, j, b, h):
        """Whether row i of sequence b, query head h, sees key j (both in range): Visibility's
        predicate, and the key bounds, ``mask_mod`` and the custom mask (the forward's hooks)."""
        conds = [self.vis.sees(j, i + self.off(b)), self.var.sees(b, h, i + self.off(b), j),
                 self.var.custom(b, i, j, self.rows.len_q(b), self.rows.len_k(b))]
        ok = all_of([c for c in conds if c is not None])
        return T.bool(True) if ok is None else ok

    def first_row(self, j0, b):  # the first row that may see key j0 (a right bound): rows before skip
        return T.max(0, j0 - self.off(b) - self.vis.right) if self.vis.right >= 0 else 0

    def last_row(self, j1, b):  # one past the last row that may see key j1 − 1 (a left bound)
        sq = self.rows.len_q(b)
        return T.min(sq, j1 - 1 - self.off(b) + self.vis.left + 1) if self.vis.left >= 0 else sq

    def first_key(self, i0, b):  # the first key row i0 may see (a left bound)
        return T.max(0, i0 + self.off(b) - self.vis.left) if self.vis.left >= 0 else 0

    def first_key_tile(self, i0, b, start, BN: int):
        """The first key tile a row tile from ``i0`` may see: its first key, or the sequence's
        ``kv_start`` (clamped into its keys; None: none) when later."""
        first = self.first_key(i0, b)
        if start is not None:
            first = T.max(first, T.min(T.max(start, 0), self.rows.len_k(b)))
        return first // BN

    def last_key(self, i1, b):  # one past the last key row i1 − 1 may see (a right bound)
        skv = self.rows.len_k(b)
        return T.min(skv, i1 - 1 + self.off(b) + self.vis.right + 1) if self.vis.right >= 0 else skv

    # exp2_fast and tanh_fast, the forward's: vectorizable (LLVM calls libm per lane for exp, tanh)
    def _score(self, s, i, j, slope, b):
        """The score of the raw product ``s = q·k`` before ``score_mod``: scaled, softcapped, less
        ALiBi's ``slope·|p − j|`` (natural-log units)."""
        x = s * T.float32(self.scale)
        t = x if self.cap is None else T.float32(self.cap) * tanh_fast(x / T.float32(self.cap))
        if slope is not None:
            t = t - slope * T.Cast("float32", T.abs(i + self.off(b) - j))
        return t

    def prob(self, s, lse, in_tile, i, j, slope, start, b, h):
        """P of the raw product ``s = q·k``: ``exp(T(s·scale) − lse)``, 0 where hidden. ``lse``: the
        row's :meth:`row_lse` (+inf for a row that sees no key: P is then 0); ``slope``: its
        head's ALiBi slope (None without); ``start``: the sequence's ``kv_start`` (keys before it
        are hidden; None without); ``b``, ``h``: the sequence and query head (the mask hooks' and
        ``score_mod``'s; a modified score of −inf gives P = 0)."""
        t = self._score(s, i, j, slope, b)
        if self.var.score_fn is not None:
            t = _f32(self.var.score_fn(t, b, h, i + self.off(b), j))
        seen = T.And(in_tile, self.sees(i, j, b, h))
        seen = seen if start is None else T.And(seen, j >= start)
        return T.Select(seen, exp2_fast((t - lse) * T.float32(LOG2E)), T.float32(0))

    def grad(self, p, dpd, s, i, j, slope, b, h):
        """dS on the raw product ``s``: ``p ∘ (dP − delta)`` (``dpd``) times the chain rule's
        factor, ``scale · T'(s·scale)`` (the softcap's ``1 − tanh²``) and ``score_mod``'s
        derivative at the score (``tvm_attention.modifier_grad``); 0 where P is 0 under a
        modifier (a hidden key's derivative may be ±inf or NaN; NaN in P passes)."""
        if self.cap is None:
            factor = T.float32(self.scale)
        else:
            t = tanh_fast(s * T.float32(self.scale / self.cap))
            factor = (T.float32(1) - t * t) * T.float32(self.scale)
        if self.d_score is None:
            return p * dpd * factor
        d = _f32(self.d_score(self._score(s, i, j, slope, b), b, h, i + self.off(b), j)[1])
        return T.Select(p != T.float32(0), p * dpd * (factor * d), T.float32(0))

    @staticmethod
    def row_lse(lse, sink):
        """The denominator's log for P: the forward's ``lse`` (no sink), with the sink's ``exp``
        joined when there is one; +inf for a row that saw no key (``lse = −inf``)."""
        if sink is None:
            full = lse
        else:
            top = T.max(lse, sink)
            full = top + T.log(T.exp(lse - top) + T.exp(sink - top))
        return T.Select(lse > T.float32(-np.inf), full, T.float32(np.inf))


def _f32(x):
    """A modifier's result (or derivative) as a float32 expression: a number becomes a constant."""
    return T.float32(float(x)) if isinstance(x, (bool, int, float)) else wide(x)


def _unroll(n: int, most: int = 4) -> int:
    """The largest of ``most``, 2, 1 dividing ``n``: 4 columns of 2 vectors each (block_n 32,
    AVX-512) are 8 accumulators, leaving registers for the loads."""
    return next(u for u in (most, 2, 1) if n % u == 0)


def _macros(spec: AttentionSpec, BN: int, UP: int, m: _ScoreMath):
    """The backward's TVMScript macros for ``spec`` over ``m.rows``: a key tile's K and V
    transposed (``load_tiles``), ``UP`` rows' products against them (``products``), a row tile's
    deltas and effective lse (``row_deltas``), the sinks' gradient phase (``dsinks_phase``)."""
    R, D, DV, sinks, row_lse, H = m.rows, spec.head_dim, spec.v_dim, spec.sinks, m.row_lse, spec.heads

    @T.macro
    def load_tiles(K, V, Kt, Vt, b, kh, j0, nj):  # K and V's key tile, transposed, zero past the keys
        for c, d in T.grid(BN, D):
            Kt[d, c] = T.if_then_else(c < nj, wide(K[R.k(b, kh, T.min(j0 + c, R.len_k(b) - 1), d)]), T.float32(0))
        for c, d in T.grid(BN, DV):
            Vt[d, c] = T.if_then_else(c < nj, wide(V[R.k(b, kh, T.min(j0 + c, R.len_k(b) - 1), d)]), T.float32(0))

    @T.macro
    def products(Q, DO, Kt, Vt, S, dP, b, h, i0, r0):
        # rows r0 .. r0 + UP − 1's q·k (S) and dO·v (dP), vectors over keys, UP rows per K/V tile
        # row load; rows past the sequence's read its last row (their results are never used)
        for rr in T.serial(UP):
            for c in T.vectorized(BN):
                S[r0 + rr, c] = T.float32(0)
                dP[r0 + rr, c] = T.float32(0)
        for d in T.serial(D):
            for rr in T.unroll(UP):
                for c in T.vectorized(BN):
                    S[r0 + rr, c] = S[r0 + rr, c] + wide(Q[R.q(b, h, T.min(i0 + r0 + rr, R.len_q(b) - 1), d)]) * Kt[d, c]
        for d in T.serial(DV):
            for rr in T.unroll(UP):
                for c in T.vectorized(BN):
                    dP[r0 + rr, c] = dP[r0 + rr, c] + wide(DO[R.q(b, h, T.min(i0 + r0 + rr, R.len_q(b) - 1), d)]) \
                        * Vt[d, c]

    @T.macro
    def row_deltas(DO, O, LSE, SK, dl, le, b, h, i0, ni):  # the tile's rows' delta = rowsum(dO ∘ O), row_lse
        for r in T.serial(ni):
            dl[r] = T.float32(0)
            for d in T.serial(DV):
                dl[r] = dl[r] + wide(DO[R.q(b, h, i0 + r, d)]) * wide(O[R.q(b, h, i0 + r, d)])
            le[r] = row_lse(LSE[R.lse(b, h, i0 + r)], SK[h] if sinks else None)

    @T.macro
    def dsinks_phase(O, DO, LSE, SK, DSK):
        for h in T.parallel(H):  # dsink_h = −Σ p_sink·delta over the head's rows
            with T.sblock("dsinks"):
                vh = T.axis.spatial(H, h)
                T.reads(O[_whole(O)], DO[_whole(DO)], LSE[_whole(LSE)], SK[vh])
                T.writes(DSK[vh])
                acc = T.sblock_alloc_buffer((2,), "float32", scope="local")  # [0] the sum, [1] a row's delta
                acc[0] = T.float32(0)
                for b in T.serial(R.B):
                    for i in T.serial(R.len_q(b)):
                        acc[1] = T.float32(0)
                        for d in T.serial(DV):
                            acc[1] = acc[1] + wide(DO[R.q(b, vh, i, d)]) * wide(O[R.q(b, vh, i, d)])
                        acc[0] = acc[0] - T.exp(SK[vh] - row_lse(LSE[R.lse(b, vh, i)], SK[vh])) * acc[1]
                DSK[vh] = acc[0]

    return load_tiles, products, row_deltas, dsinks_phase


def _whole(buf) -> tuple:
    """Every element of ``buf``, as an index tuple of slices (a block's whole-buffer region)."""
    return tuple(slice(0, n) for n in buf.shape)


def _partials(spec: AttentionSpec, m: _ScoreMath, wrt: tuple[str, ...]) -> dict:
    """Per differentiated tensor, its output ``d_<name>_partials (H, elements)`` float32: each
    query head's share of the gradient, flattened row-major (the caller sums over the heads: a
    head's task owns its row, no two tasks write one element)."""
    out = {}
    for name in wrt:
        n = 1
        for x in m.extra.tensors[name].shape:
            n = n * x
        out[name] = tirx.decl_buffer((spec.heads, n), "float32", f"d_{name}_partials", data_alignment=A)
    return out


def _scatter_chain(m: _ScoreMath, parts: dict, n_reads: int, atomic_add=None):
    """A macro adding ``dt · d score_mod / d read`` of each of the ``n_reads`` tensor reads of the
    score ``(u, b, hq, pos, j)`` to its element of query head ``h``'s partials; a chain of macros,
    one per read (a macro cannot loop over a Python list). ``atomic_add(buf, index, value)``: the
    CUDA backward's (every key tile's block adds into the same elements); None: a plain add."""
    def site(k, u, b, hq, pos, j):  # read k: (tensor name, clamped index, its derivative)
        return m.d_score(u, b, hq, pos, j)[2][k]

    def flat(name, idx):  # row-major element of the clamped index
        shape, e = m.extra.tensors[name].shape, 0
        for i, n in zip(idx, shape):
            e = e * n + i
        return e

    def make(k):
        if k == n_reads:
            @T.macro
            def done(h, dt, u, b, hq, pos, j):
                T.evaluate(0)
            return done
        nxt, buf = make(k + 1), None
        name = site(k, *(tirx.Var(n, d) for n, d in (("u", "float32"), ("b", "int32"), ("h", "int32"),
                                                       ("p", "int32"), ("j", "int32"))))[0]
        buf = parts[name]

        @T.macro
        def step(h, dt, u, b, hq, pos, j):
            if atomic_add is None:
                buf[h, flat(name, site(k, u, b, hq, pos, j)[1])] = buf[h, flat(name, site(k, u, b, hq, pos, j)[1])] \
                    + dt * _f32(site(k, u, b, hq, pos, j)[2])
            else:
                T.evaluate(atomic_add(buf, (h, flat(name, site(k, u, b, hq, pos, j)[1])),
                                      dt * _f32(site(k, u, b, hq, pos, j)[2])))
            nxt(h, dt, u, b, hq, pos, j)
        return step

    return make(0)


def _clear_chain(bufs: list):
    """A macro zeroing query head ``h``'s row of each buffer in ``bufs`` (a chain, as above)."""
    if not bufs:
        @T.macro
        def done(h):
            T.evaluate(0)
        return done
    nxt, buf = _clear_chain(bufs[1:]), bufs[0]

    @T.macro
    def step(h):
        for e in T.serial(buf.shape[1]):
            buf[h, e] = T.float32(0)
        nxt(h)
    return step


def _dq_partials(spec: AttentionSpec, R, NCH: int):
    """The chunked dQ strategy (``dq_chunks = NCH``): the dK/dV phase runs as ``NCH`` parallel
    chunks, each a serial run over every ``NCH``-th key tile (varlen: tile slot), adding each row
    tile's ``dS·K`` into its own slice of the workspace ``dq_workspace (NCH, *dq's shape)`` float32
    (a caller's argument: O(S) per chunk); a last phase sums the chunks into dQ. No task recomputes
    ``S`` and ``dP`` for dQ. Returns (the workspace, and the macros: zero a chunk's slice, add a
    row tile's rows, sum the chunks)."""
    D = spec.head_dim
    DQW = tirx.decl_buffer((NCH,) + tuple(R.qs), "float32", "dq_workspace", data_alignment=A)
    rows_of = 1
    for x in R.qs[:-1]:
        rows_of = rows_of * x  # dQ's rows (all but head_dim), flat
    RT = 64  # rows per task of the sum

    def at(r):  # dQ's index of flat row r, without head_dim
        out, rest = [], r
        for x in reversed(R.qs[1:-1]):
            out.append(rest % x)
            rest = rest // x
        return (rest,) + tuple(reversed(out))

    @T.macro
    def zero(W, ch):
        for r in T.serial(rows_of):
            for d in T.vectorized(D):
                W[(ch,) + at(r) + (d,)] = T.float32(0)

    @T.macro
    def rows(W, K, dS, accr, ch, b, kh, h, i0, ni, j0, nj):
        for r in T.serial(ni):  # a row's dS·K over the key tile in registers, then one add to its slice
            for d in T.vectorized(D):
                accr[d] = T.float32(0)
            for c in T.serial(nj):
                for d in T.vectorized(D):
                    accr[d] = accr[d] + dS[r, c] * wide(K[R.k(b, kh, j0 + c, d)])
            for d in T.vectorized(D):
                W[(ch,) + R.q(b, h, i0 + r, d)] = W[(ch,) + R.q(b, h, i0 + r, d)] + accr[d]

    @T.macro
    def reduce(W, DQ):
        for t in T.parallel((rows_of + RT - 1) // RT):
            with T.sblock("dq_sum"):
                vt = T.axis.spatial((rows_of + RT - 1) // RT, t)
                T.reads(W[_whole(W)])
                T.writes(DQ[_whole(DQ)])
                acc = T.sblock_alloc_buffer((D,), "float32", scope="local")
                for r in T.serial(T.min(RT, rows_of - vt * RT)):
                    for d in T.vectorized(D):
                        acc[d] = T.float32(0)
                    for ch in T.serial(NCH):
                        for d in T.vectorized(D):
                            acc[d] = acc[d] + W[(ch,) + at(vt * RT + r) + (d,)]
                    for d in T.vectorized(D):
                        DQ[at(vt * RT + r) + (d,)] = cast_to(DQ, acc[d])

    return DQW, zero, rows, reduce


def _dtensors_phase(spec: AttentionSpec, m: _ScoreMath, BN: int, BMQ: int, UP: int, macros, parts: dict):
    """The phase of the tensors' gradients (``grad_tensors``): one task per query head, over every
    sequence, row tile and key tile it sees, recomputes ``P`` and ``dT = P ∘ (dP − delta)`` and
    scatters ``dT · d score_mod / d read`` into its partials (:func:`_partials`); zeros first."""
    R, G, H, alibi, starts = m.rows, spec.group_size, spec.heads, spec.alibi, spec.kv_start
    load_tiles, products, row_deltas, _ = macros
    probe = (tirx.Var(n, d) for n, d in (("u", "float32"), ("b", "int32"), ("h", "int32"), ("p", "int32"),
                                         ("j", "int32")))
    scatter = _scatter_chain(m, parts, len(m.d_score(*probe)[2]))
    clear = _clear_chain(list(parts.values()))
    D, DV = spec.head_dim, spec.v_dim
    written = [buf[_whole(buf)] for buf in parts.values()]  # the block's writes (TVMScript has no generators)

    @T.macro
    def phase(Q, K, V, O, LSE, DO, SL, SK, KST):
        for h in T.parallel(H):
            with T.sblock("dtensors"):
                vh = T.axis.spatial(H, h)
                T.reads(Q[_whole(Q)], K[_whole(K)], V[_whole(V)], O[_whole(O)], LSE[_whole(LSE)], DO[_whole(DO)])
                T.writes(written)
                S = T.sblock_alloc_buffer((BMQ, BN), "float32", scope="local")
                dP = T.sblock_alloc_buffer((BMQ, BN), "float32", scope="local")
                dl = T.sblock_alloc_buffer((BMQ,), "float32", scope="local")
                le = T.sblock_alloc_buffer((BMQ,), "float32", scope="local")
                Kt = T.sblock_alloc_buffer((D, BN), "float32", scope="local")
                Vt = T.sblock_alloc_buffer((DV, BN), "float32", scope="local")
                dt = T.sblock_alloc_buffer((1,), "float32", scope="local")
                clear(vh)
                for b in T.serial(R.B):
                    for it in T.serial((R.len_q(b) + BMQ - 1) // BMQ):
                        ni = T.min(BMQ, R.len_q(b) - it * BMQ)
                        row_deltas(DO, O, LSE, SK, dl, le, b, vh, it * BMQ, ni)
                        for jt in T.serial(
                                m.first_key_tile(it * BMQ, b, KST[b] if starts else None, BN),
                                (m.last_key(it * BMQ + ni, b) + BN - 1) // BN):
                            load_tiles(K, V, Kt, Vt, b, vh // G, jt * BN, T.min(BN, R.len_k(b) - jt * BN))
                            for r0 in T.serial((ni + UP - 1) // UP):
                                products(Q, DO, Kt, Vt, S, dP, b, vh, it * BMQ, r0 * UP)
                            for r, c in T.grid(ni, T.min(BN, R.len_k(b) - jt * BN)):
                                dt[0] = m.prob(S[r, c], le[r], T.bool(True), it * BMQ + r, jt * BN + c,
                                               SL[vh] if alibi else None, KST[b] if starts else None, b, vh) \
                                    * (dP[r, c] - dl[r])
                                if dt[0] != T.float32(0):
                                    scatter(vh, dt[0], m._score(S[r, c], it * BMQ + r, jt * BN + c,
                                                                SL[vh] if alibi else None, b),
                                            b, vh, it * BMQ + r + m.off(b), jt * BN + c)

    return phase


def _second_pass(spec: AttentionSpec, m: _ScoreMath, BN: int, BMQ: int, PRODUCT_ROWS: int, macros):
    """The dQ phase of the second-pass strategy: one task per (sequence, head, query tile), over
    every key tile it sees, ``S`` and ``dP`` recomputed, ``dQ += dS·K`` with UR rows held in
    registers across the keys."""
    R, G, D, DV = m.rows, spec.group_size, spec.head_dim, spec.v_dim
    f32, alibi, starts, prob, grad = "float32", spec.alibi, spec.kv_start, m.prob, m.grad
    load_tiles, products, row_deltas, _ = macros
    UR = _unroll(BMQ, 4 if D <= 64 else 2)  # dQ: UR rows × D/16 vectors

    @T.macro
    def phase(Q, K, V, O, LSE, DO, SL, SK, KST, DQ):
            for task in T.parallel(R.q_tasks):
                with T.sblock("dq"):
                    vt = T.axis.spatial(R.q_tasks, task)
                    T.reads(Q[_whole(Q)], K[_whole(K)], V[_whole(V)], O[_whole(O)], LSE[_whole(LSE)], DO[_whole(DO)])
                    T.writes(DQ[_whole(DQ)])
                    S = T.sblock_alloc_buffer((BMQ, BN), f32, scope="local")
                    dP = T.sblock_alloc_buffer((BMQ, BN), f32, scope="local")
                    dl = T.sblock_alloc_buffer((BMQ,), f32, scope="local")
                    le = T.sblock_alloc_buffer((BMQ,), f32, scope="local")
                    acc_q = T.sblock_alloc_buffer((BMQ, D), f32, scope="local")
                    Kt = T.sblock_alloc_buffer((D, BN), f32, scope="local")
                    Vt = T.sblock_alloc_buffer((DV, BN), f32, scope="local")
                    seq = T.sblock_alloc_buffer((5,), "int32", scope="local")  # sequence, query head, first row
                    R.locate(seq, vt, False)
                    b = seq[0]
                    h = seq[1]
                    i0 = seq[2]
                    if i0 < R.len_q(b):
                        ni = T.min(BMQ, R.len_q(b) - i0)
                        for r, d in T.grid(BMQ, D):
                            acc_q[r, d] = T.float32(0)
                        for r, c in T.grid(BMQ, BN):
                            dP[r, c] = T.float32(0)
                        row_deltas(DO, O, LSE, SK, dl, le, b, h, i0, ni)
                        for jt in T.serial(m.first_key_tile(i0, b, KST[b] if starts else None, BN),
                                           (m.last_key(i0 + ni, b) + BN - 1) // BN):
                            j0 = jt * BN
                            nj = T.min(BN, R.len_k(b) - j0)
                            load_tiles(K, V, Kt, Vt, b, h // G, j0, nj)
                            for r0 in T.serial((ni + PRODUCT_ROWS - 1) // PRODUCT_ROWS):
                                products(Q, DO, Kt, Vt, S, dP, b, h, i0, r0 * PRODUCT_ROWS)
                            for r in T.serial(ni):
                                for c in T.vectorized(BN):  # dP becomes dS (no names bound: see above)
                                    dP[r, c] = grad(prob(S[r, c], le[r], c < nj, i0 + r, j0 + c, SL[h] if alibi else None,
                                                         KST[b] if starts else None, b, h),
                                                    dP[r, c] - dl[r], S[r, c], i0 + r, j0 + c, SL[h] if alibi else None, b, h)
                            # dQ += dS·K: UR rows held across the keys (each K row load feeds UR of them);
                            # dS rows past ni hold leftovers (their dQ rows are never stored)
                            for r0, c in T.grid(BMQ // UR, nj):
                                for rr in T.unroll(UR):
                                    for d in T.vectorized(D):
                                        acc_q[r0 * UR + rr, d] = acc_q[r0 * UR + rr, d] \
                                            + dP[r0 * UR + rr, c] * wide(K[R.k(b, h // G, j0 + c, d)])
                        for r in T.serial(ni):
                            for d in T.vectorized(D):
                                DQ[R.q(b, h, i0 + r, d)] = cast_to(DQ, acc_q[r, d])

    return phase


@fast_macros  # TVMScript macro expansion without its costly stack walk (under pytest: 75 % of
# this function's time, 46 s of a suite run), only while this generates
def backward_func(spec: AttentionSpec, block_m: int, block_n: int, block_m_dq: int, product_rows: int,
                  grad_tensors: tuple[str, ...] = (), dq_chunks: int = 0) -> tirx.PrimFunc:
    """The PrimFunc ``attention_backward(q, k, v, o, lse, do, [alibi_slopes], [sinks], [kv_start],
    [cu_seqlens_q, cu_seqlens_k], [key_lo, key_hi], [custom_mask, mask_indptr], [mod tensors...],
    dq, dk, dv, [dsinks])`` (the bracketed ones where the spec or layout takes them). BHSD: ``q,
    do, o, dq (B, H, Sq, D)`` (Dv for ``o``/``do``), ``k, dk (B, KH, Skv, D)``, ``v, dv (B, KH,
    Skv, Dv)``, ``lse (B, H, Sq)``; varlen: ``(total_q, H, D)``, ``(total_k, KH, D)``, ``lse (H,
    total_q)`` and ``cu_seqlens_q``/``cu_seqlens_k (batch + 1,)`` int32. ``lse`` is the forward's
    (natural log, ``−inf`` for a row that sees no key); ``alibi_slopes``, ``sinks``, ``dsinks
    (H,)`` float32, ``kv_start (B,)`` int32, the others as the forward's
    (``workloads.variants.ExtraParams``); with ``grad_tensors``, ``d_<name>_partials (H,
    elements)`` last (:func:`_partials`). The knobs are ``tvm_attention.backward.BackwardKnobs``';
    ``product_rows`` rows share each K/V tile row load (block_m and block_m_dq its multiples)."""
    BM, BN, BMQ, PRODUCT_ROWS = block_m, block_n, block_m_dq, product_rows
    R = ROWS[spec.layout](spec, BN, BMQ)
    m = _ScoreMath(spec, R, tuple(grad_tensors))
    parts = _partials(spec, m, tuple(grad_tensors))
    H, KH, G, D, DV = spec.heads, spec.kv_heads, spec.group_size, spec.head_dim, spec.v_dim
    f32, dt = "float32", spec.dtype  # dt: the inputs' and gradients' (bf16 rounded at the stores)
    first_row, last_row, prob, grad, row_lse = m.first_row, m.last_row, m.prob, m.grad, m.row_lse
    alibi, sinks, starts = spec.alibi, spec.sinks, spec.kv_start

    NCH = dq_chunks
    DQW, zero_partials, dq_rows, reduce_partials = _dq_partials(spec, R, NCH) if NCH else (None,) * 4
    macros = _macros(spec, BN, PRODUCT_ROWS, m)
    load_tiles, products, row_deltas, dsinks_phase = macros
    second_pass = _second_pass(spec, m, BN, BMQ, PRODUCT_ROWS, macros)
    dtensors_phase = _dtensors_phase(spec, m, BN, BMQ, PRODUCT_ROWS, macros, parts) if parts else None
    # accumulation blocking: head-dim columns of dK/dV held in registers at once
    UK, UV = _unroll(D), _unroll(DV)

    # not checked well-formed, as the forward's: tanh_fast's let variable appears in both arms of
    # exp2_fast's select, the same value bound twice
    @T.prim_func(s_tir=True, check_well_formed=False)
    def attention_backward(Q: T.Buffer(R.qs, dt), K: T.Buffer(R.ks, dt), V: T.Buffer(R.vs, dt), O: T.Buffer(R.os, dt),
                           LSE: T.Buffer(R.ls, f32), DO: T.Buffer(R.os, dt), SL: T.Buffer((H,), f32),
                           SK: T.Buffer((H,), f32), KST: T.Buffer((R.B,), "int32"), DQ: T.Buffer(R.qs, dt),
                           DK: T.Buffer(R.ks, dt), DV_: T.Buffer(R.vs, dt), DSK: T.Buffer((H,), f32)):
        T.func_attr({"global_symbol": "attention_backward", "tirx.noalias": True})
        for task in T.parallel(R.k_tasks if not NCH else NCH):  # NCH: chunks of tasks, each with its dQ partials
            with T.sblock("dkdv"):
                vt0 = T.axis.spatial(R.k_tasks if not NCH else NCH, task)
                T.reads(Q[_whole(Q)], K[_whole(K)], V[_whole(V)], O[_whole(O)], LSE[_whole(LSE)], DO[_whole(DO)])
                if NCH > 0:
                    T.writes(DK[_whole(DK)], DV_[_whole(DV_)], DQW[_whole(DQW)])
                else:
                    T.writes(DK[_whole(DK)], DV_[_whole(DV_)])
                S = T.sblock_alloc_buffer((BM, BN), f32, scope="local")
                P = T.sblock_alloc_buffer((BM, BN), f32, scope="local")
                dP = T.sblock_alloc_buffer((BM, BN), f32, scope="local")
                dl = T.sblock_alloc_buffer((BM,), f32, scope="local")
                le = T.sblock_alloc_buffer((BM,), f32, scope="local")
                acc_k = T.sblock_alloc_buffer((D, BN), f32, scope="local")  # dKᵀ, dVᵀ of the key tile
                acc_v = T.sblock_alloc_buffer((DV, BN), f32, scope="local")
                Kt = T.sblock_alloc_buffer((D, BN), f32, scope="local")
                Vt = T.sblock_alloc_buffer((DV, BN), f32, scope="local")
                seq = T.sblock_alloc_buffer((5,), "int32", scope="local")  # sequence, kv head, first key
                accr = T.sblock_alloc_buffer((D,), f32, scope="local")  # a row's dS·K over the key tile
                if NCH > 0:
                    zero_partials(DQW, vt0)
                for ti in T.serial(1 if not NCH else (R.k_tasks - vt0 + NCH - 1) // NCH):
                    vt = vt0 + ti * NCH
                    R.locate(seq, vt, True)
                    b = seq[0]
                    kh = seq[1]
                    j0 = seq[2]
                    if j0 < R.len_k(b):  # a varlen slot past its sequence's tiles computes nothing
                        nj = T.min(BN, R.len_k(b) - j0)
                        for d, c in T.grid(D, BN):
                            acc_k[d, c] = T.float32(0)
                        for d, c in T.grid(DV, BN):
                            acc_v[d, c] = T.float32(0)
                        load_tiles(K, V, Kt, Vt, b, kh, j0, nj)  # once per task: the score rows are vectors over keys
                        for g in T.serial(G):
                            for it in T.serial(first_row(j0, b) // BM, (last_row(j0 + nj, b) + BM - 1) // BM):
                                i0 = it * BM
                                ni = T.min(BM, R.len_q(b) - i0)
                                row_deltas(DO, O, LSE, SK, dl, le, b, kh * G + g, i0, ni)
                                for r0 in T.serial((ni + PRODUCT_ROWS - 1) // PRODUCT_ROWS):
                                    products(Q, DO, Kt, Vt, S, dP, b, kh * G + g, i0, r0 * PRODUCT_ROWS)
                                for r in T.serial(ni):
                                    # no names bound here: a let inside a vectorized loop is taken as one lane's
                                    for c in T.vectorized(BN):
                                        P[r, c] = prob(S[r, c], le[r], c < nj, i0 + r, j0 + c,
                                                       SL[kh * G + g] if alibi else None, KST[b] if starts else None,
                                                       b, kh * G + g)
                                    for c in T.vectorized(BN):  # dP becomes dS
                                        dP[r, c] = grad(P[r, c], dP[r, c] - dl[r], S[r, c], i0 + r, j0 + c,
                                                        SL[kh * G + g] if alibi else None, b, kh * G + g)
                                if NCH > 0:  # this chunk's dQ rows += dS·K (the dQ phase then runs no task)
                                    dq_rows(DQW, K, dP, accr, vt0, b, kh, kh * G + g, i0, ni, j0, nj)
                                # dVᵀ += dOᵀ·P, dKᵀ += Qᵀ·dS: vectors over keys, UV/UK head-dim columns held
                                # across the rows (each P/dS row load feeds that many FMAs)
                                for d0, r in T.grid(DV // UV, ni):
                                    for dd in T.unroll(UV):
                                        for c in T.vectorized(BN):
                                            acc_v[d0 * UV + dd, c] = acc_v[d0 * UV + dd, c] \
                                                + wide(DO[R.q(b, kh * G + g, i0 + r, d0 * UV + dd)]) * P[r, c]
                                for d0, r in T.grid(D // UK, ni):
                                    for dd in T.unroll(UK):
                                        for c in T.vectorized(BN):
                                            acc_k[d0 * UK + dd, c] = acc_k[d0 * UK + dd, c] \
                                                + wide(Q[R.q(b, kh * G + g, i0 + r, d0 * UK + dd)]) * dP[r, c]
                        for c, d in T.grid(nj, D):
                            DK[R.k(b, kh, j0 + c, d)] = cast_to(DK, acc_k[d, c])
                        for c, d in T.grid(nj, DV):
                            DV_[R.k(b, kh, j0 + c, d)] = cast_to(DV_, acc_v[d, c])
        if NCH == 0:  # the second pass (the chunked form's dQ is in the dK/dV phase)
            second_pass(Q, K, V, O, LSE, DO, SL, SK, KST, DQ)
        if NCH > 0:  # dQ = the chunks' partials summed
            reduce_partials(DQW, DQ)
        if sinks:  # static: a spec without sinks has no such phase (nor SK, DSK)
            dsinks_phase(O, DO, LSE, SK, DSK)
        if bool(parts):  # static: only with grad_tensors
            dtensors_phase(Q, K, V, O, LSE, DO, SL, SK, KST)

    return _with_params(attention_backward, [True] * 6 + [alibi, sinks, starts] + [True] * 3 + [sinks], 3 + sinks,
                        R.params + m.extra.params, ([DQW] if NCH else []) + list(parts.values()))


def _with_params(func: tirx.PrimFunc, keep: list[bool], n_out: int, before: list, after: list) -> tirx.PrimFunc:
    """``func`` with the parameters ``keep`` marks (the others unused), the buffers ``before``
    inserted before its ``n_out`` outputs and ``after`` appended (the tensors' partial
    gradients), its bindings checked (``ssa_checked``)."""
    params = [p for p, k in zip(func.params, keep) if k]
    params = params[:-n_out] + before + params[-n_out:] + after
    return ssa_checked(tirx.PrimFunc(params, func.body, func.ret_type, func.attrs))
