"""The memory planner: how the memory budget splits into weights, activations and KV pages.

The budget::

    budget     = --memory-budget, or device memory × --memory-utilization
                 (on CPU also capped by the memory available right now: the RAM is shared)
    kv budget  = budget − weights − activation reserve − fixed scale bytes
    num_pages  = kv budget // (bytes/token × page_size)

The byte figures of a model (KV per token, weights, activations) are
:mod:`~radixserve.memory.footprint`'s; the device's memory is
:mod:`~radixserve.memory.snapshot`'s; sizes in words, :mod:`~radixserve.memory.units`'.
This module is the planner's public face and names them all, so
``from radixserve.memory.planner import kv_bytes_per_token, plan_memory, format_bytes``
keeps working.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixkernels.kv_format import KVCacheDtype
from radixserve.memory.footprint import (
    activation_reserve_bytes,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_fixed_bytes,
    kv_format,
    weight_bytes,
)
from radixserve.memory.interfaces import ModelDims
from radixserve.memory.sharding import WHOLE_MODEL, DeviceShard
from radixserve.memory.snapshot import (
    MemorySnapshot,
    cpu_available_bytes,
    device_total_bytes,
    memory_snapshot,
    process_rss_bytes,
)
from radixserve.memory.units import GiB, MiB, format_bytes, parse_bytes

__all__ = [
    "GiB",
    "MemoryPlan",
    "MemorySnapshot",
    "MiB",
    "activation_reserve_bytes",
    "cpu_available_bytes",
    "device_total_bytes",
    "format_bytes",
    "kv_bytes_per_sequence",
    "kv_bytes_per_token",
    "kv_fixed_bytes",
    "kv_format",
    "memory_snapshot",
    "parse_bytes",
    "plan_memory",
    "process_rss_bytes",
    "weight_bytes",
]


@dataclass(frozen=True)
class MemoryPlan:
    """How the memory budget splits into weights, activations and KV pages."""

    device: str
    kv_dtype: str
    act_dtype: str
    page_size: int
    budget_bytes: int  # everything radixserve may use on the device
    budget_source: str  # how budget_bytes was chosen, in words
    weight_bytes: int
    activation_reserve_bytes: int
    kv_fixed_bytes: int  # fp8 per-head scales
    kv_budget_bytes: int  # what is left for pages (>= 0)
    bytes_per_token: int
    bytes_per_page: int
    num_pages: int  # 0 when nothing fits: callers must check

    @property
    def max_tokens(self) -> int:
        """Tokens of KV the pool holds at once (all sequences together)."""
        return self.num_pages * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page + self.kv_fixed_bytes

    def pages_per_sequence(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.page_size)

    def max_sequences(self, seq_len: int) -> int:
        """Sequences of ``seq_len`` tokens whose KV fits at once (no sharing of prefixes)."""
        return self.num_pages // self.pages_per_sequence(seq_len)


def plan_memory(
    cfg: ModelDims,
    *,
    kv_dtype: KVCacheDtype | str = "auto",
    page_size: int = 16,
    act_dtype: torch.dtype = torch.float32,
    memory_budget: int | None = None,
    memory_utilization: float = 0.9,
    device: torch.device | str = "cpu",
    max_num_tokens: int = 2048,
    weights_dtype: torch.dtype | None = None,
    max_num_pages: int | None = None,
    quantization: str | None = None,
    quant_group_size: int | None = None,
    quantize_embeddings: bool = False,
    quant_dense_cache: bool = False,
    shard: DeviceShard = WHOLE_MODEL,
    device_total: int | None = None,
) -> MemoryPlan:
    """Size the KV pool: pages of ``page_size`` tokens that fit after weights and activations.

    ``memory_budget`` (bytes) is the total radixserve may use; without it the budget is the
    device's total memory × ``memory_utilization`` (on the CPU, no more than what is available
    now). ``weights_dtype`` defaults to ``act_dtype`` (the model runs in one dtype).
    ``max_num_pages`` caps the result: on a CPU the budget is the machine's RAM, far more KV
    than a small model serving a few requests needs (e.g. cap at what
    ``max_running_requests × max_model_len`` tokens take). ``quantization`` and its options
    size quantized weights (:func:`weight_bytes`): what they save goes to KV pages.
    ``shard`` plans one device of a TP × PP worker (its weights, its layers' and heads' KV);
    ``device_total`` (bytes) plans for a device other than this machine's (e.g. an 80 GB GPU).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if not 0.0 < memory_utilization <= 1.0:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    dev = torch.device(device)
    if memory_budget is not None:
        if memory_budget < 0:
            raise ValueError(f"memory_budget must be >= 0, got {memory_budget}")
        budget, source = int(memory_budget), "--memory-budget"
    elif device_total is not None:
        budget = int(device_total * memory_utilization)
        source = f"device {format_bytes(device_total)} × utilization {memory_utilization:g}"
    else:
        total = device_total_bytes(dev)
        budget = int(total * memory_utilization)
        source = f"{dev.type} total {format_bytes(total)} × utilization {memory_utilization:g}"
        if dev.type == "cpu":
            avail = cpu_available_bytes()
            if avail < budget:
                budget = avail
                source = f"cpu RAM available now ({format_bytes(avail)}; total × {memory_utilization:g} is more)"
    fmt = kv_format(cfg, kv_dtype, act_dtype)
    per_token = kv_bytes_per_token(cfg, fmt.kv_dtype, act_dtype, shard)
    per_page = per_token * page_size
    weights = weight_bytes(
        cfg,
        weights_dtype or act_dtype,
        quantization,
        quant_group_size,
        quantize_embeddings,
        quant_dense_cache,
        shard,
    )
    activations = activation_reserve_bytes(cfg, max_num_tokens, act_dtype, shard)
    fixed = kv_fixed_bytes(cfg, fmt.kv_dtype, shard)
    kv_budget = max(0, budget - weights - activations - fixed)
    return MemoryPlan(
        device=str(dev),
        kv_dtype=fmt.kv_dtype.value,
        act_dtype=str(act_dtype).replace("torch.", ""),
        page_size=page_size,
        budget_bytes=budget,
        budget_source=source,
        weight_bytes=weights,
        activation_reserve_bytes=activations,
        kv_fixed_bytes=fixed,
        kv_budget_bytes=kv_budget,
        bytes_per_token=per_token,
        bytes_per_page=per_page,
        num_pages=kv_budget // per_page
        if max_num_pages is None
        else min(max_num_pages, kv_budget // per_page),
    )
