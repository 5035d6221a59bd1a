"""The router's view of its workers, and how local worker processes are started.

A worker is a process (local or on another host) that connects a DEALER socket to the
router's worker endpoint and says :class:`~radixserve.serving.protocol.WorkerHello`.
The router keeps one :class:`WorkerHandle` per worker: liveness, load, in-flight
requests (until the worker reports them finished, which is when their KV is free) and
per-worker cache-hit counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixserve.serving import protocol as p


@dataclass
class WorkerHandle:
    """One registered worker as the router tracks it."""

    worker_id: int
    identity: bytes
    hello: p.WorkerHello
    last_seen: float
    proc: subprocess.Popen[bytes] | None = None
    alive: bool = True
    death: str | None = None
    load: p.WorkerLoad = field(default_factory=p.WorkerLoad)
    inflight: set[str] = field(default_factory=set)  # rids not yet reported finished
    adds: list[p.WorkerRequest] = field(default_factory=list)  # batched per loop turn
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self.hello.pid

    def stats(self) -> p.WorkerStats:
        """The client-facing summary of this worker."""
        return p.WorkerStats(
            worker_id=self.worker_id, alive=self.alive, pid=self.pid, inflight=len(self.inflight),
            requests=self.requests, prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            hit_rate=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            load=self.load, engine=self.engine,
        )


def worker_command(
    connect: str,
    worker_id: int,
    model: str | Path,
    engine_config: dict[str, Any] | None = None,
    *,
    parent_pid: int | None = None,
    heartbeat_timeout_s: float | None = None,
    program: list[str] | None = None,
) -> list[str]:
    """The command line of a local worker process (``python -m radixserve.serving.worker``;
    ``program`` replaces that part, e.g. for a test's fake worker)."""
    cmd = [
        *(program or [sys.executable, "-m", "radixserve.serving.worker"]),
        "--connect", connect, "--worker-id", str(worker_id), "--model", str(model),
        "--engine-config", json.dumps(engine_config or {}),
    ]
    if parent_pid is not None:
        cmd += ["--parent-pid", str(parent_pid)]
    if heartbeat_timeout_s is not None:
        cmd += ["--router-timeout", str(heartbeat_timeout_s)]
    return cmd


def spawn_worker(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a local worker in its own session, so a terminal's Ctrl-C reaches only the
    parent, which then shuts the workers down in order (they also die with the parent)."""
    full_env = dict(os.environ)
    full_env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    full_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if env:
        full_env.update(env)
    return subprocess.Popen(cmd, env=full_env, start_new_session=True, stdin=subprocess.DEVNULL)
