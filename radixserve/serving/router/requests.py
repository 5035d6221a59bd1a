"""Router-side state of one generate request, and how worker outputs become client messages.

The worker sends token ids; the router folds them in here: accumulates tokens, logprobs
and usage, detokenizes incrementally (stop strings are found here, on text), and builds the
:class:`~radixserve.serving.wire.protocol.GenerateChunk` to stream and the final message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from radixserve.engine.outputs import OutputExtras
from radixserve.prefix import lora_namespace
from radixserve.sampling_params import SamplingParams
from radixserve.serving.wire import protocol as p


@dataclass(slots=True, eq=False)
class RouterRequest:
    """One request in flight at the router (``rid`` is router-global, ``client_rid`` the client's)."""

    rid: str
    client: bytes
    client_rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    session_id: str | None
    namespace: str | None
    detok: Any  # radixserve.engine.detokenizer.IncrementalDetokenizer (None while the prompt is encoded)
    arrival: float
    worker_id: int = -1
    dispatched: float = 0.0
    first_token: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[p.TokenLogprob] | None = None
    # Prompt logprobs, embedding, hidden states: folded in from the outputs, sent whole with
    # the final message.
    extras: OutputExtras = field(default_factory=OutputExtras)
    # The hidden-state floats reserved for it while in flight (InFlight's bound; 0: none).
    hidden_floats: int = 0
    usage: p.Usage | None = None
    chunks: int = 0
    retries: int = 0  # times sent to another worker after its worker died (before a first token)
    priority: int = 0  # the client's priority (the worker's cache keeps higher ones longer)
    lora: str | None = None  # the served LoRA adapter it runs with (None: the base model)
    # The weights it ran with (its worker's weight_version when it answered; weights change
    # only between a worker's requests: serving/worker/weight_updates.py).
    weight_version: str = "default"
    # That adapter's cache key on the workers (WorkerHello.lora_adapters; None: unknown).
    lora_key: str | None = None
    # Where the prompt left the cached path (the worker sends it once, when asked).
    cache_report: p.CacheReport | msgspec.UnsetType = msgspec.UNSET

    @property
    def cache_namespace(self) -> str | None:
        """The namespace its prefixes are cached under on a worker, and routed by: its
        tenant's, split by its LoRA adapter's key (radixserve.prefix.lora_namespace)."""
        return lora_namespace(self.namespace, self.lora_key)

    def apply(self, out: p.StepOutput) -> tuple[p.GenerateChunk | None, bool]:
        """Fold in one worker output. Returns the chunk to stream (``None`` when not
        streaming or nothing new) and whether a stop string matched (the request is over)."""
        # Several tokens at once (speculative decoding): only those up to a stop string's.
        delta, taken = self.detok.add_each(out.new_token_ids, final=out.finished)
        new_ids = out.new_token_ids[:taken]
        new_lps = None if out.new_logprobs is None else out.new_logprobs[:taken]
        if new_ids:
            self.first_token = self.first_token or time.monotonic()
            self.token_ids.extend(new_ids)
            if new_lps is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(new_lps)
        self.extras.take(out)
        if out.usage is not None:
            self.usage = out.usage
            if out.usage.cache_report is not msgspec.UNSET:
                self.cache_report = out.usage.cache_report
        chunk = None
        if self.stream and (delta.text or new_ids):
            chunk = p.GenerateChunk(
                request_id=self.client_rid,
                index=self.chunks,
                text=delta.text,
                token_ids=new_ids,
                logprobs=new_lps,
                prompt_tokens=None if self.chunks else len(self.prompt_ids),
                prompt_token_ids=None
                if self.chunks or not self._names_prompt()
                else self.prompt_ids,
            )
            self.chunks += 1
        return chunk, delta.stopped

    def _names_prompt(self) -> bool:
        return self.extras.prompt_logprobs is not None or self.params.return_prompt_token_ids

    def final(self, reason: p.FinishReason) -> p.GenerateFinal:
        """The last message: full text and tokens, usage and router-side timings."""
        now = time.monotonic()
        cached = self.usage.cached_tokens if self.usage is not None else 0
        host = self.usage.cached_host_tokens if self.usage is not None else 0
        disk = self.usage.cached_disk_tokens if self.usage is not None else 0
        drafted = self.usage.spec_drafted_tokens if self.usage is not None else 0
        accepted = self.usage.spec_accepted_tokens if self.usage is not None else 0
        return p.GenerateFinal(
            request_id=self.client_rid,
            finish_reason=reason,
            text=self.detok.text if self.detok is not None else "",
            token_ids=self.token_ids,
            usage=p.Usage(
                prompt_tokens=len(self.prompt_ids),
                cached_tokens=cached,
                completion_tokens=len(self.token_ids),
                cached_host_tokens=host,
                cached_disk_tokens=disk,
                spec_drafted_tokens=drafted,
                spec_accepted_tokens=accepted,
                cache_report=self.cache_report,
            ),
            timings=p.Timings(
                queue_s=(self.dispatched or now) - self.arrival,
                ttft_s=(self.first_token or now) - self.arrival,
                total_s=now - self.arrival,
            ),
            logprobs=self.logprobs,
            # The tokens the prompt logprobs score, or that the client asked for (it may have
            # sent text or messages).
            prompt_token_ids=self.prompt_ids if self._names_prompt() else None,
            worker_id=self.worker_id,
            matched_stop=self.detok.matched_stop if self.detok is not None else None,
            weight_version=self.weight_version,
            **self.extras.fields(len(self.prompt_ids), len(self.token_ids)),
        )
