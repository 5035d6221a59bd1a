"""Classification by a sequence-classification checkpoint (a reward model, a multi-label
classifier: ``*ForSequenceClassification``): vLLM's ``POST /v1/classify`` and ``/classify``
(also SGLang's ``/v1/classify``), and SGLang's native reward route ``POST /classify``.

Each input runs as an embedding does (:func:`~radixserve.serving.http.embeddings.embed`:
one prefill through the radix cache, the same limits, cache salt and priority); a
classifier's embedding is its score head's logits at the last non-pad token, computed on
the worker (``LlamaForCausalLM.pooled``). vLLM's shape answers ``probs`` (vLLM's activation
by the head's ``problem_type``: :func:`~radixserve.model.classifier.class_probs`) and the
argmax's ``label`` (``id2label``); SGLang's answers the raw logits as ``embedding``, as its
reward-model docs read them.

``/classify`` is both vLLM's route and SGLang's: the body's shape decides. SGLang's names
its inputs ``text`` or ``input_ids``; vLLM's ``input`` or ``messages``. The same holds on
``/v1/classify``, so either client may use either path.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from radixserve.model.classifier import ClassifierHead, classify
from radixserve.serving.http.auth import request_key, tenant_cache_salt
from radixserve.serving.http.chat_request import check_messages
from radixserve.serving.http.embeddings import (
    EmbedOptions,
    EncodeReqInput,
    TokenId,
    embed,
    input_items,
    sglang_pooled,
    usage_of,
)
from radixserve.serving.http.errors import APIError, invalid
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.http.openai_protocol import ChatMessageIn
from radixserve.serving.wire import protocol as p

router = APIRouter()

M = TypeVar("M", bound=BaseModel)


class ClassificationRequest(BaseModel):
    """vLLM's body: ``input`` (a text, token ids, or a batch of either) or ``messages`` (one
    conversation, rendered with the chat template and no generation prompt, as reward
    models score a chat), with vLLM's ``truncate_prompt_tokens``, ``add_special_tokens``
    and ``priority``, and the radix cache's ``cache_salt``. Any other field is a 400."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = "default"
    input: str | list[str] | list[TokenId] | list[list[TokenId]] | None = None
    messages: list[ChatMessageIn] | None = Field(default=None, min_length=1)
    user: str | None = None
    rid: str | None = None  # SGLang's /v1/classify takes one; replies carry their own id
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    add_special_tokens: bool = True
    priority: int = 0


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object posted (a 400 for anything else)."""
    try:
        raw = json.loads(await request.body())
    except ValueError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise invalid("the request body must be a JSON object")
    return raw


def _parsed(model: type[M], raw: dict[str, Any]) -> M:
    """``raw`` as ``model``; its errors answered as any body's validation errors (a 400)."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        ) from None


async def _head(g: Gateway) -> ClassifierHead:
    """The served classifier's head as its workers describe it; a 400 for another model."""
    info = await g.info()
    labels = info.labels
    if not labels:
        raise invalid(
            "the served model is not a sequence classifier (a *ForSequenceClassification "
            "checkpoint): it cannot classify",
            param="model",
        )
    return ClassifierHead(tuple(labels), problem_type=info.problem_type or None)


def _no_adapter(adapter: str | None) -> None:
    """Classification runs the base model: an adapter's own score head (PEFT's
    ``modules_to_save``) would not be applied, so a LoRA adapter is refused, not ignored."""
    if adapter is not None:
        raise invalid(f"LoRA adapters are not supported for classification ({adapter!r})")


@router.post("/v1/classify", response_model=None)
@router.post("/classify", response_model=None)
async def classify_route(request: Request) -> Response:
    """vLLM's or SGLang's classification, by the body's shape (module docstring)."""
    g = _gw(request)
    raw = await _body(request)
    if "text" in raw or "input_ids" in raw:  # SGLang's reward route: raw scores
        body = _parsed(EncodeReqInput, raw)
        await _head(g)
        _no_adapter(body.lora_path)
        return await sglang_pooled(g, request, body, normalize=False)
    return await _vllm_classify(g, request, _parsed(ClassificationRequest, raw))


async def _vllm_classify(g: Gateway, request: Request, body: ClassificationRequest) -> Response:
    head = await _head(g)
    model, adapter = await g.model_and_adapter(body.model, None)
    _no_adapter(adapter)
    items = await _inputs(g, body)
    salt = tenant_cache_salt(request_key(request.scope), body.cache_salt)
    opts = EmbedOptions(
        None, salt, body.priority, body.truncate_prompt_tokens, body.add_special_tokens
    )
    results = await embed(g, request, items, opts)
    return JSONResponse(
        {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [_item(i, head, f) for i, f in enumerate(results)],
            "usage": {**usage_of(results), "completion_tokens": 0},
        }
    )


async def _inputs(g: Gateway, body: ClassificationRequest) -> list[str | list[int]]:
    """The inputs: ``input``'s, or the one conversation of ``messages`` rendered."""
    if (body.input is None) == (body.messages is None):
        raise invalid("exactly one of input or messages must be given", param="input")
    if body.messages is None:
        return input_items(body.input)[0]
    turns = [m.wire(i) for i, m in enumerate(body.messages)]
    check_messages(turns, "messages")
    return [await g.tokenize_chat(turns, add_generation_prompt=False)]


def _item(index: int, head: ClassifierHead, f: p.GenerateFinal) -> dict[str, Any]:
    """One input's entry: its probabilities and the most likely label."""
    try:
        result = classify(head, f.embedding or [])
    except ValueError as exc:  # a worker's head of another width: the server's fault
        raise APIError(500, f"input[{index}]: {exc}", type="internal_error") from None
    return {
        "index": index,
        "label": result.label,
        "probs": result.probs,
        "num_classes": head.num_labels,
    }
