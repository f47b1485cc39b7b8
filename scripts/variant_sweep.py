"""The CPU kernel builds of the attention variants' tests that the test suite trims to covering sets.

``python scripts/variant_sweep.py [PYTEST ARGS]`` runs the kernel tests of tests/test_mla.py,
test_cascade.py, test_custom_mask.py, test_variants.py and test_modifiers.py with
``TVMA_VARIANT_SWEEP=1``, so they take their whole matrix instead of the default run's: its
builds at the preset's knobs (the default run builds without split-KV's nests where no call of a
test splits the keys, validation caches under one chunk of 256 keys or prefill-only shapes, and
the 20-head latent builds with row tiles of 16; those the tests always build unsplit stay so), a
plain latent cache of pages of 64 and an 8-bit one of pages of 16 beside the 8-bit one of pages of
64, and the plain paged cascade beside the kvcache one. The tiny benchmarks and the tune are left
out (the sweep changes nothing of theirs). About four minutes on 2 cores; extra arguments go to
pytest (``-n 2``, ``-x`` ...)."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = ["tests/test_mla.py", "tests/test_cascade.py", "tests/test_custom_mask.py", "tests/test_variants.py",
         "tests/test_modifiers.py"]


def main(argv: list[str]) -> int:
    os.environ["TVMA_VARIANT_SWEEP"] = "1"
    os.chdir(ROOT)  # pytest finds the project's conftest and pyproject from the root
    return int(pytest.main(["-q", "-p", "no:cacheprovider", *FILES, "-k", "not bench and not tune_and_build",
                            *argv]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
