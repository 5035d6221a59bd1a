"""radixserve: a prefix-caching LLM serving engine."""

from __future__ import annotations

__version__ = "0.1.0"
