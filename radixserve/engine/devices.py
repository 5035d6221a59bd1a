"""Devices: the defaults that follow a device, and which device each local worker gets.

Defaults (``EngineConfig`` fields left unset)::

    device      dtype      attention_backend
    cpu         float32    torch   (the C++ CPU kernels)
    cuda[:N]    bfloat16   triton  (compiled kernels; fused layer ops)

Workers of ``serve --workers N`` on CUDA: each gets its own GPU, chosen from ``--gpu-ids``
(device ordinals as this process numbers them), else from every GPU this process sees. A
worker sees only its GPU (``CUDA_VISIBLE_DEVICES`` set to that one entry of the parent's
list, so physical ids and UUIDs carry through) and runs on ``cuda:0``. Workers that would
share one GPU (more workers than GPUs, or an explicit ``cuda:K`` for several) are refused,
unless the memory is split explicitly: ``memory_utilization`` x workers on that GPU <= 1,
a ``memory_budget`` per worker, or ``num_pages`` (the pool sized by hand). Each worker's
planner otherwise budgets a fraction of the *whole* device, and the second one to start
runs out of memory.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

# No torch at import: the router process (serving.launcher) plans placements without it.
DEFAULT_MEMORY_UTILIZATION = 0.9


class DeviceDefaults(NamedTuple):
    dtype: str
    attention_backend: str


def parse_device(device: str | torch.device) -> tuple[str, int | None]:
    """``"cuda:1"`` -> ``("cuda", 1)``, ``"cpu"`` -> ``("cpu", None)`` (as ``torch.device`` parses it)."""
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda", "mps", "xpu", "meta") or (index and not index.isdigit()):
        raise ValueError(f"unknown device {str(device)!r}; expected cpu, cuda or cuda:N")
    return kind, int(index) if index else None


def device_defaults(device: str | torch.device) -> DeviceDefaults:
    """The dtype and attention backend a device runs best with (module docstring)."""
    if parse_device(device)[0] == "cuda":
        return DeviceDefaults("bfloat16", "triton")
    return DeviceDefaults("float32", "torch")


def bind_device(device: torch.device) -> None:
    """Make ``device`` the current CUDA device, so that Triton launches and any allocation that
    names no index land on it (``--device cuda:1``). No-op elsewhere."""
    if device.type == "cuda" and device.index is not None:
        import torch

        torch.cuda.set_device(device)


class WorkerPlacement(NamedTuple):
    """Where one local worker runs: its ``device`` config value and extra environment."""

    device: str
    env: dict[str, str]


def visible_gpus() -> list[str]:
    """This process's GPUs as ``CUDA_VISIBLE_DEVICES`` entries (index i is ``cuda:i``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def parse_gpu_ids(text: str | None) -> list[int] | None:
    """``"0,2"`` -> ``[0, 2]`` (``--gpu-ids``); None stays None."""
    if text is None:
        return None
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--gpu-ids must be comma-separated device numbers, got {text!r}"
        ) from None
    if not ids or min(ids) < 0:
        raise ValueError(f"--gpu-ids must list device numbers >= 0, got {text!r}")
    return ids


def plan_worker_devices(
    engine_config: dict[str, Any], num_workers: int, gpu_ids: list[int] | None = None
) -> list[WorkerPlacement]:
    """One placement per local worker (see the module docstring); raises ``ValueError`` with
    what to change when workers would share a GPU without splitting its memory."""
    device = str(engine_config.get("device", "cpu"))
    kind, index = parse_device(device)
    if num_workers == 0:  # only remote workers: they choose their own devices
        return []
    if kind != "cuda":
        if gpu_ids is not None:
            raise ValueError(f"--gpu-ids needs --device cuda, got {device}")
        return [WorkerPlacement(device, {}) for _ in range(num_workers)]
    gpus = visible_gpus()
    # A worker's ranks on this host: tp x pp (pipeline ranks run on one host), over the nodes.
    per_worker = (
        int(engine_config.get("tensor_parallel_size", 1))
        * int(engine_config.get("pipeline_parallel_size", 1))
        // int(engine_config.get("nnodes", 1))
    )
    if per_worker > 1:
        return _tensor_parallel_placements(gpus, index, num_workers, per_worker, gpu_ids)
    if index is not None:  # an explicit device: every worker on it
        if gpu_ids is not None:
            raise ValueError("give either --device cuda:N or --gpu-ids, not both")
        ordinals = [index] * num_workers
    else:
        pool = gpu_ids if gpu_ids is not None else list(range(len(gpus)))
        if not pool:
            raise ValueError("--device cuda: no GPU is visible (CUDA_VISIBLE_DEVICES / driver)")
        ordinals = [pool[i % len(pool)] for i in range(num_workers)]
    bad = [o for o in ordinals if o >= len(gpus)]
    if bad:
        raise ValueError(f"GPU {bad[0]} does not exist: this process sees {len(gpus)} GPU(s)")
    _check_sharing(engine_config, Counter(ordinals))
    return [WorkerPlacement("cuda:0", {"CUDA_VISIBLE_DEVICES": gpus[o]}) for o in ordinals]


def _tensor_parallel_placements(
    gpus: list[str], index: int | None, num_workers: int, per_worker: int, gpu_ids: list[int] | None
) -> list[WorkerPlacement]:
    """Tensor-parallel workers: ``per_worker`` GPUs each (its ranks on this host use ``cuda:0``,
    ``cuda:1``, ... of its own ``CUDA_VISIBLE_DEVICES``), never shared between workers."""
    if index is not None:
        raise ValueError("with --tp, give --device cuda (and --gpu-ids), not cuda:N")
    pool = gpu_ids if gpu_ids is not None else list(range(len(gpus)))
    need = num_workers * per_worker
    if len(pool) < need:
        raise ValueError(
            f"{num_workers} worker(s) x {per_worker} tensor-parallel ranks need {need} GPUs; "
            f"{len(pool)} available"
        )
    bad = [o for o in pool[:need] if o >= len(gpus)]
    if bad:
        raise ValueError(f"GPU {bad[0]} does not exist: this process sees {len(gpus)} GPU(s)")
    return [
        WorkerPlacement(
            "cuda:0",
            {
                "CUDA_VISIBLE_DEVICES": ",".join(
                    gpus[o] for o in pool[w * per_worker : (w + 1) * per_worker]
                )
            },
        )
        for w in range(num_workers)
    ]


def _check_sharing(engine_config: dict[str, Any], per_gpu: Counter[int]) -> None:
    gpu, n = per_gpu.most_common(1)[0]
    if (
        n < 2
        or engine_config.get("num_pages") is not None
        or engine_config.get("memory_budget") is not None
    ):
        return
    util = float(engine_config.get("memory_utilization", DEFAULT_MEMORY_UTILIZATION))
    if "memory_utilization" in engine_config and util * n <= 1.0:
        return
    raise ValueError(
        f"{n} workers would share GPU {gpu}, each budgeting {util:.2f} of its memory: give each worker its own "
        f"GPU (--gpu-ids, one per worker, or fewer --workers), or split the GPU explicitly with "
        f"--memory-utilization {0.9 / n:.2f} (workers x share <= 1), --memory-budget or --num-pages per worker"
    )
