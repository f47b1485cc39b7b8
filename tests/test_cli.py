"""The CLI: build/inspect/validate round trip, the main job, and clear errors."""
import json

import pytest

from tvm_attention.cli import main


def test_build_inspect_validate(tmp_path, capsys):
    out = tmp_path / "art"
    rc = main(["build", "--batch", "1", "--heads", "4", "--kv-heads", "2", "--seq-q", "64", "--seq-kv", "96",
               "--head-dim", "64", "--causal", "--target", "llvm", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "audit: FUSED" in text and "validation: PASS" in text
    m = json.loads((out / "manifest.json").read_text())
    assert m["spec"]["kv_heads"] == 2 and m["spec"]["causal"] is True
    assert main(["inspect", str(out)]) == 0
    assert "fused" in capsys.readouterr().out
    assert main(["validate", str(out), "--seed", "5"]) == 0
    assert "validation: PASS" in capsys.readouterr().out


def test_build_materialized_records_failed_audit(tmp_path, capsys):
    out = tmp_path / "mat"
    rc = main(["build", "--batch", "1", "--heads", "1", "--seq-q", "256", "--head-dim", "64",
               "--schedule", "materialized", "--out", str(out)])
    assert rc == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["audit"]["verdict"] == "not fused" and m["schedule"]["name"] == "materialized"


def test_run_main_job_small(tmp_path, capsys):
    rc = main(["run", "--seq-q", "256", "--heads", "2", "--out", str(tmp_path / "run")])
    assert rc == 0
    text = capsys.readouterr().out
    for needle in ("audit: FUSED", "validation: PASS", "GFLOP/s", "ms per call", "artifact:"):
        assert needle in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "foo"], "unknown target 'foo'"),
        (["--target", "rocm"], "not supported"),
        (["--target", "cuda", "--arch", "sm_70"], "unsupported CUDA arch"),
        (["--arch", "sm_90"], "--arch applies to cuda targets only"),
        (["--kv-heads", "3"], "kv_heads"),
        (["--dtype", "float64"], "dtype='float64' is not supported"),
        (["--schedule", "materialized", "--dtype", "bfloat16"], "the materialized schedule builds dtype(s) float32"),
        (["--knobs", '{"block_m": 12}'], "block_m=12"),  # not a multiple of 8 (AVX2) nor 16 lanes
    ],
)
def test_bad_input_clear_error(tmp_path, capsys, args, message):
    rc = main(["build", "--batch", "1", "--heads", "4", "--seq-q", "32", "--head-dim", "64",
               "--out", str(tmp_path / "x"), *args])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_validate_missing_artifact(tmp_path, capsys):
    assert main(["validate", str(tmp_path)]) == 2
    assert "no manifest" in capsys.readouterr().err
