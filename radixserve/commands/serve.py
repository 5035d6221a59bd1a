"""``radixserve serve`` (router + local workers), ``radixserve worker`` (join a router from
another host) and ``radixserve client`` (a streaming demo)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.cli import register
from radixserve.commands.engine_args import add_engine_arguments, engine_config
from radixserve.commands.gateway import add_http_arguments, request_limits, start_http_for_serve
from radixserve.serving.router.dispatch import BALANCE_LOADS, PREFIX_SOURCES, ROUTING_POLICIES
from radixserve.serving.wire.base import DEFAULT_ENDPOINT

if TYPE_CHECKING:
    from radixserve.serving.router.launcher import LocalServer
    from radixserve.serving.router.router import RouterConfig


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    _endpoint_arguments(p)
    _routing_arguments(p)
    _disaggregation_arguments(p)
    _liveness_arguments(p)
    _security_arguments(p)
    add_engine_arguments(p, "engine (per worker)", seed=True)
    add_http_arguments(p)  # --http-port etc. (the HTTP gateway, radixserve.serving.http)


def _endpoint_arguments(p: argparse.ArgumentParser) -> None:
    """The model, where clients and workers connect, the local workers."""
    p.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct) or a local HF directory",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="the chat template to render chats with instead of the model's (vLLM's and "
        "SGLang's flag): a jinja file, or the template itself inline",
    )
    p.add_argument("--host", default="127.0.0.1", help="client endpoint host (tcp)")
    p.add_argument(
        "--port", type=int, default=5555, help="client endpoint port (tcp; 0: any free port)"
    )
    p.add_argument(
        "--endpoint",
        default=None,
        help="full client endpoint, e.g. ipc:///tmp/radixserve.sock (overrides --host/--port)",
    )
    p.add_argument(
        "--workers", type=int, default=1, help="local worker processes (0: only remote workers)"
    )
    p.add_argument(
        "--gpu-ids",
        default=None,
        help="with --device cuda: GPUs for the local workers, one each, e.g. 0,1 (default: every visible GPU)",
    )
    p.add_argument(
        "--worker-endpoint",
        default="tcp://127.0.0.1:*",
        help="where workers connect (bind e.g. tcp://0.0.0.0:5556 to let remote workers join)",
    )


def _routing_arguments(p: argparse.ArgumentParser) -> None:
    """How the router chooses a worker (docs/serving.md#routing-and-failures)."""
    p.add_argument("--routing", choices=ROUTING_POLICIES, default="cache_aware")
    p.add_argument(
        "--balance-load",
        choices=BALANCE_LOADS,
        default="work",
        help="cache-aware: measure load as outstanding prompt tokens of work (queued prefill "
        "plus 32 per request in flight) or as requests in flight",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=float,
        default=None,
        help="cache-aware: load gap (in --balance-load's unit) beyond which the least loaded "
        "worker wins, if the relative threshold is passed too (default: 2048 tokens / 32 requests)",
    )
    p.add_argument("--balance-rel-threshold", type=float, default=1.5)
    p.add_argument(
        "--router-prefix-source",
        choices=PREFIX_SOURCES,
        default="tries",
        help="cache-aware: where the router learns what each worker caches: 'tries' (the "
        "prefixes it sent there, approximate) or 'events' (the workers' KV events over their "
        "router connection: evictions, restarts, L2/L3 tiers, flushes included)",
    )
    p.add_argument(
        "--cache-threshold",
        type=float,
        default=0.5,
        help="cache-aware: fraction of the prompt a worker must hold to win on cache",
    )


def _disaggregation_arguments(p: argparse.ArgumentParser) -> None:
    """Prefill/decode disaggregation over the local workers (docs/disaggregation.md)."""
    p.add_argument(
        "--disaggregation",
        default=None,
        metavar="prefill:N,decode:M",
        help="split the local workers into N prefill and M decode workers (--workers N+M): a "
        "request's prompt is computed on a prefill worker chosen by prefix cache, its KV "
        "written into a decode worker chosen by load (Mooncake's transfer engine), which "
        "streams the tokens",
    )
    p.add_argument(
        "--disaggregation-timeout",
        type=float,
        default=60.0,
        help="with --disaggregation: seconds a decode worker holds pages for a prompt's KV "
        "before it gives them back and the request fails",
    )


def _liveness_arguments(p: argparse.ArgumentParser) -> None:
    """Worker liveness and restarts, the tokenizer processes."""
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=30.0,
        help="seconds of worker silence before it is dead",
    )
    p.add_argument(
        "--tokenizer-workers",
        type=int,
        default=2,
        help="processes that encode prompts off the router's loop (0: encode on the loop)",
    )
    p.add_argument(
        "--restart-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start a local worker that exited again, with back-off (reaped and logged either way)",
    )
    p.add_argument(
        "--restart-backoff",
        type=float,
        default=1.0,
        help="seconds before the first restart; doubles with each exit in a row (at most 30 s)",
    )


