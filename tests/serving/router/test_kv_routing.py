"""Routing on the workers' KV events, end to end: ``serve --workers 2`` (a LocalServer) with
``prefix_source="events"`` on a tiny model."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig
from radixserve.serving.wire import protocol as p

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``cond`` (the router's state, read from the test thread) until true."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_events_route_to_the_worker_that_still_holds_the_prefix(tiny_llama_dir: Path) -> None:
    engine = dict(num_pages=32, page_size=4, num_threads=1)  # 128 tokens of KV per worker
    cfg = RouterConfig(endpoint="tcp://127.0.0.1:*", prefix_source="events")
    with (
        LocalServer(tiny_llama_dir, num_workers=2, config=cfg, engine_config=engine) as srv,
        Client(srv.endpoint) as client,
    ):
        router, views = srv.router, srv.router.dispatcher.views
        wait_for(lambda: len(views) == 2 and all(v.synced for v in views.values()), "snapshots")

        def served_by(**kwargs: object) -> tuple[int, p.GenerateFinal]:
            before = {w: h.requests for w, h in router.workers.items()}
            final = client.generate(params=PARAMS, **kwargs)
            (wid,) = [w for w, h in router.workers.items() if h.requests != before[w]]
            return wid, final

        def holds(wid: int, tokens: list[int]) -> int:
            view = views[wid]
            return view.match(view.page_keys(tokens, None)).l1_tokens

        # A session bound to each worker, so that the test can put prefixes where it wants.
        session: dict[int, str] = {}
        for i in range(8):
            wid, _ = served_by(input_ids=[5 + i, 6, 7], session_id=f"s{i}")
            session.setdefault(wid, f"s{i}")
            if len(session) == 2:
                break
        assert len(session) == 2, "every new session went to the same worker"
        a, b = sorted(session)

        prefix = list(range(20, 60))  # 10 pages
        for wid in (a, b):
            assert served_by(input_ids=prefix + [wid], session_id=session[wid])[0] == wid
            wait_for(lambda wid=wid: holds(wid, prefix) >= 36, f"worker {wid} to hold it")
        # Worker a computes other long prompts: its pool (128 tokens) evicts the prefix. The
        # router's tries still believe a holds it; a's events say it does not.
        for i in range(6):
            served_by(input_ids=list(range(100 + 50 * i, 190 + 50 * i)), session_id=session[a])
            if holds(a, prefix) == 0:
                break
        wait_for(lambda: holds(a, prefix) == 0, "the eviction's events")
        assert router.dispatcher.tries[a].match(prefix, touch=False) >= 36
        wid, final = served_by(input_ids=prefix + [3, 4])
        assert wid == b and final.usage.cached_tokens >= 36

        # Events stop (dropped on their way in): the router keeps serving on what it knew.
        keep = router.worker_side.on_kv_events
        router.worker_side.on_kv_events = lambda w, msg: None  # type: ignore[method-assign]
        for i in range(4):  # new prompts on both workers: each sends batches that are lost
            served_by(input_ids=list(range(10 + i, 60 + i)), session_id=session[(a, b)[i % 2]])
        # They resume past a gap: each view resynchronises from a new snapshot.
        gaps = {w: v.gaps for w, v in views.items()}
        router.worker_side.on_kv_events = keep  # type: ignore[method-assign]
        for i in range(4):  # and after it: each worker's next batch shows the gap
            served_by(input_ids=list(range(300 + i, 340 + i)), session_id=session[(a, b)[i % 2]])
        wait_for(lambda: all(v.synced and v.gaps > gaps[w] for w, v in views.items()), "resyncs")
        last = list(range(303, 343))
        wid, _ = served_by(input_ids=last + [9], session_id=session[b])
        wait_for(lambda: holds(wid, last) >= 36, "the resynchronised view to follow the cache")


def test_workers_without_events_are_routed_on_the_tries(fake_server, tokenizer) -> None:
    """Workers that send no KV events (an engine that records none, here the fake) leave their
    views unsynced: the router routes them on what it sent, a prefix group stays together."""
    srv = fake_server(num_workers=2, router={"prefix_source": "events"})
    system = "You are a helpful assistant. " * 4
    with Client(srv.endpoint, timeout=20) as client:
        for i in range(6):
            final = client.generate(system + f"Question {i}?", params=SamplingParams(max_tokens=2))
            assert final.finish_reason == "length"
        st = client.stats()
    assert not any(v.synced for v in srv.router.dispatcher.views.values())
    assert sorted(w.requests for w in st.workers) == [0, 6]  # the group kept on one worker
