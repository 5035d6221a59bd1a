"""The weight-streaming floor: the time to read every weight once at the memory bandwidth the
machine shows reading a large tensor. A batch-1 decode step cannot be faster (its weights
come from memory, not the caches: each is read once per step and the whole model is larger
than the caches between two reads of one weight), so a step's time over it says how much
goes to anything other than streaming the weights.

``read_gbs(src)`` samples the bandwidth; ``checkpoint_weight_bytes(dir, dtype)`` counts a
checkpoint's weights at the dtype served, for a benchmark that has no engine in its process
(``bench_runner_step.py`` counts its engine's parameters instead: the same bytes).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from safetensors import safe_open


def read_gbs(src: torch.Tensor) -> float:
    """GB/s of one reduction over ``src`` (512 MiB: far past any cache; on a GPU, synchronized) on the process's
    torch threads: a pure read, as a decode step's weights are. (A copy's bytes read plus
    written over its time overstates it: ~80 against ~40 GB/s on the 2-core VM.) A VM's
    bandwidth drifts by up to 1.5x within minutes: sample it beside what it is compared
    with, not once."""
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    src.sum()  # a GPU's first reduction pays for its kernel's load
    sync()
    t = time.perf_counter()
    src.sum()
    sync()
    return src.numel() * src.element_size() / (time.perf_counter() - t) / 1e9


def read_source(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 512 MiB tensor :func:`read_gbs` reads: on transparent huge pages where the kernel
    grants them, as a CPU engine holds its weights (``radixserve.memory.hugepages``).

    On 4 KB pages the rate depends on where the allocation lands: on the 2-core VM, four such
    tensors in one process read at 20, 22, 23 and 25 GB/s, each the same in every round,
    while four on huge pages read at 26.6-27.6 GB/s, and an engine's own weights (read in
    place) at 28.6-29.1: a 4 KB-page source could put the floor up to ~1.4x too high.
    On a CUDA ``device`` the weights stream from HBM: the source is a device tensor there."""
    if torch.device(device).type == "cuda":  # HBM: 1 GiB, far past the L2 cache
        return torch.ones(1 << 28, dtype=torch.float32, device=device)
    from radixserve.memory.hugepages import hugepage_buffer

    nbytes = 512 << 20
    buf = hugepage_buffer(nbytes)
    src = buf.view(torch.float32) if buf is not None else torch.empty(nbytes // 4)
    return src.fill_(1.0)


def checkpoint_weight_bytes(model_dir: str | Path, dtype: torch.dtype) -> int:
    """Bytes of a safetensors checkpoint's weights held in ``dtype`` (a tied head, absent
    from the file, counted once, as a step reads it once)."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(f.get_slice(name).get_shape())
    return total * size


def checkpoint_matmul_weights(model_dir: str | Path) -> int:
    """Multiply-adds per prompt token in a checkpoint's linear layers: the elements of every
    2-D ``*_proj.weight`` (attention and MLP projections; not the embedding, and not the head,
    which a prefill runs on its last row only). Two FLOPs each per token: the linear part of a
    prefill's compute floor (``profile_long_context.py`` counts its engine's modules instead:
    the same weights)."""
    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = f.get_slice(name).get_shape()
                if name.endswith("_proj.weight") and len(shape) == 2:
                    total += math.prod(shape)
    return total
