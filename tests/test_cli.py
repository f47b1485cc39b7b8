"""The CLI: build/inspect/validate round trip, the main job, and clear errors."""
import json
import re

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
    # What a newcomer reads (README "What `run` prints"): which criterion passed, what was
    # allocated beside what a score matrix would be, and the fraction of this CPU's FMA peak.
    assert re.search(r"validation: PASS  every element within \|out - ref\| <= atol \+ rtol·\|ref\| "
                     r"\(atol 0\.0001, rtol 0\.0001\), the worst at [\d.]+% of its bound; max abs err", text), text
    assert re.search(r"audit: FUSED  \(largest buffer \w+ \d+ elements \(local\); one Sq×Skv score matrix would be "
                     r"65536 elements\)", text), text
    peak = re.search(r"peak: +(\d+)% of the FMA peak \((\d+) GFLOP/s on \d+ threads, measured just now\)", text)
    assert peak and 0 < int(peak.group(1)) < 150 and int(peak.group(2)) > 0, text
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert 0 <= m["validation"]["tolerance_used"] <= 1
    # The README shows this output line by line: the same lines, in the same order.
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shown = re.search(r"### What `run` prints\n\n```\n(.*?)```", readme, re.S).group(1)

    def labels(out: str) -> list[str]:
        return [line.split(":")[0] for line in out.splitlines() if re.match(r"[a-z]+:", line)]

    assert labels(shown) == labels(text), (labels(shown), labels(text))


def test_validation_line_says_which_criterion_passed():
    # A max rel err above rtol is no failure (the criterion is atol + rtol·|ref| per element):
    # the line says the criterion held, and how close the worst element came to its bound.
    import numpy as np

    from tvm_attention import AttentionSpec
    from tvm_attention.validate import compare

    spec = AttentionSpec(batch=1, heads=1, seq_q=1, head_dim=2)
    ref = np.array([[[[1.0, 1e-6]]]])
    ok = compare(spec, ref + np.array([0.0, 5e-5]), ref, 0, "all")
    assert ok.passed and ok.max_rel_err > ok.rtol
    assert ok.format().startswith("validation: PASS  every element within |out - ref| <= atol + rtol·|ref| "
                                  "(atol 0.0001, rtol 0.0001), the worst at 50.0% of its bound; max abs err")
    bad = compare(spec, ref + np.array([0.0, 3e-4]), ref, 0, "all")
    assert not bad.passed and bad.format().startswith("validation: FAIL  max abs err 3.000e-04")
    assert "wanted every element within" in bad.format() and "the worst at 3× its bound" in bad.format()


def test_run_takes_a_json_target_this_host_runs_and_keeps_knob_experiments_apart(tmp_path, capsys, monkeypatch):
    # `run` takes every build flag, --target JSON included when this host can run the code; the
    # default artifact folder of a --knobs run carries the knobs' digest (the default build's
    # artifact stays), and a folder an earlier run left is replaced with a note.
    monkeypatch.chdir(tmp_path)
    haswell = '{"kind": "llvm", "mcpu": "x86-64-v3"}'  # AVX2 + FMA, vendor-neutral: every CPU we run on has them
    small = ["--seq-q", "64", "--heads", "1", "--no-log", "--target", haswell]
    assert main(["run", *small]) == 0
    text = capsys.readouterr().out
    default = tmp_path / "artifacts" / "fused_b1_h1_kv1_q64_k64_d64_float32_full"
    assert f"artifact:   {default}\n" in text and '"mcpu":"x86-64-v3"' in text
    assert json.loads((default / "manifest.json").read_text())["target"]["mcpu"] == "x86-64-v3"
    before = (default / "manifest.json").read_text()
    assert main(["run", *small, "--knobs", '{"block_n": 32}']) == 0
    text = capsys.readouterr().out
    knob_dirs = [d for d in (tmp_path / "artifacts").iterdir() if d.name.startswith("fused-knobs-")]
    assert len(knob_dirs) == 1 and f"artifact:   {knob_dirs[0]}\n" in text
    assert json.loads((knob_dirs[0] / "manifest.json").read_text())["schedule"]["knobs"]["block_n"] == 32
    assert (default / "manifest.json").read_text() == before
    assert main(["run", *small]) == 0
    assert "(replaced the one an earlier run left there)" in capsys.readouterr().out


