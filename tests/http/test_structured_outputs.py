"""Every spelling of structured output in the OpenAI bodies (OpenAI's, vLLM's new and old,
SGLang's) becomes the one constraint it names, on chat and text completions alike; two at
once, unknown options and wrong types are a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from radixserve.constrained.spec import JSON_OBJECT_SCHEMA, structural_tag_text
from radixserve.serving.http.errors import APIError
from radixserve.serving.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixserve.serving.http.sglang_protocol import SGLSamplingParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
GRAMMAR = 'root ::= "yes" | "no"'
LEGACY_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
    "triggers": ["<f>"],
}

SPELLINGS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"response_format": {"type": "text"}}, {}),
    ({"response_format": {"type": "json_object"}}, {"json_schema": JSON_OBJECT_SCHEMA}),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": SCHEMA},
            }
        },
        {"json_schema": json.dumps(SCHEMA)},
    ),
    ({"response_format": LEGACY_TAG}, {"structural_tag": structural_tag_text(LEGACY_TAG)}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": json.dumps(SCHEMA)}),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"json_schema": json.dumps(SCHEMA)}),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
    ({"structured_outputs": {"choice": ["a", "b"]}}, {"choices": ["a", "b"]}),
    ({"structured_outputs": {"grammar": GRAMMAR}}, {"ebnf": GRAMMAR}),
    ({"structured_outputs": {"json_object": True}}, {"json_schema": JSON_OBJECT_SCHEMA}),
    (
        {"structured_outputs": {"structural_tag": json.dumps(LEGACY_TAG)}},
        {"structural_tag": structural_tag_text(LEGACY_TAG)},
    ),
    (
        {
            "structured_outputs": {
                "regex": "a",
                "disable_any_whitespace": True,
                "json_object": False,
            }
        },
        {"regex": "a"},
    ),
    (
        {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
        {"json_schema": json.dumps(SCHEMA)},
    ),
    ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ({"guided_choice": ["a", "b"]}, {"choices": ["a", "b"]}),
    ({"guided_grammar": GRAMMAR}, {"ebnf": GRAMMAR}),
    ({"regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ({"ebnf": GRAMMAR}, {"ebnf": GRAMMAR}),
]


@pytest.mark.parametrize(("fields", "expected"), SPELLINGS)
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_each_spelling_is_its_constraint(
    kind: str, fields: dict[str, Any], expected: dict[str, Any]
) -> None:
    body = request(kind, **fields)
    body.check()
    assert body.constraint() == expected
    params = body.sampling(16, None)  # reaches SamplingParams and passes its checks
    assert {n: getattr(params, n) for n in expected} == expected
    assert (params.constraint is None) == (not expected)


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format and guided_regex both constrain the output",
            "guided_regex",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "ebnf": GRAMMAR},
            "structured_outputs.regex and ebnf both",
            "ebnf",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "exactly one of .* got regex, choice",
            "structured_outputs",
        ),
        ({"structured_outputs": {}}, "exactly one of .* got none", "structured_outputs"),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}},
            "structured_outputs.whitespace_pattern is not supported",
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"choice": "a"}},
            "wrong type for a choice constraint",
            "structured_outputs.choice",
        ),
        ({"guided_whitespace_pattern": " "}, "JSON output is compact", "guided_whitespace_pattern"),
        (
            {"response_format": {"type": "grammar"}},
            "response_format type 'grammar' is not supported",
            "response_format",
        ),
        (
            {"response_format": {"type": "structural_tag", "structures": []}},
            '"structures" and "triggers"',
            "response_format",
        ),
    ],
)
def test_bad_or_conflicting_spellings_are_a_400(
    fields: dict[str, Any], message: str, param: str
) -> None:
    for kind in ("chat", "completion"):
        with pytest.raises(APIError) as e:
            request(kind, **fields).check()
        err = e.value.body()["error"]
        assert e.value.status == 400 and err["param"] == param
        assert re.search(message, err["message"]), err


def test_a_bad_grammar_reaches_sampling_params_checks() -> None:
    with pytest.raises(APIError, match="non-empty grammar"):
        request("chat", ebnf="  ").sampling(16, None)


def test_sglang_generate_takes_ebnf_and_either_structural_tag() -> None:
    params, _ = SGLSamplingParams(ebnf=GRAMMAR).to_params(64, 100, None, None, 0)
    assert params.ebnf == GRAMMAR
    params, _ = SGLSamplingParams(structural_tag=json.dumps(LEGACY_TAG)).to_params(
        64, 100, None, None, 0
    )
    assert params.structural_tag == structural_tag_text(LEGACY_TAG)
    with pytest.raises(APIError) as e:
        SGLSamplingParams(structural_tag="[1]").to_params(64, 100, None, None, 0)
    assert e.value.body()["error"]["param"] == "sampling_params.structural_tag"


def request(kind: str, **fields: Any) -> ChatCompletionRequest | CompletionRequest:
    if kind == "chat":
        return ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "hi"}], **fields
        )
    return CompletionRequest(model="m", prompt="hi", **fields)
