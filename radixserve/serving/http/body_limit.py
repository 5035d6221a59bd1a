"""ASGI middleware that bounds a request body and checks its text before any handler runs.

* The body may not exceed ``max_request_bytes``: a ``Content-Length`` above it is refused
  (413) without a byte of the body being kept; a chunked body is counted as it arrives and
  refused (413) as soon as it passes the limit. Nothing is parsed or tokenized first.
* A JSON body whose text holds a lone surrogate (``"\\udc80"``: valid JSON, but not
  Unicode, so no tokenizer or encoder can take it) is a 400 naming the field.

The buffered body is replayed to the application unchanged, as one message.

Before a 413 goes out, the rest of the body is read and dropped (at most ``DRAIN_BYTES``,
for at most ``DRAIN_S``, stopping after ``DRAIN_IDLE_S`` without data), as a web server's
"lingering close" does: a client that writes its whole body before reading (most HTTP
clients) then reads the 413 instead of a connection reset, since the server closes the
connection after it. Dropped bytes are never buffered or parsed. A client that asked
``Expect: 100-continue`` (curl, for large bodies) has sent no body yet: it gets the 413 at
once.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.serving.http.errors import APIError
from radixserve.serving.wire.limits import RequestLimits, surrogate_path

DRAIN_BYTES = 64 << 20
DRAIN_S = 10.0
DRAIN_IDLE_S = 1.0

# A JSON \u escape of a surrogate code point (D800-DFFF); only then is a second parse needed.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB89a-fA-F][0-9a-fA-F]{2}")


async def _send_error(send: Send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive) -> None:
    """Read and drop what is left of a refused body (bounded: see the module doc)."""
    left, deadline = DRAIN_BYTES, time.monotonic() + DRAIN_S
    while left > 0:
        wait = min(DRAIN_IDLE_S, deadline - time.monotonic())
        if wait <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), timeout=wait)
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        left -= len(message.get("body", b""))


async def _refuse(
    scope: Scope, receive: Receive, send: Send, err: APIError, *, body_pending: bool
) -> None:
    """Answer ``err`` (413), after dropping the body still on its way (module doc)."""
    expects_continue = any(
        k == b"expect" and v.lower() == b"100-continue" for k, v in scope.get("headers", [])
    )
    if body_pending and not expects_continue:
        await _drain(receive)
    await _send_error(send, err)


def too_large(message: str) -> APIError:
    """A 413 in OpenAI's error shape."""
    return APIError(413, message, code="request_too_large")


class BodyLimit:
    """Pure ASGI middleware enforcing :class:`RequestLimits` on request bodies (module doc)."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if declared is not None and declared.isdigit():
            bad = self.limits.request_bytes_error(int(declared))
            if bad is not None:
                await _refuse(scope, receive, send, too_large(bad), body_pending=True)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            bad = self.limits.request_bytes_error(size)
            if bad is not None:
                await _refuse(
                    scope,
                    receive,
                    send,
                    too_large(f"{bad} (the body was refused before it was complete)"),
                    body_pending=bool(message.get("more_body", False)),
                )
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if _SURROGATE_ESCAPE.search(body):
            try:
                where = surrogate_path(json.loads(body))
            except ValueError:
                where = None  # not JSON: the handler's own parse reports it
            if where is not None:
                await _send_error(
                    send,
                    APIError(
                        400,
                        f"{where}: not valid Unicode (a lone surrogate such as \\udc80)",
                        param=where,
                        code="invalid_unicode",
                    ),
                )
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only the client going away can come

        await self.app(scope, replay, send)
