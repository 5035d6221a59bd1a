"""Decode steps from static buffers padded to batch-size buckets, captured once per bucket.

A decode-only step (every sequence computes one new token) of ``B`` sequences runs as the
smallest bucket ``>= B`` (1, 2, 4, 8, 16, 24, 32, 48, 64, then steps of 32, up to the
running-request limit). The bucket's inputs live in static device buffers that every step
of that size reuses; rows ``B..bucket-1`` are padding::

    static rows   0 .. B-1                        B .. bucket-1 (padding)
    input_ids     the step's tokens                0
    positions     the step's positions             0
    out_slots     the step's KV slots              slot 0 of the scratch page
    seq_lens      the step's lengths               1
    page_table    rows of the device page table    [scratch page, ...]

The scratch page is one page past the allocator's pages: no request ever holds it, so a
padding row's K/V write and its one-key attention touch nothing that matters.

On CUDA, with a backend whose forward reads only tensors of the batch (``triton``), the
model forward of each bucket is captured in a CUDA graph at start-up and a step replays it
(no Python per layer, no launches). Elsewhere the same static-buffer path runs eagerly:
on this repository's CPU path it only pays for padding, so it is off by default there
(``decode_graphs="auto"``) and exists to keep the GPU path tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.engine.staging import Staged
from radixserve.model.attention.base import AttentionBackend
from radixserve.model.forward_batch import ForwardBatch
from radixserve.scheduling.plan import StepPlan


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, ... capped by (and always including) ``max_batch``."""
    out = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64) if b < max_batch]
    b = 96
    while b < max_batch:
        out.append(b)
        b += 32
    out.append(max_batch)
    return out


class DecodeGraphs:
    """Static decode buffers (and, on CUDA, one captured graph) per batch-size bucket."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch, AttentionBackend], torch.Tensor],
        attn: AttentionBackend,
        page_table: torch.Tensor,
        scratch_page: int,
        page_size: int,
        max_batch: int,
        capture: bool,
    ) -> None:
        self.forward = forward
        self.attn = attn
        self.page_table = page_table  # the runner's persistent [rows, max_pages] table
        self.scratch_page = scratch_page
        self.page_size = page_size
        self.buckets = batch_buckets(max_batch)
        self.capture = capture
        dev = page_table.device
        n, width = self.buckets[-1], page_table.shape[1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_slots = torch.full((n,), scratch_page * page_size, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.prefix_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.table = torch.full((n, width), scratch_page, dtype=torch.int32, device=dev)
        self.ones = torch.ones(n, dtype=torch.int32, device=dev)
        self.arange = torch.arange(n, dtype=torch.int64, device=dev)
        self.starts = torch.arange(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served from this path (tests)

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def _batch(
        self, bucket: int, seq_lens_cpu: list[int], page_lists: list[list[int]]
    ) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            seq_lens=self.seq_lens[:bucket],
            extend_lens=self.ones[:bucket],
            prefix_lens=self.prefix_lens[:bucket],
            extend_start_loc=self.starts[:bucket],
            logits_indices=self.arange[:bucket],
            seq_lens_cpu=seq_lens_cpu,
            extend_lens_cpu=[1] * bucket,
            out_cache_loc=self.out_slots[:bucket],
            page_table=self.table[:bucket],
            page_size=self.page_size,
            page_lists_cpu=page_lists,
        )

    def capture_all(self, max_seq_len: int) -> None:
        """Capture every bucket's forward (CUDA): run once eagerly to warm up, then record."""
        assert self.capture
        width = self.table.shape[1]
        for bucket in reversed(self.buckets):  # largest first: smaller ones reuse its memory pool
            batch = self._batch(
                bucket, [max_seq_len] * bucket, [[self.scratch_page] * width] * bucket
            )
            self.attn.init_forward_metadata(batch)
            torch.cuda.synchronize()
            with torch.inference_mode():
                self.forward(batch, self.attn)  # warm-up: autotuning, lazy allocations
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                pool = next(iter(self.graphs.values())).pool() if self.graphs else None
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[bucket] = self.forward(batch, self.attn)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def run(self, plan: StepPlan, staged: Staged, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's logits ``[B, vocab]`` (rows beyond B were padding), from the static buffers."""
        b = plan.batch_size
        bucket = self.bucket_for(b)
        assert bucket is not None
        # Real rows from the step's one staged copy; padding rows reset (a bigger step may have used them).
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(staged.i("positions"))
        self.out_slots[:b].copy_(staged.i("out_slots"))
        self.seq_lens[:b].copy_(staged.i("seq_lens"))
        self.prefix_lens[:b].copy_(staged.i("prefix_lens"))
        self.table[:b].copy_(self.page_table.index_select(0, staged.i("table_rows")))
        if bucket > b:
            self.input_ids[b:bucket].zero_()
            self.positions[b:bucket].zero_()
            self.out_slots[b:bucket].fill_(self.scratch_page * self.page_size)
            self.seq_lens[b:bucket].fill_(1)
            self.prefix_lens[b:bucket].zero_()
            self.table[b:bucket].fill_(self.scratch_page)
        self.replays += 1
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
            return self.logits[bucket][:b]
        pad = bucket - b
        batch = self._batch(
            bucket, plan.seq_lens + [1] * pad, plan.page_lists + [[self.scratch_page]] * pad
        )
        self.attn.init_forward_metadata(batch)
        return self.forward(batch, self.attn)[:b]
