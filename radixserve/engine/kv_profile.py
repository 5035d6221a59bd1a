"""KV pool sizing from a profile run: measured device memory, not the planner's estimate.

On a device with a memory API (CUDA), after the weights are loaded, the engine runs the
largest step it will ever schedule (a dummy forward of ``max_num_tokens`` rows, as vLLM's
``profile_run`` / ``determine_num_available_blocks`` does) and sizes the pool from what it
measured::

    free₀       = free memory when the engine starts, before the weights
    used        = free₀ − free after the profile step (this engine's weights and buffers, and
                                                     what the step left outside torch's
                                                     allocator: cuBLAS workspaces, loaded
                                                     kernel modules)
    step peak   = peak allocated during the dummy step − allocated before it
                                                     (activations, logits, sampler, the
                                                     profile's own small KV pool counted too)
    graphs      = step peak × max_running_requests / max_num_tokens   (decode graphs on)
    headroom    = 1 % of total                       (what libraries take after sizing)
    kv budget   = min(total × --memory-utilization, free₀ − headroom)
                  − used − step peak − graphs − fixed scale bytes
    num_pages   = kv budget // bytes per page − 1   (the scratch page padding rows write to)

``used`` counts only what this engine added, and ``free₀`` caps the budget, so that workers
splitting one GPU (``--memory-utilization 0.45`` each, :mod:`~radixserve.engine.devices`)
do not count each other's memory as their own, and none budgets memory another holds. Where
free₀ is the cap (another process holds more than ``1 − utilization`` of the device), the
headroom is what is left for allocations after sizing; without it the first GPU run (a
worker beside a 15 GiB process on an H200) sized K and V to the last 150 MiB and could not
allocate V.

The decode graphs hold, per captured bucket and in one shared pool, the intermediates of one
decode forward of at most ``max_running_requests`` rows; a decode row costs no more than an
extend row, so the profiled per-row peak times the largest bucket bounds that pool. The
scratch page is one page of the pool the allocator never hands out, taken from the budget.

On the CPU (no device memory API: the RAM is shared with everything on the machine) the
planner's estimate stays; ``num_pages`` and ``memory_budget`` win everywhere and skip the
profile. Tests substitute a :class:`DeviceMemory` with scripted numbers.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from radixserve.memory.pool import KVPool
from radixserve.memory.units import format_bytes
from radixserve.sampling_params import SamplingParams
from radixserve.scheduling.plan import StepPlan
from radixserve.scheduling.request import Request

if TYPE_CHECKING:
    from radixserve.engine.model_runner import ModelRunner

#: Share of the device's memory kept free below free₀: allocations made outside torch's
#: allocator after sizing (cuBLAS workspaces of new streams, graph capture's own buffers).
FREE_HEADROOM = 0.01

__all__ = [
    "FREE_HEADROOM",
    "CudaMemory",
    "DeviceMemory",
    "ProfiledKV",
    "device_memory",
    "dummy_step_plan",
    "kv_pages_from_profile",
]


class DeviceMemory(Protocol):
    """What KV sizing reads from a device's allocator (bytes)."""

    def total(self) -> int:
        """The device's memory."""
        ...

    def free(self) -> int:
        """Memory no one holds now (this process's allocator cache counts as held)."""
        ...

    def allocated(self) -> int:
        """Bytes of this process's live tensors on the device."""
        ...

    def reset_peak(self) -> None:
        """Start a new peak measurement at the current allocation."""
        ...

    def peak(self) -> int:
        """Most bytes of live tensors at once since :meth:`reset_peak`."""
        ...

    def release(self) -> None:
        """Give cached, unused blocks back to the device (after the profile's tensors die)."""
        ...


class CudaMemory:
    """:class:`DeviceMemory` of one CUDA device, from torch's caching allocator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[1])

    def free(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.mem_get_info(self.device)[0])

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def release(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The memory API of ``device``, or None where there is none (the CPU: planner sizing)."""
    if device.type == "cuda":
        return CudaMemory(device)
    return None


@dataclass(frozen=True)
class ProfiledKV:
    """The measured KV sizing, with the planner's estimate beside it."""

    total_bytes: int
    utilization: float
    free_at_start_bytes: int  # free before the weights
    used_bytes: int  # free₀ − free after the profile step: weights and persistent buffers
    step_peak_bytes: int  # transient peak of the dummy max_num_tokens step
    graph_reserve_bytes: int
    kv_fixed_bytes: int
    bytes_per_page: int
    num_pages: int  # for the allocator; the pool has one more (the scratch page)
    profiled_rows: int
    planner_num_pages: int | None = None

    @classmethod
    def fit(
        cls, profiled_rows: int, planner_num_pages: int | None = None, **figures: Any
    ) -> ProfiledKV:
        """The sizing of measured ``figures`` (:func:`kv_pages_from_profile`'s arguments)."""
        f = figures
        return cls(
            f["total"], f["utilization"], f["free_at_start"], f["used"], f["step_peak"], f["graph_reserve"],
            f["kv_fixed"], f["bytes_per_page"], kv_pages_from_profile(**figures),
            profiled_rows, planner_num_pages,
        )  # fmt: skip

    @property
    def kv_budget_bytes(self) -> int:
        return (
            budget_cap(self.total_bytes, self.utilization, self.free_at_start_bytes)
            - self.used_bytes
            - self.step_peak_bytes
            - self.graph_reserve_bytes
            - self.kv_fixed_bytes
        )

    def describe(self) -> str:
        """One line for the start-up log and report."""
        planner = (
            ""
            if self.planner_num_pages is None
            else f"; planner estimate {self.planner_num_pages} pages"
        )
        return (
            f"KV pool {self.num_pages} pages (+1 scratch) from a profile run: "
            f"min({format_bytes(self.total_bytes)} × {self.utilization:g}, free at start "
            f"{format_bytes(self.free_at_start_bytes)} − 1 % headroom) − weights and buffers "
            f"{format_bytes(self.used_bytes)}"
            f" − peak of a {self.profiled_rows}-row step {format_bytes(self.step_peak_bytes)}"
            f" − decode graphs {format_bytes(self.graph_reserve_bytes)}"
            f" = {format_bytes(max(0, self.kv_budget_bytes))} for KV{planner}"
        )


