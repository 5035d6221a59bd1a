"""Helpers shared by the API modules: priming a stream, collecting finals, logprob numbers,
what stopped a request."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any, TypeVar

from starlette.requests import Request

from radixserve.serving.http.gateway import final_of, until_disconnected
from radixserve.serving.wire import protocol as p

T = TypeVar("T")
_NOTHING: Any = object()


async def _first(it: AsyncIterator[T]) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return _NOTHING


async def primed(request: Request, it: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for ``it``'s first item before the response starts, so that errors the router
    answers at once (invalid parameters, prompt too long, no workers) get their HTTP status
    instead of an error event inside a 200 stream. Returns an iterator over every item."""
    first = await until_disconnected(request, _first(it))

    async def rest() -> AsyncIterator[T]:
        try:
            if first is _NOTHING:
                return
            yield first
            async for item in it:
                yield item
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()

    return rest()


async def finals(
    request: Request, streams: list[AsyncGenerator[Any, None]]
) -> list[p.GenerateFinal]:
    """Run every stream to its final message, concurrently; the first error cancels the
    others (aborting them), and so does the HTTP client going away."""

    async def gather() -> list[p.GenerateFinal]:
        tasks = [asyncio.ensure_future(final_of(s)) for s in streams]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:  # the error that happened first, not the first in list order
                exc = t.exception() if t in done else None
                if exc is not None:
                    raise exc
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    return await until_disconnected(request, gather())


def logprob(x: float) -> float:
    """A JSON-safe logprob: ``-inf`` becomes -9999.0 (as vLLM does), NaN too."""
    if math.isnan(x) or x == -math.inf:
        return -9999.0
    return x


def stop_reason(final: p.GenerateFinal, stop_token_ids: Iterable[int] | None) -> str | int | None:
    """The stop string, or the token of ``stop_token_ids``, that ended ``final``; None when
    something else did (the length, a grammar's end, a stop token not listed). vLLM's
    ``stop_reason`` lists the request's ``stop_token_ids``; SGLang's ``matched`` the
    end-of-sequence tokens too."""
    if final.matched_stop is not None:
        return final.matched_stop
    last = final.token_ids[-1] if final.token_ids else None
    if final.finish_reason == "stop" and last is not None and last in set(stop_token_ids or ()):
        return last
    return None
