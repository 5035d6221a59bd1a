"""Paged ForwardBatches for the attention-backend tests, from explicit page lists."""

from __future__ import annotations

import torch

from radixserve.model.forward_batch import ForwardBatch


def paged_batch(pages: list[list[int]], prefix: list[int], extend: list[int], page_size: int) -> ForwardBatch:
    """Sequence ``b`` holds ``pages[b]`` (enough for its ``prefix[b] + extend[b]`` tokens) and
    computes the new rows at positions ``prefix[b] .. prefix[b] + extend[b] - 1``."""
    seq = [p + e for p, e in zip(prefix, extend)]
    table = torch.zeros(len(seq), max(len(p) for p in pages), dtype=torch.int32)
    slots, positions = [], []
    for b, n in enumerate(seq):
        assert len(pages[b]) * page_size >= n, "not enough pages for the sequence"
        table[b, : len(pages[b])] = torch.tensor(pages[b])
        for pos in range(prefix[b], n):
            slots.append(pages[b][pos // page_size] * page_size + pos % page_size)
            positions.append(pos)
    t = sum(extend)
    return ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.tensor(positions),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        extend_lens=torch.tensor(extend, dtype=torch.int32),
        prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        extend_start_loc=torch.tensor([sum(extend[:b]) for b in range(len(seq))], dtype=torch.int32),
        logits_indices=torch.zeros(0, dtype=torch.int64),
        seq_lens_cpu=seq,
        extend_lens_cpu=list(extend),
        out_cache_loc=torch.tensor(slots, dtype=torch.int64),
        page_table=table,
        page_size=page_size,
    )


def shared_batch(
    trunk_pages: int | list[int], prefix: list[int], extend: list[int], page_size: int, num_pages: int,
    trunk_of: list[int] | None = None,
) -> ForwardBatch:
    """Sequence ``b`` starts with the pool pages of trunk ``trunk_of[b]`` (default: all trunk 0),
    trunk ``t`` being ``trunk_pages[t]`` pages long (a cached prefix)."""
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3)).tolist()
    sizes = [trunk_pages] if isinstance(trunk_pages, int) else trunk_pages
    trunks = [[perm.pop() for _ in range(n)] for n in sizes]
    trunk_of = trunk_of or [0] * len(prefix)
    pages = []
    for b, (p, e) in enumerate(zip(prefix, extend)):
        trunk = trunks[trunk_of[b]]
        assert p >= len(trunk) * page_size
        pages.append(trunk + [perm.pop() for _ in range(-(-(p + e) // page_size) - len(trunk))])
    return paged_batch(pages, prefix, extend, page_size)
