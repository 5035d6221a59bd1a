"""OpenAI's harmony format (gpt-oss): reasoning, content and tool calls as channel messages.

After the prompt's ``<|start|>assistant`` a gpt-oss model writes messages, each a header
and a body (the call below is wrapped; its arguments follow ``<|message|>`` directly)::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"location": "SF"}<|call|>

and, answering, ``<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>``. The
header names a channel and, for a tool call, a recipient (before or after the channel:
the chat template renders ``<|start|>assistant to=functions.x<|channel|>commentary json``);
``<|constrain|>json`` is optional. A body ends at ``<|end|>``, ``<|call|>`` or
``<|return|>`` (the last two are stop tokens: often absent from the text) or, implicitly,
where the next header begins. Each message is read as:

- ``analysis``: reasoning;
- a ``functions.NAME`` recipient: a call of ``NAME`` whose body is the JSON arguments (a
  body that is not a JSON object is content at the end, as the model wrote it);
- another recipient (the built-in ``browser.*`` and ``python`` tools): reasoning. The
  server runs no built-in tool, so it is no call; harmony writes such calls in the chain of
  thought, and vLLM reads an analysis-channel one as reasoning (SGLang drops it; here its
  text is kept, off the user-visible content);
- anything else (``final``, a recipient-less ``commentary`` preamble): content.

Text outside any message (a continued final message, after a prefill) is content. One
pass reads both halves: :func:`scan` is the tool parser (content and calls; the reasoning
is dropped, as SGLang's gpt-oss tool parser drops it) and :func:`split` the reasoning
parser (reasoning, and an answer in which each call message stays as written, for the tool
scan that runs after it). Both are pure functions of the text, so any split of a stream
reads as the whole does; when not ``final`` a trailing piece that may be a marker is held
back, and a message whose header is unfinished is held whole.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from radixserve.agents.jsonscan import skip_ws, value_end
from radixserve.agents.reasoning import ReasoningSplit, ThinkFormat
from radixserve.agents.types import Scan, ScannedCall, held_marker_prefix

NAME = "gpt-oss"
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
_CLOSERS = (END, CALL, RETURN)  # a body's end, consumed
_OPENERS = (START, CHANNEL)  # the next header: ends a body that was not closed
FUNCTIONS = "functions."
#: How a call is forced (a structural tag per function): the header the model writes, up
#: to the function's name, then the rest of it; the arguments; the stop token.
CALL_BEGIN = CHANNEL + "commentary to=" + FUNCTIONS
CALL_HEAD = "{name} " + CONSTRAIN + "json" + MESSAGE
#: Between two forced calls: the next message's start (the prompt ends with it too).
NEXT_MESSAGE = START + "assistant"
#: Between two parts of the same stream (two analysis messages, a preamble and an answer).
SEPARATOR = "\n\n"
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class Part(NamedTuple):
    """One message (or a run of text outside any message) as far as the text shows it.

    ``kind``: ``"content"``, ``"reasoning"`` or ``"call"``; ``text``: the body (the call's
    arguments so far), a held-back trailing piece removed; ``raw``: the message as written,
    markup included (a closed call's ending made explicit, so the raw text reads back as
    the same call); ``headed``: a message, not text outside one; ``closed``: its body has
    ended; ``valid``: a call whose body is a JSON object (or is not finished yet)."""

    kind: str
    text: str
    raw: str
    headed: bool
    name: str | None = None
    closed: bool = True
    valid: bool = True


def parts(text: str, final: bool) -> list[Part]:
    """The messages of ``text`` in order; ``final``: the generation has ended."""
    out: list[Part] = []
    i = 0
    while i < len(text):
        j = _first(text, i, _OPENERS)
        plain = text[i : len(text) if j < 0 else j]
        if j < 0 and not final:
            plain = plain[: len(plain) - held_marker_prefix(plain, MARKERS)]
        if plain:
            out.append(Part("content", _without_closers(plain), plain, False))
        if j < 0:
            break
        m = text.find(MESSAGE, j)
        if m < 0:  # the header is still being written (or was cut short: kept as written)
            if final:
                out.append(Part("content", text[j:], text[j:], False))
            break
        body_at = m + len(MESSAGE)
        stop = _first(text, body_at, _CLOSERS + _OPENERS)
        closed = stop >= 0
        body = text[body_at : stop if closed else len(text)]
        if not (closed or final):
            body = body[: len(body) - held_marker_prefix(body, MARKERS)]
        closer = next((c for c in _CLOSERS if closed and text.startswith(c, stop)), "")
        out.append(_message(text[j:m], body, text[j:body_at], closer, closed, final))
        if not closed:
            break
        i = stop + len(closer)
    return out


def _first(text: str, i: int, markers: tuple[str, ...]) -> int:
    """Where the first of ``markers`` in ``text[i:]`` is (-1: none)."""
    found = [at for at in (text.find(x, i) for x in markers) if at >= 0]
    return min(found, default=-1)


def _without_closers(plain: str) -> str:
    for closer in _CLOSERS:  # a stray end marker (after a continued message) is no text
        plain = plain.replace(closer, "")
    return plain


def _message(header: str, body: str, head: str, closer: str, closed: bool, final: bool) -> Part:
    """One message from its header (the markup before ``<|message|>``) and body."""
    channel, recipient = _read_header(header)
    ended = closed or final
    raw = head + body + (closer or (CALL if closed else ""))
    if recipient is not None and recipient.startswith(FUNCTIONS):
        name = recipient[len(FUNCTIONS) :]
        if _NAME.fullmatch(name):
            args, valid = _arguments(body, ended)
            return Part("call", args, raw, True, name, ended, valid)
    if recipient is not None or channel == "analysis":
        return Part("reasoning", body, raw, True, closed=ended)
    return Part("content", body, raw, True, closed=ended)


def _read_header(header: str) -> tuple[str | None, str | None]:
    """``(channel, recipient)`` of a header such as ``<|start|>assistant to=functions.f
    <|channel|>commentary json`` or ``<|channel|>commentary to=functions.f
    <|constrain|>json`` (either may be ``None``)."""
    role, _, channel_part = header.replace(CONSTRAIN, " ").partition(CHANNEL)
    words = channel_part.split()
    channel = words[0] if words else None
    recipient = next(
        (w[3:] for w in role.replace(START, " ").split() + words if w.startswith("to=")), None
    )
    return channel, recipient


def _arguments(body: str, ended: bool) -> tuple[str, bool]:
    """A call's arguments: the JSON so far (``ended`` false), or the whole object and
    whether it is one (an empty body: no arguments, ``{}``)."""
    start = skip_ws(body, 0)
    end = value_end(body, start) if start < len(body) else None
    if not ended:
        return body[start : end if end is not None else len(body)].rstrip(), True
    if start >= len(body):
        return "{}", True
    if end is None or skip_ws(body, end) < len(body):
        return body.strip(), False
    try:
        valid = isinstance(json.loads(body[start:end]), dict)
    except (ValueError, RecursionError):
        valid = False
    return body[start:end], valid


class _Streams:
    """Content and reasoning as the parts add to them, one separator between two
    messages' texts in the same stream; ``answer``: the content with the calls as written
    between (what :func:`split` hands the tool scan)."""

    def __init__(self) -> None:
        self.out: dict[str, list[str]] = {"content": [], "reasoning": []}
        self.answer: list[str] = []

    def add(self, kind: str, part: Part, text: str) -> None:
        done = self.out[kind]
        if part.headed and text and any(done):
            text = SEPARATOR + text
        done.append(text)
        if kind == "content":
            self.answer.append(text)

    def joined(self, kind: str) -> str:
        return "".join(self.out[kind])


def scan(text: str, final: bool) -> Scan:
    """The tool parser: content and calls (``functions.*`` messages); reasoning dropped. A
    call whose arguments are not a JSON object is content at the end (``final``), as the
    model wrote it; before that it stays a call (it may have been announced already)."""
    streams, calls = _Streams(), []
    for part in parts(text, final):
        if part.kind == "call" and (part.valid or not final):
            calls.append(ScannedCall(part.name, part.text, part.closed))
        elif part.kind == "call":
            streams.add("content", part, part.raw)
        else:
            streams.add(part.kind, part, part.text)
    return Scan(streams.joined("content"), calls)


def split(text: str, final: bool) -> ReasoningSplit:
    """The reasoning parser: the analysis (and built-in tools') text, and the answer: the
    content with each call message left as written, for the tool scan (:func:`scan`) to
    read, or to stay content where the request has no tools."""
    streams = _Streams()
    for part in parts(text, final):
        if part.kind == "call":
            streams.answer.append(part.raw)
        else:
            streams.add(part.kind, part, part.text)
    return ReasoningSplit(streams.joined("reasoning"), "".join(streams.answer))


#: ``--reasoning-parser gpt-oss``: the analysis channel, read by :func:`split` (a
#: ``ThinkFormat`` with a reader of its own; its ``start``/``end`` only describe it).
THINK = ThinkFormat(NAME, False, CHANNEL + "analysis" + MESSAGE, END, reader=split)
