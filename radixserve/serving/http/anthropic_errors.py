"""Errors of ``/v1/messages`` in Anthropic's shape: ``{"type": "error", "error": {"type",
"message"}}``.

Every other route answers errors in OpenAI's shape (:mod:`.errors`), and some of them are
answered before any handler runs (a 401 from the key check, a 413 from the body limit, a
400 from request validation). This pure ASGI middleware rewrites an error response of the
Messages routes, whoever wrote it, so an Anthropic client always reads its own shape; the
status stays.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PATH = "/v1/messages"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicErrors:
    """Rewrites JSON error responses of :data:`PATH` routes into Anthropic's shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == PATH or path.startswith(PATH + "/")):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def rewrite(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is complete
                return
            if start is None:
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            new = _convert(start["status"], body)
            headers = [
                (k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"
            ]
            headers.append((b"content-length", str(len(new)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new})

        await self.app(scope, receive, rewrite)


def _convert(status: int, body: bytes) -> bytes:
    try:
        err = json.loads(body).get("error")
        message = err.get("message") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        message = None
    return json.dumps(error_body(status, message or body.decode("utf-8", "replace"))).encode()
