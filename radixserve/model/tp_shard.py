"""What each tensor-parallel rank holds of a model (:func:`shard_for_rank`: the split rules
that ``model/parallel.py``'s docstring draws) and what it reads of each checkpoint tensor
(:func:`checkpoint_slice`; the loader reads those slices from the safetensors memory map, so
no rank reads a whole tensor it does not keep).

Column-parallel projections are cut on their rows, row-parallel ones on their columns (a
row-parallel bias is loaded by rank 0 only), the embedding and LM head on their vocabulary
rows; fused tensors (Phi-3's ``qkv_proj`` / ``gate_up_proj``, transformers 5's stacked
experts) are cut part by part; every expert on its own MLP width, or under expert
parallelism each rank holds ``num_experts / N`` whole experts (:func:`local_tensor_name`
renames a checkpoint's expert to the rank's own index and drops the other ranks' experts
before they are read); norms are whole except a q/k norm over the whole projection (OLMo 2,
OLMoE), cut like the heads; a shared expert (Qwen2-MoE) is cut on its own width in both
expert layouts, its gate whole. gpt-oss: each rank takes its heads' attention sinks; its
stacked experts (``layers/gpt_oss_experts.py``: gate and up interleaved, so a rank's rows of
both are one contiguous run, MXFP4 blocks cut whole groups of 32) are cut on their width in
multiples of 32 where the width allows it, the router and its bias whole, the experts'
down bias on rank 0.
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

from radixserve.model.config import ModelConfig

__all__ = [
    "TPShard",
    "TensorSlice",
    "checkpoint_slice",
    "local_tensor_name",
    "shard_for_rank",
    "split_range",
]


def split_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``range(n)`` cut into ``parts`` contiguous runs, the larger runs first."""
    base, extra = divmod(n, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (1 if i < extra else 0)


class TPShard(NamedTuple):
    """What rank ``rank`` of ``world_size`` holds of a model (half-open ranges, global indices)."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_shard_max: int  # the largest rank's vocab rows (the all-gather's equal-size chunks)
    # The whole model's counts (a fused tensor's parts start at them).
    q_heads_total: int = 0
    kv_heads_total: int = 0
    intermediate_total: int = 0
    # Each expert's MLP rows this rank holds, of ``expert_intermediate_total`` (MoE models).
    expert_intermediate: tuple[int, int] = (0, 0)
    expert_intermediate_total: int = 0
    # Whether this rank is the first holder of its KV heads (False on the other ranks sharing
    # a replicated head): only the first counts them in a sum over ranks.
    kv_owner: bool = True
    proj_qk_norm: bool = False  # the q/k norm weights span the projection: cut like the heads
    # Expert parallelism: the whole experts [lo, hi) this rank holds (each expert then keeps
    # its whole MLP width: ``expert_intermediate`` is (0, width)); None: every expert, cut.
    experts: tuple[int, int] | None = None
    # A shared expert's MLP rows this rank holds (Qwen2-MoE; cut on its width whether or not
    # the routed experts are spread whole), of ``shared_expert_total``; (0, 0): none.
    shared_expert: tuple[int, int] = (0, 0)
    shared_expert_total: int = 0
    # gpt-oss's expert layout (MoEConfig.checkpoint_layout "gpt_oss"): stacked, transposed,
    # gate and up interleaved, MXFP4 in groups of 32 along the input.
    gpt_oss_experts: bool = False

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` as this rank sees it: its heads, MLP width and vocabulary rows (for sizing
        weights and the KV pool per device; the sampler keeps the full vocabulary)."""
        moe = cfg.moe
        if moe is not None:
            lo, hi = self.expert_intermediate
            slo, shi = self.shared_expert
            moe = dataclasses.replace(
                moe,
                intermediate_size=hi - lo,
                expert_range=self.experts,
                shared_expert_size=shi - slo,
            )
        norm_tp = None
        if cfg.qk_norm == "proj":
            norm_tp = (cfg.q_size, cfg.kv_size, self.kv_owner)
        return dataclasses.replace(
            cfg,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab[1] - self.vocab[0],
            moe=moe,
            qk_norm_tp=norm_tp,
        )


def shard_for_rank(
    cfg: ModelConfig, rank: int, world_size: int, expert_parallel: bool = False
) -> TPShard:
    """Rank ``rank``'s shard of ``cfg`` (see the module docstring for the head split).
    ``expert_parallel``: a MoE model's experts are spread whole over the ranks (``num_experts``
    must divide by ``world_size``) instead of each being cut on its width; no effect on a
    dense model."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    experts = None
    if expert_parallel and cfg.moe is not None:
        n = cfg.moe.num_experts
        if n % world_size:
            raise ValueError(
                f"expert parallelism needs the {n} experts to divide evenly over the "
                f"{world_size} tensor-parallel ranks (num_experts % tp == 0); drop "
                "--expert-parallel to cut every expert on its width instead"
            )
        experts = (rank * n // world_size, (rank + 1) * n // world_size)
    q, k = cfg.num_q_heads, cfg.num_kv_heads
    g = q // k
    owner = True
    if k >= world_size:
        kv = split_range(k, world_size, rank)
        qh = (kv[0] * g, kv[1] * g)
    else:
        head = rank * k // world_size
        sharers = [r for r in range(world_size) if r * k // world_size == head]
        owner = rank == sharers[0]
        if g < len(sharers):
            raise ValueError(
                f"tensor parallel size {world_size} is too large for {q} query heads over {k} "
                f"KV heads: {len(sharers)} ranks would share a group of {g} query heads"
            )
        lo, hi = split_range(g, len(sharers), sharers.index(rank))
        kv = (head, head + 1)
        qh = (head * g + lo, head * g + hi)
    expert_width = cfg.moe.intermediate_size if cfg.moe is not None else world_size
    expert_rows = (0, expert_width) if experts is not None else None
    shared_width = cfg.moe.shared_expert_size if cfg.moe is not None else 0
    if min(cfg.intermediate_size, cfg.vocab_size, expert_width, shared_width or world_size) < (
        world_size
    ):
        raise ValueError(f"tensor parallel size {world_size} exceeds the model's MLP or vocabulary")
    return TPShard(
        rank=rank,
        world_size=world_size,
        q_heads=qh,
        kv_heads=kv,
        intermediate=split_range(cfg.intermediate_size, world_size, rank),
        vocab=split_range(cfg.vocab_size, world_size, rank),
        vocab_shard_max=-(-cfg.vocab_size // world_size),
        q_heads_total=q,
        kv_heads_total=k,
        intermediate_total=cfg.intermediate_size,
        expert_intermediate=expert_rows or _expert_rows(cfg, world_size, rank)
        if cfg.moe is not None
        else (0, 0),
        expert_intermediate_total=expert_width if cfg.moe is not None else 0,
        kv_owner=owner,
        proj_qk_norm=cfg.qk_norm == "proj",
        experts=experts,
        shared_expert=split_range(shared_width, world_size, rank) if shared_width else (0, 0),
        shared_expert_total=shared_width,
        gpt_oss_experts=cfg.moe is not None and cfg.moe.checkpoint_layout == "gpt_oss",
    )


# MXFP4's values per scale: gpt-oss's experts are cut on their width in runs of this many,
# so that every rank's down_proj blocks are whole groups.
_MXFP4_GROUP = 32


def _expert_rows(cfg: ModelConfig, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows of each expert's MLP width (gpt-oss: whole MXFP4 groups of 32
    where there are at least as many groups as ranks)."""
    assert cfg.moe is not None
    width = cfg.moe.intermediate_size
    if cfg.moe.checkpoint_layout == "gpt_oss" and width // _MXFP4_GROUP >= world_size:
        groups = -(-width // _MXFP4_GROUP)
        lo, hi = split_range(groups, world_size, rank)
        return lo * _MXFP4_GROUP, min(hi * _MXFP4_GROUP, width)
    return split_range(width, world_size, rank)


class TensorSlice(NamedTuple):
    """The part of one checkpoint tensor a rank loads: indices ``[lo, hi)`` along ``dim`` (0:
    rows, 1: columns; 1 and 2 for stacked experts ``[E, ...]``), then each range of ``more``
    concatenated after it (a fused tensor's parts); ``zero``: the rank loads zeros of the
    tensor's shape (a row-parallel bias, added once, by rank 0, since the all-reduce sums every
    rank's output)."""

    dim: int
    lo: int
    hi: int
    zero: bool = False
    more: tuple[tuple[int, int], ...] = ()

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return ((self.lo, self.hi), *self.more)


def _parts(cut: tuple[int, int], starts: tuple[int, ...], dim: int = 0) -> TensorSlice:
    """Range ``cut`` of each part of a fused tensor whose parts start at ``starts``."""
    lo, hi = cut
    return TensorSlice(
        dim, starts[0] + lo, starts[0] + hi, more=tuple((s + lo, s + hi) for s in starts[1:])
    )


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def local_tensor_name(name: str, shard: TPShard) -> str | None:
    """Checkpoint tensor ``name`` as this rank's model names it, or None when the rank holds
    none of it (another rank's expert, never read). Only expert parallelism renames: the
    rank's experts ``[lo, hi)`` are its modules ``experts.0 .. experts.{hi - lo - 1}``."""
    if shard.experts is None:
        return name
    found = _EXPERT_INDEX.search(name)
    if found is None:
        return name
    lo, hi = shard.experts
    expert = int(found.group(1))
    if not lo <= expert < hi:
        return None
    return f"{name[: found.start()]}.experts.{expert - lo}.{name[found.end() :]}"


def _expert_slice(name: str, shard: TPShard) -> TensorSlice | None:
    """An expert's tensor (per expert, ``experts.{e}.gate_proj`` or Mixtral's ``w1``/``w3``/
    ``w2``; or stacked ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``):
    this rank's rows of the expert's MLP width, or under expert parallelism its own experts
    whole (a per-expert tensor of another rank's expert is dropped by the loader first)."""
    if shard.gpt_oss_experts:
        return _gpt_oss_expert_slice(name, shard)
    stem = name.removesuffix(".weight")
    if shard.experts is not None:
        stacked = stem.endswith((".experts.gate_up_proj", ".experts.down_proj"))
        return TensorSlice(0, *shard.experts) if stacked else None
    cut, width = shard.expert_intermediate, shard.expert_intermediate_total
    if stem.endswith(".experts.gate_up_proj"):
        return _parts(cut, (0, width), dim=1)
    if stem.endswith(".experts.down_proj"):
        return TensorSlice(2, *cut)
    if any(p in name for p in (".gate_proj.", ".up_proj.", ".w1.", ".w3.")):
        return TensorSlice(0, *cut)
    if ".down_proj." in name or ".w2." in name:
        if name.endswith(".bias"):
            return None if shard.rank == 0 else TensorSlice(0, 0, 0, zero=True)
        return TensorSlice(1, *cut)
    return None


def _gpt_oss_expert_slice(name: str, shard: TPShard) -> TensorSlice | None:
    """gpt-oss's stacked expert tensors (``layers/gpt_oss_experts.py`` draws them): under
    expert parallelism the rank's experts whole; else its rows ``[lo, hi)`` of each expert's
    width: ``2lo .. 2hi`` of the interleaved gate/up (one run holds both), ``lo .. hi`` of
    down's input, its MXFP4 blocks in whole groups (a cut inside one is refused), the down
    bias on rank 0."""
    if shard.experts is not None:
        return TensorSlice(0, *shard.experts)
    lo, hi = shard.expert_intermediate
    what = name.rpartition(".experts.")[2]
    if what.startswith("gate_up_proj"):
        # [E, H, 2I] in bf16 checkpoints (the width last); blocks, scales, bias: [E, 2I, ...].
        return TensorSlice(2 if what == "gate_up_proj" else 1, 2 * lo, 2 * hi)
    if what == "down_proj_bias":
        return None if shard.rank == 0 else TensorSlice(0, 0, 0, zero=True)
    if what == "down_proj":
        return TensorSlice(1, lo, hi)
    if what in ("down_proj_blocks", "down_proj_scales"):
        if lo % _MXFP4_GROUP or hi % _MXFP4_GROUP and hi != shard.expert_intermediate_total:
            raise ValueError(
                f"tensor parallelism cuts gpt-oss's experts at rows {lo}..{hi}, inside MXFP4 "
                f"groups of {_MXFP4_GROUP}: use a tensor parallel size of at most "
                f"{shard.expert_intermediate_total // _MXFP4_GROUP}"
            )
        return TensorSlice(2, lo // _MXFP4_GROUP, -(-hi // _MXFP4_GROUP))
    raise KeyError(f"unexpected gpt-oss expert tensor {name!r}")


def checkpoint_slice(name: str, shard: TPShard, head_dim: int) -> TensorSlice | None:
    """What ``shard`` takes of the Hugging Face tensor ``name`` (None: the whole tensor)."""
    q = (shard.q_heads[0] * head_dim, shard.q_heads[1] * head_dim)
    kv = (shard.kv_heads[0] * head_dim, shard.kv_heads[1] * head_dim)
    is_bias = name.endswith(".bias")
    if ".experts." in name:
        return _expert_slice(name, shard)
    if name.endswith(".self_attn.sinks"):  # gpt-oss: one per query head
        return TensorSlice(0, *shard.q_heads)
    if ".shared_expert." in name:  # cut on its own width, as a dense MLP on the MLP's
        if ".down_proj." in name:
            if name.endswith(".bias"):
                return None if shard.rank == 0 else TensorSlice(0, 0, 0, zero=True)
            return TensorSlice(1, *shard.shared_expert)
        return TensorSlice(0, *shard.shared_expert)
    if ".qkv_proj." in name:  # stored fused (Phi-3): the rank's rows of q, of k, of v
        q_width, kv_width = shard.q_heads_total * head_dim, shard.kv_heads_total * head_dim
        return TensorSlice(
            0,
            *q,
            more=(
                (q_width + kv[0], q_width + kv[1]),
                (q_width + kv_width + kv[0], q_width + kv_width + kv[1]),
            ),
        )
    if ".gate_up_proj." in name:  # stored fused (Phi-3): the rank's rows of gate, of up
        return _parts(shard.intermediate, (0, shard.intermediate_total))
    if shard.proj_qk_norm and (".q_norm." in name or ".k_norm." in name):
        return TensorSlice(0, *(q if ".q_norm." in name else kv))
    if ".q_proj." in name:
        return TensorSlice(0, *q)
    if ".k_proj." in name or ".v_proj." in name:
        return TensorSlice(0, *kv)
    if ".gate_proj." in name or ".up_proj." in name:
        return TensorSlice(0, *shard.intermediate)
    if ".o_proj." in name or ".down_proj." in name:
        if is_bias:
            return None if shard.rank == 0 else TensorSlice(0, 0, 0, zero=True)
        return TensorSlice(1, *(q if ".o_proj." in name else shard.intermediate))
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return TensorSlice(0, *shard.vocab)
    return None  # norms: replicated