def kv_pages_from_profile(
    *,
    total: int,
    utilization: float,
    free_at_start: int,
    used: int,
    step_peak: int,
    graph_reserve: int,
    kv_fixed: int,
    bytes_per_page: int,
) -> int:
    """Allocator pages that fit the measured budget (module docstring), the scratch page
    taken out; raises ``ValueError`` saying what to change when not even one page fits."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"memory_utilization must be in (0, 1], got {utilization}")
    budget = budget_cap(total, utilization, free_at_start)
    budget -= used + step_peak + graph_reserve + kv_fixed
    pages = budget // bytes_per_page - 1 if budget > 0 else 0
    if pages < 1:
        raise ValueError(
            f"no room for the KV cache: min({format_bytes(total)} × {utilization:g}, free at start "
            f"{format_bytes(free_at_start)}) leaves "
            f"{format_bytes(max(0, budget))} after {format_bytes(used)} in use, a step peak of "
            f"{format_bytes(step_peak)} and {format_bytes(graph_reserve)} for decode graphs; "
            f"2 pages of {format_bytes(bytes_per_page)} are needed (one is the scratch page). "
            "Raise --memory-utilization, lower --max-num-tokens, or free the device"
        )
    return int(pages)


def budget_cap(total: int, utilization: float, free_at_start: int) -> int:
    """The most this engine may hold: its share of the device, never more than was free at
    start less :data:`FREE_HEADROOM` (module docstring)."""
    return min(int(total * utilization), free_at_start - int(total * FREE_HEADROOM))


def graph_reserve_bytes(step_peak: int, max_num_tokens: int, graph_rows: int) -> int:
    """A bound on the decode graphs' memory pool: the profiled per-row peak × the largest bucket."""
    return math.ceil(step_peak * min(graph_rows, max_num_tokens) / max_num_tokens)


def dummy_step_plan(
    max_num_tokens: int, max_seq_len: int, page_size: int
) -> tuple[StepPlan, int, int]:
    """The largest step the scheduler can send: ``max_num_tokens`` prefill rows (sequences of
    at most ``max_seq_len`` tokens), each sequence sampling, and every row's prompt logprob
    asked (float32 logits for all rows: the worst case). Returns the plan, the sequences and
    the pages it needs (pages 0.. in order)."""
    lens: list[int] = []
    left = max_num_tokens
    while left > 0:
        lens.append(min(left, max_seq_len))
        left -= lens[-1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    page_lists: list[list[int]] = []
    w_rows: list[int] = []
    w_cols: list[int] = []
    w_pages: list[int] = []
    lasts: list[int] = []
    rows: list[Request] = []
    next_page = 0
    for i, n in enumerate(lens):
        pages = list(range(next_page, next_page + -(-n // page_size)))
        next_page += len(pages)
        page_lists.append(pages)
        w_rows += [i] * len(pages)
        w_cols += list(range(len(pages)))
        w_pages += pages
        positions += list(range(n))
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(n)]
        input_ids += [0] * n
        lasts.append(len(input_ids) - 1)
        rows.append(Request(f"profile-{i}", [0] * n, n, SamplingParams(max_tokens=1), n + 1))
    plan = StepPlan(
        input_ids=input_ids,
        positions=positions,
        out_slots=slots,
        table_rows=list(range(len(lens))),
        prefix_lens=[0] * len(lens),
        extend_lens=lens,
        seq_lens=lens,
        page_lists=page_lists,
        write_rows=w_rows,
        write_cols=w_cols,
        write_pages=w_pages,
        logits_indices=lasts + list(range(max_num_tokens)),
        sample_rows=rows,
        prompt_targets=[0] * max_num_tokens,
        future_rows=[],
        future_src=[],
    )
    return plan, len(lens), next_page


def profile_step_peak(
    model: torch.nn.Module,
    mem: DeviceMemory,
    *,
    make_runner: Callable[[KVPool, int, int], ModelRunner],
    pool_args: dict[str, Any],
    max_num_tokens: int,
    max_seq_len: int,
) -> int:
    """Run :func:`dummy_step_plan`'s step through a throwaway runner over a throwaway pool
    (just the pages it writes) and return the peak it allocated on top of what was live before
    (the throwaway pool included, so the figure errs high). ``make_runner(pool, rows, pages)``
    builds the runner; ``pool_args`` are :class:`KVPool`'s arguments but ``num_pages``."""
    page_size = int(pool_args["page_size"])
    plan, nseq, npages = dummy_step_plan(max_num_tokens, max_seq_len, page_size)
    before = mem.allocated()
    mem.reset_peak()
    pool = KVPool(num_pages=npages, **pool_args)
    runner = make_runner(pool, nseq, max(len(p) for p in plan.page_lists))
    runner.execute(plan)
    peak = mem.peak()
    del runner, pool
    mem.release()
    return max(0, peak - before)
