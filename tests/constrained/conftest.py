"""Constrained-decoding fixtures: a tiny-Llama engine shared by a module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from constrained_cases import make_tiny_engine

from radixserve.engine.engine import Engine


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    e = make_tiny_engine(tiny_llama_dir)
    yield e
    assert not e.has_unfinished()
    e.check_invariants()
