"""LoRA adapters loaded and unloaded while the shared server serves, through SGLang's
``/load_lora_adapter`` and vLLM's ``/v1/load_lora_adapter`` (and their unloads): a loaded
adapter is listed, named by requests and answers as PEFT's adapted model; an unloaded one
is gone from both; bad names and paths get a 4xx and change nothing. The server ends as it
began, serving ``sql`` alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from engine_helpers import peft_greedy, random_prompts

N = 6


def models(server: Any) -> list[str]:
    return [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]


def test_an_adapter_loaded_while_serving_is_listed_answers_and_unloads(
    server: Any, tiny_attn_lora_dir: Path
) -> None:
    body = {"lora_name": "attn", "lora_path": str(tiny_attn_lora_dir)}
    reply = httpx.post(server.url + "/load_lora_adapter", json=body, timeout=120)
    try:
        assert reply.status_code == 200, reply.text
        out = reply.json()
        assert out["success"] and out["error_message"] == ""
        assert sorted(out["loaded_adapters"]) == ["attn", "sql"]
        assert "attn" in models(server)
        prompt = random_prompts([11], seed=31)[0]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        got = client.completions.create(
            model="attn",
            prompt=prompt,
            max_tokens=N,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert got.choices[0].model_extra["token_ids"] == peft_greedy(  # type: ignore[index]
            server.model_dir, tiny_attn_lora_dir, prompt, N
        )
        # vLLM's load of the same files under the same name: a success that changes nothing.
        again = httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=120)
        assert again.status_code == 200
        assert again.text == "Success: LoRA adapter 'attn' added successfully."
    finally:
        gone = httpx.post(
            server.url + "/v1/unload_lora_adapter", json={"lora_name": "attn"}, timeout=60
        )
    assert gone.status_code == 200, gone.text
    assert gone.text == "Success: LoRA adapter 'attn' removed successfully."
    assert models(server)[1:] == ["sql"]
    with pytest.raises(openai.NotFoundError, match="'attn' does not exist"):
        client.completions.create(model="attn", prompt="x", max_tokens=1)


def test_bad_loads_and_unloads_are_refused_and_change_nothing(
    server: Any, tiny_lora_dir: Path, tmp_path: Path
) -> None:
    def post(path: str, **body: Any) -> httpx.Response:
        return httpx.post(server.url + path, json=body, timeout=60)

    missing = post("/load_lora_adapter", lora_name="x", lora_path=str(tmp_path))
    assert missing.status_code == 400
    assert "adapter_config.json is missing" in missing.json()["error_message"]
    assert not missing.json()["success"]
    other = post("/v1/load_lora_adapter", lora_name="sql", lora_path=str(tmp_path / "no"))
    assert other.status_code == 400 and other.json()["error"]["param"] == "lora_name"
    bad_name = post("/v1/load_lora_adapter", lora_name="a:b", lora_path=str(tiny_lora_dir))
    assert bad_name.status_code == 400 and "name has no whitespace" in bad_name.text
    too_long = post("/load_lora_adapter", lora_name="a" * 129, lora_path=str(tiny_lora_dir))
    assert too_long.status_code == 400
    unknown = post("/unload_lora_adapter", lora_name="nope")
    assert unknown.status_code == 404 and "unknown LoRA adapter 'nope'" in unknown.text
    assert post("/v1/unload_lora_adapter", lora_name="nope").status_code == 404
    assert models(server)[1:] == ["sql"]


def test_an_adapter_loaded_by_another_client_is_seen_by_the_gateway(
    server: Any, tiny_lora_dir: Path
) -> None:
    """Loaded through the router's ZeroMQ protocol, not this gateway: the gateway's model
    list and a request naming the adapter see it at once, and its unload as well."""
    from radixserve.serving.client import Client

    models(server)  # the gateway's view is taken before the load
    with Client(server.endpoint, timeout=60) as c:
        assert c.load_lora_adapter("zmq", str(tiny_lora_dir)).ok
        try:
            assert "zmq" in models(server)
            body = {"model": "zmq", "prompt": [5, 6, 7], "max_tokens": 2}
            ok = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert ok.status_code == 200 and ok.json()["model"] == "zmq"
        finally:
            assert c.unload_lora_adapter("zmq").ok
    assert "zmq" not in models(server)
    gone = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert gone.status_code == 404
