"""``radixserve keys`` / ``serve --keys --api-key`` / ``worker``/``client --keys`` as an operator runs them."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from test_serve_cli import CLI, Serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


@pytest.mark.parametrize(
    "flags",
    [
        ("--worker-endpoint", "tcp://0.0.0.0:*"),
        ("--host", "0.0.0.0"),
        ("--http-port", "0", "--http-host", "0.0.0.0"),
    ],
)
def test_public_addresses_are_refused_without_keys(
    tiny_llama_dir: Path, flags: tuple[str, ...]
) -> None:
    out = _run("serve", "--model", str(tiny_llama_dir), "--workers", "0", "--port", "0", *flags)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "refusing to bind" in out.stderr and "--insecure" in out.stderr
    assert "starting" not in out.stdout  # refused before any worker started


def test_gateway_refuses_a_public_address_without_api_key() -> None:
    out = _run("gateway", "--host", "0.0.0.0", "--port", "0")
    assert out.returncode == 1 and "refusing to bind the HTTP endpoint" in out.stderr


def test_serve_with_keys(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve --keys`` with an API key from the environment on a public HTTP address: the
    local worker and the in-process gateway get minted CURVE keys, the join is logged at
    the default log level, HTTP needs the key, a client with the key file is served."""
    made = _run("keys", str(tmp_path / "keys"))
    assert made.returncode == 0, made.stderr
    keys = tmp_path / "keys"
    monkeypatch.setenv("RADIXSERVE_API_KEY", "sk-from-env")
    srv = Serve(
        tiny_llama_dir,
        workers=1,
        extra=("--keys", str(keys / "router"), "--http-port", "0", "--http-host", "0.0.0.0"),
    )  # public, but with a key
    try:
        join = srv.wait_for(r"worker 0 joined: identity \S+, address ([\w.:]+), key ([\w-]+)")
        assert join.group(2) == "local-worker-0"
        port = srv.wait_for(r"HTTP on http://\S+:(\d+)").group(1)
        endpoint = srv.wait_for(r"serving on (tcp://\S+)").group(1)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            body = {"model": "default", "prompt": "Hi", "max_tokens": 2}
            assert c.post("/v1/completions", json=body).status_code == 401
            r = c.post(
                "/v1/completions", json=body, headers={"Authorization": "Bearer sk-from-env"}
            )
            assert r.status_code == 200, r.text
        ok = _run(
            "client",
            "--endpoint",
            endpoint,
            "--keys",
            str(keys / "client"),
            "Hello",
            "--max-tokens",
            "2",
        )
        assert ok.returncode == 0 and "prompt" in ok.stderr, ok.stderr
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(30)
        srv.kill()
    assert rc == 0
