"""Background responses (OpenAI's ``background: true`` on ``/v1/responses``): long agent
turns a client does not hold a connection open for.

The request is answered at once with the response ``in_progress``; its generation runs in a
task of the gateway's, not tied to the client's connection, and its stored response
(:mod:`.responses_store`, which ``GET /v1/responses/{id}`` reads) becomes ``completed``,
``incomplete`` or ``failed`` when it ends. ``POST /v1/responses/{id}/cancel`` stops it (the
request is aborted in the worker, its KV freed) and leaves it ``cancelled``; deleting it
stops it too. A conversation continues from a background response only once it has
ended. Per tenant, as the store is; at most :data:`MAX_RUNNING` run at once (a 429 past
that), so background requests cannot pile up unbounded work.

With ``stream: true`` too, the answer is the response's event stream, and the events are
kept (:class:`EventLog`) so that a client whose connection dropped picks the stream up
again where it left it: ``GET /v1/responses/{id}?stream=true&starting_after=N`` sends the
events after sequence number ``N`` (all of them without it), then the rest as they come.
A dropped connection does not stop the response. The events are kept while the response
runs and, after it ended, for the :data:`KEPT_LOGS` most recent streamed responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable

from radixserve.serving.http.errors import APIError

log = logging.getLogger("radixserve.serving.http")

MAX_RUNNING = 1024  # background responses running at once, all tenants together
KEPT_LOGS = 64  # streamed background responses whose events are kept after they ended

Key = tuple[str, str]  # (tenant, response id)


class EventLog:
    """The server-sent events of one streamed background response, in order (event ``i``
    has sequence number ``i``), for any number of readers, each from where it chooses."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.ended = False
        self._grew = asyncio.Event()

    def append(self, event: bytes) -> None:
        self.events.append(event)
        self._wake()

    def end(self) -> None:
        """No event follows (the response ended, however it ended)."""
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        grew, self._grew = self._grew, asyncio.Event()
        grew.set()

    async def follow(self, after: int = -1) -> AsyncIterator[bytes]:
        """The events after sequence number ``after``, then each as it comes, to the end."""
        i = after + 1
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.ended:
                return
            await self._grew.wait()


class BackgroundRuns:
    """The background responses running, by tenant and id, and the event logs of the
    streamed ones (those running, and the :data:`KEPT_LOGS` that ended last)."""

    def __init__(self) -> None:
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._logs: OrderedDict[Key, EventLog] = OrderedDict()

    def log(self, key: Key) -> EventLog | None:
        """``key``'s event log, if it was streamed and its events are still kept."""
        return self._logs.get(key)

    def new_log(self, key: Key) -> EventLog:
        """An event log for ``key``, which :meth:`start` is about to run."""
        log = self._logs[key] = EventLog()
        return log

    def forget(self, key: Key) -> None:
        """Drop ``key``'s event log (its response was deleted)."""
        self._logs.pop(key, None)

    def _ended(self, key: Key) -> None:
        self._tasks.pop(key, None)
        if key in self._logs:
            self._logs.move_to_end(key)
        ended = [k for k in self._logs if k not in self._tasks]
        for k in ended[: max(0, len(ended) - KEPT_LOGS)]:
            del self._logs[k]

    def start(self, key: Key, run: Awaitable[None]) -> None:
        """Run ``run`` in the background under ``key``; a 429 past :data:`MAX_RUNNING`."""
        if len(self._tasks) >= MAX_RUNNING:
            self._logs.pop(key, None)
            close = getattr(run, "close", None)
            if close is not None:
                close()  # the coroutine never ran: no "never awaited" warning
            raise APIError(
                429,
                f"{MAX_RUNNING} background responses are running: try again later",
                type="rate_limit_error",
                code="too_many_background_responses",
            )
        task = asyncio.ensure_future(run)
        self._tasks[key] = task
        task.add_done_callback(lambda _: self._ended(key))

    def running(self, key: Key) -> bool:
        return key in self._tasks

    async def cancel(self, key: Key) -> bool:
        """Stop ``key``'s run and wait until it has recorded that; False if none runs."""
        task = self._tasks.get(key)
        if task is None:
            return False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return True

    async def close(self) -> None:
        """Stop every run (the gateway is shutting down)."""
        for key in list(self._tasks):
            await self.cancel(key)
