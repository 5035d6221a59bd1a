"""What the synchronous and the asyncio clients share: the error type, the one request
builder (and the options it takes), ids.

Torch-free (msgspec only, through the protocol module).
"""

from __future__ import annotations

import itertools
import os
from typing import TypedDict

import msgspec

from radixserve.sampling_params import SamplingParams
from radixserve.serving.wire import protocol as p

Event = p.GenerateChunk | p.GenerateFinal


class ServerError(RuntimeError):
    """The router answered with an :class:`~radixserve.serving.wire.protocol.Error`."""

    def __init__(self, error: p.Error) -> None:
        super().__init__(f"[{error.code}] {error.message}")
        self.code = error.code
        self.message = error.message
        self.request_id = error.request_id


class GenerateOptions(TypedDict, total=False):
    """What a generate request carries besides its prompt text, its id and ``stream``: the
    keyword arguments both clients' generate methods take (``Client.submit``,
    ``AsyncClient.stream`` and the methods built on them), declared once here."""

    input_ids: list[int] | None
    messages: list[p.ChatMessage] | list[dict[str, str]] | None
    params: SamplingParams | None
    session_id: str | None
    namespace: str | None
    add_generation_prompt: bool
    continue_final_message: bool
    cache_salt: str | None
    priority: int
    tools: str | None  # JSON of the request's tool list, rendered by the chat template
    chat_template_kwargs: str | None  # JSON of extra template variables
    prediction: str | None  # the output expected (predicted outputs), encoded by the router
    lora: str | None  # the served LoRA adapter to run with (None: the base model)
    chat_template: str | None  # the request's own template for messages (a trusting router)


class ChatRendering(TypedDict, total=False):
    """How a chat prompt is rendered, as :class:`GenerateOptions` has it: the keyword
    arguments of both clients' ``tokenize_chat``."""

    add_generation_prompt: bool
    continue_final_message: bool
    tools: str | None
    chat_template_kwargs: str | None
    chat_template: str | None


def generate_request(
    request_id: str, text: str | None, stream: bool, options: GenerateOptions
) -> p.GenerateRequest:
    """The :class:`GenerateRequest` both clients send (chat messages given as dicts are
    converted). A keyword neither client knows is a :class:`TypeError`, as for any call."""
    unknown = options.keys() - GenerateOptions.__optional_keys__
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    messages = options.get("messages")
    chat = None
    if messages is not None:
        chat = [
            m if isinstance(m, p.ChatMessage) else msgspec.convert(m, p.ChatMessage)
            for m in messages
        ]
    return p.GenerateRequest(
        request_id=request_id,
        text=text,
        input_ids=options.get("input_ids"),
        messages=chat,
        add_generation_prompt=options.get("add_generation_prompt", True),
        continue_final_message=options.get("continue_final_message", False),
        params=options.get("params") or SamplingParams(),
        stream=stream,
        session_id=options.get("session_id"),
        namespace=options.get("namespace"),
        cache_salt=options.get("cache_salt"),
        priority=options.get("priority", 0),
        tools=options.get("tools"),
        chat_template_kwargs=options.get("chat_template_kwargs"),
        prediction=options.get("prediction"),
        lora=options.get("lora"),
        chat_template=options.get("chat_template"),
    )


class RequestIds:
    """Request ids unique per client: a per-process random prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(4).hex()
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}-{next(self._count)}"
