"""OpenAI's ``POST /v1/embeddings`` (also SGLang's and vLLM's route), for RAG pipelines and
agents' memory stores that embed with the model they serve, and SGLang's native
``POST /encode`` (``text`` or ``input_ids``, one or a batch, answered as
``{"embedding", "meta_info"}`` each).

Each input is a prompt run to the end of its prefill, its embedding the final norm's output
at its last token: last-token pooling, how decoder embedding models pool (Qwen3-Embedding,
gte-Qwen2, e5-mistral; the engine's ``return_embedding``). The prompt goes through the
radix cache like any other, so inputs sharing a prefix (an instruction, a document's head)
compute it once (``usage.prompt_tokens_details.cached_tokens`` counts what the cache
served); the last token is always computed. ``dimensions`` keeps the first
dimensions (Matryoshka models' truncation), and the vector is then scaled to unit length
as OpenAI's are (vLLM's ``normalize: false`` keeps the model's own scale).
``encoding_format: "base64"`` (the ``openai`` client's default) sends the little-endian
float32 bytes.

A model trained for generation answers too, with the hidden state it predicts the next
token from; only an embedding model's vectors are meant for similarity.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from radixserve.sampling_params import TOKEN_ID_LIMIT, SamplingParams
from radixserve.serving.http.auth import request_key, tenant_cache_salt
from radixserve.serving.http.errors import APIError, invalid
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.http.streams import finals
from radixserve.serving.wire import protocol as p

router = APIRouter()

TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]
MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(BaseModel):
    """OpenAI's body, with vLLM's ``normalize``, ``truncate_prompt_tokens``,
    ``add_special_tokens`` and ``priority``, and the radix cache's ``cache_salt``. Any other
    field is a 400 (it could be one that changes the vectors), not ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    normalize: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    lora_path: str | None = None  # SGLang's: a served LoRA adapter
    add_special_tokens: bool = True  # a text input's BOS, as a text prompt gets it
    priority: int = 0

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list of texts or token id lists (none empty)."""
        return input_items(self.input)[0]


def input_items(x: Any) -> tuple[list[str | list[int]], bool]:
    """One input or a batch (a text, token ids, or a list of either) as a list of inputs,
    none empty and at most :data:`MAX_INPUTS`, and whether it was a single input."""
    single = isinstance(x, str) or (bool(x) and isinstance(x[0], int))
    items: list[Any] = [x] if single else list(x)
    if not items:
        raise invalid("input must not be empty", param="input")
    if len(items) > MAX_INPUTS:
        raise invalid(f"at most {MAX_INPUTS} inputs, got {len(items)}", param="input")
    for i, item in enumerate(items):
        if not item:
            raise invalid(f"input[{i}] is empty", param="input")
    return items, single


class EncodeReqInput(BaseModel):
    """SGLang's ``POST /encode`` body (unknown keys ignored, as on ``/generate``)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    rid: str | list[str] | None = None
    dimensions: int | None = Field(default=None, ge=1)
    lora_path: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    image_data: Any = None

    def inputs(self) -> tuple[list[str | list[int]], bool]:
        """The inputs, and whether there was a single one (answered unwrapped)."""
        if self.image_data is not None:
            raise invalid("image_data is not supported", param="image_data")
        if (self.text is None) == (self.input_ids is None):
            raise invalid("exactly one of text or input_ids must be given", param="text")
        return input_items(self.text if self.text is not None else self.input_ids)

    def rids(self, n: int, default: str) -> list[str]:
        if isinstance(self.rid, list):
            if len(self.rid) != n:
                raise invalid(f"rid has {len(self.rid)} entries for {n} inputs", param="rid")
            return list(self.rid)
        base = self.rid or default
        return [base] if n == 1 else [f"{base}-{i}" for i in range(n)]


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway


