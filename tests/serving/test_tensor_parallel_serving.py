"""Tensor-parallel workers behind the router: a TP 2 worker serves the same greedy tokens as
the in-process engine, a killed rank takes its worker down (the router reports it dead, no
process is left), and a two-"node" launch (node-rank 0 and 1 over 127.0.0.1, one rank each)
serves a request."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from two_nodes import node_one

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ENGINE = dict(num_pages=128, page_size=4, max_num_tokens=64, max_running_requests=8)
PROMPT = "The quick brown fox jumps over the lazy dog. Prefix caching"
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ROUTER = dict(
    endpoint="tcp://127.0.0.1:*",
    heartbeat_interval_s=0.1,
    client_probe_interval_s=0.1,
    tokenizer_workers=1,
    restart_workers=False,
)


def child_processes(pid: int, marker: bytes) -> list[int]:
    """``pid``'s children whose command line contains ``marker``."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []
    out = []
    for c in children:
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if marker in f.read():
                    out.append(c)
        except FileNotFoundError:
            pass
    return out


def _rank_processes(pid: int) -> list[int]:
    """The spawned rank processes among ``pid``'s children (not multiprocessing's resource
    tracker)."""
    return child_processes(pid, b"spawn_main")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait(cond, timeout: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _expected(path: Path) -> list[int]:
    from radixserve.engine.engine import Engine

    engine = Engine(path, **ENGINE)
    return engine.generate([PROMPT], PARAMS)[0].token_ids


def test_tp2_worker_serves_then_a_killed_rank_takes_it_down(tiny_llama_dir: Path) -> None:
    expected = _expected(tiny_llama_dir)
    cfg = RouterConfig(**ROUTER)
    engine = {**ENGINE, "tensor_parallel_size": 2}
    with LocalServer(tiny_llama_dir, num_workers=1, config=cfg, engine_config=engine) as srv:
        with Client(srv.endpoint, timeout=60) as c:
            assert c.generate(PROMPT, params=PARAMS).token_ids == expected
            worker = srv.procs[0].pid
            ranks = _rank_processes(worker)
            assert len(ranks) == 1  # rank 1 (rank 0 is the worker itself)
            os.kill(ranks[0], signal.SIGKILL)
            # Idle: the worker's health check notices within a second, says why, and exits.
            assert _wait(lambda: c.stats().workers[0].death is not None, 20)
            assert c.health().workers_alive == 0
            death = c.stats().workers[0].death or ""
            assert "rank 1" in death and "exited with code -9" in death, death
        assert _wait(lambda: not _alive(worker), 10)
        assert not _alive(ranks[0])


def test_two_node_launch_serves_a_request(tiny_llama_dir: Path) -> None:
    expected = _expected(tiny_llama_dir)
    with node_one(tiny_llama_dir, "--num-threads", "1", "--page-size", "4") as (addr, node1):
        dist = dict(tensor_parallel_size=2, nnodes=2, dist_init_addr=addr)
        cfg = RouterConfig(**ROUTER)
        engine = {**ENGINE, **dist, "node_rank": 0, "num_threads": 1}
        with LocalServer(tiny_llama_dir, num_workers=1, config=cfg, engine_config=engine) as srv:
            assert _rank_processes(srv.procs[0].pid) == []  # node 0 has one rank: the worker itself
            with Client(srv.endpoint, timeout=60) as c:
                assert c.generate(PROMPT, params=PARAMS).token_ids == expected
        # The worker's shutdown message ends node 1's rank loop.
        assert node1.wait(timeout=30) == 0
