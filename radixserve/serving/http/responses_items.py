"""Responses API items <-> chat turns, and its flat tools in the chat API's form.

Input items (OpenAI's shapes): messages (``{"role", "content"}``, with or without
``"type": "message"``; content a string or ``input_text`` / ``output_text`` parts),
``function_call`` (a call of an earlier turn), ``function_call_output`` (its result) and
``reasoning``. Consecutive assistant-side items (reasoning, an assistant message, function
calls) are one assistant turn, the way the model wrote them in one answer, so a
conversation resent as items renders the same prompt as one continued with
``previous_response_id`` (which replays the stored items through this same function). A
malformed item or one of an unsupported type is a 400 naming it.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from radixserve.agents.types import ToolCall
from radixserve.serving.http.chat_tools import FunctionIn, ToolIn
from radixserve.serving.http.errors import invalid
from radixserve.serving.wire import protocol as p


class _Item(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    id: str | None = Field(default=None, min_length=1, max_length=256)  # the client's, kept


class _Part(_Item):
    type: str
    text: str | None = None


class MessageItem(_Item):
    role: str
    content: str | list[_Part]


class CallItem(_Item):
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class CallOutputItem(_Item):
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[_Part]


class ReasoningItem(_Item):
    summary: list[_Part] = []
    content: list[_Part] | None = None
    # What ``include: ["reasoning.encrypted_content"]`` returned (SEALED): the reasoning of a
    # conversation a stateless client (store false) carries itself.
    encrypted_content: str | None = None


_ITEMS: dict[str, type[_Item]] = {
    "message": MessageItem,
    "function_call": CallItem,
    "function_call_output": CallOutputItem,
    "reasoning": ReasoningItem,
}
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(parts: str | list[_Part], where: str) -> str:
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise invalid(
                f"{where}.content[{j}]: only text parts are supported (got {part.type!r})",
                param=where,
            )
        texts.append(part.text)
    return "".join(texts)


def parse_items(raw: str | list[Any], where: str = "input") -> list[dict[str, Any]]:
    """The request's ``input`` as checked items (a string is one user message), each a
    plain dict with its ``type`` (what the store keeps)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    out = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{at} must be an object", param=at)
        kind = item.get("type", "message")
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise invalid(
                f"{at}.type {kind!r} is not supported (message, function_call, "
                "function_call_output, reasoning)",
                param=at,
            )
        try:
            checked = model.model_validate(item)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(x) for x in first.get("loc", ()))
            raise invalid(f"{at}.{loc}: {first.get('msg')}", param=at) from None
        if isinstance(checked, MessageItem) and checked.role not in _ROLES:
            raise invalid(f"{at}.role must be one of {', '.join(_ROLES)}", param=at)
        if isinstance(checked, CallItem) and not _is_object(checked.arguments):
            raise invalid(f"{at}.arguments must be a JSON object as text", param=at)
        out.append({"type": kind, **checked.model_dump(exclude_none=True)})
    return out


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` each with an ``id`` (the client's, or a new one): what the store keeps, so
    that ``GET /v1/responses/{id}/input_items`` pages by the same ids every time."""
    return [
        item if "id" in item else {"id": new_id(_ID_PREFIX.get(item["type"], "item")), **item}
        for item in items
    ]


_ID_PREFIX = {"message": "msg", "function_call": "fc", "reasoning": "rs"}
MAX_PAGE = 100  # input items listed at most per page (OpenAI's bound)


def listed(item: dict[str, Any]) -> dict[str, Any]:
    """A stored input item as ``input_items`` lists it: a message's text content as its
    parts (``input_text``; ``output_text`` for an assistant's), and its status."""
    if item["type"] != "message":
        return item
    content = item["content"]
    if isinstance(content, str):
        kind = "output_text" if item["role"] == "assistant" else "input_text"
        content = [{"type": kind, "text": content}]
    return {"status": "completed", **item, "content": content}


def input_page(
    items: list[dict[str, Any]], after: str | None, limit: int, order: str
) -> dict[str, Any]:
    """One page of a response's input items (OpenAI's list shape): in ``order`` (``asc``:
    as given, ``desc``: newest first), those after the item ``after`` names, at most
    ``limit``. A bad value is a 400."""
    if not 1 <= limit <= MAX_PAGE:
        raise invalid(f"limit must be in [1, {MAX_PAGE}], got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise invalid(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise invalid(f"after names no input item of this response: {after!r}", param="after")
        start = ids.index(after) + 1
    page = [listed(item) for item in ordered[start : start + limit]]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(ordered),
    }


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def to_messages(items: list[dict[str, Any]], instructions: str | None) -> list[p.ChatMessage]:
    """Chat turns of checked items (see the module doc), after the instructions."""
    out = [p.ChatMessage(role="system", content=instructions)] if instructions else []
    names: dict[str, str] = {}
    turn: dict[str, Any] | None = None  # the assistant turn being gathered

    def close() -> None:
        nonlocal turn
        if turn is not None:
            out.append(
                p.ChatMessage(
                    role="assistant",
                    content=turn["content"],
                    tool_calls=turn["calls"] or None,
                    reasoning_content=turn["reasoning"] or None,
                )
            )
            turn = None

    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            close()
            role = "system" if item["role"] == "developer" else item["role"]
            out.append(p.ChatMessage(role=role, content=_text(_parts(item), f"input[{i}]")))
        elif kind == "function_call_output":
            close()
            cid = item["call_id"]
            content = _text(_parts(item, "output"), f"input[{i}]")
            out.append(
                p.ChatMessage(role="tool", content=content, tool_call_id=cid, name=names.get(cid))
            )
        else:
            if turn is None:
                turn = {"content": "", "calls": [], "reasoning": ""}
            if kind == "message":
                turn["content"] += _text(_parts(item), f"input[{i}]")
            elif kind == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                text = _text(_parts({"content": parts}), f"input[{i}]")
                turn["reasoning"] += text or unsealed(item.get("encrypted_content"))
            else:
                names[item["call_id"]] = item["name"]
                turn["calls"].append(
                    p.ToolCallPart(
                        id=item["call_id"], name=item["name"], arguments=item["arguments"]
                    )
                )
    close()
    return out


def _parts(item: dict[str, Any], key: str = "content") -> str | list[_Part]:
    value = item[key]
    return value if isinstance(value, str) else [_Part.model_validate(v) for v in value]


def output_items(
    content: str, reasoning: str, calls: list[ToolCall], incomplete: bool, seal: bool = False
) -> list[dict[str, Any]]:
    """A finished answer as Responses output items: reasoning (``seal``: with its
    ``encrypted_content``), the message, the calls."""
    status = "incomplete" if incomplete else "completed"
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, status, seal))
    if content or not calls:
        items.append(message_item(new_id("msg"), content, status))
    items.extend(call_item(new_id("fc"), c.id, c.name, c.arguments, "completed") for c in calls)
    return items


def reasoning_item(item_id: str, text: str, status: str, seal: bool = False) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    item = {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
    if seal:
        item["encrypted_content"] = sealed(text)
    return item


# OpenAI's ``encrypted_content`` carries a reasoning item's text for clients that keep no
# server state (store false) and send it back with the next turn. OpenAI encrypts it; here
# it is the text, encoded and marked (no key to manage, and nothing to hide: the client may
# send any reasoning text as the item's content anyway). A blob this server did not write
# (another provider's) reads as no reasoning.
SEALED = "rsv1."


def sealed(text: str) -> str:
    """``text`` as the ``encrypted_content`` of a reasoning item (:data:`SEALED`)."""
    return SEALED + base64.urlsafe_b64encode(text.encode()).decode()


def unsealed(value: str | None) -> str:
    """The reasoning text of an ``encrypted_content`` :func:`sealed` wrote ("" otherwise)."""
    if not value or not value.startswith(SEALED):
        return ""
    try:
        return base64.urlsafe_b64decode(value[len(SEALED) :].encode()).decode()
    except (ValueError, UnicodeDecodeError):
        return ""


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


# --------------------------------------------------------------------------- tools


def chat_tools_of(tools: list[dict[str, Any]] | None) -> list[ToolIn] | None:
    """Responses' flat function tools (``{"type": "function", "name", "parameters", ...}``)
    as the chat API's; any other tool type (web search, file search, MCP, ...) is a 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise invalid(
                f"tools[{i}].type {kind!r} is not supported (only function tools)",
                param=f"tools[{i}]",
            )
        try:
            fn = FunctionIn.model_validate({k: v for k, v in tool.items() if k != "type"})
        except ValidationError as exc:
            raise invalid(
                f"tools[{i}]: {exc.errors()[0].get('msg')}", param=f"tools[{i}]"
            ) from None
        out.append(ToolIn(type="function", function=fn))
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' ``tool_choice`` in the chat API's form (``{"type": "function", "name"}``
    -> ``{"type": "function", "function": {"name"}}``)."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "name": ...}',
                param="tool_choice",
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice
