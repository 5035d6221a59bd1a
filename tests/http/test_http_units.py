"""Fast tests without processes: request mapping, error shapes, the metrics collector, SSE, token bytes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from radixserve.serving.client import ServerError
from radixserve.serving.http.errors import APIError, from_server_error
from radixserve.serving.http.gateway import memory_line
from radixserve.serving.http.metrics import GatewayMetrics
from radixserve.serving.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixserve.serving.http.sglang_protocol import GenerateReqInput, expand
from radixserve.serving.http.sse import DONE, event
from radixserve.serving.http.streams import finals
from radixserve.serving.http.tokens import TokenNames
from radixserve.serving.wire import protocol as p


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    )


def test_chat_request_to_sampling_params() -> None:
    req = chat(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        stop="END",
        seed=3,
        logprobs=True,
        top_logprobs=4,
        presence_penalty=0.1,
        top_k=20,
        ignore_eos=True,
    )
    req.check()
    sp = req.sampling(req.wanted_max_tokens(2048), req.wanted_logprobs(), choice=2)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.stop, sp.seed, sp.logprobs) == (
        7,
        0.5,
        0.9,
        ["END"],
        5,
        4,
    )
    assert (sp.presence_penalty, sp.top_k, sp.ignore_eos) == (0.1, 20, True)
    budgeted = chat(thinking_token_budget=256)  # vLLM's extension
    assert budgeted.sampling(16, None).thinking_token_budget == 256
    assert (
        chat().wanted_max_tokens(2048) == 2048
        and chat(max_completion_tokens=3, max_tokens=9).wanted_max_tokens(1) == 3
    )
    fmt = chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object"}},
        }
    )
    assert json.loads(fmt.sampling(4, None).json_schema or "") == {"type": "object"}
    parts = chat(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    )
    assert [(m.role, m.content) for m in parts.chat()] == [("user", "a\nb")]


@pytest.mark.parametrize("kind", ["image_url", "input_audio"])
def test_media_content_parts_are_a_clear_400(kind: str) -> None:
    """An image (or audio) part reaching the chat API is refused by name, not ignored: the
    served model is a text model, a multimodal checkpoint's text model at most (Gemma 3)."""
    body = chat(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": kind, kind: {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ]
    )
    with pytest.raises(APIError) as e:
        body.chat()
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["type"] == "invalid_request_error"
    assert f"{kind!r} content parts are not supported" in err["message"]
    assert err["param"] == "messages.0.content"


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"n": 0},
        {"temperature": 3.0},
        {"top_logprobs": 2},
        {"logprobs": True, "top_logprobs": 21},
        {"response_format": {"type": "grammar"}},
        {"logit_bias": {"1": 200.0}},
        {"logit_bias": {"x": 1.0}},
        {"logit_bias": {str(i): 1.0 for i in range(301)}},
        {"stream_options": {"include_usage": True}},
        {"functions": [{"name": "f"}]},
        {"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
        {"modalities": ["text", "audio"]},
        {"thinking_token_budget": -1},
        {"use_beam_search": True, "stream": True},
        {"length_penalty": 0.5},  # beam search's only
        {"allowed_token_ids": []},
        {"allowed_token_ids": [1], "response_format": {"type": "json_object"}},
        {"bad_words": ["x"] * 65},
        {"separate_reasoning": False},
        {"echo": True},
        {"prompt_logprobs": 21},
        {"stop_regex": ["["]},
    ],
)
def test_chat_request_rejections(bad: dict[str, Any]) -> None:
    with pytest.raises(APIError) as e:
        req = chat(**bad)
        req.check()
        req.sampling(req.wanted_max_tokens(16), req.wanted_logprobs())
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"


def test_fields_openai_ignores_are_accepted() -> None:
    req = chat(
        user="u",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        modalities=["text"],
        prompt_cache_key="conv-1",
        parallel_tool_calls=True,
        max_completion_tokens=3,
        # vLLM's and SGLang's extensions at the values their clients send by default
        use_beam_search=False,
        length_penalty=1.0,
        allowed_token_ids=None,
        bad_words=[],
        separate_reasoning=True,
        echo=False,
    )
    req.check()
    assert req.session == "conv-1" and req.wanted_max_tokens(16) == 3
    assert chat(session_id="s").session == "s"


