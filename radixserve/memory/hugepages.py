"""A CPU model's weights moved onto transparent huge pages.

A decode step streams every weight once, in ~120 separate 0.7-3.5 MB matrices for SmolLM2.
On 4 KB pages each matrix spans hundreds of pages, and the page walks of the kernels'
streams cost bandwidth, the more so the faster the memory: on the project's 2-core VM the
layers' GEMVs read 3-9 % faster and a batch-1 step takes 2-5 % less time once the weights
sit on 2 MB pages, when the memory reads ~50 GB/s, and about the same at ~35 GB/s
(``benchmarks/bench_hugepages.py``). torch's own ``THP_MEM_ALLOC_ENABLE`` only covers
single allocations of 2 MB and more, and weights loaded from a safetensors memory map are
file pages, so :func:`move_to_hugepages` copies them into one anonymous mapping advised
``MADV_HUGEPAGE`` (honoured where the kernel's ``transparent_hugepage/enabled`` is
``madvise`` or ``always``; elsewhere it is plain memory and nothing is lost but the copy).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each storage starts on a cache line


def _dense_cpu_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Every strided CPU parameter and buffer of ``module`` (each object once)."""
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen or t.device.type != "cpu" or t.layout is not torch.strided:
            continue
        seen.add(id(t))
        yield t


def _span(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """The bytes [lo, hi) of their common storage that ``tensors`` view, ``lo`` rounded down
    to a multiple of 8 (any element size divides it: every tensor keeps a whole-element offset)."""
    lo: int | None = None
    hi = 0
    for t in tensors:
        if not t.numel():
            continue
        es = t.element_size()
        first = int(t.storage_offset()) * es
        last_element = sum((int(n) - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        lo = first if lo is None else min(lo, first)
        hi = max(hi, first + (last_element + 1) * es)
    return (0, 0) if lo is None else (lo - lo % 8, hi)


def hugepage_buffer(nbytes: int) -> torch.Tensor | None:
    """A zero-filled uint8 tensor of ``nbytes`` on memory advised ``MADV_HUGEPAGE``, starting
    on a 2 MB boundary, or None where the platform has no such advice."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return None
    # Private: a shared anonymous mapping is shmem, which THP's anon setting does not cover.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)  # not yet touched
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(advice, start, nbytes)
    except OSError as e:  # a kernel built without THP
        logger.debug("MADV_HUGEPAGE refused: %s", e)
        return None
    return whole[start : start + nbytes]


def move_to_hugepages(module: nn.Module) -> int:
    """Copy ``module``'s CPU parameters and buffers into one huge-page buffer, in place.

    Tensors sharing a storage (tied embeddings, views such as a fused weight's slices) keep
    sharing it: each storage is copied once and every tensor becomes the same view of the
    copy (through ``.data``, so the parameter objects and anything holding them stay valid;
    tensors made from them earlier, e.g. ``.detach()`` views, do not follow: call this
    before deriving any). Returns the bytes moved (0 where huge pages are unavailable).
    """
    groups: dict[int, list[torch.Tensor]] = {}
    for t in _dense_cpu_tensors(module):
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    # Per storage, the bytes its tensors use (a storage may hold more than they view).
    spans = {key: _span(tensors) for key, tensors in groups.items()}
    offsets, total = {}, 0
    for key, (lo, hi) in spans.items():
        offsets[key] = total
        total += -(-(hi - lo) // _ALIGN) * _ALIGN
    arena = hugepage_buffer(total) if total else None
    if arena is None:
        return 0
    base = arena.storage_offset()  # bytes into the mapping: a multiple of 4096
    shared = arena.untyped_storage()
    for key, tensors in groups.items():
        lo, hi = spans[key]
        src = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
        arena[offsets[key] : offsets[key] + hi - lo].copy_(src[lo:hi])
        start = base + offsets[key] - lo  # where byte 0 of the old storage would lie
        for t in tensors:
            # Same sizes, strides and element offset, now counted from the copy.
            offset = start // t.element_size() + t.storage_offset()
            t.data = torch.empty(0, dtype=t.dtype).set_(shared, offset, t.shape, t.stride())
    logger.debug("moved %d MB of weights onto huge pages", total >> 20)
    return total


def vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (``hg``: advised
    ``MADV_HUGEPAGE``), from ``/proc/self/smaps``; empty where there is none."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return []
    inside = False
    for line in smaps.read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []
