"""Benchmark scripts imported by the tests that check them (``benchmarks/`` is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(relative: str, name: str) -> ModuleType:
    """``benchmarks/<relative>`` as module ``name`` (registered in ``sys.modules`` first, so
    that its dataclasses can find their module)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
