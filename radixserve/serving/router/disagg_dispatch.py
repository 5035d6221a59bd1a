"""The router's side of prefill/decode disaggregation: one request, two workers.

With ``RouterConfig.disaggregation`` every request goes to a pair: a decode worker chosen by
load reserves pages for the prompt, a prefill worker chosen by prefix cache (the same
:class:`~radixserve.serving.router.dispatch.Dispatcher` as colocated routing, over the
prefill workers only) computes it and writes its KV into those pages through Mooncake's
transfer engine, and the decode worker then streams the tokens like a colocated worker::

    stage "reserve"   router ── WorkerReserve ──> D ── WorkerReserved(ticket) ──> router
    stage "prefill"   router ── WorkerPrefill(ticket) ──> P ── WorkerPrefilled ──> router
    then              router ── WorkerAdmit ──> D; D's outputs stream as any worker's

The request's ``worker_id`` is its decode worker from the start (its load counts there, and
its outputs come from there); the prefill worker's part is tracked here until it answers.

Every way it can go wrong gives the decode worker's pages back, and only once the prefill
worker cannot write into them any more: the prefill worker answered (even after an abort),
its process is gone, or the reservation's lease ran out (the decode worker then releases it
by itself and says so; a prefill worker starts no write after the lease's ``write_by``).

- client abort or disconnect: in "reserve" the reservation is released at once (the
  prefill worker has no ticket yet); in "prefill" the prefill run is aborted and the
  reservation released when its answer comes;
- the prefill worker fails, dies, or the lease runs out: the request (no token streamed
  yet) is sent once more, to a new pair, or fails with a clear error;
- the decode worker dies: the prefill run is aborted; the request is retried once by
  :class:`~radixserve.serving.router.inflight.InFlight` (as for any worker) while it had no
  token, and fails with ``worker_died`` after.
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from radixserve.serving.router.dispatch import Dispatcher, Outstanding
from radixserve.serving.router.inflight import MAX_RETRIES, InFlight
from radixserve.serving.router.requests import RouterRequest
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool
from radixserve.serving.wire import protocol as p

log = logging.getLogger("radixserve.serving.router")

# A local prefill worker found unreachable (its connection closed) is waited for this long
# to exit before its reservation may be given back and its request retried (see
# _process_gone); one still running then may yet write, and its request fails instead.
EXIT_WAIT_S = 2.0

DisaggReply = p.WorkerReserved | p.WorkerPrefilled | p.WorkerReleased


@dataclass(slots=True, eq=False)
class _Pair:
    """A request between its reservation and its admission on the decode worker."""

    st: RouterRequest
    decode: int
    stage: str = "reserve"  # "reserve" | "prefill"
    prefill: int = -1
    attempt: int = 0
    orphan: bool = False  # the client's request ended; the reservation goes once P answers


class DisaggStats(NamedTuple):
    """What the router saw of its pairs since start."""

    prefilled: int  # prefill answers with a first token
    failed: int  # prefill answers with an error, leases run out, pairs lost to a death
    bytes: int  # KV bytes the prefill workers reported written
    held_tokens: int  # prompt tokens the decode workers already held (not transferred)


class DisaggDispatch:
    """Sends each request to a prefill and a decode worker (see the module doc)."""

    def __init__(
        self, pool: WorkerPool, dispatcher: Dispatcher, inflight: InFlight, timeout_s: float
    ) -> None:
        self._pool, self._dispatcher, self._inflight = pool, dispatcher, inflight
        self.timeout_s = timeout_s
        self._pairs: dict[str, _Pair] = {}
        self._attempts = 0  # unique per prefill sent: a late answer never matches a new try
        self._prefilled = self._failed = self._bytes = self._held = 0

    def stats(self) -> DisaggStats:
        return DisaggStats(self._prefilled, self._failed, self._bytes, self._held)

    def _role(self, mode: str) -> list[WorkerHandle]:
        return [w for w in self._pool.routable if w.hello.disaggregation_mode == mode]

    def usable(self, loads: dict[int, Outstanding]) -> dict[int, Outstanding]:
        """``loads`` when a prefill and a decode worker are both routable, else nothing (the
        request then waits for workers, or fails, as it would with none at all)."""
        return loads if self._role("prefill") and self._role("decode") else {}

    # ------------------------------------------------------------------ forward
    def dispatch(self, st: RouterRequest) -> None:
        """Reserve on the least loaded decode worker; the prefill follows its answer."""
        d = min(self._role("decode"), key=lambda w: self._dispatcher.load(w.outstanding()))
        st.worker_id, st.dispatched = d.worker_id, time.monotonic()
        d.sent(st.rid, 0)
        d.requests += 1
        self._pairs[st.rid] = _Pair(st, d.worker_id)
        self._pool.send(d, p.WorkerReserve(request=_request(st), timeout_s=self.timeout_s))

    def on_message(self, w: WorkerHandle, msg: DisaggReply) -> None:
        """A worker's reservation, prefill answer or lapsed lease."""
        if isinstance(msg, p.WorkerReserved):
            self._on_reserved(w, msg)
        elif isinstance(msg, p.WorkerPrefilled):
            self._on_prefilled(w, msg)
        else:
            self._on_released(w, msg)

    def _on_reserved(self, d: WorkerHandle, msg: p.WorkerReserved) -> None:
        pair = self._pairs.get(msg.rid)
        if pair is None or pair.decode != d.worker_id or pair.stage != "reserve":
            if msg.ticket is not None:  # for a request that ended meanwhile: nothing to fill
                self._pool.send(d, p.WorkerRelease(rid=msg.rid))
            return
        if msg.ticket is None:
            self._end(pair, d)
            self._inflight.fail(
                pair.st, "invalid_params", f"the decode worker refused: {msg.error}"
            )
            return
        prefills = self._role("prefill")
        if not prefills:
            self._pool.send(d, p.WorkerRelease(rid=msg.rid))
            self._retry_or_fail(pair, "no prefill worker is left")
            return
        st = pair.st
        loads = {w.worker_id: w.outstanding() for w in prefills}
        choice = self._dispatcher.choose(st.prompt_ids, loads, None, st.namespace, rid=st.rid)
        pw = self._pool.workers[choice.worker_id]
        pw.sent(st.rid, max(0, len(st.prompt_ids) - choice.matched_tokens))
        self._attempts += 1
        pair.stage, pair.prefill, pair.attempt = "prefill", pw.worker_id, self._attempts
        self._held += msg.held_tokens
        self._pool.send(
            pw, p.WorkerPrefill(request=_request(st), ticket=msg.ticket, attempt=pair.attempt)
        )

    def _on_prefilled(self, pw: WorkerHandle, msg: p.WorkerPrefilled) -> None:
        pw.settle(msg.rid)
        pair = self._pairs.get(msg.rid)
        if pair is None or pair.stage != "prefill" or pair.attempt != msg.attempt:
            return  # a late answer to an earlier try (its pair was settled then)
        d = self._pool.workers.get(pair.decode)
        ok = msg.first_token is not None and not pair.orphan
        self._bytes += msg.kv_bytes
        if ok and d is not None and d.alive:
            self._prefilled += 1
            self._dispatcher.prefilled(msg.rid)
            del self._pairs[msg.rid]
            self._pool.send(d, p.WorkerAdmit(rid=msg.rid, result=msg.result))
            return
        if d is not None:
            self._pool.send(d, p.WorkerRelease(rid=msg.rid))
        if pair.orphan:
            self._end(pair, d)
        else:
            self._failed += 1
            self._retry_or_fail(pair, f"prefill worker {pw.worker_id} failed: {msg.error}")

    def _on_released(self, d: WorkerHandle, msg: p.WorkerReleased) -> None:
        pair = self._pairs.get(msg.rid)
        if pair is None or pair.decode != d.worker_id:
            return
        self._failed += 1
        self._abort_prefill(pair)
        self._end(pair, d)
        if not pair.orphan:
            self._inflight.fail(
                pair.st,
                "timeout",
                f"decode worker {d.worker_id} gave the request's pages back: {msg.reason} "
                f"({self.timeout_s:g} s; prefill worker {pair.prefill})",
            )

    # ------------------------------------------------------------------ endings
    def abort(self, st: RouterRequest) -> bool:
        """The client's request ended: stop its pair. False when ``st`` has none (it runs on
        its decode worker like any request: the caller aborts it there)."""
        pair = self._pairs.get(st.rid)
        if pair is None:
            return False
        d = self._pool.workers.get(pair.decode)
        if pair.stage == "reserve":  # no ticket went out: nothing can be written
            if d is not None:
                self._pool.send(d, p.WorkerRelease(rid=st.rid))
            self._end(pair, d)
        else:  # released once the prefill worker answers (or is gone)
            pair.orphan = True
            self._abort_prefill(pair)
        return True

    def worker_dead(self, w: WorkerHandle, reason: str) -> None:
        """``w`` died: settle the pairs it was part of (before InFlight handles its requests)."""
        gone: bool | None = None  # whether w's process has exited: asked once, if needed
        for pair in list(self._pairs.values()):
            if pair.decode == w.worker_id:  # InFlight retries or fails it, as w's request
                self._abort_prefill(pair)
                self._pairs.pop(pair.st.rid, None)
                self._failed += 1
            elif pair.prefill == w.worker_id and pair.stage == "prefill":
                w.inflight.discard(pair.st.rid)  # ours to settle, not InFlight's
                d = self._pool.workers.get(pair.decode)
                if gone is None:
                    gone = _process_gone(w, EXIT_WAIT_S if reason.startswith("unreachable") else 0)
                if d is not None and gone:  # it will write nothing more
                    self._pool.send(d, p.WorkerRelease(rid=pair.st.rid))
                self._failed += 1  # else the lease frees the pages, D tells us, we ignore it
                if pair.orphan:
                    self._end(pair, d)
                elif gone:
                    self._retry_or_fail(pair, f"prefill worker {w.worker_id} died ({reason})")
                else:  # its reservation stays until the lease ends: no retry under its rid
                    self._end(pair, d)
                    self._inflight.fail(
                        pair.st, "worker_died", f"prefill worker {w.worker_id} lost ({reason})"
                    )

    def _abort_prefill(self, pair: _Pair) -> None:
        pw = self._pool.workers.get(pair.prefill)
        if pair.stage == "prefill" and pw is not None and pw.alive:
            self._pool.send(pw, p.WorkerAbort(rids=[pair.st.rid]))

    def _end(self, pair: _Pair, d: WorkerHandle | None) -> None:
        """Forget ``pair`` and its load on the decode worker."""
        self._pairs.pop(pair.st.rid, None)
        if d is not None:
            d.settle(pair.st.rid)

    def _retry_or_fail(self, pair: _Pair, reason: str) -> None:
        """Its decode reservation is given back: send the request once more, or fail it."""
        self._end(pair, self._pool.workers.get(pair.decode))
        st = pair.st
        if self._inflight.get(st.rid) is not st:
            return  # it ended meanwhile
        if st.retries < MAX_RETRIES:
            log.warning("request %s: %s; retrying it on a new prefill/decode pair", st.rid, reason)
            self._inflight.retry(st)
        else:
            self._inflight.fail(st, "worker_died", f"{reason}; the request was lost")


