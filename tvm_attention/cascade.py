"""A prefix shared by many sequences, read once (cascade attention, issue 45 item 4).

Sequences that share a prompt (parallel sampling, beam search, one system prompt) each attend to
the same prefix keys and then to their own suffix. Attention over ``prefix ∪ suffix`` is the merge
of the two partial states (:func:`tvm_attention.merge.merge_states`), so:

1. **the prefix, once**: the queries of all ``N`` sequences are stacked as the rows of one
   sequence, the query heads of each kv head's group beside each other (row ``(n·Sq + s)·G + g``
   of kv head ``kh`` is position ``s`` of sequence ``n``, query head ``kh·G + g``), and one kernel
   of ``kv_heads`` heads attends them to the prefix, non-causal (every prefix key precedes every
   query), returning lse: each prefix key tile is read once per row tile of ``N·Sq·G`` rows;
2. **the suffixes**: the caller's kernel (kvcache or paged, ``return_lse``) over each sequence's
   own keys, causal bottom-right as usual;
3. the two states merged per row (a sink joins the merged denominator once).

**Positions.** Query ``s`` of sequence ``n`` sits at ``p = P + L_n − Sq + s`` (``P`` prefix keys,
``L_n`` the suffix's ``cache_seqlens``; with ``append``, ``p = P + L_n + s``), prefix key ``j`` at
``j`` and suffix key ``j`` at ``P + j``: the serving spec's variants keep their meaning over the
whole sequence. In the prefix pass the rows do not rise with their positions, so:

* what hides keys (the window, ``kv_start``, the key bounds, a custom mask) is computed here, on
  the host, into the prefix kernel's custom-mask bits: a key tile no stacked row sees is skipped;
* ALiBi and the user's modifiers become the prefix kernel's own modifiers, which read each
  stacked row's sequence, query head and position from tensors (``cascade_seq``,
  ``cascade_pos``, ``cascade_off``, ``cascade_slopes``) by the row ``q_idx − cascade_off[0]``;
* the suffix kernel shifts what is not shift-invariant by ``P``: ``kv_start − P``, the key
  bounds, the custom mask's suffix columns, and its modifiers' ``q_idx``/``kv_idx`` (read from
  ``cascade_prefix``). The window and ALiBi depend on ``p − j`` only and stay as they are.

:func:`prefix_spec` and :func:`suffix_spec` give the two kernels' specs from the serving spec;
:func:`attend` runs them.
"""
from __future__ import annotations

import ast
import dataclasses
import sys
import textwrap
import types
from typing import Any

import numpy as np

from . import modifiers
from .errors import SpecError
from .layouts import KernelArgumentError, check_variant_arrays
from .masks import pack_mask, unpack_mask
from .merge import merge_states
from .spec import MAX_SEQ_LEN, AttentionSpec
from .visibility import Visibility

#: the prefix of every name this module adds to a modifier or its tensors (the user's may not use it)
_NS = "cascade_"
_I32 = np.iinfo(np.int32)


def _check(spec: AttentionSpec) -> None:
    if spec.layout not in ("kvcache", "paged"):
        raise SpecError(f"cascade: the suffixes live in a kvcache or paged cache, not layout {spec.layout!r}")
    clash = [n for n, _, _ in spec.mod_tensors if n.startswith(_NS)]
    for kind in ("score_mod", "mask_mod"):
        src = getattr(spec, kind)
        if src is not None:
            clash += [x.id for x in ast.walk(ast.parse(src)) if isinstance(x, ast.Name) and x.id.startswith(_NS)]
            clash += [x.arg for x in ast.walk(ast.parse(src)) if isinstance(x, ast.arg) and x.arg.startswith(_NS)]
    if clash:
        raise SpecError(f"cascade: {clash[0]!r}: names starting with {_NS!r} are the cascade's own (its modifiers' "
                        "tensors); rename it")


def _hides_keys(spec: AttentionSpec) -> bool:
    """Whether a prefix key may be hidden from a row (left window, ``kv_start``, key bounds, a custom
    mask): then the prefix kernel takes custom-mask bits. Causal and a right window never hide
    a prefix key: every one precedes every query."""
    left = spec.window[0] if spec.window is not None else -1
    return left >= 0 or spec.kv_start or spec.key_bounds or spec.custom_mask


