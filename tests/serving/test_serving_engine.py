"""The server with real engine workers on the tiny Llama checkpoint: outputs equal the
in-process Engine's greedy outputs, KV accounting balances, aborts free pages, shared
prefixes hit one worker's cache."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import AsyncClient, Client
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig
from radixserve.serving.wire import protocol as p

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ENGINE = dict(
    num_pages=512, page_size=4, max_num_tokens=256, max_running_requests=32, num_threads=1
)
SYSTEMS = [
    "You are a helpful assistant. The quick brown fox jumps over the lazy dog. ",
    "Prefix caching, continuous batching, paged attention, eviction. Once upon a time ",
    "Hello, world! How are you today? I am fine, thank you. Let us count: one two ",
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[LocalServer]:
    cfg = RouterConfig(
        endpoint="tcp://127.0.0.1:*",
        heartbeat_interval_s=0.2,
        client_probe_interval_s=0.2,
    )
    with LocalServer(tiny_llama_dir, num_workers=2, config=cfg, engine_config=ENGINE) as srv:
        yield srv
    assert all(proc.poll() is not None for proc in srv.procs)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Any:
    from radixserve.engine.engine import Engine

    return Engine(tiny_llama_dir, **ENGINE)


def _idle(st: p.StatsReply) -> bool:
    return st.active == 0 and all(
        w.inflight == 0
        and w.engine.get("pages_in_use") == 0
        and w.engine.get("running") == 0
        and w.engine.get("waiting") == 0
        for w in st.workers
        if w.alive
    )


def _wait_idle(c: Client, timeout: float = 20.0) -> p.StatsReply:
    deadline = time.monotonic() + timeout
    while True:
        st = c.stats()
        if _idle(st) or time.monotonic() > deadline:
            assert _idle(st), st
            assert all(w.engine["invariants"] == "ok" for w in st.workers), st
            return st


def test_concurrent_clients_match_in_process_engine(
    server: LocalServer, engine: Any, tokenizer: Any = None
) -> None:
    prompts = [SYSTEMS[i % 3] + f"question {i}: what comes next?" for i in range(18)]
    params = [
        SamplingParams(max_tokens=6 + i % 5, temperature=0.0, ignore_eos=i % 2 == 0)
        for i in range(18)
    ]
    expected = engine.generate(prompts, params)

    async def one(client: AsyncClient, i: int) -> tuple[p.GenerateFinal, list[int], str]:
        ids, text, final = [], "", None
        async for ev in client.stream(prompts[i], params=params[i], stream=i % 3 != 0):
            if isinstance(ev, p.GenerateChunk):
                ids += ev.token_ids
                text += ev.text
            else:
                final = ev
        assert final is not None
        return final, ids, text

    async def main() -> list[tuple[p.GenerateFinal, list[int], str]]:
        clients = [AsyncClient(server.endpoint, timeout=60) for _ in range(6)]
        try:
            return await asyncio.gather(*(one(clients[i % 6], i) for i in range(len(prompts))))
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(main())
    for i, ((final, ids, text), exp) in enumerate(zip(results, expected)):
        assert final.token_ids == exp.token_ids, i
        assert final.text == exp.text, i
        assert final.finish_reason == exp.finish_reason, i
        if i % 3 != 0:  # streamed: the chunks add up to the final
            assert ids == final.token_ids and text == final.text
    with Client(server.endpoint, timeout=30) as c:
        st = _wait_idle(c)
        assert sum(w.engine["cached_prompt_tokens_total"] for w in st.workers) > 0


def test_shared_prefix_lands_on_one_worker_and_hits(server: LocalServer) -> None:
    system = "Numbers 0123456789 and symbols: + - * / = < > ( ) [ ]. A radix tree over token ids. "
    with Client(server.endpoint, timeout=30) as c:
        outs = [
            c.generate(system + f"Item {i}.", params=SamplingParams(max_tokens=2, temperature=0))
            for i in range(5)
        ]
        assert len({o.worker_id for o in outs}) == 1
        assert outs[0].usage.cached_tokens == 0
        n_prefix = len(server.router.codec.tokenizer.encode(system))
        assert all(o.usage.cached_tokens >= n_prefix - 4 for o in outs[1:]), [o.usage for o in outs]
        st = c.stats()
        w = st.workers[outs[0].worker_id]
        assert w.cached_tokens >= 4 * (n_prefix - 4)


def test_abort_and_vanished_client_free_kv(server: LocalServer) -> None:
    with Client(server.endpoint, timeout=30) as c:
        for i, _ev in enumerate(
            c.stream("Once upon a time", params=SamplingParams(max_tokens=2000, ignore_eos=True))
        ):
            if i == 3:
                break
        _wait_idle(c)
    other = Client(server.endpoint, timeout=30)
    rid = other.submit(
        "talk and talk", params=SamplingParams(max_tokens=2000, ignore_eos=True), stream=True
    )
    assert isinstance(other._next(rid, 30), p.GenerateChunk)  # it runs
    with Client(server.endpoint, timeout=30) as c:
        other._sock.close(linger=0)  # vanish without an abort
        st = _wait_idle(c)
        assert st.aborted >= 2
        # ... and the server still answers.
        assert (
            c.generate(
                "still alive?", params=SamplingParams(max_tokens=2, ignore_eos=True)
            ).usage.completion_tokens
            == 2
        )


def test_prompt_too_long_and_bad_params(server: LocalServer) -> None:
    from radixserve.serving.client import ServerError

    with Client(server.endpoint, timeout=30) as c:
        ctx = c.model_info().context_length
        with pytest.raises(ServerError) as exc:
            c.generate(input_ids=[5] * ctx)
        assert exc.value.code == "context_length"
        with pytest.raises(ServerError) as exc:
            c.generate("x", params=SamplingParams(top_k=0))
        assert exc.value.code == "invalid_params"
        assert c.generate("ok", params=SamplingParams(max_tokens=1)).usage.completion_tokens == 1


def test_logprobs_and_prompt_logprobs_match_engine(server: LocalServer, engine: Any) -> None:
    params = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs_start=0
    )
    text = "Let us count: one two three"
    exp = engine.generate([text], [params])[0]
    with Client(server.endpoint, timeout=30) as c:
        events = list(c.stream(text, params=params))
    final = events[-1]
    assert isinstance(final, p.GenerateFinal) and final.token_ids == exp.token_ids
    assert final.logprobs is not None and exp.logprobs is not None
    assert [(lp.token_id, round(lp.logprob, 4)) for lp in final.logprobs] == [
        (lp.token_id, round(lp.logprob, 4)) for lp in exp.logprobs
    ]
    assert all(lp.top is not None and len(lp.top) == 2 for lp in final.logprobs)
    streamed = [lp for ev in events[:-1] for lp in (ev.logprobs or [])]
    assert streamed == final.logprobs
    assert final.prompt_logprobs is not None and exp.prompt_logprobs is not None
    assert len(final.prompt_logprobs) == len(exp.prompt_logprobs) == final.usage.prompt_tokens
    assert final.prompt_logprobs[0] is None
    assert final.prompt_logprobs[1:] == pytest.approx(exp.prompt_logprobs[1:], abs=1e-4)
