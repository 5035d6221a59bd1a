"""Request intake: check what a caller submits and make the scheduler's :class:`Request`.

Everything that can be wrong with a request is found here, before the scheduler sees it
(vLLM's input processor does the same): invalid sampling parameters, an empty or
out-of-vocabulary prompt, one too long to ever fit the pool or the model, a constraint that
does not compile or matches only the empty string. Each raises ``ValueError`` with a
message the serving layer returns to the client as it is.
"""

from __future__ import annotations

import uuid
from collections.abc import Container, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import msgspec

from radixserve.bad_words import encode_words, word_errors
from radixserve.constrained.interface import TokenGrammar
from radixserve.constrained.thinking_budget import ThinkingBudget, ThinkMarkers, think_markers
from radixserve.engine.sampler import Sampler
from radixserve.model.config import ModelConfig
from radixserve.model.lora import LoraRegistry, lora_namespace
from radixserve.sampling_params import (
    MAX_HIDDEN_STATE_FLOATS,
    SamplingParams,
    hidden_state_floats,
)
from radixserve.scheduling.request import Request
from radixserve.token_bytes import TokenBytes

if TYPE_CHECKING:
    from radixserve.constrained.matcher import GrammarMatcher


class RequestIntake:
    """Validates requests for one engine and builds them.

    ``max_total_len``: prompt + output of one request (the smaller of ``max_model_len`` and
    the pool); ``max_model_len`` and ``pool_tokens`` only explain it in the error message.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        sampler: Sampler,
        *,
        max_total_len: int,
        max_model_len: int,
        pool_tokens: int,
        lora: LoraRegistry | None = None,
        no_embeddings: str | None = None,
        embeddings_only: bool = False,
    ) -> None:
        """``no_embeddings``: why this engine cannot return embeddings (None: it can);
        ``embeddings_only``: its checkpoint has no LM head, so it serves nothing else."""
        self.model_config = model_config
        self.lora = lora
        self.no_embeddings = no_embeddings
        self.embeddings_only = embeddings_only
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.max_total_len = max_total_len
        self.max_model_len = max_model_len
        self.pool_tokens = pool_tokens

    def _check_hidden_states(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse hidden states this engine cannot return, or more of them (one hidden_size
        vector per position the model reads) than MAX_HIDDEN_STATE_FLOATS, counted over the
        prompt and max_tokens as asked (not this engine's context), so the bound a client
        meets is the same on every server."""
        if self.no_embeddings is not None:  # the same final-norm output, on rank 0
            raise ValueError(f"hidden states are not returned {self.no_embeddings}")
        positions, floats = hidden_state_floats(
            prompt_len, max_tokens, self.model_config.hidden_size
        )
        if floats > MAX_HIDDEN_STATE_FLOATS:
            raise ValueError(
                f"return_hidden_states would return {positions} positions x "
                f"{self.model_config.hidden_size} floats = {floats} floats, more than "
                f"{MAX_HIDDEN_STATE_FLOATS}: shorten the prompt or max_tokens"
            )

    def make_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        namespace: str | None,
        taken_ids: Container[str] = (),
        session_id: str | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> Request:
        """A new request (a fresh id when ``request_id`` is None); ``taken_ids``: the ids
        in use, which ``request_id`` must not repeat. ``lora``: the served LoRA adapter
        it runs with (None: the base model); its cache namespace is the adapter's own."""
        params = params or SamplingParams()
        lora_slot, lora_key = self._adapter(lora)
        if params.prediction is not None and len(params.prediction) > self.max_total_len:
            raise ValueError(
                f"the prediction has {len(params.prediction)} tokens, more than an output of "
                f"this engine can hold ({self.max_total_len})"
            )
        params = params.validate(self.model_config.vocab_size)
        if params.return_embedding and self.no_embeddings is not None:
            raise ValueError(f"embeddings are not returned {self.no_embeddings}")
        if self.embeddings_only and not params.return_embedding:
            raise ValueError(self._embeddings_only_reason())
        if params.bad_words and params.bad_words_token_ids is None and self.tokenizer is not None:
            words = encode_words(self.tokenizer, params.bad_words)
            too_long = word_errors(None, words)  # bounded as a caller's sequences are
            if too_long:
                raise ValueError("invalid sampling parameters: " + "; ".join(too_long))
            params = msgspec.structs.replace(params, bad_words_token_ids=words)
        ids = params.truncated([int(t) for t in prompt_token_ids], self.max_total_len)
        if self.model_config.classifier is not None:  # the token transformers pools ends it
            ids = self.model_config.classifier.pooled_prompt(ids)
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_total_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens is too long: this engine fits at most {self.max_total_len - 1} "
                f"prompt tokens (max_model_len {self.max_model_len}, KV pool {self.pool_tokens} tokens)"
            )
        if params.return_hidden_states:
            self._check_hidden_states(len(ids), params.max_tokens)
        if request_id is not None and request_id in taken_ids:
            raise ValueError(f"duplicate request id {request_id!r}")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        gen = self.sampler.new_generator(params.seed) if params.seed is not None else None
        matcher = self._new_grammar_matcher(params)
        grammar: TokenGrammar | None = matcher
        budget, markers = params.thinking_token_budget, self.think_markers
        if budget is not None and markers is not None:  # without <think>, any budget is kept
            grammar = ThinkingBudget(
                budget, markers, self.model_config.vocab_size, ids, matcher, self.token_bytes
            )
        return Request(
            rid,
            ids,
            len(ids),
            params,
            self.max_total_len,
            namespace=lora_namespace(namespace, lora_key),
            session_id=session_id,
            priority=priority,
            generator=gen,
            grammar=grammar,
            lora_slot=lora_slot,
        )

    def _embeddings_only_reason(self) -> str:
        """Why a request that is not for an embedding is refused by an embeddings-only model."""
        mc = self.model_config
        if mc.classifier is not None:
            return (
                f"this model is a sequence classifier ({mc.architecture}, "
                f"{mc.classifier.num_labels} labels): it serves classification only "
                "(/v1/classify, /classify, /v1/embeddings), not generation"
            )
        return (
            "this model's checkpoint has no language-model head (an embedding model saved "
            "as its base model): it serves embeddings only (/v1/embeddings)"
        )

    def _adapter(self, lora: str | None) -> tuple[int, str | None]:
        """The adapter's slot and cache key (0 and None: the base model); ``ValueError`` for
        one not served."""
        if lora is None:
            return 0, None
        if self.lora is None:
            raise ValueError(f"unknown LoRA adapter {lora!r}: this engine serves none")
        return self.lora.lookup(lora)

    @cached_property
    def think_markers(self) -> ThinkMarkers | None:
        """The model's ``<think>``/``</think>`` token ids (None: it has none, or no tokenizer)."""
        return think_markers(self.tokenizer) if self.tokenizer is not None else None

    @cached_property
    def token_bytes(self) -> TokenBytes | None:
        """Each token's bytes, read as a thinking budget asks (None without a tokenizer)."""
        return TokenBytes(self.tokenizer) if self.tokenizer is not None else None

    def _new_grammar_matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """Compile (cached per tokenizer and constraint) the request's regex / JSON schema /
        choices and start its matcher; None when unconstrained. ``ValueError`` when invalid."""
        constraint = params.constraint
        if constraint is None:
            return None
        from radixserve.constrained.grammar import compiler_for

        mc = self.model_config
        matcher = compiler_for(self.tokenizer, mc.vocab_size, mc.eos_token_ids).new_matcher(
            constraint
        )
        if matcher.can_only_end:
            raise ValueError(
                f"the constraint matches only the empty string: {constraint.describe()}"
            )
        return matcher
