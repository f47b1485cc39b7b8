"""The long offline CUDA build sweeps that the test suite covers only by a covering set.

``python scripts/cuda_build_sweep.py [PYTEST ARGS]`` runs tests/test_cuda.py's sweepable tests
with ``TVMA_CUDA_SWEEP=1``, so they take their whole cross product instead of the default run's
covering set: today the SIMT presets (seq × arch × head_dim × dtype × causal, 32 nvcc builds,
about a minute on 2 cores) and the Hopper presets (head_dim × dtype × causal × symbolic, 16,
with its 16-bit paged decode, varlen build, build with every variant and int8 cache, and the fp8
prefill's symbolic bhsd build beside its varlen one). Needs nvcc (cross-compiles only: no GPU); extra arguments go to
pytest (``-n 2``, ``-x`` ...)."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = ["tests/test_cuda.py::test_presets_compile_offline_without_spills",
          "tests/test_hopper.py::test_sm90a_builds_offline", "tests/test_hopper.py::test_layout_builds_offline",
          "tests/test_hopper_fp8.py::test_fp8_builds_offline"]


def main(argv: list[str]) -> int:
    os.environ["TVMA_CUDA_SWEEP"] = "1"
    os.chdir(ROOT)  # pytest finds the project's conftest and pyproject from the root
    return int(pytest.main(["-q", "-p", "no:cacheprovider", *SWEEPS, *argv]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
