"""Errors in OpenAI's shape, for every HTTP endpoint of the gateway.

OpenAI answers a failed request with ``{"error": {"message", "type", "param", "code"}}``
and a 4xx/5xx status; SGLang's native server uses the same ``{"error": {"message"}}``
envelope, so one shape serves both APIs. Status codes:

=====  =============================================================================
400    invalid parameter values, missing fields, wrong types, prompt too long
       (``code="context_length_exceeded"``), a body that is not JSON (``code="json_invalid"``),
       text that is not Unicode (``code="invalid_unicode"``, ``param`` names the field), a
       batch over ``--max-batch-size`` (``code="batch_too_large"``)
404    unknown model (``code="model_not_found"``), unknown route
413    a body over ``--max-request-bytes`` (``code="request_too_large"``), refused unread
500    a worker failed the request / a bug (still in this shape: clients parse it)
503    no live worker, the server is shutting down, the worker died
504    the router did not answer in time
=====  =============================================================================
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.serving.client import ServerError

_UNION_TAG = re.compile(r"^([A-Z]\w*|\w+\[.*\]|str|int|float|bool)$")

# Router error code -> (HTTP status, OpenAI error type, OpenAI code).
_ROUTER_ERRORS: dict[str, tuple[int, str, str | None]] = {
    "invalid_params": (400, "invalid_request_error", None),
    "invalid_message": (400, "invalid_request_error", None),
    "malformed": (400, "invalid_request_error", None),
    "context_length": (400, "invalid_request_error", "context_length_exceeded"),
    "request_too_large": (413, "invalid_request_error", "request_too_large"),
    "duplicate_request": (400, "invalid_request_error", "duplicate_request"),
    "forbidden": (403, "permission_error", "forbidden"),
    "no_workers": (503, "service_unavailable", "no_workers"),
    "worker_died": (503, "service_unavailable", "worker_died"),
    "shutdown": (503, "service_unavailable", "shutdown"),
    "overloaded": (503, "service_unavailable", "overloaded"),
    "timeout": (504, "timeout", "timeout"),
    "internal": (500, "internal_error", None),
}


class APIError(Exception):
    """An HTTP error answered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def fan_out_status(ok: bool, code: str | None) -> int:
    """The HTTP status of an operation every worker was asked to do (a weight update, a
    pause): 200 when all did, 503 when none could be asked, else 400 (a worker refused)."""
    return 200 if ok else 503 if code == "unavailable" else 400


def invalid(message: str, param: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param)


def from_server_error(exc: ServerError) -> APIError:
    """Map a router :class:`~radixserve.serving.client.ServerError` to an HTTP error."""
    status, type_, code = _ROUTER_ERRORS.get(exc.code, (500, "internal_error", None))
    return APIError(status, exc.message, type=type_, code=code or exc.code)


def from_timeout(exc: BaseException) -> APIError:
    return APIError(
        504, f"the router did not answer in time: {exc}", type="timeout", code="timeout"
    )


def _loc(loc: tuple[Any, ...]) -> str:
    # FastAPI prefixes body fields with "body"; OpenAI names the parameter alone. Pydantic
    # adds the union member tried ("SGLSamplingParams", "list[int]"): not a parameter name.
    parts = [str(x) for x in loc if x != "body" and not _UNION_TAG.match(str(x))]
    return ".".join(parts) if parts else "body"


def _messages(errors: Sequence[Any]) -> list[Any]:
    """The errors worth showing: when a union value failed on one member for a real reason
    and on the others only for being of another type, the type mismatches are noise."""
    real = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    return real or list(errors)


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return APIError(
            400,
            "the request body is not valid JSON: " + "; ".join(str(e.get("msg")) for e in errors),
            code="json_invalid",
        ).response()
    errors = _messages(errors)
    first = errors[0] if errors else {}
    message = "; ".join(f"{_loc(tuple(e.get('loc', ())))}: {e.get('msg')}" for e in errors[:8])
    return APIError(
        400,
        message or "invalid request",
        param=_loc(tuple(first.get("loc", ()))) if first else None,
        code="invalid_value",
    ).response()


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type=type_).response()


def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette logs the traceback after this response is sent.
    return APIError(500, f"internal error: {type(exc).__name__}", type="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error of ``app`` answer in OpenAI's error shape."""
    app.add_exception_handler(Exception, _unexpected)
    # The ignores below: starlette's stub types a handler as taking any Exception, though it
    # calls each one only with the class it is registered for.
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
