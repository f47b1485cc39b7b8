"""Custom masks as data (issue 45, first step: ``tvm_attention.masks``): FlashInfer's packed bits
(little-endian within a byte, row-major over (query row, key) per sequence, a byte boundary
between sequences, ``mask_indptr``), and the tree masks of speculative decoding from parent
arrays and from DFS intervals, against brute force."""
import numpy as np
import pytest

from tvm_attention.masks import (dfs_intervals, pack_mask, tree_mask, tree_mask_from_intervals, tree_masks,
                                 unpack_mask)
from tvm_attention.spec import SpecError


def test_packed_bits_follow_flashinfers_convention():
    """Bit k of a sequence (k = row · kv_len + key) is bit k % 8 of its byte k // 8; each
    sequence starts on a byte: a 3 × 3 mask is 9 bits, 2 bytes, the second holding bit 8."""
    m = np.zeros((3, 3), bool)
    m[0, 1] = True  # bit 1
    m[2, 2] = True  # bit 8: byte 1, bit 0
    one = np.ones((1, 5), bool)  # bits 0-4 of its own byte
    packed, indptr = pack_mask([m, one])
    assert packed.dtype == np.uint8 and indptr.dtype == np.int32
    assert packed.tolist() == [0b10, 0b1, 0b11111] and indptr.tolist() == [0, 2, 3]
    # numpy's packbits with bitorder="little" is FlashInfer's segment_packbits(bitorder="little")
    assert packed[0] == np.packbits(m.reshape(-1)[:8], bitorder="little")[0]


