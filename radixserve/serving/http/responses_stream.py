"""The event stream of a streamed ``/v1/responses`` request, in the order the openai SDK reads.

``response.created``, ``response.in_progress``; then per output item
``response.output_item.added``, its deltas (``response.reasoning_text.delta`` in a
``reasoning`` item, ``response.content_part.added`` + ``response.output_text.delta`` in a
``message``, ``response.function_call_arguments.delta`` in a ``function_call``), its
``.done`` events and ``response.output_item.done``; finally ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut the answer) with the whole
response and its usage. Every event carries a ``sequence_number`` and is sent as
``event: <type>`` + ``data: <json>``. An error after the stream started is an ``error``
event followed by ``response.failed``.

The text is read by the same :class:`~radixserve.agents.stream.OutputParser` as the chat
API's streams: calls are announced (an item with its name) once the name is complete, and
markup never reaches the text.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import msgspec

from radixserve.agents.types import OutputDelta
from radixserve.serving.http import chat_tools
from radixserve.serving.http import responses_items as items_
from radixserve.serving.http.chat_tools import ToolPlan
from radixserve.serving.http.errors import APIError
from radixserve.serving.wire import protocol as p

_json = msgspec.json.Encoder()


class Writer:
    """Numbers and formats the events of one stream."""

    def __init__(self) -> None:
        self.seq = 0

    def emit(self, type_: str, **fields: Any) -> bytes:
        body = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + _json.encode(body) + b"\n\n"


class OutputItems:
    """The output items of one answer as its deltas arrive: at most one open at a time."""

    def __init__(self, w: Writer, seal: bool = False) -> None:
        self.w = w
        self.seal = seal  # reasoning items get their encrypted_content (include)
        self.done: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""  # the open item's text (or arguments)

    def apply(self, d: OutputDelta) -> list[bytes]:
        out: list[bytes] = []
        if d.reasoning:
            out += self._ensure("reasoning")
            out.append(self._delta("response.reasoning_text.delta", d.reasoning))
        if d.content:
            out += self._ensure("message")
            out.append(self._delta("response.output_text.delta", d.content, logprobs=[]))
        for tc in d.tool_calls:
            if tc.id is not None:
                out += self.close(incomplete=False)
                fc_id = items_.new_id("fc")
                out += self._add(items_.call_item(fc_id, tc.id, tc.name or "", "", "in_progress"))
            if tc.arguments and self.open is not None and self.open["type"] == "function_call":
                out.append(self._delta("response.function_call_arguments.delta", tc.arguments))
        return out

    def finish(self, incomplete: bool) -> list[bytes]:
        """Close the last item (an answer with nothing in it is one empty message)."""
        kinds = {i["type"] for i in self.done} | ({self.open["type"]} if self.open else set())
        out = [] if kinds & {"message", "function_call"} else self._ensure("message")
        return out + self.close(incomplete)

    def _ensure(self, kind: str) -> list[bytes]:
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self.close(incomplete=False)
        if kind == "reasoning":
            out += self._add(items_.reasoning_item(items_.new_id("rs"), "", "in_progress"))
            out.append(
                self._part("response.content_part.added", {"type": "reasoning_text", "text": ""})
            )
        else:
            out += self._add(items_.message_item(items_.new_id("msg"), None, "in_progress"))
            out.append(self._part("response.content_part.added", items_.output_text("")))
        return out

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.open, self.text = item, ""
        return [self.w.emit("response.output_item.added", output_index=len(self.done), item=item)]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.done)}

    def _delta(self, type_: str, text: str, **extra: Any) -> bytes:
        self.text += text
        where = self._where()
        if type_ != "response.function_call_arguments.delta":
            where["content_index"] = 0
        return self.w.emit(type_, **where, delta=text, **extra)

    def _part(self, type_: str, part: dict[str, Any]) -> bytes:
        return self.w.emit(type_, **self._where(), content_index=0, part=part)

    def close(self, incomplete: bool) -> list[bytes]:
        """The ``.done`` events of the open item, if any."""
        item = self.open
        if item is None:
            return []
        status = "incomplete" if incomplete else "completed"
        where, text, out = self._where(), self.text, []
        if item["type"] == "function_call":
            item = items_.call_item(item["id"], item["call_id"], item["name"], text, "completed")
            out.append(
                self.w.emit(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=text,
                )
            )
        elif item["type"] == "reasoning":
            item = items_.reasoning_item(item["id"], text, status, self.seal)
            out.append(
                self.w.emit("response.reasoning_text.done", **where, content_index=0, text=text)
            )
            out.append(
                self._part(
                    "response.content_part.done",
                    item["content"][0] if text else {"type": "reasoning_text", "text": ""},
                )
            )
        else:
            item = items_.message_item(item["id"], text, status)
            done = self.w.emit(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
            out += [done, self._part("response.content_part.done", item["content"][0])]
        out.append(self.w.emit("response.output_item.done", output_index=len(self.done), item=item))
        self.done.append(item)
        self.open, self.text = None, ""
        return out


async def events(
    turn: Any,
    plan: ToolPlan,
    stream: AsyncIterator[p.GenerateChunk | p.GenerateFinal],
    on_done: Callable[[dict[str, Any]], None],
    on_failed: Callable[[dict[str, Any]], None] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The SSE events of ``turn`` (a :class:`~.responses.Turn`) over its router stream;
    ``on_done(response)`` runs before the last event, with the finished Response object
    (it stores the conversation); ``on_failed(response)`` likewise with a failed one."""
    w = Writer()
    yield w.emit("response.created", response=turn.response("in_progress", []))
    yield w.emit("response.in_progress", response=turn.response("in_progress", []))
    parser = chat_tools.output_parser(plan)
    items = OutputItems(w, turn.body.seals_reasoning)
    try:
        async for ev in stream:
            if isinstance(ev, p.GenerateChunk):
                delta = parser.feed(ev.text) if parser is not None else OutputDelta(ev.text)
                for b in items.apply(delta):
                    yield b
                continue
            if parser is not None:
                for b in items.apply(parser.finish()):
                    yield b
            incomplete = ev.finish_reason == "length"
            for b in items.finish(incomplete):
                yield b
            status = "incomplete" if incomplete else "completed"
            done = turn.response(status, items.done, ev)
            on_done(done)
            yield w.emit(f"response.{status}", response=done)
            return
    except APIError as exc:
        yield w.emit("error", code=exc.code or exc.type, message=exc.message, param=exc.param)
        failed = turn.response("failed", items.done)
        failed["error"] = {"code": exc.code or "server_error", "message": exc.message}
        if on_failed is not None:
            on_failed(failed)
        yield w.emit("response.failed", response=failed)
