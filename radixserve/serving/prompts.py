"""Router-side text handling: prompts to token ids (chat template), token ids back to text.

The router is the only process that sees text; workers get token ids. Text prompts are
encoded the way the offline engine encodes them (``tokenizer.encode`` with the
tokenizer's special-token defaults); chat messages are rendered by the model's own chat
template, which already writes its special tokens, so they are encoded without adding more.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from radixserve.sampling_params import SamplingParams
from radixserve.serving.wire import protocol as p

log = logging.getLogger(__name__)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a text prompt, the tokenizer's special tokens (BOS) added as it adds them,
    unless the text already begins with the BOS token (a prompt rendered by a chat template
    that writes it, as Llama's and Mistral's do): encoding that again would give two BOS."""
    bos = getattr(tokenizer, "bos_token", None)
    if isinstance(bos, str) and bos and text.startswith(bos):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


class PromptError(ValueError):
    """The prompt could not be rendered or encoded (bad chat roles, no template, ...)."""


def load_tokenizer(model_path: str | Path) -> Any:
    """The model's transformers tokenizer (local files only: the router never downloads)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)


class PromptCodec:
    """Encodes generate requests to token ids and makes per-request incremental detokenizers."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat_template: str | None = getattr(tokenizer, "chat_template", None)
        # Single-string special tokens by name (bos_token, eos_token, ...) for ModelInfo.
        self.special_tokens: dict[str, str] = {
            k: v
            for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
            if isinstance(v, str)
        }

    def encode(self, req: p.GenerateRequest) -> list[int]:
        """Token ids of the request's prompt; raises :class:`PromptError` with a clear message."""
        if req.input_ids is not None:
            return list(req.input_ids)
        if req.text is not None:
            return encode_text(self.tokenizer, req.text)
        assert req.messages is not None
        if not self.chat_template:
            raise PromptError(
                "the model has no chat template; send text or input_ids instead of messages"
            )
        conversation = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=req.add_generation_prompt
            )
        except Exception as exc:  # jinja raises its own types (e.g. on an unsupported role)
            raise PromptError(f"chat template failed: {exc}") from exc
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def warm_up(self) -> None:
        """Encode and detokenize once (chat template, the tokenizer's lazy state), so that a
        server's first request does not pay for it."""
        chat = [p.ChatMessage(role="user", content="Hello.")]
        try:
            ids = self.encode(p.GenerateRequest(request_id="warm-up", text="Hello."))
            if self.chat_template:
                ids = self.encode(p.GenerateRequest(request_id="warm-up", messages=chat))
            self.detokenizer(SamplingParams(), ids[:-2]).add(ids[-2:], final=True)
        except Exception as exc:  # noqa: BLE001 - only a warm-up: requests report their own errors
            log.debug("tokenizer warm-up failed: %s", exc)

    def detokenizer(self, params: SamplingParams, prompt_ids: list[int]) -> Any:
        """An :class:`~radixserve.engine.detokenizer.IncrementalDetokenizer` for one request."""
        from radixserve.engine.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, params, prompt_ids)
