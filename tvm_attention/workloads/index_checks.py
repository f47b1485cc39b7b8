"""The exported function checks its own index arrays before it reads K or V.

Serving engines call the library from C++, without our Python loader, so the generated
function must refuse a ``block_table`` entry that is not a page, a ``cache_seqlens`` entry past
the cache, or ``cu_seqlens`` that are not monotone or do not end at the row count — as TVM's
generated argument checks refuse a wrong shape — instead of reading neighbouring memory or
faulting. The checks are a serial prologue of the CPU function, ahead of every parallel loop:
an assert inside a ``T.parallel`` loop compiles, but its failure is silently dropped there (the
loop body is outlined into a worker lambda whose return value nobody reads). A failed check
returns an error to the caller (a Python ``ValueError``, or a non-zero return code with the
message in ``TVMFFIErrorMoveFromRaised`` for C callers) whose message names the argument. TVM's
messages are constant strings, so they name the rule broken, not the index.

A kernel with left padding (``kv_start``) checks ``0 <= kv_start[b] <=`` the sequence's keys the
same way, in every layout; one with key bounds checks that ``key_lo``/``key_hi`` are non-decreasing
along the positions (what its tile skipping relies on), and a modifier's tensors that no dim is
empty; an 8-bit cache's ``k_scale``/``v_scale`` must be positive and finite, and an appending
kernel's new keys must fit the cache (and an int8 cache's hold no NaN). They are the same rules
``Layout.check_indices`` applies in the loader (one definition of what is a valid call). CUDA
kernels cannot raise from device code: there the index arrays stay trusted (CUDA builds take BHSD
only today).

Cost: one pass over ``cache_seqlens`` and the block-table entries in use (batch · pages per
sequence int32 loads), against the K/V bytes a step reads: within noise of a decode step
(``scripts/bench_index_checks.py``).
"""
from __future__ import annotations

import tvm
from tvm import tirx

from ..spec import AttentionSpec

_KIND = tvm.ir.StringImm("ValueError")


def _assert(cond, message: str) -> tirx.AssertStmt:
    # TVM 0.27's Python AssertStmt(kind, condition, ...) hands its first two arguments to the
    # FFI constructor, which takes (condition, kind, ...): pass them in the FFI's order.
    return tirx.AssertStmt(cond, _KIND, [tvm.ir.StringImm(message)])


def _for(name: str, extent, body_of) -> tirx.For:
    v = tirx.Var(name, "int32")
    return tirx.For(v, tirx.IntImm("int32", 0), extent, tirx.ForKind.SERIAL, body_of(v))


def _buffers(func: tirx.PrimFunc) -> dict[str, tirx.Buffer]:
    """The function's argument buffers by name (in TVM 0.27 a parameter is its buffer)."""
    return {p.name: p for p in func.params}


def _new(buf):
    """Keys an appending kernel adds to each sequence (``k_new``'s seq_q), else 0."""
    return buf["k_new"].shape[2] if "k_new" in buf else 0


_APPENDED = " (with append: cache_seqlens[b] + seq_q, the keys after it)"


def _kvcache(buf) -> list[tirx.Stmt]:
    cl, k = buf["CL"], buf["K"]
    max_len, new = k.shape[2], _new(buf)
    return [_for("b", cl.shape[0], lambda b: _assert(
        tirx.all(cl[b] >= 0, cl[b] + new <= max_len),
        "cache_seqlens: an entry is negative or larger than max_len (dim 2 of k_cache)"
        f"{_APPENDED if 'k_new' in buf else ''}; the kernel would reach outside the cache"))]


def _paged(buf) -> list[tirx.Stmt]:
    cl, bt, k = buf["CL"], buf["BT"], buf["K"]
    num_pages, page_size = k.shape[0], k.shape[1]
    max_pages, new = bt.shape[1], _new(buf)

    def per_sequence(b):
        pages = tirx.floordiv(cl[b] + new + page_size - 1, page_size)
        return tirx.SeqStmt([
            _assert(tirx.all(cl[b] >= 0, cl[b] + new <= max_pages * page_size),
                    "cache_seqlens: an entry is negative or larger than max_pages * page_size (the keys "
                    f"block_table can hold for a sequence){_APPENDED if 'k_new' in buf else ''}"),
            _for("j", pages, lambda j: _assert(
                tirx.all(bt[b, j] >= 0, bt[b, j] < num_pages),
                "block_table: an entry a sequence uses (j < ceil(cache_seqlens[b] / page_size)) is not a "
                "page: it must be in [0, num_pages) (dim 0 of k_pages)")),
        ])

    return [_for("b", cl.shape[0], per_sequence)]


def _varlen(buf) -> list[tirx.Stmt]:
    cq, ck, q, k = buf["CQ"], buf["CK"], buf["Q"], buf["K"]
    n1 = cq.shape[0]
    stmts = [_assert(n1 >= 1, "cu_seqlens_q: empty; it holds batch+1 offsets, starting at 0")]
    for cu, name, total, what in ((cq, "cu_seqlens_q", q.shape[0], "total_q (rows of q)"),
                                  (ck, "cu_seqlens_k", k.shape[0], "total_k (rows of k and v)")):
        stmts.append(_assert(cu[0] == 0, f"{name}: must start at 0"))
        stmts.append(_for("b", n1 - 1, lambda b, cu=cu, name=name: _assert(
            cu[b] <= cu[b + 1], f"{name}: must be non-decreasing")))
        stmts.append(_assert(cu[n1 - 1] == total, f"{name}: last entry must equal {what}"))
    return stmts


