"""A worker process: one Engine, driven by the router over a DEALER socket.

The loop never blocks the engine on I/O: while requests run it polls the socket with a
zero timeout between steps; when idle it blocks in ``poll`` (bounded, to run its checks).
It receives token ids and sampling parameters and sends back token ids, logprobs and
finish reasons, one :class:`~radixserve.serving.wire.protocol.WorkerOutputs` per step. It
never sees text.

Run by ``radixserve serve`` (local workers) or by hand on another host::

    radixserve worker --connect tcp://ROUTER_HOST:PORT --model PATH

in a process that :func:`~radixserve.serving.worker.process.run_worker` sets up; what the
worker reports about its engine (hello, load, stats) is read off it by
:mod:`~radixserve.serving.worker.reports`.

A local worker (``--parent-pid``) exits when its parent dies (``PR_SET_PDEATHSIG`` and a
``getppid`` check) or when its connection to the router is gone for ``--router-timeout``
seconds. The worker judges that itself: ZMTP heartbeats on its socket are answered by the
router's zmq I/O thread even while the router's loop is busy, so a busy router keeps the
connection (the worker waits for it), and a router that is gone loses it. A remote worker
waits for the router to come back; when the connection is made again it aborts its
requests and says hello again.

SIGINT/SIGTERM stop it at once: the handler raises :class:`Interrupted`, which abandons a
poll, an engine step (a long prefill can take seconds on a CPU) or the engine's start-up;
the worker still says goodbye and closes its socket. The process then ends with
``os._exit`` (:func:`~radixserve.serving.shutdown.exit_now`): tearing down torch's and
transformers' objects one by one is seconds of CPU on a busy machine, and serves no one.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from radixserve.engine.outputs import StepOutput
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire import zmq_events
from radixserve.serving.wire.security import PeerKeys
from radixserve.serving.worker.engine_api import ServingEngine
from radixserve.serving.worker.held import HeldRequests
from radixserve.serving.worker.lora_queue import LoraQueue
from radixserve.serving.worker.pausing import Pausing
from radixserve.serving.worker.sleeping import Sleeping
from radixserve.serving.worker.weight_updates import WeightUpdates

if TYPE_CHECKING:
    from radixserve.serving.worker.disagg import DisaggLink
from radixserve.serving.worker.reports import (
    debug_invariants,
    describe_engine,
    engine_load,
    worker_stats,
)

log = logging.getLogger("radixserve.serving.worker")

IDLE_POLL_MS = 100
# The idle poll's timeout while a LoRA adapter's files are read: it is served this soon after.
LORA_POLL_MS = 5
# Seconds without a word from a connected router after which the worker speaks first
# (a heartbeat; see Worker._check_liveness), and between two such heartbeats.
SPEAK_UP_S = 5.0


class Interrupted(BaseException):
    """Raised by :meth:`Worker.interrupt` (a signal handler) to abandon the work in progress.

    A ``BaseException``, like ``KeyboardInterrupt``: the engine-step guard that turns an
    ``Exception`` into failed requests must not catch it."""


class Worker:
    """Runs ``engine`` for the router at ``connect``.

    Without a ``context`` the worker uses a zmq context of its own and terminates it when
    :meth:`run` returns (after the goodbye left, or its short linger ran out). ``curve``: the
    keys of a router that takes only CURVE-authenticated workers (:mod:`~radixserve.serving.wire.security`)."""

    def __init__(
        self,
        engine: ServingEngine,
        connect: str,
        worker_id: int = -1,
        *,
        model_name: str = "",
        parent_pid: int | None = None,
        router_timeout_s: float = 30.0,
        context: zmq.Context | None = None,
        curve: PeerKeys | None = None,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.model_name = model_name
        self.parent_pid = parent_pid
        self.router_timeout_s = router_timeout_s
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self.sock = self._router_socket(curve)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._connected = self._ever_connected = False
        self._lost_since: float | None = time.monotonic()  # not connected yet counts as lost
        self._silence_logged = False
        self.sock.connect(connect)
        self._active: set[str] = set()  # rids added and not reported finished
        self._joins = 0  # hellos said (the next hello's WorkerHello.join)
        self._stopping = False
        self._closing = False  # saying goodbye: an interrupt must not cut that short
        self._goodbye = "shutdown"
        self._last_router = time.monotonic()
        self._spoke_up_at = 0.0  # when a silent router was last sent a heartbeat unasked
        # KV events are the real engine's, not part of ServingEngine: fakes have none.
        self._drain_kv_events: Callable[[], Any] | None = getattr(
            self.engine, "drain_kv_events", None
        )
        self._kv_events = self._event_publisher()
        from radixserve.serving.worker.kv_events import RouterEventFeed

        self._router_events = RouterEventFeed(self.engine, self._send)
        # Prefill/decode disaggregation: None for a colocated engine, whose worker never
        # imports the KV transfer's modules (torch with them: ~1.2 s of a start-up where the
        # engine did not import it, as the tests' fake engine does not).
        self._disagg: DisaggLink | None = None
        if getattr(self.engine, "disagg", None) is not None:
            from radixserve.serving.worker.disagg import DisaggLink

            self._disagg = DisaggLink.of(self.engine, self._send, self._active)
        # LoRA loads and unloads, in order, their files read off the loop (worker/lora_queue.py).
        self._lora = LoraQueue(self.engine, self._send)
        # Requests held from the engine by a weight update, a pause or released memory
        # (worker/held.py); pauses (worker/pausing.py); memory released (worker/sleeping.py);
        # weight updates, between requests (worker/weight_updates.py).
        self._held = HeldRequests(self._start)
        self._pause = Pausing(
            self.engine,
            self._send,
            self._held,
            self._abort_everything,
            disaggregated=self._disagg is not None,
        )
        self._sleep = Sleeping(
            self.engine, self._send, self._held, disaggregated=self._disagg is not None
        )
        self._weights = WeightUpdates(
            self.engine,
            self._send,
            self._held,
            ready=lambda: self._pause.weights_ready() or self._sleep.weights_ready(),
            refusal=self._pause.weights_refusal,
        )
        self._handlers = self._message_handlers()

    def _message_handlers(self) -> dict[type, Callable[[Any], None]]:
        """The handler of each message the router sends."""
        return {
            p.WorkerAdd: self._on_add,
            p.WorkerAbort: self._on_abort,
            p.WorkerReserve: self._on_disagg,
            p.WorkerPrefill: self._on_disagg,
            p.WorkerAdmit: self._on_disagg,
            p.WorkerRelease: self._on_disagg,
            p.WorkerPing: self._on_ping,
            p.WorkerStatsRequest: self._on_stats,
            p.WorkerFlush: self._on_flush,
            p.WorkerCloseSession: self._on_close_session,
            p.WorkerLoadLora: self._lora.submit,
            p.WorkerUnloadLora: self._lora.submit,
            p.WorkerUpdateWeights: self._weights.submit,
            p.WorkerPause: self._pause.pause,
            p.WorkerContinue: self._pause.resume,
            p.WorkerReleaseMemory: self._sleep.release,
            p.WorkerResumeMemory: self._sleep.resume,
            p.WorkerKVSubscribe: self._on_kv_subscribe,
            p.WorkerRejoin: self._on_rejoin,
            p.WorkerShutdown: self._on_shutdown,
        }

    def _router_socket(self, curve: PeerKeys | None) -> zmq.Socket:
        """The DEALER socket to the router: no queue limits, a short linger (the goodbye may
        find the router gone), a routing id of this worker's own, CURVE when the router
        takes only authenticated workers, and ZMTP heartbeats."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        rid = f"w{self.worker_id}-{os.getpid()}-{os.urandom(8).hex()}"
        sock.setsockopt(zmq.ROUTING_ID, rid.encode())
        if curve is not None:
            curve.apply(sock)
        # ZMTP heartbeats are answered by the router's zmq I/O thread even while its own loop
        # is busy: the connection stays up as long as the router process is there, and drops
        # (a disconnect event on the monitor) when it is gone or unreachable.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        timeout_s = max(2.0, min(self.router_timeout_s, 10.0))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout_s * 1000))
        return sock

    def _event_publisher(self) -> Any | None:
        """A KV-event publisher when the engine records events (``kv_events_endpoint``)."""
        cfg = getattr(self.engine, "config", None)
        endpoint = getattr(cfg, "kv_events_endpoint", None)
        if cfg is None or endpoint is None or self._drain_kv_events is None:
            return None
        from radixserve.serving.worker.kv_events import KVEventPublisher

        return KVEventPublisher(
            endpoint.replace("{worker}", str(self.worker_id)), cfg.kv_events_topic, self._ctx
        )

    def _publish_events(self) -> None:
        """Drain the engine's KV events to the XPUB and, when it subscribed, the router."""
        if self._drain_kv_events is None or (
            self._kv_events is None and not self._router_events.active
        ):
            return
        batch = self._drain_kv_events()
        if self._kv_events is not None:
            self._kv_events.publish(batch)
        self._router_events.publish(batch)

    def stop(self, *_: object) -> None:
        """Finish the current step, then exit the loop (safe from a signal handler)."""
        self._stopping = True

    def interrupt(self, *_: object) -> None:
        """Stop now, for a SIGTERM/SIGINT handler: raises :class:`Interrupted` to abandon the
        poll or engine step in progress (:meth:`run` then says goodbye), unless the worker is
        already closing."""
        self._stopping = True
        if not self._closing:
            self._goodbye = "stopped by a signal"
            raise Interrupted

    def _send(self, msg: msgspec.Struct) -> None:
        self.sock.send(p.encode(msg))

    def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        code = 0
        next_check = 0.0
        try:
            self._hello()
            while not self._stopping:
                busy = self._stepping() and self.engine.has_unfinished()
                idle_ms = LORA_POLL_MS if self._lora.waiting else IDLE_POLL_MS
                if self.sock.poll(0 if busy else idle_ms):
                    self._drain()
                if self._stopping:
                    break
                if not self._stepping():  # asked again: the messages just read may change it
                    self._send_outputs(self._outputs_without_a_step())
                elif self.engine.has_unfinished():
                    code = self._step()
                    if code:
                        break
                self._lora.apply_ready()
                self._weights.apply_ready()
                self._pause.poll()
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + 0.5
                    self._check_liveness(now)
                    if self._disagg is not None:
                        self._disagg.expire()
                    code = self._check_engine()
                    if code:
                        break
        except Interrupted:
            pass  # a signal: the step in progress is abandoned, the process is leaving
        finally:
            self.close()
        return code

    def _stepping(self) -> bool:
        """Whether the engine may run steps: not paused (but to let requests finish) and
        no memory released."""
        return self._pause.stepping and self._sleep.stepping

    def close(self) -> None:
        """Say goodbye, close the socket (and the context, if the worker's own), close the
        engine. :meth:`run` ends with it; call it only for a worker that never ran."""
        self._closing = True
        self._lora.close()
        self._send(p.WorkerGoodbye(reason=self._goodbye))
        # When the router asked us to go it is closing too: the goodbye may have no one left to
        # reach, so don't wait for it. Otherwise (a signal, the engine failed, the parent died)
        # the router may still be there, and failed requests or the goodbye must reach it.
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0 if self._goodbye == "shutdown requested" else 200)
        if self._kv_events is not None:
            self._kv_events.close()
        if self._own_ctx:
            self._ctx.term()
        close = getattr(self.engine, "close", None)  # e.g. writes the KV hierarchy to disk
        if callable(close):
            try:
                close()
            except Exception:
                log.exception("closing the engine failed")

    def _check_engine(self) -> int:
        """The engine's own health check, where it has one (tensor-parallel ranks answering);
        a failure ends the worker like a failed step (the router then reports it dead)."""
        check = getattr(self.engine, "check_health", None)
        if check is None:
            return 0
        try:
            check()
        except Exception as exc:
            log.error("engine health check failed: %s", exc)
            self._goodbye = f"engine failed: {exc}"
            return 1
        return 0

    def _step(self) -> int:
        try:
            outs = self.engine.step()
        except Exception:
            # The engine's state can't be trusted after a bug: fail everything, leave.
            tb = traceback.format_exc()
            log.error("engine step failed:\n%s", tb)
            err = tb.strip().splitlines()[-1]
            fails = [
                p.StepOutput(
                    request_id=rid,
                    new_token_ids=[],
                    finished=True,
                    finish_reason="error",
                    error=err,
                )
                for rid in self._active
            ]
            self._send(p.WorkerOutputs(outputs=fails, load=p.WorkerLoad()))
            self._goodbye = f"engine step failed: {err}"
            return 1
        if self._disagg is not None:
            outs = self._disagg.filter_outputs(outs)
            self._disagg.send_answers()
        self._send_outputs(outs)
        return 0

    def _outputs_without_a_step(self) -> Sequence[StepOutput]:
        """What a paused engine has to report with no step (an abort's end, a settled step's
        tokens); nothing from an engine that reports only from steps (the tests' fakes)."""
        take = getattr(self.engine, "take_outputs", None)
        return take() if take is not None else ()

    def _send_outputs(self, outs: Sequence[StepOutput]) -> None:
        """Report ``outs`` (those finished leave the active set), then the KV events."""
        if outs:
            for o in outs:
                if o.finished:
                    self._active.discard(o.request_id)
            self._send(p.WorkerOutputs(outputs=list(outs), load=engine_load(self.engine)))
        self._publish_events()

    def _read_monitor(self, now: float) -> bool:
        """Fold the connection events in; True if the connection came back after a loss."""
        from zmq.utils.monitor import recv_monitor_message

        came_back = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                came_back = came_back or self._ever_connected
                self._connected, self._ever_connected, self._lost_since = True, True, None
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                self._connected, self._lost_since = False, now
                log.warning("lost the connection to the router")
        return came_back

    def _check_liveness(self, now: float) -> None:
        """Judge the router's liveness here, by the connection, not by its silence alone.

        A router that is silent but connected (its zmq I/O thread answers heartbeats) is
        busy: wait for it. One whose connection is gone for ``router_timeout_s`` is gone: a
        local worker exits, a remote one keeps trying; when the connection comes back (a
        router restarted), a remote worker drops its requests and says hello again."""
        reconnected = self._read_monitor(now)
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            self._goodbye = "parent process died"
            self.stop()
            return
        if self._lost_since is not None and now - self._lost_since > self.router_timeout_s:
            if self.parent_pid is not None:  # a local worker without its router has no purpose
                self._goodbye = f"router gone (no connection for {now - self._lost_since:.0f} s)"
                self.stop()
            return  # a remote worker waits for the router to come back
        if reconnected:  # perhaps another router at the same address: start over with it
            log.warning(
                "connected to the router again: dropping %d requests and saying hello",
                len(self._active),
            )
            self._rejoin()
        silent = now - self._last_router
        if self._connected and silent > SPEAK_UP_S and now - self._spoke_up_at > SPEAK_UP_S:
            # The router pings each live worker every second: silence this long, connected,
            # means it is busy or it has given this worker up (declared dead while this one
            # was stopped or slow, or over a pause both slept through). A heartbeat costs
            # the first nothing; the second hears from us and asks us to join again
            # (WorkerRejoin), where an idle worker would otherwise wait in silence forever.
            self._spoke_up_at = now
            self._send(p.WorkerHeartbeat(load=engine_load(self.engine)))
        if silent > self.router_timeout_s and not self._silence_logged:
            self._silence_logged = True
            log.warning("router silent for %.0f s but connected: busy, waiting for it", silent)
        elif silent <= self.router_timeout_s:
            self._silence_logged = False

    def _hello(self) -> None:
        hello = describe_engine(self.engine, self.worker_id, self.model_name, self._joins)
        state = {"paused": self._pause.mode, "memory_released": self._sleep.released}
        self._send(msgspec.structs.replace(hello, **state))
        self._joins += 1

    def _rejoin(self) -> None:
        """Start over with the router: drop every request it may no longer know, say hello."""
        self._abort_all()
        self._hello()

    def _abort_all(self) -> None:
        """Drop every request the router may no longer know (a rejoin): the held ones are
        forgotten, the others aborted."""
        self._held.take_all()
        for rid in list(self._active):
            self._abort(rid)
        if self._disagg is not None:
            self._disagg.drop_all()

    def _abort_everything(self) -> int:
        """End every request as aborted, each reported (a pause's ``abort``); returns how
        many the engine had."""
        self._end_held(self._held.take_all())
        active = list(self._active)
        for rid in active:
            self._abort(rid)
        return len(active)

    def _end_held(self, rids: list[str]) -> None:
        """Held requests never started: they end now, as aborted, so the router settles them."""
        if rids:
            ends = [p.StepOutput(r, [], finished=True, finish_reason="abort") for r in rids]
            self._send(p.WorkerOutputs(outputs=ends, load=engine_load(self.engine)))

    def _abort(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except (KeyError, ValueError):
            pass  # finished in the meantime

    def _drain(self) -> None:
        # Asked, not found by a raised zmq.Again: this runs between steps (the router's _drain too).
        while zmq_events.events(self.sock) & zmq_events.POLLIN:
            data = self.sock.recv(zmq_events.NOBLOCK)
            self._last_router = time.monotonic()
            msg = p.decode_to_worker(data)
            if isinstance(msg, p.Error):
                log.warning("bad frame from the router: %s", msg.message)
                continue
            try:
                self._handle(msg)
            except Exception:  # one failed control message must not take the worker down
                log.exception("handling %s failed", type(msg).__name__)

    def _handle(self, msg: p.RouterToWorker) -> None:
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    def _on_add(self, msg: p.WorkerAdd) -> None:
        self._held.admit(msg.requests)  # held while a weight update waits or a pause lasts

    def _start(self, requests: list[p.WorkerRequest]) -> None:
        for req in requests:
            if req.lora is not None:
                self._lora.settle(req.lora)  # a load or unload of it sent before, applied first
            try:
                self.engine.add_request(
                    req.input_ids,
                    req.params,
                    request_id=req.rid,
                    namespace=req.namespace,
                    session_id=req.session_id,
                    priority=req.priority,
                    lora=req.lora,
                )
            # Invalid params, too long, a bad constraint: the engine says why.
            except Exception as exc:
                self._send(p.WorkerRejected(rid=req.rid, message=str(exc) or type(exc).__name__))
            else:
                self._active.add(req.rid)

    def _on_abort(self, msg: p.WorkerAbort) -> None:
        held = self._held.drop(msg.rids)
        self._end_held(held)
        for rid in set(msg.rids) - set(held):
            self._abort(rid)
        if self._disagg is not None:
            self._disagg.send_answers()  # a prefill run aborted: its answer goes now

    def _on_disagg(self, msg: Any) -> None:
        """Reserve, prefill, admit, release: prefill/decode disaggregation's messages."""
        if self._disagg is None:
            log.warning("%s to a colocated worker: ignored", type(msg).__name__)
        else:
            self._disagg.handle(msg)

    def _on_ping(self, msg: p.WorkerPing) -> None:
        self._send(p.WorkerHeartbeat(load=engine_load(self.engine)))

    def _on_stats(self, msg: p.WorkerStatsRequest) -> None:
        self._send(
            p.WorkerStatsReply(
                token=msg.token,
                load=engine_load(self.engine),
                engine=worker_stats(self.engine, debug_invariants()),
            )
        )

    def _on_flush(self, msg: p.WorkerFlush) -> None:
        self._send(p.WorkerFlushReply(token=msg.token, ok=self._pause.flush()))
        self._publish_events()

    def _on_close_session(self, msg: p.WorkerCloseSession) -> None:
        # Leases are the real engine's, not part of ServingEngine: fakes hold none.
        close = getattr(self.engine, "close_session", None)
        released = bool(close(msg.session_id, msg.namespace)) if close else False
        self._send(p.WorkerCloseSessionReply(token=msg.token, released=released))

    def _on_kv_subscribe(self, msg: p.WorkerKVSubscribe) -> None:
        self._publish_events()  # what came before goes out first; the snapshot follows it
        if not self._router_events.subscribe():
            log.info("the router asked for KV events; this engine records none")

    def _on_rejoin(self, msg: p.WorkerRejoin) -> None:
        if 0 <= msg.join < self._joins - 1:
            # Given up on an earlier hello: this worker has said hello since, and what the
            # router sent after that hello is live. Joining again would abort it for nothing.
            log.info("the router gave up join %d; joined again since: ignored", msg.join)
            return
        log.warning(
            "the router declared this worker dead: aborting %d requests and joining again",
            len(self._active),
        )
        self._rejoin()

    def _on_shutdown(self, msg: p.WorkerShutdown) -> None:
        self._goodbye = "shutdown requested"
        self.stop()
