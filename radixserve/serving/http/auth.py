"""API keys on the HTTP gateway, and the cache salt each request's tenant gets.

With API keys configured (``--api-key``, ``RADIXSERVE_API_KEY``), every request but
``GET /health`` must carry ``Authorization: Bearer <key>``, as the OpenAI clients send
it (or ``x-api-key: <key>``, as the Anthropic clients send it). Admin endpoints
(:data:`ADMIN_PATHS`) take an admin key when admin keys are configured
(``--admin-api-key``), else any API key. A request that fails gets a 401 in OpenAI's
error shape (``code="invalid_api_key"``) with ``WWW-Authenticate: Bearer``.

Keys are compared in constant time: the SHA-256 digest of what was sent against the
digest of every configured key, without stopping at the first match, so neither the time
nor an early exit tells an attacker how much of a key was right or which key matched.

Tenants: the key a request authenticated with names its tenant, and
:func:`tenant_cache_salt` derives the cache salt the router sees from that key and the
client's own ``cache_salt`` (HMAC-SHA256): requests with the same key and the same
client salt share cached prefixes; a client cannot name another tenant's cache, whatever
salt it sends, without that tenant's key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

# Endpoints that reveal or change server-wide state: cache flushes, per-worker stats and
# memory, and Prometheus metrics (their per-worker cache-hit counters are an aggregate view
# of what others' prompts left in the cache; Prometheus sends bearer tokens when scraping).
ADMIN_PATHS: frozenset[str] = frozenset(
    {
        "/flush_cache",
        "/get_server_info",
        "/server_info",
        "/metrics",
        "/cache_report",
        # What every worker serves, read from the workers' disks (http/lora_api.py).
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        # ...and the weights themselves (http/weights_api.py)...
        "/update_weights_from_disk",
        # ...and whether anyone is served at all (http/pause_api.py, http/memory_api.py).
        "/pause_generation",
        "/continue_generation",
        "/pause",
        "/resume",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/sleep",
        "/wake_up",
    }
)
# Liveness probes from load balancers and orchestrators, which carry no credentials.
OPEN_PATHS: frozenset[str] = frozenset({"/health"})
# The ASGI scope key under which the authenticated key is handed to the handlers.
SCOPE_KEY = "radixserve.api_key"
_SALT_CONTEXT = b"radixserve cache salt v1\0"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyRing:
    """A set of keys, checked in constant time."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [(k, _digest(k)) for k in keys if k]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def match(self, candidate: str) -> str | None:
        """The configured key equal to ``candidate``, or ``None`` (every key is compared)."""
        given = _digest(candidate)
        found = None
        for key, digest in self._keys:
            if hmac.compare_digest(given, digest):
                found = key
        return found


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def x_api_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key of an ``x-api-key`` header, as the Anthropic clients send it."""
    for name, value in headers:
        if name.lower() == b"x-api-key":
            return value.decode("latin-1").strip() or None
    return None


def unauthorized_body(message: str) -> dict[str, Any]:
    """OpenAI's 401 body."""
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


class APIKeyAuth:
    """Pure ASGI middleware: the API key check in front of every route.

    ``api_keys``: keys for every endpoint; ``admin_keys``: keys for :data:`ADMIN_PATHS`
    (and, being more privileged, for every other endpoint too). With neither, every request
    passes. The matched key is stored in ``scope[SCOPE_KEY]`` (:func:`request_key`)."""

    def __init__(
        self, app: ASGIApp, api_keys: Iterable[str] = (), admin_keys: Iterable[str] = ()
    ) -> None:
        self.app = app
        self.api_keys = KeyRing(api_keys)
        self.admin_keys = KeyRing(admin_keys)

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys) or bool(self.admin_keys)

    def check(self, path: str, token: str | None) -> tuple[str | None, str | None]:
        """``(matched key, None)`` if ``token`` may call ``path``, else ``(None, why)``;
        ``(None, None)`` when the path needs no key."""
        admin_path = path in ADMIN_PATHS
        if path in OPEN_PATHS:
            return None, None
        if admin_path and self.admin_keys:
            rings, need = [self.admin_keys], "an admin API key"
        elif self.api_keys:
            rings, need = [self.api_keys, self.admin_keys], "an API key"
        else:  # only admin keys are configured and this is not an admin path
            return None, None
        if token is None:
            return None, f"this endpoint needs {need}: send it as 'Authorization: Bearer <key>'"
        matches = [ring.match(token) for ring in rings]  # every ring: no early exit
        key = next((m for m in matches if m is not None), None)
        if key is None:
            return None, f"incorrect API key provided; this endpoint needs {need}"
        return key, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.enabled:
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        key, why = self.check(scope["path"], bearer_token(headers) or x_api_key(headers))
        if why is not None:
            body = json.dumps(unauthorized_body(why)).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", b'Bearer realm="radixserve"'),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        if key is not None:
            scope[SCOPE_KEY] = key
        await self.app(scope, receive, send)


def request_key(scope: Scope) -> str | None:
    """The API key the request authenticated with (``None`` without API keys)."""
    return scope.get(SCOPE_KEY)


def tenant_cache_salt(api_key: str | None, client_salt: str | None) -> str | None:
    """The cache salt the router gets for a request.

    Authenticated: HMAC-SHA256 of the client's salt (empty when none) under the request's
    API key, so every key is a tenant with caches of its own and a client's salt only splits
    its own tenant's cache further. Unauthenticated: the client's salt as given (``None``:
    the shared cache)."""
    if api_key is None:
        return client_salt
    msg = _SALT_CONTEXT + (client_salt or "").encode("utf-8", "surrogatepass")
    return hmac.new(api_key.encode("utf-8", "surrogatepass"), msg, hashlib.sha256).hexdigest()