def _request(st: RouterRequest) -> p.WorkerRequest:
    # Sessions are not leased across a pair (their KV would be split over two workers).
    return p.WorkerRequest(
        rid=st.rid,
        input_ids=st.prompt_ids,
        params=st.params,
        namespace=st.namespace,
        priority=st.priority,
        lora=st.lora,
    )


def _process_gone(w: WorkerHandle, wait_s: float = 0.0) -> bool:
    """Whether ``w``'s process has exited (a remote worker's cannot be known: False), waiting
    up to ``wait_s`` for it: a killed process's connection closes a moment before the kernel
    reports its exit, so a local worker found unreachable is given that moment."""
    proc: Any = w.proc
    if proc is None:
        return False
    if proc.poll() is not None:
        return True
    if wait_s > 0:
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return False
    return proc.poll() is not None


def parse_roles(spec: str) -> list[str]:
    """``"prefill:1,decode:2"`` -> each local worker's mode, prefill workers first
    (``ValueError`` for anything else: both roles are needed, counts >= 1)."""
    counts: dict[str, int] = {}
    for part in spec.split(","):
        role, _, n = part.strip().partition(":")
        if role not in ("prefill", "decode") or role in counts or not n.strip().isdigit():
            raise ValueError(f"--disaggregation wants prefill:N,decode:M, got {spec!r}")
        counts[role] = int(n)
    if counts.get("prefill", 0) < 1 or counts.get("decode", 0) < 1:
        raise ValueError(
            f"--disaggregation needs at least one prefill and one decode worker: {spec!r}"
        )
    return ["prefill"] * counts["prefill"] + ["decode"] * counts["decode"]
