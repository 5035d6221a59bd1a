"""The router: many clients in, several workers out, text on one side and tokens on the other.

::

    clients (DEALER) ──> frontend ROUTER ─┐                 ┌─> backend ROUTER ──> workers (DEALER)
                                          │  Router loop:   │
      GenerateChunk / Final / Error  <────┤  limits,        ├──  WorkerAdd / Abort / Ping / Stats
                                          │  dispatch,      │
                                          └  detokenize  <──┴──  WorkerOutputs / Heartbeat / ...
                                                 │ ^
                                  EncodeJob      v │  token ids
                                        tokenizer processes (tokenizer_pool.py)

One thread, one ``zmq.Poller`` loop. Both sockets are ``ROUTER_MANDATORY``: a send to a
peer that went away raises instead of vanishing silently, which is how the router learns
that a client left (its requests are aborted in the workers, freeing their KV) or that a
worker is unreachable. Clients with requests in flight get a :class:`KeepAlive` once a
second so a silent client's departure is noticed too; workers are pinged and must answer
within ``worker_timeout_s``; local worker processes are also watched with ``poll()``.

The router runs the sockets, the loop and the timers, and wires the parts that answer one
question each: what becomes of a client's message, from its limits to its dispatch
(:class:`~radixserve.serving.router.from_clients.ClientSide`, with prompts encoded off the loop by
the :class:`~radixserve.serving.router.tokenizer_pool.TokenizerPool`), and of a worker's
(:class:`~radixserve.serving.router.from_workers.WorkerSide`, KV events included); where a request
is after that, its outputs and every way it ends
(:class:`~radixserve.serving.router.inflight.InFlight`); which worker runs it
(:class:`~radixserve.serving.router.dispatch.Dispatcher`); the workers' registry and liveness
(:class:`~radixserve.serving.router.worker_pool.WorkerPool`); stats and cache flushes that ask every
worker (:class:`~radixserve.serving.router.control.ControlOps`). Local worker processes are
watched by a :class:`~radixserve.serving.router.supervisor.Supervisor` (reaped at once, restarted).
Its settings are a :class:`~radixserve.serving.router.config.RouterConfig`.

Stopping: :meth:`Router.stop` (safe from a signal handler or another thread) wakes the
poll at once through a socket pair. :meth:`Router.shutdown` then fails what is in flight,
tells the workers to exit and closes the client side; :meth:`Router.close` closes the
worker side last, so that a launcher can reap its local workers in between while their
goodbyes still land (:class:`~radixserve.serving.router.launcher.LocalServer` does).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import msgspec
import zmq

from radixserve.serving.prompts import PromptCodec
from radixserve.serving.router.config import RouterConfig
from radixserve.serving.router.control import ControlOps
from radixserve.serving.router.disagg_dispatch import DisaggDispatch
from radixserve.serving.router.dispatch import Dispatcher
from radixserve.serving.router.from_clients import ClientSide
from radixserve.serving.router.from_workers import WorkerSide
from radixserve.serving.router.inflight import InFlight
from radixserve.serving.router.lora_ops import LoraOps
from radixserve.serving.router.memory_ops import MemoryOps
from radixserve.serving.router.pause_ops import PauseOps
from radixserve.serving.router.supervisor import Supervisor, describe_exit
from radixserve.serving.router.tokenizer_pool import TokenizerPool
from radixserve.serving.router.weight_ops import WeightOps
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire import zmq_events
from radixserve.serving.wire.security import HandshakeWatch, RouterSecurity

log = logging.getLogger("radixserve.serving.router")

# A liveness turn this many intervals late means the router's loop did not run (see
# Router._excuse_stall): a loop busy with messages is late by milliseconds.
STALL_TURNS = 3


class Router:
    """Serves clients on ``config.endpoint`` with the workers that join ``worker_endpoint``."""

    def __init__(
        self,
        tokenizer: Any,
        config: RouterConfig = RouterConfig(),
        *,
        context: zmq.Context | None = None,
    ) -> None:
        self._bind_sockets(config, context)
        self.start(tokenizer)

    @classmethod
    def bound(
        cls, config: RouterConfig = RouterConfig(), *, context: zmq.Context | None = None
    ) -> Router:
        """A router with its sockets bound (workers may connect, their keys be minted) and no
        tokenizer yet: :meth:`start` gives it one before its loop first runs. ``serve``
        starts its workers in between, so that their start-up overlaps the tokenizer's load
        (transformers' imports: seconds of one core). :meth:`close_unstarted` closes it
        where the tokenizer could not be loaded."""
        router = cls.__new__(cls)
        router._bind_sockets(config, context)
        return router

    def _bind_sockets(self, config: RouterConfig, context: zmq.Context | None) -> None:
        self.config = config
        # A context of its own (unless given one) is terminated by close(): no zmq I/O thread
        # outlives the router, and nothing of it is left for interpreter exit to clean up.
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._open_sockets(config)
        self._next_tick = 0.0
        self._stopping = False
        self._errors = 0
        self.supervisor: Supervisor | None = None

    def start(self, tokenizer: Any) -> None:
        """The tokenizer's parts (the codec, the tokenizer processes) and everything that
        turns messages into work: the router can then run."""
        self.codec = PromptCodec(tokenizer)
        self.codec.warm_up()  # the router detokenizes every stream (and encodes without a pool)
        self._start_tokenizers(tokenizer, self.config)
        self._build_parts(self.config)

    def _open_sockets(self, config: RouterConfig) -> None:
        """The client and worker sockets (checked against the bind policy, then bound), the
        in-process client endpoint, and the poller with its wake-up pipe."""
        self.security = RouterSecurity(self._ctx, config.keys, insecure=config.insecure)
        try:
            # Both addresses are checked before either is bound: a refusal leaves nothing open.
            self.security.check(config.endpoint, "clients")
            self.security.check(config.worker_endpoint, "workers")
            self.frontend = self._bind(config.endpoint, client_side=True)
            try:
                self.backend = self._bind(config.worker_endpoint, client_side=False)
            except BaseException:
                self.frontend.close(linger=0)
                raise
        except BaseException:
            self.security.close()
            if self._own_ctx:
                self._ctx.term()
            raise
        self.endpoint = self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        # The same client socket, for clients in this process (the HTTP gateway of `serve`):
        # an inproc pipe skips the loopback TCP hop and both ZeroMQ I/O threads, a thread
        # wake-up fewer per streamed token on each side. Nothing outside the process reaches it.
        self.inproc_endpoint = f"inproc://radixserve-router-{os.getpid()}-{id(self):x}"
        self.frontend.bind(self.inproc_endpoint)
        self.worker_endpoint = self.backend.getsockopt_string(zmq.LAST_ENDPOINT)
        # stop() writes a byte here so the poll returns at once instead of at its timeout.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = zmq.Poller()
        self._poller.register(self.frontend, zmq.POLLIN)
        self._poller.register(self.backend, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        # Workers without a key fail the CURVE handshake before ZAP hears of them: logged here.
        self._handshakes = HandshakeWatch(self.backend, "worker")
        self._poller.register(self._handshakes.socket, zmq.POLLIN)

    def _start_tokenizers(self, tokenizer: Any, config: RouterConfig) -> None:
        # Prompts are encoded in processes of their own: a huge one delays only itself.
        self.tokenizers: TokenizerPool | None = None
        if config.tokenizer_workers > 0:
            try:
                self.tokenizers = TokenizerPool(tokenizer, config.tokenizer_workers, self._ctx)
            except (AttributeError, OSError) as exc:  # not a transformers tokenizer to hand over
                log.warning(
                    "no tokenizer processes (%s): prompts are encoded on the router's loop", exc
                )
        if self.tokenizers is not None:
            self._poller.register(self.tokenizers.socket, zmq.POLLIN)

    def _build_parts(self, config: RouterConfig) -> None:
        """The router's parts: the choice of worker, the workers, the requests in flight, the
        fan-out operations, and the two sides that turn each socket's messages into calls."""
        self.dispatcher = Dispatcher(
            config.routing,
            cache_threshold=config.cache_threshold,
            min_match_tokens=config.min_match_tokens,
            balance_load=config.balance_load,
            balance_abs_threshold=config.balance_abs_threshold,
            balance_rel_threshold=config.balance_rel_threshold,
            follow_in_flight=config.follow_in_flight,
            trie_max_tokens=config.trie_max_tokens,
            prefix_source=config.prefix_source,
        )
        self.pool = WorkerPool(
            self.backend, self.dispatcher, self._on_worker_dead, self._on_worker_joined
        )
        self.inflight = InFlight(
            self.pool,
            self.dispatcher,
            send=self.send_client,
            reply_error=self._reply_error,
            worker_wait_s=config.worker_wait_s,
        )
        self._control = ControlOps(
            self.pool, self.dispatcher, config.control_timeout_s, self.send_client, self.stats_reply
        )
        self._lora = LoraOps(self.pool, config.lora_timeout_s, self.send_client)
        self._weights = WeightOps(self.pool, config.weights_timeout_s, self.send_client)
        self._pauses = PauseOps(self.pool, config.weights_timeout_s, self.send_client)
        self._memory = MemoryOps(self.pool, config.weights_timeout_s, self.send_client)
        self.client_side = ClientSide(
            config.limits,
            self.codec,
            self.tokenizers,
            self.pool,
            self.inflight,
            self._control,
            self._lora,
            self._weights,
            self._pauses,
            self._memory,
            send=self.send_client,
            reply_error=self._reply_error,
            trusted=self.security.trusted_client,
        )
        self.split: DisaggDispatch | None = None  # prefill/decode pairs (--disaggregation)
        if config.disaggregation:
            self.split = DisaggDispatch(
                self.pool, self.dispatcher, self.inflight, config.disaggregation_timeout_s
            )
            self.inflight.split = self.split
        self.worker_side = WorkerSide(
            self.pool,
            self.dispatcher,
            self.inflight,
            self._control,
            self._lora,
            self._weights,
            self._pauses,
            self._memory,
            on_disagg=self.split.on_message if self.split is not None else None,
        )

    def _bind(self, endpoint: str, client_side: bool) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # a slow client is buffered, never mistaken for a gone one
        sock.setsockopt(zmq.RCVHWM, 0)
        # ZMTP heartbeats drop half-open TCP peers (a host that vanished without a FIN).
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000 if client_side else 60000)
        if not client_side:
            # A worker that reconnects (its heartbeat timed out over a pause both sides slept
            # through) comes back under the same routing id while this side may still hold
            # its old connection for up to the 60 s above: the new one takes the id over,
            # where by default it would be refused and the worker cut off until then. Only
            # an authenticated worker connection can claim an id, and a worker's id carries
            # 64 random bits (Worker.__init__): one worker cannot guess another's.
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            self.security.bind(sock, endpoint, "clients" if client_side else "workers")
        except BaseException:
            sock.close()
            raise
        return sock

    # ------------------------------------------------------------------ lifecycle
    def supervise(self, supervisor: Supervisor) -> None:
        """Have ``supervisor`` reap, report and restart the local workers (before any
        :meth:`expect_local`)."""
        self.supervisor = supervisor

    def expect_local(self, worker_id: int, proc: Any) -> None:
        """Register a local worker process that will say hello; its exit is watched."""
        self.pool.expect_local(worker_id, proc)
        if self.supervisor is not None:
            pidfd = self.supervisor.watch(worker_id, proc)
            if pidfd is not None:
                self._poller.register(pidfd, zmq.POLLIN)  # readable the moment it exits

    @property
    def workers(self) -> dict[int, WorkerHandle]:
        return self.pool.workers

    @property
    def live_workers(self) -> list[WorkerHandle]:
        """Workers that can take requests (not those whose exit awaits settlement)."""
        return self.pool.routable

    def _no_worker_to_come(self) -> bool:
        """No worker can take a request and none may yet join (WorkerPool.awaited): the
        requests waiting for one are failed rather than left to their timeout."""
        return not self.live_workers and not self.pool.awaited()

    @property
    def context(self) -> zmq.Context:
        """The ZeroMQ context (a client of :attr:`inproc_endpoint` must use this one)."""
        return self._ctx

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def counters(self) -> dict[str, int]:
        """Requests accepted, aborted (by or with their client) and error replies sent."""
        return {
            "requests": self.inflight.total,
            "aborted": self.inflight.aborted,
            "errors": self._errors,
        }

    def stop(self) -> None:
        """Ask :meth:`serve` / :meth:`run` to return (safe from a signal handler or another thread)."""
        self._stopping = True
        try:
            self._wake_w.send(b"\0")
        except OSError:  # already closed, or the pair is full of earlier wake-ups
            pass

    def run(self) -> None:
        """Serve until :meth:`stop`; then shut the workers down and close the sockets."""
        try:
            self.serve()
        finally:
            self.close()

    def serve(self) -> None:
        """Serve until :meth:`stop`, leaving the sockets open (see :meth:`shutdown`, :meth:`close`)."""
        while not self._stopping:
            self.run_once(0.1)

    def run_once(self, max_wait_s: float) -> None:
        """One turn: wait for traffic (at most ``max_wait_s``), handle it, run timers."""
        wait = max(0.0, min(max_wait_s, self._next_tick - time.monotonic()))
        events = dict(self._poller.poll(int(wait * 1000)))
        if self._wake_r in events:
            self._drain_wakeups()
        if self._handshakes.socket in events:
            self._handshakes.on_events()
        if self.tokenizers is not None and self.tokenizers.socket in events:
            self._drain(self.tokenizers.socket, self.tokenizers.on_frames)
        if self.frontend in events:
            self._drain(self.frontend, self.client_side.on_frames, copy=False)
        # A pidfd (the int keys) is readable once its worker exited; reaping only then keeps
        # the per-token turn free of a poll() per process.
        if self.supervisor is not None and self.supervisor.should_reap(
            time.monotonic(), any(isinstance(k, int) for k in events)
        ):
            self._supervise()
        if self.backend not in events or self._drain(
            self.backend, self.worker_side.on_frames, copy=False
        ):
            self.pool.settle_gone()  # after reading it all: a gone worker's goodbye comes first
        self.pool.flush_adds()
        if time.monotonic() >= self._next_tick:
            self._tick()

    def shutdown(self, *, shutdown_workers: bool = True) -> None:
        """Fail what is in flight, tell the workers to exit, close the client socket.

        The worker socket stays open until :meth:`close`, so that workers exiting meanwhile
        deliver their goodbyes at once instead of lingering on a vanished peer."""
        self._stopping = True
        if self.frontend.closed:
            return
        if self.tokenizers is not None:
            self.tokenizers.fail_all("shutdown: the server is shutting down")
        self.inflight.fail_all("shutdown", "the server is shutting down")
        if self.supervisor is not None:
            for fd in self.supervisor.stop():
                self._unwatch(fd)
            self.pool.restarting = set()
        if shutdown_workers:
            self.pool.shutdown_all()
        # A short linger: the "shutdown" errors just queued should reach their clients.
        self.frontend.close(linger=200)

    def close(self, *, shutdown_workers: bool = True) -> None:
        """:meth:`shutdown` if not done yet, then close the worker socket and the context."""
        self.shutdown(shutdown_workers=shutdown_workers)
        if self.backend.closed:
            return
        if self.tokenizers is not None:
            self.tokenizers.close()
        self._close_sockets()

    def close_unstarted(self) -> None:
        """Close a :meth:`bound` router that never started (its tokenizer failed to load)."""
        self._stopping = True
        self.frontend.close(linger=0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._handshakes.close()
        self.backend.close(linger=500)  # let shutdown messages to live workers leave
        self._wake_r.close()
        self._wake_w.close()
        self.security.close()  # its socket must be closed before the context can terminate
        if self._own_ctx:
            self._ctx.term()  # waits at most the lingers above, and only for undelivered messages

    def _supervise(self) -> None:
        """Reap exited local workers (the pool declares them dead), start the restarts that are due."""
        sup = self.supervisor
        assert sup is not None
        exits = sup.reap()
        for ex, pidfd in exits:
            if pidfd is not None:
                self._unwatch(pidfd)
            self.pool.process_exited(ex.worker_id, ex.pid, f"process {describe_exit(ex.code)}")
        if not self._stopping:
            for wid in sup.due(time.monotonic()):
                self.expect_local(wid, sup.start(wid))
        self.pool.restarting = sup.pending
        if exits and self._no_worker_to_come():
            self.inflight.fail_waiting("no live worker to run the request (local workers exited)")

    def _unwatch(self, pidfd: int) -> None:
        try:
            self._poller.unregister(pidfd)
        except KeyError:
            pass
        os.close(pidfd)

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass

    def _drain(self, sock: zmq.Socket, handle: Any, limit: int = 512, copy: bool = True) -> bool:
        """Handle up to ``limit`` queued messages; True if that emptied the queue.
        ``copy=False`` hands ``zmq.Frame`` objects over (their metadata name the peer)."""
        for _ in range(limit):
            # Ask before reading: an empty queue found by a raised zmq.Again cost more than
            # the rest of a streamed token's turn.
            if not zmq_events.events(sock) & zmq_events.POLLIN:
                return True
            frames: list[Any] = sock.recv_multipart(zmq_events.NOBLOCK, copy=copy)
            try:
                handle(frames)
            except Exception as exc:  # a bug must cost one request, not the server
                log.exception("error handling a message")
                if sock is self.frontend:
                    # Tied to its request where the frame names one: a client fails that
                    # request alone, not everything it has in flight.
                    raw = [f if isinstance(f, bytes) else f.bytes for f in frames]
                    rid = p.request_id_of(raw[-1]) if len(raw) > 1 else None
                    self._reply_error(
                        raw[0],
                        p.Error(
                            code="internal", message=f"{type(exc).__name__}: {exc}", request_id=rid
                        ),
                    )
        return False

    # ------------------------------------------------------------------ sending
    def send_client(self, client: bytes, msg: msgspec.Struct) -> bool:
        """Send to a client; a client that went away has its requests aborted."""
        try:
            self.frontend.send_multipart([client, p.encode(msg)], zmq_events.NOBLOCK)
        except zmq.ZMQError as exc:
            log.info("client %s unreachable (%s): aborting its requests", client.hex(), exc)
            self.inflight.drop_client(client)
            return False
        self.inflight.sent_to(client)
        return True

    def _reply_error(self, client: bytes, err: p.Error) -> None:
        self._errors += 1
        self.send_client(client, err)

    def context_length(self) -> int | None:
        """The smallest context among live workers (``None`` before any joined)."""
        return self.pool.context_length()

    # ------------------------------------------------------------------ workers
    def _on_worker_joined(self, w: WorkerHandle) -> None:
        if self.dispatcher.prefix_source == "events":
            self.pool.send(w, p.WorkerKVSubscribe())  # answered with a snapshot, then batches
        self._lora.on_joined(w)  # before any request: one may name an adapter loaded since
        self._weights.on_joined(w)  # and the weights updated since (it holds what follows)
        self._pauses.on_joined(w)  # and paused, if the others are
        self._memory.on_joined(w)  # and its memory released, if the others' is
        self.inflight.dispatch_waiting()

    def _on_worker_dead(self, w: WorkerHandle, reason: str) -> None:
        if self.split is not None:  # first: its pairs are settled before its requests
            self.split.worker_dead(w, reason)
        self.inflight.fail_worker_requests(w, reason)
        self._control.on_worker_dead(w)
        self._lora.on_worker_dead(w)
        self._weights.on_worker_dead(w)
        self._pauses.on_worker_dead(w)
        self._memory.on_worker_dead(w)
        if self._no_worker_to_come():
            self.inflight.fail_waiting("no live worker to run the request")

    # ------------------------------------------------------------------ timers
    def _tick(self) -> None:
        now = time.monotonic()
        cfg = self.config
        interval = min(cfg.heartbeat_interval_s, cfg.client_probe_interval_s)
        self._excuse_stall(now, interval)
        self._next_tick = now + interval
        if self.tokenizers is not None:
            self.tokenizers.check()
        failed = self.pool.check(now, cfg.worker_timeout_s)
        if failed and self._no_worker_to_come():
            self.inflight.fail_waiting("; ".join(failed))
        self.inflight.expire_waiting(now)
        self.inflight.probe_clients(now, cfg.client_probe_interval_s)
        self._control.expire(now)
        self._lora.expire(now)
        self._weights.expire(now)
        self._pauses.expire(now)
        self._memory.expire(now)

    def _excuse_stall(self, now: float, interval: float) -> None:
        """When this turn comes far later than due (the loop could not run: the process
        stopped, the host paused), the time it was not running is not the workers' silence
        (``WorkerPool.excuse``). A turn late by less than ``STALL_TURNS`` intervals (a busy
        loop) excuses nothing."""
        late = now - self._next_tick if self._next_tick else 0.0
        if late > STALL_TURNS * interval:
            log.warning("the router did not run for %.1f s; workers' silence in it excused", late)
            self.pool.excuse(late)

    # ------------------------------------------------------------------ stats
    def stats_reply(self, request_id: str) -> p.StatsReply:
        """A :class:`StatsReply` from what the router knows now."""
        return p.StatsReply(
            request_id=request_id,
            routing=self.config.routing,
            requests=self.inflight.total,
            active=len(self.inflight),
            aborted=self.inflight.aborted,
            errors=self._errors,
            clients=self.inflight.num_clients,
            workers=[self.workers[k].stats() for k in sorted(self.workers)],
        )
