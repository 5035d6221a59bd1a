"""vLLM's Score and Rerank APIs for an embedding model: ``POST /v1/score`` (``/score``)
scores text pairs, ``POST /v1/rerank`` (``/rerank``, ``/v2/rerank``: Jina's and Cohere's
shapes) orders documents by their relevance to a query. As vLLM scores with an embedding
model, a pair's score is the cosine similarity of the two texts' embeddings
(:mod:`~radixserve.serving.http.embeddings`: the final norm's output at the last token).

Each distinct text is embedded once, however many pairs it is in (a query against a
hundred documents: a hundred and one prompts), and through the radix cache as any prompt:
documents that share a head (an instruction, a template) compute it once.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from radixserve.serving.http.auth import request_key, tenant_cache_salt
from radixserve.serving.http.embeddings import MAX_INPUTS, EmbedOptions, embed
from radixserve.serving.http.errors import invalid
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.wire import protocol as p

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = "default"
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    lora_path: str | None = None
    priority: int = 0


class ScoreRequest(_Body):
    """vLLM's: ``text_1`` one text (scored against each of ``text_2``) or a list as long as
    ``text_2`` (scored pair by pair)."""

    text_1: str | list[str]
    text_2: str | list[str]
    encoding_format: str | None = None  # vLLM's clients send it; scores are floats either way

    def pairs(self) -> list[tuple[str, str]]:
        left = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        right = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if not left or not right:
            raise invalid("text_1 and text_2 must not be empty", param="text_1")
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise invalid(
                f"text_1 has {len(left)} texts and text_2 {len(right)}: one, or as many",
                param="text_2",
            )
        return list(zip(left, right))


class RerankRequest(_Body):
    """Jina's and Cohere's (and vLLM's): ``documents`` ordered by relevance to ``query``,
    the ``top_n`` best (all by default)."""

    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b))
    norm = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0


async def _embedded(
    g: Gateway, request: Request, body: _Body, texts: list[str]
) -> tuple[str, dict[str, list[float]], int]:
    """The model's name as replies carry it, each distinct text's embedding, and the prompt
    tokens they took."""
    if (await g.info()).labels:  # cosines of class logits would mean nothing
        raise invalid(
            "the served model is a sequence classifier: score texts with /v1/classify "
            "(scoring pairs as vLLM's cross-encoders do is not implemented)"
        )
    model, lora = await g.model_and_adapter(body.model, body.lora_path)
    distinct = list(dict.fromkeys(texts))
    if len(distinct) > MAX_INPUTS:
        raise invalid(f"at most {MAX_INPUTS} distinct texts, got {len(distinct)}")
    if any(not t for t in distinct):
        raise invalid("texts must not be empty")
    salt = tenant_cache_salt(request_key(request.scope), body.cache_salt)
    opts = EmbedOptions(lora, salt, body.priority, body.truncate_prompt_tokens)
    finals: list[p.GenerateFinal] = await embed(g, request, list(distinct), opts)
    vectors = {t: f.embedding or [] for t, f in zip(distinct, finals)}
    return model, vectors, sum(f.usage.prompt_tokens for f in finals)


async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
    pairs = body.pairs()
    g = _gw(request)
    model, vec, tokens = await _embedded(g, request, body, [t for pair in pairs for t in pair])
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": i, "object": "score", "score": cosine(vec[a], vec[b])}
            for i, (a, b) in enumerate(pairs)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
    g = _gw(request)
    model, vec, tokens = await _embedded(g, request, body, [body.query, *body.documents])
    scores = [cosine(vec[body.query], vec[d]) for d in body.documents]
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    results = []
    for i in order[: body.top_n or len(order)]:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": body.documents[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


for path in ("/v1/score", "/score"):
    router.add_api_route(path, score, methods=["POST"])
for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
    router.add_api_route(path, rerank, methods=["POST"])
