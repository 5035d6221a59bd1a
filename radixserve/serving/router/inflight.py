"""The router's requests in flight: where each one is, and every way it ends.

:class:`InFlight` holds the :class:`~radixserve.serving.router.requests.RouterRequest` of every
generate request from its arrival to its last message, indexed by router rid and by (client,
client rid). It sends a request to the worker the dispatcher chooses (or queues it until a
worker joins: a first one, one restarted, or one given up that joins again), folds the worker's
outputs into it, and ends it in one of four ways: finished (a final message), failed (an
error), aborted by its client, or dropped with a client that went away. A request whose worker
dies before it produced a token is sent once more, to another worker (or the next to join, e.g.
the dead one restarted). Whenever the worker may still run an ended request, the request is
aborted there, which frees its KV. Keep-alive bookkeeping lives here too: only clients with
requests in flight are probed.

Sending to clients stays with the router (``send`` and ``reply_error`` callbacks): a failed
send means the client is gone, and the router calls :meth:`InFlight.drop_client`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from radixserve.sampling_params import MAX_HIDDEN_STATE_FLOATS, hidden_state_floats
from radixserve.serving.router.dispatch import Dispatcher
from radixserve.serving.router.requests import RouterRequest
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool
from radixserve.serving.wire import protocol as p
from radixserve.stop_regex import StopRegexTimeout

log = logging.getLogger("radixserve.serving.inflight")

MAX_RETRIES = 1  # a request that lost its worker before its first token is sent again once

ClientSend = Callable[[bytes, msgspec.Struct], bool]
ClientError = Callable[[bytes, p.Error], None]


def context_error(n: int, context_length: int | None) -> str | None:
    """Why a prompt of ``n`` tokens does not fit ``context_length`` (``None``: it fits, or no
    worker has joined yet to say)."""
    ctx = context_length
    if ctx is not None and n >= ctx:
        return (
            f"the prompt has {n} tokens but the model's context is {ctx} tokens "
            f"(a prompt may use at most {ctx - 1}, leaving room to generate)"
        )
    return None


class SplitDispatch(Protocol):
    """Prefill/decode disaggregation's dispatch (``disagg_dispatch.DisaggDispatch``): where a
    request goes to a pair of workers instead of one."""

    def usable(self, loads: dict[int, Any]) -> dict[int, Any]:
        """``loads`` if a pair can be formed now, else nothing."""
        ...

    def dispatch(self, st: RouterRequest) -> None: ...

    def abort(self, st: RouterRequest) -> bool:
        """Stop ``st``'s pair; False when it has none (it runs on one worker)."""
        ...


# The hidden states (return_hidden_states) the requests in flight may hold together, in
# floats: twice what one request may (the engine's bound), ~1 GiB of the router's memory.
HIDDEN_FLOATS_IN_FLIGHT = 2 * MAX_HIDDEN_STATE_FLOATS


