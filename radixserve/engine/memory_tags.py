"""The parts of an engine's memory a release gives back, by SGLang's tags
(``release_memory_occupation``): the KV cache and the weights.

Torch-free, so the wire's messages (which carry the tags) and the router import them
without the model stack; the engine's :mod:`~radixserve.engine.memory_occupation` does the
releasing.
"""

from __future__ import annotations

from typing import Literal

MemoryTag = Literal["kv_cache", "weights"]
MEMORY_TAGS: tuple[MemoryTag, ...] = ("kv_cache", "weights")
