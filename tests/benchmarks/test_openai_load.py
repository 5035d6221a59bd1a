"""The peer benchmarks' load client (``benchmarks/peers/openai_load.py``) against a scripted
OpenAI-style SSE server on loopback: what it sends, and what it makes of the stream.

The server is aiohttp's, in the test's own event loop (port 0, no thread): each handler
records the request body and answers with the events the test gives it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import bench_modules
from aiohttp import web

ol = bench_modules.load("peers/openai_load.py", "peer_openai_load")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def sse(events: list[dict[str, Any]], bodies: list[dict[str, Any]]) -> Handler:
    """A handler that records the JSON body, then streams ``events`` and ``[DONE]``."""

    async def handle(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for ev in events:
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return handle


def replay_against(
    routes: dict[str, Handler], cfg_kwargs: dict[str, Any], sessions: list[list[Any]], c: int
) -> list[list[Any]]:
    """Serve ``routes`` on a free loopback port and replay ``sessions`` against it."""

    async def run() -> list[list[Any]]:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_post(path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = runner.addresses[0][1]
            cfg = ol.ReplayConfig(f"http://127.0.0.1:{port}", "m", **cfg_kwargs)
            results, wall = await ol.replay(cfg, sessions, c, tokenizer=None)
            assert wall > 0
            return results
        finally:
            await runner.cleanup()

    return asyncio.run(run())


def request(prompt: list[int], max_tokens: int = 8) -> SimpleNamespace:
    return SimpleNamespace(
        prompt_ids=prompt, max_tokens=max_tokens, messages=[{"role": "user", "content": "hi"}]
    )


def test_completion_stream_is_stamped_and_counted() -> None:
    # One event's line is over aiohttp's default line limit (512 KiB): read whole.
    big = "x" * 1_000_000
    events: list[dict[str, Any]] = [
        {"choices": [{"text": "a", "finish_reason": None}]},
        {"choices": [{"text": big, "finish_reason": None}]},
        {"choices": [{"text": "", "finish_reason": None}]},  # no content: not a token stamp
        {"choices": [{"text": "c", "finish_reason": "length"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 2},
            },
        },
    ]
    bodies: list[dict[str, Any]] = []
    results = replay_against(
        {"/v1/completions": sse(events, bodies)},
        {"extra_body": {"ignore_eos": True}},
        [[request([1, 2, 3, 4, 5], max_tokens=3)]],
        1,
    )
    (r,) = results[0]
    assert r.error is None
    assert r.text == "a" + big + "c"
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (5, 3, 2)
    assert r.finish_reason == "length"
    assert len(r.itl) == 2  # three content chunks, two gaps
    assert 0 < r.ttft <= r.e2e
    (body,) = bodies
    assert body["prompt"] == [1, 2, 3, 4, 5] and body["max_tokens"] == 3
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True


def test_chat_deltas_and_sessions_in_order() -> None:
    events: list[dict[str, Any]] = [
        {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "he"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "llo"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}},
    ]
    bodies: list[dict[str, Any]] = []
    sessions = [[request([i]), request([i, i])] for i in range(3)]
    results = replay_against(
        {"/v1/chat/completions": sse(events, bodies)}, {"mode": "chat"}, sessions, 2
    )
    assert [len(s) for s in results] == [2, 2, 2]
    for r in (r for s in results for r in s):
        assert r.error is None and r.text == "hello" and r.finish_reason == "stop"
        assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (4, 2, None)
    assert len(bodies) == 6
    assert all(b["messages"] == [{"role": "user", "content": "hi"}] for b in bodies)
    stats = ol.summarize([r for s in results for r in s], wall=1.0)
    assert stats["errors"] == 0 and stats["output_tokens"] == 12 and stats["hit_rate"] is None


def test_an_error_status_is_recorded_and_the_run_goes_on() -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=503, text="overloaded")

    results = replay_against({"/v1/completions": refuse}, {}, [[request([1]), request([2])]], 1)
    assert [r.error for r in results[0]] == ["RuntimeError: HTTP 503: overloaded"] * 2
    stats = ol.summarize(results[0], wall=1.0)
    assert stats["errors"] == 2 and stats["first_error"] == "RuntimeError: HTTP 503: overloaded"
