"""Measuring on a fleet: TVM's RPC tracker, RPC servers and MetaSchedule's RPCRunner.

``LocalFleet`` starts a tracker and N servers as child processes (loopback by default), records
their PIDs and stops them by PID (each in its own process group, so their popen workers go too).
It backs ``scripts/rpc_fleet.py`` and the tests; on a real fleet the same two TVM commands run
on the hosts (see docs/tuning.md).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..tvm_internals import TORCHLESS

#: Substrings of runner errors that mean "the device/connection failed", not "the kernel failed".
RPC_FAILURE_MARKERS = ("RPC", "Cannot request", "onnection", "ocket", "Timeout", "timed out",
                       "Broken pipe", "EOF", "reset by peer", "refused")


def is_rpc_failure(error_msg: str | None) -> bool:
    return bool(error_msg) and any(m in error_msg for m in RPC_FAILURE_MARKERS)


def parse_tracker(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--rpc-tracker must be HOST:PORT, got {text!r}")
    return host, int(port)


def tracker_status(host: str, port: int, key: str, timeout: float = 10.0) -> dict[str, int]:
    """{'servers': registered under key, 'free': idle, 'pending': queued requests}."""
    from tvm.s_tir.meta_schedule.runner import RPCConfig

    if not _port_open(host, port):  # TVM's connect would retry in a background thread for minutes
        raise ConnectionRefusedError(f"no RPC tracker listening at {host}:{port}")
    cfg = RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key, session_timeout_sec=int(timeout))
    summary = cfg.connect_tracker().summary()
    servers = sum(1 for s in summary["server_info"] if s["key"].split(":")[-1] == key)
    queue = summary["queue_info"].get(key, {"free": 0, "pending": 0})
    return {"servers": servers, "free": int(queue["free"]), "pending": int(queue["pending"])}


def free_port(start: int = 9190, end: int = 9990) -> int:
    for port in range(start, end):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in [{start}, {end})")


class LocalFleet:
    """A tracker plus ``servers`` RPC servers on this machine (127.0.0.1 unless told otherwise)."""

    def __init__(self, servers: int = 2, key: str = "cpu-local", host: str = "127.0.0.1",
                 tracker_port: int | None = None, threads_per_server: int = 1,
                 state_file: str | os.PathLike | None = None):
        self.n, self.key, self.host = servers, key, host
        self.tracker_port = tracker_port
        self.threads_per_server = threads_per_server
        self.state_file = Path(state_file) if state_file else None
        self.tracker: subprocess.Popen | None = None
        self.servers: list[subprocess.Popen] = []
        self.killed: set[int] = set()  # indices of servers killed on purpose (kill_server)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.tracker_port}"

    def _spawn(self, args: list[str], env: dict | None = None) -> subprocess.Popen:
        import tempfile

        log = tempfile.TemporaryFile()
        # TORCHLESS: the tracker and servers never meet a torch tensor; importing it cost each a second
        proc = subprocess.Popen([sys.executable, "-m", TORCHLESS, *args], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
        proc.log = log  # type: ignore[attr-defined]
        return proc

    def _check_alive(self, proc: subprocess.Popen, what: str) -> None:
        if proc.poll() is not None:
            proc.log.seek(0)  # type: ignore[attr-defined]
            tail = proc.log.read().decode(errors="replace").strip().splitlines()[-3:]  # type: ignore[attr-defined]
            raise RuntimeError(f"{what} exited with code {proc.returncode}: {' | '.join(tail)}")

    def start(self, wait_s: float = 60.0) -> "LocalFleet":
        self.tracker_port = self.tracker_port or free_port()
        self.tracker = self._spawn(["tvm.exec.rpc_tracker", "--host", self.host, "--port", str(self.tracker_port),
                                    "--port-end", str(self.tracker_port + 1), "--silent"])
        for _ in range(self.n):
            self.add_server()
        self.wait_for(self.n, wait_s)
        self._save()
        return self

    def add_server(self) -> subprocess.Popen:
        env = dict(os.environ, TVM_NUM_THREADS=str(self.threads_per_server), TVM_BIND_THREADS="0")
        port = free_port(9090 + 20 * len(self.servers), 9990)
        proc = self._spawn(["tvm.exec.rpc_server", "--host", self.host, "--port", str(port),
                            "--port-end", str(port + 10), "--tracker", self.address, "--key", self.key,
                            "--silent"], env=env)
        self.servers.append(proc)
        return proc

    def wait_for(self, servers: int, wait_s: float) -> None:
        deadline = time.time() + wait_s
        while time.time() < deadline:
            self._check_alive(self.tracker, "the RPC tracker")
            for i, proc in enumerate(self.servers):
                if i not in self.killed:
                    self._check_alive(proc, "an RPC server")
            if _port_open(self.host, self.tracker_port):
                try:
                    if tracker_status(self.host, self.tracker_port, self.key, timeout=5)["servers"] >= servers:
                        return
                except Exception:  # noqa: BLE001 - polled until the deadline, which raises with the count
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"{servers} RPC server(s) did not register with {self.address} in {wait_s:.0f} s")

    def kill_server(self, index: int) -> None:
        """Kill one server (and its workers) with SIGKILL, as a crash would."""
        self.killed.add(index)
        _kill_group(self.servers[index].pid, signal.SIGKILL)
        self.servers[index].wait(timeout=30)

    def live(self) -> list[int]:
        """Indices of the servers still running."""
        return [i for i, p in enumerate(self.servers) if i not in self.killed and p.poll() is None]

    def pids(self) -> list[int]:
        return [p.pid for p in ([self.tracker] if self.tracker else []) + self.servers]

    def stop(self) -> None:
        for proc in self.servers + ([self.tracker] if self.tracker else []):
            if proc.poll() is None:
                _kill_group(proc.pid, signal.SIGTERM)
        for proc in self.servers + ([self.tracker] if self.tracker else []):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self.state_file and self.state_file.exists():
            self.state_file.unlink()

    def _save(self) -> None:
        if self.state_file:
            self.state_file.write_text(json.dumps(
                {"tracker": self.address, "key": self.key, "pids": self.pids()}, indent=2) + "\n")

    def __enter__(self) -> "LocalFleet":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the process was started in its own session: its group id is its pid
    except ProcessLookupError:
        pass


def stop_from_state(state_file: str | os.PathLike) -> list[int]:
    """Stop a fleet started by ``scripts/rpc_fleet.py start`` (by the PIDs it recorded)."""
    state = json.loads(Path(state_file).read_text())
    for pid in state["pids"]:
        _kill_group(pid, signal.SIGTERM)
    deadline = time.time() + 10
    alive = list(state["pids"])
    while alive and time.time() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.2)
    for pid in alive:
        _kill_group(pid, signal.SIGKILL)
    Path(state_file).unlink()
    return state["pids"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
