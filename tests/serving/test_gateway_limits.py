"""The HTTP gateway's limits, in front of a router with two fake workers: a huge body is
refused unread (413) while another client is served, a lone surrogate is a 400 naming its
field, and a batch over the limit is a 400."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve.serving.http.gateway import GatewayConfig
from radixserve.serving.http.server import HTTPGateway
from radixserve.serving.wire.limits import RequestLimits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

LIMITS = RequestLimits(max_request_bytes=1 << 20, max_batch_size=4)


@pytest.fixture
def gateway(fake_server: Any, tokenizer: Any) -> Iterator[tuple[Any, HTTPGateway]]:
    srv = fake_server(num_workers=2, context_length=4096)
    http = HTTPGateway(
        GatewayConfig(router=srv.endpoint, limits=LIMITS, memory_log_interval_s=0),
        port=0,
        tokenizer=tokenizer,
    ).start()
    try:
        yield srv, http
    finally:
        http.stop()


def _status_of(sock: socket.socket, timeout: float = 20.0) -> int:
    """Read a raw HTTP response's status code."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


def test_huge_body_refused_unread_while_another_client_is_served(gateway: Any) -> None:
    srv, http = gateway
    body_len = 50_000_000  # the 50 MB chat request
    huge = socket.create_connection((http.host, http.port))
    chunked = socket.create_connection((http.host, http.port))
    try:
        # Declared length over the limit, body held back until the server agrees (curl's
        # "Expect: 100-continue"): the answer comes before a byte of the body is sent.
        huge.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % body_len
        )
        # Chunked (no length): counted as it arrives, refused once past the limit; the body
        # never ends (no last chunk), so only a refusal mid-body can answer it.
        chunked.sendall(
            b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        piece = b'{"text": "' + b"hello world " * 20_000
        sent = 0
        while sent < 2 * LIMITS.max_request_bytes:
            chunked.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        small: dict[str, Any] = {}

        def other_client() -> None:
            with httpx.Client(base_url=http.url, timeout=30) as c:
                r = c.post(
                    "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 3}
                )
                small.update(status=r.status_code, body=r.json())

        t = threading.Thread(target=other_client)
        t.start()
        assert _status_of(huge) == 413
        assert _status_of(chunked) == 413
        t.join(30)
        assert small["status"] == 200 and small["body"]["usage"]["completion_tokens"] == 3, small
    finally:
        huge.close()
        chunked.close()
    assert [p.poll() for p in srv.procs] == [None, None]
    with httpx.Client(base_url=http.url, timeout=30) as c:
        # Clients that write their whole body before reading (httpx, the OpenAI SDK) read the
        # 413 too, not a connection reset: the rest of the body is dropped first.
        for size in (3 * LIMITS.max_request_bytes, 30 * LIMITS.max_request_bytes):
            r = c.post(
                "/v1/chat/completions",
                content=b"x" * size,
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        info = c.get("/get_server_info").json()
        assert [w["alive"] for w in info["workers"]] == [True, True]
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "default",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "again"}],
            },
        )
        assert r.status_code == 200


def test_lone_surrogate_is_a_400_naming_the_field(gateway: Any) -> None:
    _, http = gateway
    cases = [
        (
            "/v1/chat/completions",
            '{"model": "default", "max_tokens": 2, "messages": '
            '[{"role": "user", "content": "hi \\udc80"}]}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            '{"model": "default", "max_tokens": 2, "stop": ["\\ud800"], '
            '"messages": [{"role": "user", "content": "hi"}]}',
            "stop[0]",
        ),
        (
            "/generate",
            '{"text": ["ok", "x\\uDFFF"], "sampling_params": {"max_new_tokens": 2}}',
            "text[1]",
        ),
        (
            "/v1/completions",
            '{"model": "default", "prompt": "ok", "max_tokens": 2, "user": "\\udc80"}',
            "user",
        ),
    ]
    with httpx.Client(base_url=http.url, timeout=30) as c:
        for path, body, field in cases:
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["param"] == field and err["message"].startswith(
                f"{field}: not valid Unicode"
            ), err
        # A valid surrogate pair (one emoji) is ordinary text.
        r = c.post(
            "/v1/chat/completions",
            content='{"model": "default", "max_tokens": 2, "messages": '
            '[{"role": "user", "content": "hi \\ud83d\\ude00"}]}',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 200, r.text


def test_batch_over_the_limit_is_refused(gateway: Any) -> None:
    _, http = gateway
    with httpx.Client(base_url=http.url, timeout=30) as c:
        r = c.post(
            "/generate",
            json={"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 1, "n": 2}},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "batch_too_large", r.text
        r = c.post(
            "/v1/completions",
            json={"model": "default", "prompt": ["a", "b", "c", "d", "e"], "max_tokens": 1},
        )
        assert r.status_code == 400 and "5 generations" in r.json()["error"]["message"]
        r = c.post(
            "/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1, "n": 2}}
        )
        assert r.status_code == 200 and len(r.json()) == 4
        assert json.loads(c.get("/get_server_info").text)["active"] == 0