def pooled(hidden: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The embedding sent: the first ``dimensions`` of the prompt's last hidden state, scaled
    to unit length (``normalize``)."""
    v = hidden[:dimensions] if dimensions else hidden
    norm = math.sqrt(math.fsum(x * x for x in v)) if normalize else 0.0
    return [x / norm for x in v] if norm > 0 else list(v)


def _vector(f: p.GenerateFinal, dimensions: int | None, normalize: bool) -> list[float]:
    """An input's vector as sent (:func:`pooled`); a 400 for more dimensions than it has."""
    assert f.embedding is not None  # embed() checked
    if dimensions is not None and dimensions > len(f.embedding):
        raise invalid(
            f"dimensions must be at most the model's {len(f.embedding)}", param="dimensions"
        )
    return pooled(f.embedding, dimensions, normalize)


def _encoded(v: list[float], encoding: str) -> list[float] | str:
    """As sent: floats, or base64 of their little-endian float32 bytes."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")
    return v


@dataclass(frozen=True)
class EmbedOptions:
    """How inputs are embedded: the adapter, the tenant's cache salt, and vLLM's options."""

    lora: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True


async def embed(
    g: Gateway, request: Request, items: list[str | list[int]], opts: EmbedOptions
) -> list[p.GenerateFinal]:
    """Each input run to the end of its prefill, concurrently; its final message carries the
    final norm's output at its last token (``embedding``) and its usage."""
    arrival = time.monotonic()
    g.check_batch(len(items))
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        return_embedding=True,
        truncate_prompt_tokens=opts.truncate_prompt_tokens,
    )
    texts = [item for item in items if isinstance(item, str)]
    if texts and not opts.add_special_tokens:  # encoded here, without the tokenizer's BOS
        ids = iter(await g.tokenize(texts, add_special_tokens=False))
        items = [next(ids) if isinstance(item, str) else item for item in items]
    streams = [
        g.stream(
            arrival=arrival,
            params=params,
            cache_salt=opts.cache_salt,
            priority=opts.priority,
            lora=opts.lora,
            **({"text": item} if isinstance(item, str) else {"input_ids": item}),
        )
        for item in items
    ]
    results = await finals(request, streams)
    missing = [i for i, f in enumerate(results) if f.embedding is None]
    if missing:
        raise APIError(
            500, f"input[{missing[0]}] ended without an embedding", type="internal_error"
        )
    return results


@router.post("/v1/embeddings", response_model=None)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    g = _gw(request)
    model, lora = await g.model_and_adapter(body.model, body.lora_path)
    salt = tenant_cache_salt(request_key(request.scope), body.cache_salt)
    opts = EmbedOptions(
        lora, salt, body.priority, body.truncate_prompt_tokens, body.add_special_tokens
    )
    results = await embed(g, request, body.inputs(), opts)
    return JSONResponse(_reply(results, body, model))


def _reply(results: list[p.GenerateFinal], body: EmbeddingRequest, model: str) -> dict[str, Any]:
    data = []
    for i, f in enumerate(results):
        v = _vector(f, body.dimensions, body.normalize)
        data.append(
            {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
        )
    return {"object": "list", "data": data, "model": model, "usage": usage_of(results)}


def usage_of(results: list[p.GenerateFinal]) -> dict[str, Any]:
    """The inputs' usage: prompt tokens only (nothing is generated), and what the cache
    served of them."""
    tokens = sum(f.usage.prompt_tokens for f in results)
    cached = sum(f.usage.cached_tokens for f in results)
    return {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "prompt_tokens_details": {"cached_tokens": cached},  # as chat's usage says it
    }


@router.post("/encode", response_model=None)
async def encode(body: EncodeReqInput, request: Request) -> Response:
    """SGLang's embedding route: each input's vector (unit length, as SGLang's pooler
    gives it; ``dimensions``: the first d) with its ``meta_info``."""
    return await sglang_pooled(_gw(request), request, body, normalize=True)


async def sglang_pooled(
    g: Gateway, request: Request, body: EncodeReqInput, normalize: bool
) -> Response:
    """SGLang's answer to ``/encode`` and to a reward model's ``/classify``: each input's
    ``embedding`` (scaled to unit length with ``normalize``; a classifier's raw logits
    without) and its ``meta_info``, unwrapped for a single input."""
    items, single = body.inputs()
    rids = body.rids(len(items), uuid.uuid4().hex)
    _, lora = await g.model_and_adapter("default", body.lora_path)
    salt = tenant_cache_salt(request_key(request.scope), body.cache_salt)
    results = await embed(g, request, items, EmbedOptions(lora, salt))
    out = []
    for rid, f in zip(rids, results):
        meta = {
            "id": rid,
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": f.usage.prompt_tokens,
            "cached_tokens": f.usage.cached_tokens,
            "e2e_latency": f.timings.total_s,
        }
        out.append({"embedding": _vector(f, body.dimensions, normalize), "meta_info": meta})
    return JSONResponse(out[0] if single else out)
