"""Server-sent events: ``data: <json>\\n\\n`` lines ending with ``data: [DONE]``.

Both APIs stream this way (OpenAI with increments, SGLang's ``/generate`` with cumulative
text). :class:`SSEResponse` closes its event generator on every exit path (done, error,
client gone): closing it closes the router stream inside, which aborts the request and
frees its KV in the worker.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Send

from radixserve.serving.http.errors import APIError

log = logging.getLogger("radixserve.serving.http")

DONE = b"data: [DONE]\n\n"
_json = msgspec.json.Encoder()  # compact, UTF-8 as is (json.dumps with ensure_ascii=False), faster


def event(payload: Any) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON."""
    return b"data: " + _json.encode(payload) + b"\n\n"


async def guard(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass ``events`` through; an error after the stream started becomes an error event
    (the status line is already sent), then ``[DONE]``."""
    try:
        async for chunk in events:
            yield chunk
    except APIError as exc:
        yield event(exc.body())
        yield DONE
    except Exception as exc:  # noqa: BLE001 -- a bug must still end the stream cleanly
        log.exception("stream failed")
        yield event(APIError(500, f"internal error: {exc}", type="internal_error").body())
        yield DONE
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def warm_streaming() -> None:
    """Run once, before the first request, what a first streamed response would do for the
    first time: anyio (under Starlette's StreamingResponse: a task group, memory streams)
    imports its stream and socket modules on first use, ~5 ms of the first request's time to
    first token otherwise (``PYTHONPROFILEIMPORTTIME`` during a first request)."""
    async with anyio.create_task_group():
        pass
    send, receive = anyio.create_memory_object_stream[bytes](1)
    send.close()
    receive.close()


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response whose generator is always closed, even when the
    client disconnects mid-stream (Starlette then cancels the send loop)."""

    def __init__(self, events: AsyncIterator[bytes], status_code: int = 200) -> None:
        super().__init__(
            guard(events),
            status_code=status_code,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
