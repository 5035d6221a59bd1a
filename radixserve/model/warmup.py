"""Warm-up: run the model over dummy batches that launch every kernel variant serving can use.

A Triton kernel compiles on the first launch of each specialization (see
:mod:`radixkernels.variants`), so a server that starts cold compiles in the middle of its first
requests, seconds each. What decides the variant at run time, once the model, dtype and KV
format are fixed:

    decode kernel   the KV split count (a constexpr): a function of the decode batch size,
                    bucketed to powers of two (radixkernels.decode.SPLIT_BUCKETS); the
                    backend says which batch size first reaches each count
    extend kernel   nothing at run time (page-table stride and slice offsets are not specialized)
    KV store        nothing at run time

So the warm-up runs: one decode-only batch per split count, one extend batch, and the two
mixed layouts (decodes first, decodes last). All rows write into scratch pages of the pool
(the first pages; the caller guarantees they are free), which are zeroed again afterwards.
The model runner calls :func:`warm_up_model` before the worker reports ready.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from radixserve.memory.pool import KVPool
from radixserve.model.attention.base import AttentionBackend
from radixserve.model.forward_batch import ForwardBatch


class WarmupReport(NamedTuple):
    """What a warm-up ran."""

    num_forwards: int
    decode_batch_sizes: list[int]  # one per reachable decode split count
    scratch_pages: list[int]


def warmup_shapes(decode_batch_sizes: list[int]) -> list[tuple[list[int], list[int]]]:
    """``(prefix lens, extend lens)`` of every warm-up batch: decode-only ones, an extend, two mixed."""
    shapes: list[tuple[list[int], list[int]]] = [([0] * b, [1] * b) for b in decode_batch_sizes]
    shapes += [([0], [3]), ([0, 0], [1, 2]), ([0, 0], [2, 1])]
    return shapes


def _on_device(fb: ForwardBatch, device: torch.device) -> ForwardBatch:
    moved = {
        f.name: getattr(fb, f.name).to(device)
        for f in dataclasses.fields(fb)
        if isinstance(getattr(fb, f.name), torch.Tensor)
    }
    return dataclasses.replace(fb, **moved)


@torch.inference_mode()
def warm_up_model(
    model: torch.nn.Module, attn: AttentionBackend, pool: KVPool, max_batch_size: int
) -> WarmupReport:
    """Run ``model`` over the warm-up batches (see the module docstring) with every page free.

    ``max_batch_size`` is the most sequences one step can hold (``max_running_requests``).
    Every sequence of a batch shares the scratch pages (their rows overwrite each other:
    the values do not matter, only the launches).
    """
    decode_sizes = (
        attn.decode_batch_sizes(max_batch_size) if hasattr(attn, "decode_batch_sizes") else [1]
    )
    shapes = warmup_shapes(decode_sizes)
    longest = max(p + e for prefix, extend in shapes for p, e in zip(prefix, extend))
    scratch = list(range(math.ceil(longest / pool.page_size)))
    if len(scratch) > pool.num_pages:
        raise ValueError(
            f"warm-up needs {len(scratch)} scratch pages, the pool has {pool.num_pages}"
        )
    device = pool.device
    for prefix, extend in shapes:
        fb = ForwardBatch.from_pages([scratch] * len(prefix), prefix, extend, pool.page_size)
        fb = dataclasses.replace(
            fb, logits_indices=torch.tensor([sum(extend) - 1], dtype=torch.int64)
        )
        fb = _on_device(fb, device)
        attn.init_forward_metadata(fb)
        model(fb, attn)
    pool.zero_pages(scratch)
    return WarmupReport(len(shapes), decode_sizes, scratch)
