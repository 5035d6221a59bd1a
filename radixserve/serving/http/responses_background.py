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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from radixserve.serving.http.errors import APIError

log = logging.getLogger("radixserve.serving.http")

MAX_RUNNING = 1024  # background responses running at once, all tenants together

Key = tuple[str, str]  # (tenant, response id)


class BackgroundRuns:
    """The background responses running, by tenant and id."""

    def __init__(self) -> None:
        self._tasks: dict[Key, asyncio.Task[None]] = {}

    def start(self, key: Key, run: Awaitable[None]) -> None:
        """Run ``run`` in the background under ``key``; a 429 past :data:`MAX_RUNNING`."""
        if len(self._tasks) >= MAX_RUNNING:
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
        task.add_done_callback(lambda _: self._tasks.pop(key, None))

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