@pytest.mark.parametrize("shapes", [[(1, 1)], [(3, 17), (0, 5), (4, 0), (7, 8)], [(5, 13)] * 3])
def test_pack_and_unpack_round_trip_at_partial_bytes(shapes):
    rng = np.random.default_rng(len(shapes))
    masks = [rng.random(s) < 0.5 for s in shapes]
    packed, indptr = pack_mask(masks)
    assert np.diff(indptr).tolist() == [-(-q * k // 8) for q, k in shapes]
    for got, want in zip(unpack_mask(packed, indptr, shapes), masks):
        np.testing.assert_array_equal(got, want)
    if len(set(shapes)) == 1:  # equal shapes: one (batch, q_len, kv_len) array packs the same
        p3, i3 = pack_mask(np.stack(masks))
        np.testing.assert_array_equal(p3, packed)
        np.testing.assert_array_equal(i3, indptr)


def brute_tree(parents, prefix):
    n = len(parents)
    m = np.zeros((n, prefix + n), bool)
    m[:, :prefix] = True
    for i in range(n):
        j = i
        while j >= 0:
            m[i, prefix + j] = True
            j = parents[j]
    return m


TREES = {
    "one_node": [-1],
    "chain": [-1, 0, 1, 2],  # a chain of drafts is causal attention over them
    "eagle": [-1, 0, 0, 1, 1, 2, 3, -1, 7],  # two roots, branching, a child listed after siblings
    "parents_after_children": [2, 2, -1, 0],  # a parent may come later in the order
}


@pytest.mark.parametrize("name", list(TREES))
def test_tree_masks_from_parents_and_from_intervals(name):
    parents = TREES[name]
    m = tree_mask(parents, 5)
    np.testing.assert_array_equal(m, brute_tree(parents, 5))
    enter, exit_ = dfs_intervals(parents)
    np.testing.assert_array_equal(tree_mask_from_intervals(enter, exit_, 5), m)
    assert sorted(enter.tolist()) == list(range(len(parents)))  # a visit per draft
    if name == "chain":
        np.testing.assert_array_equal(m[:, 5:], np.tril(np.ones((4, 4), bool)))
    packed, indptr = tree_masks([parents, [-1]], [5, 0])
    got = unpack_mask(packed, indptr, [(len(parents), 5 + len(parents)), (1, 1)])
    np.testing.assert_array_equal(got[0], m)
    assert got[1].tolist() == [[True]]  # a tree of one node, no prefix: sees itself


@pytest.mark.parametrize("parents, match", [
    ([0], r"parents\[0\]=0: a parent is -1"),  # its own parent
    ([-1, 5], r"parents\[1\]=5"),
    ([-2], r"parents\[0\]=-2"),
    ([1, 2, 0], "cycle"),
    (np.array([[-1]]), "1-D integer"),
    ([0.5], "1-D integer"),
])
def test_bad_trees_are_named(parents, match):
    with pytest.raises(SpecError, match=match):
        tree_mask(parents, 3)


def test_bad_packed_masks_are_named():
    packed, indptr = pack_mask([np.ones((3, 9), bool)])
    with pytest.raises(SpecError, match=r"sequence 0 holds bytes \[0, 4\) of 4; its 3 × 11 mask needs 5"):
        unpack_mask(packed, indptr, [(3, 11)])
    with pytest.raises(SpecError, match="expected booleans"):
        pack_mask([np.ones((2, 2), np.int8)])
    with pytest.raises(SpecError, match=r"mask_indptr: expected shape \(3,\)"):
        unpack_mask(packed, indptr, [(3, 9), (1, 1)])
    with pytest.raises(SpecError, match="is empty"):
        tree_mask_from_intervals([0, 1], [1, 1], 0)


def test_a_sequence_without_drafts_is_a_tree_of_zero_rows():
    """A batch where one sequence drafted nothing this step (issue 62): its tree is empty, its mask
    ``(0, prefix_len)``, zero bytes packed between its neighbours'."""
    assert tree_mask([], 4).shape == (0, 4) and tree_mask(np.zeros(0, np.int32), 0).shape == (0, 0)
    enter, exit_ = dfs_intervals([])
    assert enter.shape == exit_.shape == (0,)
    assert tree_mask_from_intervals([], [], 4).shape == (0, 4)
    packed, indptr = tree_masks([[-1, 0], [], [-1]], [3, 2, 1])
    assert np.diff(indptr).tolist() == [2, 0, 1]
    got = unpack_mask(packed, indptr, [(2, 5), (0, 2), (1, 2)])
    np.testing.assert_array_equal(got[0], brute_tree([-1, 0], 3))
    assert got[1].shape == (0, 2) and got[2].tolist() == [[True, True]]


def test_lengths_past_what_a_kernel_takes_are_refused_by_name():
    """``prefix_len`` and the drafts are a sequence's keys: at most ``MAX_SEQ_LEN`` (2**30), as the
    kernels take; refused before anything is allocated (never a MemoryError)."""
    from tvm_attention.limits import MAX_SEQ_LEN

    for build in (lambda n: tree_mask([-1, 0], n), lambda n: tree_mask_from_intervals([0, 1], [2, 2], n)):
        with pytest.raises(SpecError, match=r"prefix_len=1099511627776: .*at most 1073741824"):
            build(2**40)
        with pytest.raises(SpecError, match=rf"prefix_len={MAX_SEQ_LEN - 1} and 2 drafts: {MAX_SEQ_LEN + 1} keys"):
            build(MAX_SEQ_LEN - 1)
    # within the keys' bound but past what mask_indptr (int32 byte offsets) can address
    with pytest.raises(SpecError, match=r"prefix_len=1073740824 and 40 drafts: .* bytes packed; mask_indptr is int32"):
        tree_mask(np.full(40, -1), 2**30 - 1000)


@pytest.mark.parametrize("indptr, shapes, match", [
    (np.array([0, 1]), [(-1, 5)], r"shapes\[0\]: expected \(q_len, kv_len\), two non-negative ints, got \(-1, 5\)"),
    (np.array([0, 1]), [(2, -3)], r"shapes\[0\]: .*got \(2, -3\)"),
    (np.array([0, 1]), [(1.5, 2)], r"shapes\[0\]: .*got \(1.5, 2\)"),
    (np.array([0, 1]), [(1, 2, 3)], r"shapes\[0\]: .*got \(1, 2, 3\)"),
    (np.array([0.0, 1.0]), [(1, 2)], r"mask_indptr: expected integers \(each sequence's first byte\), got float64"),
])
def test_unpack_refuses_bad_shapes_and_offsets_by_name(indptr, shapes, match):
    packed, _ = pack_mask([np.ones((1, 2), bool)])
    with pytest.raises(SpecError, match=match):
        unpack_mask(packed, indptr, shapes)


@pytest.mark.parametrize("enter, exit_, match", [
    ([0, 1], [2, 3], r"drafts 0 \[0, 2\) and 1 \[1, 3\) overlap without nesting"),  # crossed
    ([0, 2, 1], [4, 5, 3], r"drafts 0 \[0, 4\) and 1 \[2, 5\) overlap"),  # 2 [1, 3) nests in 0, crosses 1
    ([0, 0], [2, 1], r"drafts 0 and 1 both enter at 0"),  # a tie: each the other's ancestor
])
def test_intervals_that_are_not_a_tree_are_refused_by_name(enter, exit_, match):
    with pytest.raises(SpecError, match=match):
        tree_mask_from_intervals(enter, exit_, 2)
    # nested and disjoint ones (with gaps between them) are a tree
    m = tree_mask_from_intervals([0, 1, 5, 2], [4, 2, 6, 4], 0)
    np.testing.assert_array_equal(m, brute_tree([-1, 0, -1, 0], 0))
