"""Tuning by files (tvm_attention/tune/dirrunner.py): export a tune's candidates as a payload,
time them with the device script (loader only, no ``tvm``), import the timings into the tuning
log, and ``build`` picks the best; a crashing or broken candidate, foreign or corrupt timings, a
CUDA payload built offline (a KV-cache decode step, whose tuned build keeps its split-KV), and the
same transport as a MetaSchedule runner."""
import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tvm_ffi
from test_cuda import assert_split_kv
from tvm.s_tir import meta_schedule as ms

from tvm_attention.schedules import cuda_fused, cuda_mma
from tvm_attention import cli
from tvm_attention.cuda_tools import find_nvcc
from tvm_attention.logs import FAILED_RUN_SECS, RECORD_FILE, parse_logs
from tvm_attention.pipeline import LogNotUsable, build_best
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target
from tvm_attention.task_mods import normalize, tuning_spec, workload_matches
from tvm_attention.tune.dirrunner import CANDIDATES, TIMINGS, DirRunner, PayloadError, export_payload, \
    import_timings, read_payload, read_timings

REPO = Path(__file__).resolve().parents[1]
SPEC = AttentionSpec(batch=1, heads=2, seq_q=64, head_dim=32, causal=True)
FLAGS = ["--batch", "1", "--heads", "2", "--seq-q", "64", "--head-dim", "32", "--causal"]


