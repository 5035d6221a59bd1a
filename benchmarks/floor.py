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
    """GB/s of one reduction over ``src`` (512 MiB: far past any cache) on the process's
    torch threads: a pure read, as a decode step's weights are. (A copy's bytes read plus
    written over its time overstates it: ~80 against ~40 GB/s on the 2-core VM.) A VM's
    bandwidth drifts by up to 1.5x within minutes: sample it beside what it is compared
    with, not once."""
    t = time.perf_counter()
    src.sum()
    return src.numel() * src.element_size() / (time.perf_counter() - t) / 1e9


def read_source() -> torch.Tensor:
    """The 512 MiB tensor :func:`read_gbs` reads."""
    return torch.ones(128 << 20, dtype=torch.float32)


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
