"""SGLang's native ``/generate`` request body, as SGLang's clients send it.

What SGLang's frontend (``sglang.lang``'s ``RuntimeEndpoint``) sends, and how it maps here:

* ``text`` or ``input_ids``, one prompt or a batch (a list); ``sampling_params`` one dict
  for all or one per prompt; ``return_logprob``, ``logprob_start_len``,
  ``top_logprobs_num`` a value for all or one per prompt; ``return_text_in_logprobs``;
  ``token_ids_logprob`` (token ids whose logprobs every reported position also gives: one
  list for all prompts or a list per prompt).
* ``max_new_tokens: 0`` ("just prefill and cache the prefix", and the scoring requests of
  ``select``) runs one token through the engine and reports none.
* ``logprob_start_len`` -1 / absent: no prompt logprobs (SGLang's default).
* ``regex``, ``json_schema``, ``ebnf`` (a grammar, as xgrammar reads it) and
  ``structural_tag`` (JSON text, xgrammar's ``format`` or the older ``structures`` and
  ``triggers``) constrain the output (radixserve's constrained decoding, so
  ``gen(regex=...)`` and typed ``gen`` work); ``logit_bias`` (token id strings to biases
  in [-100, 100]) is added to the logits; ``stop_regex`` ends the output where a pattern
  matches it (:mod:`radixserve.stop_regex`). Images are not supported: a request that
  sends them gets a 400 instead of silently wrong output.
* ``return_hidden_states`` (one for all or one per prompt): the final norm's output at every
  position the model reads, in ``meta_info.hidden_states`` of the final message
  (``sglang_api``); over ``MAX_HIDDEN_STATE_FLOATS`` floats is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from radixserve import logit_bias as bias_rules
from radixserve.constrained.spec import structural_tag_text
from radixserve.sampling_params import SamplingParams, as_list
from radixserve.serving.http.errors import invalid
from radixserve.serving.http.openai_protocol import TokenId


class SGLSamplingParams(BaseModel):
    """SGLang's ``sampling_params`` (unknown keys are an error, as in SGLang)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted; the router's detokenizer decides
    no_stop_trim: bool = False  # keep the stop string that matched at the text's end
    sampling_seed: int | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    pin_ttl_s: float | None = None  # radixserve: keep the prompt prefix pinned (see SamplingParams)

    def to_params(
        self,
        context_length: int,
        vocab_size: int,
        logprobs: int | None,
        prompt_logprobs_start: int | None,
        sample: int,
        asked: list[int] | None = None,
    ) -> tuple[SamplingParams, bool]:
        """Our :class:`SamplingParams`, and whether the output must be dropped (``max_new_tokens`` 0)."""
        max_new = context_length if self.max_new_tokens is None else self.max_new_tokens
        if max_new < 0:
            raise invalid(
                f"max_new_tokens must be >= 0, got {max_new}",
                param="sampling_params.max_new_tokens",
            )
        seed = self.sampling_seed if self.sampling_seed is not None else self.seed
        try:
            bias = bias_rules.from_json(self.logit_bias)
        except ValueError as exc:
            raise invalid(str(exc), param="sampling_params.logit_bias") from exc
        params = SamplingParams(
            max_tokens=max(1, max_new),
            min_tokens=self.min_new_tokens if max_new else 0,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=-1 if self.top_k >= vocab_size else self.top_k,  # SGLang's "off" is 1 << 30
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            seed=None if seed is None else seed + sample,
            stop=as_list(self.stop),
            stop_regex=as_list(self.stop_regex),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.no_stop_trim,
            logprobs=logprobs,
            prompt_logprobs_start=prompt_logprobs_start,
            logprob_token_ids=asked if logprobs is not None else None,
            skip_special_tokens=self.skip_special_tokens,
            regex=self.regex,
            json_schema=self.json_schema,
            ebnf=self.ebnf,
            structural_tag=self._structural_tag(),
            pin_ttl_s=self.pin_ttl_s,
            logit_bias=bias or None,
        )
        try:
            params.validate(vocab_size)
        except ValueError as exc:
            raise invalid(str(exc), param="sampling_params") from exc
        return params, max_new == 0

    def _structural_tag(self) -> str | None:
        """``structural_tag`` in xgrammar's current form (either form accepted)."""
        if self.structural_tag is None:
            return None
        try:
            return structural_tag_text(self.structural_tag)
        except ValueError as exc:
            raise invalid(str(exc), param="sampling_params.structural_tag") from None


