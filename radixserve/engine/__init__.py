"""The offline engine (``Engine``), its config, outputs and incremental detokenizer.

Importing this package stays light (``outputs`` and ``detokenizer`` are torch-free);
``from radixserve.engine import Engine`` loads the model stack on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from radixserve.engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'radixserve.engine' has no attribute {name!r}")
