"""Per-program token accounting: what a program sent and how much of it the radix cache reused."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import msgspec

from frontend_dsl.backend import CallUsage

__all__ = ["ProgramUsage", "UsageMeter", "total_usage"]


class ProgramUsage(msgspec.Struct, frozen=True):
    """Totals over every backend call of a program run (its forks included).

    ``prompt_tokens`` are the tokens sent (``tokens_sent``), ``cached_tokens`` those the
    engine found in its radix cache instead of computing (``tokens_reused``).
    """

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def tokens_sent(self) -> int:
        return self.prompt_tokens

    @property
    def tokens_reused(self) -> int:
        return self.cached_tokens

    @property
    def hit_rate(self) -> float:
        """Fraction of the prompt tokens served from the cache (0 when nothing was sent)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def __add__(self, other: ProgramUsage) -> ProgramUsage:
        return ProgramUsage(
            self.calls + other.calls,
            self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens,
            self.completion_tokens + other.completion_tokens,
        )


class UsageMeter:
    """A thread-safe accumulator shared by a program's state and its forks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage = ProgramUsage()

    def add(self, usage: CallUsage, calls: int = 1) -> None:
        with self._lock:
            self._usage = self._usage + ProgramUsage(
                calls, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
            )

    def snapshot(self) -> ProgramUsage:
        with self._lock:
            return self._usage


def total_usage(usages: Iterable[ProgramUsage]) -> ProgramUsage:
    """Sum of many programs' usage (e.g. over ``run_batch`` states)."""
    total = ProgramUsage()
    for u in usages:
        total = total + u
    return total