_CHECKS = {"kvcache": _kvcache, "paged": _paged, "varlen": _varlen}


def _kv_start(buf, spec: AttentionSpec) -> list[tirx.Stmt]:
    """``0 <= kv_start[b] <=`` sequence ``b``'s keys (``seq_kv``, or ``cache_seqlens[b]``)."""
    ks = buf["KST"]
    keys = (lambda b: buf["CL"][b]) if "CL" in buf else (lambda b: buf["K"].shape[2])
    what = "cache_seqlens[b]" if "CL" in buf else "seq_kv (dim 2 of k)"
    return [_for("b", ks.shape[0], lambda b: _assert(
        tirx.all(ks[b] >= 0, ks[b] <= keys(b)),
        f"kv_start: an entry is negative or larger than the sequence's keys ({what})"))]


def _key_bounds(buf, spec: AttentionSpec) -> list[tirx.Stmt]:
    """``key_lo``/``key_hi``: one row per sequence, at least one column, non-decreasing along the
    positions (a row tile skips key tiles by its first row's ``key_lo`` and last row's ``key_hi``:
    bounds that fell would hide keys a middle row sees)."""
    lo, hi = buf["key_lo"], buf["key_hi"]
    rows, n = lo.shape[0], lo.shape[1]
    stmts = [] if isinstance(n, (int, tirx.IntImm)) else [_assert(n >= 1, "key_lo: needs at least one column (positions)")]
    if "CQ" in buf:  # varlen: rows are a var of their own
        stmts.append(_assert(rows == buf["CQ"].shape[0] - 1, "key_lo: must have one row per sequence (batch)"))
    for x, name in ((lo, "key_lo"), (hi, "key_hi")):
        stmts.append(_for("b", rows, lambda b, x=x, name=name: _for("p", n - 1, lambda p: _assert(
            x[b, p] <= x[b, p + 1], f"{name}: must be non-decreasing along the positions (dim 1)"))))
    return stmts


def _mod_tensors(buf, spec: AttentionSpec) -> list[tirx.Stmt]:
    """Every dim of a modifier's tensor is at least 1 (its reads are clamped into it)."""
    out = []
    for name, _, dims in spec.mod_tensors:
        t = buf[name]
        out += [_assert(t.shape[i] >= 1, f"{name}: dim {i} is empty; a modifier's tensor needs an element")
                for i in range(len(dims)) if not isinstance(t.shape[i], (int, tirx.IntImm))]
    return out


def _kv_scales(buf, spec: AttentionSpec) -> list[tirx.Stmt]:
    """An 8-bit cache's ``k_scale``/``v_scale``: every entry positive and finite (an ordered
    compare: NaN fails it)."""
    out = []
    for name in ("k_scale", "v_scale"):
        x = buf[name]
        out.append(_for("h", x.shape[0], lambda h, x=x, name=name: _assert(
            tirx.all(x[h] > tirx.const(0.0, "float32"), x[h] <= tirx.const(3.4028234663852886e38, "float32")),
            f"{name}: an entry is not a positive finite number (zero, negative, inf or NaN); the value of a "
            "stored element is scale * stored")))
    return out


def _int8_new(buf, spec: AttentionSpec) -> list[tirx.Stmt]:
    """An int8 cache has no NaN: ``k_new``/``v_new`` must hold none (``isnan``: the simplifier
    folds the self-compare ``x == x`` to true)."""
    out = []
    for name in ("k_new", "v_new"):
        x = buf[name]
        out.append(_for("b", x.shape[0], lambda b, x=x, name=name: _for("h", x.shape[1], lambda h: _for(
            "i", x.shape[2], lambda i: _for("d", x.shape[3], lambda d: _assert(
                tirx.Not(tirx.isnan(tirx.Cast("float32", x[b, h, i, d]))),  # isnan takes no bf16
                f"{name}: holds NaN, which an int8 cache cannot store (use a float8 cache to keep it)"))))))
    return out


def with_index_checks(mod: tvm.IRModule, spec: AttentionSpec) -> tvm.IRModule:
    """``mod`` whose ``main`` first checks the layout's index arrays and the variant arguments
    (no change for a kernel without any, or a CUDA function, whose device code cannot raise)."""
    make = _CHECKS.get(spec.layout)
    if make is None and not spec.kv_start and not spec.key_bounds and not spec.mod_tensors and not spec.kv_quantized:
        return mod
    func = mod["main"]
    buf = _buffers(func)
    stmts = make(buf) if make is not None else []
    if spec.kv_start:  # after the lengths it is checked against
        stmts += _kv_start(buf, spec)
    if spec.key_bounds:
        stmts += _key_bounds(buf, spec)
    stmts += _mod_tensors(buf, spec)
    if spec.kv_quantized:
        stmts += _kv_scales(buf, spec)
    if spec.append and spec.kv_dtype == "int8":
        stmts += _int8_new(buf, spec)
    if not stmts:  # a static kernel's tensors: their shapes are checked by TVM's own argument checks
        return mod
    out = tvm.IRModule(dict(mod.functions))
    out["main"] = func.with_body(tirx.SeqStmt([*stmts, func.body]))
    return out
