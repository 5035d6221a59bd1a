"""Shared-prefix ("cascade") attention: a prefix shared by many sequences is read once.

When sequences of a batch share leading KV pages (a system prompt, few-shot examples, a forked
program's trunk: exactly what the radix cache makes them share), attending each sequence
over its whole history reads the shared pages once per sequence per layer. Cascade
attention splits each sequence's keys into the group's shared prefix and its own suffix::

    softmax over [shared | suffix]  =  merge( attn(q, shared), attn(q, suffix) )

where each part returns its output and the log-sum-exp of its scores, and the merge
weights the two outputs by ``exp(lse_part - lse_total)``. The shared part runs as one
attention whose query rows are every member's query heads (a matrix-matrix product
instead of ``n`` matrix-vector ones) over keys gathered once.

Grouping works on page ids alone: a page belongs to exactly one radix-tree node, so two
sequences hold the same page at the same index exactly when they share that prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedGroup:
    """Sequences (indices into the batch) whose first ``num_pages`` pages agree."""

    members: list[int]
    num_pages: int


def _common_pages(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def shared_prefix_groups(
    tables: list[list[int]], caps: list[int], min_pages: int
) -> list[SharedGroup]:
    """Group sequences by shared leading pages.

    ``tables[i]`` holds sequence ``i``'s pages in order; ``caps[i]`` is how many of them may
    be shared: the full pages before its first new row (``prefix_len // page_size``), so a
    shared part never holds a key some member's new rows must not see, and each member
    keeps at least one key of its own (never an empty softmax).

    Sequences are sorted by their page lists, so the ones sharing a prefix are neighbours,
    and swept greedily: a sequence joins the current group when it shares at least
    ``min_pages`` pages with it and the work it saves (the shared pages it no longer reads
    alone) is at least the work the shrinking shared part adds back to the members already
    in (``len(members) * pages lost``). Groups of one are dropped.
    """
    order = sorted(range(len(tables)), key=lambda i: tables[i][: caps[i]])
    groups: list[SharedGroup] = []
    current: SharedGroup | None = None
    for i in order:
        if current is not None:
            head = tables[current.members[0]]
            common = _common_pages(head, tables[i], min(current.num_pages, caps[i]))
            lost = current.num_pages - common
            if common >= min_pages and len(current.members) * lost <= common:
                current.members.append(i)
                current.num_pages = common
                continue
            if len(current.members) > 1:
                groups.append(current)
        current = SharedGroup([i], caps[i]) if caps[i] >= min_pages else None
    if current is not None and len(current.members) > 1:
        groups.append(current)
    for g in groups:
        g.members.sort()
    return groups


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, Hq, M, D]`` over ``k``/``v`` ``[B, Hkv, N, D]`` (query head ``h``
    reads KV head ``h // (Hq // Hkv)``) with an additive ``mask`` broadcastable to
    ``[B, Hq, M, N]``, or ``causal`` (``M == N``); returns the output in ``q``'s dtype and the
    float32 log-sum-exp of each row's scores, ``[B, Hq, M]``.

    On CPU this is ATen's flash attention (float accumulation, also for bfloat16, GQA
    without expanding K/V); elsewhere the same math in float32 with plain matmuls.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
        return out, lse
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    if causal:
        m, n = s.shape[-2:]
        s = s.masked_fill(
            torch.ones(m, n, dtype=torch.bool, device=s.device).triu(1), float("-inf")
        )
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.float())
    return out.to(q.dtype), lse


def merge_partial(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Combine two attentions over disjoint key sets (outputs ``[..., D]``, lse ``[...]``) into
    the attention over their union, in float32, returned in ``o1``'s dtype.

    Part 2 weighs ``e^lse2 / (e^lse1 + e^lse2) = sigmoid(lse2 - lse1)``, so the merge is one
    ``lerp`` over the outputs (one pass over the big tensors: a prefill merges thousands of
    rows per layer). The difference is clamped to +-80: beyond it the lighter part changes
    nothing in float32, and a sigmoid below ~e^-87 is a denormal, ~5x slower to produce on x86.
    """
    w2 = torch.sigmoid((lse2 - lse1).clamp_(-80.0, 80.0)).unsqueeze(-1)
    if o1.dtype == torch.float32:
        return torch.lerp(o1, o2, w2)
    return torch.lerp(o1.float(), o2.float(), w2).to(o1.dtype)
