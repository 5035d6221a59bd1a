"""The event stream of a streamed ``/v1/messages`` request, as Anthropic's SDKs read it.

``message_start`` (the message with empty content; ``usage.input_tokens`` the prompt's
length, provisional), then per content block ``content_block_start``, its
``content_block_delta`` events (``thinking_delta``, ``text_delta``, or
``input_json_delta`` with the arguments' JSON as the model writes it) and
``content_block_stop``; then ``message_delta`` (stop reason, stop sequence, the final
usage) and ``message_stop``. Each is sent as ``event: <type>`` + ``data: <json>``. An
error after the stream started is an ``error`` event in Anthropic's shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from radixserve.agents.types import OutputDelta
from radixserve.serving.http import chat_tools
from radixserve.serving.http.anthropic_errors import error_body
from radixserve.serving.http.chat_tools import ToolPlan
from radixserve.serving.http.errors import APIError
from radixserve.serving.http.messages_reply import Reply, usage
from radixserve.serving.wire import protocol as p

_json = msgspec.json.Encoder()


def emit(type_: str, **fields: Any) -> bytes:
    body = {"type": type_, **fields}
    return b"event: " + type_.encode() + b"\ndata: " + _json.encode(body) + b"\n\n"


class Blocks:
    """The content blocks of one answer as its deltas arrive: one open at a time."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.calls = 0

    def apply(self, d: OutputDelta) -> list[bytes]:
        out: list[bytes] = []
        if d.reasoning:
            out += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            out += self._ensure("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d.content}))
        for tc in d.tool_calls:
            if tc.id is not None:
                self.calls += 1
                out += self.close()
                out += self._start(
                    "tool_use", {"type": "tool_use", "id": tc.id, "name": tc.name, "input": {}}
                )
            if tc.arguments and self.open == "tool_use":
                out.append(self._delta({"type": "input_json_delta", "partial_json": tc.arguments}))
        return out

    def _ensure(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self.open == kind:
            return []
        return self.close() + self._start(kind, block)

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        self.index += 1
        self.open = kind
        return [emit("content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return emit("content_block_delta", index=self.index, delta=delta)

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [emit("content_block_stop", index=self.index)]


async def events(
    reply: Reply, plan: ToolPlan, stream: AsyncIterator[p.GenerateChunk | p.GenerateFinal]
) -> AsyncIterator[bytes]:
    parser = chat_tools.output_parser(plan)
    blocks = Blocks()
    started = False
    try:
        async for ev in stream:
            if not started:
                started = True
                prompt = (
                    ev.prompt_tokens if isinstance(ev, p.GenerateChunk) else ev.usage.prompt_tokens
                )
                yield emit("message_start", message=reply.head(prompt or 0))
            if isinstance(ev, p.GenerateChunk):
                delta = parser.feed(ev.text) if parser is not None else OutputDelta(ev.text)
                for b in blocks.apply(delta):
                    yield b
                continue
            if parser is not None:
                for b in blocks.apply(parser.finish()):
                    yield b
            for b in blocks.close():
                yield b
            reason, seq = reply.stop_reason(ev, blocks.calls > 0)
            yield emit(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": seq},
                usage=usage(ev),
            )
            yield emit("message_stop")
            return
    except APIError as exc:
        yield emit("error", error=error_body(exc.status, exc.message)["error"])