def _rebound(src: str | None, kind: str, pre: list[str], binds: list[str], tail: str) -> str | None:
    """A modifier of ``kind`` over parameters ``cascade_{score,}b, h, q, kv`` that runs ``pre``,
    binds the user's parameters (``src``'s own names) to ``binds``, then the user's body; without
    ``src``, ``pre`` and ``return tail``."""
    params = ["cascade_s"] * (kind == "score_mod") + ["cascade_b", "cascade_h", "cascade_q", "cascade_kv"]
    lines = list(pre)
    if src is None:
        lines.append(f"return {tail}")
    else:
        node = modifiers._function_node(src, kind)
        body = node.body if isinstance(node, ast.FunctionDef) else [ast.Return(node.body)]
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        lines += [f"{a.arg} = {e}" for a, e in zip(node.args.args, binds)] + [ast.unparse(s) for s in body]
    return f"def {_NS}{kind}({', '.join(params)}):\n" + textwrap.indent("\n".join(lines), "    ")


def _prefix_modifiers(spec: AttentionSpec) -> tuple[str | None, str | None, tuple]:
    """The prefix kernel's ``(score_mod, mask_mod, mod_tensors)``: ALiBi and the user's modifiers
    over each stacked row's own sequence, query head and position."""
    if not (spec.alibi or spec.score_mod or spec.mask_mod):
        return None, None, spec.mod_tensors
    g = spec.group_size
    pre = ["cascade_r = (cascade_q - cascade_off[0]) // " + str(g),
           f"cascade_head = cascade_h * {g} + (cascade_q - cascade_off[0]) % {g}",
           "cascade_p = cascade_pos[cascade_r]"]
    user = ["cascade_seq[cascade_r]", "cascade_head", "cascade_p", "cascade_kv"]
    score = None
    if spec.alibi or spec.score_mod:
        alibi = ["cascade_t = cascade_s - cascade_slopes[cascade_head] * abs(cascade_p - cascade_kv)"] if spec.alibi \
            else ["cascade_t = cascade_s"]
        score = _rebound(spec.score_mod, "score_mod", pre + alibi, ["cascade_t"] + user, "cascade_t")
    mask = _rebound(spec.mask_mod, "mask_mod", pre, user, "") if spec.mask_mod else None
    tensors = ((f"{_NS}off", "int32", (1,)), (f"{_NS}pos", "int32", ("seq_q",)), (f"{_NS}seq", "int32", ("seq_q",)))
    if spec.alibi:
        tensors += ((f"{_NS}slopes", "float32", (spec.heads,)),)
    return score, mask, spec.mod_tensors + tensors


def prefix_spec(spec: AttentionSpec) -> AttentionSpec:
    """The shared-prefix kernel's spec for serving ``spec`` (GQA ``heads:kv_heads``): ``kv_heads``
    heads over the same cache layout, one sequence whose rows are every query (the group's heads
    stacked), non-causal, with lse, no sinks (the merge adds them once); what hides keys as a
    custom mask, ALiBi and the modifiers as its own modifiers (the module docstring)."""
    _check(spec)
    score, mask, tensors = _prefix_modifiers(spec)
    return dataclasses.replace(spec, heads=spec.kv_heads, causal=False, return_lse=True, sinks=False,
                               seq_q=spec.seq_q * spec.group_size, append=False, window=None, alibi=False,
                               kv_start=False, key_bounds=False, custom_mask=_hides_keys(spec),
                               score_mod=score, mask_mod=mask, mod_tensors=tensors)


def suffix_spec(spec: AttentionSpec) -> AttentionSpec:
    """The suffixes' kernel's spec: ``spec`` with lse, no sinks (the merge adds them once), its
    modifiers reading positions shifted by the prefix's length (``cascade_prefix (1,)``)."""
    _check(spec)
    if not (spec.score_mod or spec.mask_mod):
        return dataclasses.replace(spec, return_lse=True, sinks=False)
    binds = ["cascade_b", "cascade_h", "cascade_q + cascade_prefix[0]", "cascade_kv + cascade_prefix[0]"]
    return dataclasses.replace(
        spec, return_lse=True, sinks=False, mod_tensors=spec.mod_tensors + ((f"{_NS}prefix", "int32", (1,)),),
        score_mod=spec.score_mod and _rebound(spec.score_mod, "score_mod", [], ["cascade_s"] + binds, ""),
        mask_mod=spec.mask_mod and _rebound(spec.mask_mod, "mask_mod", [], binds, ""))


