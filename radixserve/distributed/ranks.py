"""The rank processes of one tensor-parallel worker, on one host or several.

One worker = ``N`` ranks. Rank 0 is the worker itself (the process that holds the Engine, its
scheduler and radix cache, and talks to the router); ranks ``1..N-1`` run :func:`rank_loop`:
receive a step from rank 0 (:class:`~radixserve.distributed.plan_channel.PlanChannel`), execute it
on their shard, repeat, until a ``Shutdown``::

    node 0:  rank 0 (Engine, scheduler)   ranks 1..n-1 (spawned here)
    node k:  ranks k*n .. k*n+n-1         (``--node-rank k``: the first runs in that process)
             all of them meet at --dist-init-addr HOST:PORT (rank 0's TCPStore, bound there)

Start-up: every rank loads its shard; rank 0 sizes the KV pool from its own shard (the
largest) and broadcasts a :class:`~radixserve.distributed.step_wire.RankInit`; every rank builds
the same pool (its own heads) and runner and warms up (the warm-up's collectives keep them in
step); only then does rank 0 start sending steps.

Failure: the model's collectives time out after ``dist_timeout`` seconds (a hung rank), a dead
rank's sockets close at once (its peers' collectives fail within milliseconds); rank 0 watches
its local rank processes and, between steps, pings every rank (:meth:`RankGroup.check`), so an
idle worker notices too; :class:`RankFailure` names the rank. A rank whose rank 0 is gone
sees its broadcast fail and exits; local ranks also die with their parent (``PR_SET_PDEATHSIG``).

The public interface for other layers (the pipeline-parallel stages build on it):
:class:`ParallelConfig`, :func:`rendezvous`, :class:`RankGroup` (rank 0), :func:`run_node`
(``--node-rank`` > 0) and :func:`rank_loop`.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
import torch.distributed as dist

import radixserve.distributed.step_wire as step_wire
from radixserve.distributed.disagg.rank_transfer import answer_write, follower_transfer
from radixserve.distributed.dist_addr import WILDCARDS, split_addr
from radixserve.distributed.plan_channel import PlanChannel
from radixserve.distributed.rank_lora import follow_lora, lead_load, lead_unload
from radixserve.engine.config import EngineConfig
from radixserve.model.parallel import (
    TPGroup,
    listen_socket,
    make_gloo,
    private_store_path,
    rendezvous_store,
)
from radixserve.scheduling.scheduler import StepFailure

if TYPE_CHECKING:
    from radixserve.distributed.disagg.kv_transfer import KVTransfer
    from radixserve.engine.model_runner import ModelRunner
    from radixserve.model.lora import LoraAdapter, LoraRegistry
    from radixserve.model.weight_update import WeightCopy

log = logging.getLogger(__name__)

__all__ = [
    "ParallelConfig",
    "RankFailure",
    "RankGroup",
    "Rendezvous",
    "rank_loop",
    "rendezvous",
    "run_node",
]

# A rank waiting for rank 0's next step waits through the worker's idle time.
IDLE_WAIT = datetime.timedelta(days=30)
# Start-up (spawning, imports, loading shards) on a loaded host can take minutes; the
# collectives' own timeout (dist_timeout) starts only once every rank is ready.
STARTUP_TIMEOUT = datetime.timedelta(minutes=10)


class RankFailure(StepFailure):
    """A tensor-parallel rank died, hung or failed; the worker cannot go on. A
    :class:`StepFailure`: raised from a scheduler hook (the prefill side's KV transfer), the
    step loop fails the step's requests before the engine stops."""


class ParallelConfig(NamedTuple):
    """Where this process stands among one worker's ranks (from :class:`EngineConfig`)."""

    world_size: int
    nnodes: int
    node_rank: int
    host: str
    port: int  # 0: rank 0 picks a free one (single node only)
    timeout: datetime.timedelta
    # One host, no --dist-init-addr: the ranks meet at a file store only this user can
    # open instead of a TCPStore any local process reaches (see rendezvous_store).
    store_path: str | None = None

    @staticmethod
    def from_engine(cfg: EngineConfig) -> ParallelConfig:
        host, port = split_addr(cfg.dist_init_addr or "127.0.0.1:0")
        return ParallelConfig(
            cfg.tensor_parallel_size,
            cfg.nnodes,
            cfg.node_rank,
            host,
            port,
            datetime.timedelta(seconds=cfg.dist_timeout),
        )

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)


