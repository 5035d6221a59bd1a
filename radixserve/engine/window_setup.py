"""Whether a sliding-window model gets a window pool, and how the KV budget splits.

A model with sliding-window layers keeps their KV in a pool of its own
(:mod:`radixserve.memory.window_pool`), freed as requests move past the window, when
``window_kv_ratio > 0`` and nothing needs every layer's pages in one layout: the
hierarchical cache's L3 (page files and shared stores hold whole pages) or an L2 in another
KV dtype (``hicache_dtype``), prefill/decode disaggregation (its transfers copy whole
pages of every layer: ``KVPool.page_tensors``), and pipeline parallelism (the stages' plans do not carry
the window map yet). Those keep full KV for every layer, as before (exact, but
without the window's memory saving), and a start-up warning says why. int8/int4 KV works
(the window layers' per-token scales are paged in the window pool with their data), and so
does an L2 alone (:mod:`radixserve.memory.window_host`). So does tensor parallelism: rank 0's
scheduler owns both allocators, and every step's message carries the window map entries it
changed (``StepPlan.window_writes``), which each rank applies to its own map before the
forward, as it applies the page-table writes (:mod:`radixserve.distributed.step_wire`).

The budget: with ``num_pages`` sized for full KV of every layer (``L`` layers, ``Lw`` of
them windowed) and ratio ``r`` window pages per global page, the same bytes hold
``G = num_pages * L / (L - Lw + r * Lw)`` global pages and ``ceil(r * G)`` window pages.
A ``--num-pages`` given by hand is the global page count as it is.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

from radixserve.engine.config import EngineConfig
from radixserve.model.config import ModelConfig

logger = logging.getLogger(__name__)

__all__ = ["WindowPoolPlan", "plan_window_pool"]


class WindowPoolPlan(NamedTuple):
    layers: frozenset[int]  # the sliding-window layers
    window: int
    num_pages: int  # global pages (the allocator's; the pool has one more, the scratch page)
    num_window_pages: int  # window pages (likewise)


def window_pool_refusal(cfg: EngineConfig, mc: ModelConfig, window_map: bool) -> str | None:
    """Why this engine keeps full KV for the window layers (None: it gets a window pool).
    ``window_map``: every rank of the engine's topology gets the window map with each step
    (Topology.carries_window_map: one process and tensor parallelism; not pipeline stages)."""
    if cfg.window_kv_ratio <= 0:
        return "window_kv_ratio is 0"
    if cfg.hierarchical_cache and (
        cfg.hicache_storage_dir is not None
        or cfg.hicache_storage_backend == "mooncake"
        or cfg.hicache_dtype != "auto"
    ):
        return (
            "the hierarchical cache's L3 and converted L2 formats take whole pages of every layer"
        )
    if cfg.disaggregation_mode is not None:
        return "prefill/decode disaggregation transfers whole pages of every layer"
    if not window_map:
        return "pipeline parallelism does not carry the window map to its stages yet"
    windows = {mc.layer_window(i) for i in range(mc.num_layers)} - {None}
    if len(windows) > 1:
        return f"layers with different windows {sorted(w for w in windows if w)}"
    return None


def plan_window_pool(
    cfg: EngineConfig, mc: ModelConfig, num_pages: int, window_map: bool
) -> WindowPoolPlan | None:
    """The window pool of a sliding-window model, or None (no window layer, or refused);
    ``window_map`` as :func:`window_pool_refusal`'s."""
    layers = frozenset(i for i in range(mc.num_layers) if mc.layer_window(i) is not None)
    if not layers:
        return None
    refusal = window_pool_refusal(cfg, mc, window_map)
    if refusal is not None:
        # A warning unless asked for (ratio 0): the pool the user expects is not there, and
        # the KV sized for it holds fewer sequences (the model itself stays exact).
        log = logger.info if cfg.window_kv_ratio <= 0 else logger.warning
        log("no window pool: sliding-window layers keep every token's KV (%s)", refusal)
        return None
    window = mc.layer_window(min(layers))
    assert window is not None
    r = cfg.window_kv_ratio
    if cfg.num_pages is None:  # sized for full KV of every layer: the same bytes, split
        n_layers = mc.num_layers
        num_pages = int(num_pages * n_layers / (n_layers - len(layers) + r * len(layers)))
    return WindowPoolPlan(layers, window, num_pages, max(1, math.ceil(r * num_pages)))
