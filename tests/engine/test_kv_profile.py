"""KV pool sizing from a profile run, on the CPU with a scripted device memory."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.engine import kv_profile
from radixserve.engine.engine import Engine
from radixserve.engine.model_runner import WARM_PREFILL_LENGTHS, ModelRunner, make_attention_backend
from radixserve.engine.sampler import Sampler
from radixserve.memory.planner import MiB, kv_bytes_per_token
from radixserve.memory.pool import KVPool
from radixserve.model.loader import load_model
from radixserve.scheduling.plan import StepPlan

GiB = 1 << 30


class ScriptedMemory:
    """A device whose allocator reports scripted numbers; records what it was asked."""

    def __init__(
        self, total: int, used: int, peak_over: int, other: int = 0, non_torch: int = 0
    ) -> None:
        """``other``: held by other processes from the start; ``used``: what loading the
        weights takes (after the first :meth:`free`); ``peak_over``: the profiled step's peak;
        ``non_torch``: what the step leaves held outside torch's allocator (after
        :meth:`release`: cuBLAS workspaces, kernel modules), which :meth:`peak` never sees."""
        self._total, self._used, self._peak_over, self._other = total, used, peak_over, other
        self._non_torch = non_torch
        self.calls: list[str] = []

    def total(self) -> int:
        self.calls.append("total")
        return self._total

    def free(self) -> int:
        first = "free" not in self.calls
        self.calls.append("free")
        if first:
            return self._total - self._other
        return self._total - self._other - self._used - ("release" in self.calls) * self._non_torch

    def allocated(self) -> int:
        self.calls.append("allocated")
        return self._used

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def peak(self) -> int:
        self.calls.append("peak")
        return self._used + self._peak_over

    def release(self) -> None:
        self.calls.append("release")


def test_pages_from_measured_figures() -> None:
    pages = kv_profile.kv_pages_from_profile(
        total=10 * GiB,
        utilization=0.9,
        free_at_start=10 * GiB,
        used=2 * GiB,
        step_peak=GiB,
        graph_reserve=0,
        kv_fixed=0,
        bytes_per_page=MiB,
    )
    # int(10 GiB x 0.9) - 3 GiB = 3 GiB of 1 MiB pages, one of them the scratch page (the
    # headroom below free₀ does not bind: free₀ is the whole device).
    assert pages == (int(10 * GiB * 0.9) - 3 * GiB) // MiB - 1
    with_graphs = kv_profile.kv_pages_from_profile(
        total=10 * GiB,
        utilization=0.9,
        free_at_start=10 * GiB,
        used=2 * GiB,
        step_peak=GiB,
        graph_reserve=kv_profile.graph_reserve_bytes(GiB, 2048, 64),
        kv_fixed=64,
        bytes_per_page=MiB,
    )
    # 64 of 2048 rows' share of the peak (32 MiB) and the fixed bytes (one more page) come off.
    assert with_graphs == pages - 32 - 1
    shared = kv_profile.kv_pages_from_profile(
        total=10 * GiB,
        utilization=0.9,
        free_at_start=5 * GiB,  # another worker holds half the device
        used=2 * GiB,
        step_peak=GiB,
        graph_reserve=0,
        kv_fixed=0,
        bytes_per_page=MiB,
    )
    # free₀ binds, less the 1 % of the device kept for allocations made after sizing.
    assert shared == (5 * GiB - int(10 * GiB * kv_profile.FREE_HEADROOM) - 3 * GiB) // MiB - 1


def test_budget_below_one_page_is_a_clear_error() -> None:
    args: dict[str, Any] = dict(
        total=GiB, free_at_start=GiB, used=GiB // 2, step_peak=GiB // 4, graph_reserve=0, kv_fixed=0
    )
    left = int(GiB * 0.8) - GiB // 2 - GiB // 4
    assert kv_profile.kv_pages_from_profile(utilization=0.8, bytes_per_page=left // 2, **args) == 1
    with pytest.raises(ValueError, match="no room for the KV cache.*--memory-utilization"):
        kv_profile.kv_pages_from_profile(utilization=0.8, bytes_per_page=left // 2 + 1, **args)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        kv_profile.kv_pages_from_profile(utilization=0.5, bytes_per_page=1, **args)


def test_dummy_step_runs_max_num_tokens_rows(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, announce=False)
    seen: list[tuple[int, int]] = []
    forward = model.forward

    def counting(batch: Any, attn: Any) -> torch.Tensor:
        logits = forward(batch, attn)
        seen.append((batch.input_ids.shape[0], logits.shape[0]))
        return logits

    model.forward = counting  # type: ignore[method-assign]
    cfg = model.config
    pools: list[KVPool] = []

    def make_runner(pool: KVPool, rows: int, pages: int) -> ModelRunner:
        pools.append(pool)
        sampler = Sampler(cfg.vocab_size, cfg.eos_token_ids, torch.device("cpu"), 0)
        return ModelRunner(model, pool, make_attention_backend("torch", pool), sampler, rows, pages)

    mem = ScriptedMemory(total=GiB, used=100 * MiB, peak_over=7 * MiB)
    pool_args = dict(
        num_layers=cfg.num_layers, page_size=4, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim
    )
    peak = kv_profile.profile_step_peak(
        model, mem, make_runner=make_runner, pool_args=pool_args, max_num_tokens=50, max_seq_len=20
    )
    assert peak == 7 * MiB
    # 50 rows (sequences of 20, 20, 10), logits for 3 sampled rows and all 50 prompt rows.
    assert seen == [(50, 53)]
    assert pools[0].num_pages == 5 + 5 + 3
    assert mem.calls.index("allocated") < mem.calls.index("reset_peak") < mem.calls.index("peak")


def test_dummy_plan_shape() -> None:
    plan, nseq, npages = kv_profile.dummy_step_plan(9, 4, 2)
    assert isinstance(plan, StepPlan) and (nseq, npages) == (3, 5)
    assert plan.extend_lens == [4, 4, 1] and plan.positions == [0, 1, 2, 3] * 2 + [0]
    assert plan.page_lists == [[0, 1], [2, 3], [4]]
    assert plan.out_slots == list(range(9))


# The profile run's step size in these tests: not one of the warm-up's prefill lengths, so
# that the steps executed tell the profile run from the warm-up.
PROFILE_TOKENS = 96
assert PROFILE_TOKENS not in WARM_PREFILL_LENGTHS


def _engine(monkeypatch: pytest.MonkeyPatch, model: Path, mem: ScriptedMemory, **kw: Any) -> Engine:
    monkeypatch.setattr(kv_profile, "device_memory", lambda device: mem)
    rows: list[int] = []
    execute = ModelRunner.execute

    def counting(self: ModelRunner, plan: StepPlan) -> Any:
        rows.append(len(plan.input_ids))
        return execute(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", counting)
    # max_num_tokens: the profile run's step size, none of the warm-up's prefill lengths
    kw = {"page_size": 4, "max_num_tokens": PROFILE_TOKENS, "max_running_requests": 8, **kw}
    engine = Engine(str(model), **kw)
    engine.profiled_rows = rows  # type: ignore[attr-defined]
    return engine


def test_engine_sizes_the_pool_from_the_profile(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    total, used, peak, non_torch = 64 * MiB, 4 * MiB, 2 * MiB, 3 * MiB
    mem = ScriptedMemory(total, used, peak, other=MiB, non_torch=non_torch)
    engine = _engine(monkeypatch, tiny_llama_dir, mem, memory_utilization=0.5, decode_graphs="on")
    per_page = kv_bytes_per_token(engine.model_config, "auto", torch.float32) * 4
    graphs = math.ceil(peak * 8 / PROFILE_TOKENS)
    # What the step left outside the allocator counts as used, as the weights do.
    expected = (int(total * 0.5) - used - non_torch - peak - graphs) // per_page - 1
    assert engine.allocator.num_pages == expected
    assert engine.pool.num_pages == expected + 1  # the scratch page
    assert engine.profiled_rows[0] == PROFILE_TOKENS  # type: ignore[attr-defined]
    prof = engine.kv_profile
    assert prof is not None and prof.graph_reserve_bytes == graphs
    assert prof.planner_num_pages is not None and prof.planner_num_pages > 0
    assert "profile run" in engine.kv_sizing and "planner estimate" in engine.kv_sizing
    out = engine.generate([[5, 6, 7]], {"max_tokens": 3, "temperature": 0.0})
    assert len(out[0].token_ids) == 3
    engine.check_invariants()


def test_engine_budgets_only_memory_free_at_start(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    """A second worker on a GPU split 0.5/0.5 sees the first one's memory as taken, not its own."""
    total, used, peak = 64 * MiB, 4 * MiB, 2 * MiB
    mem = ScriptedMemory(total, used, peak, other=40 * MiB)
    engine = _engine(monkeypatch, tiny_llama_dir, mem, memory_utilization=0.5, decode_graphs="off")
    per_page = kv_bytes_per_token(engine.model_config, "auto", torch.float32) * 4
    headroom = int(total * kv_profile.FREE_HEADROOM)
    assert engine.allocator.num_pages == (24 * MiB - headroom - used - peak) // per_page - 1
    assert engine.kv_profile is not None and engine.kv_profile.free_at_start_bytes == 24 * MiB


def test_engine_refuses_a_device_without_room(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    mem = ScriptedMemory(total=8 * MiB, used=7 * MiB, peak_over=MiB)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        _engine(monkeypatch, tiny_llama_dir, mem, memory_utilization=0.9)


@pytest.mark.parametrize("given", [{"num_pages": 40}, {"memory_budget": 64 * MiB}])
def test_explicit_sizes_skip_the_profile(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path, given: dict[str, int]
) -> None:
    mem = ScriptedMemory(total=GiB, used=0, peak_over=0)
    engine = _engine(monkeypatch, tiny_llama_dir, mem, **given)
    assert mem.calls == [] and engine.kv_profile is None
    assert PROFILE_TOKENS not in engine.profiled_rows  # type: ignore[attr-defined]
    if "num_pages" in given:
        assert engine.allocator.num_pages == 40
