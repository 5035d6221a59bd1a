"""Speculative decoding through the real server (the agent server speculates with the ngram
drafter): a sampled request's usage reports its accepted and rejected drafts (OpenAI's
predicted-output fields), /metrics' speculative counters grow by them, and the same seed
gives the same text twice."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from http_helpers import AGENT_KEYS, Server
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow  # a real server process

# Four tokens of unequal weight (a logit bias over the random model), and a prompt that holds
# every pair of them with a follower, so the ngram drafter drafts at every decode step (as in
# tests/engine/test_speculative_sampling.py).
BIAS = {"10": 10.0, "11": 9.4, "12": 8.8, "13": 8.2}
CYCLE = [10, 10, 11, 10, 12, 10, 13, 11, 11, 12, 11, 13, 12, 12, 13, 13]
PROMPT = CYCLE * 2 + CYCLE[:1]
SPEC = ("radixserve_spec_verifies_total", "radixserve_spec_draft_tokens_total")
ACCEPTED = "radixserve_spec_accepted_tokens_total"


def _spec_counters(c: httpx.Client) -> dict[str, float]:
    r = c.get("/metrics")
    assert r.status_code == 200
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name.startswith("radixserve_spec_"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _complete(c: httpx.Client, seed: int) -> dict[str, Any]:
    r = c.post(
        "/v1/completions",
        json={
            "model": "default",
            "prompt": PROMPT,
            "max_tokens": 24,
            "temperature": 0.8,
            "seed": seed,
            "logit_bias": BIAS,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_sampled_request_reports_its_drafts_and_metrics_grow(agent_server: Server) -> None:
    headers = {"Authorization": f"Bearer {AGENT_KEYS[0]}"}
    with agent_server.client(headers=headers) as c:
        before = _spec_counters(c)
        assert set(SPEC) | {ACCEPTED} <= set(before)
        first, again = _complete(c, seed=3), _complete(c, seed=3)
        after = _spec_counters(c)
    details = first["usage"]["completion_tokens_details"]
    accepted, rejected = (
        details["accepted_prediction_tokens"],
        details["rejected_prediction_tokens"],
    )
    assert accepted > 0 and rejected > 0  # rejection sampling kept some drafts, not all
    assert first["choices"][0]["text"] == again["choices"][0]["text"]  # seeded: repeatable
    assert again["usage"]["completion_tokens_details"] == details
    for name in SPEC:
        assert after[name] > before[name], name
    assert after[ACCEPTED] - before[ACCEPTED] >= 2 * accepted
