"""The Messages API's answer: its head, content blocks, stop reason and usage."""

from __future__ import annotations

import uuid
from typing import Any

from radixserve.serving.wire import protocol as p


class Reply:
    """What the message's body needs beyond the answer: its id and model."""

    def __init__(self, model: str) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model

    def head(self, input_tokens: int = 0) -> dict[str, Any]:
        """The message without content and stop reason (``message_start``'s)."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }

    def stop_reason(self, final: p.GenerateFinal, calls: bool) -> tuple[str, str | None]:
        """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished request."""
        if final.finish_reason == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        if final.matched_stop is not None:  # the router matched it on the text
            return "stop_sequence", final.matched_stop
        return "end_turn", None


def usage(final: p.GenerateFinal) -> dict[str, Any]:
    u = final.usage
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
    }
