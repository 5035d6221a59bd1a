"""vLLM's Score and Rerank APIs on the shared server: a pair's score is the cosine of the
two texts' ``/v1/embeddings`` vectors; rerank orders the documents by it, best first, and
keeps ``top_n``; malformed bodies are 400s."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest

QUERY = "Which kernel reads the pages in place?"
DOCS = ["The decode kernel reads pages in place.", "Bananas are yellow.", "Radix trees index KV."]


def post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def cosines(server: Any, query: str, docs: list[str]) -> list[float]:
    out = post(server, "/v1/embeddings", {"model": "default", "input": [query, *docs]}).json()
    q, *ds = [d["embedding"] for d in out["data"]]  # unit length
    return [math.fsum(x * y for x, y in zip(q, d)) for d in ds]


def test_scores_are_the_cosines_of_the_embeddings(server: Any) -> None:
    want = cosines(server, QUERY, DOCS)
    one_to_many = post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(want, abs=1e-5)
    pairwise = post(server, "/score", {"text_1": [QUERY] * 2, "text_2": DOCS[:2]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(want[:2], abs=1e-5)
    assert pairwise["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents(server: Any, path: str) -> None:
    want = cosines(server, QUERY, DOCS)
    out = post(server, path, {"model": "default", "query": QUERY, "documents": DOCS}).json()
    order = sorted(range(3), key=lambda i: want[i], reverse=True)
    assert [r["index"] for r in out["results"]] == order
    assert [r["relevance_score"] for r in out["results"]] == pytest.approx(
        [want[i] for i in order], abs=1e-5
    )
    assert [r["document"]["text"] for r in out["results"]] == [DOCS[i] for i in order]
    top = post(server, path, {"query": QUERY, "documents": DOCS, "top_n": 1}).json()
    assert [r["index"] for r in top["results"]] == order[:1]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
        ("/v1/score", {"text_1": [], "text_2": ["c"]}),
        ("/v1/rerank", {"query": "q", "documents": []}),
        ("/v1/rerank", {"query": "q", "documents": ["a", ""]}),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "pooling": "mean"}),
    ],
)
def test_malformed_bodies_are_400s(server: Any, path: str, body: dict[str, Any]) -> None:
    assert post(server, path, body).status_code == 400
