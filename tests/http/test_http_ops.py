"""Operations: /metrics (Prometheus text that parses, counters that move), the memory log
line, bad requests answered 4xx in OpenAI's error shape while the server keeps serving,
and a client that disconnects mid-stream aborting its request (KV freed)."""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Any

import httpx
import pytest
from http_helpers import wait_idle
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow  # a real server process


def scrape(c: httpx.Client) -> dict[str, float]:
    """``{"name{label=value,...}": value}`` of every sample on /metrics."""
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_metrics_parse_and_counters_move(server: Any) -> None:
    with server.client() as c:
        before = scrape(c)
        for name in (
            "radixserve_num_requests_running{worker=0}",
            "radixserve_num_requests_waiting{worker=0}",
            "radixserve_kv_pages_free{worker=0}",
            "radixserve_kv_pages_evictable{worker=0}",
            "radixserve_kv_pages_in_use{worker=0}",
            "radixserve_kv_usage_ratio{worker=0}",
            "radixserve_retractions_total{worker=0}",
            "radixserve_evicted_pages_total{worker=0}",
            "radixserve_memory_rss_bytes{device=cpu,worker=0}",
        ):
            assert name in before, name
        system = (
            "Shared system prompt for the metrics test, long enough to span several pages. " * 2
        )
        for q in ("one?", "two?"):
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": "default",
                    "max_tokens": 3,
                    "temperature": 0,
                    "stream": q == "two?",
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": q},
                    ],
                },
            )
            assert r.status_code == 200
        after = scrape(c)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    w = "{worker=0}"
    assert delta(f"radixserve_prompt_tokens_total{w}") > 0
    assert delta(f"radixserve_prefix_cache_queried_tokens_total{w}") == delta(
        f"radixserve_prompt_tokens_total{w}"
    )
    assert (
        delta(f"radixserve_prefix_cache_hit_tokens_total{w}") > 0
    )  # the second call reused the system prompt
    assert delta(f"radixserve_generation_tokens_total{w}") >= 2
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"radixserve_{hist}_count{w}") == 2
    assert delta(f"radixserve_inter_token_latency_seconds_count{w}") >= 2
    assert (
        delta("radixserve_requests_finished_total{finish_reason=length,worker=0}")
        + delta("radixserve_requests_finished_total{finish_reason=stop,worker=0}")
        == 2
    )
    assert 0.0 <= after[f"radixserve_kv_usage_ratio{w}"] <= 1.0
    total = after[f"radixserve_kv_pages_total{w}"]
    parts = sum(after[f"radixserve_kv_pages_{k}{w}"] for k in ("free", "evictable", "in_use"))
    assert parts == total == 512


def test_memory_log_line(server: Any) -> None:
    m = server.out.wait_for(
        r"memory: worker 0 cpu: allocated .* kv pool .*kv pages free/evictable/in-use "
        r"(\d+)/(\d+)/(\d+) of (\d+)",
        timeout=30,
    )
    assert sum(int(m.group(i)) for i in (1, 2, 3)) == int(m.group(4)) == 512


BAD_CHAT: list[tuple[Any, int, str]] = [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),  # missing field
    ({"model": "default"}, 400, "messages"),
    ({"model": "default", "messages": "hi"}, 400, "messages"),  # wrong types
    (
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"},
        400,
        "max_tokens",
    ),
    (
        {
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": None,
            "n": 1.5,
        },
        400,
        "n",
    ),
    (
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3},
        400,
        "max_tokens",
    ),
    (
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], "top_p": 0},
        400,
        "top_p",
    ),
    (
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
        400,
        "logprobs",
    ),
    (
        {
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function"}],
        },
        400,
        "tools",
    ),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "gpt-4o"),
    ({"model": "default", "messages": []}, 400, "messages"),
]


