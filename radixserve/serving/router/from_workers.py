"""The router's worker side: what becomes of each message a worker sends.

A hello registers the worker in the :class:`~radixserve.serving.router.worker_pool.WorkerPool`; from a
registered, live worker, outputs go to :class:`~radixserve.serving.router.inflight.InFlight` (which
streams them back to clients), heartbeats and outputs refresh its load, stats and flush
replies go to :class:`~radixserve.serving.router.control.ControlOps`, LoRA adapter replies to
:class:`~radixserve.serving.router.lora_ops.LoraOps` (weight updates' to
:class:`~radixserve.serving.router.weight_ops.WeightOps`, pauses' and memory releases' to
``PauseOps`` and ``MemoryOps``), and a goodbye marks it dead.
A worker the router already declared dead is told to rejoin (once), and what it still
computes is aborted.

KV events (``prefix_source="events"``) are folded here into the worker's
:class:`~radixserve.serving.router.kv_index.WorkerKVView`, which cache-aware dispatch reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import zmq

from radixserve.serving.router.control import ControlOps
from radixserve.serving.router.dispatch import Dispatcher
from radixserve.serving.router.inflight import InFlight
from radixserve.serving.router.kv_index import decode_batch
from radixserve.serving.router.lora_ops import LoraOps
from radixserve.serving.router.memory_ops import MemoryOps
from radixserve.serving.router.pause_ops import PauseOps
from radixserve.serving.router.weight_ops import WeightOps
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire.security import peer_of

DisaggReply = p.WorkerReserved | p.WorkerPrefilled | p.WorkerReleased

# The router's logger: these are the router's messages, wherever its code lives.
log = logging.getLogger("radixserve.serving.router")


class WorkerSide:
    """Handles the messages of a router's workers (see the module doc)."""

    def __init__(
        self,
        pool: WorkerPool,
        dispatcher: Dispatcher,
        inflight: InFlight,
        control: ControlOps,
        lora: LoraOps,
        weights: WeightOps,
        pauses: PauseOps,
        memory: MemoryOps,
        on_disagg: Callable[[WorkerHandle, DisaggReply], None] | None = None,
    ) -> None:
        self._pool, self._dispatcher = pool, dispatcher
        self._inflight, self._control, self._lora = inflight, control, lora
        self._weights, self._pauses, self._memory = weights, pauses, memory
        self._on_disagg = on_disagg  # prefill/decode pairs' replies (disagg_dispatch.py)

    def on_frames(self, frames: list[zmq.Frame]) -> None:
        """Handle one message from a worker: ``[identity, frame]`` as ``zmq.Frame`` objects (the
        frame's metadata name the peer a hello came from)."""
        if len(frames) != 2:
            log.warning("worker sent %d frames; ignored", len(frames))
            return
        identity, data = frames[0].bytes, frames[1].bytes
        msg = p.decode_from_worker(data)
        if isinstance(msg, p.Error):
            log.warning("bad frame from worker %r: %s", identity, msg.message)
            return
        if isinstance(msg, p.WorkerHello):
            self._pool.register(identity, msg, peer_of(frames[1]))
            return
        w = self._pool.get(identity)
        if w is None or not w.alive:
            if w is not None and not w.rejoin_asked and not isinstance(msg, p.WorkerGoodbye):
                # Declared dead but still talking (a step outlasted the heartbeat timeout):
                # its requests have failed; it may serve again once it has dropped them.
                w.rejoin_asked = True
                self._pool.send_raw(identity, p.WorkerRejoin(join=w.hello.join))
            elif isinstance(msg, p.WorkerOutputs):  # a worker we gave up on: stop its work
                live = [o.request_id for o in msg.outputs if not o.finished]
                if live:
                    self._pool.send_raw(identity, p.WorkerAbort(rids=live))
            return
        w.last_seen = time.monotonic()
        if isinstance(msg, p.WorkerOutputs):
            w.load = msg.load
            for out in msg.outputs:
                self._inflight.on_output(w, out)
        elif isinstance(msg, p.WorkerHeartbeat):
            w.load = msg.load
        elif isinstance(msg, p.WorkerKVEvents):
            self.on_kv_events(w, msg)
        elif isinstance(msg, (p.WorkerStatsReply, p.WorkerFlushReply, p.WorkerCloseSessionReply)):
            self._control.on_reply(w, msg)
        elif isinstance(msg, p.WorkerLoraReply):
            self._lora.on_reply(w, msg)
        elif isinstance(msg, p.WorkerWeightsReply):
            self._weights.on_reply(w, msg)
        elif isinstance(msg, p.WorkerPauseReply):
            self._pauses.on_reply(w, msg)
        elif isinstance(msg, p.WorkerMemoryReply):
            self._memory.on_reply(w, msg)
        elif isinstance(msg, p.WorkerRejected):
            self._inflight.on_rejected(w, msg.rid, msg.message)
        elif isinstance(msg, p.WorkerGoodbye):
            self._pool.mark_dead(w, f"worker said goodbye ({msg.reason})")
        elif isinstance(msg, (p.WorkerReserved, p.WorkerPrefilled, p.WorkerReleased)):
            if self._on_disagg is not None:
                self._on_disagg(w, msg)

    def on_kv_events(self, w: WorkerHandle, msg: p.WorkerKVEvents) -> None:
        """Fold a worker's KV events into its view; after a gap (or an undecodable batch)
        the view is dropped and a new snapshot asked for (the tries stand in meanwhile)."""
        view = self._dispatcher.views.get(w.worker_id)
        if view is None:
            return  # not routing on events (or a worker just declared dead)
        if msg.snapshot:
            view.reset(msg.hash_identity, msg.page_size, msg.medium)
        was_synced = view.synced
        try:
            ok = view.apply(msg.seq, decode_batch(msg.batch))
        except msgspec.DecodeError as exc:
            log.warning("worker %d sent an undecodable KV event batch: %s", w.worker_id, exc)
            view.desync()
            ok = False
        if not ok and was_synced:
            log.warning(
                "worker %d: KV event batch %d missing (got %d); asking for a new snapshot",
                w.worker_id,
                view.next_seq,
                msg.seq,
            )
            self._pool.send(w, p.WorkerKVSubscribe())
