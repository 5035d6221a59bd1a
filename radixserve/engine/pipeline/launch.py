"""Start the ranks of a pipeline-parallel engine and wire rank 0's engine to them.

The :class:`~radixserve.engine.engine.Engine` is rank 0: it spawns ranks ``1 … tp·pp − 1`` on
this host (``spawn`` start method: no forked torch state), serves the rendezvous store on
``host:port`` (loopback by default), loads stage 0 while the other ranks load theirs, sizes
the KV pool and broadcasts the sizes, so every rank allocates the same pages::

    Engine (rank 0)                          rank r = 1 … world-1 (rank_main)
    listen on host:port, spawn ranks ──────> join the store, gloo group
    load stage 0                             load stage r // tp
    plan pages (smallest stage decides)
    broadcast [pages, rows, cols] ─────────> KVPool, StageRunner
    PipelineRunner.launch(plan) … ─────────> StageRunner.serve(): one forward per plan
    close(): broadcast stop, join ─────────> exit

A rank exits when its parent process does (a watchdog thread), so a killed engine never
leaves ranks behind; a rank that dies makes rank 0's next receive fail instead of hang.
The store and gloo traffic are unauthenticated (torch.distributed's): they bind to ``host``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from radixserve.engine.pipeline.comm import PipelineComm

logger = logging.getLogger(__name__)

# Collectives wait this long: a rank idles in its plan broadcast for as long as the engine has
# nothing to do, so this is no failure detector (a dead peer closes its sockets, which fails
# the wait at once; a dead parent is noticed by the watchdog).
GROUP_TIMEOUT = datetime.timedelta(days=1)
# Every rank must have joined the store within this (a rank that died while starting).
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=300)


class RankSpec(msgspec.Struct, frozen=True):
    """What a spawned rank needs to join (JSON on its command line)."""

    rank: int
    tp: int
    pp: int
    host: str
    port: int
    model_path: str
    engine_config: dict[str, Any]
    parent_pid: int
    num_threads: int


def make_groups(
    store: dist.Store, rank: int, world_size: int, host: str, device: torch.device
) -> tuple[Any, Any]:
    """(cpu group, device group): gloo bound to ``host``; NCCL for the activations on CUDA."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = GROUP_TIMEOUT
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("pp-cpu", store), rank, world_size, opts)
    if device.type != "cuda":
        return cpu, cpu
    nccl_opts = dist.ProcessGroupNCCL.Options()
    nccl_opts._timeout = GROUP_TIMEOUT
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("pp-nccl", store), rank, world_size, nccl_opts)
    return cpu, nccl


