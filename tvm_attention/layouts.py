"""Serving layouts as data: one description per way of passing attention's tensors.

A :class:`Layout` entry says, for one argument layout:

* ``args``: the kernel's arguments in call order, each with its dims and dtype. A dim name is
  resolved against the spec (``heads``, ``kv_heads``, ``head_dim``, ``head_dim_v`` are always compiled in;
  ``batch``, ``seq_q``, ``seq_kv`` are too unless the spec lists them in ``dynamic``) or bound at
  call time (a symbolic dim, written in the manifest as its name; ``batch+1`` is one more than
  ``batch``). The workloads (PrimFunc signature), the manifest (``args``, ``symbolic_dims``) and the
  loader (shape checks, output shape) all read it;
* ``options``: keywords the loader accepts for FlashAttention compatibility and checks;
* ``check_indices``: what the kernel cannot check itself (``cu_seqlens``), so that through the
  loader it never reads out of bounds;
* ``reference``: its semantics, through the one BHSD float64 reference;
* ``validation_cases``/``random_inputs``: concrete inputs for validation, timing and the tests;
* its traits, what it decides for every other module, which reads them instead of its name:
  ``packed`` (the kernels' frame), ``addressing`` (its K/V addressing class in ``workloads.kv``),
  ``is_cache``, ``can_split``, ``paged``, ``index_checks`` (the rules its index arrays obey),
  ``capacity_dim``, ``always_dynamic`` and ``cli_defaults``/``cli_help`` (the CLI's).

Adding a layout is adding an entry here and its addressing class in ``workloads/kv.py``, not an
if-chain through every module (docs/design.md, "Adding a layout", works one example through).

Layouts:

``bhsd`` (default)
    ``q (batch, heads, seq_q, head_dim)``, ``k (batch, kv_heads, seq_kv, head_dim)``, ``v (batch,
    kv_heads, seq_kv, head_dim_v)``, ``o (batch, heads, seq_q, head_dim_v)``. Any of batch, seq_q,
    seq_kv may be symbolic. (Every layout: v, v_new and o have ``head_dim_v`` columns, the spec's
    ``v_dim``; k and q ``head_dim``.)
``varlen`` (FlashAttention's ``flash_attn_varlen_func``)
    ``q (total_q, heads, head_dim)``, ``k (total_k, kv_heads, head_dim)``, ``v (total_k, kv_heads,
    head_dim_v)``, ``cu_seqlens_q``/``cu_seqlens_k (batch+1,) int32``, ``o (total_q, heads, head_dim_v)``; batch,
    total_q and total_k are symbolic. Sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
    of q against rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k/v, causal bottom-right per
    sequence; a sequence with no key outputs zeros; empty sequences are allowed.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from .errors import SpecError
from .limits import MAX_SEQ_LEN
from .modifiers import tensor_dim_name
from .quant import SCALE_GROUP, check_scale, dequantize, qk_int8_query, quantize_kv
from .reference import reference_attention
from .visibility import Visibility


class KernelArgumentError(ValueError):
    """A kernel argument does not match the artifact's manifest (raised by the loader)."""


@dataclasses.dataclass(frozen=True)
class Arg:
    """One kernel argument: name, dim names, dtype (``None``: the spec's), and whether the
    kernel writes it (the output buffer the caller passes last)."""

    name: str
    dims: tuple[str, ...]
    dtype: str | None = None
    output: bool = False


#: The call arguments of the variants that take one (``spec.variants``), in call order: after the
#: layout's own inputs, before the outputs. Per query head, or per sequence (``batch``).
VARIANT_ARGS = (("alibi", Arg("alibi_slopes", ("heads",), "float32")),
                ("sinks", Arg("sinks", ("heads",), "float32")),
                ("kv_start", Arg("kv_start", ("batch",), "int32")))


#: Keywords of the compiled-in variants the loader accepts and checks against the artifact
#: (FlashAttention's names); ``cache_leftpad`` is FlashAttention's name of ``kv_start``.
VARIANT_OPTIONS = {"window_size": "must equal the artifact's window ((-1, -1): none)",
                   "softcap": "must equal the artifact's (0: none)"}
#: keyword -> the argument it names (FlashAttention's spelling of ours)
ARG_ALIASES = {"cache_leftpad": "kv_start"}


def _number(options: Mapping[str, Any], key: str) -> float | None:
    """Keyword ``key`` as a float (None when not passed), else a named error."""
    x = options.get(key)
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        raise KernelArgumentError(f"{key}: expected a number, got {x!r}") from None


def _check_variant_options(spec, options: Mapping[str, Any]) -> None:
    w = options.get("window_size")
    if w is not None:
        try:
            left, right = (int(x) for x in w)
        except (TypeError, ValueError):
            raise KernelArgumentError(f"window_size: expected (left, right), got {w!r}") from None
        mine = spec.window or (-1, 0 if spec.causal else -1)
        if spec.causal and right == -1:
            right = 0
        if (left, right) != tuple(mine):
            raise KernelArgumentError(
                f"window_size={tuple(w)!r}: this artifact was built with window={tuple(mine)!r} "
                f"(causal={spec.causal}); build another (--window)")
    c = _number(options, "softcap")
    if c is not None:
        mine = spec.softcap or 0.0
        if not np.isclose(c, mine, rtol=1e-6, atol=0.0):
            raise KernelArgumentError(f"softcap={options['softcap']!r}: this artifact was built with softcap={mine!r}; "
                                      "build another (--softcap)")


#: The key bounds' arguments (``spec.key_bounds``), after ``kv_start``: row ``p`` of sequence
#: ``b`` sees keys ``key_lo[b, p] <= j < key_hi[b, p]`` only (``p`` clamped into the columns).
KEY_BOUND_ARGS = (Arg("key_lo", ("batch", "key_positions"), "int32"),
                  Arg("key_hi", ("batch", "key_positions"), "int32"))
#: A custom mask's arguments (``spec.custom_mask``), after the key bounds: FlashInfer's packed
#: bits (``tvm_attention.masks``) and each sequence's first byte, ``mask_indptr (batch + 1,)``
CUSTOM_MASK_ARGS = (Arg("custom_mask", ("mask_bytes",), "uint8"), Arg("mask_indptr", ("mask_rows",), "int32"))


#: The scales of an 8-bit K/V cache (``spec.kv_dtype``), after the variant arguments: the value of
#: a stored element of kv head ``h`` is ``scale[h] · stored``.
KV_SCALE_ARGS = (Arg("k_scale", ("kv_heads",), "float32"), Arg("v_scale", ("kv_heads",), "float32"))
#: The scale of fp8 queries (``spec.q_dtype``), before ``k_scale``: the value of a stored element
#: of query head ``h`` is ``q_scale[h] · stored`` (a per-tensor scale: the same in every entry).
Q_SCALE_ARG = Arg("q_scale", ("heads",), "float32")
#: ... of a latent cache (MLA): one array, K's and V's (V is the rows' first head_dim_v columns)
LATENT_SCALE = "kv_scale"
#: The new tokens' keys and values of an appending kernel (``spec.append``), last of the inputs, in
#: the query dtype: written into the cache at ``cache_seqlens[b] ..`` and attended to.
KV_NEW_ARGS = (Arg("k_new", ("batch", "kv_heads", "seq_q", "head_dim")),
               Arg("v_new", ("batch", "kv_heads", "seq_q", "head_dim_v")))
#: ... of a latent layout (MLA): the new tokens' latent rows, one per token for every head (V is
#: a row's first head_dim_v columns, as in the cache)
LATENT_NEW_ARGS = (Arg("kv_new", ("batch", "seq_q", "head_dim")),)


#: The output of a CUDA build with device-side index checks (``spec.device_checks``), after ``o``
#: and ``lse``: the call's violation bits (:data:`INDEX_ERROR_BITS`), 0 when every index array is
#: valid; the kernel always writes it. The output is undefined when it is not 0.
INDEX_ERROR_ARG = Arg("index_error", (1,), "int32", output=True)

#: ``index_error``'s bits: bit -> (the argument, the rule it broke). The rules are
#: ``Layout.check_indices``' (and ``workloads.index_checks``' host asserts): one definition of a
#: valid call.
INDEX_ERROR_BITS = {
    1: ("cu_seqlens_q", "must start at 0, be non-decreasing and end at total_q (rows of q)"),
    2: ("cu_seqlens_k", "must start at 0, be non-decreasing and end at total_k (rows of k and v)"),
    4: ("cache_seqlens", "an entry is negative or, with the appended keys, past the cache (kvcache: max_len; "
                         "paged: max_pages * page_size)"),
    8: ("block_table", "an entry a sequence uses (j < ceil(keys / page_size)) is not in [0, num_pages)"),
    16: ("kv_start", "an entry is negative or larger than its sequence's keys"),
    32: ("k_scale", "an entry is not a positive finite number (an 8-bit cache's scale per KV head)"),
    64: ("v_scale", "an entry is not a positive finite number (an 8-bit cache's scale per KV head)"),
    128: ("alignment", "q, k, v and o must start on a 16-byte boundary (cp.async and 16-byte vector loads "
                       "read them; a view at an odd offset does not)"),
    256: ("q_scale", "an entry is not a positive finite number (fp8 queries' scale per query head)"),
    512: ("mask_indptr", "must hold batch + 1 entries; a sequence's bytes [mask_indptr[b], mask_indptr[b + 1]) "
                         "start at 0 or more, end within custom_mask and hold ceil(rows * keys / 8) or more"),
}


#: Dims that count a sequence's rows or keys (or every sequence's, packed): at most
#: ``limits.MAX_SEQ_LEN`` each, checked by the library (``build.arg_bounds``) and the loader.
SEQUENCE_DIMS = ("seq_q", "seq_kv", "max_len", "total_q", "total_k")