def device_run(payload: Path, *args: str, blocker: Path) -> subprocess.CompletedProcess:
    """The payload's device script as a bare machine runs it: its own package, ``tvm``
    unimportable (``blocker`` holds a ``tvm`` that raises on import), and ``torch`` too, which a
    CPU payload never uses (tvm-ffi imported it in each timing process: 1-1.5 s of CPU each)."""
    env = dict(os.environ, PYTHONPATH=str(blocker))
    return subprocess.run([sys.executable, str(payload / "time_candidates.py"), "--rounds", "2", "--min-ms", "5", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=payload)


@pytest.fixture(scope="module")
def blocker(tmp_path_factory):
    d = tmp_path_factory.mktemp("blocker")
    (d / "tvm").mkdir()
    (d / "tvm" / "__init__.py").write_text("raise ImportError('tvm imported on the device')\n")
    # what tvm-ffi expects where torch is absent (its import is optional there)
    (d / "torch").mkdir()
    (d / "torch" / "__init__.py").write_text("raise ImportError('torch is not installed on this device')\n")
    return d


@pytest.fixture(scope="module", autouse=True)
def tasks_once():
    """Each spec's tasks made once for the file (the same function of spec, target and schedule),
    for the tunes, exports and imports here, which made them again each time (SPEC's ~0.3 s of CPU,
    five times). That an import regenerates the tasks the export hashed is what the import checks
    in another process; here one process does both, and test_tuned_cuda_decode_step_keeps_its_split
    regenerates the CUDA task's workload itself and compares its hash with the payload's.

    The CUDA decode step's tune gets the first two of its 36 tasks (tile candidates, the preset's
    first): a CUDA task's space is one point (its knobs), so the 2-trial export draws one candidate
    from each of the first two tasks (untried tasks first, in order), and the others were only
    made (~0.07 s of CPU each, ~2.5 s a time) and given a search context. Same candidates, payload
    and records."""
    import contextlib

    from conftest import make_tasks_once

    from tvm_attention.schedules import cuda_mma
    from tvm_attention.tune import dirrunner, driver

    tiles = cuda_mma.tile_candidates

    @contextlib.contextmanager
    def first_two_tiles(target):
        with pytest.MonkeyPatch.context() as mp:
            if target.kind.name == "cuda":
                mp.setattr(cuda_mma, "tile_candidates", lambda s, t: tiles(s, t)[:2])
            yield

    once = make_tasks_once(around=first_two_tiles)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(driver, "make_tasks", once)
        mp.setattr(dirrunner, "make_tasks", once)
        yield


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A payload of two CPU candidates of SPEC, and the log it was drawn from (empty)."""
    root = tmp_path_factory.mktemp("dir")
    msgs = []
    info = export_payload(SPEC, "llvm", root / "payload", trials=2, per_round=2, search="random",
                          work_dir=root / "log", progress=msgs.append)
    assert len(info["candidates"]) == 2 and "payload is full" not in "".join(msgs)
    return root / "payload", root / "log"


def test_export_time_import_and_build_picks_the_best(exported, blocker, tmp_path):
    payload, _ = exported
    log = tmp_path / "log"
    info = read_payload(payload)
    ids = sorted(info["candidates"])
    for cid in ids:  # the artifact's device files; TVM's runtime once, beside them
        assert sorted(p.name for p in (payload / "kernels" / cid).iterdir()) == ["attention.so", "manifest.json"]
    assert [p.name for p in (payload / "runtime").iterdir()] == ["libtvm_runtime.so"]
    assert "time_candidates.py" in (payload / "run.sh").read_text()
    # the device script imports neither tvm nor the build path (statically; and it runs with tvm blocked)
    tree = ast.parse((payload / "time_candidates.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not [n for n in names if n.split(".")[0] == "tvm" or n.startswith(("tvm_attention.tune", "tvm_attention.build"))]
    r = device_run(payload, "--out", str(tmp_path / "out"), blocker=blocker)
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.copy(tmp_path / "out" / TIMINGS, payload / TIMINGS)  # brought back
    timings = read_timings(payload, info)
    assert sorted(timings) == ids and all(isinstance(v, list) and len(v) == 2 for v in timings.values()), timings

    argv = ["tune", *FLAGS, "--work-dir", str(log), "--import-timings", str(payload)]
    assert cli.main(argv) == 0
    records = parse_logs(log).records
    got = sorted(sum(float(x) for x in rec.run_secs) / 2 for _, rec in records)
    assert got == pytest.approx(sorted(sum(v) / 2 for v in timings.values()), rel=1e-6)  # MetaSchedule keeps float32
    assert cli.main(argv) == 0  # a second import adds nothing
    assert len((log / RECORD_FILE).read_text().splitlines()) == 2

    built, validation = build_best(SPEC, log_dir=log)
    best = min(ids, key=lambda i: sum(timings[i]))
    assert built.source == "tuned" and validation.passed
    assert built.knobs.to_dict() == info["candidates"][best]["knobs"]
    # the next export leaves out what the log measured
    more = export_payload(SPEC, "llvm", tmp_path / "next", trials=3, per_round=2, search="random", work_dir=log,
                          progress=lambda m: None)
    done = {json.dumps(info["candidates"][i]["record"][0]) for i in ids}
    assert len(more["candidates"]) == 1 and json.dumps(more["candidates"]["c0000"]["record"][0]) not in done


def test_a_crashing_and_a_broken_candidate_are_failed_records(exported, blocker, tmp_path):
    payload = tmp_path / "p"
    shutil.copytree(exported[0], payload)
    lib = payload / "kernels" / "c0001" / "attention.so"
    data = lib.read_bytes()
    lib.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # another library than its manifest's
    r = device_run(payload, "--crash-on", "c0000", blocker=blocker)  # c0000 kills its process
    assert r.returncode == 0, r.stdout + r.stderr
    timings = json.loads((payload / TIMINGS).read_text())["timings"]
    assert "killed its timing process" in timings["c0000"]
    assert "SHA-256" in timings["c0001"]  # timed after the crash, in a fresh process
    res = import_timings(SPEC, "llvm", payload, work_dir=tmp_path / "log", progress=lambda m: None)
    assert (res.new, res.failed) == (2, 2)
    assert all(rec.run_secs[0] >= FAILED_RUN_SECS for _, rec in parse_logs(tmp_path / "log").records)
    with pytest.raises(LogNotUsable):
        build_best(SPEC, log_dir=tmp_path / "log")


def test_foreign_or_corrupt_timings_are_refused_by_name(exported, tmp_path, capsys):
    payload = tmp_path / "p"
    payload.mkdir()
    shutil.copy(exported[0] / CANDIDATES, payload / CANDIDATES)
    info = read_payload(payload)
    good = {"payload_id": info["payload_id"], "target_key": info["target_key"], "device": {"kind": "cpu"},
            "timings": {"c0000": [1e-3]}}
    with pytest.raises(PayloadError, match="timings.json: missing"):
        read_timings(payload, info)
    for doc, problem in (({**good, "payload_id": "0123"}, "different exports"),
                         ({**good, "target_key": "llvm-other-2c"}, "measured for target"),
                         ({**good, "timings": {"c9999": [1e-3]}}, "c9999 are not in the payload"),
                         ({**good, "timings": {"c0000": [-1]}}, "c0000: expected a list of positive seconds")):
        (payload / TIMINGS).write_text(json.dumps(doc))
        with pytest.raises(PayloadError, match=problem):
            read_timings(payload, info)
    with pytest.raises(PayloadError, match="holds timings that were not imported"):  # never lost by a new export
        export_payload(SPEC, "llvm", payload, trials=2, work_dir=tmp_path / "log")
    (payload / TIMINGS).write_text('{"payload_id": ')
    assert cli.main(["tune", *FLAGS, "--work-dir", str(tmp_path / "log"), "--import-timings", str(payload)]) == 2
    assert "timings.json: not valid JSON" in capsys.readouterr().err
    # the payload of another spec: named, nothing imported
    other = ["--batch", "1", "--heads", "2", "--seq-q", "64", "--head-dim", "32"]
    assert cli.main(["tune", *other, "--work-dir", str(tmp_path / "log"), "--import-timings", str(payload)]) == 2
    assert "a payload of spec b1_h2_kv2_q64_k64_d32_float32_causal" in capsys.readouterr().err
    assert not (tmp_path / "log" / RECORD_FILE).exists()


def test_dir_runner_is_the_same_transport(exported, blocker, tmp_path):
    """MetaSchedule's runner interface: run() writes the artifacts as a payload, its futures
    read the device's timings back."""
    runner = DirRunner(tmp_path / "p", "llvm", poll_s=0.1, timeout_s=60)
    inputs = [ms.runner.RunnerInput(str(exported[0] / "kernels" / c), "cpu", []) for c in ("c0000", "c0001")]
    futures = runner.run(inputs)
    assert not futures[0].done()
    r = device_run(tmp_path / "p", blocker=blocker)
    assert r.returncode == 0, r.stdout + r.stderr
    results = [f.result() for f in futures]
    assert all(x.error_msg is None and len(x.run_secs) == 2 for x in results)


needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc compiles the CUDA candidates offline")
#: a KV-cache decode step on CUDA (tensor cores; symbolic, as every kvcache spec): `tune` takes it at its
#: static bhsd representative (batch 1, seq_q 1, 256 keys)
CUDA_DECODE = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_q=1, seq_kv=256, head_dim=128, dtype="float16",
                            causal=True, layout="kvcache")
