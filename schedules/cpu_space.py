"""What every CPU tile schedule shares (the fused kernel, its bf16 dot-product form, the
row-cached family): the register file the feasibility checks count, the choices the design space
samples, and the three sampling primitives, each pinned to a value when the hand knobs give one."""
from __future__ import annotations

import math

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.schedule import ScheduleError


# -- hardware limits the feasibility check names -------------------------------------------------
VECTOR_REGISTERS = {16: 32, 8: 16, 4: 16}  # lanes -> architectural vector registers (zmm/ymm/xmm)
MAX_TILE_BYTES = 512 * 1024  # a tile's local buffers must fit well inside a 1 MiB L2


# -- choices the design space samples (the hand knobs must be one of them) ---------------------
D_UNROLL_MAX = 8  # sample_perfect_tile bound for the head_dim split of S_gemm
PARALLEL_CHUNKS = (1, 2, 4)
AUTO_UNROLL_STEPS = (0, 16, 64, 256)


def max_s_rows(block_m: int, lanes: int) -> int:
    """Largest S_gemm register block that fits: s_rows·q_vectors + q_vectors + 1 <= registers."""
    q_vectors = block_m // lanes
    return (VECTOR_REGISTERS.get(lanes, 16) - q_vectors - 1) // q_vectors


def max_pv_rows(pv_cols: int, lanes: int) -> int:
    """Largest PV_gemm register block that fits: pv_rows·ceil(pv_cols/lanes) + 2 <= registers
    (accumulators, the V segment and the P broadcast)."""
    return (VECTOR_REGISTERS.get(lanes, 16) - 2) // math.ceil(pv_cols / lanes)


#: Rows of a PV_gemm register block the presets aim at: each V vector loaded is reused by this
#: many rows. A block of one row loads a V vector per FMA and is bound by the load ports: on a
#: 2-core znver4, B1 S2048 fp32 (2 threads), head_dim 256 on AVX-512 ran 122 GFLOP/s with one
#: row over all of head_dim and 194 with 4 rows × 64 columns; D=64 on AVX2 (mcpu znver3) 165
#: with one row over 64 columns, 174 with 4 × 16 (same tile).
PV_ROWS_GOAL = 4


def pv_columns(head_dim: int, lanes: int) -> int:
    """Head_dim columns per PV_gemm register block: all of head_dim when it is a power-of-two
    number of vectors and a row block of at least two rows fits the vector registers over it
    (AVX-512 up to D=128: every AVX-512 preset measured before AVX2), else the widest divisor of
    head_dim that is a power-of-two number of vectors and takes ``PV_ROWS_GOAL`` rows (AVX2 at
    D=64 and 128: 16 columns = 2 ymm; AVX-512 D=256: 64; D=96: 32) — so every head_dim builds on
    every x86 target, SSE too.

    Why the power of two (2-core znver4, B1 H8 S=1024 causal fp32, 2 threads, the preset's
    step over the column block's, alternated): a row of 3, 5, 6, 7, 10 or 12 accumulator
    vectors is not kept in registers even with the key loop unrolled (``auto_unroll``), a block
    of 1, 2 or 4 is. AVX-512 D=48 (16 columns) 1.28x, D=80 (16) 1.47x, D=96 (32) 1.49x,
    D=112 (16) 1.63x, D=160 (32) 1.78x, D=192 (64) 2.11x; AVX2 code D=48 (16) 1.30x, D=96
    (16) 2.18x. D=64 with 32 columns: level."""
    def pow2_vectors(c: int) -> bool:
        v = math.ceil(c / lanes)
        return v & (v - 1) == 0

    if max_pv_rows(head_dim, lanes) >= 2 and pow2_vectors(head_dim):
        return head_dim
    # whole vectors first, a power-of-two count of them first (D=80 on AVX2: 16 columns, not
    # 20 = 2½ ymm; D=192 on AVX-512: 64, not 96 = 6 zmm), then the widest
    divisors = [c for c in range(1, head_dim + 1) if head_dim % c == 0]
    fits = [c for c in divisors if max_pv_rows(c, lanes) >= PV_ROWS_GOAL]
    fits = fits or [c for c in divisors if max_pv_rows(c, lanes) >= 1]
    return max(fits, key=lambda c: (c % lanes == 0 and pow2_vectors(c), c % lanes == 0, c))


def dot_pv_columns(head_dim: int, lanes: int) -> int:
    """The bf16 dot-product form's PV column block (``cpu_bf16``): all of head_dim up to D=128, as
    measured (D=64, 128 presets), else :func:`pv_columns` (MLA's 512 columns are 32 zmm; D=192
    and 256 ran 1.30x and 1.18x faster in 64-column blocks than in full rows, 2-core znver4)."""
    return head_dim if head_dim <= 128 else pv_columns(head_dim, lanes)


def vectorize_rows(sch: s_tir.Schedule, loop, lanes: int) -> None:
    """Split ``loop`` into lanes-wide vectors, unroll the vector count, vectorize the lanes."""
    outer, inner = sch.split(loop, [None, lanes])
    sch.unroll(outer)
    sch.vectorize(inner)


def sample_tile(sch, loop, extent: int, inner: int | None, max_inner: int):
    """Perfect 2-way tile of ``loop``: pinned to ``inner`` when given (hand), else sampled."""
    decision = None if inner is None else [extent // inner, inner]
    return sch.sample_perfect_tile(loop, n=2, max_innermost_factor=max_inner, decision=decision)


def sample_choice(sch, options: tuple[int, ...], value: int | None):
    """One of ``options``: pinned to ``value`` when given (hand), else sampled uniformly."""
    decision = None if value is None else options.index(value)
    return sch.sample_categorical(list(options), [1.0 / len(options)] * len(options), decision=decision)


def has_block(sch: s_tir.Schedule, name: str) -> bool:
    """Whether ``sch`` has exactly one block named ``name`` (what ``get_sblock`` finds).

    Counted by a walk of the IR (~1 ms) where the module holds one function: a failed
    ``get_sblock`` renders the whole IR into its error (~35 ms a miss), and the schedules ask about
    blocks a layout lacks on every build (48 s of a suite run, py-spy 2026-12-07)."""
    funcs = [f for f in sch.mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    if len(funcs) == 1:
        found = []
        tvm_ffi.structural_walk(funcs[0].body, [(s_tir.SBlock, lambda b: found.append(b.name_hint == name))])
        return sum(found) == 1
    try:
        sch.get_sblock(name)
    except ScheduleError:  # no such block (a wrong argument raises TypeError: a bug, not an absence)
        return False
    return True