def has_index_arrays(spec) -> bool:
    """Whether ``spec``'s kernel takes index arrays a device check can validate (varlen's
    cu_seqlens, the caches' cache_seqlens and block_table, ``kv_start``, a custom mask's
    ``mask_indptr``)."""
    return (bool(get_layout(getattr(spec, "layout", "bhsd")).index_args) or bool(getattr(spec, "kv_start", False))
            or getattr(spec, "kv_dtype", None) is not None or bool(getattr(spec, "custom_mask", False)))


def describe_index_error(mask: int) -> str:
    """The message of a non-zero ``index_error`` value: each broken rule, by argument name."""
    mask = int(mask)
    parts = [f"{name}: {rule}" for bit, (name, rule) in INDEX_ERROR_BITS.items() if mask & bit]
    unknown = mask & ~sum(INDEX_ERROR_BITS)
    if unknown:
        parts.append(f"unknown bits {unknown:#x} (a library newer than this loader?)")
    return (f"the kernel's device-side index checks refused the call (index_error={mask}); the output is "
            "undefined. " + "; ".join(parts))


def variant_args(spec) -> tuple[Arg, ...]:
    """The variant arguments ``spec``'s kernel takes, in call order: ``alibi_slopes``, ``sinks``,
    ``kv_start``, ``key_lo``, ``key_hi``, ``custom_mask``, ``mask_indptr``, the modifiers' tensors (``spec.mod_tensors``: their
    declared dims in a fully static kernel, else each dim taken at call time), fp8 queries'
    ``q_scale`` (:data:`Q_SCALE_ARG`), an 8-bit cache's ``k_scale``, ``v_scale``
    (:data:`KV_SCALE_ARGS`), then an appending kernel's ``k_new``,
    ``v_new`` (:data:`KV_NEW_ARGS`; a latent layout's ``kv_new``, :data:`LATENT_NEW_ARGS`)."""
    out = tuple(a for flag, a in VARIANT_ARGS if getattr(spec, flag, False))
    static = fully_static(spec)
    if getattr(spec, "key_bounds", False):
        out += tuple(Arg(a.name, ("batch", "seq_kv"), a.dtype) for a in KEY_BOUND_ARGS) if static else KEY_BOUND_ARGS
    if getattr(spec, "custom_mask", False):  # a static kernel's: every sequence's whole mask, packed
        out += ((Arg("custom_mask", (spec.batch * -(-spec.seq_q * spec.seq_kv // 8),), "uint8"),
                 Arg("mask_indptr", (spec.batch + 1,), "int32")) if static else CUSTOM_MASK_ARGS)
    for name, dtype, dims in getattr(spec, "mod_tensors", ()):
        shape = tuple(dims) if static else tuple(tensor_dim_name(name, i) for i in range(len(dims)))
        out += (Arg(name, shape, dtype),)
    if getattr(spec, "q_dtype", None) is not None:
        out += (Q_SCALE_ARG,)
    if getattr(spec, "kv_dtype", None) is not None:
        out += kv_scale_args(spec)
    if getattr(spec, "append", False):
        out += LATENT_NEW_ARGS if get_layout(spec.layout).latent else KV_NEW_ARGS
    return out


def kv_scale_args(spec) -> tuple[Arg, ...]:
    """An 8-bit cache's ``k_scale``/``v_scale``: :data:`KV_SCALE_ARGS` per kv head; per token the
    dims of K without head_dim (kvcache ``(batch, kv_heads, max_len)``, paged ``(num_pages,
    page_size, kv_heads)``, varlen ``(total_k, kv_heads)``), per group those and ``head_dim / 32``
    (``head_dim_v / 32`` for ``v_scale``; ``spec.kv_scale``, ``quant.scale_shape``). A latent
    cache (MLA) has one, ``kv_scale``: ``(1,)``, per token ``(batch, max_len)`` (paged
    ``(num_pages, page_size)``), per group with ``head_dim / 32`` (V's are the first
    ``head_dim_v / 32``)."""
    granularity = getattr(spec, "kv_scale", "head")
    layout = get_layout(spec.layout)
    if layout.latent:  # one cache, one scale array: V's scales are K's (per group: its first groups)
        dims = {"head": ("kv_heads",), "token": layout.args[1].dims[:-1],
                "group": layout.args[1].dims[:-1] + (spec.head_dim // SCALE_GROUP,)}[granularity]
        return (Arg(LATENT_SCALE, dims, "float32"),)
    if granularity == "head":
        return KV_SCALE_ARGS
    dims = layout.args[1].dims[:-1]
    if granularity == "token":
        return tuple(Arg(a.name, dims, "float32") for a in KV_SCALE_ARGS)
    k_scale, v_scale = KV_SCALE_ARGS  # per group: head_dim / 32 of K's, head_dim_v / 32 of V's
    return (Arg(k_scale.name, dims + (spec.head_dim // SCALE_GROUP,), "float32"),
            Arg(v_scale.name, dims + (spec.v_dim // SCALE_GROUP,), "float32"))


def kv_scale_names(spec) -> tuple[str, ...]:
    """The names of an 8-bit cache's scale arguments (:func:`kv_scale_args`)."""
    return tuple(a.name for a in kv_scale_args(spec))


def fully_static(spec) -> bool:
    """Whether every shape of ``spec``'s kernel is compiled in (bhsd, no dynamic dim): its key
    bounds are then ``(batch, seq_kv)`` and its modifiers' tensors have their declared dims;
    otherwise every dim of theirs is taken at call time. (MetaSchedule tunes the static
    representative, and takes static shapes only.)"""
    return not get_layout(getattr(spec, "layout", "bhsd")).always_dynamic and not getattr(spec, "dynamic", ())


#: The widest right bound the validation cases add rows for (the rows cost ``R`` + a few query
#: rows each): a wider window takes the same kernel formula, checked at the narrower ones in the
#: tests; without the cap a window of 2**29 (the spec's limit) would validate 2**29 rows.
RIGHT_BOUND_CASE_ROWS = 4096


def right_bound(spec) -> int:
    """``R`` of a window bounded on the right past the row's own key (``window=(L, R)``, ``0 < R
    <= RIGHT_BOUND_CASE_ROWS``), else 0: the validation cases add rows it leaves without a key.
    A row at position ``p < −R`` then sees no key although its sequence has keys: ``seq_q >
    seq_kv + R`` gives ``seq_q − seq_kv − R`` such rows (as causal does for ``R = 0``)."""
    w = getattr(spec, "window", None)
    return w[1] if w is not None and 0 < w[1] <= RIGHT_BOUND_CASE_ROWS else 0


def right_bound_hides_a_row(spec, seq_q: int, seq_kv: int) -> bool:
    """Whether a sequence of ``seq_q`` rows and ``seq_kv`` keys (at least one) has a row that
    :func:`right_bound` leaves without a key."""
    r = right_bound(spec)
    return r > 0 and seq_kv > 0 and seq_q > seq_kv + r


def _bound_dim(name: str) -> tuple[str, int]:
    """``"batch+1"`` -> ("batch", 1); ``"seq_q"`` -> ("seq_q", 0)."""
    if name.endswith("+1"):
        return name[:-2], 1
    return name, 0


class Layout:
    """Base of the layout entries; see the module docstring."""

    name = "?"
    manifest_name = "?"  # the manifest's "layout" value
    title = ""
    args: tuple[Arg, ...] = ()
    #: symbolic whatever the spec says (varlen: the batch and every length are per call)
    always_dynamic: tuple[str, ...] = ()
    #: keyword -> what the loader does with it (documentation; checked in check_options)
    options: Mapping[str, str] = {}
    #: dims of the optional ``lse`` output (``spec.return_lse``), written after ``o``
    lse_dims: tuple[str, ...] = ("batch", "heads", "seq_q")
    #: K/V come from a pool of pages (``spec.page_size`` keys each)
    paged = False
    default_page_size = 16
    #: the kv-head axis of K and V (arguments 1 and 2): where an 8-bit cache's scales apply
    kv_head_axis = 1

    @property
    def q_head_axis(self) -> int:
        """The head axis of q (argument 0): where fp8 queries' ``q_scale`` applies."""
        return self.args[0].dims.index("heads")
    #: one latent cache holds K and V (MLA): argument 1 is K, V its first ``head_dim_v`` columns;
    #: one kv head; the index arrays follow it
    latent = False

    # -- what the layout decides for the rest of the library (its traits) ----------------------
    #: q and o pack every sequence's rows ``(total_q, H, D)``, found through ``cu_seqlens`` (the
    #: kernels' packed frames: ``fused._varlen``, ``fused_cuda.varlen_grid``); otherwise they are
    #: dense ``(B, H, Sq, D)`` and the kernels address K/V through :attr:`addressing`
    packed = False
    #: the dense-query layouts' K/V addressing: the name of its class in ``workloads.kv`` (a
    #: ``KVLayout``: K/V's shape, a sequence's key count and regions, a key's index); None: packed
    addressing: str | None = None
    #: K/V are a cache of ``cache_seqlens[b]`` keys per sequence: a kernel may append
    #: ``k_new``/``v_new`` (``spec.append``), and its tiles pack a KV head's query group (decode)
    is_cache = False
    #: the decode kernels may split a sequence's keys across tasks (split-KV: the CUDA grid's
    #: ``split_tasks``, the CPU decode nests')
    can_split = False
    #: the rules its index arrays obey, checked by the loader (:meth:`check_indices`), the host
    #: asserts and the device check (``workloads.index_checks``): ``cu_seqlens`` (offsets from 0,
    #: non-decreasing, ending at the rows), ``cache_seqlens`` (each length within the cache's keys:
    #: :attr:`capacity_dim` of K, or ``max_pages * page_size`` when paged), ``block_table`` (each
    #: entry in use is a page)
    index_checks: tuple[str, ...] = ()
    #: the K/V dim that bounds a cache's keys per sequence (``max_len``), when not paged
    capacity_dim = "max_len"
    #: the CLI's representative values of ``batch``/``seq_q``/``seq_kv`` given as plain ``dyn``
    #: (or, for a layout that takes them at call time, :attr:`always_dynamic`, not given);
    #: ``seq_kv`` None: ``seq_q``'s
    cli_defaults: Mapping[str, int | None] = {"batch": 1, "seq_q": 1024, "seq_kv": None}
    #: what ``--layout``'s help says of it
    cli_help = ""

    # -- the argument list ---------------------------------------------------------------------
    @property
    def inputs(self) -> tuple[Arg, ...]:
        return tuple(a for a in self.args if not a.output)

    def all_args(self, spec) -> tuple[Arg, ...]:
        """The arguments of ``spec``'s kernel in call order: the inputs of ``args``, the variant
        arguments (``alibi_slopes``, ``sinks``, ``kv_start``: :data:`VARIANT_ARGS`), the output
        ``o``, then ``lse`` when the spec returns it, then ``index_error`` (:data:`INDEX_ERROR_ARG`)
        with device-side index checks."""
        lse = (Arg("lse", self.lse_dims, "float32", output=True),) if getattr(spec, "return_lse", False) else ()
        err = (INDEX_ERROR_ARG,) if getattr(spec, "device_checks", False) else ()
        return self.inputs + variant_args(spec) + (self.output,) + lse + err

    def inputs_of(self, spec) -> tuple[Arg, ...]:
        """The inputs of ``spec``'s kernel in call order (the layout's, then the variants')."""
        return self.inputs + variant_args(spec)

    @property
    def n_data(self) -> int:
        """The data inputs before the index arrays: q, k, v (3), or q and a latent cache (2)."""
        return 2 if self.latent else 3

    @property
    def data_names(self) -> tuple[str, ...]:
        """Their names: ``("q", "k", "v")``, ``("q", "kv_cache")``..."""
        return tuple(a.name for a in self.inputs[:self.n_data])

    def index_names(self, spec) -> tuple[str, ...]:
        """Inputs after the data inputs (q, k, v) of ``spec``'s kernel (index arrays, then
        variant arguments): passed positionally or by keyword."""
        return tuple(a.name for a in self.inputs_of(spec)[self.n_data:])

    def outputs(self, spec) -> tuple[Arg, ...]:
        return tuple(a for a in self.all_args(spec) if a.output)

    @property
    def index_args(self) -> tuple[Arg, ...]:
        """Inputs after the data inputs (``cu_seqlens_q``, ...): passed positionally or by keyword."""
        return self.inputs[self.n_data:]

    @property
    def output(self) -> Arg:
        return next(a for a in self.args if a.output)

    def dims(self, spec) -> dict[str, int | str]:
        """Dim name -> its compiled-in value, or the name itself when symbolic."""
        raise NotImplementedError

    @property
    def capacity_axis(self) -> int:
        """The axis of K (and V) that bounds a (not paged) cache's keys: :attr:`capacity_dim`'s."""
        return self.args[1].dims.index(self.capacity_dim)

    @property
    def kv_names(self) -> tuple[str, str]:
        """The names of the K and V arguments (the second and third; a latent cache's twice)."""
        return (self.args[1].name,) * 2 if self.latent else (self.args[1].name, self.args[2].name)

    def mask_shapes(self, spec, given: Mapping[str, Any]) -> list[tuple[int, int]]:
        """Each sequence's custom-mask shape ``(query rows, keys)`` in a call's arguments
        ``given`` (by name): bhsd ``(seq_q, seq_kv)`` for every sequence; overridden where the
        lengths are per sequence."""
        q, k = np.shape(given["q"]), np.shape(given[self.args[1].name])
        return [(int(q[2]), int(k[2]))] * int(q[0])

    def arg_dtype(self, spec, arg: Arg) -> str:
        """``arg``'s dtype in ``spec``'s kernel: its own, K/V's ``spec.kv_dtype_name`` (an 8-bit
        cache), q's ``spec.q_dtype_name`` (fp8 inputs), else the spec's."""
        if arg.dtype is not None:
            return arg.dtype
        if arg.name == "q":
            return getattr(spec, "q_dtype_name", spec.dtype)
        return getattr(spec, "kv_dtype_name", spec.dtype) if arg.name in self.kv_names else spec.dtype

    def arg_specs(self, spec) -> list[dict[str, Any]]:
        dims = self.dims(spec)
        return [{"name": a.name, "shape": [_resolve(dims, d) for d in a.dims], "dtype": self.arg_dtype(spec, a)}
                for a in self.all_args(spec)]

    @property
    def scaled_caches(self) -> tuple[tuple[str, str], ...]:
        """An 8-bit cache's (cache, its scales) argument names: K's and V's, or a latent layout's
        one cache and its ``kv_scale``."""
        if self.latent:
            return ((self.kv_names[0], LATENT_SCALE),)
        return tuple(zip(self.kv_names, ("k_scale", "v_scale")))

    def _headed(self, x: np.ndarray) -> np.ndarray:
        """A latent cache (or its per-token/per-group scales) with a kv-head axis of 1 at
        :attr:`kv_head_axis`, as ``quant`` takes caches; other layouts' arrays as they are."""
        return np.expand_dims(x, self.kv_head_axis) if self.latent else x

    def _unheaded(self, x: np.ndarray) -> np.ndarray:
        return np.squeeze(x, self.kv_head_axis) if self.latent else x

    def quantized(self, spec, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``arrays`` (random inputs, K/V in ``spec.dtype``) with K/V quantized to an 8-bit cache
        of ``spec.kv_dtype`` and their scales ``k_scale``/``v_scale`` added; unchanged otherwise."""
        if getattr(spec, "kv_dtype", None) is None:
            return arrays
        out = dict(arrays)
        for name, scale in self.scaled_caches:
            x = self._headed(arrays[name]).astype(np.float32)
            xq, sc = quantize_kv(x, spec.kv_dtype, self.kv_head_axis, granularity=spec.kv_scale)
            out[name], out[scale] = self._unheaded(xq), sc if spec.kv_scale == "head" else self._unheaded(sc)
        if spec.kv_scale != "head" and "cache_seqlens" in arrays:
            self._poison_unused_scales(spec, out)
        if getattr(spec, "q_dtype", None) is not None:  # fp8 inputs: q per query head too
            out["q"], out[Q_SCALE_ARG.name] = quantize_kv(arrays["q"].astype(np.float32), spec.q_dtype,
                                                          self.q_head_axis)
        return out

    def _poison_unused_scales(self, spec, arrays: dict[str, np.ndarray]) -> None:
        """Per-token or per-group scales of a cache's unused rows (past each sequence's
        ``cache_seqlens``, spare pages; an appending kernel's new keys' too, which it writes) set
        to NaN: a kernel that read one would make its rows NaN, so every validation proves it
        reads the scales of the keys it attends to only."""
        names = [scale for _, scale in self.scaled_caches]
        scale = arrays[names[0]]
        used = np.zeros(scale.shape[:-1] if spec.kv_scale == "group" else scale.shape, bool)
        for b, n in enumerate(arrays["cache_seqlens"]):
            self.write_keys(spec, arrays, used, b, 0, np.ones((spec.kv_heads, max(int(n), 0)), bool))
        for name in names:
            arrays[name] = arrays[name].copy()
            arrays[name][~used] = np.nan

    def appended(self, spec, arrays: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """``arrays`` of an appending kernel (``spec.append``) as they are once ``k_new``/``v_new``
        are written into copies of the caches (quantized with the call's scales for an 8-bit
        cache; with per-token or per-group scales, with their own, written into copies of the
        scales beside them) and ``cache_seqlens`` counts them; unchanged for other specs."""
        if not getattr(spec, "append", False):
            return arrays
        out = dict(arrays)
        lens = arrays["cache_seqlens"]
        if self.latent:  # one latent row per new token, for K and V alike
            name, scale = self.scaled_caches[0]
            x = arrays["kv_new"][:, None]  # (batch, 1, seq_q, D): one kv head
            if getattr(spec, "kv_scale", "head") != "head":  # each new row's own scales
                x, sc = quantize_kv(x.astype(np.float32), spec.kv_dtype, 1, granularity=spec.kv_scale)
                out[scale] = arrays[scale].copy()
                for b in range(len(lens)):
                    self.write_keys(spec, arrays, out[scale], b, int(lens[b]), sc[b])
            elif getattr(spec, "kv_dtype", None) is not None:
                x = quantize_kv(x.astype(np.float32), spec.kv_dtype, 1, scale=arrays[scale])[0]
            cache = arrays[name].copy()
            for b in range(len(lens)):
                self.write_keys(spec, arrays, cache, b, int(lens[b]), x[b])
            return {**out, name: cache, "cache_seqlens": (lens + arrays["kv_new"].shape[1]).astype(np.int32)}
        sq = arrays["k_new"].shape[2]
        fine = getattr(spec, "kv_scale", "head") != "head"
        for name, new, scale in zip(self.kv_names, ("k_new", "v_new"), ("k_scale", "v_scale")):
            x = arrays[new]
            if fine:  # the new keys' own scales, written beside them
                x, s = quantize_kv(x.astype(np.float32), spec.kv_dtype, 1, granularity=spec.kv_scale)
                scales = arrays[scale].copy()
                for b in range(len(lens)):
                    self.write_keys(spec, arrays, scales, b, int(lens[b]), s[b])
                out[scale] = scales
            elif getattr(spec, "kv_dtype", None) is not None:
                x = quantize_kv(x.astype(np.float32), spec.kv_dtype, 1, scale=arrays[scale])[0]
            cache = arrays[name].copy()
            for b in range(len(lens)):
                self.write_keys(spec, arrays, cache, b, int(lens[b]), x[b])
            out[name] = cache
        out["cache_seqlens"] = (lens + sq).astype(np.int32)
        return out

    def write_keys(self, spec, arrays, cache: np.ndarray, b: int, start: int, x: np.ndarray) -> None:
        """Write ``x (KH, n, ...)`` into sequence ``b``'s keys ``start .. start + n - 1`` of
        ``cache`` (K or V, ``(..., D)``, or their per-token or per-group scales)."""
        cache[b, :, start:start + x.shape[1]] = x

    def dequantized(self, spec, arrays: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """``arrays`` with an 8-bit cache's K/V read as float64 values (``scale · stored``), and
        with ``qk_int8`` q rounded to int8 per row (``quant.qk_int8_query``): what the reference
        attends to; unchanged for other specs."""
        if getattr(spec, "kv_dtype", None) is None:
            return arrays
        out = dict(arrays)
        for name, scale in self.scaled_caches:
            sc = arrays[scale] if spec.kv_scale == "head" else self._headed(arrays[scale])
            out[name] = self._unheaded(dequantize(self._headed(arrays[name]), sc, self.kv_head_axis, spec.kv_scale))
        if getattr(spec, "qk_int8", False):  # the queries as QKᵀ reads them: rounded to int8 per row
            out["q"] = qk_int8_query(arrays["q"])
        if getattr(spec, "q_dtype", None) is not None:  # fp8 queries: scale · stored
            out["q"] = dequantize(arrays["q"], arrays[Q_SCALE_ARG.name], self.q_head_axis)
        return out

    def symbolic_dims(self, spec) -> list[str]:
        """Names of the dims bound at call time, in order of first appearance."""
        out: list[str] = []
        for a in self.arg_specs(spec):
            for d in a["shape"]:
                if isinstance(d, str) and _bound_dim(d)[0] not in out:
                    out.append(_bound_dim(d)[0])
        return out

    # -- loader hooks --------------------------------------------------------------------------
    def check_indices(self, arrays: Mapping[str, np.ndarray], bound: Mapping[str, int], spec=None) -> None:
        """Raise :class:`KernelArgumentError` for index arrays (and variant arguments of
        ``spec``'s kernel) the kernel would misread."""

    def all_options(self) -> dict[str, str]:
        """``options`` and the variants' compiled-in keywords (FlashAttention's names)."""
        return {**self.options, **VARIANT_OPTIONS}

    def check_options(self, spec, options: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """FlashAttention's ``causal``/``softmax_scale``/``window_size``/``softcap`` keywords, when
        passed, must be what the artifact was built with (a kernel cannot change them at call
        time)."""
        _check_variant_options(spec, options)
        if "causal" in options and options["causal"] is not None and bool(options["causal"]) != spec.causal:
            raise KernelArgumentError(
                f"causal={options['causal']!r}: this artifact was built with causal={spec.causal}; build another"
            )
        s = options.get("softmax_scale")
        s_value = _number(options, "softmax_scale")
        if s_value is not None and not np.isclose(s_value, spec.scale, rtol=1e-6, atol=0.0):
            raise KernelArgumentError(
                f"softmax_scale={s!r}: this artifact was built with scale={spec.scale!r}; build another (--scale)"
            )

    # -- semantics and inputs ------------------------------------------------------------------
    def reference(self, spec, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """The float64 output ``o`` for ``arrays`` (the inputs by name)."""
        return self.reference_outputs(spec, arrays)[0]

    def reference_outputs(self, spec, arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Float64 ``(o, lse)``: the output and each row's log-sum-exp (``lse_dims``)."""
        raise NotImplementedError

    def kv_bytes(self, spec, case: Mapping[str, Any]) -> int:
        """Bytes of K and V a kernel must read at ``case``: every visible key of every sequence
        once per kv head (the decode roofline's numerator)."""
        raise NotImplementedError

    def validation_cases(self, spec) -> list[dict[str, Any]]:
        raise NotImplementedError

    def random_inputs(self, spec, case: Mapping[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def case_dims(self, spec, case: Mapping[str, Any]) -> dict[str, int]:
        """The symbolic dims' values at ``case`` (the shapes :meth:`random_inputs` makes, without
        making them); the layouts a symbolic kernel is tuned in (paged) have it."""
        raise NotImplementedError

    def useful_flops(self, spec, case: Mapping[str, Any]) -> float:
        """4·D·H per visible (query, key) pair: the work a kernel cannot avoid."""
        raise NotImplementedError

    def describe_case(self, case: Mapping[str, Any]) -> str:
        return ", ".join(f"{k}={v}" for k, v in case.items())

    def name_row(self, arrays: Mapping[str, np.ndarray], index: tuple[int, ...], lse: bool = False) -> str:
        """Row ``index`` of ``o`` (its index without head_dim) or, ``lse``, of the log-sum-exp,
        in words (what a failed validation names): ``batch 0 head 1 row 3``."""
        b, h, i = index
        return f"batch {b} head {h} row {i}"


def _resolve(dims: Mapping[str, int | str], name: str | int) -> int | str:
    if isinstance(name, int):  # a modifier tensor's declared size
        return name
    base, plus = _bound_dim(name)
    if base not in dims:  # a variant argument's own dim (key_positions, a mod tensor's): symbolic
        return name
    v = dims[base]
    if isinstance(v, str):
        return name
    return v + plus


def _rng_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def alibi_slopes(heads: int) -> np.ndarray:
    """``(heads,)`` float32: the ALiBi paper's slopes (``2^(-8i/n)`` for ``i = 1..n``, n the
    largest power of two ≤ heads, then every other slope of ``2n`` for the rest), as Bloom,
    MPT and FlashAttention's tests make them."""
    def powers(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    n = 1 << (heads.bit_length() - 1)
    out = powers(n) + powers(2 * n)[0::2][:heads - n]
    return np.asarray(out, np.float32)


def variant_inputs(spec, key_counts, seed: int = 0, query_rows: int | None = None,
                   query_counts=None) -> dict[str, np.ndarray]:
    """The variant arguments ``spec``'s kernel takes, for sequences of ``key_counts`` keys (and
    ``query_counts`` query rows each; default ``query_rows`` every one): ALiBi's standard slopes,
    random sink logits, a ``kv_start`` per sequence in ``[0, keys]`` (the second sequence, when
    there is one, hides every key), key bounds of random documents (:func:`document_bounds`), a
    random custom mask (:func:`random_custom_mask`) and the modifiers' tensors
    (:func:`mod_tensor_inputs`). Drawn from a generator of their own, so that a plain spec's
    inputs stay what they were."""
    rng = np.random.default_rng(seed + 7919)
    out = {}
    if getattr(spec, "alibi", False):
        out["alibi_slopes"] = alibi_slopes(spec.heads)
    if getattr(spec, "sinks", False):
        out["sinks"] = (rng.standard_normal(spec.heads) * 2).astype(np.float32)
    if getattr(spec, "kv_start", False):
        n = [int(x) for x in key_counts]
        start = [int(rng.integers(0, k + 1)) for k in n]
        if len(n) > 1:
            start[1] = n[1]
        out["kv_start"] = np.asarray(start, np.int32)
    if getattr(spec, "key_bounds", False):
        out["key_lo"], out["key_hi"] = document_bounds(key_counts, rng)
    if getattr(spec, "custom_mask", False):
        rows = [int(query_rows or 1)] * len(key_counts) if query_counts is None else [int(x) for x in query_counts]
        out["custom_mask"], out["mask_indptr"] = random_custom_mask(rows, [int(x) for x in key_counts], rng)
    out.update(mod_tensor_inputs(spec, key_counts, rng, query_rows))
    return out


def random_custom_mask(query_counts, key_counts, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A packed custom mask (``tvm_attention.masks``) of sequences of ``query_counts`` rows and
    ``key_counts`` keys: each bit set with probability 3/4, the keys of the sequence's second
    quarter hidden from every row (whole key tiles no row sees, at tile-sized lengths), and in
    the second sequence (when there is one) its first row sees no key (a zero row)."""
    from .masks import pack_mask  # beside the data it packs

    masks = []
    for b, (q, k) in enumerate(zip(query_counts, key_counts)):
        m = rng.random((q, k)) < 0.75
        m[:, k // 4:k // 2] = False
        if b == 1 and q:
            m[0] = False
        masks.append(m)
    return pack_mask(masks)


def document_bounds(key_counts, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(key_lo, key_hi) (batch, positions)`` int32 of random documents: each sequence's
    positions cut into documents at random, a row sees its own document's keys; in the second
    sequence (when there is one) the first document's rows see no key."""
    n = [int(x) for x in key_counts]
    width = max(n + [1])
    lo = np.zeros((len(n), width), np.int32)
    hi = np.zeros((len(n), width), np.int32)
    for b in range(len(n)):
        cuts = np.sort(rng.choice(np.arange(1, width), size=min(3, width - 1), replace=False)) if width > 1 else []
        edges = [0, *[int(c) for c in cuts], width]
        for i, (a, e) in enumerate(zip(edges[:-1], edges[1:])):
            lo[b, a:e], hi[b, a:e] = a, e
            if b == 1 and i == 0:
                hi[b, a:e] = a
    return lo, hi


def mod_tensor_inputs(spec, key_counts, rng: np.random.Generator, query_rows: int | None = None) -> dict:
    """Random values of the modifiers' tensors (``spec.mod_tensors``), their declared dims sized
    by the case: ``batch`` the sequences, ``seq_kv`` the most keys, ``seq_q`` the query rows.
    int32 tensors hold small non-decreasing ids along their last dim (document ids), float32
    ones standard normals."""
    n = [int(x) for x in key_counts]
    size = {"batch": max(len(n), 1), "seq_kv": max(n + [1]), "seq_q": max(query_rows or 1, 1),
            "heads": spec.heads, "kv_heads": spec.kv_heads}
    out = {}
    for name, dtype, dims in getattr(spec, "mod_tensors", ()):
        shape = tuple(d if isinstance(d, int) else size[d] for d in dims)
        if dtype == "int32":
            out[name] = np.sort(rng.integers(0, 3, size=shape), axis=-1).astype(np.int32)
        else:
            out[name] = rng.standard_normal(shape).astype(np.float32)
    return out


def variant_kwargs(spec, arrays: Mapping[str, np.ndarray], b: int | None = None) -> dict[str, Any]:
    """The reference's keywords for the variant arguments among ``arrays`` (for sequence ``b``
    alone when ``b`` is given: its ``kv_start``, and ``seq_index=b``)."""
    out: dict[str, Any] = {n: arrays[n] for n in ("alibi_slopes", "sinks", "key_lo", "key_hi") if n in arrays}
    if "mask_indptr" in arrays:
        out["custom_mask"] = (arrays["custom_mask"], arrays["mask_indptr"])
    if "kv_start" in arrays:
        out["kv_start"] = arrays["kv_start"] if b is None else arrays["kv_start"][b:b + 1]
    if getattr(spec, "mod_tensors", ()):
        out["mod_tensors"] = {n: arrays[n] for n, _, _ in spec.mod_tensors if n in arrays}
    if b is not None and getattr(spec, "has_modifiers", False):
        out["seq_index"] = b
    return out


def check_variant_arrays(spec, arrays: Mapping[str, np.ndarray], key_counts, batch: int, query_counts=None) -> None:
    """The variant arguments the kernel cannot misread, else :class:`KernelArgumentError`:
    ``kv_start`` (:func:`check_kv_start`), key bounds with one row per sequence, at least one
    column, non-decreasing along the positions (a row tile's bounds are its first row's ``key_lo``
    and its last row's ``key_hi``), a custom mask whose ``mask_indptr`` gives each sequence
    (``query_counts`` rows, ``key_counts`` keys) its bytes (:func:`check_custom_mask`), an 8-bit
    cache's scales positive and finite, and modifier tensors with no empty dim."""
    check_kv_start(arrays, key_counts)
    if getattr(spec, "custom_mask", False):
        query_counts = np.shape(arrays["q"])[2] if query_counts is None else query_counts
        check_custom_mask(arrays, np.broadcast_to(np.asarray(query_counts, np.int64), (batch,)),
                          np.broadcast_to(np.asarray(key_counts, np.int64), (batch,)), batch)
    if getattr(spec, "key_bounds", False):
        for name in ("key_lo", "key_hi"):
            x = arrays[name]
            if x.shape[0] != batch or x.shape[1] < 1:
                raise KernelArgumentError(f"{name}: expected (batch={batch}, positions >= 1), got {x.shape}")
            steps = np.diff(x.astype(np.int64), axis=1)
            if steps.size and steps.min() < 0:
                b, p = (int(i) for i in np.argwhere(steps < 0)[0])
                raise KernelArgumentError(
                    f"{name}: must be non-decreasing along the positions, but {name}[{b}, {p + 1}]={int(x[b, p + 1])} "
                    f"< {name}[{b}, {p}]={int(x[b, p])} (the kernel skips key tiles by the bounds of a row tile's "
                    "first and last rows)")
    if getattr(spec, "kv_dtype", None) is not None and getattr(spec, "kv_scale", "head") == "head":
        # (kv_heads,): the shape is the loader's generic check. Finer scales are data: the kernel
        # reads those of the keys it attends to (a bad one makes its rows NaN: quant's docstring)
        names = kv_scale_names(spec) + ((Q_SCALE_ARG.name,) if getattr(spec, "q_dtype", None) else ())
        for name in names:
            try:
                check_scale(arrays[name], arrays[name].shape[0], name)
            except SpecError as e:
                raise KernelArgumentError(str(e)) from None
    for name, _, _ in getattr(spec, "mod_tensors", ()):
        if 0 in arrays[name].shape:
            raise KernelArgumentError(f"{name}: has an empty dim {arrays[name].shape}; a modifier's tensor is read "
                                      "with its indices clamped into it, which needs at least one element")


def check_custom_mask(arrays: Mapping[str, np.ndarray], query_counts, key_counts, batch: int) -> None:
    """``mask_indptr (batch + 1,)``: starts at 0 or more, never falls, gives sequence ``b`` at
    least ``ceil(query_counts[b] · key_counts[b] / 8)`` bytes (in int64: no product wraps) and ends
    within ``custom_mask``; the library checks the same rules (``index_checks._custom_mask``)."""
    ind, n = arrays["mask_indptr"].astype(np.int64), arrays["custom_mask"].shape[0]
    if ind.shape != (batch + 1,):
        raise KernelArgumentError(f"mask_indptr: expected shape ({batch + 1},) (batch + 1), got {ind.shape}")
    need = -(-np.asarray(query_counts, np.int64) * np.asarray(key_counts, np.int64) // 8)
    bad = np.flatnonzero((ind[:-1] < 0) | (ind[1:] - ind[:-1] < need) | (ind[1:] > n))
    if bad.size:
        b = int(bad[0])
        raise KernelArgumentError(
            f"mask_indptr: sequence {b} holds bytes [{int(ind[b])}, {int(ind[b + 1])}) of custom_mask's {n}; its "
            f"{int(query_counts[b])} × {int(key_counts[b])} mask needs {int(need[b])} bytes from a start >= 0 "
            "(FlashInfer's packed bits: tvm_attention.masks.pack_mask)")


def check_kv_start(arrays: Mapping[str, np.ndarray], key_counts) -> None:
    """``0 ≤ kv_start[b] ≤`` sequence ``b``'s keys, else :class:`KernelArgumentError`."""
    if "kv_start" not in arrays:
        return
    start = arrays["kv_start"].astype(np.int64)
    counts = np.broadcast_to(np.asarray(key_counts, np.int64), start.shape)
    bad = (start < 0) | (start > counts)
    if bad.any():
        b = int(np.argmax(bad))
        raise KernelArgumentError(
            f"kv_start[{b}]={int(start[b])} must be in [0, {int(counts[b])}] (the sequence's keys); it is the "
            "first key the sequence's rows may see")


class BHSD(Layout):
    name = "bhsd"
    manifest_name = "BHSD"  # what manifests said before there were other layouts
    title = "dense (batch, heads, seq, head_dim)"
    args = (
        Arg("q", ("batch", "heads", "seq_q", "head_dim")),
        Arg("k", ("batch", "kv_heads", "seq_kv", "head_dim")),
        Arg("v", ("batch", "kv_heads", "seq_kv", "head_dim_v")),
        Arg("o", ("batch", "heads", "seq_q", "head_dim_v"), output=True),
    )
    options = {"causal": "must equal the artifact's", "softmax_scale": "must equal the artifact's"}
    addressing = "BHSD"
    cli_help = "dense (B, H, S, D) (default)"

    def dims(self, spec) -> dict[str, int | str]:
        d: dict[str, int | str] = {n: getattr(spec, n) for n in ("batch", "heads", "kv_heads", "seq_q", "seq_kv", "head_dim")}
        d["head_dim_v"] = spec.v_dim
        for n in spec.dynamic:
            d[n] = n
        return d

    def reference_outputs(self, spec, arrays):
        arrays = self.dequantized(spec, arrays)
        return reference_attention(spec, arrays["q"], arrays["k"], arrays["v"], return_lse=True,
                                   **variant_kwargs(spec, arrays))

    def check_indices(self, arrays, bound, spec=None):
        check_variant_arrays(spec, arrays, arrays["k"].shape[2], arrays["q"].shape[0], arrays["q"].shape[2])

    def kv_bytes(self, spec, case):
        return case["batch"] * spec.kv_heads * case["seq_kv"] * (spec.head_dim + spec.v_dim) * spec.kv_itemsize

    def validation_cases(self, spec):
        """The representative shape, plus, for a dynamic spec, a shape it was not built at:
        lengths that are no multiple of any tile, and (causal) rows that see no key. A window
        bounded on the right (``R > 0``) whose cases have no row it leaves without a key gets
        one where a symbolic length allows: ``seq_q = seq_kv + R + 3`` (3 such rows), or with
        ``seq_q`` compiled in, ``seq_kv`` short enough."""
        rep = {"batch": spec.batch, "seq_q": spec.seq_q, "seq_kv": spec.seq_kv}
        if not spec.dynamic:
            return [rep]
        odd = dict(rep)
        odd.update({k: v for k, v in (("batch", 2), ("seq_q", 67), ("seq_kv", 45)) if k in spec.dynamic})
        cases = [rep, odd] if odd != rep else [rep]
        r = right_bound(spec)
        if r and not any(right_bound_hides_a_row(spec, c["seq_q"], c["seq_kv"]) for c in cases):
            hidden = dict(odd)
            if "seq_q" in spec.dynamic:
                hidden["seq_q"] = hidden["seq_kv"] + r + 3
            elif "seq_kv" in spec.dynamic:
                hidden["seq_kv"] = max(1, hidden["seq_q"] - r - 3)
            if right_bound_hides_a_row(spec, hidden["seq_q"], hidden["seq_kv"]):
                cases.append(hidden)
        return cases

    def random_inputs(self, spec, case, seed=0):
        rng = np.random.default_rng(seed)
        dt = spec.np_dtype
        b, sq, sk = case["batch"], case["seq_q"], case["seq_kv"]
        return self.quantized(spec, {
            "q": _rng_array(rng, (b, spec.heads, sq, spec.head_dim), dt),
            "k": _rng_array(rng, (b, spec.kv_heads, sk, spec.head_dim), dt),
            "v": _rng_array(rng, (b, spec.kv_heads, sk, spec.v_dim), dt),
            **variant_inputs(spec, [sk] * b, seed, sq),
        })

    def useful_flops(self, spec, case):
        return 2.0 * (spec.head_dim + spec.v_dim) * spec.heads * case["batch"] * Visibility.of(spec).pairs(case["seq_q"], case["seq_kv"])


class Varlen(Layout):
    name = "varlen"
    manifest_name = "varlen"
    title = "FlashAttention varlen: packed (total, heads, head_dim) + cu_seqlens"
    args = (
        Arg("q", ("total_q", "heads", "head_dim")),
        Arg("k", ("total_k", "kv_heads", "head_dim")),
        Arg("v", ("total_k", "kv_heads", "head_dim_v")),
        Arg("cu_seqlens_q", ("batch+1",), "int32"),
        Arg("cu_seqlens_k", ("batch+1",), "int32"),
        Arg("o", ("total_q", "heads", "head_dim_v"), output=True),
    )
    always_dynamic = ("batch", "seq_q", "seq_kv")
    lse_dims = ("heads", "total_q")  # FlashAttention's varlen softmax_lse: (nheads, total_q)
    packed = True
    index_checks = ("cu_seqlens",)
    cli_help = "FlashAttention's packed (total, H, D) + cu_seqlens_q/k"
    options = {"max_seqlen_q": "checked: must be >= the longest query sequence",
               "max_seqlen_k": "checked: must be >= the longest key sequence",
               "causal": "must equal the artifact's", "softmax_scale": "must equal the artifact's"}

    def mask_shapes(self, spec, given):
        rows, keys = (np.diff(np.asarray(given[n], np.int64)) for n in ("cu_seqlens_q", "cu_seqlens_k"))
        return [(int(r), int(k)) for r, k in zip(rows, keys)]

    def dims(self, spec) -> dict[str, int | str]:
        return {"batch": "batch", "total_q": "total_q", "total_k": "total_k",
                "heads": spec.heads, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "head_dim_v": spec.v_dim}

    def check_indices(self, arrays, bound, spec=None):
        for name, total in (("cu_seqlens_q", "total_q"), ("cu_seqlens_k", "total_k")):
            cu = arrays[name]
            if cu.size == 0:
                raise KernelArgumentError(
                    f"{name}: empty; it holds batch+1 offsets, starting at 0 (a batch of no sequence is [0])")
            if cu[0] != 0:
                raise KernelArgumentError(f"{name}: must start at 0, got {int(cu[0])}")
            steps = np.diff(cu.astype(np.int64))  # int64: int32 differences of ±2**31 entries wrap
            if steps.size and steps.min() < 0:
                b = int(np.argmin(steps))
                raise KernelArgumentError(
                    f"{name}: must be non-decreasing, but {name}[{b + 1}]={int(cu[b + 1])} < {name}[{b}]={int(cu[b])}"
                )
            if int(cu[-1]) != bound[total]:
                raise KernelArgumentError(
                    f"{name}: last entry {int(cu[-1])} must equal the number of rows of "
                    f"{'q' if total == 'total_q' else 'k and v'} ({total}={bound[total]})"
                )
        cq, ck = arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]
        check_variant_arrays(spec, arrays, np.diff(ck.astype(np.int64)), len(cq) - 1, np.diff(cq.astype(np.int64)))

    def check_options(self, spec, options, arrays):
        super().check_options(spec, options, arrays)
        for opt, name in (("max_seqlen_q", "cu_seqlens_q"), ("max_seqlen_k", "cu_seqlens_k")):
            if options.get(opt) is None:
                continue
            longest = int(np.diff(arrays[name].astype(np.int64)).max(initial=0))
            value = options[opt]
            try:
                if isinstance(value, (bool, float)) or int(value) != value:
                    raise TypeError
            except (TypeError, ValueError):
                raise KernelArgumentError(f"{opt}: expected an int (the longest sequence), got {value!r}") from None
            if int(value) < longest:
                raise KernelArgumentError(
                    f"{opt}={options[opt]} is smaller than the longest sequence in {name} ({longest})"
                )

    def reference_outputs(self, spec, arrays):
        arrays = self.dequantized(spec, arrays)
        q, k, v = arrays["q"], arrays["k"], arrays["v"]
        cq, ck = arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]
        o = np.zeros(q.shape[:2] + (spec.v_dim,), np.float64)
        lse = np.full((spec.heads, q.shape[0]), -np.inf)
        for b in range(len(cq) - 1):
            rows = slice(int(cq[b]), int(cq[b + 1]))
            keys = slice(int(ck[b]), int(ck[b + 1]))
            if rows.stop == rows.start:
                continue

            def bhsd(x):
                return np.ascontiguousarray(x.transpose(1, 0, 2))[None]

            ob, lb = reference_attention(spec, bhsd(q[rows]), bhsd(k[keys]), bhsd(v[keys]), return_lse=True,
                                         **variant_kwargs(spec, arrays, b))
            o[rows] = ob[0].transpose(1, 0, 2)
            lse[:, rows] = lb[0]
        return o, lse

    def kv_bytes(self, spec, case):
        keys = sum(int(b) for _, b in case["seqlens"])
        return keys * spec.kv_heads * (spec.head_dim + spec.v_dim) * spec.kv_itemsize

    def validation_cases(self, spec):
        """The representative batch (``batch`` sequences of ``seq_q`` against ``seq_kv``) and a
        mixed one: empty sequences, one row, seq_q > seq_kv, no keys, tails; for a window bounded
        on the right (``R > 0``) that leaves no row of these without a key, a batch whose first
        rows it does (``seq_q > seq_kv + R``)."""
        rep = [(spec.seq_q, spec.seq_kv)] * spec.batch
        mixed = [(0, 7), (1, 1), (70, 33), (33, 70), (5, 0), (129, 129), (0, 0), (3, 200)]
        cases = [{"seqlens": rep}, {"seqlens": mixed}]
        r = right_bound(spec)
        if r and not any(right_bound_hides_a_row(spec, sq, sk) for c in cases for sq, sk in c["seqlens"]):
            # a window bounded on the right: sequences whose first rows it leaves without a key
            # (3 rows of 5 keys' sequence, 1 of 1 key's), beside one whose rows all see keys
            cases.append({"seqlens": [(r + 8, 5), (2, 9), (r + 2, 1)]})
        return cases

    def random_inputs(self, spec, case, seed=0):
        rng = np.random.default_rng(seed)
        dt = spec.np_dtype
        lens = np.asarray(case["seqlens"], dtype=np.int64).reshape(-1, 2)
        cq = np.concatenate([[0], np.cumsum(lens[:, 0])]).astype(np.int32)
        ck = np.concatenate([[0], np.cumsum(lens[:, 1])]).astype(np.int32)
        return self.quantized(spec, {
            "q": _rng_array(rng, (int(cq[-1]), spec.heads, spec.head_dim), dt),
            "k": _rng_array(rng, (int(ck[-1]), spec.kv_heads, spec.head_dim), dt),
            "v": _rng_array(rng, (int(ck[-1]), spec.kv_heads, spec.v_dim), dt),
            "cu_seqlens_q": cq,
            "cu_seqlens_k": ck,
            **variant_inputs(spec, lens[:, 1], seed, int(lens[:, 0].max(initial=1)), query_counts=lens[:, 0]),
        })

    def useful_flops(self, spec, case):
        pairs = sum(Visibility.of(spec).pairs(int(a), int(b)) for a, b in case["seqlens"])
        return 2.0 * (spec.head_dim + spec.v_dim) * spec.heads * pairs

    def describe_case(self, case):
        lens = case["seqlens"]
        return f"{len(lens)} sequences, lengths {lens[:6]}{' ...' if len(lens) > 6 else ''}"

    def name_row(self, arrays, index, lse=False):
        """``o (total_q, H, D)``'s row ``(t, h)`` or ``lse (H, total_q)``'s ``(h, t)``: the
        sequence whose rows (cu_seqlens_q) hold packed row ``t``, and its row."""
        h, t = index if lse else index[::-1]
        cq = np.asarray(arrays["cu_seqlens_q"])
        b = int(np.searchsorted(cq, t, side="right")) - 1  # the last sequence starting at or before t
        return f"sequence {b} head {h} row {t - int(cq[b])} (packed row {t})"


class KVCache(Layout):
    """FlashAttention's ``flash_attn_with_kvcache``: sequence ``b`` attends to keys
    ``[0, cache_seqlens[b])`` of its cache rows (the new tokens' keys already written there),
    causal bottom-right inside that range; ``cache_seqlens[b] = 0`` gives zeros."""

    name = "kvcache"
    manifest_name = "kvcache"
    title = "KV cache: q (batch, heads, seq_q, D) against k/v_cache (batch, kv_heads, max_len, D) + cache_seqlens"
    args = (
        Arg("q", ("batch", "heads", "seq_q", "head_dim")),
        Arg("k_cache", ("batch", "kv_heads", "max_len", "head_dim")),
        Arg("v_cache", ("batch", "kv_heads", "max_len", "head_dim_v")),
        Arg("cache_seqlens", ("batch",), "int32"),
        Arg("o", ("batch", "heads", "seq_q", "head_dim_v"), output=True),
    )
    always_dynamic = ("batch", "seq_q", "seq_kv")
    options = {"causal": "must equal the artifact's", "softmax_scale": "must equal the artifact's"}
    addressing = "KVCache"
    is_cache = True
    can_split = True
    index_checks = ("cache_seqlens",)
    #: the representative call is a decode step: one new token per sequence against a 1k cache
    cli_defaults = {"batch": 4, "seq_q": 1, "seq_kv": 1024}
    cli_help = "q (B, H, Sq, D) against k/v_cache (B, KH, max_len, D) + cache_seqlens"

    def mask_shapes(self, spec, given):
        sq = int(np.shape(given["q"])[2])
        new = sq if getattr(spec, "append", False) else 0  # the appended keys are the sequence's too
        return [(sq, int(n) + new) for n in np.asarray(given["cache_seqlens"], np.int64)]

    def dims(self, spec) -> dict[str, int | str]:
        return {"batch": "batch", "seq_q": "seq_q", "max_len": "max_len",
                "heads": spec.heads, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "head_dim_v": spec.v_dim}

    def key_capacity(self, arrays, bound) -> tuple[int, str]:
        """(keys a sequence may have, what bounds it) for the cache_seqlens check."""
        dim = self.capacity_dim
        return bound[dim], f"{dim}={bound[dim]} (dim {self.capacity_axis} of {self.kv_names[0]})"

    def check_indices(self, arrays, bound, spec=None):
        # int64: an entry may be 2**31 - 1, and entry + seq_q must not wrap (as it would in int32)
        lens = arrays["cache_seqlens"].astype(np.int64)
        if lens.size and lens.min() < 0:
            b = int(np.argmin(lens))
            raise KernelArgumentError(f"cache_seqlens[{b}]={int(lens[b])} is negative")
        cap, what = self.key_capacity(arrays, bound)
        if cap > MAX_SEQ_LEN:
            cap, what = MAX_SEQ_LEN, f"{what}, and at most {MAX_SEQ_LEN} keys (2**30, the longest sequence a kernel takes)"
        new = bound["seq_q"] if getattr(spec, "append", False) else 0  # the appended keys
        if lens.size and lens.max() + new > cap:
            b = int(np.argmax(lens))
            plus = f" + seq_q={new} appended" if new else ""
            raise KernelArgumentError(f"cache_seqlens[{b}]={int(lens[b])}{plus} exceeds the cache: {what}")
        check_variant_arrays(spec, arrays, lens + new, len(lens), bound.get("seq_q"))
        if new and spec.kv_dtype == "int8":
            for name in ("kv_new",) if self.latent else ("k_new", "v_new"):
                if np.isnan(arrays[name]).any():
                    raise KernelArgumentError(f"{name}: holds NaN, which an int8 cache cannot store (use a float8 "
                                              "cache to keep it)")

    def keys_of(self, spec, arrays, b: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence ``b``'s first ``length`` keys and values as ``(1, KH, length, D)`` (values ``Dv``)."""
        return arrays["k_cache"][b:b + 1, :, :length], arrays["v_cache"][b:b + 1, :, :length]

    def reference_outputs(self, spec, arrays):
        arrays = self.dequantized(spec, self.appended(spec, arrays))
        q, lens = arrays["q"], arrays["cache_seqlens"]
        o = np.zeros(q.shape[:3] + (spec.v_dim,), np.float64)
        lse = np.full(q.shape[:3], -np.inf)
        for b in range(q.shape[0]):
            k, v = self.keys_of(spec, arrays, b, int(lens[b]))
            o[b:b + 1], lse[b:b + 1] = reference_attention(spec, q[b:b + 1], k, v, return_lse=True,
                                                           **variant_kwargs(spec, arrays, b))
        return o, lse

    def validation_cases(self, spec):
        """The representative step (``batch`` sequences, ``seq_q`` new tokens, ``seq_kv`` keys
        each) and mixed lengths: empty, one key, page and tile edges, no multiple of any tile,
        a prefix shorter than the new tokens (causal rows that see no key), at 1 and 4 new
        tokens and a prefill chunk of 37; for a window bounded on the right (``R > 0``) that
        leaves no row of these without a key, ``R + 4`` new tokens over caches of 1 and 3 keys,
        whose first rows it does (not when appending: a row then sees its own key)."""
        mixed = [0, 1, 15, 16, 17, 63, 65, 200, 3]
        cases = [
            {"seq_q": spec.seq_q, "cache_seqlens": [spec.seq_kv] * spec.batch, "max_len": spec.seq_kv},
            {"seq_q": 1, "cache_seqlens": mixed, "max_len": 211},
            {"seq_q": 4, "cache_seqlens": mixed, "max_len": 211},
            {"seq_q": 37, "cache_seqlens": [0, 37, 100, 20], "max_len": 130},
        ]
        if getattr(spec, "append", False):  # room for the appended keys (15 + 4 crosses a page of 16)
            for c in cases:
                c["max_len"] = max(c["max_len"], max(c["cache_seqlens"]) + c["seq_q"])
            return cases  # every row then sees its own key at least: no row without one to add
        r = right_bound(spec)
        if r and not any(right_bound_hides_a_row(spec, c["seq_q"], n) for c in cases for n in c["cache_seqlens"]):
            # a window bounded on the right: R + 4 new tokens over caches of 1 and 3 keys leave the
            # first 3 and 1 rows without a key; those over 17 keys all see some
            cases.append({"seq_q": r + 4, "cache_seqlens": [1, 17, 3], "max_len": 17})
        return cases

    def case_dims(self, spec, case):
        """The symbolic dims' values at ``case`` (those of :meth:`random_inputs`' arrays)."""
        return {"batch": len(case["cache_seqlens"]), "seq_q": case["seq_q"], "max_len": case["max_len"]}

    def random_inputs(self, spec, case, seed=0):
        rng = np.random.default_rng(seed)
        dt = spec.np_dtype
        lens = np.asarray(case["cache_seqlens"], dtype=np.int32)
        b, sq, ml = len(lens), case["seq_q"], case["max_len"]
        return self.with_new_keys(spec, self.quantized(spec, {
            "q": _rng_array(rng, (b, spec.heads, sq, spec.head_dim), dt),
            **self.caches(spec, rng, (b, spec.kv_heads, ml)),
            "cache_seqlens": lens,
            **variant_inputs(spec, lens + (sq if spec.append else 0), seed, sq),
        }), seed)

    def caches(self, spec, rng: np.random.Generator, lead: tuple) -> dict[str, np.ndarray]:
        """Random K and V caches of shape ``lead`` + their head dims, by name (a latent layout:
        its one cache, without ``lead``'s kv-head axis, :attr:`kv_head_axis`)."""
        if self.latent:
            h = self.kv_head_axis
            return {self.kv_names[0]: _rng_array(rng, lead[:h] + lead[h + 1:] + (spec.head_dim,), spec.np_dtype)}
        k, v = self.kv_names
        return {k: _rng_array(rng, lead + (spec.head_dim,), spec.np_dtype),
                v: _rng_array(rng, lead + (spec.v_dim,), spec.np_dtype)}

    def with_new_keys(self, spec, arrays: dict[str, np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
        """``arrays`` with random ``k_new (batch, KH, seq_q, D)``/``v_new (.., Dv)`` in the query dtype
        (the last inputs) for an appending kernel (drawn apart: the others stay as they were)."""
        if not spec.append:
            return arrays
        rng = np.random.default_rng(seed + 104729)
        if self.latent:  # kv_new (batch, seq_q, D): the new tokens' latent rows
            return {**arrays, "kv_new": _rng_array(rng, arrays["q"].shape[:1] + arrays["q"].shape[2:3]
                                                   + (spec.head_dim,), spec.np_dtype)}
        shape = (arrays["q"].shape[0], spec.kv_heads, arrays["q"].shape[2])
        return {**arrays, "k_new": _rng_array(rng, shape + (spec.head_dim,), spec.np_dtype),
                "v_new": _rng_array(rng, shape + (spec.v_dim,), spec.np_dtype)}

    def _keys(self, spec, case) -> list[int]:
        """Keys each sequence attends to at ``case`` (the appended ones included)."""
        return [int(n) + (case["seq_q"] if spec.append else 0) for n in case["cache_seqlens"]]

    def useful_flops(self, spec, case):
        pairs = sum(Visibility.of(spec).pairs(case["seq_q"], n) for n in self._keys(spec, case))
        return 2.0 * (spec.head_dim + spec.v_dim) * spec.heads * pairs

    def kv_bytes(self, spec, case):
        return sum(self._keys(spec, case)) * spec.kv_heads * (spec.head_dim + spec.v_dim) * spec.kv_itemsize

    def describe_case(self, case):
        lens = list(case["cache_seqlens"])
        return f"seq_q={case['seq_q']}, cache_seqlens {lens[:6]}{' ...' if len(lens) > 6 else ''}"


class Paged(KVCache):
    """vLLM's / FlashAttention's paged KV cache: key ``j`` of sequence ``b`` lives in page
    ``block_table[b, j // page_size]``, row ``j % page_size``. Pages may be in any order and
    shared between sequences (prefix sharing); entries past a sequence's last page are never
    read (vLLM pads them with anything)."""

    name = "paged"
    manifest_name = "paged"
    title = "paged KV: k/v_pages (num_pages, page_size, kv_heads, D) + block_table + cache_seqlens"
    args = (
        Arg("q", ("batch", "heads", "seq_q", "head_dim")),
        Arg("k_pages", ("num_pages", "page_size", "kv_heads", "head_dim")),
        Arg("v_pages", ("num_pages", "page_size", "kv_heads", "head_dim_v")),
        Arg("block_table", ("batch", "max_pages"), "int32"),
        Arg("cache_seqlens", ("batch",), "int32"),
        Arg("o", ("batch", "heads", "seq_q", "head_dim_v"), output=True),
    )
    paged = True
    kv_head_axis = 2
    addressing = "Paged"
    index_checks = ("cache_seqlens", "block_table")
    cli_help = "k/v_pages (pages, page_size, KH, D) + block_table + cache_seqlens"

    def dims(self, spec) -> dict[str, int | str]:
        return {"batch": "batch", "seq_q": "seq_q", "num_pages": "num_pages", "max_pages": "max_pages",
                "page_size": spec.page_size, "heads": spec.heads, "kv_heads": spec.kv_heads,
                "head_dim": spec.head_dim, "head_dim_v": spec.v_dim}

    def key_capacity(self, arrays, bound):
        p = arrays[self.kv_names[0]].shape[1]
        return bound["max_pages"] * p, (f"block_table holds max_pages={bound['max_pages']} pages of "
                                        f"page_size={p} keys per sequence")

    def check_indices(self, arrays, bound, spec=None):
        super().check_indices(arrays, bound, spec)
        lens, table = arrays["cache_seqlens"].astype(np.int64), arrays["block_table"]
        p, n = arrays[self.kv_names[0]].shape[1], bound["num_pages"]
        lens = lens + (bound["seq_q"] if getattr(spec, "append", False) else 0)  # with the appended keys (int64)
        used = (np.arange(table.shape[1])[None, :] * p) < lens[:, None]  # entries a sequence reads
        bad = used & ((table < 0) | (table >= n))
        if bad.any():
            b, i = (int(x) for x in np.argwhere(bad)[0])
            caches = list(dict.fromkeys(self.kv_names))  # the latent layouts' one cache, kv_pages
            raise KernelArgumentError(
                f"block_table[{b}, {i}]={int(table[b, i])} is not a page: {' and '.join(caches)} "
                f"hold{'s' if len(caches) == 1 else ''} num_pages={n} "
                f"(sequence {b} has {int(lens[b])} keys, so it reads its first {-(-int(lens[b]) // p)} entries)"
            )

    def write_keys(self, spec, arrays, cache, b, start, x):
        p = spec.page_size
        j = np.arange(start, start + x.shape[1])
        cache[arrays["block_table"][b, j // p], j % p] = x.swapaxes(0, 1)

    def keys_of(self, spec, arrays, b, length):
        p = spec.page_size
        j = np.arange(length)
        pages = arrays["block_table"][b, j // p]
        k = arrays["k_pages"][pages, j % p]  # (length, KH, D)
        v = arrays["v_pages"][pages, j % p]
        return k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]

    def validation_cases(self, spec):
        """As :class:`KVCache`'s, through shuffled pages, with prefix sharing in one case."""
        cases = []
        for c in super().validation_cases(spec):
            c = {k: v for k, v in c.items() if k != "max_len"}
            cases.append(c)
        if not getattr(spec, "append", False):  # appending into a shared page would overwrite the prefix
            cases[1]["shared_prefix"] = True
        return cases

    def case_dims(self, spec, case):
        """As :class:`KVCache`'s, with the pool :meth:`random_inputs` makes: ``max_pages`` the
        longest sequence's pages, ``num_pages`` every sequence's plus 3 spare ones."""
        new = case["seq_q"] if getattr(spec, "append", False) else 0  # pages for the appended keys too
        need = [-(-(int(n) + new) // spec.page_size) for n in case["cache_seqlens"]]
        return {"batch": len(need), "seq_q": case["seq_q"], "num_pages": sum(need) + 3,
                "max_pages": max(need + [1])}

    def random_inputs(self, spec, case, seed=0):
        """Pages in shuffled order from a pool with spare pages; unused block_table entries are
        -1, which the kernel must never read. ``shared_prefix``: every sequence's first page is
        the first sequence's (when both have one)."""
        rng = np.random.default_rng(seed)
        dt, p = spec.np_dtype, spec.page_size
        lens = np.asarray(case["cache_seqlens"], dtype=np.int32)
        b, sq = len(lens), case["seq_q"]
        need = [-(-(int(n) + (sq if spec.append else 0)) // p) for n in lens]
        dims = self.case_dims(spec, case)
        max_pages, num_pages = dims["max_pages"], dims["num_pages"]
        order = rng.permutation(num_pages).astype(np.int32)
        table = np.full((b, max_pages), -1, np.int32)
        nxt = 0
        for i, n in enumerate(need):
            table[i, :n] = order[nxt:nxt + n]
            nxt += n
        if case.get("shared_prefix") and need and need[0]:
            for i in range(1, b):
                if need[i]:
                    table[i, 0] = table[0, 0]
        return self.with_new_keys(spec, self.quantized(spec, {
            "q": _rng_array(rng, (b, spec.heads, sq, spec.head_dim), dt),
            **self.caches(spec, rng, (num_pages, p, spec.kv_heads)),
            "block_table": table,
            "cache_seqlens": lens,
            **variant_inputs(spec, lens + (sq if spec.append else 0), seed, sq),
        }), seed)

    def describe_case(self, case):
        return super().describe_case(case) + (", shared prefix page" if case.get("shared_prefix") else "")


class _Latent:
    """What the latent layouts share: one cache of rows for every head (K, V its first
    ``head_dim_v`` columns), which the cache layouts' code writes as a cache of one kv head
    (:meth:`Layout._headed`: a view with that axis), each key's row read once."""

    latent = True
    can_split = False

    def write_keys(self, spec, arrays, cache, b, start, x):
        super().write_keys(spec, arrays, self._headed(cache), b, start, x)  # x (1, n, ...): the one kv head

    def kv_bytes(self, spec, case):
        return sum(self._keys(spec, case)) * spec.head_dim * spec.kv_itemsize  # one row per key, read once


class MLA(_Latent, KVCache):
    """DeepSeek's multi-head latent attention (MLA) over a contiguous latent cache: one row of
    ``head_dim`` values per token (``kv_lora_rank + rope_dim``: 512 + 64 = 576 for DeepSeek-V3),
    shared by every query head. K is the whole row, V its first ``head_dim_v`` columns: the same
    bytes, read once per key tile for both products. Queries arrive absorbed, ``q (batch, heads,
    seq_q, head_dim)``; ``o (batch, heads, seq_q, head_dim_v)``. Sequence ``b`` attends to keys
    ``[0, cache_seqlens[b])``, causal bottom-right. The scale is always given (DeepSeek's is
    ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``, not ``1/sqrt(576)``)."""

    name = "mla"
    manifest_name = "mla"
    title = "MLA latent cache: q (batch, heads, seq_q, D) against kv_cache (batch, max_len, D), v its first Dv columns"
    args = (
        Arg("q", ("batch", "heads", "seq_q", "head_dim")),
        Arg("kv_cache", ("batch", "max_len", "head_dim")),
        Arg("cache_seqlens", ("batch",), "int32"),
        Arg("o", ("batch", "heads", "seq_q", "head_dim_v"), output=True),
    )
    addressing = "LatentCache"
    cli_help = "MLA: q (B, H, Sq, D) against one latent kv_cache (B, max_len, D), v its first --head-dim-v columns"

    def dims(self, spec) -> dict[str, int | str]:
        return {"batch": "batch", "seq_q": "seq_q", "max_len": "max_len", "heads": spec.heads,
                "head_dim": spec.head_dim, "head_dim_v": spec.v_dim}

    def keys_of(self, spec, arrays, b: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        k = arrays["kv_cache"][b:b + 1, None, :length]  # (1, 1, length, D): one kv head
        return k, k[..., :spec.v_dim]


class MLAPaged(_Latent, Paged):
    """:class:`MLA` over a paged latent cache (vLLM's and FlashMLA's): key ``j`` of sequence ``b``
    is row ``j % page_size`` of page ``block_table[b, j // page_size]`` of ``kv_pages (num_pages,
    page_size, head_dim)``."""

    name = "mla_paged"
    manifest_name = "mla_paged"
    title = "MLA paged latent cache: kv_pages (num_pages, page_size, D) + block_table + cache_seqlens"
    args = (
        Arg("q", ("batch", "heads", "seq_q", "head_dim")),
        Arg("kv_pages", ("num_pages", "page_size", "head_dim")),
        Arg("block_table", ("batch", "max_pages"), "int32"),
        Arg("cache_seqlens", ("batch",), "int32"),
        Arg("o", ("batch", "heads", "seq_q", "head_dim_v"), output=True),
    )
    addressing = "LatentPaged"
    cli_help = "MLA: one latent kv_pages (pages, page_size, D) + block_table + cache_seqlens"

    def dims(self, spec) -> dict[str, int | str]:
        return {"batch": "batch", "seq_q": "seq_q", "num_pages": "num_pages", "max_pages": "max_pages",
                "page_size": spec.page_size, "heads": spec.heads, "head_dim": spec.head_dim,
                "head_dim_v": spec.v_dim}

    def keys_of(self, spec, arrays, b, length):
        p = spec.page_size
        j = np.arange(length)
        k = arrays["kv_pages"][arrays["block_table"][b, j // p], j % p][None, None]  # (1, 1, length, D)
        return k, k[..., :spec.v_dim]


def paged_from_contiguous(k_cache: np.ndarray, page_size: int, rng: np.random.Generator | None = None):
    """``(k_pages, block_table)`` holding the same keys as ``k_cache (B, KH, L, D)``, in shuffled
    pages (benchmarks compare the paged kernel with the contiguous one on the same data)."""
    b, kh, length, d = k_cache.shape
    n = -(-length // page_size)
    rng = rng or np.random.default_rng(0)
    order = rng.permutation(b * n).astype(np.int32)
    pages = np.zeros((b * n, page_size, kh, d), k_cache.dtype)
    padded = np.zeros((b, kh, n * page_size, d), k_cache.dtype)
    padded[:, :, :length] = k_cache
    blocks = padded.reshape(b, kh, n, page_size, d).transpose(0, 2, 3, 1, 4)  # (B, n, P, KH, D)
    table = order.reshape(b, n)
    pages[table.reshape(-1)] = blocks.reshape(b * n, page_size, kh, d)
    return pages, table


#: name -> entry. The CLI's --layout choices, the manifest's "layout" and the spec's ``layout``.
LAYOUTS: dict[str, Layout] = {entry.name: entry for entry in (BHSD(), Varlen(), KVCache(), Paged(), MLA(), MLAPaged())}


def get_layout(name: str) -> Layout:
    key = name.lower() if isinstance(name, str) else name
    if key not in LAYOUTS:
        raise SpecError(f"unknown layout {name!r}; known layouts: {', '.join(LAYOUTS)}")
    return LAYOUTS[key]


def layouts_where(trait: str, value: bool = True) -> tuple[str, ...]:
    """The names of the layouts whose ``trait`` (``is_cache``, ``can_split``, ``packed``, ...)
    is ``value``, in :data:`LAYOUTS`' order."""
    return tuple(n for n, entry in LAYOUTS.items() if bool(getattr(entry, trait)) == value)


def in_words(names) -> str:
    """``("bhsd", "kvcache", "paged")`` -> ``"bhsd, kvcache and paged"`` (for messages)."""
    names = list(names)
    return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"
