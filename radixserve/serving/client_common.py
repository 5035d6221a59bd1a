"""What the synchronous and the asyncio clients share: the error type, request building, ids.

Torch-free (msgspec only, through the protocol module).
"""

from __future__ import annotations

import itertools
import os

import msgspec

from radixserve.sampling_params import SamplingParams
from radixserve.serving import protocol as p

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
Event = p.GenerateChunk | p.GenerateFinal


class ServerError(RuntimeError):
    """The router answered with an :class:`~radixserve.serving.protocol.Error`."""

    def __init__(self, error: p.Error) -> None:
        super().__init__(f"[{error.code}] {error.message}")
        self.code = error.code
        self.message = error.message
        self.request_id = error.request_id


def generate_request(
    request_id: str,
    text: str | None,
    input_ids: list[int] | None,
    messages: list[p.ChatMessage] | list[dict[str, str]] | None,
    params: SamplingParams | None,
    stream: bool,
    session_id: str | None,
    namespace: str | None,
    add_generation_prompt: bool,
    cache_salt: str | None = None,
    tools: str | None = None,
    chat_template_kwargs: str | None = None,
) -> p.GenerateRequest:
    """The :class:`GenerateRequest` both clients send (chat messages given as dicts are converted)."""
    chat = None
    if messages is not None:
        chat = [
            m if isinstance(m, p.ChatMessage) else msgspec.convert(m, p.ChatMessage)
            for m in messages
        ]
    return p.GenerateRequest(
        request_id=request_id,
        text=text,
        input_ids=input_ids,
        messages=chat,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        params=params or SamplingParams(),
        stream=stream,
        session_id=session_id,
        namespace=namespace,
        cache_salt=cache_salt,
    )


class RequestIds:
    """Request ids unique per client: a per-process random prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(4).hex()
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}-{next(self._count)}"
