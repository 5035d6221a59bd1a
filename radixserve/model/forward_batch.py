"""The one object the scheduler hands to the model: a flattened ragged batch.

Many sequences, each contributing ``extend_lens[i]`` new tokens this step (1 for a decode,
the whole or a chunk of the prompt for an extend), are flattened into ``T`` rows with no
padding. Sequence ``i`` owns rows ``extend_start_loc[i] : extend_start_loc[i] + extend_lens[i]``
and already has ``prefix_lens[i]`` tokens of KV cached in pages::

    sequence i:   | prefix (in pages) ............ | new tokens (this step) |
    positions:    0 ......................... p-1    p .......... seq_len-1
    rows in T:                                       start ...... start+extend-1

The dense backend (full sequences, no pool) ignores the paged fields; the paged backends
store the new K/V at ``out_cache_loc`` and read the whole history through ``page_table``
(device) or ``page_lists_cpu`` (the same pages as host lists, for metadata built on the
host: reading the device table back would cost a transfer and a sync per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.model.lora import LoraRows


@dataclass
class ForwardBatch:
    """Inputs of one model forward. Tensors live on the model's device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each row within its sequence
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step
    extend_lens: torch.Tensor  # [B] int32, new tokens of each sequence this step
    prefix_lens: torch.Tensor  # [B] int32, = seq_lens - extend_lens
    extend_start_loc: torch.Tensor  # [B] int32, first row of each sequence in T
    logits_indices: torch.Tensor  # [N] int64, rows whose logits the caller wants
    # Host copies: loops and shapes without a device sync.
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # Paged KV (None for the dense backend).
    out_cache_loc: torch.Tensor | None = (
        None  # [T] int64, slot (page*page_size+offset) of each new row
    )
    page_table: torch.Tensor | None = None  # [B, max_pages] int32, pages of each sequence in order
    page_size: int = 1
    page_lists_cpu: list[list[int]] | None = (
        None  # host copy of page_table's rows (at least the used pages)
    )
    # A sliding-window model with a window pool (memory.window_pool): the same batch with the
    # window layers' page table, page lists and slots (window page ids); None otherwise.
    window_view: ForwardBatch | None = None
    # LoRA adapters (model.lora): which rows each adapter in the batch owns; None: no row
    # of this forward is adapted.
    lora: LoraRows | None = None
    # Embeddings (params.return_embedding): the forward keeps the final norm's output of the
    # logits rows in ``hidden`` ([N, hidden] in the activations' dtype) when asked.
    keep_hidden: bool = False
    hidden: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.extend_lens_cpu)

    @staticmethod
    def from_pages(
        pages: list[list[int]], prefix: list[int], extend: list[int], page_size: int
    ) -> ForwardBatch:
        """A paged batch from explicit page lists (tests and kernel benchmarks, on the CPU).

        Sequence ``b`` holds ``pages[b]`` (enough for its ``prefix[b] + extend[b]`` tokens)
        and computes the new rows at positions ``prefix[b] .. prefix[b] + extend[b] - 1``.
        """
        seq = [p + e for p, e in zip(prefix, extend)]
        table = torch.zeros(len(seq), max(len(p) for p in pages), dtype=torch.int32)
        slots, positions = [], []
        for b, n in enumerate(seq):
            if len(pages[b]) * page_size < n:
                raise ValueError(f"sequence {b}: {len(pages[b])} pages cannot hold {n} tokens")
            table[b, : len(pages[b])] = torch.tensor(pages[b])
            for pos in range(prefix[b], n):
                slots.append(pages[b][pos // page_size] * page_size + pos % page_size)
                positions.append(pos)
        return ForwardBatch(
            input_ids=torch.zeros(sum(extend), dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            seq_lens=torch.tensor(seq, dtype=torch.int32),
            extend_lens=torch.tensor(extend, dtype=torch.int32),
            prefix_lens=torch.tensor(prefix, dtype=torch.int32),
            extend_start_loc=torch.tensor(
                [sum(extend[:b]) for b in range(len(seq))], dtype=torch.int32
            ),
            logits_indices=torch.zeros(0, dtype=torch.int64),
            seq_lens_cpu=seq,
            extend_lens_cpu=list(extend),
            out_cache_loc=torch.tensor(slots, dtype=torch.int64),
            page_table=table,
            page_size=page_size,
            page_lists_cpu=[list(p) for p in pages],
        )

    @staticmethod
    def for_full_sequences(
        sequences: list[list[int]], device: torch.device | str = "cpu", all_logits: bool = False
    ) -> ForwardBatch:
        """A batch of whole sequences with nothing cached (prefill from scratch).

        ``logits_indices`` selects the last row of each sequence, or every row when
        ``all_logits`` is set.
        """
        lens = [len(s) for s in sequences]
        if not lens or min(lens) == 0:
            raise ValueError("every sequence needs at least one token")
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=device)
        pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(device)
        total = sum(lens)
        if all_logits:
            logits_idx = torch.arange(total, dtype=torch.int64, device=device)
        else:
            logits_idx = torch.tensor(
                [s + n - 1 for s, n in zip(starts, lens)], dtype=torch.int64, device=device
            )
        lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
        return ForwardBatch(
            input_ids=ids,
            positions=pos,
            seq_lens=lens_t,
            extend_lens=lens_t.clone(),
            prefix_lens=torch.zeros_like(lens_t),
            extend_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            logits_indices=logits_idx,
            seq_lens_cpu=list(lens),
            extend_lens_cpu=list(lens),
        )
