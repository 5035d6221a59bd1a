"""The paged KV pool: K and V storage for every layer, in the configured KV-cache dtype.

Layout (one layer; ``radixkernels.kv_format`` is the source of truth, shared with the
kernels and the memory planner)::

    k_data[layer]  [num_pages, page_size, kv_heads, packed_head_dim]  storage dtype
    v_data[layer]  same

              page 0                 page 1                       page num_pages-1
          +-----------------+  +-----------------+          +-----------------+
    slot  | 0 | 1 | ... |P-1|  | P |P+1| ...|2P-1|   ...    |   ...   | N*P-1 |
          +-----------------+  +-----------------+          +-----------------+
            each slot = one token: [kv_heads, packed_head_dim]

    slot = page * page_size + offset        flat view: [num_pages * page_size, kv_heads, packed_head_dim]

    k_scale[layer], v_scale[layer]  (float32, None for kv_dtype "auto")
        int8 / int4   [num_pages, page_size, kv_heads]  per token and head, written by store_kv
                      (a window layer's: [num_window_pages, ...], paged like its data)
        fp8_e4m3/e5m2 [kv_heads]                        static per head, 1.0 unless calibrated

Per-token scales sit in their own tensor indexed exactly like the data (same page, same
offset), so a page id addresses data and scales alike and eviction never has to know the
dtype. All layers of K live in one allocation (``k_data`` holds per-layer views), likewise V:
one big allocation instead of 2 × num_layers, and the per-layer views stay contiguous.

The pool knows nothing of requests or the tree: the page allocator hands out page ids and
the radix cache tracks which pages hold which tokens.
"""

from __future__ import annotations

import math
import os

import torch

from radixkernels.kv_format import SCALE_DTYPE, KVCacheDtype, KVFormat
from radixserve.memory.hugepages import HUGE_PAGE, hugepage_buffer
from radixserve.memory.release import discard


def kv_hugepages_enabled() -> bool:
    """Whether a CPU pool asks for transparent huge pages (``RADIXSERVE_KV_HUGEPAGES=0``:
    plain allocations, e.g. to measure the difference)."""
    return os.environ.get("RADIXSERVE_KV_HUGEPAGES", "1") != "0"


