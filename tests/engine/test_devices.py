"""Device defaults, one GPU per worker, explicit memory splits, set_device, and stats that
skip the O(pool) invariant check unless asked. GPUs are faked (monkeypatched torch.cuda)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.devices import (
    WorkerPlacement,
    bind_device,
    parse_gpu_ids,
    plan_worker_devices,
)


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_defaults_follow_the_device() -> None:
    cpu = EngineConfig()
    assert (cpu.dtype, cpu.attention_backend, cpu.torch_dtype) == (
        "float32",
        "torch",
        torch.float32,
    )
    for dev in ("cuda", "cuda:1"):
        gpu = EngineConfig(device=dev)  # resolving defaults needs no GPU
        assert (gpu.dtype, gpu.attention_backend, gpu.torch_dtype) == (
            "bfloat16",
            "triton",
            torch.bfloat16,
        )
    explicit = EngineConfig(device="cuda", dtype="float16", attention_backend="torch")
    assert (explicit.dtype, explicit.attention_backend) == ("float16", "torch")
    with pytest.raises(ValueError, match="unknown device"):
        EngineConfig(device="gpu0")


def test_one_gpu_per_worker(four_gpus: None) -> None:
    places = plan_worker_devices({"device": "cuda"}, 3)
    assert places == [WorkerPlacement("cuda:0", {"CUDA_VISIBLE_DEVICES": str(i)}) for i in range(3)]
    places = plan_worker_devices({"device": "cuda"}, 2, parse_gpu_ids("3,1"))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in places] == ["3", "1"]
    assert plan_worker_devices({}, 2) == [WorkerPlacement("cpu", {})] * 2
    assert plan_worker_devices({"device": "cuda"}, 0) == []  # only remote workers


def test_tensor_parallel_workers_get_their_own_gpus(four_gpus: None) -> None:
    places = plan_worker_devices({"device": "cuda", "tensor_parallel_size": 2}, 2)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in places] == ["0,1", "2,3"]
    assert {p.device for p in places} == {"cuda:0"}  # rank r: cuda:r of the worker's own list
    places = plan_worker_devices({"device": "cuda", "tensor_parallel_size": 2}, 1, [3, 1])
    assert places[0].env["CUDA_VISIBLE_DEVICES"] == "3,1"
    with pytest.raises(ValueError, match="need 6 GPUs"):
        plan_worker_devices({"device": "cuda", "tensor_parallel_size": 2}, 3)


def test_gpu_ids_map_through_the_parents_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,5,7")
    places = plan_worker_devices({"device": "cuda"}, 2, [2, 0])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in places] == ["7", "GPU-aa"]
    with pytest.raises(ValueError, match="GPU 3 does not exist"):
        plan_worker_devices({"device": "cuda"}, 1, [3])


def test_sharing_a_gpu_needs_an_explicit_split(four_gpus: None) -> None:
    with pytest.raises(ValueError, match=r"2 workers would share GPU 1.*--memory-utilization 0.45"):
        plan_worker_devices({"device": "cuda:1"}, 2)
    with pytest.raises(ValueError, match="2 workers would share GPU 0"):
        plan_worker_devices({"device": "cuda"}, 5)  # 5 workers on 4 GPUs: GPU 0 gets two
    split = plan_worker_devices({"device": "cuda:1", "memory_utilization": 0.45}, 2)
    assert split == [WorkerPlacement("cuda:0", {"CUDA_VISIBLE_DEVICES": "1"})] * 2
    with pytest.raises(ValueError, match="would share"):
        plan_worker_devices({"device": "cuda:1", "memory_utilization": 0.6}, 2)  # 1.2 of the GPU
    assert len(plan_worker_devices({"device": "cuda", "num_pages": 100}, 6)) == 6
    assert len(plan_worker_devices({"device": "cuda", "memory_budget": 2**30}, 6)) == 6
    with pytest.raises(ValueError, match="not both"):
        plan_worker_devices({"device": "cuda:0"}, 1, [1])
    with pytest.raises(ValueError, match="needs --device cuda"):
        plan_worker_devices({"device": "cpu"}, 1, [0])
    with pytest.raises(ValueError, match="comma-separated"):
        parse_gpu_ids("0,x")


def test_bind_device_sets_the_current_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    bind_device(torch.device("cuda:1"))
    bind_device(torch.device("cuda"))  # no index: the current device stays
    bind_device(torch.device("cpu"))
    assert calls == [torch.device("cuda:1")]


class _Engine:
    """What worker_stats reads; counts invariant checks."""

    def __init__(self) -> None:
        self.checks = 0

    def stats(self) -> dict[str, int]:
        return {"running": 1}

    def check_invariants(self) -> None:
        self.checks += 1


def test_stats_skip_the_invariant_check_unless_debugging() -> None:
    from radixserve.serving.worker.worker import worker_stats

    engine = _Engine()
    assert worker_stats(engine, check=False)["invariants"] == "unchecked" and engine.checks == 0
    assert worker_stats(engine, check=True)["invariants"] == "ok" and engine.checks == 1
