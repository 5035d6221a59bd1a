"""The local server's start-up order: its workers start before the router's tokenizer loads
(their start-ups overlap), and a tokenizer that fails to load leaves nothing behind."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig

pytestmark = pytest.mark.timeout(60)

FAKE_WORKER = [sys.executable, str(Path(__file__).resolve().parents[1] / "fake_worker.py")]
FAST = {"endpoint": "tcp://127.0.0.1:*", "heartbeat_interval_s": 0.1, "tokenizer_workers": 1}


def _worker_pids() -> list[int]:
    """This process's fake worker children."""
    return [c.pid for c in psutil.Process().children() if "fake_worker.py" in " ".join(c.cmdline())]


def _new_worker_pids(before: set[int]) -> list[int]:
    """The fake worker children started since ``before`` was taken: an earlier test's may
    still be on their way out (stopped, not yet reaped) when the suite runs them together."""
    return [pid for pid in _worker_pids() if pid not in before]


def test_workers_start_before_the_tokenizer_loads(
    tokenizer_dir: Path, tokenizer: Any, alphabet: list[int]
) -> None:
    seen: list[int] = []
    before = set(_worker_pids())

    def load() -> Any:
        seen.extend(_new_worker_pids(before))  # within LocalServer(): the workers already run
        return tokenizer

    srv = LocalServer(
        tokenizer_dir,
        num_workers=2,
        config=RouterConfig(**FAST),
        engine_config={"alphabet": alphabet, "vocab_size": len(tokenizer)},
        worker_program=FAKE_WORKER,
        load_tokenizer=load,
    )
    try:
        assert sorted(seen) == sorted(p.pid for p in srv.procs) and len(seen) == 2
        srv.start(timeout_s=30)
        assert len(srv.router.live_workers) == 2
    finally:
        srv.close()
    assert all(p.poll() is not None for p in srv.procs)


def test_a_tokenizer_that_fails_to_load_leaves_no_worker_and_no_socket(
    tokenizer_dir: Path, alphabet: list[int]
) -> None:
    started: list[int] = []
    before = set(_worker_pids())

    def load() -> Any:
        started.extend(_new_worker_pids(before))
        raise OSError("no tokenizer here")

    ctx = zmq.Context()
    try:
        with pytest.raises(OSError, match="no tokenizer here"):
            LocalServer(
                tokenizer_dir,
                num_workers=1,
                config=RouterConfig(**FAST),
                engine_config={"alphabet": alphabet, "vocab_size": 512},
                worker_program=FAKE_WORKER,
                load_tokenizer=load,
                context=ctx,
            )
    finally:
        ctx.term()  # returns (no socket of the router left open), else the timeout fails it
    assert len(started) == 1 and not psutil.pid_exists(started[0])  # killed and reaped
