"""Predicted outputs (OpenAI's ``prediction``) through the ``openai`` client against a live
server with no speculative algorithm: the answer is the one given without a prediction,
its drafts are reported as accepted and rejected prediction tokens, and a malformed or
oversized prediction is a 400."""

from __future__ import annotations

from typing import Any

import openai
import pytest

pytestmark = pytest.mark.slow  # a real server process

MESSAGES: Any = [{"role": "user", "content": "Rewrite the function with a docstring."}]


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ask(tokenizer: Any) -> dict[str, Any]:
    """The request's fields: greedy, its output held to whole words. A random model's
    tokens decode to text that encodes back to other tokens (pieces a real model would
    write merged); words each one token, a space before each, encode back to themselves,
    and a frequency penalty varies them as text is varied."""
    words = sorted(
        i
        for piece, i in tokenizer.get_vocab().items()
        if piece.startswith("Ġ") and piece[1:].isalpha() and len(piece) > 3
    )[:24]
    assert len(words) == 24
    return {
        "model": "default",
        "max_tokens": 40,
        "temperature": 0,
        "frequency_penalty": 1.0,
        "logit_bias": {str(i): 40 for i in words},
        "extra_body": {"ignore_eos": True},
    }


def _ask(client: openai.OpenAI, ask: dict[str, Any], **kw: Any) -> Any:
    return client.chat.completions.create(messages=MESSAGES, **ask, **kw)


def test_a_prediction_speeds_the_answer_and_changes_nothing(
    client: openai.OpenAI, ask: dict[str, Any]
) -> None:
    plain = _ask(client, ask)
    answer = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # nothing drafted without one
    right = _ask(client, ask, prediction={"type": "content", "content": answer})
    assert right.choices[0].message.content == answer
    details = right.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= ask["max_tokens"] // 2
    # The file before the edit: its middle third changed; the answer is still the same.
    words = answer.split(" ")
    third = len(words) // 3
    before = " ".join(words[:third] + ["print('the old line')"] + words[2 * third :])
    parts = [{"type": "text", "text": before[:10]}, {"type": "text", "text": before[10:]}]
    edited = _ask(client, ask, prediction={"type": "content", "content": parts})
    assert edited.choices[0].message.content == answer
    details = edited.usage.completion_tokens_details
    assert details.rejected_prediction_tokens > 0  # the edit's drafts
    # More than the words before the edit: the prediction was found again after it.
    assert details.accepted_prediction_tokens > third
    streamed = _ask(client, ask, prediction={"type": "content", "content": answer}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer


@pytest.mark.parametrize(
    ("prediction", "says"),
    [
        ({"type": "text", "content": "x"}, "prediction.type must be 'content'"),
        ({"type": "content", "content": [{"type": "image_url"}]}, "must be text parts"),
        ({"type": "content", "content": 5}, "prediction"),
        ({"type": "content", "content": "token " * 200_000}, "the prediction has"),
    ],
)
def test_a_bad_prediction_is_a_400(
    client: openai.OpenAI, ask: dict[str, Any], prediction: Any, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        _ask(client, ask, prediction=prediction)
    assert says in bad.value.message
