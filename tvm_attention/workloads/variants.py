"""The attention variants' contract: one definition of what each variant does to a score, to the
mask and to a row's output, called by all three fused kernels (``fused.py`` on CPUs,
``fused_cuda.py`` and ``fused_mma.py`` on CUDA GPUs), as FlashInfer's variant structs are.

A kernel owns its addressing (which tile row is which query position and head, which key a lane
holds) and its recurrence (the online softmax); a variant only fills hooks, each at a fixed point
of every kernel. :class:`Variants` is one kernel's instance: the variants' call-argument buffers
(``None`` where the spec takes none) and the hooks over them.

=========================  ==================================================  ==============
hook                       what it does (in this order)                        kernels
=========================  ==================================================  ==============
(a) arguments              :func:`tvm_attention.layouts.variant_args` is the   all
                           call order; :meth:`Variants.declare` (CUDA) and
                           :class:`ExtraParams` (CPU) declare the buffers
(b) ``score_scale``        the factor of the raw ``q·k``: ``scale·log2 e``,    all
                           or ``scale / c`` under a softcap ``c``
    ``k_scale``/           an 8-bit cache's key scale (times ``KV_UNIT``):     CPU / CUDA
    ``k_scaled``           folded into q (CPU), or into the score's factor
    ``logit``              softcap ``c·tanh(x)·log2 e``, then ALiBi's          all; score_mod
                           ``− slope·|p − j|``, then the user's ``score_mod``  not Hopper
(c) ``start``              the sequence's first visible key (``kv_start``)     all
    ``sees``/``custom``    key bounds, the user's ``mask_mod``, a custom mask  not Hopper
(d) ``v_scale``/           an 8-bit cache's value scale, once per output       CPU / CUDA
    ``v_scaled``
    ``with_sink``          the sink joins the row's denominator                all
    ``sink_terms``         its factors, for a kernel that binds them once per  tensor cores
                           row (the unrolled outputs share them)
    ``normalized``         ``acc / l``, or 0 for a row that saw no key         all
=========================  ==================================================  ==============

The window and causality are not variants of this contract: they are :mod:`tvm_attention.visibility`'s
(every kernel, the reference and the pair counts read them there), and ``kv_start`` feeds them
through :meth:`Variants.start`. What a CUDA kernel does not build its family refuses by name
(:data:`CUDA_VARIANTS`, :data:`CUDA_CALL_VARIANTS`, read by ``schedules/family.py``), before a
workload is generated (and :meth:`Variants.declare` or the Hopper kernel again, for a direct call).

Two hooks come in two forms because the kernels fold the same factor at different places: the
CPU kernel multiplies each query element by the key scale once (``q·(s·k) = (s·q)·k``) and leaves
the unit out when it is 1, the CUDA kernels multiply each score by one constant of the scale and
the unit (:meth:`Variants.k_scale` against :meth:`Variants.k_scaled`; likewise the value scale).
The output hooks' order is the kernel's: the CPU kernel adds the sink before it scales the values
(its split-KV partials store the scaled values without the sink, which the merge adds once), the
CUDA kernels scale first. Both are exact in real
arithmetic; in float32 they are each kernel's as it was (the generated code is unchanged).

Adding a score variant: ``docs/design.md`` ("Adding a score variant") walks through it.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..layouts import VARIANT_ARGS, fully_static, variant_args
from ..modifiers import instantiate, tensor_dim_name
from ..spec import DATA_ALIGNMENT as A, AttentionSpec
from ..visibility import all_of
from ._math import KV_UNIT, LOG2E, f32, normalize, normalize_seen, normalize_where, sink_terms, tanh_fast, with_sink

#: The variants (``AttentionSpec.variants``) every CUDA kernel builds: a sliding window, a logit
#: softcap, ALiBi, sinks, a first visible key per sequence.
CUDA_VARIANTS = ("window", "softcap", "alibi", "sinks", "kv_start")
#: ... and those the call decides, which the SIMT and ``mma.sync`` kernels build through
#: :class:`fused_cuda.Tile`'s hooks (the Hopper kernel, with masks of its own, refuses them): the
#: user's modifiers (``score_mod``, ``mask_mod``), key bounds, a custom mask
CUDA_CALL_VARIANTS = ("score_mod", "mask_mod", "key_bounds", "custom_mask")
#: their arguments besides the modifiers' tensors (``layouts.KEY_BOUND_ARGS``, ``CUSTOM_MASK_ARGS``)
CALL_ARGS = ("key_lo", "key_hi", "custom_mask", "mask_indptr")

#: The CUDA kernels' buffer names of the variant arguments they had first (``layouts.variant_args``'
#: names); any other argument of ``layouts.VARIANT_ARGS`` is declared under its own name
#: (:meth:`Variants.declare`).
CUDA_BUFFERS = {"alibi_slopes": "AL", "sinks": "SN", "kv_start": "KS", "q_scale": "QSC", "k_scale": "KSC",
                "v_scale": "VSC", "k_new": "KN", "v_new": "VN", "kv_scale": "KVSC", "kv_new": "KVN"}
#: The variant arguments the CPU kernel's signature templates hold a parameter for
#: (``fused.VARIANT_PARAMS``); any other of ``layouts.VARIANT_ARGS`` (a variant added later, its
#: ``Arg`` after these) is declared by :class:`ExtraParams`.
TEMPLATE_ARGS = ("alibi_slopes", "sinks", "kv_start")


def score_scale(spec: AttentionSpec) -> float:
    """What multiplies a raw score ``q·k`` (of keys without their 8-bit scale) before
    :meth:`Variants.logit`: ``scale·log2 e`` (the softmax then runs in log2 units, ``exp2``), or
    ``scale / c`` under a softcap ``c`` (``logit``'s tanh takes ``x / c``; its ``c·log2 e`` brings
    the result to log2 units)."""
    return float(spec.scale * LOG2E) if spec.softcap is None else float(spec.scale / spec.softcap)


class Variants:
    """The variants of one kernel: their call-argument buffers (``AL`` ``alibi_slopes (heads,)``,
    ``SK`` ``sinks (heads,)``, ``KS`` ``kv_start (batch,)``, ``LO``/``HI`` ``key_lo``/``key_hi
    (batch, key_positions)``, the modifiers' tensors, an 8-bit cache's ``KSC``/``VSC``
    ``k_scale``/``v_scale (kv_heads,)``, an appending kernel's ``KN``/``VN`` ``k_new``/``v_new``;
    None where the spec takes none), ``args`` the buffers of the other arguments of
    ``layouts.VARIANT_ARGS`` by name (variants added after those), the user's modifiers over
    them, and the hooks (the module's table). ``spec`` None: a kernel without variants (every
    hook the identity)."""

    def __init__(self, spec: AttentionSpec | None = None, AL=None, SK=None, KS=None, LO=None, HI=None, tensors=None,
                 scales=(None, None), new=(None, None), args=None, cmask=(None, None)):
        self.spec = spec
        self.args = dict(args or {})
        self.KSC, self.VSC = scales if spec is not None and spec.kv_quantized else (None, None)
        self.QSC = None  # fp8 queries' q_scale (heads,) (declare)
        # how finely they scale (spec.kv_scale): per kv head the hooks below fold them; per token
        # or per group the tile reads them per key (fused.py's scale_load)
        self.fine = spec is not None and spec.kv_quantized and spec.kv_scale != "head"
        self.KN, self.VN = new if spec is not None and spec.append else (None, None)  # appended keys, values
        self.G = spec.group_size if spec is not None else 1
        self.unit = KV_UNIT.get(spec.kv_dtype, 1.0) if spec is not None else 1.0
        self.softcap = spec.softcap if spec is not None else None
        self.AL = AL if spec is not None and spec.alibi else None
        self.SK = SK if spec is not None and spec.sinks else None
        self.KS = KS if spec is not None and spec.kv_start else None
        self.LO, self.HI = (LO, HI) if spec is not None and spec.key_bounds else (None, None)
        # a custom mask's packed bits and each sequence's first byte (``custom_mask``, ``mask_indptr``)
        self.CM, self.MI = cmask if spec is not None and spec.custom_mask else (None, None)
        self.mods = spec is not None and spec.has_modifiers
        # the user's modifiers over the tensor buffers (TIR expressions in, TIR out)
        self.score_fn = instantiate(spec.score_mod, "score_mod", tensors or {}) if self.mods and spec.score_mod else None
        self.mask_fn = instantiate(spec.mask_mod, "mask_mod", tensors or {}) if self.mods and spec.mask_mod else None
        self.buffers = []  # the buffers a kernel adds to its parameters itself (declare)

    # -- (a) arguments ---------------------------------------------------------------------

    @classmethod
    def declare(cls, spec: AttentionSpec | None, B=None, SQ=None, SK=None) -> "Variants":
        """The variants of a CUDA kernel, their buffers declared outside its script (named by
        :data:`CUDA_BUFFERS`; ``B``, ``SQ``, ``SK`` the kernel's batch, seq_q and seq_kv, ints or
        its vars: a fully static kernel's key bounds are ``(batch, seq_kv)``), in
        call order in ``buffers`` (:func:`tvm_attention.layouts.variant_args`): the arguments of
        ``layouts.VARIANT_ARGS``, fp8 queries' and an 8-bit cache's scales, an appending kernel's
        ``k_new``/``v_new`` (``KN``/``VN``); then what the call decides (:data:`CUDA_CALL_VARIANTS`):
        ``key_lo``/``key_hi``, ``custom_mask``/``mask_indptr``, the modifiers' tensors, each
        dim a kernel takes at call time one var by its name (``key_positions``, ``mask_bytes``,
        ``modifiers.tensor_dim_name``'s). A variant outside those two tables, or any other
        argument, is a ValueError naming it (the families refuse them by name first; this stops a
        direct call from building a kernel that would ignore them)."""
        if spec is None:
            return cls()
        missing = [v for v in spec.variants if v not in CUDA_VARIANTS + CUDA_CALL_VARIANTS]
        if missing:
            raise ValueError(f"the CUDA kernels do not build the attention variant(s) {', '.join(missing)}")
        values = {"heads": spec.heads, "kv_heads": spec.kv_heads, "batch": B, "seq_q": SQ, "seq_kv": SK,
                  "head_dim": spec.head_dim, "head_dim_v": spec.v_dim}
        values = {k: v for k, v in values.items() if v is not None}
        takes = {a.name for _, a in VARIANT_ARGS} | set(CUDA_BUFFERS) | set(CALL_ARGS) | \
            {name for name, _, _ in spec.mod_tensors}

        def dim(d):  # an int, the kernel's own dim, or a dim taken at call time (one var a name)
            if isinstance(d, int):
                return d
            if d not in values:
                values[d] = tirx.Var(d, "int32")
            return values[d]

        declared = {}
        for a in variant_args(spec):
            if a.name not in takes:
                raise ValueError(f"the CUDA kernels take no {a.name!r} argument (variants: {', '.join(CUDA_VARIANTS)})")
            declared[a.name] = tirx.decl_buffer(tuple(dim(d) for d in a.dims), a.dtype or spec.dtype,
                                                CUDA_BUFFERS.get(a.name, a.name))
        var_tensors = {name: declared[name] for name, _, _ in spec.mod_tensors}
        var = cls(spec, declared.get("alibi_slopes"), declared.get("sinks"), declared.get("kv_start"),
                  declared.get("key_lo"), declared.get("key_hi"), tensors=var_tensors,
                  # a latent cache's (MLA) one scale and new rows serve as K's and V's
                  scales=(declared.get("k_scale", declared.get("kv_scale")),
                          declared.get("v_scale", declared.get("kv_scale"))),
                  new=(declared.get("k_new", declared.get("kv_new")), declared.get("v_new", declared.get("kv_new"))),
                  cmask=(declared.get("custom_mask"), declared.get("mask_indptr")),
                  args={n: b for n, b in declared.items() if n not in CUDA_BUFFERS and n not in CALL_ARGS
                        and n not in var_tensors})
        var.QSC = declared.get("q_scale")
        var.buffers = list(declared.values())
        return var

    # -- (b) the score -----------------------------------------------------------------------

    def slope(self, h):
        """ALiBi's slope of query head ``h`` in the log2 units of the scores (None: no ALiBi)."""
        return None if self.AL is None else self.AL[h] * T.float32(LOG2E)

    def k_scale(self, h):
        """The CPU form: what multiplies a key element as the tile converts it (``kv_to_f32(unit=False)``)
        for query head ``h``, folded into the query: its kv head's key scale times the dtype's
        :data:`KV_UNIT` (the unit left out where it is 1; None: no scales)."""
        return None if self.KSC is None or self.fine else self._unit(self.KSC[T.floordiv(h, self.G)])

    def k_scaled(self, kv_head, factor: float):
        """The CUDA form: ``factor`` (float32) times what turns a raw score of kv head ``kv_head``'s
        converted keys into ``q·k`` (its ``k_scale`` and the unit, in one constant); ``factor``
        alone without scales."""
        if self.KSC is None:
            return T.float32(factor)
        return self.KSC[kv_head] * T.float32(factor * self.unit)

    def q_scaled(self, head, factor):
        """``factor`` (a float32 expression) times query head ``head``'s ``q_scale`` (fp8 queries;
        ``factor`` alone otherwise)."""
        return factor if self.QSC is None else self.QSC[head] * factor

    def _unit(self, scale):
        return scale if self.unit == 1.0 else scale * T.float32(self.unit)

    def logit(self, x, head, dist, at=None):
        """The score ``x`` (a raw ``q·k`` times :func:`score_scale` and the key scale) in the log2
        units of the softmax: softcapped ``tanh(x)·c·log2 e``, less ALiBi's ``slope·|dist|``, then
        the user's ``score_mod`` (in the natural-log units of the spec, and back). ``head()``,
        ``dist()`` (position − key) and ``at()`` (``(b, head, position, key)``, absolute, for
        ``score_mod``) are the kernel's addressing, asked only by the variants that need them."""
        if self.softcap is not None:
            x = tanh_fast(x) * T.float32(self.softcap * LOG2E)
        if self.AL is not None:
            x = x - self.slope(head()) * T.Cast("float32", T.abs(dist()))
        if self.score_fn is not None:
            y = self.score_fn(x * T.float32(1.0 / LOG2E), *at())
            y = T.float32(float(y)) if isinstance(y, (int, float)) else y
            x = f32(y) * T.float32(LOG2E)
        return x

    # -- (c) the mask ------------------------------------------------------------------------

    @property
    def masks_or_mods(self) -> bool:
        """Whether a hook asks for the row's sequence ``b`` beyond ``kv_start``: the call's masks
        and the user's score_mod (``at()``'s first entry)."""
        return self.masks_keys or self.score_fn is not None

    @property
    def masks_keys(self) -> bool:
        """Whether the call decides which keys a row sees (key bounds, a custom mask, mask_mod):
        :meth:`sees` and :meth:`custom` then hide scores that the lengths and the window do not."""
        return self.LO is not None or self.CM is not None or self.mask_fn is not None

    def start(self, b):
        """Sequence ``b``'s first visible key (None: key 0)."""
        return None if self.KS is None else self.KS[b]

    def _col(self, pos):
        return T.max(0, T.min(pos, self.LO.shape[1] - 1))

    def key_lo(self, b, pos):
        """The first key the row at (absolute) position ``pos`` of sequence ``b`` may see by the
        key bounds (None: no bounds)."""
        return None if self.LO is None else self.LO[b, self._col(pos)]

    def key_hi(self, b, pos):
        """One past the last key the row at ``pos`` may see by the key bounds (None: none)."""
        return None if self.HI is None else self.HI[b, self._col(pos)]

    def custom(self, b, row, key, rows, keys):
        """Whether the custom mask lets query row ``row`` of sequence ``b`` (``rows`` rows,
        ``keys`` keys) see ``key`` (None: no custom mask): bit ``row·keys + key`` of the bytes
        from ``mask_indptr[b]``, little-endian in its byte. Row and key are clamped into the
        sequence (a tile's rows past the last, a tail tile's keys: masked elsewhere, but the
        load must stay inside the mask); the bit's index is formed in int64 (``row·keys`` may
        pass 2**31), its byte in int32 (inside ``custom_mask``: the library checked the bytes
        each sequence needs)."""
        if self.CM is None:
            return None
        i64 = lambda x: T.Cast("int64", x)  # noqa: E731
        r = T.max(0, T.min(row, rows - 1))
        k = T.max(0, T.min(key, keys - 1))
        bit = i64(r) * i64(keys) + i64(k)
        byte = self.MI[b] + T.Cast("int32", T.shift_right(bit, i64(3)))
        return T.bitwise_and(T.shift_right(T.Cast("int32", self.CM[byte]), T.Cast("int32", T.bitwise_and(bit, i64(7)))),
                             1) != 0

    def sees(self, b, h, pos, key):
        """The key bounds and ``mask_mod`` at absolute ``pos`` and ``key`` (None: no condition)."""
        conds = []
        if self.LO is not None:
            conds += [self.key_lo(b, pos) <= key, key < self.key_hi(b, pos)]
        if self.mask_fn is not None:
            m = self.mask_fn(b, h, pos, key)
            conds.append(T.bool(bool(m)) if isinstance(m, (bool, int)) else m)
        return all_of(conds)

    # -- (d) the output ----------------------------------------------------------------------

    def v_scale(self, h):
        """The CPU form: what multiplies a row's output of query head ``h`` (``P·V`` summed the
        stored values; the scale is linear), the unit left out where it is 1 (None: no scales)."""
        return None if self.VSC is None or self.fine else self._unit(self.VSC[T.floordiv(h, self.G)])

    def v_scaled(self, acc, kv_head):
        """The CUDA form: ``acc`` of kv head ``kv_head`` times its value scale and the unit."""
        return acc if self.VSC is None else acc * (self.VSC[kv_head] * T.float32(self.unit))

    def sink(self, h):
        """The sink logit of query head ``h`` in log2 units (None: no sinks)."""
        return None if self.SK is None else self.SK[h] * T.float32(LOG2E)

    def with_sink(self, acc, l, m, h):
        """``(acc, l)`` of a row of query head ``h`` with its sink in the denominator
        (``_math.with_sink``, from the row's running max ``m``); unchanged without sinks."""
        return (acc, l) if self.SK is None else with_sink(acc, l, m, self.sink(h))

    def sink_terms(self, m, h):
        """``(w, e)`` of a row of query head ``h`` (``_math.sink_terms``): ``with_sink``'s
        ``(acc·w, l·w + e)``, for a kernel that binds them once per row; None without sinks."""
        return None if self.SK is None else sink_terms(m, self.sink(h))

    def normalized(self, acc, l, row, static: bool, sees_key, keys_sum=None):
        """A row's output ``acc / l``, or 0 for a row that saw no key: under modifiers when every
        score it met was -inf (``keys_sum``, ``l`` before a sink joined it, is 0:
        ``normalize_seen``); with ``static`` lengths (and no start) decided at build time for
        row ``row`` (``normalize``); else by the run-time predicate ``sees_key()``
        (``normalize_where``)."""
        if self.mods:
            return normalize_seen(acc, l, l if keys_sum is None else keys_sum)
        if static:
            return normalize(acc, l, row, self.spec)
        return normalize_where(acc, l, sees_key())


def transforms(spec: AttentionSpec) -> bool:
    """Whether :meth:`Variants.logit` changes ``spec``'s scores beyond their scale (a softcap,
    ALiBi, the user's score_mod): a kernel then runs it on every score before the row max."""
    return spec.softcap is not None or spec.alibi or spec.score_mod is not None


#: a kernel without variant arguments
NO_VARIANTS = Variants()


class ExtraParams:
    """The CPU kernel's variant arguments that its signature templates hold no parameter for:
    those of ``layouts.VARIANT_ARGS`` after :data:`TEMPLATE_ARGS` (``args``: a variant added
    later, per ``heads``, ``kv_heads`` or ``batch``), the key bounds ``key_lo``/``key_hi (batch,
    key_positions)``, the modifiers' tensors (every dim taken at call time,
    :func:`tvm_attention.modifiers.tensor_dim_name`), an 8-bit cache's scales ``k_scale``/``v_scale
    (kv_heads,)`` and an appending kernel's ``k_new``/``v_new``, in
    :func:`tvm_attention.layouts.variant_args`' order. Declared here, read by the tile through
    :class:`Variants`, inserted before the outputs (``fused._keep_params``)."""

    def __init__(self, spec: AttentionSpec, batch, seq_q=None, kv_shape=None):
        self.params = []
        values = {"heads": spec.heads, "kv_heads": spec.kv_heads, "batch": batch}
        self.args = {a.name: tirx.decl_buffer(tuple(values[d] for d in a.dims), a.dtype, a.name, data_alignment=A)
                     for flag, a in VARIANT_ARGS if a.name not in TEMPLATE_ARGS and getattr(spec, flag)}
        self.params += list(self.args.values())
        self.LO = self.HI = None
        static = fully_static(spec)  # then every shape is compiled in (layouts.fully_static)
        if spec.key_bounds:
            n = spec.seq_kv if static else tirx.Var("key_positions", "int32")
            self.LO = tirx.decl_buffer((batch, n), "int32", "key_lo", data_alignment=A)
            self.HI = tirx.decl_buffer((batch, n), "int32", "key_hi", data_alignment=A)
            self.params += [self.LO, self.HI]
        self.cmask = (None, None)
        if spec.custom_mask:  # the packed bits and each sequence's first byte (layouts.CUSTOM_MASK_ARGS)
            nbytes = batch * -(-spec.seq_q * spec.seq_kv // 8) if static else tirx.Var("mask_bytes", "int32")
            rows = batch + 1 if static else tirx.Var("mask_rows", "int32")
            self.cmask = (tirx.decl_buffer((nbytes,), "uint8", "custom_mask", data_alignment=A),
                          tirx.decl_buffer((rows,), "int32", "mask_indptr", data_alignment=A))
            self.params += list(self.cmask)
        self.tensors = {}
        for name, dtype, dims in spec.mod_tensors:
            shape = tuple(d if isinstance(d, int) else getattr(spec, d) for d in dims) if static else \
                tuple(tirx.Var(tensor_dim_name(name, i), "int32") for i in range(len(dims)))
            self.tensors[name] = tirx.decl_buffer(shape, dtype, name, data_alignment=A)
            self.params.append(self.tensors[name])
        self.scales = (None, None)
        if spec.kv_quantized:  # an 8-bit cache's k_scale, v_scale, after the tensors: (kv_heads,), or
            # K's shape ``kv_shape`` without head_dim (per token), with head_dim / 32 (per group; V's head_dim_v / 32)
            def shape(groups):
                return (spec.kv_heads,) if spec.kv_scale == "head" else \
                    tuple(kv_shape[:-1]) + ((groups,) if spec.kv_scale == "group" else ())
            if spec.layout_info.latent:  # one kv_scale, K's and V's (V's groups: the first head_dim_v / 32)
                one = tirx.decl_buffer(shape(spec.scale_groups), "float32", "kv_scale", data_alignment=A)
                self.scales = (one, one)
                self.params.append(one)
            else:
                self.scales = tuple(tirx.decl_buffer(shape(g), "float32", n, data_alignment=A)
                                    for n, g in (("k_scale", spec.scale_groups), ("v_scale", spec.v_scale_groups)))
                self.params += list(self.scales)
        self.new = (None, None)
        if spec.append and spec.layout_info.latent:  # kv_new (batch, seq_q, head_dim): V its first columns
            kv_new = tirx.decl_buffer((batch, seq_q, spec.head_dim), spec.dtype, "kv_new", data_alignment=A)
            self.new = (kv_new, kv_new)
            self.params.append(kv_new)
        elif spec.append:  # k_new (batch, kv_heads, seq_q, head_dim), v_new (.., head_dim_v), query dtype, last
            shape = (batch, spec.kv_heads, seq_q)
            self.new = tuple(tirx.decl_buffer(shape + (d,), spec.dtype, n, data_alignment=A)
                             for n, d in (("k_new", spec.head_dim), ("v_new", spec.v_dim)))
            self.params += list(self.new)

    @property
    def variant_args(self):
        """:class:`Variants`' LO, HI, tensors, scales, new, args, cmask."""
        return self.LO, self.HI, self.tensors, self.scales, self.new, self.args, self.cmask
