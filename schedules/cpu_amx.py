"""CPU schedule of the fused kernel's AMX form (``dot_bf16`` 2, emulated 3): QKᵀ and PV on Intel
AMX tiles (``tdpbf16ps``), the softmax on AVX-512 vectors.

The workload (``workloads.fused._tile_macro`` with :mod:`tvm_attention.workloads.amx`) writes the
two products as calls of a 32 × 32 tile micro-kernel over the staged operands, in opaque blocks
``S_gemm`` and ``PV_gemm``: nothing of them is left to schedule. What this schedule does is the
rest of the tile, with :mod:`cpu_bf16`'s pieces (the same staging): the key and value tiles'
copy by rows, ``Q_load``'s pairs, V's and P's pair words (``V_pack``, ``P_pack``, 16 per
vector), the softmax stages across query rows, the row tiles parallel.

The emulated form's blocks are the same; its micro-kernel is plain TIR (slow: a checking form).
Knobs: ``block_m``/``block_n`` (the workload's, multiples of 32), ``parallel_chunk`` and
``auto_unroll`` (pinned or sampled, recorded as ``attn.*`` like the other forms); ``s_rows``,
``pv_rows`` and ``pv_cols`` mean nothing here and are recorded as given (1 when sampled)."""
from __future__ import annotations

from tvm import s_tir

from ..spec import AttentionSpec
from ..workloads import amx
from . import cpu_bf16
from .cpu_space import has_block, vectorize_rows

L = 16  # float32 lanes of a zmm register
#: the ISA features the real form needs beyond AVX-512 (the emulated form: none)
FEATURES = ("amx-tile", "amx-bf16", "avx512f")


def misfit(spec: AttentionSpec, features: set[str], block_m: int = 32, block_n: int = 32,
           real: bool = True) -> str | None:
    """Why ``spec`` cannot take the AMX form at these tiles on a CPU with ``features`` (None: it
    can). ``real``: the tile instructions themselves; the emulated form runs on any CPU."""
    if spec.dtype != "bfloat16" or spec.kv_quantized:
        return f"multiplies bfloat16 inputs: dtype={spec.dtype}, kv_dtype={spec.kv_dtype}"
    why = amx.fits(block_m, block_n, spec.head_dim, spec.v_dim)
    if why:
        return why
    missing = [f for f in FEATURES if f not in features]
    return f"needs a CPU with {', '.join(missing)}" if real and missing else None


#: the decode nests' tiles (``decode_dot`` 6): bf16 (QKᵀ and PV) or int8 (``qk_int8``'s QKᵀ)
DECODE_FEATURES = {False: FEATURES, True: ("amx-tile", "amx-int8", "avx512f")}


def decode_misfit(spec: AttentionSpec, features: set[str], rows: int, block_n: int, heads: int = 1,
                  real: bool = True) -> str | None:
    """Why a decode nest of ``rows`` rows per kv head, ``heads`` kv heads per task, cannot take
    the tiles (``decode_dot`` 6; emulated 7, ``real`` False) on a CPU with ``features`` (None:
    it can)."""
    why = amx.decode_fits(spec, rows * heads, block_n, heads)
    if why:
        return why
    missing = [f for f in DECODE_FEATURES[bool(spec.qk_int8)] if f not in features]
    return f"needs a CPU with {', '.join(missing)}" if real and missing else None


def supports(spec: AttentionSpec, features: set[str], block_m: int = 32, block_n: int = 32) -> bool:
    """Whether ``spec`` can take the AMX form (the real one) on a CPU with ``features``."""
    return misfit(spec, features, block_m, block_n) is None


def schedule(sch: s_tir.Schedule, spec: AttentionSpec, knobs=None, suffix: str = "") -> s_tir.Schedule:
    """Schedule the AMX main nest (blocks ``*<suffix>``): with ``knobs`` every decision is pinned
    (the hand schedule), with None sampled (the design space)."""
    row_tile = sch.get_sblock("row_tile" + suffix)
    pin = knobs is not None
    cpu_bf16.register()

    def blk(name):
        return sch.get_sblock(name + suffix)

    # (no K_load where every key tile is read in place: a static length in whole tiles)
    cpu_bf16.stage_copies(sch, blk, spec.head_dim if has_block(sch, "K_load" + suffix) else 0, 0)
    # V's pairs packed as words along its rows (V_pack), P's across its rows (P_pack): 32-bit
    # lanes, 16 words per vector; P_tr (the words transposed) is the workload's call, as the
    # products are
    for name in ("V_pack", "P_pack"):
        vectorize_rows(sch, sch.get_loops(blk(name))[-1], L)
    cpu_bf16.vectorize_softmax(sch, blk, suffix)
    # s_rows, pv_rows, pv_cols: no register blocks here (the decode nests' knobs, recorded as given)
    recorded = {key: getattr(knobs, key) if pin else (0 if key == "pv_cols" else 1)
                for key in ("s_rows", "pv_rows", "pv_cols", "d_unroll")}
    return cpu_bf16.parallel_rows(sch, row_tile, blk, knobs, recorded, None)