def zeroed_storage(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool
) -> torch.Tensor:
    """A zero-filled tensor for K or V pages: on the CPU, on memory advised ``MADV_HUGEPAGE``
    where the platform grants it.

    A decode step reads every page of every running sequence's context, layer after layer:
    at 7,500 tokens of SmolLM2 that is ~5.8 MB of K and V per layer, in 4 KB pages about
    1,400 translations per layer, past what a core's second-level TLB holds alongside the
    weights' (which already sit on huge pages, :mod:`radixserve.memory.hugepages`). On 2 MB
    pages the same context is three translations. Pools smaller than one huge page stay
    plain allocations. Anonymous memory starts zeroed, as the pool's contract needs.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type == "cpu" and not pin and nbytes >= HUGE_PAGE and kv_hugepages_enabled():
        buf = hugepage_buffer(nbytes)
        if buf is not None:
            return buf.view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)


class KVPool:
    """``num_pages`` pages of ``page_size`` tokens of K and V for every layer.

    Data starts zeroed (and per-token scales at zero), so an unwritten slot reads back as 0
    rather than garbage: a kernel that loads a padded slot and masks it with a zero weight
    then cannot produce ``0 * NaN``.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        kv_dtype: KVCacheDtype | str = "auto",
        act_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        window_layers: frozenset[int] = frozenset(),
        num_window_pages: int = 0,
    ) -> None:
        """``window_layers`` (a sliding-window model with its own window pool,
        :mod:`~radixserve.memory.window_pool`): those layers' K and V live in a second
        allocation of ``num_window_pages`` pages, addressed by window page ids."""
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.fmt: KVFormat = KVFormat.create(kv_dtype, act_dtype, head_dim)
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)

        self.window_layers = frozenset(window_layers) if num_window_pages else frozenset()
        self.num_window_pages = num_window_pages if self.window_layers else 0
        if self.window_layers and (
            min(self.window_layers) < 0 or max(self.window_layers) >= num_layers
        ):
            raise ValueError(f"window layers {sorted(self.window_layers)} out of range")
        shape = (
            num_layers - len(self.window_layers),
            num_pages,
            page_size,
            kv_heads,
            self.fmt.packed_head_dim,
        )
        dtype = self.fmt.storage_dtype
        # Pinned host memory (the L2 tier on CUDA) lets page copies to and from the GPU run
        # asynchronously on a copy stream.
        pin = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        self._k = zeroed_storage(shape, dtype, self.device, pin)
        self._v = zeroed_storage(shape, dtype, self.device, pin)
        self._kw = self._vw = None
        if self.window_layers:
            wshape = (len(self.window_layers), num_window_pages, *shape[2:])
            self._kw = zeroed_storage(wshape, dtype, self.device, pin)
            self._vw = zeroed_storage(wshape, dtype, self.device, pin)
        self.k_data: list[torch.Tensor] = self._per_layer(self._k, self._kw)
        self.v_data: list[torch.Tensor] = self._per_layer(self._v, self._vw)

        self._k_scale, self._kw_scale = self._scales(shape[0], pin)
        self._v_scale, self._vw_scale = self._scales(shape[0], pin)
        self.k_scale: list[torch.Tensor] | None = None
        self.v_scale: list[torch.Tensor] | None = None
        if self._k_scale is not None and self._v_scale is not None:
            if self.fmt.kv_dtype.has_token_scales:
                self.k_scale = self._per_layer(self._k_scale, self._kw_scale)
                self.v_scale = self._per_layer(self._v_scale, self._vw_scale)
            else:
                self.k_scale = list(self._k_scale.unbind(0))
                self.v_scale = list(self._v_scale.unbind(0))

    def _scales(self, global_layers: int, pin: bool) -> tuple[torch.Tensor | None, ...]:
        """K's (or V's) scales: (the global layers' or all layers', the window layers' or None).
        Per-token scales are paged like the data, a window layer's in the window pool; per-head
        scales (fp8) are one row per layer, not paged."""
        kd, ps, h, dev = self.fmt.kv_dtype, self.page_size, self.kv_heads, self.device
        if kd.has_head_scales:
            return torch.ones((self.num_layers, h), dtype=SCALE_DTYPE, device=dev), None
        if not kd.has_token_scales:
            return None, None
        full = torch.zeros(
            (global_layers, self.num_pages, ps, h), dtype=SCALE_DTYPE, device=dev, pin_memory=pin
        )
        if not self.window_layers:
            return full, None
        wshape = (len(self.window_layers), self.num_window_pages, ps, h)
        return full, torch.zeros(wshape, dtype=SCALE_DTYPE, device=dev, pin_memory=pin)

    def _per_layer(self, full: torch.Tensor, window: torch.Tensor | None) -> list[torch.Tensor]:
        """Per-layer views in layer order: global layers from ``full``, window layers from
        ``window``."""
        fulls, wins = iter(full.unbind(0)), iter(() if window is None else window.unbind(0))
        return [
            next(wins) if i in self.window_layers else next(fulls) for i in range(self.num_layers)
        ]

    @property
    def num_slots(self) -> int:
        """Token slots per layer: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes the pool occupies on its device, scales included."""
        total = self._k.nbytes + self._v.nbytes
        if self._kw is not None and self._vw is not None:
            total += self._kw.nbytes + self._vw.nbytes
        if self._k_scale is not None and self._v_scale is not None:
            total += self._k_scale.nbytes + self._v_scale.nbytes
        if self._kw_scale is not None and self._vw_scale is not None:
            total += self._kw_scale.nbytes + self._vw_scale.nbytes
        return total

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page costs across all layers, K and V, per-token scales included."""
        return self.fmt.bytes_per_token(self.num_layers, self.kv_heads) * self.page_size

    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by page, as ``[num_layers, num_pages, ...]``: K and V data and,
        for int8/int4, their per-token scales. Copying a page means copying index ``page`` of
        dimension 1 of each (fp8's per-head scales are not per page and never move)."""
        if self.window_layers:
            raise RuntimeError("a pool with window layers has no single page layout to copy")
        out = [self._k, self._v]
        if self.fmt.kv_dtype.has_token_scales:
            assert self._k_scale is not None and self._v_scale is not None
            out += [self._k_scale, self._v_scale]
        return out

    def part_tensors(self, window: bool) -> list[torch.Tensor]:
        """A window pool's page-indexed tensors of one part, as ``[layers, pages, ...]``: the
        global layers' (indexed by global page id) or the window layers' (by window page id),
        K, V and their per-token scales. A page of every layer is one index into each part."""
        if not self.window_layers:
            raise RuntimeError("a pool without window layers has one part: page_tensors()")
        parts = (self._kw, self._vw, self._kw_scale, self._vw_scale)
        if not window:
            parts = (self._k, self._v, self._k_scale, self._v_scale)
        n = 4 if self.fmt.kv_dtype.has_token_scales else 2
        return [t for t in parts[:n] if t is not None]

    def layout(self, heads: bool = True) -> str:
        """A string that differs whenever a page's bytes would mean something else.
        ``heads=False``: without the KV head count, for pools that hold different head slices
        of one model (tensor-parallel ranks) and exchange them head by head."""
        windows = (
            f"-W{','.join(map(str, sorted(self.window_layers)))}" if self.window_layers else ""
        )
        h = f"H{self.kv_heads}-" if heads else ""
        return (
            f"L{self.num_layers}-P{self.page_size}-{h}D{self.head_dim}-"
            f"{self.fmt.kv_dtype.value}-{str(self.fmt.storage_dtype).removeprefix('torch.')}"
            f"{windows}"
        )

    def zero_pages(self, pages: list[int]) -> None:
        """Reset ``pages`` (all layers, K and V, per-token scales) to the pool's zeroed start state
        (after a warm-up wrote scratch rows into them)."""
        idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
        windows: tuple[torch.Tensor | None, ...] = ()
        if self._kw is not None:
            windows = (self._kw, self._vw)
            if self._kw_scale is not None:
                windows += (self._kw_scale, self._vw_scale)
        for t in (self._k, self._v, *windows) + (
            (self._k_scale, self._v_scale) if self.fmt.kv_dtype.has_token_scales else ()
        ):
            assert t is not None
            if any(t is x for x in windows):  # window page ids: zero those that exist
                widx = idx[idx < t.shape[1]]
                (t.view(torch.uint8) if t.element_size() == 1 else t).index_fill_(1, widx, 0)
                continue
            # fp8 storage has no fill kernels: zero its bytes (0x00 is +0.0 in both fp8 formats).
            (t.view(torch.uint8) if t.element_size() == 1 else t).index_fill_(1, idx, 0)

    def release_memory(self) -> int:
        """Give every page's memory back to the OS (K, V, the window pool's, per-token
        scales; :func:`~radixserve.memory.release.discard`): the pool reads as zeros, as when
        it was made, and its pages fault in again as they are written. The caller makes sure
        no page holds KV anyone reads (the cache flushed, nothing running); fp8's per-head
        scales are not paged and stay. Returns the bytes given back."""
        tensors = [self._k, self._v, self._kw, self._vw]
        if self.fmt.kv_dtype.has_token_scales:
            tensors += [self._k_scale, self._v_scale, self._kw_scale, self._vw_scale]
        return sum(discard(t) for t in tensors if t is not None)

    def k_flat(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K as ``[slots, kv_heads, packed_head_dim]`` (a view; a window
        layer's slots are its window pool's)."""
        return self.k_data[layer].view(-1, self.kv_heads, self.fmt.packed_head_dim)

    def v_flat(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V as ``[num_slots, kv_heads, packed_head_dim]`` (a view)."""
        return self.v_data[layer].view(-1, self.kv_heads, self.fmt.packed_head_dim)

    def __repr__(self) -> str:
        return (
            f"KVPool(layers={self.num_layers}, pages={self.num_pages}, page_size={self.page_size}, "
            f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, kv_dtype={self.fmt.kv_dtype.value}, "
            f"storage={self.fmt.storage_dtype}, device={self.device}, {self.nbytes / 2**20:.1f} MiB)"
        )
