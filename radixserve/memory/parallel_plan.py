"""The memory plan of a TP × PP worker: one :class:`MemoryPlan` per pipeline stage, per device.

Each device of stage ``s`` plans its own budget (weights of its shard, activations of its
widths, KV of its layers and KV heads, see :mod:`radixserve.memory.sharding`). The scheduler
hands out one set of page ids for all layers, so the worker's page count is the smallest any
stage affords; the other stages leave the difference unused (visible as ``slack``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from radixserve.memory.interfaces import ModelDims
from radixserve.memory.planner import MemoryPlan, plan_memory
from radixserve.memory.sharding import DeviceShard, stage_shards


@dataclass(frozen=True)
class ParallelMemoryPlan:
    """Per-stage device plans of a worker of ``tp × pp`` devices, agreed on one page count."""

    tp_size: int
    pp_size: int
    shards: tuple[DeviceShard, ...]  # one per stage
    stages: tuple[MemoryPlan, ...]  # each stage's own plan, before agreeing on pages

    @property
    def num_devices(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def num_pages(self) -> int:
        """Pages every device can hold: the smallest stage's count."""
        return min(p.num_pages for p in self.stages)

    @property
    def page_size(self) -> int:
        return self.stages[0].page_size

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.page_size

    def stage_plan(self, stage: int) -> MemoryPlan:
        """Stage ``stage``'s device plan with the agreed page count (what its pool allocates)."""
        return dataclasses.replace(self.stages[stage], num_pages=self.num_pages)

    def max_sequences(self, seq_len: int) -> int:
        """Sequences of ``seq_len`` tokens whose KV fits at once on every device."""
        return self.stage_plan(0).max_sequences(seq_len)

    def device_used_bytes(self, stage: int) -> int:
        """What one device of ``stage`` allocates: weights, activation reserve, its KV pool."""
        p = self.stage_plan(stage)
        return p.weight_bytes + p.activation_reserve_bytes + p.pool_bytes

    @property
    def total_budget_bytes(self) -> int:
        return sum(p.budget_bytes for p in self.stages) * self.tp_size

    @property
    def total_used_bytes(self) -> int:
        """Bytes allocated over all ``tp × pp`` devices."""
        return sum(self.device_used_bytes(s) for s in range(self.pp_size)) * self.tp_size

    @property
    def total_weight_bytes(self) -> int:
        return sum(p.weight_bytes for p in self.stages) * self.tp_size

    @property
    def total_kv_bytes(self) -> int:
        return sum(self.stage_plan(s).pool_bytes for s in range(self.pp_size)) * self.tp_size

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "num_devices": self.num_devices,
            "num_pages": self.num_pages,
            "max_tokens": self.max_tokens,
            "total_budget_bytes": self.total_budget_bytes,
            "total_used_bytes": self.total_used_bytes,
            "total_weight_bytes": self.total_weight_bytes,
            "total_kv_bytes": self.total_kv_bytes,
            "stages": [
                {
                    **dataclasses.asdict(self.shards[s]),
                    **self.stage_plan(s).__dict__,
                    "own_num_pages": self.stages[s].num_pages,
                    "device_used_bytes": self.device_used_bytes(s),
                }
                for s in range(self.pp_size)
            ],
        }


def plan_parallel_memory(
    cfg: ModelDims, tp: int = 1, pp: int = 1, expert_parallel: bool = False, **plan_kwargs: Any
) -> ParallelMemoryPlan:
    """Plan every stage's devices of a ``tp × pp`` worker; ``plan_kwargs`` go to
    :func:`~radixserve.memory.planner.plan_memory` (budget, dtypes, page size, device memory...),
    and are per device (``memory_budget`` is one device's). ``expert_parallel``: a MoE
    model's experts whole, ``E / tp`` per rank."""
    shards = tuple(stage_shards(cfg.num_layers, tp, pp, expert_parallel))
    stages = tuple(plan_memory(cfg, shard=shard, **plan_kwargs) for shard in shards)
    return ParallelMemoryPlan(tp_size=tp, pp_size=pp, shards=shards, stages=stages)
