"""The fusion audit reads the final lowered IR, and it can fail."""
import json

import pytest

from tvm_attention.audit import list_allocations
from tvm_attention.spec import AttentionSpec

from conftest import built

S4096 = AttentionSpec(batch=1, heads=8, seq_q=4096, head_dim=64)


def test_fused_passes_at_4096():
    report = built(S4096).audit
    assert report.verdict == "fused", report.format()
    names = {a.name: a for a in report.allocations}
    assert names["S"].scope == "local" and names["P"].scope == "local"
    # Nothing holds a score matrix: the largest buffer is one tile (at most 128 × 128), far
    # below 4096².
    assert report.largest.elements <= 128 * 128
    assert all(a.elements < S4096.score_elements() for a in report.allocations)


def test_materialized_fails_at_4096():
    report = built(S4096, "materialized").audit
    assert report.verdict == "not fused"
    s = {a.name: a for a in report.allocations}["S"]
    assert s.scope == "global" and s.elements == 8 * 4096 * 4096
    assert s.grows and any(r.startswith("S (global") and "grows with the sequence length" in r for r in report.reasons)
    assert any("not on chip" in r for r in report.reasons)


def test_size_rule_without_a_probe():
    # Where no probe build exists (here: the materialized S at twice the lengths would overflow
    # int32 indexing), the size rule still fails the score matrix.
    spec = AttentionSpec(batch=1, heads=8, seq_q=8192, head_dim=64)
    report = built(spec, "materialized").audit
    assert not report.fused and "error" in report.probe
    assert any("seq_q*seq_kv" in r for r in report.reasons)
    assert any("no probe build" in n for n in report.notes)
    lowered = built(S4096).lowered
    from tvm_attention.audit import audit
    assert audit(lowered, S4096).fused  # the fused tile is far below the matrix either way


def test_causal_and_gqa_fused_pass():
    spec = AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=4096, head_dim=128, causal=True)
    assert built(spec).audit.fused


def test_audit_reads_final_ir_not_the_schedule():
    # Allocations come from workspace calls after host finalization: sizes are in bytes there.
    allocs = list_allocations(built(S4096).lowered)
    assert {a.scope for a in allocs} == {"local"}
    assert all(a.bytes == a.elements * 4 for a in allocs)


def test_small_spec_verdicts():
    spec = AttentionSpec(batch=1, heads=1, seq_q=1, seq_kv=1, head_dim=64)
    report = built(spec).audit
    # The tile is bigger than a 1×1 score matrix, but it does not grow with the lengths.
    assert report.fused and report.largest.elements > spec.score_elements()
    mat = built(spec, "materialized").audit
    assert not mat.fused  # global S still fails: it grows


def test_report_serializes():
    d = built(S4096).audit.to_dict()
    json.dumps(d)
    assert d["verdict"] == "fused" and d["largest_allocation"]["scope"] == "local"


def test_rowcache_row_buffer_grows_with_seq_kv():
    sizes = []
    for s in (1024, 4096):
        spec = AttentionSpec(batch=1, heads=1, seq_q=s, head_dim=64)
        report = built(spec, "rowcache").audit
        sizes.append({a.name: a for a in report.allocations}["S"].elements)
        # never S×S, but its local row buffer grows with seq_kv: not fused
        assert not report.fused and sizes[-1] < spec.score_elements()
    assert sizes[1] == 4 * sizes[0]
    fused_sizes = [{a.name: a for a in built(AttentionSpec(batch=1, heads=1, seq_q=s, head_dim=64)).audit.allocations}["S"].elements
                   for s in (1024, 4096)]
    assert fused_sizes[0] == fused_sizes[1]  # the fused tile does not


def test_a_generator_bug_in_the_probe_raises(monkeypatch):
    # The probe may fail to exist (the schedule does not fit the doubled lengths: the audit says
    # "no probe build"), but a bug of the generator there (a TypeError, say) is not such a fact: it
    # raises instead of reading as "no probe" (issue 43: no blanket except hides a generator bug).
    from tvm_attention import build as build_mod

    spec = AttentionSpec(batch=1, heads=1, seq_q=64, head_dim=16)
    real = build_mod._schedule_module

    def schedule_module(family, s, knobs, target):
        if s != spec:  # the probe's spec (both lengths doubled)
            raise TypeError("a bug in the generator")
        return real(family, s, knobs, target)

    monkeypatch.setattr(build_mod, "_schedule_module", schedule_module)
    with pytest.raises(TypeError, match="a bug in the generator"):
        build_mod.build_kernel(spec, "fused")