def _security_arguments(p: argparse.ArgumentParser) -> None:
    """Logging, CURVE keys, and the switch for addresses other hosts reach."""
    p.add_argument("--log-level", default="WARNING")
    p.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="CURVE-authenticate and encrypt the client and worker ports with the router keys in DIR "
        "(made by 'radixserve keys KEYDIR': KEYDIR/router)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow ZeroMQ or HTTP addresses other hosts reach without --keys / --api-key",
    )


@register(
    "serve",
    help="serve a model over ZeroMQ: a router and N worker processes",
    arguments=_serve_arguments,
)
def serve(args: argparse.Namespace) -> int:
    """Run the router in the foreground until SIGINT/SIGTERM; a clean stop ends the process.

    On a signal the router and the HTTP gateway stop together; the router fails requests in
    flight, the workers are told to exit (and get SIGTERM) and are reaped, every socket is
    closed; then the process ends with :func:`~radixserve.serving.shutdown.exit_now` rather
    than returning (interpreter finalization would cost seconds of CPU for nothing)."""
    engine_overrides = engine_config(args)  # first: it may switch Triton to its interpreter
    if engine_overrides.get("node_rank", 0) > 0:  # another host's ranks of worker 0: no router
        return run_other_node(args.model, engine_overrides)
    import logging
    import signal
    import sys
    from collections.abc import Callable

    from radixserve.commands.gateway import check_http_bind, http_keys, tls_files, warm_up_http
    from radixserve.model_store import resolve_model
    from radixserve.serving.shutdown import exit_now, freeze_startup_objects
    from radixserve.serving.wire.security import log as audit_log

    logging.basicConfig(level=args.log_level.upper(), format="[router] %(levelname)s %(message)s")
    if audit_log.getEffectiveLevel() > logging.INFO:
        audit_log.setLevel(logging.INFO)  # who joined, from where, with which key: always shown
    if args.workers < 0:
        raise ValueError("--workers must be >= 0")
    endpoint = args.endpoint or f"tcp://{args.host}:{args.port if args.port else '*'}"
    if args.http_port is not None:  # before any worker starts: a refused address fails fast
        check_http_bind(args.http_host, http_keys(args)[0], args.insecure)
        tls_files(args)
    model = resolve_model(args.model)
    start_local_master(engine_overrides)  # only for a Mooncake L3 without a master address
    server = _start_local_server(args, model, endpoint, engine_overrides)
    # Everything a signal must stop; the HTTP gateway joins once started, so that it shuts
    # down while the workers do, not after them.
    stoppers: list[Callable[[], None]] = [server.router.stop]

    def on_signal(*_: object) -> None:
        for stop in stoppers:
            stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(
        f"radixserve: starting {args.workers} worker(s) for {model}; workers connect at "
        f"{server.router.worker_endpoint}",
        flush=True,
    )
    started = time.monotonic()
    try:
        if not server.wait_ready():
            exit_now(0)  # stopped during start-up: the workers are reaped already
    except (RuntimeError, TimeoutError) as e:  # a worker failed to start (its traceback is above)
        print(f"radixserve serve: error: {e}", file=sys.stderr)
        return 1
    http = start_http_for_serve(args, server, model)  # None without --http-port
    if http is not None:
        stoppers.append(http.request_stop)
        if server.router.stopping:  # the signal came while the gateway started
            http.request_stop()
        elif args.warm_up_request and server.router.live_workers:  # none yet: nothing to warm
            print(f"radixserve: {warm_up_http(server, http, http_keys(args)[0])}", flush=True)
    pids = " ".join(str(p.pid) for p in server.procs)
    print(
        f"radixserve: serving on {server.endpoint} (routing {args.routing}; worker pids {pids or '-'}); "
        f"start-up took {time.monotonic() - started:.1f} s (the workers' lines above say where)",
        flush=True,
    )
    freeze_startup_objects()  # the gateway's too: so that no full collection pauses the router
    try:
        server.run()
    finally:
        if http is not None:
            http.stop()
    print("radixserve: stopped", flush=True)
    exit_now(0)


