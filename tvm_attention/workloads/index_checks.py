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
``Layout.check_indices`` applies in the loader (one definition of what is a valid call: the rule
functions below serve both the host asserts and the device check).

CUDA kernels cannot raise from device code: their index arrays are trusted unless the build
sets ``spec.device_checks``; then :func:`with_device_index_checks` prepends a check kernel that
applies the same rules and writes a bitmask (``layouts.INDEX_ERROR_BITS``) to a last output
``index_error (1,) int32``, and guards every attention kernel with ``index_error[0] == 0``
(docs/cuda.md#index-checks-on-the-device).

Cost: one pass over ``cache_seqlens`` and the block-table entries in use (batch · pages per
sequence int32 loads), against the K/V bytes a step reads: within noise of a decode step
(``scripts/bench_index_checks.py``).
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.script import tirx as T

from ..layouts import (INDEX_ERROR_ARG, INDEX_ERROR_BITS, KV_NEW_ARGS, LATENT_NEW_ARGS, has_index_arrays,
                       kv_scale_names)
from ..spec import MAX_SEQ_LEN, AttentionSpec
from ..tvm_internals import fast_macros

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


# -- the rules: one definition of a valid call, for the host asserts and the device check ------
# Each returns a boolean PrimExpr that holds for a valid entry (``Layout.check_indices`` is the
# same rules in NumPy, for the loader). A call-time value is any int32, 2**31 - 1 and -2**31
# included: a rule never adds or multiplies two of them in int32. Sums and products are taken in
# int64, where two int32 terms (or an int32 times a compiled-in page size) cannot overflow
# (docs/artifact_checks.md lists each expression).

def _i64(x):
    return x if isinstance(x, int) else tirx.Cast("int64", x)


def key_capacity(max_keys):
    """The keys a sequence may hold, int64: ``max_keys`` (kvcache ``max_len``; paged
    ``int64(max_pages) * page_size``, which may pass 2**31), at most ``MAX_SEQ_LEN``."""
    return tirx.min(_i64(max_keys), tirx.IntImm("int64", MAX_SEQ_LEN))


def paged_capacity(max_pages, page_size: int):
    """``max_pages * page_size`` in int64 (max_pages a call-time dim up to 2**31 - 1)."""
    return _i64(max_pages) * tirx.IntImm("int64", page_size)


def cache_len_ok(cl_b, new, capacity):
    """``cache_seqlens[b]`` (``cl_b``): ``0 <= cl_b`` and ``cl_b + new <= key_capacity(capacity)``
    (``new``: the keys an appending kernel adds, its ``seq_q``), the sum in int64."""
    return tirx.all(cl_b >= 0, _i64(cl_b) + _i64(new) <= key_capacity(capacity))


def pages_in_use(cl_b, new, page_size):
    """The ``block_table`` entries sequence ``b`` reads: ``ceil((cl_b + new) / page_size)``, in
    int64 and then int32: read only where :func:`cache_len_ok` holds, which bounds it by
    ``max_pages``."""
    return tirx.Cast("int32", tirx.floordiv(_i64(cl_b) + _i64(new) + (page_size - 1), page_size))


def page_ok(page, num_pages):
    """A ``block_table`` entry in use: a page, ``0 <= page < num_pages``."""
    return tirx.all(page >= 0, page < num_pages)


def cu_step_ok(cu, b):
    """``cu_seqlens``: non-decreasing at ``b`` (a compare: no difference is formed)."""
    return cu[b] <= cu[b + 1]


def kv_start_ok(ks_b, keys):
    """``0 <= kv_start[b] <= keys`` (the sequence's keys: an int64 expression, e.g. ``cl_b + new``)."""
    return tirx.all(ks_b >= 0, _i64(ks_b) <= keys)


#: the first new-keys argument of an appending kernel, per kind of cache (``layouts``' tables:
#: their dims say which axis is seq_q)
_NEW_ARGS = (KV_NEW_ARGS[0], LATENT_NEW_ARGS[0])


def _appends(buf) -> bool:
    """Whether the kernel appends the call's new keys (``k_new``; a latent layout's ``kv_new``)."""
    return any(a.name in buf for a in _NEW_ARGS)


def _new(buf):
    """Keys an appending kernel adds to each sequence (its new keys' seq_q), else 0."""
    for a in _NEW_ARGS:
        if a.name in buf:
            return buf[a.name].shape[a.dims.index("seq_q")]
    return 0


_APPENDED = " (with append: cache_seqlens[b] + seq_q, the keys after it)"
_LONGEST = f", or than {MAX_SEQ_LEN} (2**30 keys, the longest sequence a kernel takes)"


def _kvcache(buf, layout) -> list[tirx.Stmt]:
    cl, k = buf["CL"], buf["K"]
    axis = layout.capacity_axis  # K's dim that holds a sequence's keys (max_len)
    max_len, new = k.shape[axis], _new(buf)
    return [_for("b", cl.shape[0], lambda b: _assert(
        cache_len_ok(cl[b], new, max_len),
        f"cache_seqlens: an entry is negative or larger than {layout.capacity_dim} (dim {axis} of {layout.kv_names[0]})"
        f"{_APPENDED if _appends(buf) else ''}; the kernel would reach outside the cache"))]


def _paged(buf, layout) -> list[tirx.Stmt]:
    cl, bt, k = buf["CL"], buf["BT"], buf["K"]
    num_pages, page_size = k.shape[0], k.shape[1]
    max_pages, new = bt.shape[1], _new(buf)
    appended = " + seq_q" if _appends(buf) else ""

    def per_sequence(b):
        pages = pages_in_use(cl[b], new, page_size)
        return tirx.SeqStmt([
            _assert(cache_len_ok(cl[b], new, paged_capacity(max_pages, int(page_size))),
                    "cache_seqlens: an entry is negative or larger than max_pages * page_size (the keys "
                    f"block_table can hold for a sequence){_LONGEST}{_APPENDED if _appends(buf) else ''}"),
            _for("j", pages, lambda j: _assert(
                page_ok(bt[b, j], num_pages),
                f"block_table: an entry a sequence uses (j < ceil((cache_seqlens[b]{appended}) / page_size)) is "
                f"not a page: it must be in [0, num_pages) (dim 0 of {layout.kv_names[0]})")),
        ])

    return [_for("b", cl.shape[0], per_sequence)]


def _varlen(buf, layout) -> list[tirx.Stmt]:
    cq, ck, q, k = buf["CQ"], buf["CK"], buf["Q"], buf["K"]
    n1 = cq.shape[0]
    stmts = [_assert(n1 >= 1, "cu_seqlens_q: empty; it holds batch+1 offsets, starting at 0")]
    for cu, name, total, what in ((cq, "cu_seqlens_q", q.shape[0], "total_q (rows of q)"),
                                  (ck, "cu_seqlens_k", k.shape[0], "total_k (rows of k and v)")):
        stmts.append(_assert(cu[0] == 0, f"{name}: must start at 0"))
        stmts.append(_for("b", n1 - 1, lambda b, cu=cu, name=name: _assert(
            cu_step_ok(cu, b), f"{name}: must be non-decreasing")))
        stmts.append(_assert(cu[n1 - 1] == total, f"{name}: last entry must equal {what}"))
    return stmts


#: a layout entry's ``index_checks`` (the rules its index arrays obey) -> the host asserts of them
_CHECKS = {("cache_seqlens",): _kvcache, ("cache_seqlens", "block_table"): _paged, ("cu_seqlens",): _varlen}


def _kv_start(buf, spec: AttentionSpec) -> list[tirx.Stmt]:
    """``0 <= kv_start[b] <=`` sequence ``b``'s keys (``seq_kv``, or ``cache_seqlens[b]`` plus an
    appending kernel's new keys: the keys its rows attend to, as the loader counts them), in int64."""
    ks, new = buf["KST"], _new(buf)
    keys = (lambda b: _i64(buf["CL"][b]) + _i64(new)) if "CL" in buf else (lambda b: _i64(buf["K"].shape[2]))
    what = ("cache_seqlens[b]" + (" + seq_q" if _appends(buf) else "")) if "CL" in buf else "seq_kv (dim 2 of k)"
    return [_for("b", ks.shape[0], lambda b: _assert(
        kv_start_ok(ks[b], keys(b)),
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


def _custom_mask(buf, spec: AttentionSpec) -> list[tirx.Stmt]:
    """``mask_indptr``: ``batch + 1`` entries; sequence ``b`` holds bytes from ``mask_indptr[b] >=
    0``, at least ``ceil(rows_b · keys_b / 8)`` of them (its query rows and keys: ``seq_q`` and
    ``seq_kv``, ``cache_seqlens[b]`` plus an appending kernel's new keys, varlen's
    ``cu_seqlens``), ending within ``custom_mask``; the sizes in int64 (a product of two call-time
    lengths passes 2**31). After the layout's own rules: the lengths are valid by then."""
    cm, mi, q = buf["custom_mask"], buf["mask_indptr"], buf["Q"]
    if "CQ" in buf:
        cq, ck = buf["CQ"], buf["CK"]
        batch = cq.shape[0] - 1
        rows, keys = (lambda b: cq[b + 1] - cq[b]), (lambda b: ck[b + 1] - ck[b])
    elif "CL" in buf:
        batch, new = buf["CL"].shape[0], _new(buf)
        rows, keys = (lambda b: q.shape[2]), (lambda b: _i64(buf["CL"][b]) + _i64(new))
    else:
        batch = q.shape[0]
        rows, keys = (lambda b: q.shape[2]), (lambda b: buf["K"].shape[2])

    def ok(b):
        need = (_i64(rows(b)) * _i64(keys(b)) + tirx.const(7, "int64")) // tirx.const(8, "int64")
        return tirx.all(mi[b] >= 0, _i64(mi[b + 1]) - _i64(mi[b]) >= need, _i64(mi[b + 1]) <= _i64(cm.shape[0]))

    return [_assert(mi.shape[0] == batch + 1, "mask_indptr: must hold batch + 1 entries (each sequence's first "
                                              "byte of custom_mask, then the end)"),
            _for("b", batch, lambda b: _assert(
                ok(b), "mask_indptr: a sequence's bytes [mask_indptr[b], mask_indptr[b + 1]) start below 0, end past "
                       "custom_mask or hold fewer than ceil(rows * keys / 8) (FlashInfer's packed bits: "
                       "tvm_attention.masks.pack_mask)"))]


def _mod_tensors(buf, spec: AttentionSpec) -> list[tirx.Stmt]:
    """Every dim of a modifier's tensor is at least 1 (its reads are clamped into it)."""
    out = []
    for name, _, dims in spec.mod_tensors:
        t = buf[name]
        out += [_assert(t.shape[i] >= 1, f"{name}: dim {i} is empty; a modifier's tensor needs an element")
                for i in range(len(dims)) if not isinstance(t.shape[i], (int, tirx.IntImm))]
    return out


def scale_ok(x):
    """An 8-bit cache's ``k_scale``/``v_scale`` entry: positive and finite (an ordered compare:
    NaN fails it)."""
    return tirx.all(x > tirx.const(0.0, "float32"), x <= tirx.const(3.4028234663852886e38, "float32"))


def _kv_scales(buf, spec: AttentionSpec) -> list[tirx.Stmt]:
    """An 8-bit cache's ``k_scale``/``v_scale``: every entry positive and finite (:func:`scale_ok`)."""
    out = []
    for name in kv_scale_names(spec):  # a latent cache's one kv_scale
        x = buf[name]
        out.append(_for("h", x.shape[0], lambda h, x=x, name=name: _assert(
            scale_ok(x[h]),
            f"{name}: an entry is not a positive finite number (zero, negative, inf or NaN); the value of a "
            "stored element is scale * stored")))
    return out


def _int8_new(buf, spec: AttentionSpec) -> list[tirx.Stmt]:
    """An int8 cache has no NaN: ``k_new``/``v_new`` must hold none (``isnan``: the simplifier
    folds the self-compare ``x == x`` to true)."""
    def every(x, body, idx=()):  # loops over every element of x (k_new's four dims, kv_new's three)
        if len(idx) == len(x.shape):
            return body(idx)
        return _for("bhid"[len(idx)] if len(x.shape) == 4 else "bid"[len(idx)], x.shape[len(idx)],
                    lambda v: every(x, body, idx + (v,)))

    out = []
    for name in ("kv_new",) if spec.layout_info.latent else ("k_new", "v_new"):
        x = buf[name]
        out.append(every(x, lambda idx, x=x, name=name: _assert(
            tirx.Not(tirx.isnan(tirx.Cast("float32", x[idx]))),  # isnan takes no bf16
            f"{name}: holds NaN, which an int8 cache cannot store (use a float8 cache to keep it)")))
    return out


def with_index_checks(mod: tvm.IRModule, spec: AttentionSpec) -> tvm.IRModule:
    """``mod`` whose ``main`` first checks the layout's index arrays and the variant arguments
    (no change for a kernel without any, or a CUDA function, whose device code cannot raise)."""
    layout = spec.layout_info
    if layout.index_checks and layout.index_checks not in _CHECKS:
        raise ValueError(f"layout {layout.name}: no host asserts for the index rules {layout.index_checks} "
                         f"(known: {', '.join(map(str, _CHECKS))})")
    make = _CHECKS.get(layout.index_checks)
    if make is None and not (spec.kv_start or spec.key_bounds or spec.custom_mask or spec.mod_tensors
                             or spec.kv_quantized):
        return mod
    func = mod["main"]
    buf = _buffers(func)
    stmts = make(buf, layout) if make is not None else []
    if spec.kv_start:  # after the lengths it is checked against
        stmts += _kv_start(buf, spec)
    if spec.key_bounds:
        stmts += _key_bounds(buf, spec)
    if spec.custom_mask:
        stmts += _custom_mask(buf, spec)
    stmts += _mod_tensors(buf, spec)
    if spec.kv_quantized and spec.kv_scale == "head":  # finer scales are data (quant.py): never past a length
        stmts += _kv_scales(buf, spec)
    if spec.append and spec.kv_dtype == "int8":
        stmts += _int8_new(buf, spec)
    if not stmts:  # a static kernel's tensors: their shapes are checked by TVM's own argument checks
        return mod
    out = tvm.IRModule(dict(mod.functions))
    out["main"] = func.with_body(tirx.SeqStmt([*stmts, func.body]))
    return out


# -- device-side checks (CUDA builds, ``spec.device_checks``) ------------------------------------

#: threads of the check kernel's one block: each takes every 256th sequence (block-table entry)
CHECK_THREADS = 256
#: A pointer's low bits, on the device: the host function cannot test them (TVM's host code
#: assumes its buffers aligned, so LLVM folds such a test away), the kernel's raw pointers can
_MISALIGNED16 = r"""
__device__ __forceinline__ int attn_misaligned16(const void* p) {
  return (int)(reinterpret_cast<unsigned long long>(p) & 15ull) != 0;
}"""
#: ``index_error``'s bits by argument name (``layouts.INDEX_ERROR_BITS`` is the table)
BITS = {name: bit for bit, (name, _) in INDEX_ERROR_BITS.items()}


def _device_buffers(func: tirx.PrimFunc, spec: AttentionSpec) -> dict[str, tirx.Buffer]:
    """The kernel's argument buffers by their call names (``q``, ``cache_seqlens``, ...): the
    CUDA kernels name their buffers apart from the CPU ones (``CS``, ``KS``), so by position in
    the layout's call order, ``index_error`` not yet among them."""
    names = [a.name for a in spec.layout_info.all_args(spec) if a.name != INDEX_ERROR_ARG.name]
    if len(names) != len(func.params):
        raise ValueError(f"device index checks: the kernel takes {len(func.params)} arguments "
                         f"({', '.join(p.name for p in func.params)}), its layout {len(names)} ({', '.join(names)})")
    return dict(zip(names, func.params))


def _mask_scan(buf: dict, keys, bit, steps, mine):
    """The check kernel's macro ``scan(reg, tx)`` of a custom mask's ``mask_indptr`` (bit 512):
    its ``batch + 1`` entries exist (else the scan would read past them), then each sequence's
    bytes hold its rows × keys bits, the host rule's (:func:`_custom_mask`) in int64; ``keys(b)``
    a KV cache's or bhsd's keys (varlen: from ``cu_seqlens``), the others ``_check_kernel``'s."""
    NT = CHECK_THREADS
    CQ, CK, CL, MI, CMK = (buf.get(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "cache_seqlens", "mask_indptr",
                                                 "custom_mask"))
    n = CQ.shape[0] - 1 if CQ is not None else CL.shape[0] if CL is not None else buf["q"].shape[0]

    def ok(b):
        rows = _i64(CQ[b + 1]) - _i64(CQ[b]) if CQ is not None else _i64(buf["q"].shape[2])
        keys_b = _i64(CK[b + 1]) - _i64(CK[b]) if CQ is not None else keys(b)
        need = (rows * keys_b + tirx.const(7, "int64")) // tirx.const(8, "int64")
        return tirx.all(MI[b] >= 0, _i64(MI[b + 1]) - _i64(MI[b]) >= need, _i64(MI[b + 1]) <= _i64(CMK.shape[0]))

    @T.macro
    def scan(reg, tx):
        if MI.shape[0] != n + 1:
            if tx == 0:
                reg[tx] = T.bitwise_or(reg[tx], BITS["mask_indptr"])
        else:
            for i in T.serial(steps(n)):
                if mine(i, tx, n):
                    reg[tx] = T.bitwise_or(reg[tx], bit(ok(i * NT + tx), "mask_indptr"))

    return scan


def _check_kernel(spec: AttentionSpec, buf: dict, err, emulate: bool) -> tirx.Stmt:
    """One thread block of ``CHECK_THREADS`` threads: thread ``tx`` ORs the bits of the rules
    broken by the entries it takes (every ``CHECK_THREADS``-th sequence, cu_seqlens step or
    block-table entry) into a register, a shared-memory tree ORs the block's, and thread 0
    writes ``err[0]`` (always: 0 for a valid call, so callers need not clear it). Emulated:
    serial loops, the shared array in global memory."""
    NT = CHECK_THREADS
    thread = (lambda n: T.serial(n)) if emulate else (lambda n: T.thread_binding(n, thread="threadIdx.x"))
    block = (lambda n: T.serial(n)) if emulate else (lambda n: T.thread_binding(n, thread="blockIdx.x"))
    red_scope = "global" if emulate else "shared"
    rules = spec.layout_info.index_checks  # the layout's index arrays' rules
    varlen = "cu_seqlens" in rules
    cache = "cache_seqlens" in rules
    paged = "block_table" in rules
    CQ, CK = buf.get("cu_seqlens_q"), buf.get("cu_seqlens_k")
    CL, BT, KS = buf.get("cache_seqlens"), buf.get("block_table"), buf.get("kv_start")
    KSC, VSC = buf.get("k_scale"), buf.get("v_scale")  # an 8-bit cache's scales (kv_heads,)
    QSC = buf.get("q_scale")  # fp8 queries' scales (heads,)
    MI = buf.get("mask_indptr")  # a custom mask's: each sequence's first byte
    new = _new(buf)
    K = buf[spec.layout_info.kv_names[0]]
    if varlen:
        N1, TQ, TK = CQ.shape[0], buf["q"].shape[0], K.shape[0]
    if cache:
        B = CL.shape[0]
        cap = (K.shape[spec.layout_info.capacity_axis] if not paged  # max_len; max_pages * page_size
               else paged_capacity(BT.shape[1], int(K.shape[1])))
    if paged:
        MP, NP, PS = BT.shape[1], K.shape[0], K.shape[1]
    if KS is not None:
        NB = KS.shape[0]

    def in_use(b, j):  # entry j of sequence b is read (its cache_seqlens valid, j < its pages)
        return T.And(cache_len_ok(CL[b], new, cap), j < pages_in_use(CL[b], new, PS))

    def judged(b):  # kv_start is checked against a valid length (else bit 4 alone, as on the host)
        return cache_len_ok(CL[b], new, cap) if cache else T.bool(True)

    def keys(b):  # the sequence's keys kv_start is checked against (the host rule's), int64
        return _i64(CL[b]) + _i64(new) if cache else _i64(buf["k"].shape[2])

    def bit(ok, name):
        return T.Select(ok, T.int32(0), T.int32(BITS[name]))

    def steps(n):  # iterations for a thread to take every NT-th of n items (n up to 2**31 - 1: no n + NT)
        return T.truncdiv(n, NT) + T.Select(T.truncmod(n, NT) > 0, 1, 0)

    def mine(i, tx, n):  # item i * NT + tx exists (written n - i * NT: i * NT <= n - 1, nothing overflows)
        return tx < n - i * NT

    mask_scan = None if MI is None else _mask_scan(buf, keys, bit, steps, mine)

    # the tensors read or written 16 bytes at a time (cp.async, vector loads): q, k, v, o
    vectors = [buf[a.name] for a in spec.layout_info.all_args(spec)[:3]] + [buf[spec.layout_info.output.name]]

    def alignment_bit():  # when one's data does not start on a 16-byte boundary (a pointer's bits)
        mis = T.int32(0)
        for x in vectors:
            mis = T.bitwise_or(mis, T.cuda.func_call("attn_misaligned16", x.access_ptr("r"),
                                                     source_code=_MISALIGNED16, return_type="int32"))
        return T.Select(mis != 0, T.int32(BITS["alignment"]), T.int32(0))

    @T.macro
    def scan(reg, tx):
        reg[tx] = 0
        if varlen:
            if tx == 0:
                if N1 < 1:  # no offsets at all: nothing to read
                    reg[tx] = BITS["cu_seqlens_q"] | BITS["cu_seqlens_k"]
                else:
                    reg[tx] = T.bitwise_or(T.bitwise_or(bit(CQ[0] == 0, "cu_seqlens_q"), bit(CK[0] == 0, "cu_seqlens_k")),
                                           T.bitwise_or(bit(CQ[N1 - 1] == TQ, "cu_seqlens_q"),
                                                        bit(CK[N1 - 1] == TK, "cu_seqlens_k")))
            for i in T.serial(steps(N1 - 1)):
                if mine(i, tx, N1 - 1):
                    reg[tx] = T.bitwise_or(reg[tx], T.bitwise_or(bit(cu_step_ok(CQ, i * NT + tx), "cu_seqlens_q"),
                                                                 bit(cu_step_ok(CK, i * NT + tx), "cu_seqlens_k")))
        if cache:
            for i in T.serial(steps(B)):
                if mine(i, tx, B):
                    reg[tx] = T.bitwise_or(reg[tx], bit(cache_len_ok(CL[i * NT + tx], new, cap), "cache_seqlens"))
        if paged:
            # flat over the (batch, max_pages) table: entry j of sequence b is read iff j < its pages
            # (a sequence whose cache_seqlens is broken has bit 4 alone: its entries are not judged,
            # as the host asserts stop at the first broken rule)
            # (truncdiv: the flat index is non-negative, and C's / needs no floor fix-up)
            for i in T.serial(steps(B * MP)):
                if mine(i, tx, B * MP):
                    reg[tx] = T.bitwise_or(reg[tx], bit(T.Or(T.Not(in_use(T.truncdiv(i * NT + tx, MP),
                                                                          T.truncmod(i * NT + tx, MP))),
                                                             page_ok(BT[T.truncdiv(i * NT + tx, MP),
                                                                        T.truncmod(i * NT + tx, MP)], NP)),
                                                        "block_table"))
        if KSC is not None:
            for i in T.serial(steps(spec.kv_heads)):
                if mine(i, tx, spec.kv_heads):
                    reg[tx] = T.bitwise_or(reg[tx], T.bitwise_or(bit(scale_ok(KSC[i * NT + tx]), "k_scale"),
                                                                 bit(scale_ok(VSC[i * NT + tx]), "v_scale")))
        if MI is not None:
            mask_scan(reg, tx)
        if QSC is not None:
            for i in T.serial(steps(spec.heads)):
                if mine(i, tx, spec.heads):
                    reg[tx] = T.bitwise_or(reg[tx], bit(scale_ok(QSC[i * NT + tx]), "q_scale"))
        if KS is not None:
            for i in T.serial(steps(NB)):
                if mine(i, tx, NB):
                    reg[tx] = T.bitwise_or(reg[tx], bit(T.Or(T.Not(judged(i * NT + tx)),
                                                             kv_start_ok(KS[i * NT + tx], keys(i * NT + tx))),
                                                        "kv_start"))
        if not emulate:  # (emulated, the pointers are the CPU's own)
            if tx == 0:
                reg[tx] = T.bitwise_or(reg[tx], alignment_bit())

    @T.prim_func(s_tir=True, check_well_formed=False)
    def check():
        for bx in block(1):
            with T.sblock("index_check"):
                T.reads()
                T.writes()
                red = T.sblock_alloc_buffer((NT,), "int32", scope=red_scope)  # the block's bits
                reg = T.sblock_alloc_buffer((NT,), "int32", scope="local")  # a register per thread
                for tx in thread(NT):
                    with T.sblock("index_scan"):
                        T.reads()
                        T.writes()
                        scan(reg, tx)
                        red[tx] = reg[tx]
                for step in T.serial(8):  # log2(NT) halvings; TVM puts a barrier between them
                    for tx in thread(NT):
                        with T.sblock("index_or"):
                            T.reads()
                            T.writes()
                            if tx < T.shift_right(NT // 2, step):
                                red[tx] = T.bitwise_or(red[tx], red[tx + T.shift_right(NT // 2, step)])
                for tx in thread(NT):
                    with T.sblock("index_store"):
                        T.reads()
                        T.writes()
                        if tx == 0:
                            err[0] = red[0]

    body = check.body
    if isinstance(body, s_tir.SBlockRealize):  # the parser's implicit root block
        body = body.block.body
    return body


def _grid_loop(stmt, emulate: bool) -> bool:
    """Whether ``stmt`` is a loop of a kernel's grid: bound to ``blockIdx.*`` (emulated: any
    loop, the grid being the serial loops a kernel's nest starts with)."""
    if not isinstance(stmt, tirx.For):
        return False
    if emulate:
        return True
    tb = stmt.thread_binding
    return tb is not None and str(tb.thread_tag).startswith("blockIdx.")


def _guard(stmt, cond, emulate: bool, found: list) -> tirx.Stmt:
    """``stmt`` with the body under each outermost grid-loop nest (one per kernel) run only when
    ``cond`` holds: the condition is inside each kernel, around what every thread block does
    (TVM's sync insertion refuses a condition around a launch)."""
    if _grid_loop(stmt, emulate):
        loops = [stmt]
        while _grid_loop(loops[-1].body, emulate):
            loops.append(loops[-1].body)
        found.append(loops[0].loop_var.name)
        inner = tirx.IfThenElse(cond, loops[-1].body, None)
        for loop in reversed(loops):
            inner = tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, inner, loop.thread_binding,
                             loop.annotations)
        return inner
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([_guard(s, cond, emulate, found) for s in stmt.seq])
    if isinstance(stmt, s_tir.SBlockRealize):
        blk = stmt.block
        new = s_tir.SBlock(blk.iter_vars, blk.reads, blk.writes, blk.name_hint, _guard(blk.body, cond, emulate, found),
                           blk.init, blk.alloc_buffers, blk.match_buffers, blk.annotations)
        return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, new)
    if isinstance(stmt, tirx.For):  # a loop around launches (none today): the kernels are inside
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, _guard(stmt.body, cond, emulate, found),
                        stmt.thread_binding, stmt.annotations)
    if isinstance(stmt, tirx.IfThenElse):
        return tirx.IfThenElse(stmt.condition, _guard(stmt.then_case, cond, emulate, found),
                               None if stmt.else_case is None else _guard(stmt.else_case, cond, emulate, found))
    if isinstance(stmt, tirx.AttrStmt):
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, _guard(stmt.body, cond, emulate, found))
    return stmt


@fast_macros  # TVMScript macro expansion without its costly stack walk, only while this generates
def with_device_index_checks(mod: tvm.IRModule, spec: AttentionSpec, emulate: bool = False) -> tvm.IRModule:
    """``mod`` (a CUDA kernel's module, scheduled, before lowering; or its ``emulate=True`` form,
    which builds for the CPU) whose ``main`` takes one more argument, last: ``index_error (1,)
    int32``, and first runs a check kernel (:func:`_check_kernel`: the host asserts' rules, each
    broken one a bit of :data:`layouts.INDEX_ERROR_BITS`) that writes it; every following kernel
    (any number: each outermost ``blockIdx`` loop nest) does nothing unless ``index_error[0]`` is
    0. Kernels on one stream run in order, so they see the check kernel's write. ``spec``: one
    whose kernel takes index arrays (:func:`layouts.has_index_arrays`)."""
    if not has_index_arrays(spec):
        raise ValueError(f"device index checks: {spec.short_name()} takes no index array (bhsd without kv_start)")
    func = mod["main"]
    buf = _device_buffers(func, spec)
    err = tirx.decl_buffer((1,), "int32", INDEX_ERROR_ARG.name)
    found: list = []
    ok = tirx.EQ(tirx.BufferLoad(err, [tirx.IntImm("int32", 0)]), tirx.IntImm("int32", 0))
    # the same value in every thread of a block: marked so, TVM's sync insertion places the
    # kernels' barriers inside the condition (it refuses to under a thread-dependent one)
    cond = ok if emulate else T.tvm_thread_invariant(ok)
    body = _guard(func.body, cond, emulate, found)
    if not found:
        raise ValueError("device index checks: no kernel (blockIdx-bound loop nest) found in main to guard")
    check = _check_kernel(spec, buf, err, emulate)
    if isinstance(body, s_tir.SBlockRealize):  # the root block: the check kernel first in it
        blk = body.block
        blk = s_tir.SBlock(blk.iter_vars, blk.reads, blk.writes, blk.name_hint, tirx.SeqStmt([check, blk.body]),
                           blk.init, blk.alloc_buffers, blk.match_buffers, blk.annotations)
        body = s_tir.SBlockRealize(body.iter_values, body.predicate, blk)
    else:
        body = tirx.SeqStmt([check, body])
    out = tvm.IRModule(dict(mod.functions))
    out["main"] = tirx.PrimFunc([*func.params, err], body, func.ret_type, func.attrs).with_attr("attn.index_error", 1)
    return out
