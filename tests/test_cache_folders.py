"""The caches of code (``tvm_attention.paths``: the build cache, the torch function's backward
artifacts, the transformers backend's): made private (0700, parents too), and refused, by name,
when another user owns them or may write them, or they are no folder at all."""
import os
import stat

import pytest

from tvm_attention import paths
from tvm_attention.paths import CacheFolderError, StaleArtifact, check_private, load_or_build, private_dir


def test_a_cache_is_made_private_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        made = private_dir(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", made):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert private_dir(made) == made  # an existing private folder is used as it is


def test_an_unsafe_or_impossible_folder_is_refused_by_name(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode in (0o775, 0o757, 0o777):
        os.chmod(shared, mode)
        with pytest.raises(CacheFolderError, match=f"{shared}: the cache folder is writable by other users "
                                                   f"\\(mode {mode:o}\\).*chmod go-w"):
            check_private(shared)
    os.chmod(shared, 0o700)
    check_private(shared)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(shared).st_uid + 1)  # someone else's folder
    with pytest.raises(CacheFolderError, match="belongs to user id"):
        check_private(shared)
    monkeypatch.undo()
    (tmp_path / "file").write_text("")
    with pytest.raises(CacheFolderError, match="file: exists and is not a folder"):
        private_dir(tmp_path / "file" / "builds")
    with pytest.warns(RuntimeWarning, match="not a folder.*the thing is built into a temporary folder"):
        fallback = paths.usable_cache(tmp_path / "file", "the thing")
    assert fallback.parent == paths.scratch_dir() and stat.S_IMODE(fallback.stat().st_mode) == 0o700


def test_load_or_build_rebuilds_what_is_not_asked_for(tmp_path):
    """A cached folder that does not load, or loads but is not what was asked, is rebuilt with a
    warning; a fresh build that is not what was asked raises instead of being used."""
    out = tmp_path / "cache" / "entry"
    out.mkdir(parents=True)
    (out / "manifest.json").write_text("foreign")
    built = []

    def build(o):
        o.mkdir(exist_ok=True)
        (o / "manifest.json").write_text("mine")
        built.append(o)

    def load(o):
        return (o / "manifest.json").read_text()

    def check(got):
        return None if got == "mine" else f"it is {got!r}"

    with pytest.warns(RuntimeWarning, match="is unusable \\(StaleArtifact: it is 'foreign'\\); rebuilding it"):
        assert load_or_build(out, load, build, check, "thing") == ("mine", "rebuilt")
    assert load_or_build(out, load, build, check, "thing") == ("mine", "loaded") and len(built) == 1
    with pytest.raises(StaleArtifact, match="just built is not the one asked for"):
        load_or_build(tmp_path / "cache" / "other", load, build, lambda got: "never right", "thing")
