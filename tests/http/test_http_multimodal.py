"""A multimodal checkpoint served as its text model over HTTP: ``radixserve serve`` on a tiny
Gemma 3 ``Gemma3ForConditionalGeneration`` checkpoint (``tests/model/test_gemma_vs_hf.py``
checks its tokens and logprobs against transformers) answers text chat requests, and a
request carrying an image gets a 400 that says why, from each API that takes content parts
(chat completions, Responses, Messages), with the server still answering after them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tiny_models
from http_helpers import serve, stop

IMAGE = "data:image/png;base64,iVBORw0KGgo="


@pytest.fixture(scope="module")
def gemma3_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model_type, overrides = tiny_models.GEMMA_QUIRKS["gemma3_multimodal"]
    path = tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("gemma3_mm_http") / "model", model_type, tokenizer=True, **overrides
    )
    srv = serve(Path(path))
    yield srv
    stop(srv)


def _chat(content: Any) -> dict[str, Any]:
    return {
        "model": "model",
        "max_tokens": 4,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": content}],
    }


def test_text_answered_images_refused(gemma3_server: Any) -> None:
    with gemma3_server.client() as c:
        ok = c.post("/v1/chat/completions", json=_chat("Hello there"))
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 4
        parts = [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": IMAGE}},
        ]
        bad = c.post("/v1/chat/completions", json=_chat(parts))
        assert bad.status_code == 400
        err = bad.json()["error"]
        assert "'image_url' content parts are not supported" in err["message"]
        assert err["type"] == "invalid_request_error"
        responses = c.post(
            "/v1/responses",
            json={
                "model": "model",
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}]}
                ],
            },
        )
        assert responses.status_code == 400 and "input_image" in responses.text
        image = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "AA"},
        }
        messages = c.post(
            "/v1/messages",
            json={
                "model": "model",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [image]}],
            },
        )
        assert messages.status_code == 400 and "image" in messages.text
        again = c.post("/v1/chat/completions", json=_chat("Hello there"))
        assert again.status_code == 200
        assert again.json()["choices"][0]["message"] == ok.json()["choices"][0]["message"]
