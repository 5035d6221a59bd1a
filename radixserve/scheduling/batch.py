"""Turning one step's work list into a :class:`ForwardBatch`, built once per step from lists.

The scheduler decides *what* runs (request, number of new tokens); this module lays it out::

    work:        (req0, 5)            (req1, 1)  (req2, 1)  (req3, 3)
    rows (T):    0 1 2 3 4            5          6          7 8 9
    positions:   c0 .. c0+4           c1         c2         c3 .. c3+2
    slots:       page_table[b, pos // page_size] * page_size + pos % page_size

``logits_indices`` lists the rows whose logits are needed: first the last row of every
request whose tokens are now all computed (it samples), then the prompt rows whose
logprobs were asked for. :class:`LogitsPlan` remembers which is which.

:class:`PageTable` keeps every running request's page list as a row of one persistent
``[max_running, max_pages]`` int32 tensor, so a decode step writes only the pages that are
new instead of rebuilding the table.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixserve.model.forward_batch import ForwardBatch
from radixserve.scheduling.request import Request


class PageTable:
    """Persistent page table: one row per running request (its ``slot``)."""

    def __init__(self, max_rows: int, max_pages: int, device: torch.device | str) -> None:
        self.table = torch.zeros(max_rows, max(1, max_pages), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._pending: list[tuple[int, int, int]] = []  # (row, col, page) writes not yet applied

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def acquire(self) -> int:
        return self._free_rows.pop()

    def release(self, row: int) -> None:
        self._free_rows.append(row)

    def set_row(self, row: int, pages: list[int]) -> None:
        """Rewrite a row (admission, or after the cache swapped duplicate pages)."""
        if pages:
            self.table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)

    def append(self, row: int, col: int, pages: list[int]) -> None:
        """Queue the writes of pages newly appended at ``col`` (applied in one go by :meth:`flush`)."""
        self._pending.extend((row, col + i, p) for i, p in enumerate(pages))

    def flush(self) -> None:
        if not self._pending:
            return
        rows, cols, pages = zip(*self._pending)
        self._pending.clear()
        idx = (torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64))
        self.table.index_put_(tuple(i.to(self.table.device) for i in idx),
                              torch.tensor(pages, dtype=torch.int32, device=self.table.device))

    def row_matches(self, row: int, pages: list[int]) -> bool:
        """Whether the stored row starts with ``pages`` (invariant checks)."""
        return self.table[row, : len(pages)].tolist() == pages


class LogitsPlan(NamedTuple):
    """Which logits rows mean what, in the order of ``logits_indices``."""

    sample_reqs: list[Request]  # logits[i] samples sample_reqs[i]
    # Prompt logprobs: (request, first position, count); rows follow the sample rows in order.
    prompt_spans: list[tuple[Request, int, int]]
    prompt_targets: torch.Tensor  # [sum of counts] int64: the token each prompt row scores


def build_forward_batch(
    work: list[tuple[Request, int]], page_table: PageTable, page_size: int, device: torch.device
) -> tuple[ForwardBatch, LogitsPlan]:
    """Lay out ``work`` (request, new tokens) as one flattened batch."""
    input_ids: list[int] = []
    positions: list[int] = []
    seq_of_row: list[int] = []
    prefix_lens: list[int] = []
    ext_lens: list[int] = []
    seq_lens: list[int] = []
    starts: list[int] = []
    rows: list[int] = []
    sample_rows: list[int] = []
    sample_reqs: list[Request] = []
    lp_rows: list[int] = []
    lp_targets: list[int] = []
    spans: list[tuple[Request, int, int]] = []
    t = 0
    for b, (req, n) in enumerate(work):
        c = req.computed_len
        # list slicing / range / repetition run in C: no per-token Python work
        input_ids += req.token_ids[c : c + n]
        positions += range(c, c + n)
        seq_of_row += [b] * n
        prefix_lens.append(c)
        ext_lens.append(n)
        seq_lens.append(c + n)
        starts.append(t)
        rows.append(req.slot)
        if c + n == len(req.token_ids):
            sample_rows.append(t + n - 1)
            sample_reqs.append(req)
        if req.wants_prompt_logprobs:
            lo = max(c, req.prompt_lp_next)
            hi = min(c + n, req.prompt_len - 1)
            if hi > lo:
                lp_rows += range(t + lo - c, t + hi - c)
                lp_targets += req.token_ids[lo + 1 : hi + 1]
                spans.append((req, lo, hi - lo))
        t += n

    page_table.flush()
    pos_t = torch.tensor(positions, dtype=torch.int64)
    max_pages = (max(seq_lens) + page_size - 1) // page_size
    table = page_table.table[torch.tensor(rows, dtype=torch.int64, device=page_table.table.device), :max_pages]
    table_cpu = table.cpu()
    out_loc = table_cpu[torch.tensor(seq_of_row), pos_t // page_size].to(torch.int64) * page_size + pos_t % page_size

    fb = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),
        positions=pos_t.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        extend_lens=torch.tensor(ext_lens, dtype=torch.int32).to(device),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32).to(device),
        extend_start_loc=torch.tensor(starts, dtype=torch.int32).to(device),
        logits_indices=torch.tensor(sample_rows + lp_rows, dtype=torch.int64).to(device),
        seq_lens_cpu=seq_lens,
        extend_lens_cpu=ext_lens,
        out_cache_loc=out_loc.to(device),
        page_table=table.to(device),
        page_size=page_size,
    )
    plan = LogitsPlan(sample_reqs, spans, torch.tensor(lp_targets, dtype=torch.int64))
    return fb, plan
