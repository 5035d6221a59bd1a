"""SGLang's ``/update_weights_from_disk`` and ``/get_weight_version`` on the shared server:
the weights of another checkpoint of the tiny Llama answer as transformers' (through the
``openai`` client too), the model info names them, the served adapter stays; what is
refused is a 400 that changes nothing; the server ends as it began, on its own weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import tiny_models
from engine_helpers import hf_greedy, random_prompts

N = 5
PROMPT = random_prompts([9], seed=41)[0]


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_tiny_llama(tmp_path_factory.mktemp("other_weights"), seed=42)


def _generated(c: httpx.Client) -> tuple[list[int], str]:
    """The prompt's greedy tokens and the weight version that answered (meta_info)."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True},
    }
    r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"]), r.json()["meta_info"]["weight_version"]


def _tokens(c: httpx.Client) -> list[int]:
    return _generated(c)[0]


def _update(c: httpx.Client, **body: Any) -> httpx.Response:
    return c.post("/update_weights_from_disk", json=body, timeout=120)


def test_new_weights_answer_and_the_old_come_back(server: Any, other_weights: Path) -> None:
    with server.client() as c:
        assert _generated(c) == (hf_greedy(server.model_dir, PROMPT, N), "default")
        r = _update(c, model_path=str(other_weights), weight_version="rl-step-1")
        try:
            assert r.status_code == 200 and r.json()["success"] is True, r.text
            assert r.json()["weight_version"] == "rl-step-1"
            assert c.get("/get_weight_version").json() == {"weight_version": "rl-step-1"}
            info = c.get("/get_model_info").json()
            assert (info["model_path"], info["weight_version"]) == (str(other_weights), "rl-step-1")
            assert _generated(c) == (hf_greedy(other_weights, PROMPT, N), "rl-step-1")
            models = c.get("/v1/models").json()["data"]
            assert "sql" in [m["id"] for m in models]  # the adapter is still served
        finally:
            back = _update(c, model_path=str(server.model_dir), weight_version="default")
        assert back.json()["success"] is True, back.text
        assert _tokens(c) == hf_greedy(server.model_dir, PROMPT, N)
        assert c.get("/get_weight_version").json() == {"weight_version": "default"}


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"model_path": "/no/such/checkpoint"}, 400, "/no/such/checkpoint"),
        ({"model_path": "x", "flush_cache": False}, 400, "always dropped"),
        ({"model_path": "x", "load_format": "pt"}, 400, "load_format"),
        ({"model_path": ""}, 400, "model_path"),
        ({"model_path": "x" * 5000}, 400, "model_path"),
    ],
)
def test_what_is_refused_changes_nothing(
    server: Any, body: dict[str, Any], status: int, says: str
) -> None:
    with server.client() as c:
        r = _update(c, **body)
        assert r.status_code == status and says in r.text, r.text
        assert c.get("/get_weight_version").json() == {"weight_version": "default"}
        assert _tokens(c) == hf_greedy(server.model_dir, PROMPT, N)


def test_abort_all_requests_ends_the_running_ones_first(server: Any, other_weights: Path) -> None:
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
    }
    with server.client() as c:
        with c.stream("POST", "/generate", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            next(lines)  # it runs
            up = _update(c, model_path=str(other_weights), abort_all_requests=True)
            try:
                assert up.json()["success"] is True and up.json()["num_aborted_requests"] == 1
                last = [ln for ln in lines if ln != "data: [DONE]"][-1]
                assert '"type":"abort"' in last.replace(" ", "")
            finally:
                back = _update(c, model_path=str(server.model_dir), weight_version="default")
        assert back.json()["success"] is True, back.text
        assert _tokens(c) == hf_greedy(server.model_dir, PROMPT, N)
