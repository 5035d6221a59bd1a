"""The offline API's pieces: the prompt shapes ``Engine.generate`` takes, and the collector
that turns one request's step outputs into its :class:`GenerateOutput`.

:meth:`Engine.generate <radixserve.engine.engine.Engine.generate>` queues every prompt, steps
the engine until all have finished and feeds each :class:`StepOutput` to its request's
:class:`GenerateCollector`, which detokenizes incrementally and watches for stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.outputs import (
    GenerateOutput,
    OutputExtras,
    StepOutput,
    TokenLogprob,
    Usage,
)
from radixserve.sampling_params import SamplingParams
from radixserve.stop_regex import StopRegexTimeout

# One text, texts, one prompt as token ids, or prompts as token ids.
PromptInput = str | Sequence[str] | Sequence[Sequence[int]] | Sequence[int]


def normalize_prompts(prompts: PromptInput) -> list[str | list[int]]:
    """``prompts`` as a list of prompts, each a text or a list of token ids."""
    if isinstance(prompts, str):
        return [prompts]
    # The elements' type depends on which of PromptInput's shapes this is, told apart here.
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return [p if isinstance(p, str) else list(p) for p in items]


class GenerateCollector:
    """Accumulates one request's outputs inside :meth:`Engine.generate`."""

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_ids: list[int]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, params, prompt_ids)
        self.prompt_ids = prompt_ids
        self.want_logprobs = params.logprobs is not None
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.extras = OutputExtras()
        self.text = ""
        self.stopped = False
        self.error: str | None = None  # the router would fail the request with this (a 400)
        self.last: StepOutput | None = None
        self.cache_report: Any = msgspec.UNSET  # sent once, with an early output

    def add(self, o: StepOutput) -> bool:
        """Take one output; True when a stop string just matched (the caller stops the request)."""
        self.last = o
        if o.usage is not None and o.usage.cache_report is not msgspec.UNSET:
            self.cache_report = o.usage.cache_report
        self.extras.take(o)
        if self.stopped:
            return False
        # Several tokens at once (speculative decoding): only those up to a stop string's.
        try:
            delta, taken = self.detok.add_each(o.new_token_ids, final=o.finished)
        except StopRegexTimeout as exc:
            self.stopped, self.error = True, str(exc)
            return not o.finished
        self.token_ids += o.new_token_ids[:taken]
        if o.new_logprobs:
            self.logprobs += o.new_logprobs[:taken]
        self.text += delta.text
        if delta.stopped:
            self.stopped = True
            return not o.finished
        return False

    def result(self, rid: str) -> GenerateOutput:
        """The request's result, once its final output was taken."""
        o = self.last
        assert o is not None and o.finished
        reason = "error" if self.error else "stop" if self.stopped else o.finish_reason
        usage = o.usage or Usage(len(self.prompt_ids), 0, len(self.token_ids))
        return GenerateOutput(
            request_id=rid,
            text=self.text,
            token_ids=self.token_ids,
            finish_reason=reason,
            usage=Usage(
                usage.prompt_tokens,
                usage.cached_tokens,
                len(self.token_ids),
                usage.cached_host_tokens,
                usage.cached_disk_tokens,
                usage.spec_drafted_tokens,
                usage.spec_accepted_tokens,
                self.cache_report,
            ),
            prompt_token_ids=self.prompt_ids,
            logprobs=self.logprobs if self.want_logprobs else None,
            error=self.error or o.error,
            matched_stop=self.detok.matched_stop,
            **self.extras.fields(len(self.prompt_ids), len(self.token_ids)),
        )
