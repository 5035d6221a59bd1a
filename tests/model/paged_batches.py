"""Paged ForwardBatches for the attention-backend tests: sequences over shared trunks."""

from __future__ import annotations

import torch

from radixserve.model.forward_batch import ForwardBatch


def shared_batch(
    trunk_pages: int | list[int],
    prefix: list[int],
    extend: list[int],
    page_size: int,
    num_pages: int,
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
    return ForwardBatch.from_pages(pages, prefix, extend, page_size)
