"""The Messages API's answer: its head, content blocks, stop reason and usage."""

from __future__ import annotations

import uuid
from typing import Any

from radixserve.serving.wire import protocol as p


class Reply:
    """What the message's body needs beyond the answer: id, model, the stop sequences."""

    def __init__(self, model: str, stops: list[str], eos: list[int], tokenizer: Any) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.stops = stops
        self.eos = set(eos)
        self.tokenizer = tokenizer

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
        ids = final.token_ids
        if not self.stops or (ids and ids[-1] in self.eos):
            return "end_turn", None
        return "stop_sequence", self.matched_stop(ids)

    def matched_stop(self, ids: list[int]) -> str | None:
        """Which stop sequence ended the answer: the one ending latest in the last tokens'
        text (the router trims it from the text; the tokens still hold it)."""
        if len(self.stops) == 1 or self.tokenizer is None:
            return self.stops[0]
        tail = self.tokenizer.decode(ids[-64:])
        ends = {s: tail.rfind(s) + len(s) for s in self.stops if s in tail}
        return max(ends, key=lambda s: (ends[s], len(s))) if ends else self.stops[0]


def usage(final: p.GenerateFinal) -> dict[str, Any]:
    u = final.usage
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
    }
