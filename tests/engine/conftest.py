"""Engine test fixtures (helpers live in ``tests/engine_helpers.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import tiny_models

from radixserve.engine.engine import Engine


@pytest.fixture
def make_engine() -> Callable[..., Engine]:
    def make(model_dir: Path, **kw: object) -> Engine:
        kw.setdefault("num_pages", 512)
        kw.setdefault("page_size", 4)
        return Engine(str(model_dir), **kw)

    return make


@pytest.fixture(scope="module")
def llamas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints of one tiny Llama architecture (what a weight update swaps)."""
    return tuple(  # type: ignore[return-value]
        tiny_models.build_tiny_llama(tmp_path_factory.mktemp(f"llama{seed}"), seed=seed)
        for seed in (21, 22)
    )
