"""Nothing out of bounds at any value (issue 41, item 1): every bound the library, the loader and
the CUDA device checks test is written so that no sum or product of call-time values can
overflow (docs/artifact_checks.md lists each). Each check is called with 2³¹−1, 2³¹−seq_q and
−2³¹, through the library itself (as a C++ caller calls it) and through the loader, and must
refuse with its named error, writing nothing; the device checks' rules are the same functions,
tested emulated in test_device_checks.py."""
import numpy as np
import pytest
import tvm

from tvm_attention.artifact import kernel_of
from tvm_attention.layouts import LAYOUTS
from tvm_attention.loader import KernelArgumentError, aligned_empty
from tvm_attention.spec import MAX_ELEMENTS, MAX_SEQ_LEN, MAX_WINDOW, AttentionSpec, SpecError
from tvm_attention.validate import TOLERANCES

from conftest import built

SQ = 2  # new tokens per call: the appended keys
KV = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=SQ, seq_kv=64, head_dim=16, causal=True, layout="kvcache",
                   kv_dtype="int8", append=True, kv_start=True)
PG = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=SQ, seq_kv=64, head_dim=16, causal=True, layout="paged",
                   append=True, kv_start=True)
VL = AttentionSpec(batch=2, heads=2, seq_q=32, head_dim=16, layout="varlen", key_bounds=True)
HUGE = [2**31 - 1, 2**31 - SQ, -2**31]
CANARY = 0x5A


