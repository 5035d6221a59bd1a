"""A decode worker's side of disaggregation (serving/worker/disagg.py) on a real decode engine:
a reservation answered with a ticket holds pages; an admit that comes after its lease ran
out fails the request (an error output the router forwards) instead of leaving it hanging,
and every page is back."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
from engine_helpers import greedy, random_prompts

from radixserve.serving.wire import protocol as p

pytest.importorskip("mooncake.engine", reason="Mooncake wheel (and libibverbs1) not importable")


def test_an_admit_after_the_lease_fails_the_request(tiny_llama_dir: Path) -> None:
    from radixserve.distributed.disagg.roles import DecodeRole, PrefillResult
    from radixserve.engine.engine import Engine
    from radixserve.serving.worker.disagg import DisaggLink

    engine = Engine(str(tiny_llama_dir), page_size=4, num_pages=64, disaggregation_mode="decode")
    try:
        sent: list[msgspec.Struct] = []
        active: set[str] = set()
        link = DisaggLink.of(engine, sent.append, active)
        assert link is not None and link.mode == "decode"
        (prompt,) = random_prompts([9], seed=3)
        req = p.WorkerRequest(rid="r1", input_ids=prompt, params=greedy(3))
        link.handle(p.WorkerReserve(request=req, timeout_s=1.0))
        (reserved,) = sent
        assert isinstance(reserved, p.WorkerReserved) and reserved.ticket is not None
        assert engine.stats().pages_in_use == 3  # 9 tokens: 3 pages held for the KV
        role = engine.disagg
        assert isinstance(role, DecodeRole)
        assert role.expire(time.time() + 60) == ["r1"]  # the lease is over: pages back
        link.handle(p.WorkerAdmit(rid="r1", result=p.encode(PrefillResult("r1", 7, 0))))
        failed = sent[-1]
        assert isinstance(failed, p.WorkerOutputs)
        (out,) = failed.outputs
        assert out.request_id == "r1" and out.finished and out.finish_reason == "error"
        assert "r1" not in active and engine.stats().pages_in_use == 0
        engine.check_invariants()
    finally:
        engine.close()
