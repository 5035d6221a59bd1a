"""SGLang's ``POST /abort_request`` on the real server: a request stopped by the id its client
knows ends with finish reason ``abort`` and what it had generated, its KV is freed, and one
tenant cannot stop another's."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from http_helpers import AGENT_KEYS, wait_idle

LONG = 1500  # of the 2,048-token context: a request that is still running when it is stopped
STORY = "Tell me a very long story."


def _events(r: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to ``[DONE]``."""
    for line in r.iter_lines():
        if line.startswith("data:") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data:"))


def _abort(c: httpx.Client, **body: Any) -> int:
    r = c.post("/abort_request", json=body)
    assert r.status_code == 200, r.text
    return int(r.json()["aborted"])


def _engine(info: dict[str, Any]) -> dict[str, Any]:
    return info["workers"][0]["engine"]


def test_generate_stopped_by_rid_ends_with_abort_and_frees_its_kv(server: Any) -> None:
    body = {
        "text": STORY,
        "rid": "story-1",
        "stream": True,
        "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True},
    }
    with server.client() as c:
        before = _engine(wait_idle(c))
        with c.stream("POST", "/generate", json=body) as r:
            events = _events(r)
            first = next(events)
            assert first["meta_info"]["id"] == "story-1"
            assert _abort(c, rid="someone-else") == 0
            assert _abort(c, rid="story-1") == 1
            last = list(events)[-1]
        after = _engine(wait_idle(c))
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < last["meta_info"]["completion_tokens"] < LONG
    assert len(last["output_ids"]) == last["meta_info"]["completion_tokens"]
    assert after["aborted_total"] == before["aborted_total"] + 1
    assert after["invariants"] == "ok"
    assert _abort(server.client(), rid="story-1") == 0  # ended: nothing left to stop


def test_a_sample_is_found_by_its_prompts_rid_too(server: Any) -> None:
    body = {
        "text": STORY,
        "rid": "forked",
        "stream": True,
        "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "n": 2},
    }
    with server.client() as c:
        with c.stream("POST", "/generate", json=body) as r:
            events = _events(r)
            seen = {next(events)["meta_info"]["id"]}
            assert seen <= {"forked-0", "forked-1"}
            assert _abort(c, rid="forked") == 2
            finals = [e for e in events if e["meta_info"]["finish_reason"] is not None]
        wait_idle(c)
    assert sorted(e["meta_info"]["id"] for e in finals) == ["forked-0", "forked-1"]
    assert {e["meta_info"]["finish_reason"]["type"] for e in finals} == {"abort"}


def test_a_streamed_chat_completion_is_stopped_by_the_id_its_first_chunk_showed(
    server: Any,
) -> None:
    body = {
        "model": "default",
        "stream": True,
        "max_tokens": LONG,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": STORY}],
    }
    with server.client() as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            events = _events(r)
            rid = next(events)["id"]
            assert rid.startswith("chatcmpl-")
            assert _abort(c, rid=rid) == 1
            reasons = [ch["finish_reason"] for e in events for ch in e["choices"]]
        wait_idle(c)
    assert reasons[-1] == "abort"


def test_a_completion_given_its_rid_is_stopped_before_its_answer(server: Any) -> None:
    body = {
        "model": "default",
        "prompt": STORY,
        "rid": "batch-job-7",
        "max_tokens": LONG,
        "ignore_eos": True,
    }
    with server.client() as c, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(c.post, "/v1/completions", json=body)
        deadline = time.monotonic() + 30
        while _abort(c, rid="batch-job-7") == 0:  # not yet in flight: try again
            assert time.monotonic() < deadline and not answer.done(), "never seen in flight"
        out = answer.result(timeout=60).json()
        wait_idle(c)
    assert out["id"] == "batch-job-7"
    assert out["choices"][0]["finish_reason"] == "abort"
    assert out["usage"]["completion_tokens"] < LONG  # maybe none: stopped before its prefill


def test_abort_all_stops_every_request_and_an_empty_body_is_refused(server: Any) -> None:
    body = {
        "text": [STORY, "Count to a thousand."],
        "stream": True,
        "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True},
    }
    with server.client() as c:
        r = c.post("/abort_request", json={})
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
        with c.stream("POST", "/generate", json=body) as r:
            events = _events(r)
            next(events)
            assert _abort(c, abort_all=True) == 2
            finals = [e for e in events if e["meta_info"]["finish_reason"] is not None]
        wait_idle(c)
    assert [e["meta_info"]["finish_reason"]["type"] for e in finals] == ["abort", "abort"]


def test_a_tenant_cannot_stop_another_tenants_request(agent_server: Any) -> None:
    mine, theirs = ({"Authorization": f"Bearer {key}"} for key in AGENT_KEYS)
    body = {
        "text": STORY,
        "rid": "shared-name",
        "stream": True,
        "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
    }
    with agent_server.client(headers=mine) as c, agent_server.client(headers=theirs) as other:
        with c.stream("POST", "/generate", json=body) as r:
            events = _events(r)
            next(events)
            assert _abort(other, rid="shared-name") == 0
            assert _abort(other, abort_all=True) == 0
            last = list(events)[-1]
        assert (
            agent_server.client().post("/abort_request", json={"abort_all": True}).status_code
            == 401
        )
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["meta_info"]["completion_tokens"] == 64