def _torch_of(x: Any):
    """torch, when ``x`` is one of its tensors (then it is loaded), else None."""
    return sys.modules.get("torch") if type(x).__module__.split(".")[0] == "torch" else None


def _permuted(x, axes: tuple[int, ...]):
    """``x`` (a NumPy array or a torch tensor, on its device) with its axes in the order ``axes``, compact."""
    return x.permute(*axes).contiguous() if _torch_of(x) is not None else np.ascontiguousarray(x.transpose(axes))


def _host(x: Any) -> np.ndarray:
    """``x`` on the host, as NumPy: what the cascade computes its masks and positions from (lengths,
    key bounds, a custom mask: a copy of a few ints from a GPU, which waits for its stream)."""
    if _torch_of(x) is not None:
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "") if _torch_of(x) is not None else np.dtype(x.dtype).name


def stack_queries(q, kv_heads: int):
    """``q (N, H, Sq, D)`` as one sequence of ``kv_heads`` heads: ``(1, KH, N·Sq·G, D)``, row
    ``(n·Sq + s)·G + g`` of kv head ``kh`` being ``q[n, kh·G + g, s]``. A NumPy array or a torch
    tensor (stacked on its device)."""
    n, h, sq, d = q.shape
    g = h // kv_heads
    return _permuted(q.reshape(n, kv_heads, g, sq, d), (1, 0, 3, 2, 4)).reshape(1, kv_heads, -1, d)


def unstack(x, n: int, heads: int, sq: int):
    """:func:`stack_queries` undone on an output ``(1, KH, rows, Dv)`` or lse ``(1, KH, rows)``."""
    kh = x.shape[1]
    g = heads // kh
    tail = tuple(x.shape[3:])
    return _permuted(x.reshape(kh, n, sq, g, *tail), (1, 0, 3, 2, *range(4, 4 + len(tail)))).reshape(n, heads, sq, *tail)


def _lengths(kernel, given: tuple) -> np.ndarray:
    """``cache_seqlens`` among a kernel's cache arguments ``given`` (those after ``q``, in order)."""
    names = [a["name"] for a in kernel.spec.arg_specs()][1:1 + len(given)]
    if "cache_seqlens" not in names:
        raise SpecError(f"cascade: expected the cache arguments through cache_seqlens ({len(given)} given: "
                        f"{', '.join(names)})")
    return _host(given[names.index("cache_seqlens")]).astype(np.int64).reshape(-1)


# -- the caller's arguments, checked as given: the prefix pass's kernel sees q stacked as one
# sequence (1, KH, N·Sq·G, D) and its own cascade_* tensors, so its errors would name those

def _check_q(spec: AttentionSpec, q) -> None:
    """``q (N, H, Sq, D)`` of the serving ``spec``'s dtype, heads and head_dim, whose stacked rows
    (``N·Sq·G``, one sequence in the prefix pass) a kernel takes."""
    if q.ndim != 4 or q.shape[1] != spec.heads or q.shape[3] != spec.head_dim or _dtype_name(q) != spec.dtype:
        raise SpecError(f"cascade: q: expected {spec.dtype} (N, {spec.heads}, Sq, {spec.head_dim}) (N sequences of "
                        f"Sq queries), got {_dtype_name(q)} {tuple(q.shape)}")
    n, _, sq, _ = q.shape
    g = spec.group_size
    if n * sq * g > MAX_SEQ_LEN:
        raise SpecError(f"cascade: q {q.shape} stacks {n} · {sq} · {g} = {n * sq * g} rows (sequences · queries · "
                        f"query heads per kv head) into the prefix pass's one sequence, more than the {MAX_SEQ_LEN} "
                        "a kernel takes; split the batch")


