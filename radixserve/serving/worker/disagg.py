"""A worker's part of prefill/decode disaggregation: the router's messages to its engine's role.

Runs in a worker process whose engine was built with ``disaggregation_mode``
(:mod:`radixserve.distributed.disagg.roles`); the router carries every message between the
two workers (:mod:`radixserve.serving.wire.disagg_messages`):

- **decode**: :class:`~radixserve.serving.wire.protocol.WorkerReserve` reserves pages (queued
  until the pool has room, tried again after every step) and answers with the ticket;
  ``WorkerAdmit`` admits the prefilled request, which from then on streams like any other;
  ``WorkerRelease`` gives a reservation back; a reservation whose lease ran out is given
  back here and reported (``WorkerReleased``).
- **prefill**: ``WorkerPrefill`` runs the prompt for a ticket; its step output (one token)
  is not streamed: the role's answer goes back as ``WorkerPrefilled`` instead.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from radixserve.distributed.disagg.roles import (
    DecodeRole,
    PrefillResult,
    PrefillRole,
    PrefillTicket,
)
from radixserve.engine.outputs import StepOutput
from radixserve.serving.wire import protocol as p

log = logging.getLogger("radixserve.serving.worker")

DisaggMessage = p.WorkerReserve | p.WorkerPrefill | p.WorkerAdmit | p.WorkerRelease

_ticket_decoder = msgspec.msgpack.Decoder(PrefillTicket)
_result_decoder = msgspec.msgpack.Decoder(PrefillResult)


class DisaggLink:
    """Turns the router's disaggregation messages into calls on ``role`` and its answers into
    messages (``send``); ``active`` is the worker's set of rids it streams outputs for."""

    def __init__(
        self,
        role: PrefillRole | DecodeRole,
        send: Callable[[msgspec.Struct], None],
        active: set[str],
    ) -> None:
        self.role = role
        self._send = send
        self._active = active
        self._waiting: deque[p.WorkerReserve] = deque()  # decode: no room yet
        self._attempts: dict[str, int] = {}  # prefill: rid -> the router's attempt number

    @classmethod
    def of(
        cls, engine: Any, send: Callable[[msgspec.Struct], None], active: set[str]
    ) -> DisaggLink | None:
        """The link of an engine with a disaggregation role (None for a colocated one)."""
        role = getattr(engine, "disagg", None)
        if isinstance(role, (PrefillRole, DecodeRole)):
            return cls(role, send, active)
        return None

    @property
    def mode(self) -> str:
        return "prefill" if isinstance(self.role, PrefillRole) else "decode"

    def handle(self, msg: DisaggMessage) -> None:
        """One message from the router (a message for the other role is answered with an
        error, never applied)."""
        role = self.role
        if isinstance(msg, p.WorkerPrefill) and isinstance(role, PrefillRole):
            self._prefill(role, msg)
        elif isinstance(msg, p.WorkerReserve) and isinstance(role, DecodeRole):
            self._waiting.append(msg)
            self.try_reserve()
        elif isinstance(msg, p.WorkerAdmit) and isinstance(role, DecodeRole):
            if role.finish(_result_decoder.decode(msg.result)):
                self._active.add(msg.rid)
            else:  # its lease ran out first (the pages are gone): the request fails here
                self._fail(msg.rid, "its reservation lapsed before the KV was admitted")
        elif isinstance(msg, p.WorkerRelease) and isinstance(role, DecodeRole):
            self._waiting = deque(m for m in self._waiting if m.request.rid != msg.rid)
            role.cancel(msg.rid)
        else:
            log.warning("a %s worker got %s: ignored", self.mode, type(msg).__name__)
        self.send_answers()

    def _prefill(self, role: PrefillRole, msg: p.WorkerPrefill) -> None:
        req = msg.request
        try:
            ticket = _ticket_decoder.decode(msg.ticket)
            role.prefill(req.input_ids, req.params, ticket, req.namespace)
        except (ValueError, msgspec.DecodeError) as exc:
            err = f"{type(exc).__name__}: {exc}"
            self._send(p.WorkerPrefilled(rid=req.rid, attempt=msg.attempt, result=b"", error=err))
            return
        self._attempts[req.rid] = msg.attempt

    def try_reserve(self) -> None:
        """Reserve for the queued requests, in order, while the pool has room."""
        role = self.role
        assert isinstance(role, DecodeRole)
        while self._waiting:
            msg = self._waiting[0]
            req = msg.request
            try:
                ticket = role.reserve(
                    req.input_ids, req.params, req.rid, req.namespace, timeout_s=msg.timeout_s
                )
            except ValueError as exc:
                self._waiting.popleft()
                self._send(p.WorkerReserved(rid=req.rid, error=str(exc) or "refused"))
                continue
            if ticket is None:
                return  # no room until a running request finishes
            self._waiting.popleft()
            self._send(
                p.WorkerReserved(rid=req.rid, ticket=p.encode(ticket), held_tokens=ticket.held_len)
            )

    def filter_outputs(self, outs: Sequence[StepOutput]) -> list[StepOutput]:
        """The outputs to stream: a prefill worker's runs (and their aborts) are answered with
        :class:`WorkerPrefilled`, not streamed; a decode worker streams every admitted one."""
        if isinstance(self.role, DecodeRole):
            return list(outs)
        return [o for o in outs if o.request_id in self._active]

    def send_answers(self) -> None:
        """After a step or a message: the prefill side's answers; the decode side's queued
        reservations that now fit."""
        role = self.role
        if isinstance(role, DecodeRole):
            if self._waiting:
                self.try_reserve()
            return
        for res in role.take_results():
            attempt = self._attempts.pop(res.request_id, 0)
            self._send(
                p.WorkerPrefilled(
                    rid=res.request_id,
                    attempt=attempt,
                    result=p.encode(res),
                    first_token=res.first_token,
                    kv_bytes=res.bytes,
                    error=res.error,
                )
            )

    def _fail(self, rid: str, why: str) -> None:
        out = StepOutput(
            request_id=rid, new_token_ids=[], finished=True, finish_reason="error", error=why
        )
        self._send(p.WorkerOutputs(outputs=[out], load=p.WorkerLoad()))

    def expire(self) -> None:
        """Decode side: give back reservations whose lease ran out, and say so."""
        if isinstance(self.role, DecodeRole):
            for rid in self.role.expire():
                self._send(p.WorkerReleased(rid=rid, reason="no KV arrived within its lease"))

    def drop_all(self) -> None:
        """The router starts over with this worker (rejoin): forget what it asked. Reserved
        pages are given back only as their leases run out (a prefill may still write)."""
        self._waiting.clear()
