"""Start the ranks of a pipeline-parallel engine (each stage a tensor-parallel group) and wire
rank 0's engine to them. Built on :mod:`radixserve.distributed.ranks` (its rendezvous store bound to
the given address, gloo groups, the TP group, rank threads and devices, :class:`RankFailure`).

The :class:`~radixserve.engine.engine.Engine` is rank 0: it spawns ranks ``1 … tp·pp − 1`` on
this host, serves the rendezvous store, loads stage 0 while the other ranks load theirs, sizes
the KV pool and broadcasts the sizes, so every rank allocates the same pages::

    Engine (rank 0)                          rank r = 1 … world-1 (rank_main)
    listen on host:port, spawn ranks ──────> join the store: world gloo group (plans, P2P),
                                             its stage's TP group (ranks s·tp … s·tp+tp−1)
    load stage 0 (its TP share)              load stage r // tp (its TP share)
    plan pages (smallest stage decides)
    broadcast [pages, rows, cols] ─────────> KVPool, StageRunner
    warm-up plans ─────────────────────────> StageRunner.serve(): one forward per plan
    close(): broadcast stop, join ─────────> exit

The ranks are fresh interpreters (``python -m radixserve.distributed.pipeline.launch SPEC``), which
never re-import the caller's ``__main__``; they die with their parent (``PR_SET_PDEATHSIG``)
and, when rank 0 goes away, see their broadcast fail. A rank that dies makes rank 0's next
transfer fail (:class:`RankFailure` naming it); one that hangs, its receive time out after
``dist_timeout``. Pipeline ranks run on one host (``--nnodes`` is for tensor parallelism).
"""

from __future__ import annotations

import datetime
import logging
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import torch
import torch.distributed as dist

from radixserve.distributed.pipeline.comm import PipelineComm
from radixserve.distributed.ranks import (
    IDLE_WAIT,
    STARTUP_TIMEOUT,
    ParallelConfig,
    RankFailure,
    bind_host,
    private_rendezvous,
    rank_device,
    rank_threads,
    remove_private_store,
)
from radixserve.engine.config import EngineConfig
from radixserve.memory.sharding import DeviceShard, stage_shards
from radixserve.model.parallel import TPGroup, listen_socket, make_gloo, rendezvous_store

logger = logging.getLogger(__name__)

__all__ = ["PipelineLaunch", "RankSpec", "rank_main"]


class RankSpec(msgspec.Struct, frozen=True):
    """What a spawned rank needs to join (JSON on its command line)."""

    rank: int
    tp: int
    pp: int
    host: str
    port: int
    model_path: str
    engine_config: dict[str, Any]
    store_path: str | None = None  # rank 0's private file store (one host), else host:port


class StageGroups(NamedTuple):
    """One rank's groups: the world's (plans, activations), its stage's TP group."""

    comm: PipelineComm
    tp: TPGroup | None
    store: Any


def join_groups(
    pc: ParallelConfig, rank: int, tp: int, pp: int, device: torch.device, listen: Any = None
) -> StageGroups:
    """Meet the other ranks at ``pc``'s address: the world's gloo group (plans and, on the CPU,
    activations; NCCL for the activations on CUDA) and this rank's stage TP group."""
    world = tp * pp
    store = rendezvous_store(pc.host, pc.port, rank, world, STARTUP_TIMEOUT, listen, pc.store_path)
    host = bind_host(pc)
    cpu = make_gloo(dist.PrefixStore("pp", store), rank, world, IDLE_WAIT, host)
    dev: Any = cpu
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = IDLE_WAIT
        dev = dist.ProcessGroupNCCL(dist.PrefixStore("pp-nccl", store), rank, world, opts)
    stage, tp_rank = divmod(rank, tp)
    tp_group = None
    if tp > 1:
        tp_store = dist.PrefixStore(f"tp{stage}", store)
        tp_group = TPGroup.create(tp_store, tp_rank, tp, device, pc.timeout, host)
    comm = PipelineComm(rank, tp, pp, cpu, dev, device, step_timeout=pc.timeout)
    return StageGroups(comm, tp_group, store)