def router_config(args: argparse.Namespace, endpoint: str) -> RouterConfig:
    """The router's configuration from ``serve``'s flags (docs/configuration.md)."""
    from radixserve.serving.router.router import RouterConfig
    from radixserve.serving.wire.security import load_router_keys

    return RouterConfig(
        endpoint=endpoint,
        worker_endpoint=args.worker_endpoint,
        routing=args.routing,
        worker_timeout_s=args.worker_timeout,
        balance_load=args.balance_load,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        cache_threshold=args.cache_threshold,
        prefix_source=args.router_prefix_source,
        keys=load_router_keys(args.keys) if args.keys is not None else None,
        insecure=args.insecure,
        limits=request_limits(args),
        restart_workers=args.restart_workers,
        restart_backoff_s=args.restart_backoff,
        tokenizer_workers=args.tokenizer_workers,
        disaggregation=args.disaggregation is not None,
        disaggregation_timeout_s=args.disaggregation_timeout,
    )


def _start_local_server(
    args: argparse.Namespace, model: Path, endpoint: str, engine_overrides: dict[str, Any]
) -> LocalServer:
    """Bind the router and start the local workers (a taken port is one clear error line)."""
    import zmq

    from radixserve.engine.config import EngineConfig
    from radixserve.engine.devices import parse_gpu_ids
    from radixserve.serving.router.launcher import LocalServer

    overrides = disaggregation_overrides(args)
    for worker in overrides or []:  # a refused combination: one line before any worker starts
        EngineConfig.from_kwargs(**{**engine_overrides, **worker})
    try:
        return LocalServer(
            model,
            # Loaded once the workers are started: their start-up and its load overlap.
            load_tokenizer=lambda: serving_tokenizer(model, args.chat_template),
            num_workers=args.workers,
            worker_overrides=overrides,
            config=router_config(args, endpoint),
            engine_config=engine_overrides,
            gpu_ids=parse_gpu_ids(args.gpu_ids),
            # Shared with the HTTP gateway's client (the router's inproc endpoint), so the
            # router must not terminate it under the gateway; the process ends with exit_now.
            context=zmq.Context(),
        )
    except zmq.ZMQError as e:  # e.g. the port is taken: one clear line, not a traceback
        raise ValueError(
            f"cannot bind {endpoint} or {args.worker_endpoint}: {e} (try --port or --endpoint)"
        ) from e


def serving_tokenizer(model: Path, chat_template: str | None) -> Any:
    """The router's tokenizer: the model's, its chat template replaced by ``chat_template``
    (``--chat-template``: a file or the template inline) where one is given."""
    from radixserve.serving.prompts import load_tokenizer, read_chat_template

    tokenizer = load_tokenizer(model)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def start_local_master(engine_overrides: dict[str, Any]) -> Any:
    """A single-host trial of the Mooncake L3 (``--hicache-storage-backend mooncake`` with no
    ``master_server_address`` in its config): start a ``mooncake_master`` (with its HTTP
    metadata server) on loopback, point the workers' store config at it, and return it (it
    dies with this process). None when a master is given or the backend is not Mooncake.
    Prefill/decode disaggregation alone needs none: its transfer engines meet peer to peer."""
    if engine_overrides.get("hicache_storage_backend") != "mooncake":
        return None
    import json
    import tempfile

    extra = json.loads(engine_overrides.get("hicache_storage_backend_extra_config") or "{}")
    path = engine_overrides.get("hicache_storage_backend_config")
    given = json.loads(Path(path).read_text()) if path else {}
    if extra.get("master_server_address") or given.get("master_server_address"):
        return None
    from radixserve.distributed.mooncake_master import LocalMaster

    log = Path(tempfile.mkdtemp(prefix="radixserve-mooncake-")) / "master.log"
    master = LocalMaster(log, die_with_parent=True)
    engine_overrides["hicache_storage_backend_extra_config"] = json.dumps(
        {**master.config, **extra}
    )
    print(
        f"radixserve: started a local mooncake_master at {master.config['master_server_address']} "
        f"(pid {master.proc.pid}, log {log}); in a cluster give its address instead",
        flush=True,
    )
    return master


