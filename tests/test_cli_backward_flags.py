"""``tune --backward`` and ``bench --backward``'s flags (issue 62): what the backward does not use
is refused by name, never silently ignored; a ``--work-dir`` that is a file and lengths that are
no lengths are named; ``bench --backward`` honours ``--seq``. Argument checks only: each test
answers before a kernel is built (the bench's one reaches the benchmark's entry and stops there)."""
from __future__ import annotations

import pytest

from tvm_attention import cli

TUNE = ["tune", "--backward", "--batch", "1", "--heads", "2", "--seq-q", "64", "--head-dim", "16"]


@pytest.mark.parametrize("flags", [["--trials", "8"], ["--search", "random"], ["--per-round", "4"], ["--seed", "3"],
                                   ["--trials", "64"],  # its default value, but given: still refused
                                   ["--threads", "1"], ["--schedule", "fused"], ["--rpc-key", "k"]])
def test_tune_backward_refuses_the_forward_searchs_flags_by_name(tmp_path, capsys, flags, monkeypatch):
    from tvm_attention.tune import backward as tb

    monkeypatch.setattr(tb, "tune_backward", lambda *a, **k: pytest.fail("the search ran"))
    assert cli.main(TUNE + flags + ["--work-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "tvm-attention tune: error: tune --backward " in err and f"{flags[0]} is for the forward's search" in err


def test_tune_backward_names_several_refused_flags_at_once(tmp_path, capsys, monkeypatch):
    from tvm_attention.tune import backward as tb

    monkeypatch.setattr(tb, "tune_backward", lambda *a, **k: pytest.fail("the search ran"))
    assert cli.main(TUNE + ["--trials", "8", "--seed", "1", "--work-dir", str(tmp_path)]) == 2
    assert "--trials, --seed are for the forward's search" in capsys.readouterr().err


def test_tune_backward_names_a_work_dir_that_is_a_file(tmp_path, capsys, monkeypatch):
    from tvm_attention.tune import backward as tb

    monkeypatch.setattr(tb, "tune_backward", lambda *a, **k: pytest.fail("the search ran"))
    f = tmp_path / "log.json"
    f.write_text("{}")
    for work, blocker in ((f, f), (f / "sub", f)):
        assert cli.main(TUNE + ["--work-dir", str(work)]) == 2
        err = capsys.readouterr().err
        assert f"--work-dir {work}: {blocker} is a file, not a folder" in err, err
        assert "Traceback" not in err and "FileExistsError" not in err
    assert f.read_text() == "{}"


@pytest.mark.parametrize("other", ["--loader", "--decode", "--halfprec", "--mla", "--masks", "--serving",
                                   "--variant-costs", "--kv-accuracy"])
def test_bench_backward_with_another_benchmark_is_refused_by_name(tmp_path, capsys, other):
    assert cli.main(["bench", "--backward", other, "--tiny", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"choose one of {other}, --backward" in err or f"choose one of --backward, {other}" in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("seq", [["0"], ["-5"], ["256", "0"]])
def test_bench_refuses_lengths_that_are_not_positive(tmp_path, capsys, seq):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--backward", "--tiny", "--seq", *seq, "--out", str(tmp_path)])
    assert e.value.code == 2
    bad = next(s for s in seq if int(s) <= 0)
    assert f"argument --seq: {bad}: a sequence length is a positive int" in capsys.readouterr().err


def test_bench_backward_honours_seq(tmp_path, monkeypatch, capsys):
    """``--seq`` replaces the backward benchmark's lengths (with ``--tiny`` too); without it the
    benchmark keeps its own (S 1k-8k, not the sweep's default)."""
    from tvm_attention.bench import backward

    seen = []

    def run(cfg, threads, say=print):
        seen.append(cfg.seqs)
        raise KeyboardInterrupt  # stop at the benchmark's entry: nothing measured, nothing written

    monkeypatch.setattr(backward, "run", run)
    for extra, want in ((["--tiny", "--seq", "96", "160"], (96, 160)), (["--seq", "512"], (512,)),
                        (["--tiny"], backward.quick_config().seqs), ([], backward.Config().seqs)):
        assert cli.main(["bench", "--backward", *extra, "--threads", "2", "--out", str(tmp_path)]) == 130
        assert seen[-1] == want, extra
    assert "interrupted before the first point" in capsys.readouterr().out
