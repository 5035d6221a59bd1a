"""A leased session across two real engine workers: the router sends its next turn to the
worker that holds its lease, and that worker still has the turn's KV after unkeyed traffic
passed more than twice its pool through both workers; closing the session releases it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PAGE = 4
ENGINE = dict(
    num_pages=48, page_size=PAGE, max_num_tokens=256, max_running_requests=8, num_threads=1
)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def test_leased_session_returns_to_its_worker_with_its_kv(tiny_llama_dir: Path) -> None:
    rng = random.Random(7)
    cfg = RouterConfig(
        endpoint="tcp://127.0.0.1:*", heartbeat_interval_s=0.2, client_probe_interval_s=0.2
    )
    with LocalServer(tiny_llama_dir, num_workers=2, config=cfg, engine_config=ENGINE) as srv:
        with Client(srv.endpoint, timeout=60) as c:
            first = _ids(rng, 64)
            t1 = c.generate(input_ids=first, params=GREEDY, session_id="agent-7")
            home = t1.worker_id
            churn = [_ids(rng, 56) for _ in range(14)]  # 784 tokens: > 2 x 192 per worker
            seen = {c.generate(input_ids=p, params=GREEDY).worker_id for p in churn}
            assert seen == {0, 1}  # the churn went through both workers
            history = first + t1.token_ids + _ids(rng, 12)  # + the tool's result
            t2 = c.generate(input_ids=history, params=GREEDY, session_id="agent-7")
            assert t2.worker_id == home  # the session follows its lease
            assert t2.usage.cached_tokens == (len(first) + len(t1.token_ids) - 1) // PAGE * PAGE
            # The worker granted the lease before it sent the final output; stats come after.
            eng = c.stats().workers[home].engine
            assert eng["leases_granted_total"] == 2
            assert eng["lease_hits_total"] == 1 and eng["leases_active"] == 1
            assert eng["leased_pages"] == (len(history) + 8 - 1) // PAGE
            assert eng["evicted_pages_total"] > 0
            assert eng["invariants"] == "ok"
            # Closed from the API: the worker that held it releases the lease, and the router
            # forgets where the session ran; a second close finds nothing to release.
            assert c.close_session("agent-7") is True
            assert c.close_session("agent-7") is False
            eng = c.stats().workers[home].engine
            assert eng["leases_active"] == 0 and eng["leased_pages"] == 0
    assert all(proc.poll() is not None for proc in srv.procs)
