"""Where an engine's start-up time goes (printed by each worker and by ``radixserve serve``)."""

from __future__ import annotations

import time

__all__ = ["StartupClock", "describe_startup"]


class StartupClock:
    """Seconds spent in each named phase of the engine's start-up."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._t
        self._t = now


def describe_startup(laps: dict[str, float]) -> str:
    """``"4.1 s: load weights 2.0 s, tokenizer 0.3 s, ..."`` (phases of 50 ms or more)."""
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in laps.items() if v >= 0.05)
    return f"{sum(laps.values()):.1f} s" + (f": {parts}" if parts else "")
