"""What every CPU tile schedule shares (the fused kernel, its bf16 dot-product form, the
row-cached family): the register file the feasibility checks count, the choices the design space
samples, and the three sampling primitives, each pinned to a value when the hand knobs give one."""
from __future__ import annotations

import math

from tvm import s_tir
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
    """Whether ``sch`` has a block named ``name``."""
    try:
        sch.get_sblock(name)
    except ScheduleError:  # no such block (a wrong argument raises TypeError: a bug, not an absence)
        return False
    return True
