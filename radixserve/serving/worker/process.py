"""A worker process from start to exit: :func:`run_worker`, what ``radixserve worker`` (and
``radixserve serve``, for its local workers) runs.

It loads the worker's CURVE keys, ties a local worker to its parent, installs the signal
handlers (SIGTERM/SIGINT abandon even the engine's start-up), builds the engine and runs a
:class:`~radixserve.serving.worker.worker.Worker` until it stops.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve.serving.shutdown import die_with_parent, freeze_startup_objects
from radixserve.serving.wire.security import peer_keys_from_env
from radixserve.serving.worker.engine_api import ServingEngine
from radixserve.serving.worker.worker import Interrupted, Worker

EngineFactory = Callable[..., ServingEngine]


def build_engine(model: str, **config: Any) -> ServingEngine:
    """The real engine (imports torch; only worker processes pay for it)."""
    from radixserve.engine.engine import Engine

    return Engine(model, **config)


def run_worker(
    connect: str,
    *,
    model: str | None = None,
    worker_id: int = -1,
    engine_config: dict[str, Any] | None = None,
    parent_pid: int | None = None,
    router_timeout_s: float = 30.0,
    keys: str | None = None,
    log_level: str = "WARNING",
    engine_factory: EngineFactory | None = None,
) -> int:
    """Run one worker process until it is stopped; returns its exit code.

    ``connect``: the router's worker endpoint. ``model``: a model directory or spec (``None``:
    the default model). ``engine_config``: :class:`~radixserve.engine.config.EngineConfig`
    fields. ``parent_pid``: a local worker exits when that process dies. ``router_timeout_s``:
    how long a local worker waits without a connection to its router. ``keys``: this worker's
    CURVE key directory. ``engine_factory`` replaces the real engine (tests' fake engine).
    ``radixserve worker`` (and ``radixserve serve`` for its local workers) calls this.
    """
    logging.basicConfig(
        level=log_level.upper(), format=f"[worker {worker_id}] %(levelname)s %(message)s"
    )
    # Local workers of a CURVE router get a key minted for them through the environment.
    curve = peer_keys_from_env()
    if keys is not None:
        from radixserve.serving.wire.security import load_peer_keys

        curve = load_peer_keys(keys)
    if parent_pid is not None:
        die_with_parent()
        if os.getppid() != parent_pid:
            return 1  # the parent is already gone
    worker: Worker | None = None

    def on_signal(*_: object) -> None:
        if worker is None:
            raise Interrupted  # still building the engine: abandon that
        worker.interrupt()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if engine_factory is None:
            from radixserve.model_store import resolve_model

            engine = build_engine(str(resolve_model(model)), **(engine_config or {}))
        else:
            engine = engine_factory(model, **(engine_config or {}))
        startup = getattr(engine, "startup_seconds", None)
        if startup:  # where start-up went, once, on the terminal `radixserve serve` runs in
            from radixserve.engine.startup import describe_startup

            sizing = getattr(engine, "kv_sizing", None)
            print(
                f"radixserve: worker {worker_id} engine ready in {describe_startup(startup)}"
                + (f"; {sizing}" if sizing else ""),
                flush=True,
            )
        name = Path(str(model)).name if model else "default"
        worker = Worker(
            engine,
            connect,
            worker_id,
            model_name=name,
            parent_pid=parent_pid,
            router_timeout_s=router_timeout_s,
            curve=curve,
        )
        freeze_startup_objects()  # so that a full collection never pauses a step
        return worker.run()
    except Interrupted:  # stopped before run() (which handles its own) took over
        if worker is not None and not worker.sock.closed:
            worker.close()
        return 0