def _prefix_length(kernel, given: tuple) -> int:
    """``P``, the prefix's one ``cache_seqlens`` entry; every cache argument of ``given`` with a
    batch dim holds one sequence (the prefix kernel's batch is the stacked q's, 1)."""
    lens = _lengths(kernel, given)
    if lens.size != 1:
        raise SpecError(f"cascade: prefix: cache_seqlens holds {lens.size} lengths; the shared prefix is one "
                        "sequence (cache_seqlens [P])")
    for a, x in zip(kernel.spec.arg_specs()[1:], given):
        dims, shape = a["shape"], tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        i = dims.index("batch") if "batch" in dims else None
        if i is not None and len(shape) == len(dims) and shape[i] != 1:
            want = ", ".join("1" if d == "batch" else str(d) for d in dims)
            raise SpecError(f"cascade: prefix: {a['name']}: dim {i} is {shape[i]}; the shared prefix is one sequence "
                            f"({a['name']} ({want}))")
    return int(lens[0])


def _per_head(name: str, x, heads: int):
    """``x``, one float per query head (``sinks``, ``alibi_slopes``), as given (a NumPy array or a
    torch tensor, left on its device)."""
    a = x if _torch_of(x) is not None else np.asarray(x)
    floating = a.is_floating_point() if _torch_of(a) is not None else np.issubdtype(a.dtype, np.floating)
    if tuple(a.shape) != (heads,) or not floating:
        raise SpecError(f"cascade: {name}: expected ({heads},) (one per query head), got {_dtype_name(a)} "
                        f"{tuple(a.shape)}")
    return a


def _check_variant_args(spec: AttentionSpec, n: int, heads: int, keys: np.ndarray, args: dict) -> None:
    """The serving ``spec``'s variant arguments, as the caller passed them (over whole sequences
    of ``keys`` keys each: prefix, suffix and appended): present; ALiBi's slopes one per query
    head; ``kv_start`` one per sequence in ``[0, keys]``; the key bounds ``(N, positions)``,
    non-decreasing along the positions. The kernels would see them stacked or shifted."""
    need = (["alibi_slopes"] * spec.alibi + ["kv_start"] * spec.kv_start + ["key_lo", "key_hi"] * spec.key_bounds
            + ["k_new", "v_new"] * spec.append)
    for name in need:
        if args.get(name) is None:
            raise SpecError(f"cascade: missing {name}, an argument of this spec")
    if spec.alibi:
        _per_head("alibi_slopes", args["alibi_slopes"], heads)
    given = {}
    for name, ndim, what in (("kv_start", 1, f"({n},) (one per sequence)"),
                             ("key_lo", 2, f"({n}, positions) (a row per sequence)"),
                             ("key_hi", 2, f"({n}, positions) (a row per sequence)")):
        if name in need:
            x = _host(args[name])
            if x.ndim != ndim or x.shape[0] != n or not np.issubdtype(x.dtype, np.integer):
                raise SpecError(f"cascade: {name}: expected integers {what}, got {x.dtype} {x.shape}")
            given[name] = x
    try:  # the kernels' rules, over the positions and keys the caller counts
        check_variant_arrays(types.SimpleNamespace(key_bounds=spec.key_bounds), given, keys, n)
    except KernelArgumentError as e:
        raise KernelArgumentError(f"cascade: {e}") from None


def _run(which: str, kernel, *args, **kwargs):
    """``kernel(*args, **kwargs)``; its refusal names the pass (``prefix``/``suffix``): both take
    cache arguments of the same names."""
    try:
        return kernel(*args, **kwargs)
    except (KernelArgumentError, SpecError) as e:
        raise type(e)(f"cascade: {which}: {e}") from None


def _user_masks(args: dict, shapes: list[tuple[int, int]]) -> list[np.ndarray]:
    """The caller's custom mask over each sequence's whole keys (prefix, suffix, appended): one
    boolean ``(Sq, keys_n)`` per sequence, a ``(N, Sq, ≥ keys)`` boolean array, or packed bits
    with ``mask_indptr``."""
    m = args.pop("custom_mask", None)
    if m is None:
        raise SpecError("cascade: this spec takes a custom_mask over each sequence's prefix and suffix keys")
    indptr = args.pop("mask_indptr", None)
    if indptr is not None:
        return unpack_mask(_host(m), _host(indptr), shapes)
    out = []
    for n, (rows, keys) in enumerate(shapes):
        mn = _host(m[n])
        if mn.dtype != np.bool_ or mn.ndim != 2 or mn.shape[0] != rows or mn.shape[1] < keys:
            raise SpecError(f"custom_mask[{n}]: expected ({rows}, {keys}) booleans over the prefix and suffix keys, "
                            f"got {mn.dtype} {mn.shape}")
        out.append(mn[:, :keys])
    return out


