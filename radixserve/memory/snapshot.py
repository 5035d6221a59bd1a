"""Device memory: how much there is (:func:`device_total_bytes`, :func:`cpu_available_bytes`)
and what is in use now (:func:`memory_snapshot`, for the workers' metrics).

CUDA figures come from the driver and the caching allocator; on the CPU the "device" is
the machine's RAM, shared with everything else, and the process's use is its RSS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def device_total_bytes(device: torch.device | str) -> int:
    """Total memory of the device (GPU memory, or the machine's RAM for the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "device cuda requested but torch.cuda.is_available() is False (use --device cpu)"
            )
        return int(torch.cuda.mem_get_info(device)[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_available_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (free RAM the kernel can hand out without swapping)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return device_total_bytes("cpu")


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory in use now. CUDA: the caching allocator's counters; CPU: the process's RSS."""

    device: str
    allocated_bytes: int  # CUDA: tensors alive; CPU: process RSS
    reserved_bytes: int  # CUDA: held by the caching allocator; CPU: process RSS
    total_bytes: int  # device memory (GPU) or machine RAM (CPU)
    rss_bytes: int  # resident set of this process (host memory), both cases
    pool_bytes: int  # the KV pool's size, as told by the caller


def process_rss_bytes() -> int:
    """Resident set size of this process (from /proc/self/statm; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def memory_snapshot(device: torch.device | str = "cpu", pool_bytes: int = 0) -> MemorySnapshot:
    """What is in use on ``device`` now (cheap: no device sync, for metrics)."""
    dev = torch.device(device)
    rss = process_rss_bytes()
    if dev.type == "cuda":
        return MemorySnapshot(
            device=str(dev),
            allocated_bytes=int(torch.cuda.memory_allocated(dev)),
            reserved_bytes=int(torch.cuda.memory_reserved(dev)),
            total_bytes=device_total_bytes(dev),
            rss_bytes=rss,
            pool_bytes=pool_bytes,
        )
    return MemorySnapshot(
        device=str(dev),
        allocated_bytes=rss,
        reserved_bytes=rss,
        total_bytes=device_total_bytes(dev),
        rss_bytes=rss,
        pool_bytes=pool_bytes,
    )
