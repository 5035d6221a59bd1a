"""gpt-oss's harmony format (radixserve.agents.harmony): reasoning, content and calls read
out of channel messages, whole and split at every character, with the markup never
reaching the content or the reasoning.

The outputs follow OpenAI's harmony guide (github.com/openai/harmony, "Function calling"
and "Receiving messages"): the analysis message, then a call whose header names the
recipient (after the channel as the model writes it, or before it as the chat template
renders it), or a final answer; ``<|call|>`` and ``<|return|>`` are stop tokens, so a
detokenizer may leave them out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from stream_helpers import run, splits, whole

from radixserve.agents import harmony
from radixserve.agents.registry import (
    HARMONY,
    guess_tool_format,
    reasoning_format,
    served_tool_format,
    tool_format,
)
from radixserve.agents.stream import OutputParser
from radixserve.sampling_params import SamplingParams
from radixserve.serving.http import chat_tools

TEMPLATE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "gpt_oss.jinja"
).read_text()
THINK = "<|channel|>analysis<|message|>The user asks for the weather in SF.<|end|>"
REASONING = "The user asks for the weather in SF."
SF = '{"location": "San Francisco, CA"}'
TO = "<|start|>assistant<|channel|>commentary to=functions."
CALL = f"{TO}get_weather <|constrain|>json<|message|>{SF}<|call|>"
TIME = TO + 'get_time <|constrain|>json<|message|>{"zone": "PST"}<|call|>'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 20 C and sunny.<|return|>"

# (answer, reasoning, content, calls) with both parsers (reasoning and tools).
CASES = [
    pytest.param(THINK + FINAL, REASONING, "It is 20 C and sunny.", [], id="analysis-final"),
    # The final message without its stop token (a detokenizer dropped <|return|>).
    pytest.param(
        THINK + FINAL.removesuffix("<|return|>"),
        REASONING,
        "It is 20 C and sunny.",
        [],
        id="no-return",
    ),
    pytest.param(THINK + CALL, REASONING, "", [("get_weather", SF)], id="one-call"),
    # <|call|> is a stop token: the text may end with the arguments.
    pytest.param(
        THINK + CALL.removesuffix("<|call|>"),
        REASONING,
        "",
        [("get_weather", SF)],
        id="no-call-token",
    ),
    pytest.param(
        THINK + CALL + TIME,
        REASONING,
        "",
        [("get_weather", SF), ("get_time", '{"zone": "PST"}')],
        id="two-calls",
    ),
    # A preamble: recipient-less commentary is for the user.
    pytest.param(
        THINK
        + "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"
        + CALL,
        REASONING,
        "Checking the weather.",
        [("get_weather", SF)],
        id="preamble",
    ),
    # A built-in tool's call (browser) is no function call: its text joins the reasoning.
    pytest.param(
        THINK
        + '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "SF weather"}<|call|>',
        REASONING + '\n\n{"query": "SF weather"}',
        "",
        [],
        id="builtin",
    ),
    # Nor in the commentary channel: any recipient but functions.* is never content.
    pytest.param(
        "<|start|>assistant to=python<|channel|>commentary code<|message|>print(2 + 2)<|call|>",
        "print(2 + 2)",
        "",
        [],
        id="builtin-commentary",
    ),
    pytest.param(
        f"{TO}get_weather<|constrain|>json<|message|>{SF}<|call|>",
        "",
        "",
        [("get_weather", SF)],
        id="constrain-unspaced",
    ),
    pytest.param(
        THINK
        + f"<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{SF}<|call|>",
        REASONING,
        "",
        [("get_weather", SF)],
        id="no-constrain",
    ),
    # The recipient before the channel, as the chat template renders calls back.
    pytest.param(
        THINK
        + f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{SF}<|call|>",
        REASONING,
        "",
        [("get_weather", SF)],
        id="recipient-first",
    ),
    # No stop token, no <|end|>: the next header closes a message.
    pytest.param(
        "<|channel|>analysis<|message|>Hm.<|start|>assistant<|channel|>final<|message|>Hi.",
        "Hm.",
        "Hi.",
        [],
        id="implicit-close",
    ),
    # A call with no arguments, and text after a prefill (outside any message).
    pytest.param(
        "<|channel|>commentary to=functions.ping <|constrain|>json<|message|><|call|>",
        "",
        "",
        [("ping", "{}")],
        id="empty-arguments",
    ),
    pytest.param("sunny, 20 C.<|return|>", "", "sunny, 20 C.", [], id="continued-final"),
]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_whole_and_split_at_every_character(
    text: str, reasoning: str, content: str, calls: list[tuple[str, str]]
) -> None:
    expected = {"content": content, "reasoning": reasoning, "calls": calls}
    assert whole(harmony.scan, harmony.THINK, text) == expected
    for pieces in splits(text):
        got = run(harmony.scan, harmony.THINK, pieces)
        assert got == expected, pieces
    # The tool parser alone drops the reasoning (SGLang's gpt-oss tool parser does too).
    assert whole(harmony.scan, None, text) == {**expected, "reasoning": ""}
    for pieces in splits(text)[:2]:
        assert run(harmony.scan, None, pieces) == {**expected, "reasoning": ""}


def test_without_tools_calls_stay_content_as_written() -> None:
    """The reasoning parser alone (a request with no tools): the analysis is reasoning, a
    call message is no call, and stays in the content as the model wrote it."""
    for pieces in splits(THINK + CALL):
        got = run(None, harmony.THINK, pieces)
        assert got == {"reasoning": REASONING, "content": CALL, "calls": []}, pieces


def test_malformed_arguments_are_content_nothing_lost() -> None:
    bad = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": SF}<|call|>'
    for text in (bad, bad.removesuffix("<|call|>"), bad.replace("}", "} trailing")):
        got = whole(harmony.scan, harmony.THINK, THINK + text)
        assert got == {"reasoning": REASONING, "content": text, "calls": []}
    # Streamed, the call was announced once its header ended: it stays a call (what was
    # sent cannot be taken back), its arguments as written.
    streamed = run(harmony.scan, harmony.THINK, list(THINK + bad))
    assert streamed["calls"] == [("get_weather", '{"location": SF}')]
    assert streamed["content"] == ""


def test_held_back_markers_never_leak() -> None:
    """Every prefix of an answer, fed as a stream: no piece of a marker in the content or
    the reasoning sent so far."""
    text = THINK + "<|start|>assistant<|channel|>commentary<|message|>One moment.<|end|>" + CALL
    p = OutputParser(harmony.scan, harmony.THINK)
    content = reasoning = ""
    for ch in text:
        d = p.feed(ch)
        content += d.content
        reasoning += d.reasoning
        for shown in (content, reasoning):
            assert "<|" not in shown and not shown.endswith("<"), shown
    assert (content, reasoning) == ("One moment.", REASONING)


def test_template_guess_names_and_plan() -> None:
    """The template's harmony markup picks the format (as ``[ARGS]`` picks Mistral's v11);
    SGLang's and vLLM's parser names select it; a plan on the template reads the reasoning
    with it, keeps the special tokens in the text and forces calls in its markup."""
    assert guess_tool_format(TEMPLATE) is HARMONY
    assert served_tool_format(None, TEMPLATE) is HARMONY
    assert tool_format("gpt-oss") is HARMONY and tool_format("openai") is HARMONY
    assert served_tool_format("gpt-oss", TEMPLATE) is HARMONY
    assert reasoning_format("gpt-oss") is harmony.THINK
    tools = [chat_tools.ToolIn.model_validate({"function": {"name": "get_weather"}})]
    plan = chat_tools.plan(tools, "required", TEMPLATE, None, None, False, False)
    assert plan.think is harmony.THINK and plan.special_tokens
    assert plan.structural_tag is not None
    assert "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" in (
        plan.structural_tag
    )
    params = chat_tools.constrain(SamplingParams(), plan)
    assert params.skip_special_tokens is False and params.structural_tag == plan.structural_tag
    # Named by --tool-call-parser, whatever the template: a request without tools too.
    named = chat_tools.plan(None, None, "{{ messages }}", "gpt-oss", None, False)
    assert named.think is harmony.THINK and named.special_tokens
    # Another model's template: nothing implied, special tokens skipped as before.
    qwen = chat_tools.plan(tools, "auto", "{{ tools }} <tool_call>", None, None, False)
    assert qwen.think is None and not qwen.special_tokens
    assert chat_tools.constrain(SamplingParams(), qwen).skip_special_tokens


def test_call_token_ends_with_tool_calls_and_return_with_stop() -> None:
    """The engine ends the turn at a stop token (``finish_reason`` "stop"): an answer ending
    with ``<|call|>`` finished with a call (``tool_calls``), one ending with ``<|return|>``
    with the answer (``stop``); the stop tokens, when the text keeps them, are no content."""
    tools = [chat_tools.ToolIn.model_validate({"function": {"name": "get_weather"}})]
    plan = chat_tools.plan(tools, "auto", TEMPLATE, None, None, False)
    msg, reason = chat_tools.message(plan, THINK + CALL, "stop")
    assert reason == "tool_calls" and msg["content"] is None
    assert msg["reasoning_content"] == REASONING
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": SF}
    msg, reason = chat_tools.message(plan, THINK + FINAL, "stop")
    assert reason == "stop" and "tool_calls" not in msg
    assert (msg["content"], msg["reasoning_content"]) == ("It is 20 C and sunny.", REASONING)
    # Cut off by max_tokens inside the call: no call, the text as written stays content.
    cut = THINK + CALL[: CALL.index("San")]
    msg, reason = chat_tools.message(plan, cut, "length")
    assert reason == "length" and "tool_calls" not in msg
    assert msg["content"] == CALL[: CALL.index("San")]