def _shift_bounds(x: np.ndarray, p: int) -> np.ndarray:
    """Key bounds ``(N, positions)`` over whole sequences as the suffix kernel's: column ``c`` is
    the row at position ``P + c`` (clamped into ``x``'s columns, as the kernels clamp), its keys
    shifted by ``−P`` (in int64, kept in int32's range)."""
    x = _host(x).astype(np.int64)
    cols = np.minimum(np.arange(max(x.shape[1] - p, 1)) + p, x.shape[1] - 1)
    return np.ascontiguousarray(np.clip(x[:, cols] - p, _I32.min, _I32.max), np.int32)


def _prefix_visible(spec: AttentionSpec, pos: np.ndarray, p: int, args: dict, masks) -> np.ndarray:
    """``(N·Sq, P)`` booleans: which prefix key each query (``pos (N, Sq)``) sees under the
    window, ``kv_start``, the key bounds and the custom mask."""
    n, sq = pos.shape
    j, r = np.arange(p)[None, :], pos.reshape(-1, 1)
    seq = np.repeat(np.arange(n), sq)
    vis = np.ones((n * sq, p), bool)
    start = _host(args["kv_start"]).astype(np.int64)[seq, None] if spec.kv_start else None
    seen = Visibility.of(spec).sees(j, r, start)  # the window and kv_start, as every kernel reads them
    if seen is not None:
        vis &= seen
    if spec.key_bounds:
        lo, hi = (_host(args[k]).astype(np.int64) for k in ("key_lo", "key_hi"))
        c = np.clip(r, 0, lo.shape[1] - 1)
        vis &= (j >= lo[seq[:, None], c]) & (j < hi[seq[:, None], c])
    if masks is not None:
        vis &= np.concatenate([m[:, :p] for m in masks])
    return vis


