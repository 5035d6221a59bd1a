"""What one device holds when a model is split by tensor (TP) and pipeline (PP) parallelism.

A worker of ``tp × pp`` ranks splits the model twice::

            stage 0 (layers [0, a))          stage 1 (layers [a, b))   …   stage pp-1
    tp 0 │ embedding/tp + layers/tp │  →  │ layers/tp │  →  …  →  │ layers/tp + norm + LM head/tp │
    tp 1 │ embedding/tp + layers/tp │  →  │ layers/tp │  →  …  →  │ layers/tp + norm + LM head/tp │

- Pipeline: the decoder layers split into ``pp`` contiguous stages (the first stage also holds
  the embedding, the last the final norm and the LM head). When the layers do not divide
  evenly, the extra layers go to the middle stages first (from the second-to-last back), as
  vLLM does: the first and last stages already carry the vocabulary-sized tensors.
- Tensor: inside a stage, q/k/v and gate/up are column-parallel (each rank a slice of the
  heads / of the intermediate size), o and down row-parallel (a slice of their input); the
  embedding and the LM head are vocabulary-parallel. Norms are replicated. KV heads split
  across ranks, except when there are fewer KV heads than ranks: then each rank keeps one
  KV head, replicated over about ``tp / kv_heads`` ranks (SmolLM2's 3 KV heads on 4 ranks).
  Splits that do not divide evenly give the larger share to the first ranks; the planner
  sizes for the largest device.
- Tied embeddings: with ``pp == 1`` the LM head is the embedding; with ``pp > 1`` the last
  stage holds a copy of the embedding's shard as its LM head.

Pages: every stage's pool holds the same page ids (the scheduler assigns pages once, for all
layers), each stage storing only its own layers' K/V for its own KV heads; so a worker's page
count is the smallest any of its devices affords.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def stage_layer_ranges(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Split ``num_layers`` decoder layers into ``pp`` contiguous ``[start, end)`` stages.

    ``stage_layer_ranges(80, 2) == [(0, 40), (40, 80)]``; ``stage_layer_ranges(30, 4) ==
    [(0, 7), (7, 15), (15, 23), (23, 30)]`` (the two extra layers on the middle stages).
    """
    if pp < 1:
        raise ValueError(f"pipeline parallel size must be >= 1, got {pp}")
    if num_layers < pp:
        raise ValueError(f"cannot split {num_layers} layers into {pp} pipeline stages")
    sizes = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        # The extra layers go to the stages before the last, the middle ones first.
        sizes[(pp - 2 - i) % pp] += 1
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` shares differing by at most one, the larger ones first."""
    return [total // parts + (1 if r < total % parts else 0) for r in range(parts)]


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one TP rank keeps: a share of them, or one replicated head when ``tp`` exceeds them."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    # Fewer KV heads than ranks: each rank keeps the one its query heads read (a replica).
    return math.ceil(num_kv_heads / tp)


def q_heads_per_rank(num_q_heads: int, num_kv_heads: int, tp: int) -> int:
    """Query heads the largest TP rank keeps (radixserve.model.parallel's split by GQA group):
    its KV heads' whole groups, or, with KV heads replicated, its share of one group (largest
    where the fewest ranks share a head: SmolLM2's 3 KV heads on 4 ranks, rank 2 alone)."""
    group = num_q_heads // num_kv_heads
    if num_kv_heads >= tp:
        return math.ceil(num_kv_heads / tp) * group
    return math.ceil(group / (tp // num_kv_heads))


@dataclass(frozen=True)
class DeviceShard:
    """The part of a model one device holds: a TP share of the layers ``[layer_start, layer_end)``,
    with or without the embedding and the LM head (and the final norm that precedes it)."""

    tp_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    layer_start: int = 0
    layer_end: int | None = None  # None: to the last layer
    has_embedding: bool = True
    has_lm_head: bool = True
    # Expert parallelism: a MoE model's experts spread whole over the TP ranks (E / tp each)
    # instead of every expert cut on its width.
    expert_parallel: bool = False

    def layers(self, num_layers: int) -> int:
        """How many decoder layers this device runs."""
        end = num_layers if self.layer_end is None else self.layer_end
        return end - self.layer_start

    @property
    def is_whole_model(self) -> bool:
        return self.tp_size == 1 and self.pp_size == 1

    def describe(self, num_layers: int) -> str:
        end = num_layers if self.layer_end is None else self.layer_end
        parts = [f"layers [{self.layer_start}, {end})"]
        if self.has_embedding:
            parts.insert(0, "embedding")
        if self.has_lm_head:
            parts.append("norm + LM head")
        return (
            f"stage {self.pp_rank}: "
            + ", ".join(parts)
            + (f", 1/{self.tp_size} of each (TP)" if self.tp_size > 1 else "")
        )


WHOLE_MODEL = DeviceShard()


def stage_shards(
    num_layers: int, tp: int = 1, pp: int = 1, expert_parallel: bool = False
) -> list[DeviceShard]:
    """One :class:`DeviceShard` per pipeline stage (every TP rank of a stage holds the same shape)."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    ranges = stage_layer_ranges(num_layers, pp)
    return [
        DeviceShard(
            tp_size=tp,
            pp_size=pp,
            pp_rank=s,
            layer_start=start,
            layer_end=end,
            has_embedding=s == 0,
            has_lm_head=s == pp - 1,
            expert_parallel=expert_parallel,
        )
        for s, (start, end) in enumerate(ranges)
    ]
