"""Router-side text handling: prompts to token ids (chat template), token ids back to text.

The router is the only process that sees text; workers get token ids. Text prompts are
encoded the way the offline engine encodes them (``tokenizer.encode`` with the
tokenizer's special-token defaults); chat messages are rendered by the model's own chat
template, which already writes its special tokens, so they are encoded without adding more.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from radixserve.sampling_params import SamplingParams
from radixserve.serving.wire import protocol as p

log = logging.getLogger(__name__)


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text prompt, the tokenizer's special tokens (BOS) added as it adds them,
    unless the text already begins with the BOS token (a prompt rendered by a chat template
    that writes it, as Llama's and Mistral's do): encoding that again would give two BOS.
    ``add_special_tokens`` False: none added (``/tokenize``'s option)."""
    bos = getattr(tokenizer, "bos_token", None)
    if not add_special_tokens or (isinstance(bos, str) and bos and text.startswith(bos)):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


class PromptError(ValueError):
    """The prompt could not be rendered or encoded (bad chat roles, no template, ...)."""


def load_tokenizer(model_path: str | Path) -> Any:
    """The model's transformers tokenizer (local files only: the router never downloads)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)


# The largest chat template --chat-template reads (real ones are a few to a few dozen KiB).
MAX_TEMPLATE_FILE_BYTES = 1 << 20


def read_chat_template(spec: str) -> str:
    """The chat template ``--chat-template`` names (vLLM's and SGLang's flag): a file's
    contents, or the template itself written inline; ``ValueError`` for a path that is not
    a file, a file over :data:`MAX_TEMPLATE_FILE_BYTES`, or a template jinja cannot parse
    (said at start-up, not on the first chat request)."""
    import jinja2

    path = Path(spec)
    inline = "{%" in spec or "{{" in spec
    if not inline:
        if not path.is_file():
            raise ValueError(f"--chat-template: no file {spec} (nor a template written inline)")
        if path.stat().st_size > MAX_TEMPLATE_FILE_BYTES:
            raise ValueError(f"--chat-template: {spec} is over {MAX_TEMPLATE_FILE_BYTES} bytes")
    text = spec if inline else path.read_text(encoding="utf-8")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: line {exc.lineno}: {exc.message}") from None
    return text


# Names a request may not set through chat_template_kwargs: the template variables the
# rendering itself passes, and every named argument of transformers' apply_chat_template,
# which the kwargs are passed beside (chat_template among them: a request's own template
# goes through GenerateRequest.chat_template, which the router takes only where trusted).
RESERVED_TEMPLATE_VARS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def chat_turn(m: p.ChatMessage) -> dict[str, Any]:
    """One message as chat templates read it: OpenAI's shape, with each call's arguments
    as an object where they parse (templates write them with ``tojson``)."""
    turn: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args: Any = json.loads(c.arguments)
            except ValueError:
                args = c.arguments
            calls.append(
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}}
            )
        turn["tool_calls"] = calls
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        turn["name"] = m.name
    if m.reasoning_content is not None:
        turn["reasoning_content"] = m.reasoning_content
    return turn


def template_inputs(tools: str | None, kwargs: str | None) -> dict[str, Any]:
    """``tools`` and the request's extra template variables, as ``apply_chat_template``
    keywords (both arrive as JSON text; the gateway checked their shape and size)."""
    out: dict[str, Any] = {}
    if kwargs:
        try:
            extra = json.loads(kwargs)
        except ValueError as exc:
            raise PromptError(f"chat_template_kwargs is not JSON: {exc}") from exc
        if not isinstance(extra, dict):
            raise PromptError("chat_template_kwargs must be a JSON object")
        bad = sorted(RESERVED_TEMPLATE_VARS & set(extra))
        if bad:
            raise PromptError(f"chat_template_kwargs may not set {', '.join(bad)}")
        out.update(extra)
    if tools:
        try:
            out["tools"] = json.loads(tools)
        except ValueError as exc:
            raise PromptError(f"tools is not JSON: {exc}") from exc
    return out


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
        if not (req.chat_template or self.chat_template):
            raise PromptError(
                "the model has no chat template; send text or input_ids instead of messages"
            )
        conversation = [chat_turn(m) for m in req.messages]
        extra = template_inputs(req.tools, req.chat_template_kwargs)
        if req.chat_template is not None:  # the request's own (the router checked it may)
            extra["chat_template"] = req.chat_template
        if req.continue_final_message:  # transformers cuts the rendering after the last message
            extra["continue_final_message"] = True
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                **extra,
            )
        except Exception as exc:  # jinja raises its own types (e.g. on an unsupported role)
            raise PromptError(f"chat template failed: {exc}") from exc
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def encode_with_prediction(self, req: p.GenerateRequest) -> list[list[int]]:
        """The prompt's token ids, then the prediction's where ``req`` has one: its text as
        the output would hold it (no special tokens added)."""
        ids = [self.encode(req)]
        if req.prediction is not None:
            ids.append(encode_text(self.tokenizer, req.prediction, add_special_tokens=False))
        return ids

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
