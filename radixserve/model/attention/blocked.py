"""Attention over a long paged history one block of keys at a time (flash-style).

The torch paged backend (quantized pools, devices and head sizes the CPU kernel lacks) used
to gather and dequantize a sequence's whole history per layer call and, for a prefill
chunk over a cached prefix, to build a ``[chunk, context]`` mask: transient memory that
grew with the context (at 32k tokens a 4096-token chunk's mask alone was 512 MiB in
float32). Here the keys are cut into blocks of at most ``KV_BLOCK_TOKENS`` positions per
sequence; each block is gathered and dequantized on its own, attended with the log-sum-exp
of its scores, and merged into a float32 running output (the online softmax of
FlashAttention, block by block; flash-decoding's merge)::

    o, lse = attn(q, block 0)
    for each later block b:  o = merge(o, lse, attn(q, b));  lse = logaddexp(lse, lse_b)

So what a layer call allocates is bounded by the block and the rows (a chunk, a decode
batch), not by the context; a history of one block is the single call it was before,
bit for bit. Rows are ordered by their number of keys, longest first, so the rows that
have keys in a block are always the leading ``rows`` of the call: a row is never attended
over a block where it sees nothing (an empty softmax).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from radixserve.model.attention.cascade import merge_partial
from radixserve.model.attention.windowed import masked_attention

# Key positions of one sequence per block. A block's dequantized K/V take
# 2 * KV_BLOCK_TOKENS * kv_heads * head_dim * 4 bytes per row of the call (3 MiB for
# SmolLM2's 3 x 64); merging a block costs a pass over the call's [rows, heads, D] output,
# small against the block's attention for any chunk.
KV_BLOCK_TOKENS = 2048

Attend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float],
    tuple[torch.Tensor, torch.Tensor],
]


class KVBlock(NamedTuple):
    """One block of keys for the leading ``rows`` rows of a call."""

    rows: int
    k: torch.Tensor  # [rows, Hkv, N, D]
    v: torch.Tensor  # [rows, Hkv, N, D]
    mask: torch.Tensor | None  # additive, broadcastable to [rows, Hq, M, N]; None: all seen


def block_spans(num_pages: int, page_size: int) -> list[tuple[int, int]]:
    """Page ranges ``[start, end)`` of the blocks over ``num_pages`` pages (at least one)."""
    width = max(1, KV_BLOCK_TOKENS // page_size)
    return [(s, min(s + width, num_pages)) for s in range(0, max(num_pages, 1), width)]


def rows_with_keys(key_lens: list[int], first_key: int) -> int:
    """How many leading rows (``key_lens`` sorted longest first) have a key at ``first_key`` or later."""
    n = 0
    while n < len(key_lens) and key_lens[n] > first_key:
        n += 1
    return n


def attend_blocks(
    q: torch.Tensor, blocks: Iterable[KVBlock], sm_scale: float, attend: Attend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, Hq, M, D]`` over the union of ``blocks`` (the first covers
    every row); returns the output in ``q``'s dtype and the float32 log-sum-exp ``[B, Hq, M]``.

    ``attend`` is :func:`~radixserve.model.attention.cascade.attention_with_lse` (passed in,
    so a benchmark that wraps the backend's module attribute sees every call)."""
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for blk in blocks:
        o, s = attend(q[: blk.rows], blk.k, blk.v, blk.mask, sm_scale)
        if out is None or lse is None:
            if blk.rows != q.shape[0]:
                raise ValueError("the first key block must cover every row")
            out, lse = o, s
            continue
        if out.dtype != torch.float32:
            out = out.float()  # accumulate in float32 from the second block on
        r = blk.rows
        out[:r] = merge_partial(out[:r], lse[:r], o.float(), s)
        lse[:r] = torch.logaddexp(lse[:r], s)
    if out is None or lse is None:
        raise ValueError("attention over no keys")
    return out.to(q.dtype), lse


def masked_attention_blocks(
    q: torch.Tensor,  # [n, Hq, D], queries at positions q_pos
    k: torch.Tensor,  # [L, Hkv, D], keys at positions k_pos
    v: torch.Tensor,  # [L, Hkv, D]
    q_pos: torch.Tensor,  # [n] int64
    k_pos: torch.Tensor,  # [L] int64
    sm_scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~radixserve.model.attention.windowed.masked_attention` (a window, a soft-cap
    and/or sinks, which ATen's flash attention lacks) over ``KV_BLOCK_TOKENS`` keys at a time
    with an online softmax, so its float32 scores are ``[Hq, n, block]``, not ``[Hq, n, L]``
    (a soft-capped global layer's history is the whole context). One block: that function,
    bit for bit. Every row sees at least its own key, so no row ends with an empty softmax."""
    if k.shape[0] <= KV_BLOCK_TOKENS:
        return masked_attention(q, k, v, q_pos, k_pos, sm_scale, window, softcap, sinks)
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    top = torch.full(qf.shape[:2], float("-inf"), device=q.device)  # running max per row
    total = torch.zeros(qf.shape[:2], device=q.device)  # running sum of exp(score - top)
    acc = torch.zeros_like(qf)
    for s in range(0, k.shape[0], KV_BLOCK_TOKENS):
        kf = k[s : s + KV_BLOCK_TOKENS].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vf = v[s : s + KV_BLOCK_TOKENS].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(qf, kf.transpose(1, 2)) * sm_scale  # [Hq, n, block]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        dist = q_pos[:, None] - k_pos[None, s : s + KV_BLOCK_TOKENS]
        hidden = dist < 0
        if window is not None:
            hidden |= dist >= window
        scores.masked_fill_(hidden[None], float("-inf"))
        new_top = torch.maximum(top, scores.amax(dim=-1))
        base = torch.where(torch.isinf(new_top), 0.0, new_top)  # rows that saw nothing yet
        p = torch.exp(scores - base[..., None])
        rescale = torch.exp(top - base)
        total = total * rescale + p.sum(dim=-1)
        acc = acc * rescale[..., None] + torch.matmul(p, vf)
        top = new_top
    if sinks is not None:  # each head's sink joins the denominator once per row
        total = total + torch.exp(sinks.float()[:, None] - top)
    return (acc / total[..., None]).transpose(0, 1).to(q.dtype)
