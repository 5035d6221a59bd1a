"""Starting and stopping a server: a router plus local worker processes.

:class:`LocalServer` is what ``radixserve serve`` runs in the foreground, and what tests,
benchmarks and library users run in the background (``with LocalServer(...) as srv:``).
Workers are child processes in their own sessions that also die with their parent; the
router's :class:`~radixserve.serving.router.supervisor.Supervisor` reaps one that exits at once
and starts it again with back-off (``RouterConfig.restart_workers``). On
stop, the router fails what is in flight and tells every worker to shut down; the local
ones also get SIGTERM, which interrupts even a long engine step at once (see
:mod:`radixserve.serving.worker.worker`); they are reaped (SIGKILL after a grace period), and only
then does the router close its worker socket: no orphans, and no goodbye left lingering.
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve.engine.devices import plan_worker_devices
from radixserve.serving.router.router import Router, RouterConfig
from radixserve.serving.router.supervisor import RestartPolicy, Supervisor
from radixserve.serving.router.worker_pool import spawn_worker, worker_command

log = logging.getLogger("radixserve.serving.launcher")


def default_threads_per_worker(num_workers: int) -> int:
    """CPU threads per worker so that workers together use the machine's cores once."""
    return max(1, (os.cpu_count() or 1) // max(1, num_workers))


def stop_processes(procs: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM every live process, wait up to ``grace_s`` for all to exit, then SIGKILL and reap.

    A worker exits within milliseconds of its SIGTERM (it abandons a step in progress), so
    the grace period only matters for one that is stuck; waiting for a message-driven exit
    first would cost a whole engine step when a long prefill is running."""
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.terminate()
            except ProcessLookupError:  # exited between poll() and the signal
                pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        log.warning("worker process %d ignored SIGTERM for %.0f s: killing it", proc.pid, grace_s)
        proc.kill()
    for proc in alive:
        proc.wait()  # SIGKILL cannot be ignored: this reaps it


class LocalServer:
    """A router on ``config.endpoint`` with ``num_workers`` local worker processes.

    ``engine_config`` are EngineConfig fields for every worker (on the CPU, ``num_threads``
    defaults to an even share of the cores). ``worker_program`` replaces
    ``python -m radixserve worker`` (tests use a fake worker). ``context``: the router's ZeroMQ
    context, when an in-process client shares it (then its owner terminates it, not the router).
    ``worker_overrides``: EngineConfig fields for worker i alone (e.g. its disaggregation mode).
    ``tokenizer``: the router's; ``load_tokenizer``: a function that loads it, called once
    the workers are started, so that their start-up and its load overlap (neither: the
    model's, loaded so).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        num_workers: int = 1,
        config: RouterConfig | None = None,
        engine_config: dict[str, Any] | None = None,
        worker_program: list[str] | None = None,
        worker_env: dict[str, str] | None = None,
        tokenizer: Any = None,
        load_tokenizer: Callable[[], Any] | None = None,
        gpu_ids: list[int] | None = None,
        context: Any = None,
        worker_overrides: list[dict[str, Any]] | None = None,
    ) -> None:
        from radixserve.serving.prompts import load_tokenizer as model_tokenizer

        self.model = model
        self.num_workers = num_workers
        engine_config = dict(engine_config or {})
        if worker_program is None and engine_config.get("device", "cpu") == "cpu":
            # Per rank: a tensor/pipeline-parallel worker's ranks share its cores too.
            ranks = int(engine_config.get("tensor_parallel_size", 1)) * int(
                engine_config.get("pipeline_parallel_size", 1)
            )
            engine_config.setdefault("num_threads", default_threads_per_worker(num_workers * ranks))
        # One GPU per worker on CUDA (or an explicit split); refused before anything starts.
        placements = plan_worker_devices(engine_config, num_workers, gpu_ids)
        config = config if config is not None else RouterConfig()
        self.router = Router.bound(config, context=context)
        self.endpoint = self.router.endpoint
        router_endpoint, parent = self.router.worker_endpoint, os.getpid()

        def spawn(worker_id: int) -> subprocess.Popen[bytes]:
            place = placements[worker_id]
            cfg_i = (
                engine_config
                if "device" not in engine_config
                else {**engine_config, "device": place.device}
            )
            if worker_overrides is not None:
                cfg_i = {**cfg_i, **worker_overrides[worker_id]}
            cmd = worker_command(
                router_endpoint,
                worker_id,
                model,
                cfg_i,
                parent_pid=parent,
                heartbeat_timeout_s=max(30.0, config.worker_timeout_s),
                program=worker_program,
            )
            # With CURVE, each local worker gets a key of its own, allowed for as long as the router runs.
            keys = self.router.security.mint("workers", f"local-worker-{worker_id}")
            env = {**(worker_env or {}), **place.env, **(keys.to_env() if keys is not None else {})}
            return spawn_worker(cmd, env or None)

        started = []
        try:
            for i in range(num_workers):  # first: their start-up overlaps the tokenizer's load
                started.append(spawn(i))
            if tokenizer is None:
                tokenizer = (
                    load_tokenizer() if load_tokenizer is not None else model_tokenizer(model)
                )
            self.router.start(tokenizer)
        except BaseException:
            for proc in started:
                proc.kill()
                proc.wait()
            self.router.close_unstarted()
            raise
        policy = RestartPolicy(
            restart=config.restart_workers,
            backoff_s=config.restart_backoff_s,
            backoff_max_s=config.restart_backoff_max_s,
        )
        self.supervisor = Supervisor(spawn, policy)
        self.router.supervise(self.supervisor)
        # Every process ever started, restarts included (the supervisor appends them): all reaped on close.
        self.procs: list[subprocess.Popen[bytes]] = self.supervisor.procs
        for i, proc in enumerate(started):
            self.router.expect_local(i, proc)
        self._thread: threading.Thread | None = None

    def wait_ready(self, timeout_s: float = 300.0) -> bool:
        """Run the router until every local worker joined and its tokenizer processes are
        loaded (True); False if :meth:`Router.stop`
        was called meanwhile (e.g. by a signal); raise if a worker died or time ran out."""
        deadline = time.monotonic() + timeout_s
        pool = self.router.tokenizers
        while len(self.router.live_workers) < self.num_workers or (
            pool is not None and not pool.ready
        ):
            if self.router.stopping:
                self.close()
                return False
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                self.close()
                raise RuntimeError(
                    f"worker process {dead[0].pid} exited with code {dead[0].returncode} at start-up"
                )
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"workers did not join within {timeout_s:.0f} s")
            self.router.run_once(0.05)
        # Start-up's garbage (the tokenizer's pickling, the imports) collected now, while no
        # request waits, rather than by a full collection in the middle of the first ones.
        gc.collect()
        return True

    def run(self) -> None:
        """Serve in this thread until :meth:`Router.stop` (e.g. from a signal handler); then stop all."""
        try:
            self.router.serve()
        finally:
            self._shutdown()

    def start(self, timeout_s: float = 300.0) -> LocalServer:
        """Wait for the workers, then serve from a background thread."""
        self.wait_ready(timeout_s)
        self._thread = threading.Thread(target=self.run, name="radixserve-router", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the router (it shuts the workers down) and reap every worker process."""
        self.router.stop()
        if self._thread is not None:
            self._thread.join(30.0)
            if self._thread.is_alive():  # wedged: its sockets are not ours to touch from here
                log.error("the router thread did not stop within 30 s; stopping the workers only")
                stop_processes(self.procs)
                return
            self._thread = None
        self._shutdown()  # a no-op after the serving thread did it

    def _shutdown(self) -> None:
        # Order matters: fail requests and tell workers first, reap the local workers while
        # the worker socket still takes their goodbyes, close that socket last.
        self.router.shutdown()
        stop_processes(self.procs)
        self.router.close()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
