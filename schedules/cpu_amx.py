"""CPU schedule of the fused kernel's AMX form (``dot_bf16`` 2, emulated 3): QKᵀ and PV on Intel
AMX tiles (``tdpbf16ps``), the softmax on AVX-512 vectors.

The workload (``workloads.fused._tile_macro`` with :mod:`tvm_attention.workloads.amx`) writes the
two products as calls of a 32 × 32 tile micro-kernel over the staged operands, in opaque blocks
``S_gemm`` and ``PV_gemm``: nothing of them is left to schedule. What this schedule does is the
rest of the tile, as :mod:`cpu_bf16` does it: the copies (``K_load`` by rows; ``V_load``, the
value tile transposed, by 16 × 16 blocks), ``Q_load``'s pairs, ``P_round`` and ``P_ilv`` (16 pairs
per shuffle: :data:`cpu_bf16.ILV`), the softmax stages across query rows, the transposed
accumulator's init and correction along its rows, the row tiles parallel.

The emulated form's blocks are the same; its micro-kernel is plain TIR (slow: a checking form).
Knobs: ``block_m``/``block_n`` (the workload's, multiples of 32), ``parallel_chunk`` and
``auto_unroll`` (pinned or sampled, recorded as ``attn.*`` like the other forms); ``s_rows``,
``pv_rows`` and ``pv_cols`` mean nothing here and are recorded as given (1 when sampled)."""
from __future__ import annotations

from tvm import s_tir

from ..spec import AttentionSpec
from . import cpu_bf16
from .cpu_space import (
    AUTO_UNROLL_STEPS,
    PARALLEL_CHUNKS,
    has_block,
    sample_choice,
    vectorize_rows,
)

L = 16  # float32 lanes of a zmm register
#: the ISA features the real form needs beyond AVX-512 (the emulated form: none)
FEATURES = ("amx-tile", "amx-bf16", "avx512f")


def supports(spec: AttentionSpec, features: set[str], block_m: int = 32, block_n: int = 32) -> bool:
    """Whether ``spec`` can take the AMX form (the real one) on a CPU with ``features``."""
    from ..workloads import amx
    return (spec.dtype == "bfloat16" and not spec.kv_quantized and all(f in features for f in FEATURES)
            and amx.fits(block_m, block_n, spec.head_dim, spec.v_dim) is None)


def schedule(sch: s_tir.Schedule, spec: AttentionSpec, knobs=None, suffix: str = "") -> s_tir.Schedule:
    """Schedule the AMX main nest (blocks ``*<suffix>``): with ``knobs`` every decision is pinned
    (the hand schedule), with None sampled (the design space)."""
    row_tile = sch.get_sblock("row_tile" + suffix)
    pin = knobs is not None
    cpu_bf16.register()

    def blk(name):
        return sch.get_sblock(name + suffix)

    def vec(loop, extent, lanes):
        if extent > lanes:
            outer, loop = sch.split(loop, [None, lanes])
            sch.unroll(outer)
        sch.vectorize(loop)

    D, DV = spec.head_dim, spec.v_dim
    # Copies: the key and value tiles' rows; q's pairs once per row tile
    vec(sch.get_loops(blk("K_load"))[-1], D, 32)
    vec(sch.get_loops(blk("V_load"))[-1], DV, 32)
    sch.unroll(sch.get_loops(blk("Q_load"))[-1])

    # Pairs of V rows and of P rows (keys 2jp, 2jp+1) interleaved, 16 columns per shuffle; P
    # rounded first (P_tr, the pairs transposed, is the workload's call)
    for name in ("V_ilv", "P_ilv"):
        b = blk(name)
        jp, x, t = sch.get_loops(b)[-3:]
        xo, xi = sch.split(x, [None, L])
        sch.reorder(jp, xo, t, xi)
        sch.tensorize(t, cpu_bf16.ILV)
    vec(sch.get_loops(blk("P_round"))[-1], int(sch.get(blk("P_round")).iter_vars[1].dom.extent), L)
    # (acc_rescale reads what it writes: vectorize refuses it; its rows are a contiguous scale
    # LLVM vectorizes itself)
    for name in ("acc_init", "O_store"):
        sch.vectorize(sch.get_loops(blk(name))[-1])

    # Softmax stages across query rows, as the other forms
    for name in ("row_max", "P_exp", "row_sum", "state_init", "max_ref", "online_correction", "max_commit",
                 "score_mod"):
        if name != "score_mod" or has_block(sch, name + suffix):
            vectorize_rows(sch, sch.get_loops(blk(name))[-1], L)
    for name in ("row_max", "row_sum"):
        b = blk(name)
        sch.decompose_reduction(b, sch.get_loops(b)[-3])

    c_loop = sch.get_loops(blk("kv_tile"))[-1]
    unroll = sample_choice(sch, AUTO_UNROLL_STEPS, knobs.auto_unroll if pin else None)
    sch.annotate(c_loop, "pragma_auto_unroll_max_step", unroll)
    sch.annotate(c_loop, "pragma_unroll_explicit", 1)
    for key in ("s_rows", "pv_rows", "pv_cols", "d_unroll"):
        sch.annotate(row_tile, f"attn.{key}", getattr(knobs, key) if pin else (0 if key == "pv_cols" else 1))
    sch.annotate(row_tile, "attn.auto_unroll", unroll)
    fused = sch.fuse(*sch.get_loops(row_tile))
    chunk = sample_choice(sch, PARALLEL_CHUNKS, knobs.parallel_chunk if pin else None)
    outer, _ = sch.split(fused, [None, chunk])
    sch.parallel(outer)
    sch.annotate(row_tile, "attn.parallel_chunk", chunk)
    return sch
