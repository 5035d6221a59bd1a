"""peers/servers.py's ServerProcess: pausing a server stops its whole process group (the
leader and the processes it started), resuming continues them, and a server stopped while
paused still ends on SIGTERM within its grace period rather than waiting for SIGKILL.

The "server" is a real process group: a Python leader that forks a child, both asleep in
``signal.pause()``; states are read from /proc, polled until they change or a deadline
passes (signals are delivered asynchronously)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from bench_modules import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
from peers import servers  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc")

FORKING_SLEEPER = "import os, signal\nos.fork()\nwhile True:\n    signal.pause()\n"


def _wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)  # polling /proc for a signal's effect; nothing to wait on instead


def _states(srv: servers.ServerProcess) -> set[str]:
    return {p.status() for p in srv._tree()}


@pytest.fixture
def server(tmp_path: Path):
    srv = servers.ServerProcess(
        [sys.executable, "-c", FORKING_SLEEPER], {}, servers.free_port(), tmp_path / "log.txt"
    )
    try:
        _wait_for(lambda: len(srv._tree()) == 2, "the leader's child")
        yield srv
    finally:
        srv.stop(grace_s=10.0)


def test_pause_stops_the_whole_group_and_resume_continues_it(
    server: servers.ServerProcess,
) -> None:
    server.pause()
    assert server.paused
    _wait_for(lambda: _states(server) == {psutil.STATUS_STOPPED}, "both processes stopped")
    server.pause()  # idempotent
    server.resume()
    assert not server.paused
    _wait_for(lambda: psutil.STATUS_STOPPED not in _states(server), "both processes continued")
    assert server.cpu_seconds() >= 0.0


def test_stop_while_paused_ends_on_sigterm(server: servers.ServerProcess) -> None:
    server.pause()
    _wait_for(lambda: _states(server) == {psutil.STATUS_STOPPED}, "both processes stopped")
    t0 = time.monotonic()
    server.stop(grace_s=10.0)
    assert server.proc.returncode == -signal.SIGTERM
    assert time.monotonic() - t0 < 10.0
    assert not server.paused
