"""Supervision of local worker processes: reaped at once, reported, restarted with back-off.

The router's loop owns the :class:`Supervisor`. Each local worker process gets a Linux
pidfd, which the router polls next to its sockets: the moment a worker exits, the poll
wakes, the process is reaped (no zombie is left until ``serve`` exits) and its exit code
is logged and handed to the worker pool, which declares the worker dead (its requests are
retried or failed, see :class:`~radixserve.serving.router.inflight.InFlight`). Where pidfds are
not available, every loop turn polls the processes instead (at most ``max_wait_s`` late).

With ``restart`` on (``--restart-workers``, the default for local workers) a worker that
exited is started again under the same worker id after a back-off that doubles with every
exit in a row (``backoff_s``, ``2 * backoff_s``, ... up to ``backoff_max_s``); a worker that
ran ``stable_s`` before exiting starts the count over. After ``max_failures`` exits in a row
the supervisor gives up on that id and says so. Nothing is restarted once the router stops.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

log = logging.getLogger("radixserve.serving.supervisor")

SpawnWorker = Callable[[int], "subprocess.Popen[bytes]"]


def describe_exit(code: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL (exit code -9)``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code})"
    return f"exit code {code}"


class WorkerExit(NamedTuple):
    """One local worker process that exited, as reported."""

    worker_id: int
    pid: int
    code: int
    ran_s: float


@dataclass(frozen=True)
class RestartPolicy:
    """Back-off of restarts: ``backoff_s * 2**(exits in a row - 1)``, at most ``backoff_max_s``."""

    restart: bool = True
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0  # a run this long resets the count of exits in a row
    max_failures: int = 10  # exits in a row after which the worker id is given up

    def delay(self, failures: int) -> float:
        """Seconds to wait before the restart that follows ``failures`` exits in a row (>= 1)."""
        return min(self.backoff_max_s, self.backoff_s * (2 ** max(0, failures - 1)))


@dataclass
class _Watched:
    worker_id: int
    proc: subprocess.Popen[bytes]
    started: float
    pidfd: int | None = None


@dataclass
class Supervisor:
    """Watches the local worker processes of one router (see the module doc).

    ``spawn(worker_id)`` starts a worker process (the launcher's command line for that id).
    ``procs`` lists every process started, restarts included, for the launcher's final reap.
    """

    spawn: SpawnWorker
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    exits: list[WorkerExit] = field(default_factory=list)
    restarts: int = 0
    _watched: dict[int, _Watched] = field(default_factory=dict)  # by pid
    _failures: dict[int, int] = field(default_factory=dict)  # worker id -> exits in a row
    _due: dict[int, float] = field(default_factory=dict)  # worker id -> when to restart it
    stopped: bool = False

    def watch(self, worker_id: int, proc: subprocess.Popen[bytes]) -> int | None:
        """Watch ``proc`` as worker ``worker_id``; returns its pidfd to poll (``None``: none)."""
        if proc not in self.procs:
            self.procs.append(proc)
        pidfd = None
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(proc.pid)
            except OSError:  # an old kernel, or the process is gone already (poll() sees it)
                pidfd = None
        self._watched[proc.pid] = _Watched(worker_id, proc, time.monotonic(), pidfd)
        return pidfd

    @property
    def pidfds(self) -> list[int]:
        return [w.pidfd for w in self._watched.values() if w.pidfd is not None]

    def should_reap(self, now: float, fd_fired: bool) -> bool:
        """Whether the router's turn must call :meth:`reap` (and start restarts): a watched
        pidfd fired, a restart is due, or some process has no pidfd (it is polled every turn)."""
        if fd_fired or any(w.pidfd is None for w in self._watched.values()):
            return True
        due = self.next_due()
        return due is not None and due <= now

    @property
    def pending(self) -> set[int]:
        """Worker ids whose restart is scheduled (requests may wait for them)."""
        return set(self._due)

    def reap(self) -> list[tuple[WorkerExit, int | None]]:
        """Reap every watched process that exited: (its exit, its pidfd to stop polling)."""
        out = []
        now = time.monotonic()
        for pid, w in list(self._watched.items()):
            code = w.proc.poll()  # reaps it
            if code is None:
                continue
            del self._watched[pid]
            ex = WorkerExit(w.worker_id, pid, code, now - w.started)
            self.exits.append(ex)
            log.warning(
                "worker %d (pid %d) exited after %.1f s: %s",
                ex.worker_id,
                pid,
                ex.ran_s,
                describe_exit(code),
            )
            self._schedule(ex, now)
            out.append((ex, w.pidfd))
        return out

    def _schedule(self, ex: WorkerExit, now: float) -> None:
        if self.stopped or not self.policy.restart:
            return
        failures = (
            1 if ex.ran_s >= self.policy.stable_s else self._failures.get(ex.worker_id, 0) + 1
        )
        self._failures[ex.worker_id] = failures
        if failures > self.policy.max_failures:
            log.error(
                "worker %d exited %d times in a row: not restarting it again",
                ex.worker_id,
                failures,
            )
            return
        delay = self.policy.delay(failures)
        self._due[ex.worker_id] = now + delay
        log.warning(
            "restarting worker %d in %.1f s (exit %d in a row)", ex.worker_id, delay, failures
        )

    def due(self, now: float) -> list[int]:
        """Worker ids whose back-off has passed (taken off the schedule)."""
        if self.stopped:
            self._due.clear()
            return []
        ready = [wid for wid, at in self._due.items() if at <= now]
        for wid in ready:
            del self._due[wid]
        return ready

    def start(self, worker_id: int) -> subprocess.Popen[bytes]:
        """Start worker ``worker_id`` again (the caller watches it and expects its hello)."""
        proc = self.spawn(worker_id)
        self.restarts += 1
        log.warning("worker %d restarted (pid %d)", worker_id, proc.pid)
        return proc

    def next_due(self) -> float | None:
        """When the next restart is due (``None``: none scheduled)."""
        return min(self._due.values()) if self._due else None

    def stop(self) -> list[int]:
        """No more restarts; returns the pidfds to close."""
        self.stopped = True
        self._due.clear()
        fds = self.pidfds
        for w in self._watched.values():
            w.pidfd = None
        return fds
