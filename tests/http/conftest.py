"""One real ``radixserve serve --http-port 0`` process on the tiny Llama, shared by the HTTP tests.

The server (router + one worker process + the HTTP gateway thread) starts once per session
and is stopped with SIGTERM at the end; the fixture checks that it and its worker exit.
Its stdout is read by a thread, so tests can wait for log lines (the memory line).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from http_helpers import (
    AGENT_KEYS,
    ENGINE_FLAGS,
    TEMPLATES,
    Server,
    gone,
    serve,
    start,
    stop,
)


@pytest.fixture(scope="session")
def server(
    tiny_llama_dir: Path, tiny_lora_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """``radixserve serve --http-port 0`` on the tiny Llama (memory log every 0.5 s), with
    one LoRA adapter, ``sql`` (test_http_lora.py; the base model's requests run as without
    it). Its ZeroMQ clients connect over ipc: the kernel names their user there, so the
    gateways the tests start in this process (the same user) may flush the cache
    (docs/security.md)."""
    sock = tmp_path_factory.mktemp("http-server") / "clients.sock"
    out = start(
        [
            "serve",
            "--model",
            str(tiny_llama_dir),
            "--workers",
            "1",
            "--endpoint",
            f"ipc://{sock}",
            "--http-port",
            "0",
            "--memory-log-interval",
            "0.5",
            "--lora-paths",
            f"sql={tiny_lora_dir}",
            "--trust-request-chat-template",  # test_http_chat_template.py
            *ENGINE_FLAGS,
        ]
    )
    try:
        url = out.wait_for(r"HTTP on (http://\S+)", timeout=400).group(1)  # a loaded machine
        m = out.wait_for(r"serving on (ipc://\S+) .*worker pids (\d+)")
    except BaseException:
        out.stop()
        raise
    srv = Server(url, m.group(1), tiny_llama_dir, out, [int(m.group(2))])
    with srv.client() as c:  # the gateway answers once the worker joined
        assert c.get("/health").status_code == 200
    yield srv
    assert out.stop() == 0, "".join(out.seen)
    assert all(gone(pid) for pid in srv.worker_pids), "a worker outlived the server"


@pytest.fixture(scope="session")
def tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="session")
def agent_server(tiny_llama_dir: Path) -> Iterator[Server]:
    """``serve`` on the tiny Llama with Qwen3's chat template (``--chat-template``: tools
    rendered, the hermes parser), the qwen3 reasoning parser, two API keys (two tenants) and
    speculative decoding (ngram drafter): the server of the Responses, Messages,
    agent-framework and speculative HTTP tests (greedy output is the same with speculation;
    constrained requests never draft)."""
    srv = serve(
        tiny_llama_dir,
        "--chat-template",
        str(TEMPLATES / "qwen3.jinja"),
        "--reasoning-parser",
        "qwen3",
        "--api-key",
        AGENT_KEYS[0],
        "--api-key",
        AGENT_KEYS[1],
        "--speculative-algorithm",
        "ngram",
    )
    yield srv
    stop(srv)