def test_strict_types() -> None:
    for bad in (
        {"max_tokens": "5"},
        {"n": True},
        {"messages": "hi"},
        {"stop": 5},
        {"tools": [{"type": "function"}]},  # no function: the app answers 400
    ):
        with pytest.raises(ValidationError):
            chat(**bad)


def test_completion_prompts() -> None:
    assert CompletionRequest(model="m", prompt="a").prompts() == ["a"]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(model="m", prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
    with pytest.raises(APIError):
        CompletionRequest(model="m", prompt=[]).prompts()


def test_sglang_expand_and_params() -> None:
    req = GenerateReqInput.model_validate(
        {
            "text": ["a", "b"],
            "sampling_params": {"max_new_tokens": 0, "n": 2, "top_k": 1 << 30, "sampling_seed": 5},
            "return_logprob": [True, False],
            "logprob_start_len": 3,
            "rid": ["x", "y"],
        }
    )
    items, single = expand(req, "r")
    assert not single and [(i.text, i.sample, i.rid, i.return_logprob) for i in items] == [
        ("a", 0, "x-0", True),
        ("a", 1, "x-1", True),
        ("b", 0, "y-0", False),
        ("b", 1, "y-1", False),
    ]
    params, drop = items[1].sampling.to_params(2048, 512, 0, 3, items[1].sample)
    assert drop and params.max_tokens == 1 and params.top_k == -1 and params.seed == 6
    assert params.prompt_logprobs_start == 3 and params.logprobs == 0
    one, single = expand(GenerateReqInput.model_validate({"input_ids": [1, 2, 3]}), "r")
    assert (
        single
        and one[0].input_ids == [1, 2, 3]
        and one[0].rid == "r"
        and one[0].logprob_start_len == -1
    )
    regex, _ = (
        GenerateReqInput.model_validate({"text": "a", "sampling_params": {"regex": "[0-9]+"}}),
        None,
    )
    assert expand(regex, "r")[0][0].sampling.to_params(64, 512, None, None, 0)[0].regex == "[0-9]+"
    for bad in (
        {"text": "a", "input_ids": [1]},
        {"text": "a", "image_data": "x.png"},
        {"text": ["a", "b"], "rid": ["only-one"]},
    ):
        with pytest.raises(APIError):
            expand(GenerateReqInput.model_validate(bad), "r")
    with pytest.raises(ValidationError):
        GenerateReqInput.model_validate({"text": "a", "sampling_params": {"unknown": 1}})


def test_router_errors_map_to_http_status() -> None:
    def status(code: Any) -> int:
        return from_server_error(ServerError(p.Error(code=code, message="m"))).status

    assert status("invalid_params") == 400 and status("context_length") == 400
    assert status("no_workers") == 503 and status("timeout") == 504 and status("internal") == 500
    assert (
        from_server_error(ServerError(p.Error(code="context_length", message="m"))).code
        == "context_length_exceeded"
    )


def _stats() -> p.StatsReply:
    engine = {
        "running": 1,
        "waiting": 2,
        "num_pages": 100,
        "pages_free": 60,
        "pages_evictable": 30,
        "pages_in_use": 10,
        "cached_tokens": 120,
        "prompt_tokens_total": 500,
        "cached_prompt_tokens_total": 200,
        "generated_tokens_total": 80,
        "computed_tokens_total": 380,
        "retractions_total": 1,
        "evicted_pages_total": 4,
        "finished_total": 9,
        "aborted_total": 1,
        "steps_total": 50,
        "hit_rate": 0.4,
        "leased_pages": 12,
        "lease_hits_total": 3,
        "lease_lost_tokens_total": 40,
        "eviction_policy": "adaptive",
        "eviction_policy_active": "lfu",
        "eviction_regret_tokens": {"lru": 64, "lfu": 8},
        "cache_regret_tokens": {"lfu": 16},
        "spec_draft_pages": 24,
        "spec_draft_pages_free": 20,
        "spec_draft_pages_evictable": 3,
        "spec_draft_pool_bytes": 4096,
        "memory": {
            "device": "cpu",
            "allocated_bytes": 5,
            "reserved_bytes": 6,
            "total_bytes": 7,
            "rss_bytes": 5,
            "pool_bytes": 3,
        },
    }
    workers = [
        p.WorkerStats(
            worker_id=i,
            alive=i == 0,
            pid=1,
            inflight=1,
            requests=3,
            prompt_tokens=500,
            cached_tokens=200,
            hit_rate=0.4,
            load=p.WorkerLoad(),
            engine=engine,
        )
        for i in (0, 1)
    ]
    return p.StatsReply(
        request_id="s",
        routing="cache_aware",
        requests=10,
        active=1,
        aborted=2,
        errors=3,
        clients=1,
        workers=workers,
    )


def test_metrics_exposition_parses() -> None:
    m = GatewayMetrics()
    m.update(_stats())
    final = p.GenerateFinal(
        request_id="r",
        finish_reason="length",
        text="",
        token_ids=[1, 2],
        usage=p.Usage(prompt_tokens=5, cached_tokens=4, completion_tokens=2),
        timings=p.Timings(),
        worker_id=0,
    )
    m.observe_request(final, 0.02, [0.01], 0.05)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(m.render().decode())
        for s in fam.samples
    }
    w0 = (("worker", "0"),)
    assert samples[("radixserve_kv_usage_ratio", w0)] == pytest.approx(0.1)
    assert samples[("radixserve_prefix_cache_hit_tokens_total", w0)] == 200
    assert samples[("radixserve_prefix_cache_queried_tokens_total", w0)] == 500
    assert (
        samples[("radixserve_retractions_total", w0)] == 1
        and samples[("radixserve_evicted_pages_total", w0)] == 4
    )
    assert samples[("radixserve_worker_up", (("worker", "1"),))] == 0.0
    assert samples[("radixserve_kv_leased_pages", w0)] == 12  # session leases
    assert samples[("radixserve_session_lease_hits_total", w0)] == 3
    assert samples[("radixserve_session_lease_lost_tokens_total", w0)] == 40
    active = (("configured", "adaptive"), ("policy", "lfu"), ("worker", "0"))
    assert samples[("radixserve_eviction_policy_active", active)] == 1
    assert (
        samples[("radixserve_eviction_regret_tokens_total", (("policy", "lru"), ("worker", "0")))]
        == 64
    )
    live = (("policy", "lfu"), ("worker", "0"))  # the live cache's own regret
    assert samples[("radixserve_cache_regret_tokens_total", live)] == 16
    assert (
        "radixserve_kv_pages_free",
        (("worker", "1"),),
    ) not in samples  # gauges of live workers only
    assert samples[("radixserve_memory_pool_bytes", (("device", "cpu"), ("worker", "0")))] == 3
    # The draft model's KV pool (speculative decoding), beside the model's.
    assert samples[("radixserve_spec_draft_kv_pages", w0)] == 24
    assert samples[("radixserve_spec_draft_kv_pages_free", w0)] == 20
    assert samples[("radixserve_spec_draft_kv_pages_evictable", w0)] == 3
    assert samples[("radixserve_spec_draft_kv_pool_bytes", w0)] == 4096
    assert samples[("radixserve_time_to_first_token_seconds_count", w0)] == 1
    assert (
        samples[
            ("radixserve_requests_finished_total", (("finish_reason", "length"), ("worker", "0")))
        ]
        == 1
    )
    assert samples[("radixserve_router_requests_total", ())] == 10
    line = memory_line(_stats().workers[0])
    assert line.startswith("memory: worker 0 cpu: ") and "60/30/10 of 100 (10.0% in use)" in line


