"""The backward's knobs searched with MetaSchedule (issue 46; ``tvm_attention.tune.backward``): each
point a task measured by MetaSchedule's builder and runner and recorded in its JSON database; the
fastest is read back without rerunning; a corrupt log and specs the runner would misread are
refused by name."""
from __future__ import annotations

import pytest

from tvm_attention.backward import BackwardKnobs
from tvm_attention.errors import SpecError
from tvm_attention.spec import AttentionSpec
from tvm_attention.tune.backward import WORKLOADS, best_knobs, tune_backward

SPEC = AttentionSpec(batch=1, heads=2, seq_q=128, seq_kv=128, head_dim=16, causal=True)
POINTS = (BackwardKnobs(32, 32, 64), BackwardKnobs(32, 64, 128))


def test_every_point_is_measured_recorded_and_read_back(tmp_path, monkeypatch, capsys):
    """``tvm-attention tune --backward`` (two points instead of the default 24: the suite's time)."""
    from tvm_attention import cli
    from tvm_attention.tune import backward as tb

    monkeypatch.setattr(tb, "CANDIDATES", POINTS)
    argv = ["tune", "--backward", "--batch", "1", "--heads", "2", "--seq-q", "128", "--seq-kv", "128",
            "--head-dim", "16", "--causal", "--work-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| block_m | block_n | block_m_dq | dq_chunks | ms |" in out and "best: block_m=" in out
    found = best_knobs(SPEC, tmp_path, candidates=POINTS)  # from the database alone
    assert set(found.seconds) == set(POINTS) and not found.errors
    assert f"dq_chunks={found.knobs.dq_chunks} " in out
    assert all(0 < s < 1 for s in found.seconds.values())
    assert found.knobs == min(found.seconds, key=found.seconds.get)
    with pytest.raises(SpecError, match="no point of .* was measured"):  # another spec: not in this log
        best_knobs(AttentionSpec(batch=1, heads=2, seq_q=128, seq_kv=128, head_dim=16), tmp_path, candidates=POINTS)


def test_a_corrupt_or_missing_log_and_untunable_specs_are_refused_by_name(tmp_path, capsys):
    with pytest.raises(SpecError, match="database_workload.json is missing"):
        best_knobs(SPEC, tmp_path)
    (tmp_path / WORKLOADS).write_text("{not json\n")
    (tmp_path / "database_tuning_record.json").write_text("")
    with pytest.raises(SpecError, match="database_workload.json, line 1, is not JSON"):
        best_knobs(SPEC, tmp_path)
    from tvm_attention import cli

    assert cli.main(["tune", "--backward", "--batch", "1", "--heads", "2", "--seq-q", "64", "--head-dim", "16",
                     "--runner", "dir:/tmp/x", "--work-dir", str(tmp_path)]) == 2
    assert "--runner is for the forward's search" in capsys.readouterr().err
    for kw, what in ((dict(layout="varlen"), "static BHSD spec without a custom mask"),
                     (dict(custom_mask=True), "with a custom mask"), (dict(dynamic=["seq_q"]), "symbolic dims seq_q")):
        with pytest.raises(SpecError, match=what):
            tune_backward(AttentionSpec(batch=1, heads=2, seq_q=128, seq_kv=128, head_dim=16, **kw), tmp_path)


def test_a_target_the_backward_does_not_build_for_is_refused_by_name(tmp_path, monkeypatch):
    """As ``build_backward``: the search builds the CPU kernel, so a CUDA target is refused by name
    before any workload is made or anything is written (issue 62)."""
    from tvm_attention.target import TargetError
    from tvm_attention.tune import backward as tb

    monkeypatch.setattr(tb, "_modules", lambda *a: pytest.fail("a workload was made"))
    for search in (tune_backward, best_knobs):
        with pytest.raises(TargetError, match="backward: target kind 'cuda' is not built.*a CPU kernel"):
            search(SPEC, tmp_path / "log", target={"kind": "cuda", "arch": "sm_90"}, candidates=POINTS)
    assert not (tmp_path / "log").exists()
