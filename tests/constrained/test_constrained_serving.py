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
from constrained_cases import ARITH_EBNF, ARITH_REGEX, IPV4_REGEX, PERSON_SCHEMA

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


def test_vllm_and_sglang_spellings_through_the_openai_client(http_url: str) -> None:
    """What clients written for vLLM and SGLang send in ``extra_body`` constrains the answer
    on both OpenAI routes; a grammar the compiler refuses is a 400 and the server goes on."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    checks: list[tuple[dict[str, Any], Any]] = [
        ({"structured_outputs": {"grammar": ARITH_EBNF}}, arith),
        ({"guided_grammar": ARITH_EBNF}, arith),
        ({"ebnf": ARITH_EBNF}, arith),
        ({"structured_outputs": {"regex": IPV4_REGEX}}, ipv4),
        ({"guided_regex": IPV4_REGEX}, ipv4),
        ({"regex": IPV4_REGEX}, ipv4),
        ({"structured_outputs": {"choice": ["red", "green"]}}, {"red", "green"}.__contains__),
        ({"guided_choice": ["red", "green"]}, {"red", "green"}.__contains__),
        ({"guided_json": PERSON_SCHEMA}, person),
    ]
    for i, (extra, valid) in enumerate(checks):
        chat = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": f"Answer {i}."}],
            temperature=1.0,
            seed=i,
            max_tokens=400,
            extra_body=extra,
        )
        text = client.completions.create(
            model="default",
            prompt=f"Answer {i}:",
            temperature=1.0,
            seed=i,
            max_tokens=400,
            extra_body=extra,
        )
        for answer, why in (
            (chat.choices[0].message.content or "", chat.choices[0].finish_reason),
            (text.choices[0].text, text.choices[0].finish_reason),
        ):
            assert why == "stop" and valid(answer), (extra, answer)
    with pytest.raises(BadRequestError, match='invalid ebnf: .*Rule "nowhere" is not defined'):
        client.completions.create(
            model="default", prompt="x", max_tokens=4, extra_body={"ebnf": "root ::= nowhere"}
        )
    with pytest.raises(BadRequestError, match="response_format and guided_regex both"):
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "a"},
        )


def test_sglang_generate_ebnf_and_structural_tag(http_url: str) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tag = {"type": "tag", "begin": "<n>", "content": {"type": "json_schema", "json_schema": schema}}
    forced = {  # xgrammar's form: one tagged call, required, and nothing after it
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<n>"],
            "tags": [{**tag, "end": "</n>"}],
            "at_least_one": True,
            "stop_after_first": True,
        },
    }
    legacy = {  # the older form SGLang's docs send: free text, a structure once triggered
        "type": "structural_tag",
        "structures": [{"begin": "<n>", "schema": schema, "end": "</n>"}],
        "triggers": ["<n>"],
    }
    with httpx.Client(base_url=http_url, timeout=60) as h:
        sp: dict[str, Any] = {"ebnf": ARITH_EBNF, "temperature": 1.0, "max_new_tokens": 64}
        r = h.post("/generate", json={"text": ["Sum:", "Product:"], "sampling_params": sp})
        assert r.status_code == 200, r.text
        assert all(arith(item["text"]) for item in r.json()), r.json()
        for seed in range(3):
            sp = {"structural_tag": json.dumps(forced), "temperature": 1.0, "sampling_seed": seed}
            r = h.post("/generate", json={"text": "Call:", "sampling_params": sp})
            assert r.status_code == 200, r.text
            m = re.fullmatch(r"<n>(.*)</n>", r.json()["text"], flags=re.S)
            assert m is not None, r.json()["text"]
            jsonschema.validate(json.loads(m.group(1)), schema)
        sp = {"structural_tag": json.dumps(legacy), "max_new_tokens": 8}
        r = h.post("/generate", json={"text": "Call:", "sampling_params": sp})
        assert r.status_code == 200, r.text  # compiled on the worker in its current form


def arith(text: str) -> bool:
    return re.fullmatch(ARITH_REGEX, text) is not None


def ipv4(text: str) -> bool:
    return re.fullmatch(IPV4_REGEX, text) is not None


def person(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    return True
