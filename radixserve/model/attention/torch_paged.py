"""Paged attention on the CPU: the C++ kernel of ``native.py``, or plain torch.

On the CPU with an unquantized pool the store of the new K/V and the attention of the whole
batch are one call per layer to the kernel of ``csrc/paged_attention.cpp`` (same two parts
as below, read from the pages in place; 1.4-1.9x the torch path per layer call here,
``benchmarks/bench_cpu_attention.py``). int8, int4 and fp8 pools take the same kernel over
their codes (``csrc/paged_attention_quant.h``: each chunk of keys decoded as ``_gather``
below dequantizes, int4's in the rotated basis; their new rows quantized in the same call as
``store_kv_ref`` does, bit for bit). The torch path below serves other devices, head sizes
the kernel lacks, and machines where it cannot be built; it is also the baseline the Triton
kernels match.

Each layer call (1) stores the step's new K/V rows into the pool at ``batch.out_cache_loc``
and (2) attends over every sequence's whole history read back from the pool::

    pool (one layer)  [num_pages, page_size, kv_heads, head_dim]; flat slot = page * page_size + offset
    position j of sequence b lives in page page_table[b, j // page_size] at offset j % page_size

Each sequence's keys split in two parts (cascade attention, see ``cascade.py``):

    shared part:  leading pages the sequence shares with others of the batch (a cached
                  system prompt, few-shot examples, a forked trunk). Every member's new
                  rows attend to them in one call, the pages read once per group.
    own part:     the rest of its history, new rows included.
                  decode sequences (1 new row): batched calls over [B, pages * page_size]
                    gathers of whole pages, positions past each sequence's end masked; the
                    query heads of one KV head ride in the query-length axis
                  extend sequences (n new rows): per sequence, the rows over the keys
                    before them (no mask), then causally over their own n keys, merged

Each part returns its output and its scores' log-sum-exp; the two merge exactly. A
sequence in no group has an empty shared part and its own part is its whole history.
Every history read goes block by block (``blocked.py``): at most ``KV_BLOCK_TOKENS`` keys
per sequence gathered and dequantized at a time, merged by log-sum-exp, so a layer call's
transient memory is bounded by the chunk and the block, whatever the context.

Everything that depends only on the batch (groups, slot indices, masks) is computed once
per forward, from the batch's host page lists, by :meth:`init_forward_metadata` (the model
runner calls it before the forward), and reused by every layer. Quantized pools go through the
reference store / dequantize of ``radixkernels.reference``; the unquantized case is a plain
``index_copy_`` of rows and an ``index_select`` of whole pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.model import native
from radixserve.model.attention.base import AttentionBackend, NativeLayersPlan
from radixserve.model.attention.blocked import (
    KVBlock,
    attend_blocks,
    block_spans,
    masked_attention_blocks,
    rows_with_keys,
)
from radixserve.model.attention.cascade import (
    attention_with_lse,
    merge_partial,
    shared_prefix_groups,
)
from radixserve.model.attention.windowed import window_start
from radixserve.model.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from radixserve.memory.pool import KVPool


@dataclass
class _Shared:
    """Shared-prefix groups attended in one call: queries and keys padded to the largest group."""

    q_rows: (
        torch.Tensor
    )  # [G * Rmax] int64 batch rows of each group's new tokens, padded with row 0
    pages: torch.Tensor  # [G, Smax] int64 each group's shared pages in order, padded with page 0
    keys: list[int]  # each group's shared keys (groups ordered by them, most first)
    mask: torch.Tensor | None  # [G, 1, 1, Smax * page_size] additive key padding (None: no padding)
    rows: torch.Tensor  # [R] int64 the batch rows of every group (each row in one group)
    src: torch.Tensor  # [R] int64 where each of ``rows`` sits in the padded [G * Rmax]
    shape: tuple[int, int]  # (G, Rmax)
    kv: list[list[KVBlock] | None] | None  # per layer: gathered K/V blocks kept across forwards
    key: tuple[int, ...]  # the padded page ids (host), naming the kept K/V


@dataclass
class _Decode:
    rows: torch.Tensor  # [Bd] int64 rows of the decode sequences in the batch, most keys first
    pages: torch.Tensor  # [Bd, P] int64 each sequence's own pages, padded with page 0
    lens: list[int]  # each sequence's own keys (descending)
    mask: torch.Tensor  # [Bd, 1, 1, P * page_size] additive: 0 attended, -inf padding


@dataclass
class _Extend:
    rows: slice  # rows of this sequence in the batch
    pages: torch.Tensor  # its own pages (after its group's), in order
    before: int  # own keys before the new rows (then the n new rows' own keys)


@dataclass
class _BatchMeta:
    decode: _Decode | None
    extends: list[_Extend]
    shared: list[_Shared]
    native: (
        native.AttentionPlan | None
    )  # the whole batch through the CPU kernel (then the rest is empty)


class TorchPagedAttentionBackend(AttentionBackend):
    """Stores new K/V into a ``KVPool`` and attends over the paged history, in torch.

    K/V are gathered a whole page at a time (``page_size`` tokens of one layer are one
    contiguous block), which moves far fewer, larger pieces than a gather per token.
    """

    # Sinks: through the CPU kernel, else the per-sequence masked path (``_masked``).
    supports_sinks = True

    # Shared prefixes shorter than this are attended per sequence: below it the extra
    # attention call and merge cost more than re-reading the pages.
    cascade_min_tokens = 64

    # Bytes of gathered shared-prefix K/V kept from one forward to the next (see _keep_shared).
    shared_kv_bytes = 256 << 20

    def __init__(self, pool: KVPool, native_kernel: bool = True) -> None:
        """``native_kernel``: attend through the CPU kernel of ``native.py`` where it applies
        (CPU, unquantized or quantized pages, a supported head size, the kernel built); False:
        in torch."""
        self.pool = pool
        self.fmt = pool.fmt
        self._quantized = self.fmt.kv_dtype.is_quantized
        pages = pool.k_data[0]
        fits = native.supported_quantized if self._quantized else native.supported
        self._native = (
            native_kernel
            and fits(self.fmt.act_dtype, pages.dtype, pages.device, self.fmt.head_dim)
            and native.load()
        )
        self._meta_batch: ForwardBatch | None = None
        self._meta: _BatchMeta | None = None
        self._window_plans: dict[int, native.AttentionPlan] = {}  # per window, for this batch
        self._shared_kv: dict[tuple[int, ...], list[list[KVBlock] | None]] = {}

    @property
    def row_exact(self) -> bool:
        """Whether a row's attention output is the same bits whatever else the step holds
        (a decode row equals the prefill row of its position): the native kernel's promise."""
        return self._native

    # -- per-forward metadata ------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan the next forward over ``batch`` from its host page lists (no device reads)."""
        assert batch.page_lists_cpu is not None and batch.out_cache_loc is not None, (
            "paged backend needs a paged batch"
        )
        self._meta = self._plan(batch)
        self._meta_batch = batch
        self._window_plans = {}

    def _plan(self, batch: ForwardBatch) -> _BatchMeta:
        ps = batch.page_size
        assert batch.out_cache_loc is not None  # a paged batch (checked by the caller)
        dev = batch.out_cache_loc.device
        lens, news = batch.seq_lens_cpu, batch.extend_lens_cpu
        n_pages = [-(-n // ps) for n in lens]
        host = batch.page_lists_cpu
        assert host is not None
        starts = _starts(news)
        # Shared pages lie wholly before every member's first new row (prefix // page_size).
        caps = [(n - e) // ps for n, e in zip(lens, news)]
        if self._native:
            return _BatchMeta(None, [], [], self._plan_native(host, caps, lens, news, starts, ps))
        found = shared_prefix_groups(host, caps, min_pages=-(-self.cascade_min_tokens // ps))
        skip = [0] * len(lens)  # pages each sequence leaves to its group
        for g in found:
            for m in g.members:
                skip[m] = g.num_pages
        groups = [
            (
                [r for m in g.members for r in range(starts[m], starts[m] + news[m])],
                host[g.members[0]][: g.num_pages],
            )
            for g in found
        ]
        shared = [self._prepare_shared(call, ps, dev) for call in _padded_calls(groups)]
        self._keep_shared(shared, ps)

        own_pages = [host[b][skip[b] : n_pages[b]] for b in range(len(lens))]
        own_lens = [n - s * ps for n, s in zip(lens, skip)]
        decode_idx = [b for b, n in enumerate(news) if n == 1]
        decode = None
        if decode_idx:
            decode = self._prepare_decode(
                [own_pages[b] for b in decode_idx],
                [own_lens[b] for b in decode_idx],
                [starts[b] for b in decode_idx],
                ps,
                dev,
            )
        extends = []
        for b, n in enumerate(news):
            if n == 1:
                continue
            pages = torch.tensor(own_pages[b], dtype=torch.int64, device=dev)
            extends.append(_Extend(slice(starts[b], starts[b] + n), pages, own_lens[b] - n))

        return _BatchMeta(decode, extends, shared, None)

    def _plan_native(
        self,
        host: list[list[int]],
        caps: list[int],
        lens: list[int],
        news: list[int],
        starts: list[int],
        ps: int,
    ) -> native.AttentionPlan:
        """The kernel's plan for the whole batch: groups by shared pages, the rest alone.

        Any shared page is worth sharing there (no extra call, no merge), hence min_pages=1.
        """
        found = shared_prefix_groups(host, caps, min_pages=1)
        grouped = {m for g in found for m in g.members}
        parts = [(g.members, g.num_pages) for g in found] + [
            ([b], 0) for b in range(len(lens)) if b not in grouped
        ]

        def member(b: int, skip: int) -> native.Member:
            return native.Member(
                starts[b], news[b], host[b][skip : -(-lens[b] // ps)], lens[b] - skip * ps
            )

        return native.AttentionPlan.build(
            [
                ([member(b, skip) for b in members], host[members[0]][:skip])
                for members, skip in parts
            ]
        )

    def _window_plan(self, batch: ForwardBatch, window: int) -> native.AttentionPlan:
        """The CPU kernel's plan for the layers with ``window``: every sequence alone (no
        shared pages), its pages from the first one its first new row's window reaches."""
        plan = self._window_plans.get(window)
        if plan is None:
            ps, host = batch.page_size, batch.page_lists_cpu
            assert host is not None
            starts = _starts(batch.extend_lens_cpu)
            parts: list[tuple[list[native.Member], list[int]]] = []
            for b, (length, n) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
                skip = window_start(length - n, window) // ps
                pages = host[b][skip : -(-length // ps)]
                parts.append(([native.Member(starts[b], n, pages, length - skip * ps)], []))
            plan = self._window_plans[window] = native.AttentionPlan.build(parts)
        return plan

    def _prepare_decode(
        self, pages: list[list[int]], lens: list[int], rows: list[int], ps: int, dev: torch.device
    ) -> _Decode:
        """Decode metadata: each sequence's own pages padded to a common width, and the padding
        mask, the sequences ordered by their keys, most first (``blocked.py``)."""
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        pages, lens, rows = (
            [pages[i] for i in order],
            [lens[i] for i in order],
            [rows[i] for i in order],
        )
        width = max(len(p) for p in pages)
        padded = [p + [0] * (width - len(p)) for p in pages]
        j = torch.arange(width * ps, dtype=torch.int64, device=dev)
        padding = j[None, :] >= torch.tensor(lens, dtype=torch.int64, device=dev)[:, None]
        return _Decode(
            rows=torch.tensor(rows, dtype=torch.int64, device=dev),
            pages=torch.tensor(padded, dtype=torch.int64, device=dev),
            lens=lens,
            mask=self._additive(padding)[:, None, None, :],
        )

    def _prepare_shared(
        self, groups: list[tuple[list[int], list[int]]], ps: int, dev: torch.device
    ) -> _Shared:
        """One padded call for ``groups`` (each: its rows, its shared pages), the groups with
        the most shared pages first (``blocked.py``)."""
        groups = sorted(groups, key=lambda grp: -len(grp[1]))
        r_max = max(len(rows) for rows, _ in groups)
        s_max = max(len(pages) for _, pages in groups)
        q_rows = [r for rows, _ in groups for r in rows + [0] * (r_max - len(rows))]
        pages = [p for _, pg in groups for p in pg + [0] * (s_max - len(pg))]
        mask = None
        if any(len(pg) < s_max for _, pg in groups):
            j = torch.arange(s_max * ps, dtype=torch.int64, device=dev)
            keys = torch.tensor([len(pg) * ps for _, pg in groups], dtype=torch.int64, device=dev)
            mask = self._additive(j[None, :] >= keys[:, None])[:, None, None, :]
        return _Shared(
            q_rows=torch.tensor(q_rows, dtype=torch.int64, device=dev),
            pages=torch.tensor(pages, dtype=torch.int64, device=dev).view(len(groups), s_max),
            keys=[len(pg) * ps for _, pg in groups],
            key=tuple(pages),
            mask=mask,
            rows=torch.tensor(
                [r for rows, _ in groups for r in rows], dtype=torch.int64, device=dev
            ),
            src=torch.tensor(
                [g * r_max + i for g, (rows, _) in enumerate(groups) for i in range(len(rows))],
                dtype=torch.int64,
                device=dev,
            ),
            shape=(len(groups), r_max),
            kv=None,
        )

    def _keep_shared(self, calls: list[_Shared], ps: int) -> None:
        """Attach to each call the per-layer K/V its shared pages had in the previous forward.

        While the same groups decode step after step (a system prompt's requests), their
        shared pages and hence the gathered K/V do not change: a gather per layer and step
        is memory traffic for nothing. Kept K/V are keyed by the call's padded page ids and
        dropped at the first forward that does not use them. That is what makes them safe:
        a key used by two consecutive forwards names pages that running requests held
        (locked in the radix cache) throughout, and held pages are never written; a page
        written in a forward is a private page of that forward and in no shared key.
        """
        keys = [c.key for c in calls]
        self._shared_kv = {k: v for k, v in self._shared_kv.items() if k in keys}
        per_token = (
            2 * self.pool.num_layers * self.pool.k_data[0].shape[-2] * self.pool.fmt.head_dim
        )
        per_token *= torch.finfo(self.fmt.act_dtype).bits // 8
        used = sum(len(k) for k in self._shared_kv) * ps * per_token
        for call, key in zip(calls, keys):
            if key not in self._shared_kv:
                if used + len(key) * ps * per_token > self.shared_kv_bytes:
                    continue
                used += len(key) * ps * per_token
                self._shared_kv[key] = [None] * self.pool.num_layers
            call.kv = self._shared_kv[key]

    def _additive(self, hidden: torch.Tensor) -> torch.Tensor:
        # An additive float mask: CPU attention converts a bool mask on every call (every
        # layer), which made attention ~2x slower.
        zeros = torch.zeros(hidden.shape, dtype=self.fmt.act_dtype, device=hidden.device)
        return zeros.masked_fill_(hidden, float("-inf"))

    # -- pool access ---------------------------------------------------------------------

    def _store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        pool = self.pool
        if self._quantized:
            from radixkernels.reference import store_kv_ref

            store_kv_ref(
                pool.k_data[layer_id],
                pool.v_data[layer_id],
                _scale(pool, "k_scale", layer_id),
                _scale(pool, "v_scale", layer_id),
                k,
                v,
                slots,
                self.fmt,
            )
            return
        kd, vd = pool.k_data[layer_id], pool.v_data[layer_id]
        kd.view(-1, kd.shape[-2], kd.shape[-1]).index_copy_(0, slots, k.to(kd.dtype))
        vd.view(-1, vd.shape[-2], vd.shape[-1]).index_copy_(0, slots, v.to(vd.dtype))

    def _gather(
        self, layer_id: int, pages: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole ``pages``: ``[len(pages) * page_size, kv_heads, head_dim]`` in ``dtype``."""
        pool = self.pool
        kd, vd = pool.k_data[layer_id], pool.v_data[layer_id]
        h, dp = kd.shape[-2], kd.shape[-1]
        # Rows of a 2-D view: one contiguous block per page (a 4-D index_select is ~3x slower).
        k = kd.view(kd.shape[0], -1).index_select(0, pages).view(-1, h, dp)
        v = vd.view(vd.shape[0], -1).index_select(0, pages).view(-1, h, dp)
        if not self._quantized:
            return k.to(dtype), v.to(dtype)
        from radixkernels.reference import dequantize_ref

        ks, vs = _scale(pool, "k_scale", layer_id), _scale(pool, "v_scale", layer_id)
        if self.fmt.kv_dtype.has_token_scales:
            assert ks is not None and vs is not None
            ks = ks.index_select(0, pages).view(-1, h)
            vs = vs.index_select(0, pages).view(-1, h)
        return dequantize_ref(k, ks, self.fmt).to(dtype), dequantize_ref(v, vs, self.fmt).to(dtype)

    def _gather_split(
        self, layer_id: int, pages: torch.Tensor, n: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``pages`` cut into ``n`` equal runs (one per sequence or group), heads
        first as attention takes them: ``[n, kv_heads, tokens, head_dim]`` each."""
        k, v = self._gather(layer_id, pages, dtype)
        return k.view(n, -1, *k.shape[1:]).transpose(1, 2), v.view(n, -1, *v.shape[1:]).transpose(
            1, 2
        )

    def _blocks(
        self,
        layer_id: int,
        pages: torch.Tensor,
        key_lens: list[int],
        mask: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> Iterator[KVBlock]:
        """K/V of ``pages`` ``[B, P]`` (row ``i`` sees its first ``key_lens[i]`` positions,
        longest first; ``mask`` ``[B, 1, 1, P * page_size]`` hides the rest), one block of
        pages at a time, each block trimmed to the rows and positions anyone sees in it."""
        ps = self.pool.page_size
        for start, end in block_spans(pages.shape[1], ps):
            rows = rows_with_keys(key_lens, start * ps)
            if rows == 0:
                return
            k, v = self._gather_split(layer_id, pages[:rows, start:end].reshape(-1), rows, dtype)
            keys = min(end * ps, key_lens[0]) - start * ps
            part = None if mask is None else mask[:rows, :, :, start * ps : start * ps + keys]
            yield KVBlock(rows, k[:, :, :keys], v[:, :, :keys], part)

    def native_layers_plan(
        self, batch: ForwardBatch, windows: Sequence[int | None]
    ) -> NativeLayersPlan | None:
        """The CPU kernel's plans for ``batch`` (prepared by init_forward_metadata) with the
        pool's per-layer pages, for a forward that runs every layer in one native call: each
        windowed layer gets the plan and slots ``_native_forward`` would give it (its window's
        plan, over the window view's pages and slots where the window pool holds its KV)."""
        meta = self._meta
        if meta is None or meta.native is None or self._meta_batch is not batch:
            return None
        assert batch.out_cache_loc is not None  # a paged batch (init_forward_metadata)
        view = batch if batch.window_view is None else batch.window_view
        assert view.out_cache_loc is not None
        plans, slots = [meta.native], [batch.out_cache_loc]
        index: dict[int, int] = {}  # window -> its plan's index
        layer_plans = []
        for window in windows:
            if window is not None and window not in index:
                index[window] = len(plans)
                plans.append(self._window_plan(view, window))
                slots.append(view.out_cache_loc)
            layer_plans.append(0 if window is None else index[window])
        scales: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        if self._quantized:  # int8 / fp8 pages (meta.native: the kernel reads them)
            assert self.pool.k_scale is not None and self.pool.v_scale is not None
            scales = (self.pool.k_scale, self.pool.v_scale)
        return NativeLayersPlan(
            plans, slots, layer_plans, self.pool.k_data, self.pool.v_data, *scales
        )

    # -- attention -----------------------------------------------------------------------

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        sm_scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = self._meta
        if meta is None or not _prepared_for(self._meta_batch, batch):
            raise RuntimeError("call init_forward_metadata(batch) before the forward over it")
        assert batch.out_cache_loc is not None  # a paged batch (init_forward_metadata)
        quirks = window is not None or softcap is not None or sinks is not None
        if meta.native is not None:  # the store and the whole batch's attention, in one call
            return self._native_forward(layer_id, q, k, v, batch, sm_scale, window, softcap, sinks)
        if quirks:
            return self._masked(layer_id, q, k, v, batch, sm_scale, window, softcap, sinks)
        out = torch.empty_like(q)
        self._store(layer_id, k, v, batch.out_cache_loc)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)  # [T, Hq], own part
        if meta.decode is not None:
            self._decode(layer_id, q, out, lse, meta.decode, sm_scale)
        for ext in meta.extends:
            o, s = self._extend(layer_id, q[ext.rows].transpose(0, 1).unsqueeze(0), ext, sm_scale)
            out[ext.rows] = o[0].transpose(0, 1)
            lse[ext.rows] = s[0].transpose(0, 1)
        for call in meta.shared:
            self._shared(layer_id, q, out, lse, call, sm_scale)
        return out

    def _native_forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        sm_scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """The layer through the CPU kernel (it takes windows, soft-caps and sinks too): the
        new rows' store (int8/fp8: quantized as ``_store`` does, bit for bit) and the
        attention."""
        assert self._meta is not None and self._meta.native is not None
        assert batch.out_cache_loc is not None
        out = torch.empty_like(q)
        plan = self._meta.native if window is None else self._window_plan(batch, window)
        scales = None
        if self._quantized:
            ks, vs = _scale(self.pool, "k_scale", layer_id), _scale(self.pool, "v_scale", layer_id)
            assert ks is not None and vs is not None
            scales = (ks, vs)
        native.paged_attention(
            q,
            self.pool.k_data[layer_id],
            self.pool.v_data[layer_id],
            out,
            plan,
            sm_scale,
            store=(k, v, batch.out_cache_loc),
            window=window,
            softcap=softcap,
            scales=scales,
            sinks=sinks,
        )
        return out

    def _masked(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        sm_scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """A windowed, soft-capped or sinked layer without the CPU kernel: per sequence, over
        the pages its new rows' windows reach (``windowed.py``); the cascade split takes none
        of them."""
        assert batch.out_cache_loc is not None and batch.page_lists_cpu is not None
        self._store(layer_id, k, v, batch.out_cache_loc)
        ps, dev = batch.page_size, q.device
        out = torch.empty_like(q)
        start = 0
        for b, (length, n) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
            first = window_start(length - n, window) // ps  # the first page any new row sees
            pages = torch.tensor(
                batch.page_lists_cpu[b][first : -(-length // ps)], dtype=torch.int64, device=dev
            )
            kk, vv = self._gather_split(layer_id, pages, 1, q.dtype)  # [1, Hkv, P * ps, D]
            k_pos = torch.arange(first * ps, length, device=dev)
            keys = k_pos.numel()
            rows = slice(start, start + n)
            out[rows] = masked_attention_blocks(
                q[rows],
                kk[0, :, :keys].transpose(0, 1),
                vv[0, :, :keys].transpose(0, 1),
                torch.arange(length - n, length, device=dev),
                k_pos,
                sm_scale,
                window,
                softcap,
                sinks,
            )
            start += n
        return out

    def _decode(
        self,
        layer_id: int,
        q: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dec: _Decode,
        sm_scale: float,
    ) -> None:
        """Own part of every decode row, one call per key block (heads of a KV head as query rows)."""
        bd = len(dec.lens)
        hq, d = q.shape[1], q.shape[2]
        hkv = self.pool.k_data[layer_id].shape[-2]
        qq = q.index_select(0, dec.rows).view(bd, hkv, hq // hkv, d)
        blocks = self._blocks(layer_id, dec.pages, dec.lens, dec.mask, q.dtype)
        o, s = attend_blocks(qq, blocks, sm_scale, attention_with_lse)
        out.index_copy_(0, dec.rows, o.reshape(bd, hq, d))
        lse.index_copy_(0, dec.rows, s.reshape(bd, hq))

    def _extend(
        self, layer_id: int, q: torch.Tensor, ext: _Extend, sm_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's new rows ``q`` ``[1, Hq, n, D]`` over its own keys: causally over
        the n new ones, then over the ``before`` keys that precede them (every one seen, no
        mask), block by block, merged."""
        ps, n = self.pool.page_size, q.shape[2]
        first = ext.before // ps  # the page of the first new row
        kk, vv = self._gather_split(layer_id, ext.pages[first:], 1, q.dtype)
        at = ext.before - first * ps
        o, s = attention_with_lse(
            q, kk[:, :, at : at + n], vv[:, :, at : at + n], None, sm_scale, causal=True
        )
        if ext.before == 0:
            return o, s
        prefix = ext.pages[: -(-ext.before // ps)][None]
        blocks = self._blocks(layer_id, prefix, [ext.before], None, q.dtype)
        o2, s2 = attend_blocks(q, blocks, sm_scale, attention_with_lse)
        return merge_partial(o, s, o2, s2), torch.logaddexp(s, s2)

    def _shared(
        self,
        layer_id: int,
        q: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        sh: _Shared,
        sm_scale: float,
    ) -> None:
        """Every grouped row over its group's shared pages, read once per group; merged into ``out``."""
        g, r_max = sh.shape
        hq, d = q.shape[1], q.shape[2]
        hkv = self.pool.k_data[layer_id].shape[-2]
        group = hq // hkv
        # A group's rows' query heads of one KV head become that head's query rows: [G, Hkv, Rmax * grp, D].
        qg = (
            q.index_select(0, sh.q_rows)
            .view(g, r_max, hkv, group, d)
            .transpose(1, 2)
            .reshape(g, hkv, -1, d)
        )
        blocks: Iterable[KVBlock] | None = sh.kv[layer_id] if sh.kv is not None else None
        if blocks is None:
            blocks = self._blocks(layer_id, sh.pages, sh.keys, sh.mask, q.dtype)
            if sh.kv is not None:
                blocks = sh.kv[layer_id] = list(blocks)
        o, s = attend_blocks(qg, blocks, sm_scale, attention_with_lse)
        o = (
            o.view(g, hkv, r_max, group, d)
            .transpose(1, 2)
            .reshape(g * r_max, hq, d)
            .index_select(0, sh.src)
        )
        s = (
            s.view(g, hkv, r_max, group)
            .transpose(1, 2)
            .reshape(g * r_max, hq)
            .index_select(0, sh.src)
        )
        out.index_copy_(
            0,
            sh.rows,
            merge_partial(out.index_select(0, sh.rows), lse.index_select(0, sh.rows), o, s),
        )


def _padded_calls(
    groups: list[tuple[list[int], list[int]]],
) -> list[list[tuple[list[int], list[int]]]]:
    """Split groups (rows, pages) into calls whose padding at most doubles the work.

    Groups go in by decreasing row count; a call takes the next group while its padded
    area (groups x most rows x most pages) stays within twice the groups' own
    rows x pages, so a big prefill and a few decodes do not share a call.
    """
    calls: list[list[tuple[list[int], list[int]]]] = []
    work = 0
    for grp in sorted(groups, key=lambda x: -len(x[0])):
        rows, pages = grp
        if calls:
            call = calls[-1]
            padded = (len(call) + 1) * len(call[0][0]) * max(len(pages), *(len(p) for _, p in call))
            if padded <= 2 * (work + len(rows) * len(pages)):
                call.append(grp)
                work += len(rows) * len(pages)
                continue
        calls.append([grp])
        work = len(rows) * len(pages)
    return calls


def _prepared_for(prepared: ForwardBatch | None, batch: ForwardBatch) -> bool:
    """Whether ``batch`` is the prepared one or its window layers' view (the window view
    differs only in page ids, which every windowed path reads from the batch it is given)."""
    return prepared is not None and (batch is prepared or batch is prepared.window_view)


def _starts(lens: list[int]) -> list[int]:
    starts, acc = [], 0
    for n in lens:
        starts.append(acc)
        acc += n
    return starts


def _scale(pool: KVPool, name: str, layer_id: int) -> torch.Tensor | None:
    scales = getattr(pool, name, None)
    return None if scales is None else scales[layer_id]
