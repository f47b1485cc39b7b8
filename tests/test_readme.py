"""Every Python block of the README runs as written, in order, after the README's main command
(`tvm-attention run`, whose artifact the blocks load) and its `tvm-attention build` commands."""
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import serving_env
from tvm_attention import cli

README = Path(__file__).resolve().parents[1] / "README.md"
RUN_ARTIFACT = "artifacts/fused_b1_h8_kv8_q1024_k1024_d64_float32_full"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def build_commands() -> list[list[str]]:
    """The one-line `tvm-attention build ... --out artifacts/...` commands of the README's bash
    blocks (what its serving examples load; CUDA builds span lines and are tested elsewhere)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        lines += [shlex.split(line)[1:] for line in block.splitlines()
                  if line.startswith("tvm-attention build ") and "--out artifacts/" in line and not line.endswith("\\")]
    return lines


def serving_blocks(blocks: list[str]) -> list[str]:
    """The blocks that serve through ``tvm_attention.load`` alone (no ``import tvm``, no
    transformers): they must run where only the serving install is."""
    return [b for b in blocks if "tvm_attention.load(" in b and not re.search(r"^import .*\btvm\b(?!_)", b, re.M)
            and "transformers" not in b]


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = python_blocks()
    assert len(blocks) >= 2
    assert any(RUN_ARTIFACT in b for b in blocks)  # they load what `tvm-attention run` writes
    monkeypatch.chdir(tmp_path)
    # What `tvm-attention run` writes (without its timing): the default spec, hand schedule.
    assert cli.main(["build", "--batch", "1", "--heads", "8", "--seq-q", "1024", "--head-dim", "64",
                     "--no-log", "--out", RUN_ARTIFACT]) == 0
    commands = build_commands()
    assert len(commands) >= 2  # the symbolic and the varlen artifact the serving examples load
    for argv in commands:
        assert cli.main(argv + ["--no-log"]) == 0, argv
    for i, block in enumerate(blocks):
        if "from transformers" in block and importlib.util.find_spec("transformers") is None:
            continue  # the [hf] extra is not installed here (CI installs it)
        proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"README python block {i + 1} failed:\n{block}\n{proc.stderr[-2000:]}"
    # The loader's serving examples again, where only the serving install is (no tvm at all).
    serving = serving_blocks(blocks)
    assert len(serving) >= 2
    python = serving_env.make(tmp_path / "venv")
    for block in serving:
        check = block + "\nimport sys\nassert not any(m == 'tvm' or m.startswith('tvm.') for m in sys.modules)\n"
        proc = subprocess.run([str(python), "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"README serving block failed without tvm:\n{block}\n{proc.stderr[-2000:]}"
