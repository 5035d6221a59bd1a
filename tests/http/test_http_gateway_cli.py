"""``radixserve gateway --router ENDPOINT``: a separate gateway process in front of a running router."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from http_helpers import start

pytestmark = pytest.mark.slow  # real server processes


def test_gateway_process_in_front_of_a_running_router(server: Any) -> None:
    gw = start(
        [
            "gateway",
            "--router",
            server.endpoint,
            "--port",
            "0",
            "--tokenizer",
            str(server.model_dir),
            "--served-model-name",
            "tiny",
            "--memory-log-interval",
            "0.3",
        ]
    )
    try:
        url = gw.wait_for(r"HTTP gateway on (http://\S+)").group(1)
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            # The served name, then the server's LoRA adapter (tests/http/conftest.py).
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "sql"]
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "max_tokens": 3,
                    "logprobs": True,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            assert r.status_code == 200, r.text
            entries = r.json()["choices"][0]["logprobs"]["content"]
            assert entries and not entries[0]["token"].startswith(
                "token_id:"
            )  # --tokenizer names tokens
            assert (
                c.post(
                    "/v1/chat/completions",
                    json={
                        "model": "default",
                        "max_tokens": 1,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                ).status_code
                == 200
            )
            assert (
                c.post(
                    "/v1/chat/completions",
                    json={
                        "model": server.model_dir.name,
                        "max_tokens": 1,
                        "messages": [{"role": "user", "content": "x"}],
                    },
                ).status_code
                == 404
            )
        gw.wait_for(r"\[gateway\] INFO memory: worker 0 cpu: ", timeout=30)
    finally:
        code = gw.stop()
    assert code == 0, "".join(gw.seen)
