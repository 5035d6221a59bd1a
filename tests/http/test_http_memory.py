"""Memory released and resumed on the real server, as RL loops do around a training step:
SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation``, vLLM's
``/sleep``, ``/wake_up`` and ``/is_sleeping``.

A release while a rollout runs is refused; retracted by a pause, the rollout waits out a
release of everything, the weights' resume and an update, then ends with the new weights'
continuation of what it had, while a request sent meanwhile is held and runs wholly on them.
vLLM's level 1 keeps the weights: a request held over it answers as before. Bad tags and
levels are 400s that change nothing. Every test leaves the server awake and generating, on
its own weights, with no KV page held; ``/health_generate`` answers a 503 at once while
paused or asleep, 200 after (the admin key's part: tests/http/test_http_auth.py)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import tiny_models
from engine_helpers import hf_greedy
from http_helpers import wait_idle
from test_http_pause import LONG, OTHER_PROMPT, PROMPT, _generate, _ok, _rollout

ALL = {"tags": ["kv_cache", "weights"]}


@pytest.fixture(scope="module")
def next_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_tiny_llama(tmp_path_factory.mktemp("sleep_weights"), seed=47)


@contextmanager
def _awake(c: httpx.Client, server: Any) -> Iterator[None]:
    """Whatever happens: awake, generating, on the server's own weights, nothing held."""
    try:
        yield
    finally:
        assert c.post("/resume_memory_occupation").status_code == 200
        assert c.post("/continue_generation").status_code == 200
        if c.get("/get_weight_version").json()["weight_version"] != "default":
            body = {"model_path": str(server.model_dir), "weight_version": "default"}
            assert c.post("/update_weights_from_disk", json=body, timeout=120).json()["success"]
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        assert c.get("/health_generate").status_code == 200
        assert wait_idle(c)["workers"][0]["engine"]["invariants"] == "ok"


def _unready(c: httpx.Client) -> tuple[str, str]:
    """``/health_generate``'s 503 (code, message): answered at once, not held like a
    request (the client's timeout is far under a held request's wait)."""
    probe = c.get("/health_generate", timeout=10)
    assert probe.status_code == 503, probe.text
    error = probe.json()["error"]
    return error["code"], error["message"]


def test_an_rl_step_releases_everything_and_the_rollouts_end_on_the_new_weights(
    server: Any, next_policy: Path
) -> None:
    with server.client() as c, _awake(c, server), ThreadPoolExecutor(1) as pool:
        with _rollout(c) as events:
            refused = c.post("/release_memory_occupation", json=ALL)
            assert refused.status_code == 400 and "pause with mode" in refused.json()["message"]
            assert c.get("/is_sleeping").json() == {"is_sleeping": False}
            _ok(c.post("/pause_generation", json={"mode": "retract"}))
            assert _unready(c) == ("paused", "generation paused (retract)")
            released = _ok(c.post("/release_memory_occupation", json=ALL))
            assert released == {"message": "Memory released successfully.", "status": "ok"}
            assert c.get("/is_sleeping").json() == {"is_sleeping": True}
            assert _unready(c) == ("asleep", "memory released (kv_cache, weights)")
            held = pool.submit(_generate, server.client(), OTHER_PROMPT, 5)
            _ok(c.post("/continue_generation"))  # still asleep: nothing runs
            update = {"model_path": str(next_policy), "weight_version": "rl-step-2"}
            early = c.post("/update_weights_from_disk", json=update, timeout=120)
            assert early.status_code == 400 and "resume them first" in early.json()["message"]
            _ok(c.post("/resume_memory_occupation", json={"tags": ["weights"]}))
            assert _ok(c.post("/update_weights_from_disk", json=update, timeout=120))["success"]
            assert c.get("/is_sleeping").json() == {"is_sleeping": True}  # the KV cache's
            assert not held.done()
            _ok(c.post("/resume_memory_occupation"))  # no body: every tag
            last = list(events)[-1]
        out = last["output_ids"]
        assert (len(out), last["meta_info"]["weight_version"]) == (LONG, "rl-step-2")
        old = hf_greedy(server.model_dir, PROMPT, LONG)  # the rollout on the old weights
        k = next(i for i, (x, y) in enumerate(zip(out, old)) if x != y)
        assert 1 <= k < LONG  # released mid-way: the old weights' tokens, then the new's
        assert out[k : k + 5] == hf_greedy(next_policy, PROMPT + out[:k], 5)
        answer = held.result(timeout=120)
        assert answer["output_ids"] == hf_greedy(next_policy, OTHER_PROMPT, 5)


def test_vllm_sleep_level_1_keeps_the_weights_and_bad_inputs_change_nothing(server: Any) -> None:
    with server.client() as c, _awake(c, server), ThreadPoolExecutor(1) as pool:
        for bad in (
            c.post("/sleep", params={"level": 3}),
            c.post("/sleep", params={"level": "deep"}),
            c.post("/wake_up", params={"tags": ["weights", "gpu"]}),
            c.post("/release_memory_occupation", json={"tags": ["gpu"]}),
            c.post("/resume_memory_occupation", json={"tags": "kv_cache"}),
        ):
            assert bad.status_code == 400, bad.text
        assert "the tags are kv_cache, weights, cuda_graph" in c.post("/wake_up?tags=gpu").text
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        _ok(c.post("/release_memory_occupation", json={"tags": []}))  # SGLang's: none
        # SGLang's CUDA graphs' tag (verl names it): the CPU engine has none to release.
        _ok(c.post("/release_memory_occupation", json={"tags": ["cuda_graph"]}))
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        assert len(_generate(c, OTHER_PROMPT, 2)["output_ids"]) == 2  # nothing held
        slept = c.post("/sleep", params={"level": 1})
        assert (slept.status_code, slept.content) == (200, b"")
        assert c.get("/is_sleeping").json() == {"is_sleeping": True}
        assert _unready(c) == ("asleep", "memory released (kv_cache)")
        held = pool.submit(_generate, server.client(), OTHER_PROMPT, 5)
        woke = c.post("/wake_up", params={"tags": ["kv_cache"]})
        assert (woke.status_code, woke.content) == (200, b"")
        answer = held.result(timeout=120)
        assert answer["output_ids"] == hf_greedy(server.model_dir, OTHER_PROMPT, 5)
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
