"""Distributed tuning on TVM's RPC tracker (loopback only): two servers, a killed server, a
fleet that dies, no server at all. Every process a test starts is stopped by PID.

Cost: every process here imports TVM (3-5 s of CPU each: the tracker, each server and its popen
worker, each tune's runner workers), so the file starts one fleet and runs two tunes. The tunes
use ``search="random"``: what is tested is the measuring transport; the evolutionary search
(a population of 64 replayed per task, ~9 s of CPU per tune) is tested in test_tune/test_search."""
import os
import threading
import time

import pytest

from tvm_attention.pipeline import build_best
from tvm_attention.spec import AttentionSpec
from tvm_attention.tune.driver import NoDevicesLeft, tune
from tvm_attention.logs import RECORD_FILE, parse_logs
from tvm_attention.tune.rpc import LocalFleet, free_port, tracker_status

pytest.importorskip("tornado", reason="TVM's RPC tracker needs tornado")

#: small: its size does not matter to the transport (the builds and measurements stay cheap)
SPEC = AttentionSpec(batch=1, heads=2, seq_q=64, head_dim=32)


def alive(pid):
    return os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"


@pytest.fixture(scope="module")
def module_fleet():
    """One tracker for the file: a fleet takes 15-20 s to start here (each process imports TVM)."""
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
def fleet(module_fleet):
    """The module's fleet with exactly two live servers registered: servers a test killed are
    replaced (a server starts in a few seconds)."""
    f = module_fleet
    for _ in range(2 - len(f.live())):
        f.add_server()
    return _registered(f, 2)


@pytest.fixture
def live_fleet(module_fleet):
    """The module's fleet as the tests before left it: its live servers (one at least; none is
    started when one is left: each costs two TVM imports), all registered."""
    f = module_fleet
    if not f.live():
        f.add_server()
    return _registered(f, len(f.live()))


def records(work):
    p = work / RECORD_FILE
    return len(p.read_bytes().splitlines()) if p.exists() else 0


def test_rpc_tune_on_two_servers_then_a_server_killed_finishes_on_the_other_and_builds(fleet, tmp_path):
    """One tune, two stories (each tune starts runner workers that import TVM): its first round
    measures on two servers, every candidate measured; then one server is killed (SIGKILL) and
    the tune meets its budget on the other, losing no record; ``build`` takes the log's best."""
    killed = threading.Event()
    msgs = []

    def progress(m):
        # the kill at the first round's report: the second round then runs on one server, whatever
        # the machine's speed (a kill 1 s after the first records, as before, came after a fast
        # second round had finished: its report still saw two servers)
        msgs.append(m)
        if not killed.is_set() and "trials]" in m:
            fleet.kill_server(fleet.live()[0])
            killed.set()

    # 4 trials: the kill comes after the first round (2 records), and the second is left to one
    # server (a third round on it, as with 6 trials, measured nothing new: one round of builds and
    # runner calls fewer)
    r = tune(SPEC, trials=4, per_round=2, work_dir=tmp_path, rpc_tracker=fleet.address, rpc_key="test-cpu",
             rpc_timeout_s=30, progress=progress, search="random")
    assert killed.is_set()
    assert r.trials_new == 4 and r.trials_total == 4 and records(tmp_path) == 4  # nothing lost, budget met
    # the first round, before the kill: on two servers (the progress shows the fleet), all measured
    assert any("[rpc test-cpu: 2 server(s)" in m for m in msgs)
    parsed = parse_logs(tmp_path)
    assert all(min(rec.run_secs) < 1.0 for _, rec in parsed.records[:2])
    failed = [rec for _, rec in parsed.records if min(rec.run_secs) >= 1e9]
    assert len(failed) <= 2  # at most the candidates the dead server held
    assert any("1 server(s)" in m for m in msgs)  # the rounds after the kill: one server
    built, validation = build_best(SPEC, log_dir=tmp_path)
    assert built.source == "tuned" and validation.passed and built.audit.fused


def test_whole_fleet_gone_stops_with_clear_error_and_intact_log(live_fleet, tmp_path):
    """Every server the fleet has left (after the test above: one; alone: both) dies mid-tune."""
    fleet = live_fleet

    def killer():
        while records(tmp_path) < 2:
            time.sleep(0.05)
        for i in fleet.live():
            fleet.kill_server(i)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    start = time.time()
    with pytest.raises(NoDevicesLeft, match="no RPC server left"):
        tune(SPEC, trials=40, per_round=2, work_dir=tmp_path, rpc_tracker=fleet.address,
             rpc_key="test-cpu", rpc_timeout_s=10, progress=lambda m: None, search="random")
    assert time.time() - start < 240
    assert not fleet.live()
    kept = records(tmp_path)
    assert kept >= 2
    parsed = parse_logs(tmp_path)  # the log is intact and parses
    assert len(parsed.records) == kept


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
