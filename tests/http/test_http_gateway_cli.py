"""``radixserve gateway --router ENDPOINT``: a separate gateway process in front of a running router."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
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


def test_gateway_over_https(server: Any, tmp_path: Path) -> None:
    """``--ssl-keyfile`` / ``--ssl-certfile``: the gateway speaks HTTPS only; a client that
    trusts the certificate's CA gets its answers, a plain HTTP request gets none."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_pem, cert_pem = tmp_path / "key.pem", tmp_path / "cert.pem"
    cert.private_key_pem.write_to_path(str(key_pem))
    cert.cert_chain_pems[0].write_to_path(str(cert_pem))
    gw = start(
        ["gateway", "--router", server.endpoint, "--port", "0", "--memory-log-interval", "0"]
        + ["--ssl-keyfile", str(key_pem), "--ssl-certfile", str(cert_pem)]
    )
    try:
        url = gw.wait_for(r"HTTP gateway on (https://\S+)").group(1)
        trusted = ssl.create_default_context()
        ca.configure_trust(trusted)
        with httpx.Client(base_url=url, verify=trusted, timeout=60) as c:
            assert c.get("/health").status_code == 200
            body = {"model": "default", "prompt": "Hi", "max_tokens": 2}
            assert c.post("/v1/completions", json=body).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # an unknown CA: refused
            httpx.get(url + "/health", timeout=10)
    finally:
        code = gw.stop()
    assert code == 0, "".join(gw.seen)


def test_tls_flags_are_checked_before_anything_starts(tmp_path: Path) -> None:
    import argparse

    from radixserve.commands.gateway import tls_files

    key = tmp_path / "key.pem"
    key.write_text("x")
    for ssl_keyfile, ssl_certfile, says in [
        (str(key), None, "go together"),
        (str(key), str(tmp_path / "missing.pem"), "no file"),
    ]:
        args = argparse.Namespace(ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)
        with pytest.raises(ValueError, match=says):
            tls_files(args)
    assert tls_files(argparse.Namespace(ssl_keyfile=None, ssl_certfile=None)) is None
