"""Byte sizes in words and back: :func:`format_bytes` for what the planner, the memory
report and the logs print, :func:`parse_bytes` for what size flags take
(``--memory-budget 24GiB``). Plain arithmetic: no torch here.
"""

from __future__ import annotations

import math

GiB = 1 << 30
MiB = 1 << 20


def format_bytes(n: float) -> str:
    """Binary units, e.g. ``2.00 GiB``, ``512.0 KiB``, ``278,528 B``."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n):,} B"


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"80 GB"``, ``"512MiB"``, ``"1e9"`` -> bytes (GB = 10^9, GiB = 2^30)."""
    s = text.strip().replace(" ", "").replace("_", "")
    units = {
        "tib": 1 << 40, "gib": GiB, "mib": MiB, "kib": 1024,
        "tb": 10**12, "gb": 10**9, "mb": 10**6, "kb": 10**3,
        "t": 1 << 40, "g": GiB, "m": MiB, "k": 1024, "b": 1,
    }  # fmt: skip
    lower = s.lower()
    number, mult = lower, 1  # a bare number counts bytes
    for unit, unit_mult in units.items():
        if lower.endswith(unit):
            number, mult = lower[: -len(unit)], unit_mult
            break
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 24GiB, 80GB, 512MiB)") from None
    if value < 0 or not math.isfinite(value):
        raise ValueError(f"size must be a non-negative number, got {text!r}")
    return int(value * mult)
