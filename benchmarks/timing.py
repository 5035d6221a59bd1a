"""Timing a method in place: the step-breakdown benchmarks' one instrument.

``time_calls(obj, "forward", "linear layers", acc)`` replaces ``obj.forward`` (an instance's
or a class's attribute) by a wrapper that adds each call's duration to ``acc["linear
layers"]``; ``clock`` picks wall time (default) or e.g. ``time.thread_time`` (this thread's
CPU time, which a loaded machine disturbs far less). ``median_seconds(fn, reps)``: the
median wall time of ``reps`` calls after one warm-up call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, MutableMapping
from typing import Any


def time_calls(
    obj: Any,
    name: str,
    key: str,
    acc: MutableMapping[str, float],
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Wrap ``obj.name`` so that the time of every call accumulates in ``acc[key]``."""
    fn: Callable[..., Any] = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] = acc.get(key, 0.0) + clock() - t

    setattr(obj, name, timed)


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall seconds of ``reps`` calls of ``fn``, after one warm-up call."""
    fn()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)
