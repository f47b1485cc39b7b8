"""Distributed tuning on TVM's RPC tracker (loopback only): two servers, a killed server, a
fleet that dies, no server at all. Every process a test starts is stopped by PID.

Cost: every process here imports TVM (1.5-3 s of CPU each: the tracker, each server and its
popen worker, each tune's builder and runner workers), so the file starts one fleet (torch kept
out of it) and runs one tune, which meets a killed server and then the fleet's end. The tune uses
``search="random"``: what is tested is the measuring transport; the evolutionary search (a
population of 64 replayed per task, ~9 s of CPU per tune) is tested in test_tune/test_search."""
import contextlib
import os
import time

import pytest

from tvm_attention.pipeline import build_best
from tvm_attention.spec import AttentionSpec
from tvm_attention.threads import set_num_threads
from tvm_attention.tune.driver import NoDevicesLeft, tune
from tvm_attention.logs import RECORD_FILE, parse_logs
from tvm_attention.tune.rpc import LocalFleet, free_port, tracker_status

pytest.importorskip("tornado", reason="TVM's RPC tracker needs tornado")

#: small: its size does not matter to the transport (the builds and measurements stay cheap)
SPEC = AttentionSpec(batch=1, heads=2, seq_q=64, head_dim=32)


def alive(pid):
    return os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"


@pytest.fixture(scope="module", autouse=True)
def _threads_back():
    """The tune here runs on one thread (``threads=1``: its builder starts one worker, not two);
    the file after this one, in the same process, gets the session's setting back."""
    yield
    set_num_threads()


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory):
    """A folder whose ``torch`` package raises ImportError (what tvm-ffi expects where torch is
    absent), for the fleet's PYTHONPATH. Its processes run through tvm_attention._torchless, but
    the popen worker that TVM's RPC tracker and each server start imported torch (1-1.5 s of CPU
    each, three per fleet): tvm.rpc.tracker and tvm.rpc.server bind ``PopenWorker`` by name at
    import, where _torchless's swap of ``tvm.support.popen_pool.PopenWorker`` does not reach.
    Torch is no part of what is tested here."""
    d = tmp_path_factory.mktemp("no_torch")
    (d / "torch").mkdir()
    (d / "torch" / "__init__.py").write_text("raise ImportError('torch is blocked in the RPC fleet')\n")
    return d


@contextlib.contextmanager
def torch_blocked(no_torch):
    """Fleet processes started meanwhile (and their workers) cannot import torch."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(no_torch), *filter(None, [os.environ.get("PYTHONPATH")])]))
        yield


@pytest.fixture(scope="module")
def module_fleet(no_torch):
    """One tracker for the file: a fleet takes 15-20 s to start here (each process imports TVM)."""
    with torch_blocked(no_torch):
        f = LocalFleet(servers=2, key="test-cpu").start()
    yield f
    pids = f.pids()
    f.stop()
    assert not any(alive(p) for p in pids), "a fleet process outlived the tests"


def _registered(f, n):
    """Wait until the tracker lists exactly ``n`` servers (it forgets a killed server when its
    socket closes)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        if tracker_status(f.host, f.tracker_port, f.key, timeout=5)["servers"] == n:
            return f
        time.sleep(0.2)
    raise AssertionError(f"the tracker did not get to {n} server(s)")


@pytest.fixture
def fleet(module_fleet, no_torch):
    """The module's fleet with exactly two live servers registered: servers a test killed are
    replaced (a server starts in a few seconds)."""
    f = module_fleet
    with torch_blocked(no_torch):
        for _ in range(2 - len(f.live())):
            f.add_server()
    return _registered(f, 2)


def records(work):
    p = work / RECORD_FILE
    return len(p.read_bytes().splitlines()) if p.exists() else 0


def test_rpc_tune_loses_a_server_then_the_whole_fleet_keeps_every_record_and_builds(fleet, tmp_path):
    """One tune, three stories (each tune on a fleet starts builder and runner workers that import
    TVM, and keeps none for the next: one tune here, where there were two): its first round
    measures on two servers, every candidate measured; then one server is killed (SIGKILL) and the
    tune goes on on the other, losing no record, until the log holds 4; then that last server dies
    too, mid-tune, and the tune stops with a clear error (NoDevicesLeft), the log intact with every
    record measured before; ``build`` takes the log's best."""
    msgs = []
    last = {}  # the records in the log when the last server was killed

    def progress(m):
        # the kills at the rounds' reports: the first round's report still sees two servers, the
        # rounds after it run on one whatever the machine's speed (a kill 1 s after the first
        # records came after a fast second round had finished: its report still saw two servers);
        # the last server dies once the log holds 4 records, short of the budget of 6
        msgs.append(m)
        if "trials]" not in m:
            return
        live = fleet.live()
        if len(live) == 2:
            fleet.kill_server(live[0])
        elif len(live) == 1 and records(tmp_path) >= 4:
            last["records"] = records(tmp_path)
            fleet.kill_server(live[0])

    start = time.time()
    with pytest.raises(NoDevicesLeft, match="no RPC server left") as e:
        tune(SPEC, trials=6, per_round=2, work_dir=tmp_path, rpc_tracker=fleet.address, rpc_key="test-cpu",
             rpc_timeout_s=30, progress=progress, search="random", threads=1)
    assert time.time() - start < 240
    assert not fleet.live() and last, msgs  # both servers killed, the second once 4 records were in
    # nothing lost: the records of the rounds on two servers and on one, none after the fleet was gone
    kept = records(tmp_path)
    assert 4 <= kept == last["records"] < 6 and f"{kept} record(s) are in {tmp_path}" in str(e.value)
    parsed = parse_logs(tmp_path)  # the log is intact and parses
    assert len(parsed.records) == kept
    # the first round, before the kill: on two servers (the progress shows the fleet), all measured
    assert any("[rpc test-cpu: 2 server(s)" in m for m in msgs)
    assert all(min(rec.run_secs) < 1.0 for _, rec in parsed.records[:2])
    failed = [rec for _, rec in parsed.records if min(rec.run_secs) >= 1e9]
    assert len(failed) <= 2  # at most the candidates the dead server held
    assert any("1 server(s)" in m for m in msgs)  # the rounds after the kill: one server
    built, validation = build_best(SPEC, log_dir=tmp_path)
    assert built.source == "tuned" and validation.passed and built.audit.fused


def test_no_server_is_a_clear_error_without_hanging(module_fleet, tmp_path):
    start = time.time()  # the tracker is up; no server has this key
    with pytest.raises(RuntimeError, match="no server registered under key 'nobody'"):
        tune(SPEC, trials=4, work_dir=tmp_path, rpc_tracker=module_fleet.address, rpc_key="nobody",
             progress=lambda m: None)
    assert time.time() - start < 30
    port = free_port(9500, 9600)
    with pytest.raises(RuntimeError, match="cannot reach the RPC tracker"):
        tune(SPEC, trials=4, work_dir=tmp_path, rpc_tracker=f"127.0.0.1:{port}", rpc_key="x",
             progress=lambda m: None)
    assert records(tmp_path) == 0
