"""radixserve: a prefix-caching LLM serving engine."""

from __future__ import annotations

import os

# With few cores, OpenMP threads spin-waiting between ops steal time from each other and make
# CPU timings swing wildly (up to 10x under contention, measured). The OpenMP runtime reads
# this once, when torch first loads it, so it is set here, before any radixserve module can
# import torch; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
