"""OpenAI request bodies (pydantic, strict types) and their mapping to :class:`SamplingParams`.

Types are strict (``"5"`` is not an integer), unknown fields are ignored (clients send
``user``, ``store``, ``metadata``, ...), and values are checked by
:meth:`SamplingParams.validate`, the one place the engine, router and gateways share.
Structured output (``response_format``, and vLLM's and SGLang's spellings: see
:mod:`.structured_outputs`) uses radixserve's constrained decoding. Tools and reasoning are
planned in :mod:`.chat_tools`. Features radixserve does not have (``suffix``, ``best_of`` >
``n``, image content) are rejected with a 400 rather than silently ignored.
Extensions accepted as vLLM and SGLang do: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output`` (SGLang's ``no_stop_trim``), SGLang's ``stop_regex``,
``skip_special_tokens``, ``thinking_token_budget``; each choice carries vLLM's
``stop_reason`` (the stop string, stop pattern or stop token id that ended it).
``logit_bias`` has OpenAI's semantics (token id strings to biases in [-100, 100], at most
300; see :mod:`radixserve.logit_bias`).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from radixserve import logit_bias as bias_rules
from radixserve.sampling_params import TOKEN_ID_LIMIT, SamplingParams, as_list
from radixserve.serving.http.chat_tools import MAX_MESSAGES, CallIn, ToolIn
from radixserve.serving.http.chunk_usage import ChunkUsage
from radixserve.serving.http.errors import invalid
from radixserve.serving.http.structured_outputs import StructuredOutputFields
from radixserve.serving.wire import protocol as p

# A token id in a request body: bounded here, so that an absurd integer is a 400, not a
# failure to encode the request for the router.
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]
# Beam search's most beams (http/beam_search.py): each step asks for the 2 n likeliest next
# tokens, and a generation's logprobs top out at 20.
MAX_BEAMS = 10


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: each chunk's usage so far (with include_usage)


class ContentPart(_Body):
    type: str
    text: str | None = None


class PredictionIn(_Body):
    """OpenAI's predicted output: ``{"type": "content", "content": text or text parts}``."""

    type: str
    content: str | list[ContentPart]

    def text(self) -> str:
        """The text predicted (text parts joined as they stand)."""
        if self.type != "content":
            raise invalid(
                f"prediction.type must be 'content', got {self.type!r}", param="prediction.type"
            )
        if isinstance(self.content, str):
            return self.content
        if any(part.type != "text" or part.text is None for part in self.content):
            raise invalid("prediction.content parts must be text parts", param="prediction.content")
        return "".join(part.text or "" for part in self.content)


