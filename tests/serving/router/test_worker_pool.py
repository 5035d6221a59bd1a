"""WorkerPool's settlement of a worker whose process exited: its goodbye, read after the exit
was seen, still names the cause; without one it is declared dead after the grace period. And
which workers a request finding none live waits for."""

from __future__ import annotations

import subprocess
import sys
import time

import radixserve.serving.wire.protocol as p
from radixserve.serving.router.dispatch import Dispatcher
from radixserve.serving.router.worker_pool import EXIT_GRACE_S, WorkerHandle, WorkerPool


class _Backend:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(frames)


def _pool() -> tuple[WorkerPool, list[tuple[int, str]]]:
    dead: list[tuple[int, str]] = []
    pool = WorkerPool(
        _Backend(),  # type: ignore[arg-type]
        Dispatcher(),
        on_dead=lambda w, reason: dead.append((w.worker_id, reason)),
        on_joined=lambda w: None,
    )
    for wid in (0, 1):
        pool.register(b"w%d" % wid, p.WorkerHello(wid, 1000 + wid, "m", 64, 32, [0]))
    return pool, dead


def _worker(pool: WorkerPool, wid: int) -> WorkerHandle:
    return pool.workers[wid]


def test_an_exited_worker_is_not_routable_but_waits_for_its_goodbye() -> None:
    pool, dead = _pool()
    pool.process_exited(1, 1001, "process exited with code 0")
    pool.settle_gone()  # the goodbye may still be on its way: not settled yet
    assert dead == [] and _worker(pool, 1).alive
    assert [w.worker_id for w in pool.routable] == [0]
    pool.mark_dead(_worker(pool, 1), "worker said goodbye (stopped by a signal)")  # it arrives
    pool.settle_gone(time.monotonic() + 2 * EXIT_GRACE_S)
    assert dead == [(1, "worker said goodbye (stopped by a signal)")]


def test_an_exited_worker_without_goodbye_is_declared_dead_after_the_grace() -> None:
    pool, dead = _pool()
    pool.process_exited(0, 1000, "process killed by SIGKILL")
    exited_at = time.monotonic()
    pool.settle_gone(exited_at)
    assert dead == []
    pool.settle_gone(exited_at + EXIT_GRACE_S + 0.01)
    assert dead == [(0, "process killed by SIGKILL")]
    assert [w.worker_id for w in pool.live] == [1]


def test_an_unreachable_worker_is_declared_dead_at_once() -> None:
    pool, dead = _pool()
    w = _worker(pool, 0)
    w.gone = "unreachable (host unreachable)"  # what a failed send records (settle_at 0)
    pool.settle_gone()
    assert dead == [(0, "unreachable (host unreachable)")]


def test_a_restarted_worker_settles_its_predecessor_and_keeps_its_id() -> None:
    pool, dead = _pool()
    pool.process_exited(0, 1000, "process killed by SIGKILL")
    assert not _worker(pool, 0).stats().alive  # reported gone while the grace runs
    new = pool.register(b"w0-new", p.WorkerHello(0, 2000, "m", 64, 32, [0]))
    assert dead == [(0, "process killed by SIGKILL")]
    assert new.worker_id == 0 and _worker(pool, 0).hello.pid == 2000


def test_a_worker_given_up_is_awaited_while_its_process_runs() -> None:
    """A local worker found unreachable, or declared dead for its silence (a long step, a
    pause past the heartbeats), may join again while its process runs: requests that find no
    routable worker wait for it (InFlight.dispatch) instead of failing; once the process is
    gone, not."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        pool, _ = _pool()
        pool.mark_dead(_worker(pool, 0), "no heartbeat for 31.0 s")
        assert not pool.awaited()  # a remote worker's process is not ours to see
        pool.expected[2] = proc
        assert pool.awaited()  # starting
        w = pool.register(b"w2", p.WorkerHello(2, proc.pid, "m", 64, 32, [0]))
        assert w.proc is proc and not pool.awaited()
        w.gone = "unreachable (host unreachable)"  # a failed send, not settled yet
        assert pool.awaited()  # not routable, its process running: it may reconnect
        pool.settle_gone()
        assert not w.alive and pool.awaited()
        w = pool.register(b"w2", p.WorkerHello(2, proc.pid, "m", 64, 32, [0]))  # joined again
        assert w.proc is proc and w.alive and not pool.awaited()
        pool.mark_dead(w, "no heartbeat for 31.0 s")
        assert pool.awaited()  # given up, its process still running
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)
        assert not pool.awaited()
        pool.restarting = {2}
        assert pool.awaited()  # its restart is scheduled
    finally:
        proc.kill()
        proc.wait()