def test_bad_requests_get_4xx_and_server_keeps_serving(server: Any) -> None:
    with server.client() as c:
        for body, status, word in BAD_CHAT:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["type"] in (
                "invalid_request_error",
                "not_found_error",
            ) and word in json.dumps(err), err
        r = c.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"
        r = c.post("/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": 0})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": "default", "prompt": [], "max_tokens": 1})
        assert r.status_code == 400
        r = c.post(
            "/v1/completions", json={"model": "default", "prompt": [1, 2, 10**9], "max_tokens": 1}
        )
        assert r.status_code == 400 and "input_ids" in r.json()["error"]["message"]
        # Integers past int64 are a 400 in the usual shape, not a failure to encode for the router.
        for extra in (
            {"prompt": [1, 2**64]},
            {"max_tokens": 2**64},
            {"stop_token_ids": [2**64]},
            {"top_k": 2**64},
        ):
            r = c.post(
                "/v1/completions",
                json={"model": "default", "prompt": "x", "max_tokens": 1, **extra},
            )
            assert r.status_code == 400 and r.json()["error"]["message"], (extra, r.text)
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "default",
                "messages": [{"role": "user", "content": "x"}],
                "stream": True,
                "max_tokens": -1,
            },
        )
        assert r.status_code == 400  # a stream that fails validation gets a status, not an event
        assert c.get("/v1/no/such/route").status_code == 404
        ok = c.post(
            "/v1/chat/completions",
            json={
                "model": "default",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "still there?"}],
            },
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in (
            "stop",
            "length",
        )


def wait_running(c: httpx.Client, timeout: float = 30.0) -> None:
    """Poll until a request is running in the worker and has generated tokens (bounded)."""
    before = c.get("/get_server_info").json()["workers"][0]["engine"]["generated_tokens_total"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engine = c.get("/get_server_info").json()["workers"][0]["engine"]
        if engine["running"] and engine["generated_tokens_total"] > before:
            return
        time.sleep(0.02)
    raise AssertionError("the request never started running")


@pytest.mark.parametrize(
    "route", ["/v1/chat/completions", "/generate", "non-streamed /v1/chat/completions"]
)
def test_disconnect_mid_stream_aborts_and_frees_kv(server: Any, route: str) -> None:
    if route == "/generate":
        body: dict[str, Any] = {
            "text": "Tell me a very long story.",
            "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
        }
    else:
        body = {
            "model": "default",
            "stream": route == "/v1/chat/completions",
            "max_tokens": 1500,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}],
        }
    with server.client() as c:
        wait_idle(c)
        before = c.get("/get_server_info").json()
        if body.get("stream"):
            with httpx.Client(base_url=server.url, timeout=30) as streamer:
                with streamer.stream("POST", route, json=body) as r:
                    assert r.status_code == 200
                    events = 0
                    for line in r.iter_lines():
                        events += line.startswith("data:")
                        if events >= 3:
                            break  # leave mid-stream: closing the response closes the connection
        else:  # a raw connection, closed once the request is running in the worker
            host, port = server.url.removeprefix("http://").split(":")
            payload = json.dumps(body).encode()
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
                )
                wait_running(c)
        info = wait_idle(c)  # the abort freed the request's KV pages (none in use, nothing running)
    engine_before, engine_after = before["workers"][0]["engine"], info["workers"][0]["engine"]
    why = f"before {before}\nafter {info}\nserver output:\n{''.join(server.out.seen[-20:])}"
    assert info["aborted"] == before["aborted"] + 1, why
    assert engine_after["aborted_total"] == engine_before["aborted_total"] + 1, why
    assert (
        engine_after["generated_tokens_total"] - engine_before["generated_tokens_total"] < 1500
    ), why
    assert engine_after["invariants"] == "ok"


def test_serve_sends_a_warm_up_request_before_serving(server: Any) -> None:
    """Before ``serve`` prints that it is serving, one short streamed completion has gone
    through the gateway, the router and the worker, to its end (what a first request pays
    once, it pays instead)."""
    log = "".join(server.out.seen)
    m = re.search(r"warm-up request through HTTP, router and worker: (\d+) ms", log)
    assert m is not None, log
    assert log.index(m.group(0)) < log.index("serving on")
