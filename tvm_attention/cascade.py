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

:func:`prefix_spec` and :func:`suffix_spec` give the two kernels' specs from the serving spec;
:func:`attend` runs them. Positional variants (a window, ALiBi, ``kv_start``) and modifiers
would need each part's absolute positions: refused by name here.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .errors import SpecError
from .merge import merge_states
from .spec import AttentionSpec


def _check(spec: AttentionSpec) -> None:
    if spec.layout not in ("kvcache", "paged"):
        raise SpecError(f"cascade: the suffixes live in a kvcache or paged cache, not layout {spec.layout!r}")
    bad = [v for v in spec.variants if v not in ("softcap", "sinks")]
    if bad or spec.append:
        what = ", ".join(bad + (["append"] if spec.append else []))
        raise SpecError(f"cascade: {what} would need each part's absolute positions; not built for a shared prefix "
                        "(yet)")


def prefix_spec(spec: AttentionSpec) -> AttentionSpec:
    """The shared-prefix kernel's spec for serving ``spec`` (GQA ``heads:kv_heads``): ``kv_heads``
    heads over the same cache layout, one sequence whose rows are every query (the group's heads
    stacked), non-causal, with lse, no sinks (the merge adds them once)."""
    _check(spec)
    return dataclasses.replace(spec, heads=spec.kv_heads, causal=False, return_lse=True, sinks=False,
                               seq_q=spec.seq_q * spec.group_size)


def suffix_spec(spec: AttentionSpec) -> AttentionSpec:
    """The suffixes' kernel's spec: ``spec`` with lse, no sinks (the merge adds them once)."""
    _check(spec)
    return dataclasses.replace(spec, return_lse=True, sinks=False)


def stack_queries(q: np.ndarray, kv_heads: int) -> np.ndarray:
    """``q (N, H, Sq, D)`` as one sequence of ``kv_heads`` heads: ``(1, KH, N·Sq·G, D)``, row
    ``(n·Sq + s)·G + g`` of kv head ``kh`` being ``q[n, kh·G + g, s]``."""
    n, h, sq, d = q.shape
    g = h // kv_heads
    return np.ascontiguousarray(q.reshape(n, kv_heads, g, sq, d).transpose(1, 0, 3, 2, 4).reshape(1, kv_heads, -1, d))


def unstack(x: np.ndarray, n: int, heads: int, sq: int) -> np.ndarray:
    """:func:`stack_queries` undone on an output ``(1, KH, rows, Dv)`` or lse ``(1, KH, rows)``."""
    kh = x.shape[1]
    g = heads // kh
    tail = x.shape[3:]
    return np.ascontiguousarray(x.reshape(kh, n, sq, g, *tail).transpose(1, 0, 3, 2, *range(4, 4 + len(tail)))
                                .reshape(n, heads, sq, *tail))


def attend(prefix_kernel, suffix_kernel, q: np.ndarray, prefix: tuple, suffix: tuple,
           sinks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(o (N, H, Sq, Dv), lse (N, H, Sq))`` of ``N`` sequences over a shared prefix and their own
    suffixes. ``prefix_kernel``/``suffix_kernel``: kernels of :func:`prefix_spec`/:func:`suffix_spec`
    (loaded or built). ``q (N, H, Sq, D)``; ``prefix``: the prefix kernel's cache arguments for one
    sequence (kvcache: ``k_cache (1, KH, len, D), v_cache, cache_seqlens [P]``; paged: ``k_pages,
    v_pages, block_table (1, pages), cache_seqlens [P]``, the shared pages); ``suffix``: the suffix
    kernel's arguments after ``q`` (each sequence's own cache and lengths). ``sinks (H,)``: joined
    once, in the merge. NumPy arrays."""
    n, heads, sq = q.shape[:3]
    kh = prefix_kernel.spec.kv_heads
    if prefix_kernel.spec.heads != kh or suffix_kernel.spec.heads != heads:
        raise SpecError(f"cascade: the prefix kernel takes {prefix_kernel.spec.heads} heads over {kh} kv heads and the "
                        f"suffix kernel {suffix_kernel.spec.heads}; expected {kh} (prefix_spec) and q's {heads}")
    o_p, lse_p = prefix_kernel(stack_queries(q, kh), *prefix)
    o_s, lse_s = suffix_kernel(q, *suffix)
    o, lse = merge_states(unstack(np.asarray(o_p), n, heads, sq), unstack(np.asarray(lse_p), n, heads, sq),
                          np.asarray(o_s), np.asarray(lse_s),
                          sinks=None if sinks is None else np.asarray(sinks, np.float32).reshape(-1, 1))
    return o, lse