def disaggregation_overrides(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """Each local worker's disaggregation mode from ``--disaggregation`` (None without it);
    ``--workers`` becomes N + M (given otherwise, it must say the same)."""
    if getattr(args, "disaggregation", None) is None:
        return None
    from radixserve.serving.router.disagg_dispatch import parse_roles

    roles = parse_roles(args.disaggregation)
    if args.workers == 0:  # remote workers only: they say their mode when they join
        return None
    if args.workers not in (1, len(roles)):
        raise ValueError(f"--workers {args.workers} but --disaggregation {args.disaggregation}")
    args.workers = len(roles)
    return [{"disaggregation_mode": r} for r in roles]


def run_other_node(model: str | None, engine_overrides: dict[str, Any]) -> int:
    """``--node-rank`` > 0: run this host's tensor-parallel ranks of the worker whose rank 0
    runs on node 0 (at ``--dist-init-addr``) until it stops them; the exit code."""
    import logging

    from radixserve.distributed.ranks import run_node
    from radixserve.engine.config import EngineConfig
    from radixserve.model_store import resolve_model
    from radixserve.serving.shutdown import exit_now

    logging.basicConfig(level=logging.WARNING, format="[ranks] %(levelname)s %(message)s")
    cfg = EngineConfig.from_kwargs(**engine_overrides)
    print(
        f"radixserve: node {cfg.node_rank} of {cfg.nnodes}: tensor-parallel ranks of the worker "
        f"at {cfg.dist_init_addr}",
        flush=True,
    )
    exit_now(run_node(cfg, resolve_model(model)))


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--connect",
        default=None,
        help="the router's worker endpoint, e.g. tcp://ROUTER_HOST:5556 (not with --node-rank > 0)",
    )
    p.add_argument("--model", default="default")
    p.add_argument(
        "--worker-id", type=int, default=-1, help="preferred id (-1: the router assigns one)"
    )
    p.add_argument("--log-level", default="WARNING")
    p.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="this worker's CURVE keys, for a router that requires them ('radixserve keys KEYDIR': KEYDIR/worker)",
    )
    # Set by `serve` for its local workers (serving.workers.worker_command), with --engine-config.
    p.add_argument(
        "--parent-pid", type=int, default=None, help=argparse.SUPPRESS
    )  # exit when it dies
    p.add_argument(
        "--router-timeout",
        type=float,
        default=30.0,
        help="seconds without a connection to the router before a local worker exits",
    )
    add_engine_arguments(p, "engine", seed=True)


@register(
    "worker",
    help="run one worker process that joins a router (e.g. from another host)",
    arguments=_worker_arguments,
)
def worker(args: argparse.Namespace, engine_factory: Any = None) -> int:
    from radixserve.serving.shutdown import exit_now
    from radixserve.serving.worker.process import run_worker

    config = engine_config(args)
    if config.get("node_rank", 0) > 0:  # this host only runs ranks; node 0 is the worker
        return run_other_node(args.model, config)
    if args.connect is None:
        raise ValueError("radixserve worker needs --connect (the router's worker endpoint)")
    # A stopped worker skips interpreter finalization (seconds of torch teardown, for no one).
    exit_now(
        run_worker(
            args.connect,
            model=args.model,
            worker_id=args.worker_id,
            engine_config=config,
            parent_pid=args.parent_pid,
            router_timeout_s=args.router_timeout,
            keys=args.keys,
            log_level=args.log_level,
            engine_factory=engine_factory,
        )
    )


def _client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default="What is a radix tree?")
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT)
    p.add_argument(
        "--raw", action="store_true", help="send the prompt as text, not as a chat message"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stats", action="store_true", help="print the router's stats afterwards")
    p.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="this client's CURVE keys, for a router that requires them ('radixserve keys KEYDIR': KEYDIR/client)",
    )


@register(
    "client",
    help="send one prompt to a running server and stream the answer",
    arguments=_client_arguments,
)
def client(args: argparse.Namespace) -> int:
    from radixserve.serving.client import stream_demo

    return stream_demo(
        args.prompt,
        endpoint=args.endpoint,
        raw=args.raw,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        stats=args.stats,
        keys=args.keys,
    )
