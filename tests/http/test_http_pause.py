"""Pausing generation on the real server, as RL loops do around a weight update: SGLang's
``/pause_generation`` and ``/continue_generation``, vLLM's ``/pause``, ``/resume`` and
``/is_paused``.

A rollout retracted by a pause waits out a weight update and ends with the new weights'
continuation of what it had (the weights that finished it are the ones it reports), while
a request sent during the pause is held and runs wholly on the new weights; one kept in
place ends exactly as if never paused, and a weight update meanwhile is refused; an abort
ends the running request; a bad mode changes nothing. Every test leaves the server
generating, on its own weights, with no KV page held."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import tiny_models
from engine_helpers import hf_greedy, random_prompts
from http_helpers import wait_idle

LONG = 400  # tokens: a rollout still running when the pause comes after its first chunk
PROMPT, OTHER_PROMPT = random_prompts([11, 7], seed=61)


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_tiny_llama(tmp_path_factory.mktemp("pause_weights"), seed=43)


def _body(prompt: list[int], n: int, stream: bool) -> dict[str, Any]:
    params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    return {"input_ids": prompt, "sampling_params": params, "stream": stream}


def _generate(c: httpx.Client, prompt: list[int], n: int) -> dict[str, Any]:
    r = c.post("/generate", json=_body(prompt, n, False), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def uninterrupted(server: Any) -> list[int]:
    """The rollout's tokens on the server's own weights, never paused."""
    with server.client() as c:
        return list(_generate(c, PROMPT, LONG)["output_ids"])


@contextmanager
def _rollout(c: httpx.Client) -> Iterator[Iterator[dict[str, Any]]]:
    """The rollout streaming, its first chunk read (it runs): its remaining events."""
    with c.stream("POST", "/generate", json=_body(PROMPT, LONG, True), timeout=120) as r:
        events = (
            json.loads(line.removeprefix("data:"))
            for line in r.iter_lines()
            if line.startswith("data:") and line != "data: [DONE]"
        )
        next(events)
        yield events


@contextmanager
def _restored(c: httpx.Client, server: Any) -> Iterator[None]:
    """Whatever happens: generating again, on the server's own weights, nothing held."""
    try:
        yield
    finally:
        assert c.post("/continue_generation").status_code == 200
        if c.get("/get_weight_version").json()["weight_version"] != "default":
            body = {"model_path": str(server.model_dir), "weight_version": "default"}
            assert c.post("/update_weights_from_disk", json=body, timeout=120).json()["success"]
        assert c.get("/is_paused").json() == {"is_paused": False}
        assert wait_idle(c)["workers"][0]["engine"]["invariants"] == "ok"


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()


def test_a_retracted_rollout_finishes_on_the_new_weights_and_new_requests_wait_for_them(
    server: Any, other_weights: Path, uninterrupted: list[int]
) -> None:
    with server.client() as c, _restored(c, server), ThreadPoolExecutor(1) as pool:
        with _rollout(c) as events:
            paused = _ok(c.post("/pause_generation", json={"mode": "retract"}))
            assert paused == {"message": "Generation paused successfully.", "status": "ok"}
            assert c.get("/is_paused").json() == {"is_paused": True}
            assert c.post("/flush_cache").status_code == 200  # retracted: nothing holds KV
            held = pool.submit(_generate, server.client(), OTHER_PROMPT, 5)
            update = {"model_path": str(other_weights), "weight_version": "rl-step-1"}
            assert _ok(c.post("/update_weights_from_disk", json=update, timeout=120))["success"]
            assert not held.done()  # held by the pause, though the update is done
            _ok(c.post("/continue_generation"))
            last = list(events)[-1]
        out = last["output_ids"]
        assert (len(out), last["meta_info"]["weight_version"]) == (LONG, "rl-step-1")
        k = next(i for i, (x, y) in enumerate(zip(out, uninterrupted)) if x != y)
        assert 1 <= k < LONG  # the pause came mid-way: the old weights' tokens, then the new's
        assert out[k : k + 5] == hf_greedy(other_weights, PROMPT + out[:k], 5)
        answer = held.result(timeout=120)
        assert answer["output_ids"] == hf_greedy(other_weights, OTHER_PROMPT, 5)
        assert answer["meta_info"]["weight_version"] == "rl-step-1"


def test_kept_in_place_a_rollout_ends_as_if_never_paused_and_weights_wait(
    server: Any, other_weights: Path, uninterrupted: list[int]
) -> None:
    with server.client() as c, _restored(c, server):
        with _rollout(c) as events:
            assert _ok(c.post("/pause", params={"mode": "keep"})) == {"status": "paused"}
            assert c.post("/flush_cache").status_code == 400  # kept in place: it holds KV
            update = {"model_path": str(other_weights)}
            refused = c.post("/update_weights_from_disk", json=update, timeout=120)
            assert refused.status_code == 400 and "paused in place" in refused.json()["message"]
            assert _ok(c.post("/resume")) == {"status": "resumed"}
            last = list(events)[-1]
        assert last["output_ids"] == uninterrupted
        assert last["meta_info"]["weight_version"] == "default"


def test_an_abort_pause_ends_the_rollout_and_a_bad_mode_changes_nothing(server: Any) -> None:
    with server.client() as c, _restored(c, server):
        bad = c.post("/pause_generation", json={"mode": "sideways"})
        assert bad.status_code == 400 and c.get("/is_paused").json() == {"is_paused": False}
        assert c.post("/pause", params={"mode": "retract"}).status_code == 400  # not vLLM's
        with _rollout(c) as events:
            assert _ok(c.post("/pause", params={"clear_cache": "true"})) == {"status": "paused"}
            last = list(events)[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < last["meta_info"]["completion_tokens"] < LONG
        engine = wait_idle(c)["workers"][0]["engine"]
        assert engine["pages_evictable"] == 0  # cleared: nothing ran after the abort
        _ok(c.post("/resume"))
        assert len(_generate(c, OTHER_PROMPT, 3)["output_ids"]) == 3
