"""Router <-> worker messages of prefill/decode disaggregation (``serve --disaggregation``).

One request between a decode worker D and a prefill worker P, the router carrying every
message (P and D never talk to each other except through the transfer engine's writes)::

    router ── WorkerReserve ──> D      D reserves its held prefix and pages for the rest
    router <── WorkerReserved ── D     the ticket (opaque msgpack: D's pool, pages to fill)
    router ── WorkerPrefill ──> P      P computes the prompt, writes the pages into D's pool
    router <── WorkerPrefilled ── P    the answer (opaque msgpack), and its first token / error
    router ── WorkerAdmit ──> D        D admits the request and streams WorkerOutputs from here
    router ── WorkerRelease ──> D      ...or gives the reservation back (P failed, died, or the
                                       client left and P will not write any more)
    router <── WorkerReleased ── D     D gave a reservation back by itself: its lease ran out

The ticket and the answer are the :mod:`radixserve.distributed.disagg.roles` structs encoded
by the workers; the router passes them on without reading them (the wire imports none of
the engine's modules).
"""

from __future__ import annotations

from radixserve.serving.wire.base import Msg
from radixserve.serving.wire.worker_messages import WorkerRequest


class WorkerReserve(Msg, tag="w_reserve"):
    """Router -> decode worker: reserve pages for ``request``'s prompt, for at most
    ``timeout_s`` seconds of waiting for its KV (the reservation's lease)."""

    request: WorkerRequest
    timeout_s: float


class WorkerPrefill(Msg, tag="w_prefill"):
    """Router -> prefill worker: compute ``request``'s prompt and write it per ``ticket``.
    ``attempt`` comes back in the answer, so a late answer to an earlier try is told apart."""

    request: WorkerRequest
    ticket: bytes
    attempt: int = 0


class WorkerAdmit(Msg, tag="w_admit"):
    """Router -> decode worker: the prefill worker's answer; the request runs from here."""

    rid: str
    result: bytes


class WorkerRelease(Msg, tag="w_release"):
    """Router -> decode worker: give ``rid``'s reservation back (nothing will be written)."""

    rid: str


class WorkerReserved(Msg, tag="w_reserved"):
    """Decode worker -> router: the ticket for ``rid`` (``None`` with ``error``: refused)."""

    rid: str
    ticket: bytes | None = None
    held_tokens: int = 0  # prompt tokens the decode worker already holds (not transferred)
    error: str | None = None


class WorkerPrefilled(Msg, tag="w_prefilled"):
    """Prefill worker -> router: the answer for ``rid`` (``first_token`` None: ``error`` says
    why; nothing usable was written)."""

    rid: str
    attempt: int
    result: bytes
    first_token: int | None = None
    kv_bytes: int = 0  # KV bytes written into the decode worker's pool
    error: str | None = None


class WorkerReleased(Msg, tag="w_released"):
    """Decode worker -> router: it gave ``rid``'s reservation back itself (``reason``)."""

    rid: str
    reason: str
