"""Speculative decoding: drafters that guess a request's next tokens, and how much to guess.

A drafter proposes up to ``k`` tokens to follow a request's context; the scheduler runs them
through the model in one forward after the request's last token (``k + 1`` rows, inside the
normal continuous batch) and keeps the longest prefix the model agrees with, plus the
model's own next token (:func:`~radixserve.speculative.verify.accepted_length`). A sampled
request's rows agree or not by rejection sampling
(:func:`~radixserve.speculative.rejection.rejection_sample`), so its output keeps the
distribution of plain sampling.

- ``ngram`` (:class:`~radixserve.speculative.ngram.NgramDrafter`): prompt lookup, as vLLM's
  n-gram proposer: the last tokens of the context matched earlier in the request's own
  prompt and output, what followed there proposed.
- ``radix`` (:class:`~radixserve.speculative.suffix_index.RadixDrafter`): what followed the
  context's last tokens in the sequences the radix cache was given (earlier requests'
  prompts and outputs, this request's prompt), within the request's own cache namespace.

- ``draft`` (:class:`~radixserve.speculative.draft_model.DraftModelDrafter`): a smaller model
  of the same vocabulary drafts greedily, on KV of its own
  (:class:`~radixserve.speculative.draft_kv.DraftKV`); the engine loads it
  (``engine.draft_setup``); ``make_draft`` makes a truncated-layer draft of a checkpoint.
- a request's ``prediction`` (:class:`~radixserve.speculative.prediction.PredictionDrafter`,
  OpenAI's predicted outputs): the text the client expects, followed while the output
  agrees and found again after an edit; it wraps the server's drafter, if any, and drafts
  with no algorithm configured too.

How many tokens a request drafts is set per request from its acceptance so far
(:class:`~radixserve.speculative.adaptive.AdaptiveK`), down to none for a while when its
drafts keep failing. This package sits at the scheduling layer: the scheduler calls it
with host lists; only :mod:`.rejection` (the sampler calls it on the device) and the draft
model's drafter (its own model and pool) touch tensors.
"""

from __future__ import annotations

from radixserve.speculative.adaptive import AdaptiveK
from radixserve.speculative.drafter import ALGORITHMS, Drafter
from radixserve.speculative.factory import make_drafter
from radixserve.speculative.verify import accepted_length

__all__ = ["ALGORITHMS", "AdaptiveK", "Drafter", "accepted_length", "make_drafter"]
