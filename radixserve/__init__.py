"""radixserve: a prefix-caching LLM serving engine."""

from __future__ import annotations

import os

# With few cores, OpenMP threads spin-waiting between ops steal time from each other and make
# CPU timings swing wildly (up to 10x under contention, measured), so idle threads sleep
# (PASSIVE); but only after spinning ~1 ms (GOMP_SPINCOUNT, libgomp's unit: ~100k spins per
# ms): a forward wakes the threads a few hundred times, and sleeping at once made every
# wake-up a futex round trip (a 4-sequence decode step 55 -> 47 ms; through HTTP at c=4
# 68.7 -> 79.3 output tok/s, run `spin` in the README). The OpenMP runtime reads these once,
# when torch first loads it, so they are set here, before any radixserve module can import
# torch; values the user set win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ["OMP_WAIT_POLICY"].upper() == "PASSIVE":
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

__version__ = "0.1.0"
