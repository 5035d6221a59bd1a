"""The router's view of its workers, and how local worker processes are started.

A worker is a process (local or on another host) that connects a DEALER socket to the
router's worker endpoint and says :class:`~radixserve.serving.wire.protocol.WorkerHello`.
The router keeps one :class:`WorkerHandle` per worker: liveness, load, in-flight
requests (until the worker reports them finished, which is when their KV is free) and
per-worker cache-hit counters.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq

from radixserve.serving.router.dispatch import Dispatcher, Outstanding
from radixserve.serving.router.supervisor import describe_exit
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire.security import Peer, printable
from radixserve.serving.wire.security import log as audit_log

log = logging.getLogger("radixserve.serving.workers")

# How long a worker whose process exited stays "gone" before it is declared dead: a worker
# says goodbye (and sends its last outputs) just before it exits, and the reaper can see the
# exit before this side's I/O thread has read those bytes off the connection. Within the
# grace, a message from it settles the matter at once (a goodbye marks it dead with its own
# reason); nothing new is routed to it meanwhile.
EXIT_GRACE_S = 0.5


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
    gone: str | None = (
        None  # why it seems gone (a send failed, its process exited); see WorkerPool.settle_gone
    )
    settle_at: float = 0.0  # when a gone worker may be declared dead (see EXIT_GRACE_S)
    rejoin_asked: bool = False  # declared dead, then heard from: told once to join again
    load: p.WorkerLoad = field(default_factory=p.WorkerLoad)
    inflight: set[str] = field(default_factory=set)  # rids not yet reported finished
    prefill: dict[str, int] = field(default_factory=dict)  # rid -> prompt tokens left to compute
    prefill_tokens: int = 0  # their sum
    adds: list[p.WorkerRequest] = field(default_factory=list)  # batched per loop turn
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    engine: dict[str, Any] = field(default_factory=dict)
    # The LoRA adapters it serves (name -> cache key): its hello's, then its load and
    # unload replies' (router/lora_ops.py).
    lora_adapters: dict[str, str] = field(default_factory=dict)
    # The weights it serves: its hello's, then its weight updates' (router/weight_ops.py).
    model_path: str = ""
    weight_version: str = "default"

    def outstanding(self) -> Outstanding:
        """What this worker has to do, as the dispatcher measures it."""
        return Outstanding(len(self.inflight), self.prefill_tokens)

    def sent(self, rid: str, uncached_tokens: int) -> None:
        """Request ``rid`` goes to this worker, which must compute ``uncached_tokens`` of its
        prompt (the dispatcher's estimate) before its first token."""
        self.inflight.add(rid)
        self.prefill[rid] = uncached_tokens
        self.prefill_tokens += uncached_tokens

    def prefill_done(self, rid: str) -> None:
        """Request ``rid`` has its first token (or ended): its prompt is no longer queued."""
        self.prefill_tokens -= self.prefill.pop(rid, 0)

    def settle(self, rid: str) -> None:
        """Request ``rid`` is over on this worker."""
        self.inflight.discard(rid)
        self.prefill_done(rid)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self.hello.pid

    def stats(self) -> p.WorkerStats:
        """The client-facing summary of this worker."""
        return p.WorkerStats(
            worker_id=self.worker_id,
            alive=self.alive and self.gone is None,
            pid=self.pid,
            inflight=len(self.inflight),
            requests=self.requests,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            hit_rate=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            load=self.load,
            engine=self.engine,
            death=self.death,
            prefill_tokens=self.prefill_tokens,
        )


class WorkerPool:
    """The router's workers: registration, sends over the backend socket, liveness.

    ``on_dead(worker, reason)`` runs once when a worker is declared dead (its in-flight
    requests are still listed in ``worker.inflight`` then, for the router to fail);
    ``on_joined(worker)`` after a worker registered.
    """

    def __init__(
        self,
        backend: zmq.Socket,
        dispatcher: Dispatcher,
        on_dead: Callable[[WorkerHandle, str], None],
        on_joined: Callable[[WorkerHandle], None],
    ) -> None:
        self.backend = backend
        self.dispatcher = dispatcher
        self._on_dead = on_dead
        self._on_joined = on_joined
        self.workers: dict[int, WorkerHandle] = {}
        self._by_identity: dict[bytes, WorkerHandle] = {}
        self.expected: dict[int, Any] = {}  # worker id -> Popen of local workers not yet registered
        self.restarting: set[int] = set()  # local worker ids whose restart is scheduled

    @property
    def live(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.alive]

    def expect_local(self, worker_id: int, proc: Any) -> None:
        """A local worker process that will say hello; its exit is watched."""
        self.expected[worker_id] = proc

    def get(self, identity: bytes) -> WorkerHandle | None:
        return self._by_identity.get(identity)

    def register(
        self, identity: bytes, hello: p.WorkerHello, peer: Peer | None = None
    ) -> WorkerHandle:
        """Add a worker that said hello (a known identity re-registering lost its work);
        ``peer`` (its address and CURVE key) goes into the join's audit line."""
        old = self._by_identity.get(identity)
        if old is not None:
            self.mark_dead(old, "worker re-registered")
        wid = hello.worker_id
        held = self.workers.get(wid)
        if held is not None and held.alive and held.gone is not None:
            self.mark_dead(held, held.gone)  # its restart is here: the old process is gone
        if wid < 0 or (wid in self.workers and self.workers[wid].alive):
            wid = max([*self.workers, *self.expected, -1]) + 1
        # A worker joining again (declared dead after a long step) keeps its process handle.
        proc = self.expected.pop(wid, None) or (old.proc if old is not None else None)
        w = WorkerHandle(wid, identity, hello, time.monotonic(), proc=proc, load=hello.load)
        w.lora_adapters = dict(hello.lora_adapters)
        w.model_path, w.weight_version = hello.model_path, hello.weight_version
        self.workers[wid] = w
        self._by_identity[identity] = w
        self.dispatcher.add_worker(wid)
        peer = peer or Peer("?", None)
        audit_log.info(
            "worker %d joined: identity %s, address %s, key %s, pid %d, model %r, context %d",
            wid,
            printable(identity),
            peer.address,
            peer.key or "none (no CURVE)",
            hello.pid,
            hello.model,
            hello.context_length,
        )
        self._on_joined(w)
        return w

    def send(self, w: WorkerHandle, msg: msgspec.Struct) -> bool:
        """Send to a live worker; False if it is unreachable (nothing more is sent to it then,
        and :meth:`settle_gone` declares it dead)."""
        if w.gone is not None:
            return False
        try:
            self.backend.send_multipart([w.identity, p.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            w.gone, w.settle_at = f"unreachable ({exc})", 0.0
            return False
        return True

    @property
    def routable(self) -> list[WorkerHandle]:
        """Live workers new requests may go to (not those found gone, awaiting settlement)."""
        return [w for w in self.live if w.gone is None]

    def awaited(self) -> bool:
        """Whether a worker may yet join, so that a request finding none routable waits for one
        (up to the router's ``worker_wait_s``) rather than failing at once: a local worker
        starting or due to be restarted, or one not routable now whose process still runs:
        given up for its silence, or found unreachable and not yet settled (a long step, or
        the server paused past its connections' heartbeats: the worker reconnects and joins
        again, keeping its process handle, see :meth:`register`)."""
        if self.expected or self.restarting:
            return True
        return any(
            (not w.alive or w.gone is not None) and w.proc is not None and w.proc.poll() is None
            for w in self.workers.values()
        )

    def settle_gone(self, now: float | None = None) -> None:
        """Declare dead the workers found gone: unreachable ones at once, exited ones once
        :data:`EXIT_GRACE_S` has passed since their exit was seen.

        Call it right after reading the worker socket to the end: what a worker sent before
        it went (its goodbye, its last outputs) is still queued on our side after the
        connection closed, and must be read first, or a clean exit would look like a crash."""
        now = time.monotonic() if now is None else now
        for w in self.live:
            if w.gone is not None and now >= w.settle_at:
                self.mark_dead(w, w.gone)

    def _exited(self, w: WorkerHandle, reason: str) -> None:
        if w.gone is None:
            w.gone, w.settle_at = reason, time.monotonic() + EXIT_GRACE_S

    def send_raw(self, identity: bytes, msg: msgspec.Struct) -> None:
        """Best-effort send to any peer (e.g. a worker already given up on)."""
        try:
            self.backend.send_multipart([identity, p.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def flush_adds(self) -> None:
        """Send each worker the requests batched for it during this loop turn."""
        for w in self.live:
            if w.adds:
                adds, w.adds = w.adds, []
                self.send(w, p.WorkerAdd(requests=adds))

    def mark_dead(self, w: WorkerHandle, reason: str) -> None:
        """Stop routing to ``w``; the router fails its in-flight requests (``on_dead``)."""
        if not w.alive:
            return
        w.alive, w.death = False, reason
        log.warning("worker %d (pid %s) is dead: %s", w.worker_id, w.pid, reason)
        self.dispatcher.remove_worker(w.worker_id)
        self._on_dead(w, reason)
        w.inflight.clear()
        w.prefill.clear()
        w.prefill_tokens = 0
        w.adds.clear()

    def process_exited(self, worker_id: int, pid: int, reason: str) -> None:
        """Local worker process ``pid`` (worker ``worker_id``) exited and was reaped: a live
        worker is gone (declared dead by :meth:`settle_gone`, after its last messages are
        read); one that never joined will not come."""
        proc = self.expected.get(worker_id)
        if proc is not None and proc.pid == pid:
            del self.expected[worker_id]
            log.error("worker %d failed to start (%s)", worker_id, reason)
        for w in self.live:
            if w.pid == pid:
                self._exited(w, reason)

    def excuse(self, stalled_s: float) -> None:
        """The router itself did not run for ``stalled_s`` seconds (its process was stopped,
        its host paused): no worker could be heard in that time, so it does not count toward
        their silence. Without this, a whole server stopped and continued (SIGSTOP/SIGCONT,
        a VM suspended) would declare every worker dead on its first liveness turn."""
        for w in self.live:
            w.last_seen += stalled_s

    def check(self, now: float, timeout_s: float) -> list[str]:
        """Liveness turn: reap exited processes, time out silent workers, ping the rest.
        Returns why local workers that never joined failed (they will not come)."""
        for w in self.live:
            code = w.proc.poll() if w.proc is not None else None
            if code is not None:
                # Worded as the supervisor's reap words it: whichever sees the exit first,
                # the death reads the same.
                self._exited(w, f"process {describe_exit(code)}")
            elif w.gone is not None:
                continue  # settled by settle_gone; nothing to ping
            elif now - w.last_seen > timeout_s:
                self.mark_dead(w, f"no heartbeat for {now - w.last_seen:.1f} s")
            else:
                self.send(w, p.WorkerPing())
        failed = []
        for wid, proc in list(self.expected.items()):
            if proc.poll() is not None:
                del self.expected[wid]
                failed.append(f"worker {wid} failed to start (exit code {proc.returncode})")
                log.error(failed[-1])
        return failed

    def shutdown_all(self) -> None:
        """Tell every worker to exit, the dead-declared too (a hung one that recovers should go)."""
        for w in self.workers.values():
            self.send_raw(w.identity, p.WorkerShutdown())

    def context_length(self) -> int | None:
        sizes = [w.hello.context_length for w in self.live]
        return min(sizes) if sizes else None

    def hidden_size(self) -> int:
        """The live workers' model's hidden size (0: unknown)."""
        return max((w.hello.hidden_size for w in self.live), default=0)

    def vocab_size(self) -> int | None:
        sizes = [w.hello.vocab_size for w in self.live]
        return min(sizes) if sizes else None

    def lora_adapters(self) -> dict[str, str] | None:
        """The LoRA adapters every live worker serves, name -> cache key (a name two
        workers serve with other files: the first one's); None: no worker has joined yet."""
        live = self.live
        if not live:
            return None
        common = set.intersection(*(set(w.lora_adapters) for w in live))
        return {name: live[0].lora_adapters[name] for name in sorted(common)}


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
    """The command line of a local worker process (``python -m radixserve worker``;
    ``program`` replaces that part, e.g. for a test's fake worker)."""
    cmd = [
        *(program or [sys.executable, "-m", "radixserve", "worker"]),
        "--connect",
        connect,
        "--worker-id",
        str(worker_id),
        "--model",
        str(model),
        "--engine-config",
        json.dumps(engine_config or {}),
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
    full_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    for http_only in (
        "RADIXSERVE_API_KEY",
        "RADIXSERVE_ADMIN_API_KEY",
    ):  # a worker has no use for them
        full_env.pop(http_only, None)
    if env:
        full_env.update(env)
    return subprocess.Popen(cmd, env=full_env, start_new_session=True, stdin=subprocess.DEVNULL)
