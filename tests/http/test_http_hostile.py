"""Hostile bodies against every POST route of the real server: a small valid body of each
route with one field replaced by any JSON value, dropped, or joined by an unknown one, or
no JSON object at all. Every answer is a 2xx or a 4xx with an error body (never a 5xx, a
hang or a dead worker), and afterwards nothing runs, no KV page is held and the engine's
invariants hold.

The replaced values come from hypothesis's JSON strategies (nested, unicode, huge and
negative numbers, nulls); the length fields (``max_tokens`` and its kin, ``n``) keep their
small values, so a mutated body that is still valid generates a few tokens, not the
context."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from http_helpers import wait_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Hi"}]
# A small valid body of each POST route (the shared server: tests/http/conftest.py).
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "default", "messages": CHAT, "max_tokens": 2},
    "/v1/completions": {"model": "default", "prompt": "Hi", "max_tokens": 2},
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
    "/abort_request": {"rid": "nobody"},
    "/v1/responses": {"model": "default", "input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "default", "messages": CHAT, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "default", "messages": CHAT},
    "/close_session": {"session_id": "s"},
    "/tokenize": {"model": "default", "prompt": "Hi"},
    "/detokenize": {"model": "default", "tokens": [1, 2]},
    "/load_lora_adapter": {"lora_name": "x", "lora_path": "/nonexistent"},
    "/unload_lora_adapter": {"lora_name": "x"},
    "/update_weights_from_disk": {"model_path": "/nonexistent"},
    "/v1/embeddings": {"model": "default", "input": "Hi"},
    "/encode": {"text": "Hi"},
    "/v1/score": {"model": "default", "text_1": "a", "text_2": ["b"]},
    "/v1/rerank": {"model": "default", "query": "a", "documents": ["b", "c"]},
}
# Valid bodies naming what is not there (no such adapter or checkpoint): a 4xx even so.
NOT_THERE = {"/load_lora_adapter", "/unload_lora_adapter", "/update_weights_from_disk"}
# Fields whose valid values make a request long: kept as they are.
LENGTHS = {"max_tokens", "max_new_tokens", "max_output_tokens", "max_completion_tokens", "n"}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=12,
)


@st.composite
def hostile(draw: st.DrawFn) -> tuple[str, Any]:
    """A route and a body: its valid one with one field replaced, dropped or added, or a
    value that is not an object."""
    route = draw(st.sampled_from(sorted(VALID)))
    body = json.loads(json.dumps(VALID[route]))
    kind = draw(st.sampled_from(["replace", "replace-nested", "drop", "add", "not-an-object"]))
    mutable = [k for k in body if k not in LENGTHS]
    if kind == "not-an-object":
        return route, draw(json_values.filter(lambda v: not isinstance(v, dict)))
    if kind == "add":
        body[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
    elif kind == "drop" and mutable:
        del body[draw(st.sampled_from(mutable))]
    elif kind == "replace-nested" and isinstance(body.get("sampling_params"), dict):
        name = draw(st.sampled_from(["temperature", "top_p", "stop", "regex", "json_schema"]))
        body["sampling_params"][name] = draw(json_values)
    elif mutable:
        body[draw(st.sampled_from(mutable))] = draw(json_values)
    return route, body


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    with server.client(timeout=60) as c:
        yield c


def test_the_valid_bodies_are_valid(client: httpx.Client) -> None:
    """What the mutations start from is accepted (else they would test only refusals)."""
    for route, body in VALID.items():
        r = client.post(route, json=body)
        ok = r.status_code < 300 or (route in NOT_THERE and r.status_code in (400, 404))
        assert ok, (route, r.status_code, r.text)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=hostile())
def test_no_body_gets_a_5xx(client: httpx.Client, case: tuple[str, Any]) -> None:
    route, body = case
    r = client.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (route, body, r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json(), (route, body, r.text)  # an error body saying why


def test_afterwards_nothing_is_held(client: httpx.Client) -> None:
    info = wait_idle(client)
    engine = info["workers"][0]["engine"]
    assert engine["invariants"] == "ok" and engine["pages_in_use"] == 0
