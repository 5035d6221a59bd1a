"""SGLang's own frontend language (``sglang.RuntimeEndpoint``) running programs against radixserve.

Needs an interpreter with the ``sglang`` package. The full package pulls CUDA wheels, but
its frontend imports with a light install; for example, in a throwaway venv that sees the
system packages (torch stays the system's)::

    python -m venv --system-site-packages /tmp/sglvenv
    /tmp/sglvenv/bin/pip install --no-deps sglang && /tmp/sglvenv/bin/pip install aiohttp IPython pybase64 pillow
    RADIXSERVE_SGLANG_PYTHON=/tmp/sglvenv/bin/python pytest tests/http/test_http_sglang_frontend.py

Skipped when no such interpreter is configured (and ``sglang`` is not importable here);
``test_http_sglang.py`` always checks the same request shapes on the wire.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # a real server process


def _sglang_python() -> str | None:
    configured = os.environ.get("RADIXSERVE_SGLANG_PYTHON")
    if configured:
        return configured
    return sys.executable if importlib.util.find_spec("sglang") is not None else None


def test_sglang_frontend_programs(server: Any, tokenizer: Any) -> None:
    python = _sglang_python()
    if python is None:
        pytest.skip("no interpreter with sglang (set RADIXSERVE_SGLANG_PYTHON)")
    script = Path(__file__).with_name("sglang_program.py")
    proc = subprocess.run(
        [python, str(script), server.url], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["model_path"] == str(server.model_dir)  # the loaded path, as SGLang answers
    assert isinstance(out["answer"], str) and out["answer_meta"]["completion_tokens"] <= 8
    assert out["streamed"] == out["answer"]  # greedy, streamed or not
    assert (
        out["batch"] == [b for b in out["batch"] if isinstance(b, str)] and len(out["batch"]) == 2
    )
    assert out["city"] in (" Paris", " London", " Berlin")
    scores = out["city_meta"]["normalized_prompt_logprobs"]
    assert (
        len(scores) == 3
        and out["city"] == [" Paris", " London", " Berlin"][scores.index(max(scores))]
    )
    assert out[
        "number"
    ].isdigit()  # regex-constrained gen through radixserve's constrained decoding
    assert out["forked"].startswith("Two continuations")
    assert "workers" in out["server_info_keys"]
    # Streamed with logprobs through the frontend's text_async_iter: each piece's meta_info has
    # the token count so far and the logprobs of new tokens only, so no token comes twice. The
    # iterator pairs a piece with the newest meta_info when it wakes and merges the meta of
    # pieces without text into the next one, so pieces can lose their logprobs or carry an
    # earlier piece's; what arrives is a subsequence of the unstreamed logprobs, in order
    # (tests/http/test_http_sglang.py checks every message on the wire exactly).
    chunks, unstreamed = out["streamed_lp"], out["unstreamed_lp"]
    assert chunks, "no streamed chunk"
    counts = [c["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == unstreamed["completion_tokens"]
    expected = [t[1] for t in unstreamed["output_token_logprobs"]]
    streamed = [t[1] for c in chunks for t in c["output_token_logprobs"]]
    remaining = iter(expected)
    assert all(tok in remaining for tok in streamed), (streamed, expected)
    for c in chunks:
        assert c["output_token_logprobs_length"] == c["completion_tokens"]
        assert (
            len(c["output_token_logprobs"])
            == len(c["output_top_logprobs"])
            <= c["completion_tokens"]
        )
    assert out["at_least"] == 5  # min_tokens held the stop strings (and EOS) off for 5 tokens
