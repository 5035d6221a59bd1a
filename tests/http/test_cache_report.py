"""Miss reports end to end on the shared server: a chat whose system prompt carries a
timestamp (the classic template drift that breaks prefix caching) asks for
``return_cache_report``; every turn after the first diverges at the timestamp's token, and
the server's report (``GET /cache_report``, ``/metrics``, ``radixserve cache-report``) puts
the top divergence position there."""

from __future__ import annotations

from typing import Any

import pytest
from test_http_ops import scrape

from radixserve.cli import main

pytestmark = pytest.mark.slow  # a real server process


def _chat(c: Any, minute: int, **extra: Any) -> dict[str, Any]:
    system = f"You are the build agent. Current time: 12:0{minute}:00 UTC. Answer in one word."
    r = c.post(
        "/v1/chat/completions",
        json={
            "model": "default",
            "max_tokens": 2,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"status of job {minute}?"},
            ],
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def _top_counts(c: Any) -> dict[int, int]:
    report = c.get("/cache_report", params={"top": 100}).json()
    return {e["index"]: e["count"] for e in report["top_divergence"]}


def test_a_drifting_system_prompt_is_explained(server: Any, capsys: Any) -> None:
    """Two turns ask for a report; all five after the first count at the drift's position
    (divergence positions are counted for every prompt, reasons only for those asked)."""
    with server.client() as c:
        plain = _chat(c, 0)  # no report unless asked
        assert "cache_report" not in plain["usage"]["prompt_tokens_details"]
        before = _top_counts(c)
        reports_before = c.get("/cache_report").json()["reports"]
        reports = [
            _chat(c, m, return_cache_report=True)["usage"]["prompt_tokens_details"]["cache_report"]
            for m in (1, 2)
        ]
        for m in (3, 4, 5):
            assert "cache_report" not in _chat(c, m)["usage"]["prompt_tokens_details"]
        at = reports[0]["diverged_at"]
        assert at > 10  # inside the system prompt, past the template's preamble
        for m, rep in enumerate(reports, start=1):
            assert rep["reason"] == "never_cached"
            assert rep["diverged_at"] == at and rep["cached_tokens"] == at // 4 * 4
            assert rep["after"].lstrip().startswith(str(m)), rep
            assert rep["cached_after"].lstrip().startswith(str(m - 1)), rep
            assert "12:0" in rep["before"] + rep["after"]

        report = c.get("/cache_report", params={"top": 3}).json()
        top = report["top_divergence"][0]
        assert (top["index"], top["workers"]) == (at, [0])
        assert top["count"] - before.get(at, 0) == 5  # every prompt, asked or not
        assert report["reports"] - reports_before == 2  # reasons: the two that asked
        assert report["reasons"]["never_cached"] >= 2 and report["prompts"] >= 6

        metrics = scrape(c)
        assert metrics[f"radixserve_cache_divergence_top{{position={at},worker=0}}"] == top["count"]
        assert metrics["radixserve_cache_miss_reasons_total{reason=never_cached,worker=0}"] >= 2
        assert metrics["radixserve_cache_divergence_position_count{worker=0}"] >= 5
        assert metrics["radixserve_cache_divergence_prompts_total{worker=0}"] >= 6

    assert main(["cache-report", "--url", server.url, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert f"{at:>7}  {top['count']:>6}" in out and "never_cached" in out


def _leases(c: Any) -> int:
    info = c.get("/get_server_info").json()
    return sum(w["engine"]["leases_active"] for w in info["workers"] if w["alive"])


def test_sessions_close_from_the_api_in_their_tenants_namespace(server: Any) -> None:
    """Two tenants (cache salts) use the same prompt_cache_key: each turn leases a path in
    its own namespace, and closing one tenant's session releases only that lease."""
    with server.client() as c:
        base = _leases(c)
        for salt in ("tenant-a", "tenant-b"):
            _chat(c, 7, prompt_cache_key="shared-key", cache_salt=salt)
        assert _leases(c) == base + 2
        r = c.delete("/v1/sessions/shared-key", params={"cache_salt": "tenant-a"})
        assert r.status_code == 200 and r.json() == {"session_id": "shared-key", "released": True}
        assert _leases(c) == base + 1  # tenant-b's lease is untouched
        body = {"session_id": "shared-key", "cache_salt": "tenant-a"}
        assert c.post("/close_session", json=body).json()["released"] is False
        body["cache_salt"] = "tenant-b"
        assert c.post("/close_session", json=body).json()["released"] is True
        assert _leases(c) == base
        # ``user`` is a tenant hint, not a session: no lease for it.
        _chat(c, 8, user="alice")
        assert c.post("/close_session", json={"session_id": "alice"}).json()["released"] is False


def test_text_completions_carry_the_session_key_too(server: Any) -> None:
    """``/v1/completions`` takes ``prompt_cache_key`` / ``session_id`` as the chat API does:
    a keyed turn leases its path to that session (an agent framework sending token ids)."""
    with server.client() as c:
        base = _leases(c)
        for key in ("prompt_cache_key", "session_id"):
            body = {"model": "default", "prompt": [5, 6, 7, 8] * 6, "max_tokens": 2, key: key}
            assert c.post("/v1/completions", json=body).status_code == 200
        assert _leases(c) == base + 2
        for key in ("prompt_cache_key", "session_id"):
            assert c.post("/close_session", json={"session_id": key}).json()["released"] is True
        assert _leases(c) == base
