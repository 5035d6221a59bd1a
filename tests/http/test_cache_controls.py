"""The cache controls a client sends: ``priority`` and ``prompt_cache_retention`` on the
OpenAI bodies, ``priority`` on SGLang's, and the session id + priority crossing the wire
from client to router to worker."""

from __future__ import annotations

import msgspec
import pytest

from radixserve.serving.client.common import generate_request
from radixserve.serving.http.errors import APIError
from radixserve.serving.http.openai_protocol import ChatCompletionRequest, retention_seconds
from radixserve.serving.http.sglang_protocol import GenerateReqInput
from radixserve.serving.wire import protocol as p


def _chat(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    )


def test_prompt_cache_retention_pins_the_prompt_for_that_long() -> None:
    assert retention_seconds("24h") == 86400.0 and retention_seconds("90m") == 5400.0
    assert retention_seconds("in_memory") is None
    assert _chat(prompt_cache_retention="24h").sampling(8, None).pin_ttl_s == 86400.0
    assert _chat(prompt_cache_retention="in_memory").sampling(8, None).pin_ttl_s is None
    assert _chat(prompt_cache_retention="24h", pin_ttl_s=5.0).sampling(8, None).pin_ttl_s == 5.0
    for bad in ("forever", "0h", "24d"):
        with pytest.raises(APIError):
            _chat(prompt_cache_retention=bad).sampling(8, None)


def test_the_responses_api_takes_the_same_cache_controls() -> None:
    from radixserve.serving.http.responses import ResponsesRequest

    def body(**kw: object) -> ResponsesRequest:
        r = ResponsesRequest.model_validate({"model": "m", "input": "hi", **kw})
        r.check()
        return r

    assert body(prompt_cache_retention="24h").pin_ttl_s() == 86400.0
    assert body(prompt_cache_retention="in_memory").pin_ttl_s() is None
    assert body().pin_ttl_s() is None and body().priority == 0
    assert body(priority=5).priority == 5
    with pytest.raises(APIError):
        body(prompt_cache_retention="forever")
    with pytest.raises(ValueError):
        body(priority=10**6)


def test_priority_fields_are_bounded() -> None:
    assert _chat(priority=7).priority == 7 and _chat().priority == 0
    with pytest.raises(ValueError):
        _chat(priority=10**6)
    assert GenerateReqInput.model_validate({"text": "x", "priority": 3}).priority == 3


def test_session_and_priority_cross_the_wire() -> None:
    req = generate_request("r1", "hello", False, {"session_id": "agent-1", "priority": 4})
    back = p.decode_client(p.encode(req))
    assert isinstance(back, p.GenerateRequest)
    assert (back.session_id, back.priority) == ("agent-1", 4)
    wreq = p.WorkerAdd(
        requests=[
            p.WorkerRequest(
                rid="1", input_ids=[1, 2], params=back.params, session_id="agent-1", priority=4
            )
        ]
    )
    got = p.decode_to_worker(p.encode(wreq))
    assert isinstance(got, p.WorkerAdd)
    assert (got.requests[0].session_id, got.requests[0].priority) == ("agent-1", 4)


def test_usage_says_which_tier_the_cached_tokens_came_from() -> None:
    from radixserve.serving.http.openai_reply import usage

    final = p.GenerateFinal(
        request_id="r",
        finish_reason="stop",
        text="",
        token_ids=[1],
        usage=p.Usage(
            prompt_tokens=100,
            cached_tokens=80,
            completion_tokens=1,
            cached_host_tokens=30,
            cached_disk_tokens=10,
        ),
        timings=p.Timings(),
    )
    details = usage([[final]])["prompt_tokens_details"]
    assert details == {
        "cached_tokens": 80,
        "cached_tokens_by_tier": {"device": 40, "host": 30, "disk": 10},
    }


def test_cache_report_is_absent_unless_asked_and_crosses_the_wire() -> None:
    plain = p.Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=1)
    assert b"cache_report" not in p.encode(
        p.StepOutput(request_id="r", new_token_ids=[1], usage=plain)
    )
    rep = p.CacheReport(reason="evicted", cached_tokens=8, diverged_at=9, evicted_by="lru")
    out = p.StepOutput(
        request_id="r", new_token_ids=[1], usage=msgspec.structs.replace(plain, cache_report=rep)
    )
    back = p.decode_from_worker(p.encode(p.WorkerOutputs(outputs=[out], load=p.WorkerLoad())))
    assert isinstance(back, p.WorkerOutputs) and back.outputs[0].usage is not None
    assert back.outputs[0].usage.cache_report == rep
    close = p.decode_client(p.encode(p.CloseSession(request_id="c", session_id="s")))
    assert isinstance(close, p.CloseSession) and close.session_id == "s"
    assert _chat(return_cache_report=True).sampling(8, None).return_cache_report
    assert GenerateReqInput.model_validate({"text": "x", "return_cache_report": True})
