"""radixserve: a prefix-caching LLM serving engine.

The public API, as vLLM and SGLang users expect it::

    from radixserve import Engine, SamplingParams
    engine = Engine()  # the default model (SmolLM2-135M-Instruct), or Engine("path/to/model")
    out = engine.generate(["The capital of France is"], {"max_tokens": 16, "temperature": 0})

The names are loaded lazily, so ``import radixserve`` stays light (no torch): clients and
the prompt DSL import it too.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

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

# name -> module that defines it; resolved on first access (PEP 562).
_EXPORTS = {
    "Engine": "radixserve.engine.engine",
    "EngineConfig": "radixserve.engine.config",
    "SamplingParams": "radixserve.sampling_params",
    "GenerateOutput": "radixserve.engine.outputs",
    "StepOutput": "radixserve.engine.outputs",
    "TokenLogprob": "radixserve.engine.outputs",
    "Usage": "radixserve.engine.outputs",
    "EngineStats": "radixserve.engine.outputs",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
