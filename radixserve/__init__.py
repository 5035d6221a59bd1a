"""radixserve: a prefix-caching LLM serving engine."""

from __future__ import annotations

import os

# OpenMP threads wait for the next parallel region by spinning a bounded while (GOMP_SPINCOUNT
# iterations: a few ms here), then sleep. The back-to-back ops of a forward pass then skip a
# futex wake-up each (SmolLM2 decode steps at batch 16 ran ~1.3x faster than with
# OMP_WAIT_POLICY=PASSIVE on the 2-core machine), and an idle engine still stops burning a
# core. Unbounded spinning (ACTIVE) made timings swing up to 10x when several processes
# shared the cores; such setups should set OMP_WAIT_POLICY=PASSIVE (the test suite does).
# The OpenMP runtime reads these once, when torch loads it, so they are set here, before any
# radixserve module imports torch; values the user set win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

__version__ = "0.1.0"
