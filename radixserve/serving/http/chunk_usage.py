"""The ``usage`` field of streamed OpenAI chunks, vLLM's ``continuous_usage_stats`` included."""

from __future__ import annotations

from typing import Any

from radixserve.serving.wire import protocol as p


class ChunkUsage:
    """The ``usage`` field of a streamed OpenAI chunk. ``stream_options.include_usage``: the
    field is ``null`` on every chunk and the totals come in a last chunk of their own; with
    vLLM's ``continuous_usage_stats`` too, each choice's chunk carries that choice's usage so
    far (its prompt, its tokens up to that chunk)."""

    def __init__(self, include: bool, continuous: bool) -> None:
        self.include, self.continuous = include, include and continuous
        self._prompt: dict[int, int] = {}
        self._completion: dict[int, int] = {}

    def started(self, i: int, ev: p.GenerateChunk | p.GenerateFinal) -> None:
        """Choice ``i``'s first event: its prompt's length."""
        if isinstance(ev, p.GenerateFinal):
            self._prompt[i] = ev.usage.prompt_tokens
        elif ev.prompt_tokens is not None:
            self._prompt[i] = ev.prompt_tokens

    def add(self, i: int, ev: p.GenerateChunk | p.GenerateFinal) -> None:
        """Choice ``i``'s tokens of ``ev`` (a final: its counts, which are the exact ones)."""
        if isinstance(ev, p.GenerateFinal):
            self._prompt[i] = ev.usage.prompt_tokens
            self._completion[i] = ev.usage.completion_tokens
        else:
            self._completion[i] = self._completion.get(i, 0) + len(ev.token_ids)

    def field(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The chunk's ``usage`` entry (none without ``include_usage``)."""
        if not self.include:
            return {}
        if not (self.continuous and choices):
            return {"usage": None}
        i = choices[0]["index"]
        prompt, completion = self._prompt.get(i, 0), self._completion.get(i, 0)
        return {
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        }
