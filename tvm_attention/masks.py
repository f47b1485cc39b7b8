"""Custom attention masks as data (issue 45): FlashInfer's packed form and the tree masks of
speculative decoding, in NumPy (no TVM).

**Packed bits** (FlashInfer's ``packed_custom_mask`` with ``mask_indptr``, ``segment_packbits``):
sequence ``b``'s mask is ``(q_len_b, kv_len_b)`` booleans, True where query row ``i`` may see key
``j``; row-major over (row, key) it is ``q_len_b · kv_len_b`` bits, packed little-endian within a
byte (bit ``k`` of the sequence is bit ``k % 8`` of its byte ``k // 8``) and padded to a whole
byte. The sequences' bytes follow each other: ``mask_indptr (batch + 1,) int32`` holds each one's
first byte, ``mask_indptr[b + 1] − mask_indptr[b] = ceil(q_len_b · kv_len_b / 8)``.

**Tree attention** (speculative decoding: EAGLE, Medusa, SpecInfer): ``n`` draft tokens after a
prefix of ``prefix_len`` keys, ``parents[i]`` the draft token draft ``i`` continues (−1: it
continues the prefix). Draft ``i`` sees the whole prefix, itself and its ancestors:
:func:`tree_mask` writes that out, ``(n, prefix_len + n)``. TVM's LLM kernels describe the same
tree by DFS intervals (``enter``, ``exit``): draft ``j`` is an ancestor-or-self of ``i`` exactly
when ``enter[j] <= enter[i] < exit[j]`` (:func:`dfs_intervals`, :func:`tree_mask_from_intervals`).

A CPU build with ``custom_mask`` takes the packed form (``custom_mask``, ``mask_indptr``) as call
arguments (docs/semantics.md); the loader packs a boolean mask with :func:`pack_mask`.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import SpecError
from .limits import MAX_ELEMENTS, MAX_SEQ_LEN


def _as_bool_2d(m, what: str) -> np.ndarray:
    a = np.asarray(m)
    if a.ndim != 2:
        raise SpecError(f"{what}: expected a 2-D (query rows, keys) mask, got shape {a.shape}")
    if a.dtype != np.bool_:
        raise SpecError(f"{what}: expected booleans (True: the row sees the key), got {a.dtype}")
    return a


def _is_int(x) -> bool:
    """A Python or NumPy int, not a bool (which Python counts as one)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def pack_mask(masks) -> tuple[np.ndarray, np.ndarray]:
    """``(packed uint8, mask_indptr int32 (batch + 1,))`` of boolean masks in FlashInfer's
    convention (the module docstring): ``masks`` a ``(batch, q_len, kv_len)`` boolean array (every
    sequence the same shape) or a sequence of ``(q_len_b, kv_len_b)`` boolean arrays (ragged)."""
    if isinstance(masks, np.ndarray):
        if masks.ndim != 3:
            raise SpecError(f"custom_mask: expected (batch, q_len, kv_len) booleans or a list of (q_len_b, "
                            f"kv_len_b) ones, got shape {masks.shape}")
        masks = list(masks)
    segments = [np.packbits(_as_bool_2d(m, f"custom_mask[{b}]").reshape(-1), bitorder="little")
                for b, m in enumerate(masks)]
    indptr = np.zeros(len(segments) + 1, np.int64)
    indptr[1:] = np.cumsum([s.size for s in segments])
    if indptr[-1] > np.iinfo(np.int32).max:
        raise SpecError(f"custom_mask: {int(indptr[-1])} bytes packed; mask_indptr is int32 (at most 2**31 - 1)")
    packed = np.concatenate(segments) if segments else np.zeros(0, np.uint8)
    return packed.astype(np.uint8), indptr.astype(np.int32)