def stage_of(model_path: str | Path, tp: int, pp: int, rank: int) -> DeviceShard:
    from radixserve.model.config import ModelConfig

    num_layers = ModelConfig.from_pretrained(model_path).num_layers
    return stage_shards(num_layers, tp, pp)[rank // tp]


class PipelineLaunch:
    """Rank 0's side: the rank processes, rank 0's groups, its stage, start-up and shutdown."""

    def __init__(
        self, cfg: EngineConfig, model_path: str | Path, engine_kwargs: dict[str, Any]
    ) -> None:
        self.tp, self.pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
        world = self.tp * self.pp
        pc = private_rendezvous(ParallelConfig.from_engine(cfg)._replace(world_size=world), cfg)
        listen = None
        if pc.store_path is None:
            listen = listen_socket(pc.host, pc.port)  # bound before the ranks start: no race
            pc = pc._replace(port=listen.getsockname()[1])
        self.pc = pc
        self.device = rank_device(cfg.device, 0)
        self.stage = stage_of(model_path, self.tp, self.pp, 0)
        self.runner: Any = None  # rank 0's PipelineRunner, once make_runner built it
        self._closed = False
        self.failed = False  # a transfer failed: the ranks are out of step (or hung) for good
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for rank in range(1, world):
            spec = RankSpec(
                rank,
                self.tp,
                self.pp,
                pc.host,
                pc.port,
                str(model_path),
                engine_kwargs,
                pc.store_path,
            )
            cmd = [sys.executable, "-m", __name__, msgspec.json.encode(spec).decode()]
            self.procs[rank] = subprocess.Popen(cmd)
        try:
            groups = join_groups(pc, 0, self.tp, self.pp, self.device, listen)
        except Exception as exc:
            self.close(None)
            raise self.explain(exc) from exc
        self.comm, self.tp_group, self.store = groups.comm, groups.tp, groups.store

    @staticmethod
    def from_config(
        cfg: EngineConfig, model_path: str | Path, engine_kwargs: dict[str, Any]
    ) -> PipelineLaunch:
        if cfg.nnodes != 1:
            raise ValueError("pipeline parallelism runs its ranks on one host (nnodes 1)")
        return PipelineLaunch(cfg, model_path, engine_kwargs)

    def plan_memory(self, cfg: Any, **kwargs: Any) -> Any:
        """The planner's arguments -> stage 0's device plan with the page count every stage
        affords (:func:`~radixserve.memory.parallel_plan.plan_parallel_memory`)."""
        from radixserve.memory.parallel_plan import plan_parallel_memory

        return plan_parallel_memory(cfg, self.tp, self.pp, **kwargs).stage_plan(0)

    def make_runner(
        self,
        model: torch.nn.Module,
        pool: Any,
        cfg: EngineConfig,
        num_pages: int,
        max_rows: int,
        max_pages: int,
    ) -> Any:
        """Tell the other ranks the sizes; rank 0's :class:`PipelineRunner` with the configured
        attention backend and sampler (its warm-up runs on every rank, so the engine is ready
        only when all of them are)."""
        from radixserve.distributed.pipeline.runner import PipelineRunner
        from radixserve.engine.model_runner import make_attention_backend
        from radixserve.engine.sampler import Sampler
        from radixserve.model.pipeline_stage import LlamaPipelineStage

        assert isinstance(model, LlamaPipelineStage)
        mc = model.full_config
        attn = make_attention_backend(cfg.resolved_attention_backend, pool)
        sampler = Sampler(mc.vocab_size, mc.eos_token_ids, pool.device, cfg.seed)
        sizes = torch.tensor([num_pages, max_rows, max_pages], dtype=torch.int64)
        try:
            self.comm.cpu_group.broadcast([sizes], dist.BroadcastOptions()).wait()
        except Exception as exc:
            raise self.explain(exc) from exc
        self._wait_ready()
        self.runner = PipelineRunner(
            model,
            pool,
            attn,
            sampler,
            self.comm,
            max_rows,
            max_pages,
            scratch_page=num_pages,
            micro_batches=cfg.pipeline_micro_batches,
            check_ranks=self.check,
        )
        return self.runner

    def _wait_ready(self) -> None:
        """Wait until every rank has built its pool and runner (the start-up may take minutes
        on a loaded host; each step's ``dist_timeout`` applies only from then on)."""
        keys = [f"pp-ready/{r}" for r in self.procs]
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        while True:
            self.check()
            try:
                self.store.wait(keys, datetime.timedelta(seconds=1))
                return
            except Exception as exc:  # not all ready yet: check the processes again
                if time.monotonic() > deadline:
                    raise RankFailure(f"pipeline ranks not ready in time: {exc}") from exc

    def dead_ranks(self) -> list[str]:
        return [
            f"pipeline rank {r} (pid {p.pid}) exited with code {p.returncode}"
            for r, p in self.procs.items()
            if p.poll() is not None
        ]

    def explain(self, exc: BaseException) -> RankFailure:
        """A :class:`RankFailure` naming the rank that died (waiting briefly for its exit),
        else the failed transfer itself."""
        self.failed = True
        deadline = time.monotonic() + 1.0
        while not self.dead_ranks() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = self.dead_ranks()
        return RankFailure("; ".join(dead) if dead else f"pipeline transfer failed: {exc}")

    def check(self) -> None:
        """Between steps: :class:`RankFailure` when a rank process has exited."""
        dead = self.dead_ranks()
        if dead:
            raise RankFailure("; ".join(dead))

    def close(self, runner: Any) -> None:
        """Tell the ranks to stop (when they can still hear it), wait, kill what is left;
        after a failed transfer, kill them at once (a hung rank would only use up the grace
        period, and the others cannot step again)."""
        if self._closed:
            return
        self._closed = True
        if runner is not None and not self.failed and not self.dead_ranks():
            try:
                runner.shutdown()
            except Exception:  # a rank is gone: the others see their broadcast fail
                logger.debug("pipeline shutdown broadcast failed", exc_info=True)
        deadline = time.monotonic() + (0.0 if self.failed else 10.0)
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        remove_private_store(self.pc)


def rank_main(spec: RankSpec) -> None:
    """A spawned rank: join, load its stage, allocate its pool, run plans until told to stop."""
    from radixserve.distributed.pipeline.runner import StageRunner
    from radixserve.distributed.ranks import _die_with_parent
    from radixserve.engine.model_runner import kv_pool_args, make_attention_backend
    from radixserve.memory.pool import KVPool
    from radixserve.model.loader import load_model
    from radixserve.model.pipeline_stage import LlamaPipelineStage

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    logging.basicConfig(
        level=logging.WARNING, format=f"[rank {spec.rank}] %(levelname)s %(message)s"
    )
    cfg = EngineConfig.from_kwargs(**spec.engine_config)
    pc = ParallelConfig.from_engine(cfg)._replace(
        world_size=spec.tp * spec.pp, host=spec.host, port=spec.port, store_path=spec.store_path
    )
    device = rank_device(cfg.device, spec.rank)
    threads = rank_threads(cfg, pc)
    if device.type == "cpu" and threads is not None:
        torch.set_num_threads(threads)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    groups = join_groups(pc, spec.rank, spec.tp, spec.pp, device)
    stage = stage_of(spec.model_path, spec.tp, spec.pp, spec.rank)
    model = load_model(
        spec.model_path, dtype=cfg.torch_dtype, device=device, tp=groups.tp, stage=stage
    )
    assert isinstance(model, LlamaPipelineStage)
    sizes = torch.zeros(3, dtype=torch.int64)
    groups.comm.cpu_group.broadcast([sizes], dist.BroadcastOptions()).wait()
    num_pages, max_rows, max_pages = (int(x) for x in sizes.tolist())
    # + the scratch page, as on rank 0
    pool = KVPool(num_pages=num_pages + 1, **kv_pool_args(model, cfg, device))
    attn = make_attention_backend(cfg.resolved_attention_backend, pool)
    micro = cfg.pipeline_micro_batches
    runner = StageRunner(model, pool, attn, groups.comm, max_rows, max_pages, micro_batches=micro)
    groups.store.set(f"pp-ready/{spec.rank}", "1")  # rank 0 starts the warm-up after this
    runner.serve(partial(_stage_weights, model, spec, cfg, device, groups.tp, stage))


def _stage_weights(
    model: Any,
    spec: RankSpec,
    cfg: EngineConfig,
    device: torch.device,
    tp: TPGroup | None,
    stage: DeviceShard,
    path: str,
) -> Any:
    """This rank's share of checkpoint ``path``, loaded as its stage was and checked
    against it (a weight update: PipelineRunner.replace_weights)."""
    from radixserve.model.weight_update import load_weights_for

    return load_weights_for(model, path, dtype=cfg.torch_dtype, device=device, tp=tp, stage=stage)


if __name__ == "__main__":
    try:
        rank_main(msgspec.json.decode(sys.argv[1], type=RankSpec))
    except Exception as exc:  # say which rank and why, then leave with an error code
        logging.getLogger(__name__).error("pipeline rank failed: %s", exc)
        sys.exit(1)
