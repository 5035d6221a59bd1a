"""A pipeline-parallel worker behind the router: PP 2 serves the in-process engine's greedy
tokens, and a killed stage takes its worker down (the router reports it dead, no rank left)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

# The tensor-parallel serving test's settings and helpers (same worker shape, same checks).
from test_tensor_parallel_serving import (
    ENGINE,
    PARAMS,
    PROMPT,
    ROUTER,
    _alive,
    _wait,
    child_processes,
)

from radixserve.serving.client import Client
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _stage_processes(pid: int) -> list[int]:
    """``pid``'s children that are pipeline ranks."""
    return child_processes(pid, b"radixserve.distributed.pipeline.launch")


def test_pp2_worker_serves_then_a_killed_stage_takes_it_down(tiny_llama_dir: Path) -> None:
    from radixserve.engine.engine import Engine

    expected = Engine(tiny_llama_dir, **ENGINE).generate([PROMPT], PARAMS)[0].token_ids
    engine = {**ENGINE, "pipeline_parallel_size": 2}
    with LocalServer(
        tiny_llama_dir, num_workers=1, config=RouterConfig(**ROUTER), engine_config=engine
    ) as srv:
        with Client(srv.endpoint, timeout=60) as c:
            assert c.generate(PROMPT, params=PARAMS).token_ids == expected
            assert c.generate(PROMPT, params=PARAMS).token_ids == expected  # cache warm
            worker = srv.procs[0].pid
            ranks = _stage_processes(worker)
            assert len(ranks) == 1  # stage 1 (stage 0 is the worker itself)
            os.kill(ranks[0], signal.SIGKILL)
            # Idle: the worker's health check notices, says why, and exits.
            assert _wait(lambda: c.stats().workers[0].death is not None, 20)
            assert c.health().workers_alive == 0
            death = c.stats().workers[0].death or ""
            assert "pipeline rank 1" in death and "exited with code -9" in death, death
        assert _wait(lambda: not _alive(worker), 10)
        assert not _alive(ranks[0])