def bind_host(pc: ParallelConfig) -> str:
    """The local address this rank's gloo sockets listen on: the rendezvous host on node 0, the
    local address that routes to it elsewhere (never every interface)."""
    if pc.node_rank == 0 and pc.host not in WILDCARDS:
        return pc.host
    if pc.host in WILDCARDS:
        return socket.gethostname()
    with socket.socket(
        socket.AF_INET6 if ":" in pc.host else socket.AF_INET, socket.SOCK_DGRAM
    ) as s:
        s.connect((pc.host, pc.port or 9))  # UDP: no packet is sent, only a route chosen
        return s.getsockname()[0]


class Rendezvous(NamedTuple):
    """One rank's groups: the model's collectives and the step channel from rank 0."""

    tp: TPGroup
    channel: PlanChannel
    store: dist.Store


def rendezvous(
    pc: ParallelConfig, rank: int, device: torch.device, listen: socket.socket | None = None
) -> Rendezvous:
    """Meet the other ranks at ``pc``'s address (rank 0 serves the store on ``listen``)."""
    store = rendezvous_store(
        pc.host, pc.port, rank, pc.world_size, STARTUP_TIMEOUT, listen, pc.store_path
    )
    host = bind_host(pc)
    tp = TPGroup.create(
        dist.PrefixStore("tp", store),
        rank,
        pc.world_size,
        device,
        pc.timeout,
        host,
        connect_timeout=STARTUP_TIMEOUT,
    )
    plan_backend = make_gloo(dist.PrefixStore("plan", store), rank, pc.world_size, IDLE_WAIT, host)
    return Rendezvous(tp, PlanChannel(plan_backend, rank, pc.timeout, IDLE_WAIT), store)


def private_rendezvous(pc: ParallelConfig, cfg: EngineConfig) -> ParallelConfig:
    """``pc`` with a private file store when every rank runs on this host and no
    ``--dist-init-addr`` was given: rank 0 makes it before it starts the others."""
    if pc.nnodes == 1 and cfg.dist_init_addr is None:
        return pc._replace(store_path=private_store_path())
    return pc


def remove_private_store(pc: ParallelConfig) -> None:
    """Remove the directory of ``pc``'s private store, if it has one (rank 0, at close)."""
    if pc.store_path is not None:
        shutil.rmtree(os.path.dirname(pc.store_path), ignore_errors=True)