class ChatMessageIn(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[CallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def wire(self, index: int) -> p.ChatMessage:
        """This turn as the router renders it (``developer`` is OpenAI's new ``system``)."""
        calls = None
        if self.tool_calls:
            calls = []
            for j, c in enumerate(self.tool_calls):
                name, args = c.function.get("name"), c.function.get("arguments", "{}")
                if not isinstance(name, str) or not isinstance(args, str):
                    raise invalid(
                        f"messages[{index}].tool_calls[{j}].function needs a string name "
                        "and string arguments",
                        param=f"messages.{index}.tool_calls",
                    )
                calls.append(p.ToolCallPart(id=c.id, name=name, arguments=args))
        return p.ChatMessage(
            role="system" if self.role == "developer" else self.role,
            content=self.text(index),
            tool_calls=calls,
            tool_call_id=self.tool_call_id,
            name=self.name,
            reasoning_content=self.reasoning_content,
        )

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type in _MEDIA_PARTS:
                raise invalid(
                    f"messages[{index}]: {part.type!r} content parts are not supported: "
                    "radixserve serves text models (of a multimodal checkpoint such as Gemma 3, "
                    "its text model only); send text content parts",
                    param=f"messages.{index}.content",
                )
            if part.type != "text" or part.text is None:
                raise invalid(
                    f"messages[{index}]: only text content parts are supported (got {part.type!r})",
                    param=f"messages.{index}.content",
                )
            texts.append(part.text)
        return "\n".join(texts)


# Content parts that carry media (OpenAI's and vLLM's names): refused with a message that
# says so, rather than the generic one for an unknown part.
_MEDIA_PARTS = frozenset(
    {
        "image_url",
        "input_image",
        "image",
        "image_pil",
        "input_audio",
        "audio_url",
        "video_url",
        "file",
    }
)


# Fields of OpenAI's (and vLLM's) requests that would change the output and that radixserve
# does not implement: a 400 naming the field, rather than an answer that silently ignores
# it. Everything else unknown is ignored, as OpenAI ignores what it does not use.
UNSUPPORTED_FIELDS = {
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "functions": "the legacy functions field is not supported; send tools",
    "function_call": "the legacy function_call field is not supported; send tool_choice",
    "verbosity": "verbosity is not supported",
}
# vLLM's and SGLang's extensions that radixserve does not implement, each with the value that
# leaves the output as if it were absent (what their clients send by default): any other
# value is a 400 naming the field, not an answer that silently ignores it.
UNSUPPORTED_UNLESS = {
    "logits_processors": (None, "custom logits processors are not supported"),
    "documents": (None, "documents are not supported"),
    "mm_processor_kwargs": (None, "multimodal processor arguments are not supported"),
    "echo": (False, "echo is not supported on chat completions (it is on /v1/completions)"),
    "kv_transfer_params": (None, "kv_transfer_params is not supported"),
    "separate_reasoning": (True, "reasoning is always separated by the server's parser"),
    "stream_reasoning": (True, "reasoning is always streamed as it comes"),
}


class _SamplingBody(_Body, StructuredOutputFields):
    """Fields shared by chat and text completions (the structured-output ones in
    :class:`~.structured_outputs.StructuredOutputFields`)."""

    model_config = ConfigDict(strict=True, extra="allow")

    # The conversation's key (OpenAI's prompt_cache_key; SGLang's session_id): handed to
    # the router as the request's session, so that one conversation's turns meet its cache
    # (and, on the worker, its session lease: memory.leases).
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    session_id: str | None = Field(default=None, max_length=256)
    # SGLang's: the request's id, the answer's ``id`` and what /abort_request names it by
    # (default: a fresh ``chatcmpl-``/``cmpl-`` id, which a stream's first chunk shows).
    rid: str | None = Field(default=None, min_length=1, max_length=256)

    @property
    def session(self) -> str | None:
        return self.prompt_cache_key or self.session_id

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (vLLM / SGLang names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # vLLM's prefix-cache isolation: requests share cached prefixes only with the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None  # vLLM's: keep the stop string that matched
    no_stop_trim: bool = False  # SGLang's name for the same
    # SGLang's: stop where one of these patterns matches the output (radixserve.stop_regex).
    stop_regex: str | list[str] | None = None
    skip_special_tokens: bool | None = None
    # SGLang's: the served LoRA adapter to run with (vLLM's way, the adapter's name as
    # ``model``, works too: Gateway.resolve_model).
    lora_path: str | None = Field(default=None, max_length=256)
    pin_ttl_s: float | None = None  # radixserve: keep the prompt prefix pinned (see SamplingParams)
    # vLLM's: at most this many tokens of <think> block, then it is closed (SamplingParams).
    thinking_token_budget: int | None = None
    # vLLM's: each prompt token's logprob, rank and text, with this many likeliest tokens
    # (the completion's choices carry them; the chat completion, once, at its top level).
    prompt_logprobs: int | None = None
    # vLLM's: the prompt's and each choice's token ids beside the text (what an agent's RL
    # trainer learns from); streamed, the prompt's on a choice's first chunk (chat: the
    # chunk's top level) and each chunk's new ones.
    return_token_ids: bool = False
    # SGLang's: the final norm's output at the position that gave the last token, on each
    # choice (``hidden_states``; [] when the choice has one token, as SGLang gives); streamed,
    # in a chunk of its own after the choice's last.
    return_hidden_states: bool = False
    # vLLM's: logprobs name each token "token_id:<id>" instead of its text, so that tokens
    # whose text is not a whole character (or repeats another's) are told apart.
    return_tokens_as_token_ids: bool = False
    # vLLM's: the output is drawn from these tokens only.
    allowed_token_ids: list[TokenId] | None = None
    # vLLM's: only the prompt's last k tokens are read (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = None
    # vLLM's: words the output never spells (radixserve.bad_words).
    bad_words: list[str] | None = None
    # Cache controls: higher priority leaves the cache later (--eviction-policy priority);
    # OpenAI's prompt_cache_retention: "in_memory" (the default: LRU and session leases) or a
    # time such as "24h", which pins the prompt prefix that long (within the pin budget).
    priority: int = Field(default=0, ge=-1000, le=1000)
    prompt_cache_retention: str | None = Field(default=None, max_length=16)
    # radixserve: usage.prompt_tokens_details.cache_report says where the prompt left the
    # longest cached path and why the rest was not cached (docs/http-api.md).
    return_cache_report: bool = False
    # vLLM's beam search (http/beam_search.py): ``n`` beams, scored with length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def check_common(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS:
                raise invalid(UNSUPPORTED_FIELDS[name], param=name)
            if name in UNSUPPORTED_UNLESS:
                neutral, why = UNSUPPORTED_UNLESS[name]
                if value is not None and value != neutral and value != []:
                    raise invalid(why, param=name)
        modalities = (self.model_extra or {}).get("modalities")
        if modalities not in (None, ["text"]):
            raise invalid(
                "only text output is supported (modalities: ['text'])", param="modalities"
            )
        if not 1 <= self.n <= 128:
            raise invalid(f"n must be in [1, 128], got {self.n}", param="n")
        self.bias()  # a bad logit_bias fails before anything runs
        self.constraint()  # and so does a bad response_format
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise invalid(
                f"temperature must be in [0, 2], got {self.temperature}", param="temperature"
            )
        if self.stream_options is not None and not self.stream:
            raise invalid(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= 20:
                raise invalid(
                    f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
                    param="prompt_logprobs",
                )
            if self.stream:
                raise invalid(
                    "prompt_logprobs are answered whole, as vLLM answers them: send stream false",
                    param="prompt_logprobs",
                )

    def check_beam_search(self) -> None:
        """What beam search does not run with (vLLM's server refuses or ignores the same):
        :meth:`beam_search_refuses`, more than :data:`MAX_BEAMS` beams."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise invalid("length_penalty applies to beam search", param="length_penalty")
            return
        for name, on in self.beam_search_refuses().items():
            if on:
                raise invalid(f"{name} is not supported with beam search", param=name)
        if not 1 <= self.n <= MAX_BEAMS:
            raise invalid(f"beam search takes n in [1, {MAX_BEAMS}] beams", param="n")
        if not math.isfinite(self.length_penalty):
            raise invalid("length_penalty must be a finite number", param="length_penalty")

    def beam_search_refuses(self) -> dict[str, bool]:
        """The fields beam search does not run with, each with whether it is set."""
        raise NotImplementedError

    def bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids (a 400 naming the bad entry)."""
        try:
            return bias_rules.from_json(self.logit_bias) or None
        except ValueError as exc:
            raise invalid(str(exc), param="logit_bias") from exc

    def sampling(
        self,
        max_tokens: int,
        logprobs: int | None,
        choice: int = 0,
        prompt_logprobs_start: int | None = None,
    ) -> SamplingParams:
        """The :class:`SamplingParams` of choice ``choice`` (seeded choices get seed + choice,
        so ``n`` seeded samples differ yet stay reproducible)."""
        stop = as_list(self.stop)
        kw: dict[str, Any] = {"max_tokens": max_tokens, "stop": stop, "logprobs": logprobs}
        for name in (
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "pin_ttl_s",
            "thinking_token_budget",
            "prompt_logprobs",
            "allowed_token_ids",
            "truncate_prompt_tokens",
            "bad_words",
        ):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.pin_ttl_s is None and self.prompt_cache_retention is not None:
            ttl = retention_seconds(self.prompt_cache_retention)
            if ttl is not None:
                kw["pin_ttl_s"] = ttl
        if self.stop_token_ids:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop_regex:
            kw["stop_regex"] = as_list(self.stop_regex)
        if self.no_stop_trim:
            kw["include_stop_str_in_output"] = True
        if self.return_cache_report:
            kw["return_cache_report"] = True
        if self.return_token_ids:
            kw["return_prompt_token_ids"] = True
        if self.return_hidden_states:
            kw["return_hidden_states"] = True
        if self.seed is not None:
            kw["seed"] = self.seed + choice
        if self.logit_bias:
            kw["logit_bias"] = self.bias()
        if prompt_logprobs_start is not None:
            kw["prompt_logprobs_start"] = prompt_logprobs_start
        kw.update(self.constraint())
        try:
            return SamplingParams(**kw).validate()
        except ValueError as exc:
            raise invalid(str(exc)) from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def chunk_usage(self) -> ChunkUsage:
        """What a stream's chunks say of usage (``stream_options``)."""
        opts = self.stream_options
        return ChunkUsage(self.include_usage, bool(opts and opts.continuous_usage_stats))


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last message left open for the model to go on with (a prefilled reply).
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the request's own template, where the server trusts them (--trust-request-...).
    chat_template: str | None = None
    # Handed to templates that read it (chat_tools.with_reasoning_effort), as vLLM and SGLang do.
    reasoning_effort: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # The answer expected (a file an edit mostly keeps): drafted from and verified, so the
    # answer comes faster where it agrees and is the same either way.
    prediction: PredictionIn | None = None

    def check(self) -> None:
        self.check_common()
        self.check_beam_search()
        if self.prediction is not None:
            self.prediction.text()  # a bad shape fails before anything runs
        if len(self.messages) > MAX_MESSAGES:
            raise invalid(
                f"at most {MAX_MESSAGES} messages, got {len(self.messages)}", param="messages"
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid(
                "continue_final_message goes on with the last message: send it with "
                "add_generation_prompt false",
                param="continue_final_message",
            )
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise invalid("top_logprobs requires logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= 20:
                raise invalid(
                    f"top_logprobs must be in [0, 20], got {self.top_logprobs}",
                    param="top_logprobs",
                )

    def beam_search_refuses(self) -> dict[str, bool]:
        return {
            "stream": self.stream,
            "logprobs": self.logprobs,
            "stop": bool(self.stop),
            "response_format": bool(self.constraint()),
            "tools": bool(self.tools) and self.tool_choice != "none",
            "prediction": self.prediction is not None,
            "return_hidden_states": self.return_hidden_states,
        }

    def chat(self) -> list[p.ChatMessage]:
        return [m.wire(i) for i, m in enumerate(self.messages)]

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def wanted_max_tokens(self, context_length: int) -> int:
        """``max_completion_tokens``, else ``max_tokens``, else up to the context length
        (the engine stops a request when prompt + output fill the context)."""
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None:
                if value < 1:
                    raise invalid(f"{name} must be >= 1, got {value}", param=name)
                return value
        return max(1, context_length)


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        self.check_beam_search()
        if self.suffix:
            raise invalid("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of must equal n (no server-side ranking)", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise invalid(f"logprobs must be in [0, 20], got {self.logprobs}", param="logprobs")
        if (self.scores_prompt or self.prompt_only) and self.stream:
            raise invalid(
                "echo with logprobs or max_tokens 0 is answered whole: send stream false",
                param="echo",
            )
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise invalid(
                f"max_tokens must be >= 1 (0 only with echo), got {self.max_tokens}",
                param="max_tokens",
            )

    def beam_search_refuses(self) -> dict[str, bool]:
        return {
            "stream": self.stream,
            "echo": self.echo,
            "logprobs": self.logprobs is not None,
            "stop": bool(self.stop),
            "response_format": bool(self.constraint()),
            "return_hidden_states": self.return_hidden_states,
        }

    @property
    def scores_prompt(self) -> bool:
        """Whether the answer holds the prompt's logprobs (echo with logprobs, as vLLM and
        OpenAI's legacy API answer it: what evaluation harnesses score prompts with)."""
        return self.echo and self.logprobs is not None

    @property
    def prompt_only(self) -> bool:
        """``max_tokens: 0`` with echo: the prompt back (and its logprobs), no completion."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: texts or token id lists."""
        p = self.prompt
        if isinstance(p, str):
            out: list[Any] = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]
        else:
            out = list(p)
        if not out:
            raise invalid("prompt must not be empty", param="prompt")
        for i, one in enumerate(out):
            if isinstance(one, list) and not one:
                raise invalid(f"prompt[{i}] is an empty token list", param="prompt")
        return out


def retention_seconds(value: str) -> float | None:
    """OpenAI's ``prompt_cache_retention``: None for ``in_memory`` (no pin), else seconds
    ("24h", "90m", "3600s")."""
    if value == "in_memory":
        return None
    m = re.fullmatch(r"(\d{1,6})([smh])", value)
    if m is None or int(m.group(1)) == 0:
        raise invalid(
            f"prompt_cache_retention must be in_memory or a time like 24h, got {value!r}",
            param="prompt_cache_retention",
        )
    return float(int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)])