class InFlight:
    """Every generate request between its arrival and its last message (see the module doc).

    ``worker_wait_s``: how long a request may wait for a worker to join (0: a request that
    finds no worker fails at once, unless a worker may yet join: ``WorkerPool.awaited``)."""

    def __init__(
        self,
        pool: WorkerPool,
        dispatcher: Dispatcher,
        *,
        send: ClientSend,
        reply_error: ClientError,
        worker_wait_s: float,
    ) -> None:
        self._pool = pool
        self._dispatcher = dispatcher
        self._send = send
        self._reply_error = reply_error
        self._worker_wait_s = worker_wait_s
        self._requests: dict[str, RouterRequest] = {}
        self._by_client: dict[bytes, dict[str, str]] = {}  # client -> client rid -> rid
        self._last_sent: dict[bytes, float] = {}
        self._waiting: deque[RouterRequest] = deque()  # no worker yet
        self._next_rid = 0
        self.split: SplitDispatch | None = None  # set by the router with --disaggregation
        self.total = 0  # requests accepted
        self.hidden_floats = 0  # reserved by the requests in flight (_reserve_hidden)
        self.aborted = 0  # by their client, or with a client that went away

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def num_clients(self) -> int:
        """Clients with requests in flight."""
        return len(self._by_client)

    def get(self, rid: str) -> RouterRequest | None:
        return self._requests.get(rid)

    def has(self, client: bytes, client_rid: str) -> bool:
        """Whether ``client`` has a request ``client_rid`` in flight."""
        return client_rid in self._by_client.get(client, {})

    def new_rid(self) -> str:
        """A fresh router-global request id (counts the request as accepted)."""
        self.total += 1
        return self._fresh_rid()

    def _fresh_rid(self) -> str:
        rid = str(self._next_rid)
        self._next_rid += 1
        return rid

    def track(self, st: RouterRequest) -> None:
        """Track a new request; :meth:`dispatch` sends it once its prompt is encoded. Meanwhile
        an abort, its client leaving or a shutdown ends it like any other."""
        self._by_client.setdefault(st.client, {})[st.client_rid] = st.rid
        self._requests[st.rid] = st
        self._last_sent.setdefault(st.client, st.arrival)

    def dispatch(self, st: RouterRequest) -> None:
        """Batch ``st`` for the worker the dispatcher chooses; queue or fail it without one."""
        pool = self._pool
        loads = {w.worker_id: w.outstanding() for w in pool.routable}
        if self.split is not None:
            loads = self.split.usable(loads)
        if not loads:
            if pool.awaited() or (not pool.workers and self._worker_wait_s > 0):
                self._waiting.append(st)
            else:
                self.fail(st, "no_workers", "no live worker to run the request")
            return
        too_long = context_error(len(st.prompt_ids), pool.context_length())
        if too_long:
            return self.fail(st, "context_length", too_long)
        refused = self._reserve_hidden(st)
        if refused is not None:
            return self.fail(st, "overloaded", refused)
        if self.split is not None:
            return self.split.dispatch(st)
        decision = self._dispatcher.choose(
            st.prompt_ids, loads, st.session_id, st.cache_namespace, rid=st.rid
        )
        w = pool.workers[decision.worker_id]
        st.worker_id, st.dispatched = w.worker_id, time.monotonic()
        w.sent(st.rid, max(0, len(st.prompt_ids) - decision.matched_tokens))
        w.requests += 1
        w.adds.append(
            p.WorkerRequest(
                rid=st.rid,
                input_ids=st.prompt_ids,
                params=st.params,
                namespace=st.namespace,
                session_id=st.session_id,
                priority=st.priority,
                lora=st.lora,
            )
        )

    def _reserve_hidden(self, st: RouterRequest) -> str | None:
        """Reserve what ``st``'s hidden states may weigh (once: a retry keeps its share), or
        say why not: the router holds each request's until its final message, as Python
        floats (~32 bytes each), and a batch of requests each within the engine's bound
        could together take more memory than the host has."""
        if not st.params.return_hidden_states or st.hidden_floats:
            return None
        hidden_size = self._pool.hidden_size()  # only for the requests asking: not per dispatch
        if not hidden_size:
            return None
        _, need = hidden_state_floats(len(st.prompt_ids), st.params.max_tokens, hidden_size)
        if need > MAX_HIDDEN_STATE_FLOATS:
            return None  # the engine refuses it alone (a 400 that says why; no retry helps)
        if self.hidden_floats + need > HIDDEN_FLOATS_IN_FLIGHT:
            return (
                f"the requests in flight would hold {self.hidden_floats + need} floats of "
                f"hidden states, more than the server's {HIDDEN_FLOATS_IN_FLIGHT}: retry "
                "when they finished, or ask for fewer positions (a shorter prompt or max_tokens)"
            )
        st.hidden_floats = need
        self.hidden_floats += need
        return None

    # ------------------------------------------------------------------ clients
    def abort(self, client: bytes, client_rid: str) -> None:
        """The client aborts one of its requests (a no-op if it already ended)."""
        rid = self._by_client.get(client, {}).get(client_rid)
        st = self._requests.get(rid) if rid is not None else None
        if st is None:
            return  # already finished: the abort crossed the final message
        self.abort_in_worker(st)
        self.aborted += 1
        self.finish(st, "abort")

    def abort_in_worker(self, st: RouterRequest) -> None:
        """Make sure the worker stops ``st`` (or never gets it), freeing its KV."""
        if self.split is not None and self.split.abort(st):
            return
        w = self._pool.workers.get(st.worker_id)
        if w is None:
            if st in self._waiting:
                self._waiting.remove(st)
            return
        if w.alive and st.rid in w.inflight:
            if any(a.rid == st.rid for a in w.adds):  # not sent yet: just don't send it
                w.adds = [a for a in w.adds if a.rid != st.rid]
                w.settle(st.rid)
            else:
                self._pool.send(w, p.WorkerAbort(rids=[st.rid]))

    def drop_client(self, client: bytes) -> None:
        """The client is gone: abort its requests in the workers, forget it."""
        for rid in list(self._by_client.pop(client, {}).values()):
            st = self._requests.pop(rid, None)
            if st is not None:
                self.aborted += 1
                self.abort_in_worker(st)
        self._last_sent.pop(client, None)

    def sent_to(self, client: bytes) -> None:
        """Something reached ``client``: it needs no keep-alive for a while."""
        if client in self._by_client:  # only clients with requests in flight are probed
            self._last_sent[client] = time.monotonic()

    def probe_clients(self, now: float, interval_s: float) -> None:
        """A :class:`KeepAlive` to each client with requests in flight that heard nothing for
        ``interval_s`` (a failed send reveals a client that left)."""
        for client in list(self._by_client):
            if now - self._last_sent.get(client, 0.0) >= interval_s:
                self._send(client, p.KeepAlive())

    # ------------------------------------------------------------------ ending
    def _forget(self, st: RouterRequest) -> bool:
        if self._requests.pop(st.rid, None) is None:
            return False
        self.hidden_floats -= st.hidden_floats
        self._dispatcher.ended(st.rid)
        rids = self._by_client.get(st.client)
        if rids is not None:
            rids.pop(st.client_rid, None)
            if not rids:
                del self._by_client[st.client]
                self._last_sent.pop(st.client, None)
        return True

    def finish(self, st: RouterRequest, reason: p.FinishReason) -> None:
        """End ``st`` with its final message (once)."""
        if self._forget(st):
            self._send(st.client, st.final(reason))

    def fail(self, st: RouterRequest, code: Any, message: str) -> None:
        """End ``st`` with an error (once)."""
        if self._forget(st):
            self._reply_error(
                st.client, p.Error(code=code, message=message, request_id=st.client_rid)
            )

    def fail_all(self, code: Any, message: str) -> None:
        """End every request with an error (the router is shutting down)."""
        for st in list(self._requests.values()):
            self.fail(st, code, message)

    # ------------------------------------------------------------------ workers
    def on_output(self, w: WorkerHandle, out: p.StepOutput) -> None:
        """Fold one worker output into its request: stream a chunk, end it on a stop string
        (aborting it in the worker) or when the worker finished it."""
        rid = out.request_id
        if out.new_token_ids and rid in w.prefill:  # the first token: the prompt is computed
            w.prefill_done(rid)
            self._dispatcher.prefilled(rid)
        if out.finished:
            w.settle(rid)
            if out.usage is not None:
                w.prompt_tokens += out.usage.prompt_tokens
                w.cached_tokens += out.usage.cached_tokens
        st = self._requests.get(rid)
        if st is None:
            if not out.finished and rid not in w.inflight:  # an orphan (see retry): stop it
                self._pool.send(w, p.WorkerAbort(rids=[rid]))
            return  # else it finished here already (stop string, abort): its abort is on its way
        st.weight_version = w.weight_version  # its worker's, which cannot change under it
        if out.error_code == "invalid_params":  # the request's own doing
            self.fail(st, "invalid_params", f"the engine ended the request: {out.error}")
            return
        if out.error is not None or out.finish_reason == "error":
            self.fail(st, "internal", f"worker {w.worker_id} failed the request: {out.error}")
            return
        try:
            chunk, stopped = st.apply(out)
        except StopRegexTimeout as exc:  # the request's own patterns: a 400, the worker freed
            if not out.finished:
                self.abort_in_worker(st)
            self.fail(st, "invalid_params", str(exc))
            return
        if chunk is not None and not self._send(st.client, chunk):
            return  # the client is gone (its requests were aborted)
        if stopped:
            if not out.finished:
                self.abort_in_worker(st)
            self.finish(st, "stop")
        elif out.finished:
            self.finish(st, out.finish_reason or "stop")

    def on_rejected(self, w: WorkerHandle, rid: str, message: str) -> None:
        """The worker's engine refused the request (invalid params, too long, ...)."""
        w.settle(rid)
        st = self._requests.get(rid)
        if st is not None:
            self.fail(st, "invalid_params", f"the engine rejected the request: {message}")

    def fail_worker_requests(self, w: WorkerHandle, reason: str) -> None:
        """``w`` died: retry, once, each of its requests that had no token yet (nothing was
        streamed, so a client cannot tell), on another worker or the next to join; fail the
        others with ``worker_died``."""
        for rid in list(w.inflight):
            st = self._requests.get(rid)
            if st is None:
                continue
            if not st.token_ids and st.retries < MAX_RETRIES:
                log.warning(
                    "worker %d died (%s) before request %s had a token: retrying it",
                    w.worker_id,
                    reason,
                    rid,
                )
                self.retry(st, stale_at=w.identity)
            else:
                self.fail(
                    st, "worker_died", f"worker {w.worker_id} died ({reason}); the request was lost"
                )

    def retry(self, st: RouterRequest, stale_at: bytes | None = None) -> None:
        """Send ``st`` once more (its ``retries`` counted), under a fresh rid.

        The process that had it may still run it, or receive it yet: a worker given up for its
        silence, or one that reconnected and said hello again while the request crossed that
        hello. Under the old rid its engine would refuse the retry as a duplicate, or the old
        run's final output (the abort of its rejoin) would end the retry. Under a new one the
        old run is an orphan: aborted here at the peer ``stale_at`` (best effort; unknown ids
        are ignored there), and by :meth:`on_output` should any of its outputs still come."""
        old = st.rid
        self._dispatcher.ended(old)
        if stale_at is not None:
            self._pool.send_raw(stale_at, p.WorkerAbort(rids=[old]))
        del self._requests[old]
        st.rid = self._fresh_rid()
        self._requests[st.rid] = st
        self._by_client[st.client][st.client_rid] = st.rid
        st.retries += 1
        st.worker_id = -1
        st.extras.hidden_states = None  # any the old run sent: the new one computes them all again
        self.dispatch(st)

    # ------------------------------------------------------------------ waiting for a worker
    def dispatch_waiting(self) -> None:
        """A worker joined: dispatch the requests that waited for one."""
        waiting, self._waiting = self._waiting, deque()
        for st in waiting:
            self.dispatch(st)

    def fail_waiting(self, message: str) -> None:
        """No worker will come: fail the requests waiting for one."""
        waiting, self._waiting = self._waiting, deque()
        for st in waiting:
            self.fail(st, "no_workers", message)

    def expire_waiting(self, now: float) -> None:
        """Fail the requests that waited longer than ``worker_wait_s`` for a worker."""
        while self._waiting and now - self._waiting[0].arrival > self._worker_wait_s:
            st = self._waiting.popleft()
            self.fail(st, "no_workers", f"no worker joined within {self._worker_wait_s:.0f} s")
