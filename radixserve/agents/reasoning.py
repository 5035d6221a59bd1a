"""Reasoning split from the answer: a think block, as each reasoning model writes it.

``qwen3``: reasoning only when the answer starts with ``<think>`` (with
``enable_thinking: false`` the template closes an empty think block in the prompt and the
answer is plain); ``glm45`` writes the same. ``deepseek-r1``: its template opens
``<think>`` in the prompt, so the answer starts inside the reasoning and only ``</think>``
appears (an opening tag, when the model writes one anyway, is dropped); an answer that
never closes it is all reasoning; ``qwen3-thinking`` (Qwen3's thinking-only models) the
same. ``mistral`` (Magistral) thinks between ``[THINK]`` and ``[/THINK]``, ``kimi`` (Kimi
K1.5, Kimi-VL-Thinking) between ``◁think▷`` and ``◁/think▷``, each only when the answer
starts so. ``gpt-oss`` (:mod:`radixserve.agents.harmony`) has no block: its reasoning is
the analysis channel's messages, read by a reader of its own. The names are SGLang's
``--reasoning-parser`` names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from radixserve.agents.types import held_marker_prefix

START, END = "<think>", "</think>"


class ReasoningSplit(NamedTuple):
    reasoning: str
    content: str


class ThinkFormat(NamedTuple):
    """One reasoning format: its name, whether answers start inside the reasoning, and the
    markup around the reasoning. ``reader``: a format whose reasoning is not one block at
    the start (harmony's analysis messages, between which calls and answers come) reads
    the text itself, ``(text, final) -> ReasoningSplit``, as :func:`split` reads a block."""

    name: str
    starts_inside: bool
    start: str = START
    end: str = END
    reader: Callable[[str, bool], ReasoningSplit] | None = None


QWEN3 = ThinkFormat("qwen3", starts_inside=False)
DEEPSEEK_R1 = ThinkFormat("deepseek-r1", starts_inside=True)
FORMATS = {
    f.name: f
    for f in (
        QWEN3,
        DEEPSEEK_R1,
        QWEN3._replace(name="glm45"),
        DEEPSEEK_R1._replace(name="qwen3-thinking"),
        ThinkFormat("mistral", False, "[THINK]", "[/THINK]"),
        ThinkFormat("kimi", False, "\u25c1think\u25b7", "\u25c1/think\u25b7"),
    )
}


def after_prefill(fmt: ThinkFormat, prefill: str) -> ThinkFormat:
    """The format of an answer that goes on with ``prefill``, a reply the client began
    (``continue_final_message``, Anthropic's prefill): the answer starts inside the reasoning
    exactly when the prefill opened a think block and left it open. The template's
    generation prompt, which opens the block for DeepSeek-R1, is not rendered then. A
    format with a reader of its own reads the continuation as it reads any answer."""
    if fmt.reader is not None:
        return fmt
    return fmt._replace(starts_inside=prefill.rfind(fmt.start) > prefill.rfind(fmt.end))


def split(fmt: ThinkFormat, text: str, final: bool) -> ReasoningSplit:
    """Reasoning and content of ``text``; when not ``final``, a trailing piece that may be
    a tag still arriving is held back from both."""
    if fmt.reader is not None:
        return fmt.reader(text, final)
    lead = len(text) - len(text.lstrip())
    body = text[lead:]
    if body.startswith(fmt.start):
        body = body[len(fmt.start) :]
    elif not fmt.starts_inside:
        if not final and fmt.start.startswith(body):
            return ReasoningSplit("", "")  # maybe the opening tag, still arriving
        return ReasoningSplit("", text)
    elif not final and body and fmt.start.startswith(body):
        return ReasoningSplit("", "")
    end = body.find(fmt.end)
    if end < 0:
        hold = 0 if final else held_marker_prefix(body, (fmt.end,))
        return ReasoningSplit(body[: len(body) - hold], "")
    # The newlines templates put after the closing tag are not part of the answer.
    return ReasoningSplit(body[:end], body[end + len(fmt.end) :].lstrip("\n"))
