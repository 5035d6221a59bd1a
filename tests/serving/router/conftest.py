"""Fixtures of the router's unit tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest


@pytest.fixture
def worker_proc() -> Iterator[subprocess.Popen[bytes]]:
    """A running process for worker 0 (a worker given up is waited for while it runs)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    yield proc
    proc.kill()
    proc.wait()
