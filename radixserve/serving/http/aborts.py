"""The gateway's requests in flight by the ids their clients know, for SGLang's
``POST /abort_request``.

A client that gave a request an id (``/generate``'s ``rid``; a chat or text completion's
``rid``, or the ``id`` its first streamed chunk showed) may stop it by that id before it
ends, and ``abort_all`` stops every one of its requests: RL rollouts cut short, an agent
whose user cancelled. The request then ends as any abort does: its worker frees its KV,
and its HTTP answer comes back with what it had generated and finish reason ``abort``.

Tenants: a request is filed under its tenant (the digest of the API key it came with;
one tenant without API keys), and an abort reaches only its own tenant's requests, so one
tenant can neither stop nor probe for another's. The ids are the client's own and need not
be unique: an abort stops every request of the tenant under that id.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class AbortScope:
    """Whose a request is (``owner``, see :func:`abort_scope`) and the ids it may be
    aborted by (a ``/generate`` sample's own and its prompt's; a completion's ``id``)."""

    owner: str
    ids: tuple[str, ...]


def abort_owner(api_key: str | None) -> str:
    """The tenant a request is filed under: the SHA-256 of its API key (no key: ``""``)."""
    if api_key is None:
        return ""
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


def abort_scope(api_key: str | None, *ids: str) -> AbortScope:
    """The scope of a request that came with ``api_key`` and is known by ``ids``."""
    return AbortScope(abort_owner(api_key), tuple(dict.fromkeys(ids)))


class InFlightIds:
    """The router request ids in flight, by tenant, with the client ids each answers to."""

    def __init__(self) -> None:
        self._by_owner: dict[str, dict[str, tuple[str, ...]]] = {}

    @contextlib.contextmanager
    def track(self, scope: AbortScope | None, request_id: str) -> Iterator[None]:
        """File router request ``request_id`` under ``scope`` while the block runs (None:
        a request no client id reaches, such as a beam's)."""
        if scope is None:
            yield
            return
        mine = self._by_owner.setdefault(scope.owner, {})
        mine[request_id] = scope.ids
        try:
            yield
        finally:
            del mine[request_id]
            if not mine:
                self._by_owner.pop(scope.owner, None)

    def matching(self, owner: str | None, client_id: str | None) -> list[str]:
        """The router ids of ``owner``'s requests in flight known by ``client_id`` (None:
        all of them; ``owner`` None: every tenant's)."""
        owners = list(self._by_owner.values()) if owner is None else [self._by_owner.get(owner, {})]
        return [
            rid
            for mine in owners
            for rid, ids in mine.items()
            if client_id is None or client_id in ids
        ]