@pytest.mark.parametrize("target, message", [
    ('{"kind": "llvm", "mcpu": "znver4"}', "avx512"),  # this "host" is AVX2 only (the override below)
    ("cuda", "`run` times the kernel on this machine's CPU"),
])
def test_run_refuses_a_target_this_host_cannot_run(tmp_path, capsys, monkeypatch, target, message):
    from tvm_attention.hostcpu import HOST_CPU_ENV

    monkeypatch.setenv(HOST_CPU_ENV, "x86-64-v3")
    arch = ["--arch", "sm_80"] if target == "cuda" else []
    rc = main(["run", "--target", target, *arch, "--out", str(tmp_path / "x")])
    assert rc == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


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


def test_help_explains_every_flag_and_shows_defaults(capsys):
    from tvm_attention.cli import build_parser

    parser = build_parser()
    bare = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, p in parser.commands.items()
            for a in p._actions if not a.help and a.dest != "help"]
    assert not bare, f"flags without help text: {bare}"
    for argv, needles in [
        (["--help"], ["Build, audit, validate, export and run fused attention", "Start with: tvm-attention run"]),
        (["run", "--help"], ["The main job: build the default spec", "--seq-q SQ", "(default: 1024)",
                             "query heads (default: 8)", "head dimension (default: 64)"]),
        (["build", "--help"], ["--batch B --seq-q SQ", "required with --layout bhsd"]),
        (["bench", "--help"], ["(default: 256 512 1024 2048 4096 8192 16384)", "(default: both)"]),
        (["tune", "--help"], ["(default: 64)", "seed of the search"]),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())  # help wraps lines
        assert "``" not in text
        for needle in needles:
            assert needle in text, (argv, needle)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and re.match(r"tvm-attention \d+\.\d+\.\d+ \(apache-tvm 0\.27", out), out


@pytest.mark.parametrize("argv, hint, usage", [
    (["run", "--seqq", "2048"], "did you mean --seq-q?", "usage: tvm-attention run"),
    (["biuld"], "did you mean 'build'?", "usage: tvm-attention [-h]"),
    (["run", "--layout", "pagd"], "did you mean 'paged'?", "usage: tvm-attention run"),
    (["build", "--heads", "1", "--head-dim", "8", "--out", "x", "--shedule", "fused"], "did you mean --schedule?",
     "usage: tvm-attention build"),
])
def test_a_mistyped_flag_gets_its_commands_usage_and_a_suggestion(capsys, argv, hint, usage):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and hint in err and err.startswith(usage), err


def test_a_missing_batch_names_the_layout(tmp_path, capsys):
    assert main(["build", "--heads", "1", "--seq-q", "32", "--head-dim", "64", "--out", str(tmp_path / "x")]) == 2
    assert "--batch is required with --layout bhsd" in capsys.readouterr().err


def test_run_in_the_runtime_only_install_says_it_needs_the_full_install(tmp_path):
    # The serving install (tvm-ffi, NumPy, ml_dtypes; no compiler) loads artifacts; building is
    # the full install's: one line that says so, not a ModuleNotFoundError traceback.
    import subprocess

    import serving_env

    python = serving_env.shared()
    proc = subprocess.run([str(python), "-m", "tvm_attention.cli", "run"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=serving_env.env())
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("tvm-attention run: error: `run` compiles kernels, which needs the full install")
    assert "'tvm'" in proc.stderr
    version = subprocess.run([str(python), "-m", "tvm_attention.cli", "--version"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=60, env=serving_env.env())
    assert version.returncode == 0 and "apache-tvm not installed" in version.stdout
