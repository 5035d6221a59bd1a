"""Attention with a sliding window and/or a logit soft-cap: the reference math the torch
backends use for such layers (Mistral's window, Gemma 2/3's local layers, Gemma 2's cap).

A query at position ``p`` sees the keys at positions ``j`` with ``j <= p`` and, with a
``window``, ``p - j < window`` (transformers' ``sliding_window_causal`` mask: the last
``window`` positions, its own included). The soft-cap bounds each score as
``cap * tanh(score / cap)`` before the mask and softmax (Gemma 2). Attention sinks
(gpt-oss) add one logit per query head to every row's softmax, a column with no value whose
probability is dropped: the row's weights then sum to less than one. Scores and softmax are
float32, the output is cast back to ``q``'s dtype.

Only the pages that hold keys some new row can see are read (from the page of the first
new row's window start on): KV further back stays allocated for now, but is never read.
"""

from __future__ import annotations

import torch


def window_start(first_query_pos: int, window: int | None) -> int:
    """The first key position any query at ``first_query_pos`` or later can see."""
    return 0 if window is None else max(0, first_query_pos - window + 1)


def masked_attention(
    q: torch.Tensor,  # [n, Hq, D], queries at positions q_pos
    k: torch.Tensor,  # [L, Hkv, D], keys at positions k_pos
    v: torch.Tensor,  # [L, Hkv, D]
    q_pos: torch.Tensor,  # [n] int64
    k_pos: torch.Tensor,  # [L] int64
    sm_scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # [Hq] float32
) -> torch.Tensor:
    """``[n, Hq, D]``: causal attention of the queries over the keys, windowed and capped,
    with each head's sink in its softmax."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * sm_scale  # [Hq, n, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    dist = q_pos[:, None] - k_pos[None, :]  # [n, L]
    hidden = dist < 0
    if window is not None:
        hidden |= dist >= window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink's column joins the softmax, then is dropped (transformers' gpt-oss)
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs, vf)  # [Hq, n, D]
    return out.transpose(0, 1).to(q.dtype)
