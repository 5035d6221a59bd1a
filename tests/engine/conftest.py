"""Engine test fixtures (helpers live in ``tests/engine_helpers.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.engine.engine import Engine


@pytest.fixture
def make_engine() -> Callable[..., Engine]:
    def make(model_dir: Path, **kw: object) -> Engine:
        kw.setdefault("num_pages", 512)
        kw.setdefault("page_size", 4)
        return Engine(str(model_dir), **kw)

    return make
