"""``POST /tokenize`` and ``POST /detokenize``: vLLM's token counting and decoding routes.

Clients count a prompt before they send it (to trim an agent's history to the context, to
price a call) and need the count the server will see. So a ``prompt`` is encoded as a text
prompt of ``/v1/completions`` is, and ``messages`` (with ``tools`` and
``chat_template_kwargs``) are rendered by the model's template and encoded as a chat
request's are: both by the router, the one process that encodes prompts. The answer is
vLLM's: ``count``, ``max_model_len``, ``tokens`` and, asked for, ``token_strs`` (the
vocabulary's pieces). ``/detokenize`` decodes ``tokens`` with the gateway's tokenizer (as
logprob entries are named), or the router's when the gateway has none. ``/tokenizer_info``
(vLLM's) names the special tokens and the chat template, so that a client can use these
routes as its tokenizer.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from radixserve.serving.http import chat_tools
from radixserve.serving.http.chat_request import check_messages, plan_tools
from radixserve.serving.http.chat_tools import ToolIn
from radixserve.serving.http.errors import invalid
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.http.openai_protocol import ChatMessageIn, TokenId

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenizeBody(_Body):
    """Exactly one of ``prompt`` and ``messages``. ``add_special_tokens`` defaults as in
    vLLM: the tokenizer's BOS for a prompt; none for messages (their template writes it)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    tools: list[ToolIn] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # the request's own, where the server trusts them
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[TokenId]


async def _gateway(request: Request, model: str | None) -> Gateway:
    g: Gateway = request.app.state.gateway
    if model is not None:
        await g.check_model(model)
    return g


def _tokenizer(g: Gateway, what: str) -> Any:
    """The gateway's tokenizer, or a 400 saying how to give it one."""
    if g.tokenizer is None:
        raise invalid(
            f"{what} needs the model's tokenizer here: start the gateway with --tokenizer"
        )
    return g.tokenizer


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
    g = await _gateway(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("send exactly one of prompt and messages", param="prompt")
    if body.messages is None:
        assert body.prompt is not None
        special = body.add_special_tokens is not False
        (ids,) = await g.tokenize([body.prompt], add_special_tokens=special)
    else:
        ids = await _tokenize_chat(g, body, body.messages)
    info = await g.info()
    out: dict[str, Any] = {"count": len(ids), "max_model_len": info.context_length, "tokens": ids}
    out["token_strs"] = _pieces(g, ids) if body.return_token_strs else None
    return out


async def _tokenize_chat(
    g: Gateway, body: TokenizeBody, messages: list[ChatMessageIn]
) -> list[int]:
    """The chat prompt's ids, rendered as ``/v1/chat/completions`` renders it."""
    if body.add_special_tokens:
        raise invalid(
            "add_special_tokens applies to a prompt: a chat template writes its own",
            param="add_special_tokens",
        )
    turns = [m.wire(i) for i, m in enumerate(messages)]
    check_messages(turns, "messages")
    g.check_chat_template(body.chat_template)
    plan = await plan_tools(g, body.tools, None, template=body.chat_template)
    return await g.tokenize_chat(
        turns,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        tools=plan.tools_json,
        chat_template_kwargs=chat_tools.template_kwargs(body.chat_template_kwargs),
        chat_template=body.chat_template,
    )


def _pieces(g: Gateway, ids: list[int]) -> list[str]:
    pieces = _tokenizer(g, "return_token_strs").convert_ids_to_tokens(ids)
    return [str(piece) for piece in pieces]


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
    g = await _gateway(request, body.model)
    info = await g.info()
    if len(body.tokens) > info.context_length:
        raise invalid(
            f"{len(body.tokens)} tokens, more than the context of {info.context_length}",
            param="tokens",
        )
    if any(t >= info.vocab_size for t in body.tokens):
        raise invalid(f"token ids must be in [0, {info.vocab_size})", param="tokens")
    return {"prompt": await g.detokenize(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """vLLM's: what a client needs to stand in for the model's tokenizer with ``/tokenize``
    and ``/detokenize`` (lm-evaluation-harness's remote tokenizer reads it): the special
    tokens, the chat template, the context length."""
    g: Gateway = request.app.state.gateway
    info = await g.info()
    return {
        **info.special_tokens,
        "chat_template": info.chat_template,
        "model_max_length": info.context_length,
        "vocab_size": info.vocab_size,
    }
