"""``radixserve gateway``: the HTTP gateway (OpenAI-compatible + SGLang-native + /metrics) in
front of a running router; and the ``--http-port`` option that ``radixserve serve`` uses to
run the same gateway next to its router."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from radixserve.cli import register
from radixserve.serving.wire.limits import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_REQUEST_BYTES

HTTP_LOGGER = "radixserve.serving.http"


def _common_http_arguments(g: Any, *, memory_log_default: float) -> None:
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients use (default: the router's model name; 'default' always works)",
    )
    g.add_argument(
        "--memory-log-interval",
        type=float,
        default=memory_log_default,
        help="seconds between device-memory log lines (0: off)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may wait for the router's next message",
    )
    g.add_argument(
        "--access-log", action="store_true", help="log every HTTP request (uvicorn access log)"
    )
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (repeat for several "
        "tenants; also RADIXSERVE_API_KEY); each key gets a prefix cache of its own",
    )
    g.add_argument(
        "--admin-api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="the key /flush_cache, /get_server_info and /metrics require instead "
        "(also RADIXSERVE_ADMIN_API_KEY)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body (HTTP: 413 above it, refused before it is parsed; 0: no limit)",
    )
    g.add_argument(
        "--max-batch-size",
        type=int,
        default=DEFAULT_MAX_BATCH_SIZE,
        help="most generations (prompts × n) one HTTP request may start (0: no limit)",
    )
    g.add_argument(
        "--ssl-keyfile",
        default=None,
        help="serve HTTPS with this PEM private key (vLLM's flag; with --ssl-certfile)",
    )
    g.add_argument(
        "--ssl-certfile",
        default=None,
        help="the PEM certificate (chain) of --ssl-keyfile",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="take a request's own chat_template (vLLM's flag): a template is code the server "
        "runs, in jinja's sandbox in a tokenizer process; only for clients you trust",
    )
    _agent_arguments(g)


def _agent_arguments(g: Any) -> None:
    from radixserve.agents.registry import REASONING_FORMATS, TOOL_FORMATS

    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_FORMATS),
        help="the format tool calls are read in (default: guessed from the chat template)",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_FORMATS),
        help="split a reasoning model's reasoning (a think block; gpt-oss's analysis messages) out "
        "of answers into reasoning_content",
    )


def http_keys(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The API keys and admin API keys from the options and the environment."""

    def keys(given: list[str] | None, env: str) -> tuple[str, ...]:
        out = list(given or [])
        if os.environ.get(env):
            out.append(os.environ[env])
        if any(not k.strip() for k in out):
            raise ValueError(f"an empty API key is not a key ({env} or its option)")
        return tuple(dict.fromkeys(out))

    return keys(args.api_key, "RADIXSERVE_API_KEY"), keys(
        args.admin_api_key, "RADIXSERVE_ADMIN_API_KEY"
    )


def check_http_bind(host: str, api_keys: tuple[str, ...], insecure: bool) -> None:
    """Refuse an HTTP address other hosts reach without an API key, unless ``insecure``."""
    from radixserve.serving.wire.security import check_bind

    check_bind(f"tcp://{host}:0", secured=bool(api_keys), insecure=insecure, what="HTTP")


def request_limits(args: argparse.Namespace) -> Any:
    """The :class:`~radixserve.serving.wire.limits.RequestLimits` of the command's options."""
    from radixserve.serving.wire.limits import RequestLimits

    return RequestLimits(
        max_request_bytes=args.max_request_bytes,
        max_batch_size=args.max_batch_size,
        request_chat_templates=args.trust_request_chat_template,
    )


