"""The prefix property at the text level, per chat template of tests/fixtures/chat_templates:
turn N's prompt plus the answer the model wrote (a forced call, exactly as the grammar of
its format writes it) is a prefix of turn N+1's prompt, or the test names where the
template re-serializes. Token-level reuse is measured through the server in
tests/http/test_http_tools.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from radixserve.agents.registry import guess_tool_format, served_tool_format
from radixserve.serving.prompts import chat_turn, template_inputs
from radixserve.serving.wire import protocol as p

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# What each model ends its turn with (its EOS), which the template writes back (Mistral's
# template writes the tokenizer's eos_token: the tiny tokenizer's is <|im_end|>).
END_OF_TURN = {
    "qwen3.jinja": "<|im_end|>",
    "qwen3_coder.jinja": "<|im_end|>",
    "llama3_1.jinja": "<|eot_id|>",
    "mistral.jinja": "<|im_end|>",
    "mistral_v11.jinja": "<|im_end|>",
    "gpt_oss.jinja": "",  # the call's own <|call|> ends the turn
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tiny_models

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return tiny_models.build_tokenizer(tmp_path_factory.mktemp("tok"))


def render(tok: Any, template: str, msgs: list[p.ChatMessage], kwargs: str | None = None) -> str:
    tok.chat_template = (TEMPLATES / template).read_text()
    out: str = tok.apply_chat_template(
        [chat_turn(m) for m in msgs],
        tokenize=False,
        add_generation_prompt=True,
        **template_inputs(json.dumps(TOOLS), kwargs),
    )
    return out


@pytest.mark.parametrize("template", sorted(END_OF_TURN))
def test_turn_n_plus_answer_prefixes_turn_n_plus_1(tokenizer: Any, template: str) -> None:
    text = (TEMPLATES / template).read_text()
    fmt = guess_tool_format(text)
    # The guess is what the format's parser, named, gives with this template.
    assert fmt is not None and served_tool_format(fmt.name, text) is fmt
    call = {"name": "get_weather", fmt.args_key: {"city": "Paris"}}
    answer = fmt.begin + json.dumps([call] if fmt.array else call) + fmt.end
    if fmt.xml:  # as Qwen3-Coder writes it
        answer = fmt.begin + "get_weather>\n<parameter=city>\nParis\n</parameter>" + fmt.end
    elif fmt.head is not None:  # Mistral's v11, harmony: the name in the markup
        answer = fmt.begin + fmt.head.format(name="get_weather") + '{"city": "Paris"}' + fmt.end
    eos = END_OF_TURN[template]
    turn1 = [
        p.ChatMessage(role="system", content="Be brief."),
        p.ChatMessage(role="user", content="Weather in Paris?"),
    ]
    prompt1 = render(tokenizer, template, turn1)
    tc = p.ToolCallPart(id="abcdefghi", name="get_weather", arguments='{"city": "Paris"}')
    turn2 = [
        *turn1,
        p.ChatMessage(role="assistant", content="", tool_calls=[tc]),
        p.ChatMessage(role="tool", content="18 C", tool_call_id="abcdefghi"),
    ]
    prompt2 = render(tokenizer, template, turn2)
    assert prompt2.startswith(prompt1)
    written = prompt1 + answer + eos
    if template == "mistral.jinja":
        # Mistral's template re-serializes the call: it adds the call's id inside the
        # object, so the cache reuses the answer only up to the end of the arguments.
        common = os.path.commonprefix([written, prompt2])
        assert written[len(common) :].startswith("}]") and prompt2[len(common) :].startswith(
            ', "id": "abcdefghi"}]'
        )
    elif template == "gpt_oss.jinja":
        # gpt-oss's template renders a call back with its recipient first, not as the model
        # writes it (and a forced call is written): the cache reuses the prompt, not the call.
        assert os.path.commonprefix([written, prompt2]) == prompt1
        assert prompt2[len(prompt1) :].startswith(
            ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        )
    else:
        assert prompt2.startswith(written)


def test_gpt_oss_template_renders_tools_reasoning_calls_and_results(tokenizer: Any) -> None:
    """The harmony the fixture writes: the tools as a TypeScript namespace in the developer
    message, the reasoning effort, an earlier call with its reasoning as an analysis
    message, the result from the function's role; the reasoning is dropped once a final
    answer follows (gpt-oss's templates keep only the pending call's). The template reads
    the reasoning as ``thinking``, which transformers fills from ``reasoning_content``."""
    tc = p.ToolCallPart(id="abcdefghi", name="get_weather", arguments='{"city": "Paris"}')
    turns = [
        p.ChatMessage(role="system", content="Be brief."),
        p.ChatMessage(role="user", content="Weather in Paris?"),
        p.ChatMessage(role="assistant", content="", tool_calls=[tc], reasoning_content="Look."),
        p.ChatMessage(role="tool", content="18 C", tool_call_id="abcdefghi"),
    ]
    text = render(tokenizer, "gpt_oss.jinja", turns, json.dumps({"reasoning_effort": "high"}))
    assert "\nReasoning: high\n" in text
    assert (
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// Current weather of a city\ntype get_weather = (_: {\n"
        "city?: string,\n}) => any;\n\n} // namespace functions<|end|>"
    ) in text
    assert text.endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Look.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C"<|end|>'
        "<|start|>assistant"
    )
    answered = [*turns, p.ChatMessage(role="assistant", content="18 C."), turns[1]]
    later = render(tokenizer, "gpt_oss.jinja", answered)
    assert "Look." not in later and "<|channel|>final<|message|>18 C.<|end|>" in later
