"""Hand-schedule knobs: presets, feasibility errors, and several knob sets that all stay right."""
import numpy as np
import pytest

from tvm_attention.schedules import UnknownScheduleError, cpu_fused, get_schedule
from tvm_attention.build import build_kernel
from tvm_attention.reference import random_inputs, reference_attention
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target, vector_lanes

from conftest import built, report, run_kernel

TARGET = resolve_target("llvm")
SPEC = AttentionSpec(batch=1, heads=2, seq_q=150, seq_kv=333, head_dim=64, causal=True)


def test_presets_are_feasible():
    for d in (32, 64, 128, 256):
        spec = AttentionSpec(batch=1, heads=1, seq_q=64, head_dim=d)
        cpu_fused.check(cpu_fused.preset(spec, TARGET), spec, TARGET)


@pytest.mark.parametrize("lanes", [16, 8])
def test_pv_column_block_is_a_power_of_two_vectors(lanes):
    """A PV row of 3, 5, 6, ... accumulator vectors stays in memory (1.3-2.2x slower than a block
    of 1, 2 or 4 vectors: cpu_fused.pv_columns); a head_dim that is not a power-of-two number of
    vectors takes the widest such block with PV_ROWS_GOAL rows, one that is keeps all of it."""
    want = {16: {48: 16, 64: 64, 80: 16, 96: 32, 112: 16, 128: 128, 160: 32, 192: 64, 256: 64},
            8: {48: 16, 64: 16, 96: 16, 128: 16, 192: 16}}[lanes]
    assert {d: cpu_fused.pv_columns(d, lanes) for d in want} == want
    for d in (72, 40):  # no whole-vector divisor on AVX-512: the widest block that fits, as before
        assert cpu_fused.pv_columns(d, 16) == d


LANES = vector_lanes(TARGET)  # 16 on AVX-512 (32 vector registers), 8 on AVX2 (16)
#: (knobs, message) per ISA: each set breaks one rule on that ISA's registers and lanes.
INFEASIBLE = {
    16: [
        (dict(block_m=24), "multiple of vector_lanes"),
        (dict(block_n=50, s_rows=4), "multiple of s_rows"),
        (dict(pv_rows=3), "multiple of pv_rows"),
        (dict(s_rows=16), "S_gemm register block needs"),
        (dict(pv_rows=8), "PV_gemm register block needs"),
        (dict(vector_lanes=32, block_m=64), "vector_lanes=32"),
        (dict(block_m=32, block_n=4096, s_rows=4), "MAX_TILE_BYTES"),
        (dict(block_n=0), "positive int"),
    ],
    # AVX2: 8 lanes, so 24 rows are whole vectors and 12 are not; 16 ymm registers, so a row
    # of D=64 accumulators over all of head_dim (8 vectors) leaves room for one PV row, and 32
    # rows (4 vectors) for s_rows=2
    8: [
        (dict(block_m=12), "multiple of vector_lanes"),
        (dict(block_n=50, s_rows=4), "multiple of s_rows"),
        (dict(block_m=8, pv_rows=3), "multiple of pv_rows"),
        (dict(s_rows=8), "S_gemm register block needs"),
        (dict(pv_rows=2, pv_cols=0), "PV_gemm register block needs"),
        (dict(vector_lanes=16, block_m=32), "vector_lanes=16"),
        (dict(block_m=32, block_n=4096, s_rows=2), "MAX_TILE_BYTES"),
        (dict(block_n=0), "positive int"),
    ],
}


@pytest.mark.parametrize("knobs, message", INFEASIBLE[LANES])
def test_infeasible_knobs_are_rejected_by_name(knobs, message):
    base = cpu_fused.preset(SPEC, TARGET).to_dict()
    with pytest.raises(cpu_fused.KnobError, match=message):
        build_kernel(SPEC, knobs={**base, **knobs})


def test_unknown_knob_and_schedule():
    with pytest.raises(cpu_fused.KnobError, match="bogus"):
        build_kernel(SPEC, knobs={"bogus": 1})
    with pytest.raises(UnknownScheduleError, match="known"):
        get_schedule("nope", TARGET)


#: Knob sets that all fit their ISA (the preset is one more point), per float32 lane count.
KNOB_SETS = {
    16: [
        dict(block_m=16, block_n=32, s_rows=8, pv_rows=2),
        dict(block_m=32, block_n=64, s_rows=4, pv_rows=4),
        dict(block_m=32, block_n=128, s_rows=8, pv_rows=4),
        dict(block_m=48, block_n=96, s_rows=6, pv_rows=3),
        dict(block_m=64, block_n=64, s_rows=2, pv_rows=4),
        dict(block_m=16, block_n=256, s_rows=16, pv_rows=1),
    ],
    8: [  # AVX2: D=64 PV rows are one register row unless head_dim is split (pv_cols)
        dict(block_m=8, block_n=32, s_rows=8, pv_rows=1),
        dict(block_m=16, block_n=64, s_rows=4, pv_rows=1),
        dict(block_m=16, block_n=128, s_rows=4, pv_rows=2, pv_cols=32),
        dict(block_m=24, block_n=96, s_rows=3, pv_rows=1),
        dict(block_m=32, block_n=64, s_rows=2, pv_rows=1),
        dict(block_m=8, block_n=256, s_rows=8, pv_rows=2, pv_cols=32),
    ],
}


@pytest.mark.parametrize("knobs", KNOB_SETS[LANES], ids=lambda k: "m{block_m}_n{block_n}_s{s_rows}_p{pv_rows}".format(**k))
def test_knob_sets_all_correct_and_fused(knobs):
    key = tuple(sorted(knobs.items()))
    q, k, v = random_inputs(SPEC, seed=21)
    out = run_kernel(SPEC, q, k, v, knobs=key)
    ref = reference_attention(SPEC, q, k, v)
    assert np.allclose(out, ref, atol=1e-4, rtol=1e-4), report(out, ref)
    assert built(SPEC, knobs=key).audit.fused
