"""The FastAPI application of the HTTP gateway.

``create_app(GatewayConfig(router="tcp://127.0.0.1:5555"))`` gives an ASGI app with:

* OpenAI-compatible ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``
  (:mod:`~radixserve.serving.http.openai_api`), ``/v1/responses``
  (:mod:`~radixserve.serving.http.responses`);
* OpenAI's ``/v1/embeddings`` (:mod:`~radixserve.serving.http.embeddings`), and vLLM's
  ``/v1/score`` and ``/v1/rerank`` on them (:mod:`~radixserve.serving.http.scoring`);
* vLLM's ``/v1/classify`` and SGLang's reward ``/classify`` for sequence classifiers
  (:mod:`~radixserve.serving.http.classify`);
* Anthropic-compatible ``/v1/messages`` and ``/v1/messages/count_tokens``
  (:mod:`~radixserve.serving.http.messages`);
* vLLM's ``/tokenize`` and ``/detokenize`` (:mod:`~radixserve.serving.http.tokenize_api`);
* SGLang's and vLLM's LoRA adapter loading and unloading
  (:mod:`~radixserve.serving.http.lora_api`);
* SGLang's weight updates, ``/update_weights_from_disk`` and ``/get_weight_version``
  (:mod:`~radixserve.serving.http.weights_api`);
* SGLang's ``/pause_generation`` and ``/continue_generation``, vLLM's ``/pause``,
  ``/resume`` and ``/is_paused`` (:mod:`~radixserve.serving.http.pause_api`);
* SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation``, vLLM's
  ``/sleep``, ``/wake_up`` and ``/is_sleeping`` (:mod:`~radixserve.serving.http.memory_api`);
* SGLang-native ``/generate``, ``/abort_request``, ``/get_model_info``, ``/flush_cache``,
  ``/health``, ``/health_generate``, ``/get_server_info``
  (:mod:`~radixserve.serving.http.sglang_api`);
* ``/metrics`` in Prometheus text format (:mod:`~radixserve.serving.http.metrics`);

all behind the API keys of ``config`` when it has some (:mod:`~radixserve.serving.http.auth`).

The app holds one :class:`~radixserve.serving.http.gateway.Gateway` (``app.state.gateway``),
started and closed by the app's lifespan, inside the serving event loop (its ZeroMQ
socket belongs to that loop).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve import __version__
from radixserve.serving.http import (
    cache_report,
    classify,
    embeddings,
    lora_api,
    memory_api,
    messages,
    openai_api,
    pause_api,
    responses,
    scoring,
    sessions_api,
    sglang_api,
    tokenize_api,
    weights_api,
)
from radixserve.serving.http.anthropic_errors import AnthropicErrors
from radixserve.serving.http.auth import APIKeyAuth
from radixserve.serving.http.body_limit import BodyLimit
from radixserve.serving.http.errors import APIError, install_error_handlers
from radixserve.serving.http.gateway import Gateway, GatewayConfig
from radixserve.serving.http.sse import warm_streaming

log = logging.getLogger("radixserve.serving.http")


class _CountErrors:
    """Pure ASGI middleware counting error responses by status (``radixserve_http_errors_total``);
    unlike ``BaseHTTPMiddleware`` it leaves streaming responses untouched."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.gateway.metrics.http_errors.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(config: GatewayConfig | None = None, tokenizer: Any = None) -> FastAPI:
    """The gateway's ASGI app for the router at ``config.router``.

    ``tokenizer``: a transformers tokenizer for the token strings of logprob results
    (otherwise loaded from ``config.tokenizer`` or the default model when it is served).
    ``config`` defaults to ``GatewayConfig()``.
    """
    config = config if config is not None else GatewayConfig()
    gateway = Gateway(config, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        await warm_streaming()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(
        title="radixserve",
        version=__version__,
        lifespan=lifespan,
        description="OpenAI-compatible and SGLang-native HTTP gateway in front of a radixserve router.",
    )
    app.state.gateway = gateway
    install_error_handlers(app)
    # Added first, so it runs inside the error counter: refused keys count as 401s.
    app.add_middleware(APIKeyAuth, api_keys=config.api_keys, admin_keys=config.admin_api_keys)
    app.add_middleware(
        BodyLimit, limits=config.limits
    )  # inside _CountErrors: its 413/400s are counted
    app.add_middleware(AnthropicErrors)  # around the two above: their errors on /v1/messages too
    app.add_middleware(_CountErrors, gateway=gateway)
    app.include_router(openai_api.router)
    app.include_router(sglang_api.router)
    app.include_router(responses.router)
    app.include_router(messages.router)
    app.include_router(cache_report.router)
    app.include_router(sessions_api.router)
    app.include_router(tokenize_api.router)
    app.include_router(lora_api.router)
    app.include_router(weights_api.router)
    app.include_router(pause_api.router)
    app.include_router(memory_api.router)
    app.include_router(embeddings.router)
    app.include_router(scoring.router)
    app.include_router(classify.router)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format; worker stats are refreshed from the router on each scrape
        (the last snapshot is served if the router does not answer)."""
        try:
            await gateway.stats()
        except APIError as exc:
            log.warning(
                "metrics: router stats unavailable (%s); serving the last snapshot", exc.message
            )
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