CUDA_DECODE_FLAGS = ["--batch", "1", "--heads", "4", "--kv-heads", "2", "--seq-q", "1", "--seq-kv", "256",
                     "--head-dim", "128", "--dtype", "float16", "--causal", "--layout", "kvcache",
                     "--target", "cuda", "--arch", "sm_90"]


@pytest.fixture(scope="module")
def cuda_payload(tmp_path_factory):
    """Two candidates of a tune of ``CUDA_DECODE``, exported offline (built, not measured)."""
    root = tmp_path_factory.mktemp("cuda")
    assert cli.main(["tune", *CUDA_DECODE_FLAGS, "--trials", "2", "--per-round", "2", "--search", "random",
                     "--work-dir", str(root / "log"), "--runner", f"dir:{root / 'p'}"]) == 0
    return root / "p"


@pytest.fixture(scope="module")
def cuda_imported(cuda_payload, tmp_path_factory):
    """``cuda_payload``'s timings (the last candidate the fastest) imported into a log, and what
    ``build`` (``build_best``) makes of it: (payload info, fastest id, built, validation). One
    CUDA build (nvcc, seconds) for the two tests below."""
    payload = tmp_path_factory.mktemp("cuda_import") / "p"
    shutil.copytree(cuda_payload, payload)
    info = read_payload(payload)
    ids = sorted(info["candidates"])
    fast = ids[-1]  # not the first: build must take the fastest, not the first record
    (payload / TIMINGS).write_text(json.dumps({
        "payload_id": info["payload_id"], "target_key": "cuda-sm_90",
        "device": {"kind": "cuda", "name": "H200", "arch": "sm_90"},
        "timings": {i: [1e-5 if i == fast else 2e-5] * 2 for i in ids}}))
    log = payload.parent / "log"
    assert cli.main(["tune", *CUDA_DECODE_FLAGS, "--work-dir", str(log), "--import-timings", str(payload)]) == 0
    built, validation = build_best(CUDA_DECODE, target=resolve_target("cuda", arch="sm_90"), log_dir=log)
    return info, fast, built, validation


