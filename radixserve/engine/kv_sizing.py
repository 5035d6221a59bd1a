"""How many pages the engine's KV pool gets: given, planned, or measured by a profile run.

::

    num_pages given                      that many
    memory_budget given, a device with   the memory planner (radixserve.memory.planner); on a
    no memory API (CPU), or TP / PP      CPU without a budget, at most CPU_DEFAULT_KV_BYTES of KV
    otherwise (CUDA)                     a profile run of the largest step (kv_profile), the
                                         planner's estimate kept beside the measured figure

A :class:`KVSizer` is made before the weights load: a profile run budgets only the memory
that was free then (another worker's share of the device stays that worker's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

import radixserve.engine.kv_profile as kv_profile
from radixserve.engine.config import EngineConfig
from radixserve.engine.kv_profile import ProfiledKV
from radixserve.engine.model_runner import ModelRunner
from radixserve.memory.planner import kv_bytes_per_token, kv_fixed_bytes, plan_memory

if TYPE_CHECKING:
    from radixserve.memory.planner import MemoryPlan
    from radixserve.model.llama import LlamaForCausalLM

# The memory planner for this rank's share of a model (the topology's: one process plans
# from its own shard, pipeline stages from the whole model, so every stage fits).
PlanFn = Callable[..., "MemoryPlan"]


def plan_local(model: LlamaForCausalLM, **kwargs: Any) -> MemoryPlan:
    """One process's (or one tensor-parallel rank's) plan: from its share of the model."""
    return plan_memory(model.local_config, **kwargs)


# Default KV pool on a CPU when neither num_pages nor memory_budget is given.
CPU_DEFAULT_KV_BYTES = 1 << 30


class KVSizing(NamedTuple):
    """The pool's size (allocator pages, the scratch page not counted) and how it was found."""

    num_pages: int
    description: str  # in words, for the start-up log (``Engine.kv_sizing``)
    profile: ProfiledKV | None  # the profile run's figures, when one decided


class KVSizer:
    """Sizes the KV pool of one engine (see the module docstring).

    ``parallel``: tensor or pipeline parallelism. The planner then sizes the pool, from rank
    0's shard (the largest); a profile run would need every rank in its forward.
    """

    def __init__(self, cfg: EngineConfig, device: torch.device, parallel: bool) -> None:
        self.cfg = cfg
        self.device = device
        # Free device memory before the weights: the most this engine may take (kv_profile).
        self.memory: kv_profile.DeviceMemory | None = None
        if cfg.num_pages is None and cfg.memory_budget is None and not parallel:
            self.memory = kv_profile.device_memory(device)
        self.free_at_start = 0 if self.memory is None else self.memory.free()

    def size(
        self,
        model: LlamaForCausalLM,
        pool_args: dict[str, Any],
        plan_fn: PlanFn = plan_local,
    ) -> KVSizing:
        """The pool's size for ``model``, loaded since this sizer was made. ``pool_args``: the
        pool's arguments but its size (the profile run builds a small pool of its own)."""
        cfg = self.cfg
        if cfg.num_pages is not None:
            return KVSizing(cfg.num_pages, f"KV pool {cfg.num_pages} pages (num_pages given)", None)
        if self.memory is None:
            pages = self._plan_num_pages(model, plan_fn)
            how = f"KV pool {pages} pages from the memory planner" + (
                " (--memory-budget)" if cfg.memory_budget is not None else ""
            )
            return KVSizing(pages, how, None)
        profile = self._profile(model, self.memory, pool_args, plan_fn)
        return KVSizing(profile.num_pages, profile.describe(), profile)

    def _profile(
        self,
        model: LlamaForCausalLM,
        mem: kv_profile.DeviceMemory,
        pool_args: dict[str, Any],
        plan_fn: PlanFn,
    ) -> ProfiledKV:
        """Pages from a profile run of the largest step on ``mem``'s device; the planner's
        estimate is kept beside the measured figure."""
        cfg, mc = self.cfg, model.config
        max_seq_len = min(cfg.max_model_len or mc.max_position_embeddings, cfg.max_num_tokens)
        peak = kv_profile.profile_step_peak(
            model,
            mem,
            make_runner=lambda pool, rows, pages: ModelRunner.from_config(
                model, pool, cfg, rows, pages
            ),
            pool_args=pool_args,
            max_num_tokens=cfg.max_num_tokens,
            max_seq_len=max_seq_len,
        )
        # After the step (its tensors released): the weights, and what the step left outside
        # torch's allocator (cuBLAS workspaces, kernel modules), which the peak does not see.
        used = self.free_at_start - mem.free()
        graph_rows = min(cfg.max_running_requests, cfg.max_num_tokens)
        graphs = (
            kv_profile.graph_reserve_bytes(peak, cfg.max_num_tokens, graph_rows)
            if cfg.use_decode_graphs
            else 0
        )
        per_page = kv_bytes_per_token(mc, cfg.kv_cache_dtype, cfg.torch_dtype) * cfg.page_size
        try:
            planner = self._plan_num_pages(model, plan_fn)
        except ValueError:  # the estimate found no room; the measured figure decides
            planner = 0
        return kv_profile.ProfiledKV.fit(
            total=mem.total(),
            utilization=cfg.memory_utilization,
            free_at_start=self.free_at_start,
            used=used,
            step_peak=peak,
            graph_reserve=graphs,
            kv_fixed=kv_fixed_bytes(mc, cfg.kv_cache_dtype),
            bytes_per_page=per_page,
            profiled_rows=cfg.max_num_tokens,
            planner_num_pages=planner,
        )

    def _plan_num_pages(self, model: LlamaForCausalLM, plan_fn: PlanFn) -> int:
        """Pages from the memory planner. On a CPU without an explicit budget the planner's
        budget is the machine's RAM (shared with everything else), so the pool is capped at
        ``CPU_DEFAULT_KV_BYTES`` of KV."""
        cfg = self.cfg
        # This rank's share of the model (the whole model without tensor parallelism).
        local_config = model.local_config
        cap = None
        if self.device.type == "cpu" and cfg.memory_budget is None:
            per_page = (
                kv_bytes_per_token(local_config, cfg.kv_cache_dtype, cfg.torch_dtype)
                * cfg.page_size
            )
            cap = max(1, CPU_DEFAULT_KV_BYTES // per_page)
        plan = plan_fn(
            model,
            kv_dtype=cfg.kv_cache_dtype,
            page_size=cfg.page_size,
            act_dtype=cfg.torch_dtype,
            memory_budget=cfg.memory_budget,
            memory_utilization=cfg.memory_utilization,
            device=self.device,
            max_num_tokens=cfg.max_num_tokens,
            max_num_pages=cap,
            **quant_plan_args(model),
        )
        if plan.num_pages < 1:
            raise ValueError(f"no room for the KV cache: {plan}")
        return int(plan.num_pages)


def quant_plan_args(model: LlamaForCausalLM) -> dict[str, Any]:
    """The loaded model's quantization, as the planner's weight-size arguments."""
    report = getattr(model, "quant_report", None)
    if report is None:
        return {}
    return {
        "quantization": report.method,
        "quant_group_size": report.group_size,
        "quantize_embeddings": not report.full_precision,
        "quant_dense_cache": report.dense_cache_bytes > 0,
    }
