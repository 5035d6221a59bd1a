"""The HTTP gateway: OpenAI-compatible and SGLang-native APIs and Prometheus metrics, in
front of a radixserve router (it talks to the router through the ZeroMQ
:class:`~radixserve.serving.client.AsyncClient`, never to an engine).

* :mod:`.app` -- ``create_app(GatewayConfig(router=...))``, the FastAPI app;
* :mod:`.server` -- :class:`HTTPGateway`, uvicorn on a bound socket (foreground or thread);
* :mod:`.gateway` -- the shared router client, model info, per-request metrics;
* :mod:`.openai_api` / :mod:`.openai_protocol` -- ``/v1/*``;
* :mod:`.sglang_api` / :mod:`.sglang_protocol` -- ``/generate`` and SGLang's control routes;
* :mod:`.metrics` -- ``/metrics``; :mod:`.sse` -- server-sent events; :mod:`.errors` -- OpenAI's error shape.

Run it with ``radixserve gateway --router tcp://HOST:5555 --port 8000`` or
``radixserve serve --http-port 8000``. Importing this package pulls in FastAPI, not torch.
"""

from __future__ import annotations

from radixserve.serving.http.gateway import GatewayConfig

__all__ = ["GatewayConfig"]
