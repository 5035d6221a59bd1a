"""The drafter interface."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any, Protocol

__all__ = ["ALGORITHMS", "DraftSource", "Drafter"]

ALGORITHMS = ("ngram", "radix", "draft")  # --speculative-algorithm; predictions need none


class DraftSource(Protocol):
    """What a drafter reads of a request (implemented by the scheduler's ``Request``)."""

    request_id: str
    token_ids: list[int]  # prompt + output so far (every token known: no placeholder)
    prompt_len: int
    namespace: str | None

    @property
    def prediction(self) -> list[int] | None:
        """The output the client expects (OpenAI's predicted outputs), as token ids."""


class Drafter(abc.ABC):
    """Proposes the tokens most likely to follow a request's context.

    The scheduler calls :meth:`propose` for each decoding request it lets draft,
    :meth:`prompt_cached` once a request's prompt has been computed (and so inserted into the
    radix cache), and :meth:`finished` when the request leaves (every path: stop, length,
    abort, error), after which the drafter keeps no state of it."""

    name: str

    @abc.abstractmethod
    def propose(self, req: DraftSource, k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``req.token_ids`` (maybe none)."""

    def prompt_cached(self, req: DraftSource) -> None:
        """``req``'s prompt is computed and in the cache."""
        return None

    def finished(self, req: DraftSource) -> None:
        """``req`` left; its prompt and output (``token_ids``) went into the cache."""
        return None

    def reset(self) -> None:
        """The cache was flushed (no request running): drop any cached state of the drafter's
        own that mirrors it (the draft model's KV cache)."""
        return None

    def pool_stats(self) -> dict[str, Any]:
        """Gauges of the drafter's own KV pool, as ``EngineStats`` fields (none: no pool)."""
        return {}

    def check_invariants(self, live: Iterable[str]) -> None:
        """Raise ``AssertionError`` if the drafter's own state is inconsistent, or holds
        anything for a request not in ``live`` (the scheduler's requests)."""
        return None