def _call_args(spec, pk, sk, q, p: int, lens: np.ndarray, args: dict) -> tuple[dict, dict]:
    """The prefix and suffix kernels' keyword arguments for the serving ``spec``'s variant
    arguments ``args`` (by name, over whole sequences)."""
    n, heads, sq = q.shape[:3]
    if (lens < (0 if spec.append else sq)).any():
        b = int(np.argmin(lens))
        raise SpecError(f"cascade: sequence {b}'s suffix holds {int(lens[b])} keys, fewer than its {sq} queries' own; "
                        "a query must follow the shared prefix (the suffix holds the new tokens' keys, or append them)")
    _check_variant_args(spec, n, heads, p + lens + (sq if spec.append else 0), args)
    pos = p + lens[:, None] + np.arange(sq)[None, :] - (0 if spec.append else sq)
    pa: dict[str, Any] = {}
    sa = {k: args.pop(k) for k in ("k_new", "v_new", "alibi_slopes") if k in args}
    for name in (t[0] for t in spec.mod_tensors if not t[0].startswith(_NS)):  # the user's own
        if name not in args:
            raise SpecError(f"cascade: missing {name}, a tensor the modifiers read")
        pa[name] = sa[name] = args.pop(name)
    if any(t[0] == f"{_NS}off" for t in pk.spec.mod_tensors):
        pa.update(cascade_off=np.asarray([p - n * sq * heads // spec.kv_heads], np.int32),
                  cascade_pos=pos.reshape(-1).astype(np.int32), cascade_seq=np.repeat(np.arange(n, dtype=np.int32), sq))
        if spec.alibi:
            pa["cascade_slopes"] = _host(sa["alibi_slopes"]).astype(np.float32)
    if any(t[0] == f"{_NS}prefix" for t in sk.spec.mod_tensors):
        sa["cascade_prefix"] = np.asarray([p], np.int32)
    masks = _user_masks(args, [(sq, int(x) + p + sq * spec.append) for x in lens]) if spec.custom_mask else None
    if pk.spec.custom_mask:
        vis = _prefix_visible(spec, pos, p, args, masks)
        pa["custom_mask"], pa["mask_indptr"] = pack_mask([np.repeat(vis, heads // spec.kv_heads, axis=0)])
    if spec.kv_start:
        sa["kv_start"] = np.maximum(_host(args.pop("kv_start")).astype(np.int64) - p, 0).astype(np.int32)
    if spec.key_bounds:
        sa["key_lo"], sa["key_hi"] = (_shift_bounds(args.pop(k), p) for k in ("key_lo", "key_hi"))
    if masks is not None:
        sa["custom_mask"] = [m[:, p:] for m in masks]
    if args:
        raise SpecError(f"cascade: unexpected argument(s) {', '.join(sorted(args))} for this spec")
    return pa, sa


def attend(prefix_kernel, suffix_kernel, q, prefix: tuple, suffix: tuple, sinks=None, **args: Any) -> tuple[Any, Any]:
    """``(o (N, H, Sq, Dv), lse (N, H, Sq))`` of ``N`` sequences over a shared prefix and their own
    suffixes. ``prefix_kernel``/``suffix_kernel``: kernels of :func:`prefix_spec`/:func:`suffix_spec`
    (loaded or built; CPU or CUDA). ``q (N, H, Sq, D)``; ``prefix``: the prefix kernel's cache
    arguments for one sequence (kvcache: ``k_cache (1, KH, len, D), v_cache, cache_seqlens [P]``;
    paged: ``k_pages, v_pages, block_table (1, pages), cache_seqlens [P]``, the shared pages);
    ``suffix``: the suffix kernel's cache arguments after ``q`` (each sequence's own cache and
    lengths). ``sinks (H,)``: joined once, in the merge. ``args``: the serving spec's other
    arguments by name, over whole sequences (positions from the prefix's first key):
    ``k_new``/``v_new`` (append), ``alibi_slopes``, ``kv_start``, ``key_lo``/``key_hi`` (columns:
    positions), ``custom_mask`` (per sequence ``(Sq, P + keys_n)`` booleans, or packed with
    ``mask_indptr``) and the modifiers' tensors.

    NumPy arrays or torch tensors, answered in ``q``'s kind. On a GPU (a CUDA build's kernels,
    torch CUDA tensors) the data stays there: ``q`` is stacked and the outputs unstacked with
    torch's ops on its device, the kernels read the caches where they are, and the states merge
    on the device (:func:`~tvm_attention.merge.merge_states`); the host reads only the lengths
    (``cache_seqlens``, a few ints) and what the masks and positions are computed from (the key
    bounds, ``kv_start``, a custom mask), whose results the kernels take as small arrays.

    Errors name the caller's arguments as passed (the prefix pass's kernel sees ``q`` stacked as
    one sequence and tensors of its own): :class:`SpecError` for what the cascade checks itself
    (``q``'s shape, a prefix of one sequence, ``sinks``, the variant arguments), a kernel's own
    refusal prefixed with its pass (``cascade: prefix: k_cache: ...``)."""
    if _torch_of(q) is None:
        q = np.asarray(q)
    ps, ss = prefix_kernel.spec, suffix_kernel.spec
    kh = ps.kv_heads
    if ps.heads != kh or ss.kv_heads != kh:
        raise SpecError(f"cascade: the prefix kernel takes {ps.heads} heads over {kh} kv heads and the suffix kernel "
                        f"{ss.heads} over {ss.kv_heads}; expected the prefix's heads to be its kv heads "
                        "(prefix_spec and suffix_spec of one serving spec)")
    _check_q(ss, q)
    n, heads, sq = tuple(q.shape[:3])
    p = _prefix_length(prefix_kernel, prefix)
    lens = _lengths(suffix_kernel, suffix)
    if lens.size != n:
        raise SpecError(f"cascade: suffix: cache_seqlens holds {lens.size} lengths, q {n} sequences")
    if sinks is not None:
        sinks = _per_head("sinks", sinks, heads).reshape(-1, 1)
    pa, sa = _call_args(ss, prefix_kernel, suffix_kernel, q, p, lens, dict(args))
    o_p, lse_p = _run("prefix", prefix_kernel, stack_queries(q, kh), *prefix, **pa)
    o_s, lse_s = _run("suffix", suffix_kernel, q, *suffix, **sa)
    return merge_states(unstack(o_p, n, heads, sq), unstack(lse_p, n, heads, sq), o_s, lse_s, sinks=sinks)
