"""Constraints end to end: ZeroMQ client -> router -> worker process, and the HTTP gateway's
SGLang-native ``/generate`` and OpenAI ``response_format`` (with the official client).

One router with one real worker on the tiny Llama, one HTTP gateway in a thread.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from constrained_cases import IPV4_REGEX, PERSON_SCHEMA

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client, ServerError
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig
from radixserve.serving.wire import protocol as p

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ENGINE = dict(
    num_pages=1024, page_size=4, max_num_tokens=512, max_running_requests=32, num_threads=1
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[LocalServer]:
    cfg = RouterConfig(
        endpoint="tcp://127.0.0.1:*", heartbeat_interval_s=0.2, client_probe_interval_s=0.2
    )
    with LocalServer(tiny_llama_dir, num_workers=1, config=cfg, engine_config=ENGINE) as srv:
        yield srv
    assert all(proc.poll() is not None for proc in srv.procs)


@pytest.fixture(scope="module")
def http_url(server: LocalServer) -> Iterator[str]:
    from radixserve.serving.http.gateway import GatewayConfig
    from radixserve.serving.http.server import HTTPGateway

    gw = HTTPGateway(
        GatewayConfig(router=server.endpoint, memory_log_interval_s=0.0), port=0
    ).start()
    yield gw.url
    gw.stop()


def test_router_passes_constraints_through(server: LocalServer) -> None:
    with Client(server.endpoint, timeout=60) as c:
        outs = [
            c.generate(
                f"Server {i} address:",
                params=SamplingParams(regex=IPV4_REGEX, temperature=1.0, seed=i, max_tokens=40),
            )
            for i in range(4)
        ]
        for o in outs:
            assert re.fullmatch(IPV4_REGEX, o.text) and o.finish_reason == "stop", o.text
        streamed = "".join(
            ev.text
            for ev in c.stream(
                "Person:",
                params=SamplingParams(
                    json_schema=json.dumps(PERSON_SCHEMA), temperature=1.0, seed=3, max_tokens=400
                ),
            )
            if isinstance(ev, p.GenerateChunk)
        )
        jsonschema.validate(json.loads(streamed), PERSON_SCHEMA)
        # An invalid regex is the worker's clear rejection; the server keeps serving.
        with pytest.raises(ServerError, match=r"invalid_params.*invalid regex"):
            c.generate("x", params=SamplingParams(regex="(unclosed"))
        assert c.generate("y", params=SamplingParams(choices=["on", "off"])).text in ("on", "off")


def test_sglang_generate_regex_and_json_schema(http_url: str) -> None:
    with httpx.Client(base_url=http_url, timeout=60) as h:
        sp = {"regex": IPV4_REGEX, "temperature": 0.9, "max_new_tokens": 40}
        r = h.post("/generate", json={"text": ["Host:", "Other host:"], "sampling_params": sp})
        assert r.status_code == 200, r.text
        for item in r.json():
            assert re.fullmatch(IPV4_REGEX, item["text"])
            assert item["meta_info"]["finish_reason"]["type"] == "stop"
        r = h.post(
            "/generate",
            json={
                "text": "Person:",
                "sampling_params": {
                    "json_schema": json.dumps(PERSON_SCHEMA),
                    "temperature": 1.0,
                    "max_new_tokens": 400,
                },
            },
        )
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["text"]), PERSON_SCHEMA)
        bad = h.post(
            "/generate", json={"text": "x", "sampling_params": {"json_schema": '{"type": "nope"}'}}
        )
        assert bad.status_code == 400 and "invalid json_schema" in bad.text


def test_openai_response_format_json_schema_and_json_object(http_url: str) -> None:
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=fmt,
        temperature=1.0,
        max_tokens=400,
        n=2,
        seed=5,
    )
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON_SCHEMA)
    obj = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Any JSON object."}],
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=200,
    )
    if (
        obj.choices[0].finish_reason == "stop"
    ):  # free-form JSON may run past max_tokens on a random model
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    else:
        assert (obj.choices[0].message.content or "").startswith("{")
    with pytest.raises(BadRequestError, match="invalid json_schema"):
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "nope"}},
            },
        )
