"""Sampling parameters: one msgspec Struct shared by the engine, the wire protocol and the DSL.

Torch-free on purpose, so that clients import it light. ``validate()`` is the one place
where parameter values are checked; the engine, the router and the gateways all call it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from radixserve import bad_words as bad_word_rules
from radixserve import logit_bias as bias_rules
from radixserve import stop_regex
from radixserve.constrained.spec import (
    CONSTRAINT_FIELDS,
    Constraint,
    constraint_errors,
    constraint_of,
)

# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32
# (vLLM draws the same line).
SAMPLING_EPS = 1e-5
# Integer fields stay within int64 so that every layer (msgpack frames, torch) can carry them.
_INT_LIMIT = 2**63
# Token ids are int32 everywhere (page tables, torch indices).
TOKEN_ID_LIMIT = 2**31
# The router looks for every stop string in the text of every step: their number and length
# are bounded, as SGLang's and vLLM's users need (a few short strings), not by the body size.
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 1024
# Every step stages a row's allowed tokens: a short list (labels, digits), bounded.
MAX_ALLOWED_TOKEN_IDS = 4096


MAX_PIN_TTL_S = 86400.0  # a day: a pin is a cache hint, not storage
# Tokens whose logprobs a request may ask for at each position (logprob_token_ids): each
# one is a float per reported position on the wire.
MAX_LOGPROB_TOKEN_IDS = 256


# The most floats a request's hidden states may come to (return_hidden_states: hidden_size
# per position read); a larger request is refused before it runs. 16 Mi floats: ~150 MB as
# the wire's float64s and ~300 MB of JSON, e.g. 4096 positions of a 4096-wide model.
MAX_HIDDEN_STATE_FLOATS = 1 << 24


def hidden_state_floats(prompt_len: int, max_tokens: int, hidden_size: int) -> tuple[int, int]:
    """``(positions, floats)`` a request asking for hidden states may return at most: one
    ``hidden_size`` vector per position the model reads of its prompt and ``max_tokens``
    (all but the last token's)."""
    positions = prompt_len + max_tokens - 1
    return positions, positions * hidden_size


def read_positions(
    hidden: list[list[float]] | None, prompt_len: int, output_len: int
) -> list[list[float]] | None:
    """``hidden`` of the positions the model read of a prompt and output of these lengths,
    all but the output's last token: a stop string may end the output before the engine
    does, and the hidden states of what it cut go with it."""
    return None if hidden is None else hidden[: prompt_len + output_len - 1]


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How to sample one request's completion.

    ``temperature == 0`` (or below ``SAMPLING_EPS``) means greedy. ``top_k <= 0`` and
    ``top_p == 1`` and ``min_p == 0`` disable those filters. ``logprobs``: ``None`` returns
    none; ``0`` returns the chosen token's logprob; ``k > 0`` adds the top-k alternatives.
    ``prompt_logprobs_start``:
    when set, the logprob of every prompt token from that position on is returned
    (the DSL's ``select`` and SGLang's ``logprob_start_len`` use it), each with its rank and
    ``logprobs``' k likeliest tokens; ``prompt_logprobs`` (vLLM's) asks for them from the
    first token on with its own k.
    ``regex`` / ``json_schema`` / ``choices`` / ``ebnf``: a grammar the output must follow (see
    :mod:`radixserve.constrained`); the request ends with "stop" as soon as the grammar
    is complete and nothing more can follow.
    """

    max_tokens: int = 128
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    # Stop where one of these patterns (Python's re syntax; SGLang's stop_regex) first matches
    # the output text: radixserve.stop_regex.
    stop_regex: list[str] = []
    # Keep the stop string, or the text a stop pattern matched, that ended the output at its
    # end (vLLM's name; SGLang's no_stop_trim); by default it is cut off.
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs_start: int | None = None
    # vLLM's prompt_logprobs: the prompt's logprobs from its first token on (from
    # prompt_logprobs_start where that is set), each position with this many likeliest tokens
    # (instead of logprobs' k) beside the scored token and its rank.
    prompt_logprobs: int | None = None
    # SGLang's token_ids_logprob: beside each reported logprob (``logprobs`` set), the logprobs
    # of these tokens at that position, in this order (at most MAX_LOGPROB_TOKEN_IDS).
    logprob_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # Constrained decoding (at most one): the output must match ``regex`` in full, be JSON
    # valid against ``json_schema`` (JSON text of the schema), or be one of ``choices``.
    regex: str | None = None
    json_schema: str | None = None
    choices: list[str] | None = None
    # JSON text ``{"begin": str, "schema": {...}, "end": str}``: the output is ``begin``, a
    # JSON value valid against ``schema``, then ``end`` (a tool call in a model's own markup).
    tagged_json: str | None = None
    # JSON text of an xgrammar structural tag (``{"type": "structural_tag", "format": ...}``):
    # free text with tool calls whose arguments follow their schemas (strict tools, and
    # several forced calls); see radixserve.agents.tool_tags.
    structural_tag: str | None = None
    # A grammar in EBNF as xgrammar reads it (llama.cpp's GBNF: ``root ::= ...``; SGLang's
    # ``ebnf``, vLLM's ``grammar``): the output must be a string of its root rule.
    ebnf: str | None = None
    # OpenAI's logit_bias: token id -> bias in [-100, 100] added to the logits before the
    # draw (see radixserve.logit_bias); at most 300 entries.
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: the output is drawn from these tokens only (at most
    # MAX_ALLOWED_TOKEN_IDS; not with a grammar, which decides the tokens itself).
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: the output never spells one of these words (radixserve.bad_words);
    # the engine encodes them into bad_words_token_ids (callers with ids may set those).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's truncate_prompt_tokens: only the prompt's last k tokens are read (-1: as many as
    # the context holds); the router and the engine's intake both apply it (truncated).
    truncate_prompt_tokens: int | None = None
    # Keep this request's prompt prefix pinned in the KV cache for this many seconds after
    # it finishes, refreshed by every hit (within the server's pin budget; None: no pin).
    pin_ttl_s: float | None = None
    # At most this many tokens inside the model's <think> block, then "\n</think>" is forced
    # (radixserve.constrained.thinking_budget; vLLM's name). None: no budget.
    thinking_token_budget: int | None = None
    # Report where the prompt left the longest cached path and why (usage.cache_report;
    # radixserve.memory.miss_report). Not about sampling: it rides here to reach the worker.
    return_cache_report: bool = False
    # Put the prompt's token ids in the final message (vLLM's return_token_ids: a client that
    # sent text or messages learns the tokens the model read). Not about sampling either: the
    # router reads it.
    return_prompt_token_ids: bool = False
    # The output the client expects, as token ids (OpenAI's predicted outputs: a file an
    # edit mostly repeats): drafted from and verified (radixserve.speculative.prediction),
    # so it changes how fast the output comes, never what it is.
    prediction: list[int] | None = None
    # Return the prompt's embedding: the final norm's output at its last token (last-token
    # pooling, as decoder embedding models pool: Qwen3-Embedding, gte-Qwen2, e5-mistral),
    # unnormalized, with the first output (StepOutput.embedding). Not about sampling either.
    return_embedding: bool = False
    # Return the final norm's output (the model's last hidden state, as transformers'
    # ``hidden_states[-1]``) at every position the model reads: each prompt token's and each
    # output token's but the last (SGLang's return_hidden_states). Computed for the whole
    # prompt even where a prefix is cached; with the final output only. Not about sampling.
    return_hidden_states: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def prompt_logprobs_from(self) -> int | None:
        """The first prompt position whose logprob is returned (None: no prompt logprobs)."""
        if self.prompt_logprobs_start is not None:
            return self.prompt_logprobs_start
        return 0 if self.prompt_logprobs is not None else None

    @property
    def prompt_top_k(self) -> int:
        """How many likeliest tokens each scored prompt position reports."""
        return self.prompt_logprobs if self.prompt_logprobs is not None else self.logprobs or 0

    @property
    def constraint(self) -> Constraint | None:
        """The grammar constraint of these parameters, or None (call after ``validate``)."""
        return constraint_of(self._constraint_fields())

    def _constraint_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in CONSTRAINT_FIELDS}

    @property
    def constraint_set(self) -> bool:
        """Whether one of the constraint fields (a grammar of some kind) is set."""
        return any(getattr(self, name) is not None for name in CONSTRAINT_FIELDS)

    def truncated(self, prompt: list[int], context: int | None) -> list[int]:
        """``prompt`` as ``truncate_prompt_tokens`` keeps it: its last k tokens (-1: as many as
        a context of ``context`` tokens holds, one position left to generate in); all of it
        when unset. Keeping what was kept already changes nothing."""
        keep = self.truncate_prompt_tokens
        if keep == -1:
            keep = None if context is None else max(1, context - 1)
        return prompt if keep is None else prompt[-keep:]

    def _allowed_errors(self, vocab_size: int | None) -> list[str]:
        """Why ``allowed_token_ids`` is refused (none: the draw may be limited to it)."""
        allowed = self.allowed_token_ids
        if allowed is None:
            return []
        if not allowed:
            return ["allowed_token_ids must name at least one token"]
        if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
            return [f"allowed_token_ids has {len(allowed)} ids, more than {MAX_ALLOWED_TOKEN_IDS}"]
        if self.constraint_set:
            return ["allowed_token_ids cannot be combined with a structured output or grammar"]
        return _token_id_errors("allowed_token_ids", allowed, vocab_size)

    def _asked_errors(self, vocab_size: int | None) -> list[str]:
        """Why ``logprob_token_ids`` is refused (none: absent, or ids in the vocabulary)."""
        asked = self.logprob_token_ids
        if asked is None:
            return []
        if self.logprobs is None:
            return ["logprob_token_ids needs logprobs (SGLang's return_logprob)"]
        if not 0 < len(asked) <= MAX_LOGPROB_TOKEN_IDS:
            return [
                f"logprob_token_ids must name 1 to {MAX_LOGPROB_TOKEN_IDS} tokens, got {len(asked)}"
            ]
        return _token_id_errors("logprob_token_ids", asked, vocab_size)

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ``ValueError`` with a clear message for any invalid value; return self."""
        errors: list[str] = []
        for name in (
            "max_tokens",
            "min_tokens",
            "top_k",
            "prompt_logprobs_start",
            "prompt_logprobs",
            "truncate_prompt_tokens",
            "thinking_token_budget",
        ):
            value = getattr(self, name)
            if value is not None and abs(value) >= _INT_LIMIT:
                errors.append(f"{name} must be below 2**63 in magnitude, got {value}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            value = getattr(self, name)
            if not math.isfinite(value):
                errors.append(f"{name} must be a finite number, got {value}")
        if errors:  # the range checks below would only repeat these
            raise ValueError("invalid sampling parameters: " + "; ".join(errors))
        if self.max_tokens < 1:
            errors.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            errors.append(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            errors.append(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if not self.temperature >= 0.0:  # also rejects NaN
            errors.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            errors.append(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            errors.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            errors.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                errors.append(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            errors.append(f"seed must be in [0, 2**63), got {self.seed}")
        errors += _stop_errors(self.stop)
        errors += stop_regex.pattern_errors(self.stop_regex)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                errors.append(f"{name} must be in [0, 20], got {value}")
        errors += self._asked_errors(vocab_size)
        if self.pin_ttl_s is not None and not 0.0 < self.pin_ttl_s <= MAX_PIN_TTL_S:
            errors.append(
                f"pin_ttl_s must be in (0, {MAX_PIN_TTL_S:g}] seconds, got {self.pin_ttl_s}"
            )
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            errors.append(f"thinking_token_budget must be >= 0, got {self.thinking_token_budget}")
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1
        ):
            errors.append(
                f"truncate_prompt_tokens must be >= 1 or -1, got {self.truncate_prompt_tokens}"
            )
        if self.prompt_logprobs_start is not None and self.prompt_logprobs_start < 0:
            errors.append(f"prompt_logprobs_start must be >= 0, got {self.prompt_logprobs_start}")
        errors += constraint_errors(self._constraint_fields())
        errors += bias_rules.errors(self.logit_bias, vocab_size, TOKEN_ID_LIMIT)
        errors += _token_id_errors("stop_token_ids", self.stop_token_ids, vocab_size)
        errors += _token_id_errors("prediction", self.prediction or [], vocab_size)
        errors += self._allowed_errors(vocab_size)
        errors += bad_word_rules.word_errors(self.bad_words, self.bad_words_token_ids)
        if (self.bad_words or self.bad_words_token_ids) and (
            self.allowed_token_ids is not None or self.constraint_set
        ):  # the tokens left could be exactly the banned ones: nothing to draw
            errors.append("bad_words cannot be combined with allowed_token_ids or a grammar")
        flat = [t for seq in self.bad_words_token_ids or () for t in seq]
        errors += _token_id_errors("bad_words_token_ids", flat, vocab_size)
        if errors:
            raise ValueError("invalid sampling parameters: " + "; ".join(errors))
        return self


def _stop_errors(stop: list[str]) -> list[str]:
    """Why the stop strings are refused (none: each may be looked for)."""
    if len(stop) > MAX_STOP_STRINGS:
        return [f"stop has {len(stop)} strings, more than {MAX_STOP_STRINGS}"]
    if any(not s for s in stop):
        return ["stop strings must be non-empty"]
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        return [f"a stop string has {len(longest)} characters, more than {MAX_STOP_CHARS}"]
    return []


def _token_id_errors(name: str, ids: list[int], vocab_size: int | None) -> list[str]:
    """Why the token ids of field ``name`` are refused (none: each is in the vocabulary)."""
    bad = [t for t in ids if not 0 <= t < TOKEN_ID_LIMIT]
    if bad:
        return [f"{name} must be token ids in [0, 2**31), got {bad[:8]}"]
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            return [f"{name} out of the vocabulary (size {vocab_size}): {bad[:8]}"]
    return []


def as_list(value: str | Sequence[str] | None) -> list[str]:
    """One string or several, as request bodies send ``stop`` and ``stop_regex``, as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


# SGLang's names for two of the fields, accepted in dicts so that SGLang users' code runs.
_SGLANG_ALIASES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}

SamplingInput = SamplingParams | Mapping[str, Any] | None
"""One prompt's sampling parameters: a :class:`SamplingParams`, a dict of its fields, or
``None`` for the defaults."""


def to_sampling_params(value: SamplingInput) -> SamplingParams:
    """A :class:`SamplingParams` from one :data:`SamplingInput`; unknown dict keys and
    wrongly typed values are a ``ValueError`` that names them."""
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            f"sampling params must be a SamplingParams or a dict of its fields, "
            f"not {type(value).__name__}"
        )
    fields = dict(value)
    for alias, name in _SGLANG_ALIASES.items():
        if alias in fields:
            if name in fields:
                raise ValueError(f"sampling params give both {alias!r} and {name!r}")
            fields[name] = fields.pop(alias)
    try:
        if "logit_bias" in fields:  # JSON spells token ids as strings
            fields["logit_bias"] = bias_rules.from_json(fields["logit_bias"])
        return msgspec.convert(fields, SamplingParams)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"invalid sampling params: {exc}") from None


def per_prompt(
    params: SamplingInput | Sequence[SamplingInput], num_prompts: int
) -> list[SamplingParams]:
    """One :class:`SamplingParams` per prompt: a single value (object or dict) applies to
    every prompt; a list gives one per prompt and must have ``num_prompts`` entries."""
    if params is None or isinstance(params, (SamplingParams, Mapping)):
        return [to_sampling_params(params)] * num_prompts
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise ValueError(
            f"sampling params must be a SamplingParams, a dict, or a list of them, "
            f"not {type(params).__name__}"
        )
    if len(params) != num_prompts:
        raise ValueError(
            f"{len(params)} sampling params for {num_prompts} prompts (give one, or one per prompt)"
        )
    return [to_sampling_params(p) for p in params]