def gateway_config(
    args: argparse.Namespace, router: str, router_keys: Any, context: Any = None
) -> Any:
    """The :class:`~radixserve.serving.http.gateway.GatewayConfig` of the command's HTTP
    options (keys, limits, timeouts), for a gateway in front of ``router`` (``context``: the
    router's ZeroMQ context, for its ``inproc://`` endpoint)."""
    from radixserve.serving.http.gateway import GatewayConfig

    api_keys, admin_keys = http_keys(args)
    return GatewayConfig(
        router=router,
        served_model_name=args.served_model_name,
        request_timeout_s=args.request_timeout,
        memory_log_interval_s=args.memory_log_interval,
        api_keys=api_keys,
        admin_api_keys=admin_keys,
        router_keys=router_keys,
        limits=request_limits(args),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        context=context,
    )


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP options of ``radixserve serve`` (no gateway unless ``--http-port`` is given)."""
    g = p.add_argument_group("HTTP gateway (OpenAI-compatible, SGLang-native, /metrics)")
    g.add_argument(
        "--http-port", type=int, default=None, help="serve HTTP on this port too (0: any free port)"
    )
    g.add_argument("--http-host", default="127.0.0.1", help="HTTP bind address")
    g.add_argument(
        "--no-warm-up-request",
        dest="warm_up_request",
        action="store_false",
        help="do not send one short request through HTTP, router and worker before serving "
        "(it takes what a first request pays once; its prompt is cached like any other)",
    )
    _common_http_arguments(g, memory_log_default=60.0)


def tls_files(args: argparse.Namespace) -> Any:
    """The ``--ssl-keyfile`` / ``--ssl-certfile`` pair (None: plain HTTP); ``ValueError`` for
    one without the other, or a file that is not there (said before anything starts)."""
    from radixserve.serving.http.server import TLSFiles

    key, cert = args.ssl_keyfile, args.ssl_certfile
    if key is None and cert is None:
        return None
    if key is None or cert is None:
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for flag, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert)):
        if not Path(path).is_file():
            raise ValueError(f"{flag}: no file {path}")
    return TLSFiles(key, cert)


def start_http_for_serve(args: argparse.Namespace, server: Any, model: str | Path) -> Any:
    """Start the gateway thread for ``radixserve serve`` (``server``: its started
    :class:`~radixserve.serving.router.launcher.LocalServer`) when ``--http-port`` was given; returns
    it, or ``None``. The caller stops it after the router returns. If the gateway cannot
    start (e.g. the port is taken), the server is closed before the error propagates."""
    if getattr(args, "http_port", None) is None:
        return None
    router = server.router
    try:
        # In the router's process, through its inproc endpoint. Behind CURVE the gateway is one
        # more client with a key of its own (inproc has no handshake; the key then rests unused).
        return _start_http(
            args,
            router.inproc_endpoint,
            model,
            router.security.mint("clients", "http-gateway"),
            router.context,
        )
    except BaseException:
        server.close()
        raise


def warm_up_http(server: Any, http: Any, api_keys: tuple[str, ...], timeout_s: float = 60.0) -> str:
    """Send one short streamed completion through the gateway, the router and a worker of a
    started ``serve`` before it says it is serving, running the router's loop in this thread
    meanwhile (the router's thread is this one until ``serve`` runs it for good).

    A first request pays costs no later one does, in every layer on its path (first calls of
    code paths, lazy allocations and imports: 5-25 ms on a 2-core VM, benchmarks/README.md);
    this one pays them instead, as SGLang's start-up request does. Its prompt is cached like
    any other. /health answers 503 until it is done. Returns a line for the log; a failure
    (e.g. a worker that refuses it) is reported there and does not stop the server."""
    import json
    import ssl
    import threading
    import time
    import urllib.request

    base = http.url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
    headers = {"Content-Type": "application/json"}
    if api_keys:
        headers["Authorization"] = f"Bearer {api_keys[0]}"
    outcome: dict[str, str] = {}
    done = threading.Event()
    # Never via a proxy; over HTTPS, to our own socket on loopback: its certificate names the
    # server's public name, not 127.0.0.1, and there is no one else on this connection.
    own = ssl.create_default_context()
    own.check_hostname, own.verify_mode = False, ssl.CERT_NONE
    direct = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=own)
    )

    def send() -> None:
        try:
            with direct.open(
                urllib.request.Request(f"{base}/v1/models", headers=headers), timeout=timeout_s
            ) as r:
                model = json.load(r)["data"][0]["id"]
            body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0.0}
            req = urllib.request.Request(
                f"{base}/v1/completions", json.dumps({**body, "stream": True}).encode(), headers
            )
            with direct.open(req, timeout=timeout_s) as r:
                for _ in r:  # the whole stream, to [DONE]
                    pass
        except Exception as exc:  # noqa: BLE001 -- reported, never fatal
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            done.set()

    started = time.monotonic()
    gateway = http.app.state.gateway
    gateway.warming_up = True  # /health: 503 meanwhile
    try:
        threading.Thread(target=send, name="radixserve-warm-up", daemon=True).start()
        while not done.is_set() and not server.router.stopping:
            if time.monotonic() - started > timeout_s:
                return f"warm-up request: no answer within {timeout_s:.0f} s (serving anyway)"
            server.router.run_once(0.01)
    finally:
        gateway.warming_up = False
    ms = (time.monotonic() - started) * 1e3
    if "error" in outcome:
        return f"warm-up request failed after {ms:.0f} ms (serving anyway): {outcome['error']}"
    return f"warm-up request through HTTP, router and worker: {ms:.0f} ms"


def _start_http(
    args: argparse.Namespace,
    router_endpoint: str,
    model: str | Path,
    router_keys: Any,
    context: Any = None,
) -> Any:
    from radixserve.serving.http.server import HTTPGateway
    from radixserve.serving.prompts import load_tokenizer

    logger = logging.getLogger(HTTP_LOGGER)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(
            logging.INFO
        )  # the periodic memory line is the point of the interval option
    config = gateway_config(
        args, router_endpoint.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:"), router_keys, context
    )
    # Loaded here, not on the first request: the load would block the serving event loop.
    http = HTTPGateway(
        config,
        args.http_host,
        args.http_port,
        tokenizer=load_tokenizer(model),
        access_log=args.access_log,
        tls=tls_files(args),
    ).start()
    print(f"radixserve: HTTP on {http.url} (OpenAI /v1, SGLang /generate, /metrics)", flush=True)
    return http


def _gateway_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", default="tcp://127.0.0.1:5555", help="the router's client endpoint")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model directory (or 'default') whose tokenizer names logprob tokens "
        "(default: the default model's, when the router serves it)",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--keys",
        default=None,
        help="CURVE key directory of a client (radixserve keys DIR: DIR/client), "
        "for a router that requires keys",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow an HTTP address other hosts reach without --api-key",
    )
    _common_http_arguments(p, memory_log_default=60.0)


@register(
    "gateway",
    help="HTTP gateway (OpenAI-compatible, SGLang-native, Prometheus /metrics) for a running router",
    arguments=_gateway_arguments,
)
def gateway(args: argparse.Namespace) -> int:
    import signal

    from radixserve.serving.http.server import HTTPGateway

    logging.basicConfig(level=args.log_level.upper(), format="[gateway] %(levelname)s %(message)s")
    check_http_bind(args.host, http_keys(args)[0], args.insecure)
    router_keys = None
    if args.keys is not None:
        from radixserve.serving.wire.security import load_peer_keys

        router_keys = load_peer_keys(args.keys)
    config = gateway_config(args, args.router, router_keys)
    tokenizer = None
    if args.tokenizer is not None:
        from radixserve.model_store import resolve_model
        from radixserve.serving.prompts import load_tokenizer

        tokenizer = load_tokenizer(resolve_model(args.tokenizer))
    http = HTTPGateway(
        config,
        args.host,
        args.port,
        tokenizer=tokenizer,
        log_level="warning",
        access_log=args.access_log,
        tls=tls_files(args),
    )
    signal.signal(signal.SIGINT, http.request_stop)
    signal.signal(signal.SIGTERM, http.request_stop)
    print(f"radixserve: HTTP gateway on {http.url} for router {args.router}", flush=True)
    http.run()
    print("radixserve: gateway stopped", flush=True)
    return 0