@needs_nvcc
def test_cuda_timings_imported_are_what_build_uses(cuda_imported):
    """The last step of tuning by files on CUDA: timings brought back from the device are
    imported into the log, and ``build`` takes the fastest record, keeping the KV-cache build's
    split. ``records_for`` matched records by the schedule's name (``fused``) while CUDA
    workloads are ``fused_mma``/``fused_cuda``: every CUDA record was skipped (issue 41)."""
    info, fast, built, validation = cuda_imported
    assert built.source == "tuned" and not validation.ran  # no GPU here: recorded as not run
    assert dataclasses.replace(built.knobs, split_tasks=0).to_dict() == info["candidates"][fast]["knobs"]
    assert_split_kv(built, CUDA_DECODE)


@needs_nvcc
def test_cuda_candidates_build_offline(cuda_payload):
    payload = cuda_payload
    info = read_payload(payload)
    assert len(info["candidates"]) == 2 and info["target_key"] == "cuda-sm_90"
    for c in info["candidates"].values():
        d = payload / c["dir"]
        assert (d / "kernel.fatbin").read_bytes()[:4] == b"\x50\xed\x55\xba"  # fatbin magic: no JIT there
        assert json.loads((d / "manifest.json").read_text())["kernel_binary"]["arch"] == "sm_90"
    assert sorted(p.name for p in (payload / "runtime").iterdir()) == ["libtvm_runtime.so", "libtvm_runtime_cuda.so"]
    # timings from another GPU are refused
    (payload / TIMINGS).write_text(json.dumps({"payload_id": info["payload_id"], "target_key": "cuda-sm_90",
                                               "device": {"kind": "cuda", "name": "A100", "arch": "sm_80"},
                                               "timings": {"c0000": [1e-4]}}))
    with pytest.raises(PayloadError, match=r"A100 \(sm_80\), but the kernels are built for sm_90"):
        read_timings(payload, info)


@needs_nvcc
def test_tuned_cuda_decode_step_keeps_its_split(cuda_payload, cuda_imported):
    """A CUDA KV-cache spec is tuned at its bhsd representative, a kernel without split-KV (bhsd
    refuses it): the kvcache kernel built from that tune's record, the way ``build`` builds a
    tuned record (``build_from_record``, which ``build_best`` calls: the build ``cuda_imported``
    made), still splits a small batch's keys as its preset does (the knobs, the merge kernel,
    the batch-sized workspace). The record's workload is the family's ``workload(spec, knobs)``
    of the knobs exported with it, which log matching regenerates."""
    target = resolve_target("cuda", arch="sm_90")
    rep = tuning_spec(CUDA_DECODE, target)
    info = read_payload(cuda_payload)
    assert info["spec"] == rep.to_dict() and rep.layout == "bhsd"
    _, fast, built, _ = cuda_imported
    entry = info["candidates"][fast]
    knobs = cuda_mma.MMAKnobs.from_dict(entry["knobs"])
    assert knobs.split_tasks == 0  # bhsd: no split-KV
    workload = ms.database.Workload(normalize(cuda_fused.workload(rep, knobs)))
    assert str(tvm_ffi.structural_hash(workload.mod)) == entry["workload_hash"]  # the task's module
    assert workload_matches(rep, workload.mod)
    record = ms.database.TuningRecord.from_json(entry["record"], workload)
    assert built.trace == str(record.trace)  # built from this very record

    # the record's tile, the preset's split (> 0); the merge kernel and the batch-sized workspace
    assert built.source == "tuned" and built.knobs == dataclasses.replace(knobs, split_tasks=built.knobs.split_tasks)
    assert_split_kv(built, CUDA_DECODE)