def test_sse_and_error_shape() -> None:
    assert event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode() and DONE == b"data: [DONE]\n\n"
    assert APIError(404, "nope", code="model_not_found").body() == {
        "error": {
            "message": "nope",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }


def test_token_bytes_rejoin_split_characters(tiny_llama_dir: Any) -> None:
    from transformers import AutoTokenizer

    names = TokenNames(AutoTokenizer.from_pretrained(str(tiny_llama_dir)))
    text = "héllo → ✓ 日本"
    ids = names.tokenizer.encode(text)
    assert b"".join(names.bytes(i) for i in ids).decode() == text
    assert TokenNames().text(7) == "token_id:7"


def test_finals_fails_at_the_first_error_and_closes_the_rest() -> None:
    """A batch whose second prompt fails at once must not wait for the first to finish."""
    closed: list[str] = []

    class Quiet:  # an HTTP request whose client never goes away
        async def receive(self) -> dict[str, Any]:
            await asyncio.Event().wait()
            return {}

    async def endless() -> AsyncIterator[Any]:
        try:
            await asyncio.Event().wait()  # a long generation
            yield None
        finally:
            closed.append("endless")

    async def failing() -> AsyncIterator[Any]:
        raise APIError(400, "prompt too long", code="context_length_exceeded")
        yield None

    async def main() -> None:
        with pytest.raises(APIError, match="prompt too long"):
            await asyncio.wait_for(finals(Quiet(), [endless(), failing()]), timeout=30)  # type: ignore[arg-type]

    asyncio.run(main())
    assert closed == ["endless"]  # cancelled: its request is aborted


def test_warm_streaming_loads_what_a_first_stream_would() -> None:
    """The gateway's start-up (app lifespan) runs warm_streaming, so that a first streamed
    response does not import anyio's stream modules itself (~5 ms of its time to first
    token). In a fresh interpreter: not loaded before, loaded after."""
    import subprocess
    import sys

    code = (
        "import asyncio, sys\n"
        "from radixserve.serving.http.sse import warm_streaming\n"
        "before = 'anyio.streams.memory' in sys.modules\n"
        "asyncio.run(warm_streaming())\n"
        "print(before, 'anyio.streams.memory' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_health_says_503_while_serve_warms_up() -> None:
    """/health is not ready while ``serve`` sends its warm-up request (Gateway.warming_up):
    a client that waits for it sends its first request after the warm-up."""
    from fastapi.testclient import TestClient

    from radixserve.serving.http.app import create_app
    from radixserve.serving.http.gateway import GatewayConfig

    app = create_app(GatewayConfig(router="tcp://127.0.0.1:9"))
    with TestClient(app) as c:
        app.state.gateway.warming_up = True
        r = c.get("/health")
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "warming_up"


def test_reasoning_effort_reaches_templates_that_read_it() -> None:
    """As vLLM and SGLang do, ``reasoning_effort`` is handed to the template (gpt-oss's reads
    it); a template that does not read it would ignore it, so that is a 400, as is a value
    OpenAI does not have."""
    from radixserve.serving.http.chat_tools import with_reasoning_effort

    reads = "{{ reasoning_effort | default('medium') }}{% for m in messages %}{% endfor %}"
    assert with_reasoning_effort(None, None, "x", "reasoning_effort") is None
    assert with_reasoning_effort({"a": 1}, "low", reads, "reasoning_effort") == {
        "reasoning_effort": "low",
        "a": 1,
    }
    # One set in chat_template_kwargs itself stands.
    kept = with_reasoning_effort({"reasoning_effort": "high"}, "low", reads, "reasoning_effort")
    assert kept == {"reasoning_effort": "high"}
    for effort, template in (("low", "{{ messages }}"), ("low", None), ("extreme", reads)):
        with pytest.raises(APIError) as e:
            with_reasoning_effort(None, effort, template, "reasoning.effort")
        assert e.value.status == 400 and e.value.body()["error"]["param"] == "reasoning.effort"
