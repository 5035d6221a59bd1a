"""Counted memory: the peak of bytes a call allocates on the CPU and has not yet freed.

torch's profiler records every allocation and free of its CPU allocator (``profile_memory``),
the ones inside ATen's kernels and the C++ extensions included; summing them in time order
gives the call's transient peak, a count that does not depend on the machine's load (unlike
RSS, which the allocator's caching and other processes blur)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn: Callable[[], Any]) -> int:
    """The most bytes ``fn()`` held allocated at once (over what was allocated before it)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak
