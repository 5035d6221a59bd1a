"""Stored responses of ``/v1/responses``: what ``previous_response_id`` continues from.

A response is kept (unless the request said ``store: false``) as the conversation it ends:
the input items of every turn so far and its own output items, in the Responses API's
item shape, so that the next request sends only its new items and the gateway renders the
whole conversation again (the same turns, so the same prompt prefix the cache holds).
Instructions are not kept: as in OpenAI's API, each request's ``instructions`` apply to
that request only.

Bounded: at most ``max_entries`` responses and ``max_chars`` characters of items (a
conversation's items count in each of its responses: a chain of N turns holds N growing
copies, so the character bound is what limits it), least recently used dropped first, and
each one for ``ttl_s`` seconds after it was last used. Per tenant: entries are keyed by
the tenant (a digest of the request's API key), so one key never reads or continues
another's responses, and a response id alone names nothing.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

DEFAULT_MAX_ENTRIES = 4096
DEFAULT_MAX_CHARS = 256 << 20  # 256 Mi characters of items, all tenants together
DEFAULT_TTL_S = 3600.0


def tenant_of(api_key: str | None) -> str:
    """The store's tenant of a request: a digest of its API key ("" without keys)."""
    if api_key is None:
        return ""
    return hashlib.sha256(
        b"radixserve responses\0" + api_key.encode("utf-8", "surrogatepass")
    ).hexdigest()


class Stored(NamedTuple):
    """One stored response: the conversation's items through its output, the session key
    its turns share (the first response's id unless the client named one), and the
    Response object as it was answered (what ``GET /v1/responses/{id}`` gives back)."""

    items: list[dict[str, Any]]
    session: str
    chars: int
    expires: float
    response: dict[str, Any] | None = None


class ResponseStore:
    """An LRU map ``(tenant, response id) -> Stored`` with count, size and age bounds."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_chars: int = DEFAULT_MAX_CHARS,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        tenant: str,
        response_id: str,
        items: list[dict[str, Any]],
        session: str,
        response: dict[str, Any] | None = None,
    ) -> bool:
        """Keep a response; ``False`` when it alone is over the size bound (not kept)."""
        chars = len(json.dumps(items)) + (len(json.dumps(response)) if response else 0)
        if chars > self.max_chars or self.max_entries <= 0:
            return False
        key = (tenant, response_id)
        self._drop(key)
        self._entries[key] = Stored(items, session, chars, self.clock() + self.ttl_s, response)
        self.chars += chars
        self._expire()
        while len(self._entries) > self.max_entries or self.chars > self.max_chars:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, tenant: str, response_id: str) -> Stored | None:
        """The tenant's stored response, or ``None`` (never stored, evicted, expired, or
        another tenant's). A hit renews its age and recency."""
        self._expire()
        key = (tenant, response_id)
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry = entry._replace(expires=self.clock() + self.ttl_s)
        self._entries[key] = entry
        self._entries.move_to_end(key)
        return entry

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget the tenant's response; ``False`` when it holds none by that id."""
        return self._drop((tenant, response_id))

    def _drop(self, key: tuple[str, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.chars -= entry.chars
        return True

    def _expire(self) -> None:
        # Entries are in recency order and each use renews the age: the oldest expire first.
        now = self.clock()
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires > now:
                return
            self._drop(key)
