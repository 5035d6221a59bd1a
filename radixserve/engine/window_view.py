"""The window layers' view of a step's batch, for a model with a window pool.

The scheduler and the runner's page table deal in global page ids only; the window
layers' KV lives in the window pool (:mod:`radixserve.memory.window_pool`) under window
page ids. The runner keeps the map from one to the other on the device (and a host mirror),
patched from each plan's ``window_writes``, and derives per forward::

    window page table   map[page_table]                      one gather on the device
    window KV slots     map[slot // page_size] * page_size + slot % page_size
    window page lists   host: the scratch page before each sequence's first window page,
                        mapped pages from there (the only ones any window path reads)

Global pages whose window pages were released map to the window pool's scratch page;
no attention path reads them (each reads only the pages some new row's window reaches).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from radixserve.memory.window_pool import first_window_page
from radixserve.model.forward_batch import ForwardBatch
from radixserve.scheduling.plan import StepPlan

if TYPE_CHECKING:
    from radixserve.memory.window_pool import WindowPages

__all__ = ["check_window_map", "patch_window_host", "window_view"]


def check_window_map(
    table: torch.Tensor | None, host_table: list[int], scratch: int, pages: WindowPages
) -> None:
    """The runner's device map ``table`` and its host mirror, with the entries the next
    plan will send applied, equal the window pool's map (invariant checks; reads the device)."""
    assert table is not None, "a window pool without the runner's map"
    device = table.tolist()
    pending = dict(pages._writes)
    for g, w in enumerate(pages.table):
        want = scratch if w < 0 else w
        dev = pending.get(g, device[g])
        host = pending.get(g, host_table[g])
        dev = scratch if dev < 0 else dev
        host = scratch if host < 0 else host
        assert dev == host == want, (
            f"window map of page {g}: device {dev}, host {host}, pool {want}"
        )


def patch_window_host(
    host: list[int], pages: list[int], windows: list[int], scratch: int
) -> list[int]:
    """Apply a plan's map entries to the host mirror; returns the window pages to write on
    the device (-1, "none", becomes the scratch page)."""
    out = [scratch if w < 0 else w for w in windows]
    for g, w in zip(pages, out):
        host[g] = w
    return out


def window_view(
    batch: ForwardBatch, plan: StepPlan, table: torch.Tensor, host: list[int], window: int
) -> ForwardBatch:
    """``batch`` as the window layers read it (see the module docstring)."""
    ps = batch.page_size
    assert batch.page_table is not None and batch.out_cache_loc is not None
    pt = batch.page_table
    wpt = table.index_select(0, pt.reshape(-1).to(torch.int64)).view(pt.shape).to(pt.dtype)
    slots = batch.out_cache_loc
    wslots = table.index_select(0, torch.div(slots, ps, rounding_mode="floor")) * ps + slots % ps
    scratch = host[-1]  # the global scratch page never gets a window page of its own
    lists = []
    for pages, prefix in zip(plan.page_lists, plan.prefix_lens):
        lo = min(first_window_page(prefix, window, ps), len(pages))
        lists.append([scratch] * lo + [host[g] for g in pages[lo:]])
    return dataclasses.replace(
        batch, out_cache_loc=wslots, page_table=wpt, page_lists_cpu=lists, window_view=None
    )
