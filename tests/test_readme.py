"""Every Python block of the README and of every page under docs/ runs as written, in order (the
README first, then docs/ by path), after the README's main command (`tvm-attention run`, whose
artifact the blocks load) and the `tvm-attention build` commands those pages show."""
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import serving_env
from tvm_attention import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUN_ARTIFACT = "artifacts/fused_b1_h8_kv8_q1024_k1024_d64_float32_full"


def pages() -> list[Path]:
    """The README, then every markdown page under docs/ (sorted by path)."""
    return [README] + sorted((ROOT / "docs").rglob("*.md"))


def blocks_of(kind: str, page: Path) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", page.read_text(), flags=re.S)


def python_blocks() -> list[tuple[str, str]]:
    """(page, block) for every ```python block of every page."""
    return [(str(p.relative_to(ROOT)), b) for p in pages() for b in blocks_of("python", p)]


def build_commands() -> list[list[str]]:
    """The one-line `tvm-attention build ... --out artifacts/...` commands of the pages' bash
    blocks (what their serving examples load; CUDA builds span lines and are tested elsewhere)."""
    lines = []
    for page in pages():
        for block in blocks_of("bash", page):
            lines += [shlex.split(line)[1:] for line in block.splitlines()
                      if line.startswith("tvm-attention build ") and "--out artifacts/" in line
                      and not line.endswith("\\")]
    return lines


def serving_blocks(blocks: list[str]) -> list[str]:
    """The blocks that serve through ``tvm_attention.load`` alone (no ``import tvm``, no
    transformers): they must run where only the serving install is."""
    return [b for b in blocks if "tvm_attention.load(" in b and not re.search(r"^import .*\btvm\b(?!_)", b, re.M)
            and "transformers" not in b]


def test_readme_and_docs_python_blocks_run(tmp_path, monkeypatch):
    found = python_blocks()
    blocks = [b for _, b in found]
    assert any(p == "README.md" for p, _ in found)  # the README's own serving example
    assert any(p.startswith("docs/") for p, _ in found)
    assert any(RUN_ARTIFACT in b for b in blocks)  # they load what `tvm-attention run` writes
    monkeypatch.chdir(tmp_path)
    # What `tvm-attention run` writes (without its timing): the default spec, hand schedule.
    assert cli.main(["build", "--batch", "1", "--heads", "8", "--seq-q", "1024", "--head-dim", "64",
                     "--no-log", "--out", RUN_ARTIFACT]) == 0
    commands = build_commands()
    assert len(commands) >= 2  # the symbolic and the varlen artifact the serving examples load
    for argv in commands:
        assert cli.main(argv + ["--no-log"]) == 0, argv
    run = [(page, block) for page, block in found
           if "from transformers" not in block or importlib.util.find_spec("transformers") is not None]
    # (without the [hf] extra installed, the transformers page's block is left out; CI installs it)
    run_blocks(sys.executable, run, tmp_path)
    # The loader's serving examples again, where only the serving install is (no tvm at all).
    serving = serving_blocks(blocks)
    assert len(serving) >= 2
    run_blocks(serving_env.shared(), [("serving", b) for b in serving], tmp_path,
               env=serving_env.env(), no_tvm=True)


#: Runs each block of a JSON list as a script of its own (a fresh ``__main__`` namespace), in
#: order, in one process: a fresh interpreter per block would import TVM (and the torch that
#: tvm_ffi imports) again, 3-4 s apiece. Stops at the first block that raises, naming it.
BLOCK_RUNNER = """
import json, sys, traceback
for i, (page, block) in enumerate(json.load(sys.stdin)):
    try:
        exec(compile(block, f"<{page}, block {i}>", "exec"), {"__name__": "__main__"})
        if NO_TVM:
            assert not any(m == "tvm" or m.startswith("tvm.") for m in sys.modules), "tvm was imported"
    except BaseException:
        sys.stderr.write(f"BLOCK {i} of {page} failed:\\n{block}\\n{traceback.format_exc()}")
        sys.exit(1)
"""


def run_blocks(python, blocks: list[tuple[str, str]], cwd, env=None, no_tvm: bool = False) -> None:
    """Run ``(page, block)`` pairs with ``python`` in order (``BLOCK_RUNNER``); ``no_tvm``: each
    must also leave ``tvm`` unimported."""
    proc = subprocess.run([str(python), "-c", f"NO_TVM = {no_tvm}\n" + BLOCK_RUNNER], input=json.dumps(blocks),
                          cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"a python block failed:\n{proc.stderr[-3000:]}"


def test_readme_is_a_first_page_and_every_doc_link_resolves():
    # The README serves a new user (what it is, the two commands, semantics, CLI, one serving
    # example, results, a map of docs/); the details live in docs/.
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move details to docs/"
    broken = []
    for page in pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not a link
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)