def rank_device(device: str, local_rank: int) -> torch.device:
    """``cuda`` / ``cuda:B`` -> ``cuda:B+local_rank``; the CPU stays the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + local_rank)


def rank_threads(cfg: EngineConfig, pc: ParallelConfig) -> int | None:
    """CPU threads per rank: the asked number, else this host's cores shared by its ranks."""
    if cfg.num_threads is not None or torch.device(cfg.device).type != "cpu":
        return cfg.num_threads
    return max(1, (os.cpu_count() or 1) // pc.ranks_per_node)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: a dead rank 0 still ends the broadcast this rank waits in


def rank_loop(cfg: EngineConfig, model_path: str | Path, rank: int, pc: ParallelConfig) -> None:
    """Run rank ``rank`` (not 0) until rank 0 says ``Shutdown``: load the shard, build the
    pool rank 0 sized, warm up, then execute every step rank 0 sends. A start-up failure is
    also written to the store, where rank 0 reads it at once (the rank may be on another host)."""
    device = rank_device(cfg.device, rank - pc.local_ranks.start)
    threads = rank_threads(cfg, pc)
    if device.type == "cpu" and threads is not None:
        torch.set_num_threads(threads)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    rv = rendezvous(pc, rank, device)
    try:
        runner, init = _build_rank(cfg, model_path, rank, rv, device)
        # Prefill/decode disaggregation: this rank's pool registered, its address published.
        kv = follower_transfer(cfg, runner.pool, runner.model, rv.store, rank)
    except Exception as exc:
        rv.store.set(f"failed/{rank}", f"tensor-parallel rank {rank} failed to start: {exc}")
        raise
    rv.store.set(f"ready/{rank}", "1")  # rank 0 starts its warm-up (collectives) after this
    runner.warm_up(init.max_total_len, max_step_tokens=cfg.max_num_tokens)
    log.info("rank %d ready (%s)", rank, device)
    try:
        _serve_steps(runner, rv, rank, device, kv, cfg)
    finally:
        if kv is not None:
            kv.close()


def _serve_steps(
    runner: ModelRunner,
    rv: Rendezvous,
    rank: int,
    device: torch.device,
    kv: KVTransfer | None,
    cfg: EngineConfig,
) -> None:
    """Execute rank 0's messages until its ``Shutdown``."""
    while True:
        msg = rv.channel.recv()
        if isinstance(msg, step_wire.Shutdown):
            return
        if isinstance(msg, step_wire.StepMessage):
            runner.launch_message(msg).result()
        elif isinstance(msg, step_wire.Ping):
            rv.tp.all_reduce(torch.zeros(1, device=device))
        elif isinstance(msg, step_wire.Audit):
            rv.tp.all_gather(state_digest(runner))
        elif isinstance(msg, step_wire.KVWrite):
            answer_write(kv, msg, rank, rv.tp.all_gather, device)
        elif isinstance(msg, step_wire.UpdateWeights):
            _take_weights(runner, msg.path, cfg, rv, device)
        elif isinstance(msg, (step_wire.LoadLora, step_wire.UnloadLora)):
            lora = cast("LoraRegistry", runner.model.lora)  # lora_enabled: rank 0 checked
            follow_lora(lora, msg, partial(_all_agree, rv.tp, device=device))


def _rank_load_args(cfg: EngineConfig, rv: Rendezvous, device: torch.device) -> dict[str, Any]:
    """``load_model``'s arguments for this rank's shard: at start-up and for every update."""
    return {
        "dtype": cfg.torch_dtype,
        "device": device,
        "quantization": cfg.quant_config(),
        "tp": rv.tp,
        "expert_parallel": cfg.expert_parallel,
    }


def _take_weights(
    runner: ModelRunner, path: str, cfg: EngineConfig, rv: Rendezvous, device: torch.device
) -> None:
    """This rank's part of :meth:`RankGroup.replace_weights`."""
    from radixserve.model.weight_update import follow_update, load_weights_for

    def prepare() -> WeightCopy:
        return load_weights_for(runner.model, path, **_rank_load_args(cfg, rv, device))

    agree = partial(_all_agree, rv.tp, device=device)
    follow_update(prepare, agree, f"rank refuses the weights at {path}")


def _all_agree(tp: Any, ok: bool, *, device: torch.device) -> bool:
    """Whether every rank of ``tp`` says ``ok`` (one all-gather)."""
    votes = tp.all_gather(torch.tensor([1 if ok else 0], device=device))
    return all(int(v.item()) == 1 for v in votes)


def _build_rank(
    cfg: EngineConfig, model_path: str | Path, rank: int, rv: Rendezvous, device: torch.device
) -> tuple[ModelRunner, step_wire.RankInit]:
    """Load the shard, take rank 0's start-up message, build the same pool and runner."""
    from radixserve.engine.model_runner import ModelRunner, kv_pool_args
    from radixserve.memory.pool import KVPool
    from radixserve.model.loader import load_model

    model = load_model(model_path, announce=False, **_rank_load_args(cfg, rv, device))
    if cfg.lora_enabled:  # the start-up adapters, in rank 0's order: the same slots
        model.serve_lora(cfg.lora_paths, cfg.max_lora_rank, cfg.max_loaded_loras)
    init = rv.channel.recv()
    if not isinstance(init, step_wire.RankInit):
        raise RankFailure(f"expected the start-up message, got {type(init).__name__}")
    mine = step_wire.rank_settings(cfg)
    if init.settings != mine:
        diff = [f"{a} (rank 0) vs {b}" for a, b in zip(init.settings, mine) if a != b]
        raise RankFailure(f"settings differ from rank 0's: {', '.join(diff)}")
    pool_args = kv_pool_args(model, cfg, device)
    if init.window_layers:  # rank 0's window pool: the map arrives with each step
        pool_args["window_layers"] = frozenset(init.window_layers)
        pool_args["num_window_pages"] = init.num_window_pages
    pool = KVPool(num_pages=init.num_pages, **pool_args)
    runner = ModelRunner.from_config(
        model, pool, cfg, init.max_rows, init.max_pages, init.scratch_page
    )
    if init.window_layers:
        runner.use_window_pool(init.window)
    return runner, init


def _weighted_sums(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``'s sum and position-weighted sum (int64): equal tables give equal sums."""
    t = t.to(torch.int64)
    weights = torch.arange(1, t.numel() + 1, device=t.device).view_as(t)
    return [t.sum(), (t * weights).sum()]


def state_digest(runner: ModelRunner) -> torch.Tensor:
    """What every rank must agree on after the same plans, as an int64 tensor: its pool's
    page count and page table; with a window pool, its window page count, how many global
    pages map a window page (not the scratch page) and the window map itself."""
    dev = runner.page_table.device
    parts = [torch.tensor(runner.pool.num_pages, device=dev), *_weighted_sums(runner.page_table)]
    wmap = runner.window_map
    if wmap is not None:
        scratch = runner.pool.num_window_pages - 1
        parts += [
            torch.tensor(runner.pool.num_window_pages, device=dev),
            (wmap != scratch).sum().to(torch.int64),
            *_weighted_sums(wmap),
        ]
    return torch.stack(parts)


def _rank_main(cfg: EngineConfig, model_path: str, rank: int, pc: ParallelConfig) -> None:
    """Entry point of a spawned rank process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(message)s")
    try:
        rank_loop(cfg, model_path, rank, pc)
    except Exception as exc:  # say which rank and why, then leave with an error code
        log.error("tensor-parallel rank %d failed: %s", rank, exc)
        os._exit(1)
    os._exit(0)


def spawn_ranks(
    cfg: EngineConfig, model_path: str, pc: ParallelConfig, ranks: range
) -> dict[int, mp.process.BaseProcess]:
    """Start ``ranks`` as processes of this host (spawned: no forked torch state)."""
    ctx = mp.get_context("spawn")
    procs: dict[int, mp.process.BaseProcess] = {}
    for r in ranks:
        proc = ctx.Process(
            target=_rank_main,
            args=(cfg, model_path, r, pc),
            name=f"radixserve-rank-{r}",
            daemon=True,
        )
        proc.start()
        procs[r] = proc
    return procs


def stop_ranks(procs: dict[int, mp.process.BaseProcess], timeout: float = 10.0) -> None:
    """Join ``procs`` (they were told to stop), killing any still there after ``timeout``."""
    if not procs:  # wait() on no objects sleeps the whole timeout
        return
    wait([p.sentinel for p in procs.values()], timeout)
    for p in procs.values():
        if p.is_alive():
            p.kill()
        p.join(timeout=5)


class RankGroup:
    """Rank 0's side of a tensor-parallel worker: the groups, the local rank processes, the
    start-up message, the health checks and the shutdown."""

    def __init__(self, cfg: EngineConfig, model_path: str | Path) -> None:
        """Start this host's other ranks and meet every rank (rank 0 serves the rendezvous)."""
        self.pc = pc = private_rendezvous(ParallelConfig.from_engine(cfg), cfg)
        listen = None
        if pc.store_path is None:
            listen = listen_socket(pc.host, pc.port)  # bound before the ranks start: no race
            if pc.port == 0:
                pc = self.pc = pc._replace(port=listen.getsockname()[1])
        self.procs = spawn_ranks(cfg, str(model_path), pc, range(1, pc.ranks_per_node))
        self.device = rank_device(cfg.device, 0)
        self._closed = False
        self.failed = False  # a collective failed: the ranks are out of step for good
        try:
            self.rv = rendezvous(pc, 0, self.device, listen)
        except Exception as exc:
            self.close()
            raise self.explain(exc) from exc
        self.tp = self.rv.tp
        self.channel = self.rv.channel

    @property
    def world_size(self) -> int:
        return self.pc.world_size

    def start(self, init: step_wire.RankInit) -> None:
        """Tell every rank the pool and runner shape rank 0 decided, and wait until each has
        built them (its warm-up's collectives then meet rank 0's)."""
        self.channel.send(init)
        keys = [f"ready/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        while True:
            dead = self.dead_ranks()
            if dead:
                raise RankFailure("; ".join(dead))
            for r in range(1, self.world_size):  # a rank on any host that failed to start
                if self.rv.store.check([f"failed/{r}"]):
                    self.failed = True
                    raise RankFailure(self.rv.store.get(f"failed/{r}").decode())
            if self.rv.store.check(keys):
                return
            if time.monotonic() > deadline:
                raise RankFailure("tensor-parallel ranks not ready in time")
            # Wake at once if a local rank dies, else look at the store again shortly.
            wait([p.sentinel for p in self.procs.values()], 0.05)

    def dead_ranks(self) -> list[str]:
        """This host's rank processes that have exited, in words."""
        return [
            f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}"
            for r, p in self.procs.items()
            if not p.is_alive()
        ]

    def explain(self, exc: BaseException) -> RankFailure:
        """A :class:`RankFailure` for a failed collective: which local rank died, when one
        did (waiting briefly: its exit and our failed socket race), else the error itself
        (a remote rank: gloo names its address; a hang: the timeout)."""
        self.failed = True
        wait([p.sentinel for p in self.procs.values()], 1.0 if self.procs else 0)
        dead = self.dead_ranks()
        if dead:
            return RankFailure("; ".join(dead))
        return RankFailure(f"tensor-parallel collective failed: {exc}")

    def check(self) -> None:
        """Between steps: raise :class:`RankFailure` when a local rank has exited, or when
        a ping (one broadcast and one all-reduce) to every rank fails or times out."""
        dead = self.dead_ranks()
        if dead:
            self.failed = True
            raise RankFailure("; ".join(dead))
        try:
            self.channel.send(step_wire.Ping())
            self.tp.all_reduce(torch.zeros(1, device=self.device))
        except Exception as exc:
            raise self.explain(exc) from exc

    def replace_weights(self, path: str, prepare: Callable[[], WeightCopy]) -> int:
        """New weights on every rank, all or none: each rank loads and checks its share
        (``prepare``, rank 0's), all agree, then each copies; rank 0's bytes copied.
        ``ValueError`` (no rank changed) where any rank could not."""
        from radixserve.model.weight_update import lead_update

        self.channel.send(step_wire.UpdateWeights(path))
        agree = partial(_all_agree, self.tp, device=self.device)
        return lead_update(prepare, agree, "tensor-parallel")

    def serve_lora(self, registry: LoraRegistry, adapter: LoraAdapter) -> LoraAdapter:
        """Serve ``adapter`` (rank 0's share, read) on every rank or none (:mod:`.rank_lora`)."""
        agree = partial(_all_agree, self.tp, device=self.device)
        return lead_load(registry, adapter, self.channel.send, agree)

    def unload_lora(self, registry: LoraRegistry, name: str) -> None:
        """Stop serving adapter ``name`` to new requests on every rank."""
        lead_unload(registry, name, self.channel.send)

    def audit(self, runner: ModelRunner) -> list[list[int]]:
        """Assert that every rank holds the same pool size, page table and window map as
        rank 0's ``runner``; returns every rank's :func:`state_digest`, rank 0's first."""
        self.channel.send(step_wire.Audit())
        digests = [d.tolist() for d in self.tp.all_gather(state_digest(runner))]
        assert all(d == digests[0] for d in digests), f"ranks disagree on KV state: {digests}"
        return digests

    def close(self, reason: str = "worker stopping") -> None:
        """Tell the ranks to stop, wait for this host's, kill what is left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.failed:  # the ranks are out of step (or hung): no message, no grace period
            stop_ranks(self.procs, timeout=0.0)
        else:
            if hasattr(self, "channel"):
                try:
                    self.channel.send(step_wire.Shutdown(reason))
                except Exception:  # a rank is already gone: the others see their broadcast fail
                    log.debug("shutdown broadcast failed", exc_info=True)
            stop_ranks(self.procs)
        remove_private_store(self.pc)


def run_node(cfg: EngineConfig, model_path: str | Path) -> int:
    """``--node-rank`` > 0: run this host's ranks of the worker until rank 0 stops them (no
    router connection: rank 0's node is the worker). Returns the exit code (non-zero when a
    rank failed)."""
    pc = ParallelConfig.from_engine(cfg)
    if pc.node_rank == 0:
        raise ValueError("run_node is for --node-rank > 0; node 0 runs the worker itself")
    first, *others = pc.local_ranks
    procs = spawn_ranks(cfg, str(model_path), pc, range(first + 1, first + 1 + len(others)))
    code = 0
    try:
        rank_loop(cfg, model_path, first, pc)
    except Exception as exc:
        log.error("tensor-parallel rank %d failed: %s", first, exc)
        code = 1
    finally:
        stop_ranks(procs, timeout=30.0)
    bad = [r for r, p in procs.items() if p.exitcode]
    return 1 if (code or bad) else 0