def threads_per_rank(world_size: int, num_threads: int | None) -> int:
    """CPU threads each rank uses: the cores shared out, unless the config says."""
    if num_threads is not None:
        return num_threads
    return max(1, (os.cpu_count() or 1) // world_size)


class PipelineLaunch:
    """Rank 0's side of the launch: the child processes and rank 0's :class:`PipelineComm`."""

    def __init__(
        self,
        tp: int,
        pp: int,
        model_path: str,
        engine_config: dict[str, Any],
        device: torch.device,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.tp, self.pp, self.world_size = tp, pp, tp * pp
        self.device = device
        self.procs: list[Any] = []
        store = dist.TCPStore(
            host, port, self.world_size, True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False
        )
        threads = threads_per_rank(self.world_size, engine_config.get("num_threads"))
        for rank in range(1, self.world_size):
            spec = RankSpec(
                rank, tp, pp, host, store.port, model_path, engine_config, os.getpid(), threads
            )
            # A fresh interpreter (not multiprocessing's spawn, which re-imports the caller's
            # __main__): the spec travels as JSON on the command line.
            cmd = [
                sys.executable,
                "-m",
                "radixserve.engine.pipeline.launch",
                msgspec.json.encode(spec).decode(),
            ]
            self.procs.append(subprocess.Popen(cmd))
        try:
            cpu, dev = make_groups(store, 0, self.world_size, host, device)
        except Exception:
            self.terminate()
            raise
        self.store = store
        self.comm = PipelineComm(0, tp, pp, cpu, dev, device)
        from radixserve.memory.sharding import stage_shards
        from radixserve.model.config import ModelConfig

        self.shard = stage_shards(ModelConfig.from_pretrained(model_path).num_layers, tp, pp)[0]
        self._closed = False

    def plan_memory(self, cfg: Any, **kwargs: Any) -> Any:
        """The planner's arguments -> stage 0's device plan with the page count every stage
        affords (:func:`~radixserve.memory.parallel_plan.plan_parallel_memory`)."""
        from radixserve.memory.parallel_plan import plan_parallel_memory

        return plan_parallel_memory(cfg, self.tp, self.pp, **kwargs).stage_plan(0)

    def make_runner(
        self,
        model: torch.nn.Module,
        pool: Any,
        attn: Any,
        sampler: Any,
        num_pages: int,
        max_rows: int,
        max_pages: int,
    ) -> Any:
        """Tell the other ranks the sizes, and build rank 0's :class:`PipelineRunner`."""
        from radixserve.engine.pipeline.runner import PipelineRunner
        from radixserve.model.pipeline_stage import LlamaPipelineStage

        assert isinstance(model, LlamaPipelineStage)
        self.broadcast_sizes(num_pages, max_rows, max_pages)
        return PipelineRunner(
            model, pool, attn, sampler, self.comm, max_rows, max_pages, scratch_page=num_pages
        )

    def close(self, runner: Any) -> None:
        """Stop the other ranks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self.dead_ranks():
                runner.shutdown()
        finally:
            self.join()

    def broadcast_sizes(self, num_pages: int, max_rows: int, max_pages: int) -> None:
        """Tell the other ranks the pool and page-table sizes rank 0 decided."""
        sizes = torch.tensor([num_pages, max_rows, max_pages], dtype=torch.int64)
        self.comm.cpu_group.broadcast([sizes], dist.BroadcastOptions()).wait()

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the ranks to exit (after the stop broadcast); kill any that do not."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.terminate()

    def terminate(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def dead_ranks(self) -> list[int]:
        return [i + 1 for i, p in enumerate(self.procs) if p.poll() is not None]


def start_pipeline(cfg: Any, model_path: Any, config: dict[str, Any]) -> PipelineLaunch | None:
    """Rank 0's launch for an engine config with ``pipeline_parallel_size > 1`` (else None);
    ``config`` is the engine's keyword arguments, which every rank rebuilds its config from."""
    pp = int(cfg.pipeline_parallel_size)
    if pp <= 1:
        return None
    device = torch.device(cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(threads_per_rank(pp, cfg.num_threads))
    return PipelineLaunch(1, pp, str(model_path), dict(config), device)


def _watch_parent(parent_pid: int) -> None:
    """Exit this rank when the engine that spawned it is gone (it was killed, not closed)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)


def rank_main(spec: RankSpec) -> None:
    """A spawned rank: join, load its stage, allocate its pool, run plans until told to stop."""
    from radixserve.engine.config import EngineConfig
    from radixserve.engine.model_runner import make_attention_backend
    from radixserve.engine.pipeline.runner import StageRunner
    from radixserve.memory.pool import KVPool
    from radixserve.memory.sharding import stage_shards
    from radixserve.model.config import ModelConfig
    from radixserve.model.loader import load_model
    from radixserve.model.pipeline_stage import LlamaPipelineStage

    logging.basicConfig(
        level=logging.WARNING, format=f"[rank {spec.rank}] %(levelname)s %(message)s"
    )
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    cfg = EngineConfig.from_kwargs(**spec.engine_config)
    device = torch.device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", spec.rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        cfg = dataclasses.replace(cfg, device=str(device))
    else:
        torch.set_num_threads(spec.num_threads)
    store = dist.TCPStore(
        spec.host, spec.port, spec.tp * spec.pp, False, timeout=RENDEZVOUS_TIMEOUT
    )
    cpu, dev = make_groups(store, spec.rank, spec.tp * spec.pp, spec.host, device)
    comm = PipelineComm(spec.rank, spec.tp, spec.pp, cpu, dev, device)
    mc = ModelConfig.from_pretrained(spec.model_path)
    shard = stage_shards(mc.num_layers, spec.tp, spec.pp)[comm.stage]
    model = load_model(spec.model_path, dtype=cfg.torch_dtype, device=device, shard=shard)
    assert isinstance(model, LlamaPipelineStage)
    sizes = torch.zeros(3, dtype=torch.int64)
    cpu.broadcast([sizes], dist.BroadcastOptions()).wait()
    num_pages, max_rows, max_pages = (int(x) for x in sizes.tolist())
    pool = KVPool(
        num_layers=model.num_local_layers,
        num_pages=num_pages + 1,  # + the scratch page, as on rank 0
        page_size=cfg.page_size,
        kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        kv_dtype=cfg.kv_cache_dtype,
        act_dtype=cfg.torch_dtype,
        device=device,
    )
    attn = make_attention_backend(cfg.resolved_attention_backend, pool)
    StageRunner(model, pool, attn, comm, max_rows, max_pages).serve()


if __name__ == "__main__":
    rank_main(msgspec.json.decode(sys.argv[1], type=RankSpec))