def _inputs(spec):
    """A valid call of ``spec`` (cache_seqlens [3, 17], room for the appended keys), each cache
    followed in memory by canary bytes that a write past its end would change."""
    lay = LAYOUTS[spec.layout]
    case = {"seq_q": SQ, "cache_seqlens": [3, 17]}
    if spec.layout == "kvcache":
        case["max_len"] = 24
    x = lay.random_inputs(spec, case, seed=5)
    for name in lay.kv_names:
        a = x[name]
        raw = aligned_empty((a.nbytes + 4096,), np.uint8)
        raw[...] = CANARY
        view = raw[:a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        x[name] = view
        _CANARIES[id(view)] = raw[a.nbytes:]
    return x


_CANARIES = {}  # id(cache view) -> the bytes after it


def _canaries_intact(x, spec):
    for name in LAYOUTS[spec.layout].kv_names:
        assert (_CANARIES[id(x[name])] == CANARY).all(), f"{name}: written past its end"


def _raw(spec, x):
    """The library itself, as a C++ caller calls it: no loader check runs."""
    k = kernel_of(built(spec))
    o = aligned_empty(x["q"].shape, x["q"].dtype)
    k.function(*x.values(), o)
    return o


@pytest.mark.parametrize("spec", [KV, PG], ids=["kvcache", "paged"])
@pytest.mark.parametrize("value", HUGE)
def test_cache_length_plus_appended_keys_cannot_wrap(spec, value):
    """``cache_seqlens[b] + seq_q <= capacity``: in int32, 2³¹−1 + 2 wrapped, passed, and the
    kernel wrote the new keys outside the cache (``malloc(): invalid next size``, SIGSEGV)."""
    x = _inputs(spec)
    _raw(spec, x)  # valid
    x["cache_seqlens"] = np.array([3, value], np.int32)
    before = {n: x[n].copy() for n in LAYOUTS[spec.layout].kv_names}
    with pytest.raises(ValueError, match="cache_seqlens: an entry is negative or larger than max_"):
        _raw(spec, x)
    with pytest.raises(KernelArgumentError, match=rf"cache_seqlens\[1\]={value}"):
        kernel_of(built(spec))(*x.values())
    for n, b in before.items():
        np.testing.assert_array_equal(x[n].view(np.uint8), b.view(np.uint8))
    _canaries_intact(x, spec)


@pytest.mark.parametrize("value", HUGE)
def test_block_table_entries_at_the_ends_of_int32(value):
    """A page index times page_size (the row a key lives in) is never formed for an entry that
    is not a page."""
    x = _inputs(PG)
    x["block_table"] = x["block_table"].copy()
    x["block_table"][1, 0] = value
    with pytest.raises(ValueError, match=r"block_table: an entry a sequence uses \(j < ceil\(\(cache_seqlens\[b\] \+ "
                                         r"seq_q\) / page_size\)\) is not a page: it must be in \[0, num_pages\)"):
        _raw(PG, x)
    with pytest.raises(KernelArgumentError, match=rf"block_table\[1, 0\]={value} is not a page"):
        kernel_of(built(PG))(*x.values())
    _canaries_intact(x, PG)


@pytest.mark.parametrize("spec", [KV, PG], ids=["kvcache", "paged"])
@pytest.mark.parametrize("value", HUGE)
def test_kv_start_against_the_keys_with_the_appended_ones(spec, value):
    """``0 <= kv_start[b] <= cache_seqlens[b] + seq_q``, compared in int64; the library, the
    device check and the loader judge it against the same keys (with append, the new ones too)."""
    x = _inputs(spec)
    x["kv_start"] = np.array([3 + SQ, 17 + SQ], np.int32)  # the last key: valid, sees only the new keys
    _raw(spec, x)
    x = _inputs(spec)
    x["kv_start"] = np.array([0, value], np.int32)
    with pytest.raises(ValueError, match=r"kv_start: an entry is negative or larger than the sequence's keys "
                                         r"\(cache_seqlens\[b\] \+ seq_q\)"):
        _raw(spec, x)
    with pytest.raises(KernelArgumentError, match=rf"kv_start\[1\]={value} must be in \[0, {17 + SQ}\]"):
        kernel_of(built(spec))(*x.values())


def _varlen_inputs(cu_k, seed=0):
    rng = np.random.default_rng(seed)
    total_k = int(cu_k[-1])
    n = len(cu_k) - 1
    cu_q = np.arange(n + 1, dtype=np.int32) * 4
    x = {"q": rng.standard_normal((int(cu_q[-1]), 2, 16), dtype=np.float32),
         "k": rng.standard_normal((total_k, 2, 16), dtype=np.float32),
         "v": rng.standard_normal((total_k, 2, 16), dtype=np.float32),
         "cu_seqlens_q": cu_q, "cu_seqlens_k": np.asarray(cu_k, np.int32)}
    x["key_lo"] = np.zeros((n, 4), np.int32)
    x["key_hi"] = np.full((n, 4), 2**31 - 1, np.int32)
    return x


@pytest.mark.parametrize("cu_k", [[0, 2**31 - 1, -2**31 + 5, 4], [0, 2**31 - 1, 4], [0, -2**31, 4],
                                  [0, 2**31 - SQ, 2**31 - 1, 4]])
def test_cu_seqlens_steps_through_the_ends_of_int32(cu_k):
    """A sequence's rows are ``cu[b + 1] − cu[b]``: the library compares neighbours (no
    difference formed), the loader takes differences in int64. ``[0, 2³¹−1, −2³¹+5, 4]`` has
    int32 differences that all wrap to non-negative ones."""
    x = _varlen_inputs(cu_k)
    x["k"] = x["v"] = np.zeros((4, 2, 16), np.float32)
    with pytest.raises(ValueError, match="cu_seqlens_k: must be non-decreasing"):
        _raw(VL, x)
    bad = int(np.argmax(np.diff(np.asarray(cu_k, np.int64)) < 0))
    with pytest.raises(KernelArgumentError, match=rf"cu_seqlens_k: must be non-decreasing, but "
                                                  rf"cu_seqlens_k\[{bad + 1}\]={cu_k[bad + 1]} <"):
        kernel_of(built(VL))(*x.values())


@pytest.mark.parametrize("lo, hi", [(-2**31, 2**31 - 1), (-2**31, 2**31 - SQ), (0, 2**31 - 1), (-2**31, 20)])
def test_key_bounds_at_the_ends_of_int32_select_what_they_say(lo, hi):
    """Key bounds are any int32 (``key_hi`` 2³¹−1: "to the end"); the tile range the kernel
    computes from them (``hi + block_n − 1``) overflowed, so such rows saw no key and output
    zeros. They are clamped into [0, 2³⁰] first: every row matches the reference."""
    x = _varlen_inputs([0, 40, 75])
    x["key_lo"][...] = lo
    x["key_hi"][...] = hi
    k = kernel_of(built(VL))
    got = k(*x.values())
    ref = LAYOUTS["varlen"].reference(VL, x)
    atol, rtol = TOLERANCES["float32"]
    np.testing.assert_allclose(got, ref, atol=atol, rtol=rtol)
    assert np.abs(got).max() > 0


def _huge(shape, dtype):
    """A writeable array of ``shape`` (any size) over 64 bytes: every stride 0."""
    base = aligned_empty((64,), np.uint8).view(dtype)
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=(0,) * len(shape), writeable=True)