class AbortReqInput(BaseModel):
    """SGLang's ``POST /abort_request`` body: the ``rid`` of the requests to stop, or
    ``abort_all`` (unknown keys ignored, as in :class:`GenerateReqInput`)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    rid: str = ""
    abort_all: bool = False


class GenerateReqInput(BaseModel):
    """SGLang's ``POST /generate`` body (unknown keys ignored: SGLang grows new ones often)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SGLSamplingParams | list[SGLSamplingParams] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    session_id: str | None = None
    priority: int = Field(default=0, ge=-1000, le=1000)  # higher leaves the cache later
    # radixserve: meta_info.cache_report, where the prompt left the cached path and why.
    return_cache_report: bool = False
    # As vLLM's: requests share cached prefixes only with requests of the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # The served LoRA adapter (by name) of every prompt, or one per prompt (None: the base).
    lora_path: str | list[str | None] | None = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    # Tokens whose logprobs each reported position also gives (with return_logprob): one list
    # for every prompt, or one per prompt.
    token_ids_logprob: list[TokenId] | list[list[TokenId]] | None = None
    # The final norm's output at every position read (one for all prompts, or one per prompt).
    return_hidden_states: bool | list[bool] = False


@dataclass
class Item:
    """One prompt x one sample of a (maybe batched) ``/generate`` request."""

    index: int
    text: str | None
    input_ids: list[int] | None
    sampling: SGLSamplingParams
    sample: int
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    rid: str
    lora: str | None = None
    prompt_rid: str = ""  # its prompt's rid (with n > 1 each sample's rid adds "-j" to it)
    token_ids_logprob: list[int] | None = None
    return_hidden_states: bool = False


def _pick(value: Any, i: int, n: int, name: str) -> Any:
    if isinstance(value, list):
        if len(value) != n:
            raise invalid(f"{name} has {len(value)} entries for {n} prompts", param=name)
        return value[i]
    return value


def _asked(value: list[int] | list[list[int]] | None, i: int, n: int) -> list[int] | None:
    """Prompt ``i``'s ``token_ids_logprob``: the one list for all, or its own of a list per
    prompt (a list of lists: one per prompt; a list of ints: the same for every prompt)."""
    if not value:
        return None
    if not isinstance(value[0], list):
        return [int(t) for t in value]  # a list of ints: the same for every prompt
    per_prompt = _pick(value, i, n, "token_ids_logprob")
    return list(per_prompt) or None


def expand(req: GenerateReqInput, default_rid: str) -> tuple[list[Item], bool]:
    """The request's items (prompt-major, then sample) and whether it was a single prompt."""
    for name in ("image_data", "video_data", "audio_data", "input_embeds"):
        if getattr(req, name) is not None:
            raise invalid(f"{name} is not supported", param=name)
    if (req.text is None) == (req.input_ids is None):
        raise invalid("exactly one of text or input_ids must be given", param="text")
    prompts: list[Any]
    if req.text is not None:
        single = isinstance(req.text, str)
        prompts = [req.text] if single else list(req.text)
    else:
        ids = req.input_ids or []
        single = not ids or isinstance(ids[0], int)
        prompts = [ids] if single else list(ids)
    if not prompts:
        raise invalid("the batch is empty", param="text")
    n_prompts = len(prompts)
    items: list[Item] = []
    for i, prompt in enumerate(prompts):
        sp = _pick(req.sampling_params, i, n_prompts, "sampling_params") or SGLSamplingParams()
        if not 1 <= sp.n <= 128:
            raise invalid(
                f"sampling_params.n must be in [1, 128], got {sp.n}", param="sampling_params.n"
            )
        if isinstance(prompt, list) and not prompt:
            raise invalid(f"input_ids[{i}] is empty", param="input_ids")
        ret = bool(_pick(req.return_logprob, i, n_prompts, "return_logprob"))
        start = _pick(req.logprob_start_len, i, n_prompts, "logprob_start_len")
        top = _pick(req.top_logprobs_num, i, n_prompts, "top_logprobs_num")
        rid = _pick(req.rid, i, n_prompts, "rid") or (
            default_rid if single else f"{default_rid}-{i}"
        )
        asked = _asked(req.token_ids_logprob, i, n_prompts)
        hidden = bool(_pick(req.return_hidden_states, i, n_prompts, "return_hidden_states"))
        lora = _pick(req.lora_path, i, n_prompts, "lora_path")
        if lora is not None and not 0 < len(lora) <= 256:
            raise invalid("lora_path names an adapter in 1 to 256 characters", param="lora_path")
        for j in range(sp.n):
            items.append(
                Item(
                    index=len(items),
                    text=prompt if isinstance(prompt, str) else None,
                    input_ids=list(prompt) if isinstance(prompt, list) else None,
                    sampling=sp,
                    sample=j,
                    return_logprob=ret,
                    logprob_start_len=-1 if start is None else start,
                    top_logprobs_num=0 if top is None else top,
                    rid=rid if sp.n == 1 else f"{rid}-{j}",
                    lora=lora,
                    prompt_rid=rid,
                    token_ids_logprob=asked,
                    return_hidden_states=hidden,
                )
            )
    return items, single and len(items) == 1