def unpack_mask(packed: np.ndarray, mask_indptr: np.ndarray, shapes: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """The boolean masks ``(q_len_b, kv_len_b)`` (``shapes``) packed in ``packed`` at
    ``mask_indptr`` (integers): :func:`pack_mask` undone. A segment shorter than its shape needs,
    a shape that is not two non-negative ints and a non-integer ``mask_indptr`` are each a
    :class:`SpecError` naming the sequence or the argument."""
    packed, indptr = np.asarray(packed), np.asarray(mask_indptr)
    if packed.dtype != np.uint8 or packed.ndim != 1:
        raise SpecError(f"custom_mask: expected packed uint8 bytes (n,), got {packed.dtype} {packed.shape}")
    if not np.issubdtype(indptr.dtype, np.integer):  # a float offset would be truncated into another byte
        raise SpecError(f"mask_indptr: expected integers (each sequence's first byte), got {indptr.dtype}")
    if indptr.shape != (len(shapes) + 1,):
        raise SpecError(f"mask_indptr: expected shape ({len(shapes) + 1},) (batch + 1), got {indptr.shape}")
    for b, shape in enumerate(shapes):
        dims = tuple(shape) if isinstance(shape, (tuple, list, np.ndarray)) else (shape,)
        if len(dims) != 2 or not all(_is_int(x) and x >= 0 for x in dims):
            raise SpecError(f"shapes[{b}]: expected (q_len, kv_len), two non-negative ints, got {dims!r}")
    out = []
    for b, (q, k) in enumerate(shapes):
        q, k = int(q), int(k)
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        need = -(-q * k // 8)
        if not 0 <= lo <= hi <= packed.size or hi - lo < need:
            raise SpecError(f"mask_indptr: sequence {b} holds bytes [{lo}, {hi}) of {packed.size}; its "
                            f"{q} × {k} mask needs {need}")
        bits = np.unpackbits(packed[lo:lo + need], bitorder="little", count=q * k)
        out.append(bits.reshape(q, k).astype(bool))
    return out


def _check_lengths(prefix_len, n: int) -> None:
    """``prefix_len`` (an int >= 0) and ``n`` drafts are one sequence's keys: at most
    ``MAX_SEQ_LEN`` (2**30), as the kernels take, and its mask's bits packed must fit
    ``mask_indptr``'s int32 byte offsets. Checked before the mask is allocated: a length past
    them is a named error, never a MemoryError."""
    if not _is_int(prefix_len) or prefix_len < 0:
        raise SpecError(f"prefix_len must be a non-negative int, got {prefix_len!r}")
    p = int(prefix_len)
    if p > MAX_SEQ_LEN:
        raise SpecError(f"prefix_len={p}: a sequence has at most {MAX_SEQ_LEN} keys (2**30, the longest a kernel "
                        "takes)")
    if p + n > MAX_SEQ_LEN:
        raise SpecError(f"prefix_len={p} and {n} drafts: {p + n} keys; a sequence has at most {MAX_SEQ_LEN} (2**30, "
                        "the longest a kernel takes)")
    nbytes = -(-n * (p + n) // 8)
    if nbytes > MAX_ELEMENTS:
        raise SpecError(f"prefix_len={p} and {n} drafts: a {n} × {p + n} mask, {nbytes} bytes packed; mask_indptr is "
                        "int32 (at most 2**31 - 1 bytes in a batch)")


def _check_parents(parents, what: str = "parents") -> np.ndarray:
    p = np.asarray(parents)
    if p.ndim == 1 and p.size == 0:  # a sequence that drafted nothing: [] is float64 to NumPy
        return np.zeros(0, np.int64)
    if p.ndim != 1 or not np.issubdtype(p.dtype, np.integer):
        raise SpecError(f"{what}: expected a 1-D integer array (the parent draft of each draft token, -1 for "
                        f"the prefix), got {p.dtype} {p.shape}")
    n = p.size
    bad = np.flatnonzero((p < -1) | (p >= n) | (p == np.arange(n)))
    if bad.size:
        i = int(bad[0])
        raise SpecError(f"{what}[{i}]={int(p[i])}: a parent is -1 (the prefix) or another draft token in "
                        f"[0, {n})")
    # every chain of parents ends at -1 within n steps, else it has a cycle
    node, steps = p.astype(np.int64), 0
    while (node >= 0).any():
        steps += 1
        if steps > n:
            i = int(np.flatnonzero(node >= 0)[0])
            raise SpecError(f"{what}: the drafts' parents form a cycle (draft {i} is its own ancestor): not a tree")
        node = np.where(node >= 0, p[np.maximum(node, 0)], -1)
    return p.astype(np.int64)


def tree_mask(parents, prefix_len: int) -> np.ndarray:
    """``(n, prefix_len + n)`` booleans of a draft tree: row ``i`` sees every prefix key, draft
    ``i`` itself and its ancestors (``parents``: the parent draft of each, −1 for the prefix).
    Keys are the prefix's, then the drafts' in their order (how they are appended to the cache).
    No drafts (``parents`` empty: a sequence that drafted nothing this step) is ``(0, prefix_len)``,
    zero bytes packed. ``prefix_len + n`` keys at most ``limits.MAX_SEQ_LEN`` (2**30), as the
    kernels take; more is a :class:`SpecError` naming ``prefix_len``."""
    p = _check_parents(parents)
    n = p.size
    _check_lengths(prefix_len, n)
    seen = np.eye(n, dtype=bool)
    node = p.copy()
    while (node >= 0).any():  # walk every row's chain of ancestors up one step at a time
        rows = np.flatnonzero(node >= 0)
        seen[rows, node[rows]] = True
        node = np.where(node >= 0, p[np.maximum(node, 0)], -1)
    return np.concatenate([np.ones((n, int(prefix_len)), bool), seen], axis=1)


def dfs_intervals(parents) -> tuple[np.ndarray, np.ndarray]:
    """``(enter, exit)`` int32 of each draft in a depth-first walk of the tree (children in index
    order): ``enter[i]`` its visit, ``exit[i]`` one past the last visit in its subtree, so ``j`` is
    an ancestor-or-self of ``i`` exactly when ``enter[j] <= enter[i] < exit[j]``."""
    p = _check_parents(parents)
    n = p.size
    children: list[list[int]] = [[] for _ in range(n + 1)]  # n: the prefix (the roots' parent)
    for i, q in enumerate(p):
        children[int(q) if q >= 0 else n].append(i)
    enter, exit_ = np.zeros(n, np.int32), np.zeros(n, np.int32)
    clock, stack = 0, [(n, 0)]
    while stack:  # iterative: a chain of drafts as deep as it is long
        node, k = stack.pop()
        if k == 0 and node != n:
            enter[node] = clock
            clock += 1
        if k < len(children[node]):
            stack.append((node, k + 1))
            stack.append((children[node][k], 0))
        elif node != n:
            exit_[node] = clock
    return enter, exit_


def tree_mask_from_intervals(enter, exit, prefix_len: int) -> np.ndarray:
    """:func:`tree_mask` of a tree given by DFS intervals (:func:`dfs_intervals`, TVM's LLM
    kernels' form): draft ``i`` sees draft ``j`` when ``enter[j] <= enter[i] < exit[j]``. The
    intervals must be a tree's: each non-empty, no two entered at once, any two nested or disjoint
    (gaps between them allowed); else a :class:`SpecError` names the drafts. Empty ``enter`` and
    ``exit`` (no drafts) give ``(0, prefix_len)``; lengths as :func:`tree_mask`'s."""
    e, x = np.asarray(enter), np.asarray(exit)
    if e.ndim == x.ndim == 1 and e.size == x.size == 0:  # a sequence that drafted nothing
        e = x = np.zeros(0, np.int64)
    if e.ndim != 1 or e.shape != x.shape or not np.issubdtype(e.dtype, np.integer) \
            or not np.issubdtype(x.dtype, np.integer):
        raise SpecError(f"enter/exit: expected two 1-D integer arrays of one length, got {e.dtype} {e.shape} and "
                        f"{x.dtype} {x.shape}")
    e, x = e.astype(np.int64), x.astype(np.int64)
    if (x <= e).any():
        i = int(np.flatnonzero(x <= e)[0])
        raise SpecError(f"enter/exit: draft {i}'s interval [{int(e[i])}, {int(x[i])}) is empty")
    _check_lengths(prefix_len, e.size)
    # A tree's DFS intervals nest or are disjoint, one visit each: a child's lies inside its
    # parent's. Else "j sees i" is no ancestry (two drafts entered at once would see each other).
    tie = np.triu(e[:, None] == e[None, :], 1)
    if tie.any():
        j, i = (int(v) for v in np.argwhere(tie)[0])
        raise SpecError(f"enter/exit: drafts {j} and {i} both enter at {int(e[j])}: a DFS visits each draft once, "
                        "so the intervals of a tree start apart")
    crossed = (e[:, None] < e[None, :]) & (e[None, :] < x[:, None]) & (x[:, None] < x[None, :])  # [j, i]
    if crossed.any():
        j, i = (int(v) for v in np.argwhere(crossed)[0])
        raise SpecError(f"enter/exit: drafts {j} [{int(e[j])}, {int(x[j])}) and {i} [{int(e[i])}, {int(x[i])}) "
                        "overlap without nesting: a tree's DFS intervals nest (a child's inside its parent's) or "
                        "are disjoint")
    seen = (e[None, :] <= e[:, None]) & (e[:, None] < x[None, :])
    return np.concatenate([np.ones((e.size, int(prefix_len)), bool), seen], axis=1)


def tree_masks(parents: Sequence, prefix_lens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The packed masks of a batch of draft trees (:func:`tree_mask` of each sequence's
    ``parents`` after its ``prefix_lens[b]`` cached keys) and their ``mask_indptr``."""
    if len(parents) != len(prefix_lens):
        raise SpecError(f"tree_masks: {len(parents)} draft trees but {len(prefix_lens)} prefix lengths")
    return pack_mask([tree_mask(p, n) for p, n in zip(parents, prefix_lens)])