@pytest.mark.parametrize("dims, message", [
    ((2, 2, 2**32 + 24, 16), r"k_cache: dim 2 is negative or larger than 1073741824 \(the longest sequence"),
    ((2, 2, MAX_SEQ_LEN + 1, 16), r"k_cache: dim 2 is negative or larger than 1073741824"),
    ((2**31 + 2, 2, 24, 16), r"k_cache: dim 0 is negative or larger than 2147483647 \(kernels index with 32-bit"),
    ((2**12, 2, 2**16, 16), r"k_cache: more than 2147483647 elements; kernels index with 32-bit ints"),
    ((2, 3, 24, 16), r"k_cache: dim 1 must be 2: expected shape \(batch, 2, max_len, 16\)"),
])
def test_the_library_checks_shapes_in_int64_before_any_index(dims, message):
    """TVM binds each int64 dim to an int32 var (``max_len = int32(shape[2])``): 2³²+24 became
    24, and a tensor of 2³¹ elements or more wraps every flat index. The library reads the
    caller's shapes in int64 first: every dim in range, the elements at most 2³¹−1, a sequence
    at most 2³⁰ keys."""
    x = _inputs(KV)
    x["k_cache"] = _huge(dims, np.int8)
    with pytest.raises(ValueError, match=message):
        _raw(KV, x)


def test_the_loader_names_a_sequence_past_the_longest():
    k = kernel_of(built(KV))
    x = _inputs(KV)
    with pytest.raises(KernelArgumentError, match=r"k_cache: dim 2 \(max_len\) is 1073741825; the longest sequence"):
        k(x["q"], _huge((2, 2, MAX_SEQ_LEN + 1, 1), np.int8), *list(x.values())[2:])
    with pytest.raises(KernelArgumentError, match=rf"k_cache: .* at most {MAX_ELEMENTS}: split the batch"):
        k(x["q"], _huge((2, 2, MAX_SEQ_LEN, 16), np.int8), *list(x.values())[2:])


@pytest.mark.parametrize("spec", [KV, PG], ids=["kvcache", "paged"])
def test_an_empty_batch_from_cpp_does_not_divide_by_zero(spec):
    """Split-KV's chunks per sequence, ceil(split_tasks / (batch · kv_heads)), divided by zero
    for a batch of 0 (SIGFPE) when a C++ caller passed one (the loader answers empty calls
    itself)."""
    dev = tvm.cpu()
    lay = LAYOUTS[spec.layout]
    args = []
    for a in lay.all_args(spec):
        shape = tuple(0 if d == "batch" else {"seq_q": SQ, "max_len": 24, "num_pages": 4, "max_pages": 2}.get(d, d)
                      for d in lay.arg_specs(spec)[[b.name for b in lay.all_args(spec)].index(a.name)]["shape"])
        args.append(tvm.runtime.empty(shape, lay.arg_dtype(spec, a), dev))
    names = [a.name for a in lay.all_args(spec)]
    for s in ("k_scale", "v_scale"):
        if s in names:
            args[names.index(s)] = tvm.runtime.tensor(np.ones(spec.kv_heads, np.float32))
    kernel_of(built(spec)).function(*args)


# -- the spec: compiled-in values whose arithmetic would overflow (item 3) -------------------------
@pytest.mark.parametrize("window, side", [((4, 2**31 - 1), "right"), ((MAX_WINDOW + 1, 0), "left"),
                                          ((-1, 2**40), "right")])
def test_windows_past_the_range_are_refused_by_name(window, side):
    with pytest.raises(SpecError, match=rf"window: {side}=\d+ is out of range; each side is -1 \(unbounded\) or in "
                                        rf"\[0, {MAX_WINDOW}\]"):
        AttentionSpec(batch=1, heads=2, seq_q=8, head_dim=16, window=window)
    AttentionSpec(batch=1, heads=2, seq_q=8, head_dim=16, window=(MAX_WINDOW, MAX_WINDOW))


@pytest.mark.parametrize("cap", [1e-40, 1e40, 1e-7, 2e6])
def test_softcaps_past_float32_are_refused_by_name(cap):
    with pytest.raises(SpecError, match=r"softcap=.* is out of range: a cap is in \[1e-06, 1e\+06\]"):
        AttentionSpec(batch=1, heads=2, seq_q=8, head_dim=16, softcap=cap)
    assert AttentionSpec(batch=1, heads=2, seq_q=8, head_dim=16, softcap=50).softcap == 50.0


def test_lengths_and_pages_past_int32_indexing_are_refused_by_name():
    with pytest.raises(SpecError, match=r"seq_kv=1073741825 is longer than the longest sequence a kernel takes"):
        AttentionSpec(batch=1, heads=1, seq_q=1, seq_kv=MAX_SEQ_LEN + 1, head_dim=1)
    with pytest.raises(SpecError, match=r"page_size=268435456: one page of kv_heads=2 x head_dim=16 would hold more"):
        AttentionSpec(batch=1, heads=2, kv_heads=2, seq_q=1, head_dim=16, layout="paged", page_size=2**28)
