"""Where one engine runs: one process, a tensor-parallel group, or pipeline stages of them.

The :class:`~radixserve.engine.engine.Engine` builds every topology the same way, in one
path, and asks its :class:`Topology` at each point where they differ::

    make_topology(cfg) ──> device, threads, load_args   (before the weights: other ranks load theirs)
                           plan_memory                   (the KV pool's size: this rank's, or every stage's)
                           make_runner                   (rank 0's runner; a pipeline's tells the stages the sizes)
                           start                         (the other ranks build the same pool and runner)
                           warmed_up                     (from now on each step goes to every rank)
                           on_step_error, check, audit   (a rank died or hung; every rank agrees)
                           rank_link                     (disaggregation: every rank's KV transfer)
                           close                         (stop the other ranks)

:class:`Topology` itself is one process: nothing to start, check or stop.
:class:`TensorParallel` holds a :class:`~radixserve.distributed.ranks.RankGroup`,
:class:`PipelineParallel` a :class:`~radixserve.distributed.pipeline.launch.PipelineLaunch`.
No other module tests ``tensor_parallel_size`` or ``pipeline_parallel_size`` to decide how
to build or drive an engine (``tests/distributed/test_topology.py`` checks).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import torch

from radixserve.distributed.disagg.group_link import GroupLink
from radixserve.distributed.disagg.rank_transfer import RankLink
from radixserve.distributed.ranks import RankGroup, rank_threads
from radixserve.distributed.step_wire import RankInit, rank_settings
from radixserve.engine.config import EngineConfig
from radixserve.engine.model_runner import ModelRunner
from radixserve.engine.window_setup import WindowPoolPlan
from radixserve.memory.planner import MemoryPlan, plan_memory

if TYPE_CHECKING:
    from radixserve.distributed.pipeline.launch import PipelineLaunch
    from radixserve.engine.startup import StartupClock
    from radixserve.memory.pool import KVPool
    from radixserve.model.lora import LoraAdapter, LoraRegistry

__all__ = [
    "PipelineParallel",
    "RunnerShape",
    "TensorParallel",
    "Topology",
    "make_topology",
]


class RunnerShape(NamedTuple):
    """What rank 0 decided and every rank builds the same: the pool's pages (the scratch
    page not counted), the runner's rows and page-table columns, the longest sequence, and
    the window pool of a sliding-window model (None: every layer keeps full KV)."""

    num_pages: int
    max_rows: int
    max_pages: int
    max_total_len: int
    window: WindowPoolPlan | None = None


class Topology:
    """One process holds the whole model (the base of the parallel topologies)."""

    #: More than one rank: the planner sizes the pool (a profile run would need every rank).
    parallel = False
    #: Every rank gets the window map's changes with each step's plan, so a sliding-window
    #: model may keep its window layers' KV in a window pool (engine.window_setup).
    carries_window_map = True
    #: Rank 0's forward ends in the final norm, whose output at a prompt's last token is the
    #: prompt's embedding (return_embedding); a pipeline's rank 0 runs the first stage only.
    holds_final_norm = True

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg

    @property
    def device(self) -> torch.device:
        return torch.device(self.cfg.device)

    def threads(self) -> int | None:
        """The CPU threads this rank uses (``None``: torch's default)."""
        return self.cfg.num_threads

    def load_args(self) -> dict[str, Any]:
        """``load_model``'s arguments for this rank's share: its TP group, its stage."""
        return {"tp": None, "stage": None}

    def plan_memory(self, model: Any, **kwargs: Any) -> MemoryPlan:
        """The memory planner's plan for this rank's share of ``model``."""
        return plan_memory(model.local_config, **kwargs)

    def make_runner(self, model: Any, pool: KVPool, shape: RunnerShape) -> ModelRunner:
        """Rank 0's runner over ``pool`` (one page past the allocator's: the scratch page)."""
        return ModelRunner.from_config(
            model,
            pool,
            self.cfg,
            max_rows=shape.max_rows,
            max_pages=shape.max_pages,
            scratch_page=shape.num_pages,
        )

    def start(self, shape: RunnerShape, clock: StartupClock) -> None:
        """Before rank 0's warm-up: the other ranks build their pool and runner."""

    def warmed_up(self, runner: ModelRunner) -> None:
        """After rank 0's warm-up: wire the runner to the other ranks."""

    @property
    def on_step_error(self) -> Callable[[Exception], NoReturn] | None:
        """What a failed step raises (``None``: the step loop's own handling)."""
        return None

    def check(self) -> None:
        """Between steps, while idle: raise ``RankFailure`` when a rank died or hangs."""

    def audit(self, runner: ModelRunner) -> None:
        """Assert that every rank holds the same KV state as ``runner``."""

    def rank_link(self) -> RankLink | None:
        """Rank 0's line to the other ranks' KV transfers (disaggregation); None: no others."""
        return None

    def replace_weights(self, model: Any, path: Path, load_args: dict[str, Any]) -> int:
        """Load checkpoint ``path`` as ``model`` was (``load_args`` with this rank's share)
        and copy it into ``model`` in place (:mod:`~radixserve.model.weight_update`); the
        bytes copied. ``ValueError``, with nothing changed, where it does not fit."""
        from radixserve.model.weight_update import load_weights_for

        return load_weights_for(model, path, **load_args, **self.load_args()).apply()

    def serve_lora(self, registry: LoraRegistry, adapter: LoraAdapter) -> LoraAdapter:
        """Serve ``adapter`` (read for this rank) from the next step on, on every rank or
        none; ``ValueError``, nothing changed, where any rank refuses it."""
        return registry.serve(adapter)

    def unload_lora(self, registry: LoraRegistry, name: str) -> None:
        """Adapter ``name`` takes no new request, on every rank (its slot drains)."""
        registry.remove(name)

    def close(self, runner: ModelRunner | None) -> None:
        """Stop the other ranks. Idempotent."""


class TensorParallel(Topology):
    """Rank 0 of ``tensor_parallel_size`` ranks (on ``nnodes`` hosts): each step's plan goes
    to every rank, which runs the same device half over its own heads."""

    parallel = True

    def __init__(self, cfg: EngineConfig, model_path: str | Path) -> None:
        super().__init__(cfg)
        self.ranks = RankGroup(cfg, model_path)

    @property
    def device(self) -> torch.device:
        return self.ranks.device

    def threads(self) -> int | None:
        return rank_threads(self.cfg, self.ranks.pc)

    def load_args(self) -> dict[str, Any]:
        return {"tp": self.ranks.tp, "stage": None, "expert_parallel": self.cfg.expert_parallel}

    def start(self, shape: RunnerShape, clock: StartupClock) -> None:
        wp = shape.window
        self.ranks.start(
            RankInit(
                shape.num_pages + 1,
                shape.max_rows,
                shape.max_pages,
                shape.num_pages,
                shape.max_total_len,
                rank_settings(self.cfg),
                window_layers=[] if wp is None else sorted(wp.layers),
                num_window_pages=0 if wp is None else wp.num_window_pages + 1,  # + scratch
                window=0 if wp is None else wp.window,
            )
        )
        clock.lap("tensor-parallel ranks ready")

    def warmed_up(self, runner: ModelRunner) -> None:
        runner.followers = self.ranks.channel

    @property
    def on_step_error(self) -> Callable[[Exception], NoReturn]:
        return self._step_failed

    def _step_failed(self, exc: Exception) -> NoReturn:
        # The ranks are out of step for good: stop, saying which rank died or hung.
        raise self.ranks.explain(exc) from exc

    def check(self) -> None:
        self.ranks.check()

    def audit(self, runner: ModelRunner) -> None:
        self.ranks.audit(runner)

    def rank_link(self) -> RankLink:
        return GroupLink(self.ranks)

    def replace_weights(self, model: Any, path: Path, load_args: dict[str, Any]) -> int:
        """Every rank loads its share of ``path`` and checks it; only once all could does
        any copy (RankGroup.replace_weights)."""
        from radixserve.model.weight_update import load_weights_for

        share = {**load_args, **self.load_args()}
        return self.ranks.replace_weights(str(path), lambda: load_weights_for(model, path, **share))

    def serve_lora(self, registry: LoraRegistry, adapter: LoraAdapter) -> LoraAdapter:
        return self.ranks.serve_lora(registry, adapter)

    def unload_lora(self, registry: LoraRegistry, name: str) -> None:
        self.ranks.unload_lora(registry, name)

    def close(self, runner: ModelRunner | None) -> None:
        self.ranks.close()


class PipelineParallel(Topology):
    """Rank 0 of ``pipeline_parallel_size`` stages, each a tensor-parallel group, on one host:
    rank 0 runs stage 0 and sends each step's activations down the stages."""

    parallel = True
    carries_window_map = False  # the stages build no window pool and apply no window map
    holds_final_norm = False  # the last stage's rank runs it

    def __init__(
        self, cfg: EngineConfig, model_path: str | Path, engine_kwargs: dict[str, Any]
    ) -> None:
        from radixserve.distributed.pipeline.launch import PipelineLaunch

        super().__init__(cfg)
        self.launch: PipelineLaunch = PipelineLaunch.from_config(cfg, model_path, engine_kwargs)

    @property
    def device(self) -> torch.device:
        return self.launch.device

    def threads(self) -> int | None:
        return rank_threads(self.cfg, self.launch.pc)

    def load_args(self) -> dict[str, Any]:
        return {"tp": self.launch.tp_group, "stage": self.launch.stage}

    def replace_weights(self, model: Any, path: Path, load_args: dict[str, Any]) -> int:
        """Every stage's ranks load their share of ``path`` and check it; only once all
        could does any copy (PipelineRunner.replace_weights)."""
        from radixserve.model.weight_update import load_weights_for

        share = {**load_args, **self.load_args()}
        runner = self.launch.runner
        assert runner is not None, "weights are updated once the pipeline serves"
        return runner.replace_weights(str(path), lambda: load_weights_for(model, path, **share))

    def plan_memory(self, model: Any, **kwargs: Any) -> MemoryPlan:
        # The page count every stage affords, from the whole model's config.
        return self.launch.plan_memory(model.config, **kwargs)

    def make_runner(self, model: Any, pool: KVPool, shape: RunnerShape) -> ModelRunner:
        return self.launch.make_runner(
            model,
            pool,
            self.cfg,
            num_pages=shape.num_pages,
            max_rows=shape.max_rows,
            max_pages=shape.max_pages,
        )

    @property
    def on_step_error(self) -> Callable[[Exception], NoReturn]:
        return self._step_failed

    def _step_failed(self, exc: Exception) -> NoReturn:
        raise self.launch.explain(exc) from exc

    def check(self) -> None:
        self.launch.check()

    def close(self, runner: ModelRunner | None) -> None:
        self.launch.close(runner)


def make_topology(
    cfg: EngineConfig, model_path: str | Path, engine_kwargs: dict[str, Any]
) -> Topology:
    """The topology ``cfg`` asks for; the parallel ones start their other ranks now, so they
    load their shards while rank 0 loads its own. ``engine_kwargs``: the Engine's keyword
    arguments (pipeline ranks are fresh interpreters that build their config from them)."""
    if cfg.node_rank != 0:
        raise ValueError(
            "node_rank > 0 runs only rank loops (distributed.ranks.run_node), not an Engine"
        )
    if cfg.pipeline_parallel_size > 1:
        return PipelineParallel(cfg, model_path, engine_kwargs)
    if cfg.tensor_parallel_size > 1:
        return TensorParallel(cfg, model_path)
    return Topology(cfg)
