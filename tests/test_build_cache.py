"""The build cache (tvm_attention.build_cache): a hit is the build, runs and validates; any change
to what decides the code misses; damage is rebuilt; concurrent builders are both right.

Every test here uses a cache folder of its own (``cache_root``), not the run's shared one."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tvm_attention import build_cache
from tvm_attention.artifact import validate_built
from tvm_attention.audit import list_allocations
from tvm_attention.build import build_kernel
from tvm_attention.cli import main
from tvm_attention.schedules import get_schedule
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target

ROOT = Path(__file__).resolve().parents[1]
SPEC = AttentionSpec(batch=1, heads=2, kv_heads=1, seq_q=48, seq_kv=80, head_dim=32, causal=True)
TARGET = resolve_target("llvm")


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv(build_cache.DIR_ENV, str(tmp_path / "builds"))
    monkeypatch.setenv(build_cache.ENABLE_ENV, "1")
    return tmp_path / "builds"


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """SPEC built once into a cache of this module's: (the build, its entry, seconds it took).
    A test copies the entry into its own cache (``_seeded``) instead of building again."""
    mp = pytest.MonkeyPatch()
    mp.setenv(build_cache.DIR_ENV, str(tmp_path_factory.mktemp("seed")))
    mp.setenv(build_cache.ENABLE_ENV, "1")
    try:
        t0 = time.perf_counter()
        built = build_kernel(SPEC, cache=True)
        seconds = time.perf_counter() - t0
        assert built.cache_entry is None
        (entry,) = _entries(build_cache.root())
    finally:
        mp.undo()
    return built, entry, seconds


def _seeded(seed, root: Path) -> Path:
    entry = root / seed[1].parent.name / seed[1].name
    shutil.copytree(seed[1], entry)
    return entry


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*") if not p.name.startswith("."))


def _key(spec=SPEC, schedule="fused", target=TARGET, **knobs) -> str:
    preset = get_schedule(schedule, target).preset(spec, target)
    return build_cache.hand_key(spec, schedule, target, dataclasses.replace(preset, **knobs))[0]


def test_a_hit_is_the_build_and_runs(seed, cache_root):
    first, _, t_build = seed
    entry = _seeded(seed, cache_root)
    t0 = time.perf_counter()
    hit = build_kernel(SPEC, cache=True)
    t_hit = time.perf_counter() - t0
    assert hit.cache_entry == str(entry)
    assert t_hit < t_build / 3, (t_hit, t_build)  # at once: no lowering, no LLVM
    v = validate_built(hit, seed=3)  # the stored library, run against the reference
    assert v.ran and v.passed, v.format()
    assert (hit.source, hit.knobs, hit.audit, hit.data_alignment) == (first.source, first.knobs, first.audit,
                                                                      first.data_alignment)
    assert hit.audit.fused and hit.lowered.script() == first.lowered.script()
    assert list_allocations(hit.lowered) == list_allocations(first.lowered)  # the IR itself, parsed back
    # an artifact exported from a hit: its library, loaded and validated by the CLI
    from tvm_attention.artifact import export

    export(hit, cache_root.parent / "art", v)
    assert main(["validate", str(cache_root.parent / "art")]) == 0


def test_a_changed_knob_spec_target_or_source_misses(seed, cache_root, monkeypatch):
    entry = _seeded(seed, cache_root)
    key = _key()
    assert entry.name == key
    preset = seed[0].knobs
    others = [_key(block_n=preset.block_n // 2), _key(dataclasses.replace(SPEC, seq_kv=81)),
              _key(dataclasses.replace(SPEC, softcap=30.0)), _key(schedule="rowcache"),
              # another CPU than the host's (an AVX2 run's host target is x86-64-v3 itself)
              _key(target=resolve_target({"kind": "llvm", "mcpu": "znver4" if TARGET.attrs["mcpu"] == "x86-64-v3"
                                          else "x86-64-v3"})),
              _key(target=resolve_target({"kind": "llvm", "num-cores": 1}))]
    assert len({key, *others}) == 1 + len(others)
    # a knob changed: built, validated, stored beside the first
    other = build_kernel(SPEC, knobs={"block_n": preset.block_n // 2}, cache=True)
    assert other.cache_entry is None and other.knobs.block_n == preset.block_n // 2 and validate_built(other).passed
    assert len(_entries(cache_root)) == 2
    # An edited generator source (a schedule's file here): a new digest, so no entry matches.
    real = build_cache.module_files

    def edited(name):
        out = []
        for rel, path in real(name):
            if path.name == "cpu_fused.py":
                copy = cache_root.parent / "cpu_fused.py"
                copy.write_bytes(path.read_bytes() + b"\n# an edit\n")
                path = copy
            out.append((rel, path))
        return out

    before = build_cache.source_digest()
    monkeypatch.setattr(build_cache, "module_files", edited)
    monkeypatch.setattr(build_cache, "_DIGEST", [])
    assert build_cache.source_digest() != before
    assert _key() != key and build_cache.lookup(_key(), TARGET, SPEC) is None
    monkeypatch.setattr(build_cache, "_DIGEST", [before])
    assert build_cache.lookup(key, TARGET, SPEC) is not None  # the entry itself is still there, intact


def test_the_generator_list_holds_every_module_the_build_imports():
    """GENERATOR_MODULES covers the import graph of tvm_attention.build (the imports inside
    functions counted: scripts/check_structure.py), so no source that shapes a build is left out
    of the digest. A module added to the build path must be added there too."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_structure
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    graph = {}
    for imp in check_structure.imports():
        graph.setdefault(imp.module, set()).add(imp.target)
    seen, todo = set(), ["tvm_attention.build"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    covered = {m for m in seen if any(m == g or m.startswith(g + ".") for g in build_cache.GENERATOR_MODULES)}
    assert seen - covered == set()
    assert all(build_cache.module_files(m) for m in build_cache.GENERATOR_MODULES)
    digested = {p.resolve() for m in build_cache.GENERATOR_MODULES for _, p in build_cache.module_files(m)}
    assert (ROOT / "schedules" / "cpu_fused.py").resolve() in digested
    assert (ROOT / "tvm_attention" / "workloads" / "fused.py").resolve() in digested


def test_cli_reuses_the_cache_and_no_cache_builds(seed, cache_root, tmp_path, capsys):
    entry = _seeded(seed, cache_root)
    args = ["build", "--batch", "1", "--heads", "2", "--kv-heads", "1", "--seq-q", "48", "--seq-kv", "80",
            "--head-dim", "32", "--causal", "--no-log"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr()
    assert f"from the build cache: {entry} (--no-cache builds it again)" in out.err and "validation: PASS" in out.out
    assert main([*args, "--no-cache", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr()
    assert "from the build cache" not in out.err and "validation: PASS" in out.out
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in "ab")
    assert a["library_sha256"] == build_cache._sha256(entry / build_cache.LIBRARY)  # the cached library, exported
    assert a["validation"]["passed"] and b["validation"]["passed"] and a["audit"] == b["audit"]
    assert a["schedule"] == b["schedule"] and a["audit"]["verdict"] == "fused"
    assert _entries(cache_root) == [entry]  # --no-cache neither read nor wrote it


def test_the_cache_can_be_turned_off(monkeypatch):
    assert build_cache.enabled(True) and not build_cache.enabled(False)
    for off in ("0", "off"):
        monkeypatch.setenv(build_cache.ENABLE_ENV, off)
        assert not build_cache.enabled(True)


DAMAGES = ["truncated library", "missing meta", "garbage entry.json", "bad meta", "library not a library"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_entry_is_not_trusted(seed, cache_root, damage):
    entry = _seeded(seed, cache_root)
    lib, meta, info_file = entry / build_cache.LIBRARY, entry / build_cache.META, entry / build_cache.ENTRY
    if damage == "truncated library":
        lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])
    elif damage == "missing meta":
        meta.unlink()
    elif damage == "garbage entry.json":
        info_file.write_text("{not json")
    else:  # files that do not load, their recorded digests matching (an entry written by other code)
        (meta if damage == "bad meta" else lib).write_bytes(b"\x80\x05garbage")
        info = json.loads(info_file.read_text())
        for name in (build_cache.META, build_cache.LIBRARY):
            info["sha256"][name] = build_cache._sha256(entry / name)
        info_file.write_text(json.dumps(info))
    assert build_cache.lookup(entry.name, TARGET, SPEC) is None
    assert not entry.exists() and _entries(cache_root) == []  # removed, to be built again


def test_a_damaged_entry_is_rebuilt_and_stored_again(seed, cache_root):
    entry = _seeded(seed, cache_root)
    lib = entry / build_cache.LIBRARY
    lib.write_bytes(lib.read_bytes()[:1000])
    rebuilt = build_kernel(SPEC, cache=True)
    assert rebuilt.cache_entry is None  # built, not trusted
    v = validate_built(rebuilt)
    assert v.passed, v.format()
    again = build_kernel(SPEC, cache=True)  # stored again, intact
    assert again.cache_entry == str(entry) and validate_built(again).passed


def test_half_written_entries_are_never_read(seed, cache_root):
    """A writer's temporary folder (a crash mid-store) sits beside the entries and is never taken
    for one; a store renames a complete folder into place."""
    built, _, _ = seed
    key, doc = build_cache.hand_key(SPEC, "fused", TARGET, built.knobs)
    shard = cache_root / key[:2]
    shard.mkdir(parents=True)
    half = shard / f".{key[:16]}.tmp-crashed"
    half.mkdir()
    (half / build_cache.LIBRARY).write_bytes(b"\x7fELF cut")
    assert build_cache.lookup(key, TARGET, SPEC) is None and build_cache.entries() == []
    meta = {"source": built.source, "knobs": built.knobs, "audit": built.audit, "trace": None,
            "data_alignment": built.data_alignment}
    assert build_cache.store(key, doc, built.library, built.lowered, meta) == shard / key
    assert build_cache.store(key, doc, built.library, built.lowered, meta) is None  # there already
    hit = build_kernel(SPEC, cache=True)
    assert hit.cache_entry == str(shard / key) and validate_built(hit).passed


def test_two_processes_building_one_key_are_both_right(cache_root):
    code = textwrap.dedent(f"""
        from tvm_attention.artifact import validate_built
        from tvm_attention.build import build_kernel
        from tvm_attention.spec import AttentionSpec
        b = build_kernel(AttentionSpec.from_dict({SPEC.to_dict()!r}), cache=True)
        v = validate_built(b)
        print("PASS" if v.passed else "FAIL", b.cache_entry)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=str(ROOT)) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.startswith("PASS"), err[-2000:]
    (entry,) = _entries(cache_root)
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no writer's leftovers
    hit = build_kernel(SPEC, cache=True)
    assert hit.cache_entry == str(entry) and validate_built(hit).passed


def test_eviction_removes_the_least_recently_used(seed, cache_root):
    a = _seeded(seed, cache_root)
    b = a.parent / ("f" * 64)  # a second entry (any name: eviction reads no key)
    shutil.copytree(a, b)
    old = time.time() - 1000
    os.utime(a / build_cache.ENTRY, (old, old))
    os.utime(b / build_cache.ENTRY, (old + 10, old + 10))  # a: used longest ago ...
    assert build_kernel(SPEC, cache=True).cache_entry == str(a)  # ... until this hit
    assert [e for _, _, e in build_cache.entries()] == [b, a]
    sizes = [size for _, size, _ in build_cache.entries()]
    assert build_cache.evict(limit=max(sizes)) == 1 and _entries(cache_root) == [a]
    assert build_cache.evict(limit=0) == 1 and _entries(cache_root) == []


def test_only_cpu_targets_this_host_runs_are_cached(cache_root, monkeypatch):
    from tvm_attention.hostcpu import HOST_CPU_ENV

    assert build_cache.cacheable(TARGET)
    assert not build_cache.cacheable(resolve_target("cuda", arch="sm_80"))
    monkeypatch.setenv(HOST_CPU_ENV, "x86-64-v3")  # an AVX2 host: a znver4 build is cross-compiled, never loaded
    assert not build_cache.cacheable(resolve_target({"kind": "llvm", "mcpu": "znver4"}))
    assert build_cache.cacheable(resolve_target("llvm"))


def _plant(entry: Path, **files: bytes) -> None:
    """Write ``files`` into ``entry`` with entry.json's digests updated: an entry written by
    other code (or by someone who can write the folder), intact to every digest."""
    info = json.loads((entry / build_cache.ENTRY).read_text())
    for name, data in files.items():
        (entry / name).write_bytes(data)
        info["sha256"][name] = build_cache._sha256(entry / name)
    (entry / build_cache.ENTRY).write_text(json.dumps(info))


def test_another_specs_entry_is_not_a_hit(seed, cache_root):
    """An entry holding another spec's build under this spec's key, every digest consistent, is
    refused (its library's attention_spec_hash() is not this spec's) and the spec rebuilt."""
    entry = _seeded(seed, cache_root)
    other = dataclasses.replace(SPEC, scale=0.05)
    key = _key(other)
    foreign = cache_root / key[:2] / key
    shutil.copytree(entry, foreign)
    info = json.loads((foreign / build_cache.ENTRY).read_text())
    (foreign / build_cache.ENTRY).write_text(json.dumps(dict(info, key=key)))
    assert build_cache.lookup(key, TARGET, other) is None and not foreign.exists()
    shutil.copytree(entry, foreign)
    (foreign / build_cache.ENTRY).write_text(json.dumps(dict(info, key=key)))
    built = build_kernel(other, cache=True)
    assert built.cache_entry is None and validate_built(built).passed
    assert build_kernel(other, cache=True).cache_entry == str(foreign)  # stored again: its own


def test_an_entry_holds_no_pickle_and_is_private(seed, cache_root, monkeypatch):
    """meta.json is JSON: a pickle planted as the entry's meta (digests updated) is never
    unpickled (no marker), the entry is a miss; the cache's folders are 0700 and its files 0600
    whatever the umask."""
    import pickle

    class Plant:
        def __reduce__(self):
            return (Path.touch, (cache_root.parent / "marker",))

    old = os.umask(0o002)  # group-writable by default: the cache must not follow
    try:
        built = build_kernel(dataclasses.replace(SPEC, seq_kv=81), cache=True)
        entry = Path(build_cache.entries()[0][2])
        for folder in (cache_root, entry.parent, entry):
            assert folder.stat().st_mode & 0o777 == 0o700, folder
        assert {p.stat().st_mode & 0o777 for p in entry.iterdir()} == {0o600}
        meta = json.loads((entry / build_cache.META).read_text())
        assert meta["knobs"]["values"] == built.knobs.to_dict() and meta["audit"]["verdict"] == "fused"
    finally:
        os.umask(old)
    entry = _seeded(seed, cache_root)
    _plant(entry, **{build_cache.META: pickle.dumps(Plant()), "meta.pkl": pickle.dumps(Plant())})
    assert build_cache.lookup(entry.name, TARGET, SPEC) is None
    assert not (cache_root.parent / "marker").exists()


def test_a_cache_others_may_write_is_not_used(seed, cache_root, tmp_path):
    """A cache folder writable by the group is refused with a warning naming it (the build is
    made and not stored); an entry whose file others may write is not trusted."""
    cache_root.mkdir(mode=0o700)
    entry = _seeded(seed, cache_root)
    os.chmod(entry / build_cache.LIBRARY, 0o664)
    assert build_cache.lookup(entry.name, TARGET, SPEC) is None and not entry.exists()
    entry = _seeded(seed, cache_root)
    os.chmod(cache_root, 0o775)
    build_cache._REFUSED.clear()
    with pytest.warns(RuntimeWarning, match=f"build cache not used: {cache_root}: the cache folder is writable by "
                                            "other users"):
        built = build_kernel(SPEC, cache=True)
    assert built.cache_entry is None and validate_built(built).passed


def test_a_hit_that_fails_validation_is_evicted_and_rebuilt(seed, cache_root):
    """A library that claims this spec but computes another (built for another scale, linked
    with this spec's hash) stored under the key: build_best validates the hit, removes it,
    builds again and stores the right one, instead of failing every run."""
    from tvm_attention.build import _schedule_module, build_from_module
    from tvm_attention.pipeline import build_best

    family = get_schedule("fused", TARGET)
    knobs = seed[0].knobs
    other = dataclasses.replace(SPEC, scale=0.05)
    liar = build_from_module(SPEC, "fused", _schedule_module(family, other, knobs, TARGET), TARGET, source="hand",
                             knobs=knobs)
    key, doc = build_cache.hand_key(SPEC, "fused", TARGET, knobs)
    build_cache.store(key, doc, liar.library, liar.lowered,
                      {"source": "hand", "knobs": knobs, "audit": liar.audit, "trace": None,
                       "data_alignment": liar.data_alignment})
    said = []
    built, validation = build_best(SPEC, use_log=False, cache=True, say=said.append)
    assert validation.passed and built.cache_entry is None
    assert any("failed validation" in m and "removed, building it again" in m for m in said), said
    again, v2 = build_best(SPEC, use_log=False, cache=True)
    assert again.cache_entry is not None and v2.passed
