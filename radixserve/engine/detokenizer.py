"""Incremental detokenization with stop strings.

Token ids arrive a few at a time; text must come out as soon as it is final. Two things
make that subtle:

- Byte-level BPE splits multi-byte UTF-8 characters across tokens, and SentencePiece
  decodes a token's leading space differently depending on what precedes it. So each step
  decodes a short window of recent ids twice (with and without the new ones) and emits the
  difference, and waits while the window ends in an incomplete character (U+FFFD).
- Stop strings and stop patterns (``stop_regex``, :mod:`radixserve.stop_regex`) are matched
  on text and excluded from the output (kept, with ``include_stop_str_in_output``: vLLM's
  name, SGLang's ``no_stop_trim``). Text that could still become a stop string or a match
  is held back until it is decided. Before ``min_tokens`` output tokens nothing stops the
  output (as in vLLM and SGLang); from then on, the first stop in the text not yet
  emitted does. A stop pattern that takes too long to match raises
  :class:`~radixserve.stop_regex.StopRegexTimeout`: the caller fails the request.

The router uses this too (the worker never sees text): on ``stopped`` it aborts the request
in the worker and reports ``finish_reason="stop"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from radixserve.sampling_params import SamplingParams
from radixserve.stop_regex import StopPatterns

# Prompt ids used as left context, so the first output token decodes as it would in context.
_CONTEXT_TOKENS = 5


class DetokDelta(NamedTuple):
    """Text that became final with the last :meth:`IncrementalDetokenizer.add` call."""

    text: str
    stopped: bool  # a stop string matched; the request should finish now
    finish_reason: str | None  # "stop" when stopped, else None


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of final text, honouring stop strings.

    ``tokenizer`` is a transformers tokenizer. ``params`` supplies ``stop``, ``stop_regex``,
    ``min_tokens`` and ``skip_special_tokens`` (defaults: no stops, skip special tokens).
    ``prompt_token_ids`` (optional) gives the decoding context of the first output tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._tok = tokenizer
        # A fast tokenizer's Rust decoder, called directly: transformers' decode wraps it in
        # argument conversion that cost more than the decode itself (the router runs this for
        # every streamed token). Same text: clean-up is off either way.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special = params.skip_special_tokens if params is not None else True
        self._stops: tuple[str, ...] = tuple(params.stop) if params is not None else ()
        self._patterns = StopPatterns(params.stop_regex if params is not None else ())
        self._keep_stop = params.include_stop_str_in_output if params is not None else False
        self._matched: str | None = None
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._min_tokens = params.min_tokens if params is not None else 0
        self._num_out = 0  # output token ids fed so far
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""  # decoded output text so far (truncated at a stop string)
        self._emitted = 0  # chars of _text already returned
        self._stopped = False

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return self._text[: self._emitted]

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string, or the stop pattern, that ended the output (None: none did)."""
        return self._matched

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=self._skip_special))
        return self._tok.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def add(self, token_ids: Sequence[int], final: bool = False) -> DetokDelta:
        """Feed new token ids; return the text that is now final.

        ``final=True`` marks the end of the stream: held-back text (an incomplete
        character, a possible stop-string start) is released.
        """
        if self._stopped:
            return DetokDelta("", True, "stop")
        if token_ids:
            self._ids.extend(token_ids)
            self._num_out += len(token_ids)
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full_text = self._decode(self._ids[self._prefix_offset :])
            if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
                self._append(full_text[len(prefix_text) :])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        elif final and self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full_text = self._decode(self._ids[self._prefix_offset :])
            self._append(full_text[len(prefix_text) :])
            self._read_offset = len(self._ids)
        if self._stopped:
            out = self._text[self._emitted :]
            self._emitted = len(self._text)
            return DetokDelta(out, True, "stop")
        end = len(self._text) if final else len(self._text) - self._held_back()
        out = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return DetokDelta(out, False, None)

    def add_each(self, token_ids: Sequence[int], final: bool = False) -> tuple[DetokDelta, int]:
        """:meth:`add` as if the ids came one per call (speculative decoding delivers several
        at once): the text, and how many of ``token_ids`` are the request's, i.e. up to the
        one that completed a stop string (all of them when none did), as a request decoded
        one token per step would have ended."""
        if not (self._stops or self._patterns) or len(token_ids) <= 1:
            return self.add(token_ids, final), len(token_ids)
        texts: list[str] = []
        for i, t in enumerate(token_ids):
            delta = self.add([t], final=final and i == len(token_ids) - 1)
            texts.append(delta.text)
            if delta.stopped:
                return DetokDelta("".join(texts), True, "stop"), i + 1
        return DetokDelta("".join(texts), False, None), len(token_ids)

    def flush(self) -> str:
        """Release everything held back (the stream ended without a stop string)."""
        return self.add((), final=True).text

    def _append(self, delta: str) -> None:
        if not delta:
            return
        start = len(self._text)
        self._text += delta
        if not (self._stops or self._patterns) or self._num_out < self._min_tokens:
            return
        # A stop string may straddle the old text and the new delta.
        search_from = max(self._emitted, start - self._max_stop + 1, 0)
        cut, end, matched = -1, -1, ""
        for s in self._stops:
            i = self._text.find(s, search_from)
            if i != -1 and (cut == -1 or i < cut):
                cut, end, matched = i, i + len(s), s
        if self._patterns:
            m = self._patterns.first_match(self._text, self._emitted)
            if m is not None and (cut == -1 or m.start < cut):
                cut, end, matched = m.start, m.end, m.pattern
        if cut != -1:
            self._text = self._text[: end if self._keep_stop else cut]
            self._matched = matched
            self._stopped = True

    def _held_back(self) -> int:
        """Length of the unemitted text's longest suffix that could still become a stop."""
        held = 0
        if self._patterns and self._num_out >= self._min_tokens:  # else nothing may stop yet
            held = len(self._text) - self._patterns.undecided_from(self._text, self._emitted)
        pending = len(self._text) - self._emitted
        for n in range(min(self._max_stop - 1, pending), held, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return held
