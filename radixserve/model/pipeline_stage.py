"""One pipeline stage of a Llama-family model: the decoder layers ``[start, end)`` and nothing else
it does not need.

A model split into ``pp`` stages (:mod:`radixserve.memory.sharding` decides the ranges) runs as
a chain; only hidden states travel between stages (this decoder adds each block's residual in
place, so there is no separate residual stream to carry, unlike vLLM's ``IntermediateTensors``
of hidden states + residual)::

    stage 0:  input_ids ─> embed_tokens ─> layers [0, a) ─────────────> hidden [T, H] ─┐
    stage 1:                    hidden ─> layers [a, b) ─────────────> hidden [T, H] ─┤ send/recv
    stage pp-1:                 hidden ─> layers [c, L) ─> norm ─> LM head ─> logits   ┘

Like vLLM's ``make_layers`` + ``PPMissingLayer``, a stage builds only its own modules, and the
parameter names stay the checkpoint's (``model.layers.40.…``: the layers sit in a
``ModuleDict`` keyed by their global index), so :meth:`LlamaForCausalLM.load_weights` installs
them unchanged once :meth:`LlamaPipelineStage.load_weights` has dropped the other stages'
tensors. Each layer's attention addresses the stage's KV pool by its *local* index
(``layer - start``): a stage's pool holds its own layers only, in the same page layout, so page
``p`` means the same tokens on every stage.

Tied embeddings: the last stage has no embedding, so its LM head is loaded from the
checkpoint's ``model.embed_tokens.weight`` (its own copy, as in vLLM).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from radixserve.memory.sharding import DeviceShard
from radixserve.model import native
from radixserve.model.attention.base import AttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.layers.decoder import decoder_layer
from radixserve.model.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
    token_embedding,
)
from radixserve.model.parallel import (
    ParallelLMHead,
    TPGroup,
    TPShard,
    VocabParallelEmbedding,
    shard_for_rank,
)

_LAYER_PREFIX = "model.layers."


class StageBody(nn.Module):
    """The ``model.`` part of a stage: its embedding (first stage), layers, final norm (last).
    ``cfg`` is the rank's local view under tensor parallelism (``tp``, ``tp_shard``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        stage: DeviceShard,
        tp: TPGroup | None = None,
        tp_shard: TPShard | None = None,
    ) -> None:
        super().__init__()
        start, end = stage.layer_start, stage.layer_end or cfg.num_layers
        self.embed_tokens: nn.Module | None = None
        if stage.has_embedding:
            self.embed_tokens = (
                token_embedding(cfg.vocab_size, cfg.hidden_size)
                if tp_shard is None
                else VocabParallelEmbedding(tp_shard, cfg.hidden_size, tp)
            )
        # Global indices as keys keep the checkpoint's names; local indices address the pool.
        self.layers = nn.ModuleDict(
            {str(i): decoder_layer(cfg, i - start, tp) for i in range(start, end)}
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.has_lm_head else None
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim
        )


class LlamaPipelineStage(LlamaForCausalLM):
    """Layers ``[stage.layer_start, stage.layer_end)`` of a :class:`LlamaForCausalLM`; with ``tp``
    this rank's tensor-parallel share of them (the stage is a TP group).

    :meth:`forward` takes the previous stage's hidden states (none on the first stage) and
    returns the next stage's input, or on the last stage the float32 logits of
    ``batch.logits_indices``, exactly as the whole model does. It inherits the whole model's
    weight loading (fused q/k/v and gate/up, zero-copy mmap) and is built on ``meta`` the same
    way; ``__init__`` deliberately does not call the parent's, which would build every layer.
    """

    def __init__(self, cfg: ModelConfig, stage: DeviceShard, tp: TPGroup | None = None) -> None:
        nn.Module.__init__(self)
        # The stage body has no embedding scale, soft-cap, local RoPE or Granite's scalars.
        if cfg.norm_layout == "sandwich" or cfg.scaled:
            raise ValueError(f"pipeline parallelism is not supported for {cfg.model_type} yet")
        end = stage.layer_end or cfg.num_layers
        if not 0 <= stage.layer_start < end <= cfg.num_layers:
            raise ValueError(
                f"stage layers [{stage.layer_start}, {end}) outside the model's {cfg.num_layers}"
            )
        self.full_config = cfg
        self.score = None  # sequence classifiers are not served with pipeline parallelism
        # The tie applies inside one module only when it holds both ends (pp 1): otherwise the
        # last stage's head is its own copy of the embedding, loaded by name.
        both_ends = stage.has_embedding and stage.has_lm_head
        self.config = dataclasses.replace(
            cfg, tie_word_embeddings=cfg.tie_word_embeddings and both_ends
        )
        self.stage = dataclasses.replace(stage, layer_end=end)
        # Tensor parallelism inside the stage, as LlamaForCausalLM does it for the whole model.
        self.tp = tp
        self.shard: TPShard | None = None
        self.local_config = cfg
        if tp is not None:
            self.shard = shard_for_rank(cfg, tp.rank, tp.world_size)
            self.local_config = self.shard.local_config(cfg)
        body = StageBody(self.local_config, self.stage, tp, self.shard)
        self.model = body  # type: ignore[assignment]
        head: nn.Module | None = None
        if stage.has_lm_head:
            head = (
                nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
                if self.shard is None
                else ParallelLMHead(self.shard, cfg.hidden_size, cfg.vocab_size, tp)
            )
        self.lm_head = head  # type: ignore[assignment]
        self.quant_report = None

    @property
    def num_local_layers(self) -> int:
        """Decoder layers on this stage (the KV pool's layer count)."""
        return self.stage.layers(self.full_config.num_layers)

    @property
    def is_first(self) -> bool:
        return self.stage.has_embedding

    @property
    def is_last(self) -> bool:
        return self.stage.has_lm_head

    @property
    def body(self) -> StageBody:
        """``self.model`` as what it is here (the parent types it as the whole model)."""
        return cast(StageBody, self.model)

    def _first_layer(self) -> LlamaDecoderLayer:
        return cast(LlamaDecoderLayer, next(iter(self.body.layers.values())))

    @property
    def dtype(self) -> torch.dtype:
        return self._first_layer().input_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self._first_layer().input_layernorm.weight.device

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        attn: AttentionBackend,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this stage's layers over the batch's ``T`` rows.

        ``hidden`` ``[T, hidden_size]`` is the previous stage's output (required unless this
        is the first stage, which embeds ``batch.input_ids``; it is updated in place). Returns
        hidden states ``[T, hidden_size]``, or on the last stage float32 logits
        ``[len(logits_indices), vocab]``.
        """
        body = self.body
        if body.embed_tokens is not None:
            h = body.embed_tokens(batch.input_ids)
        elif hidden is None:
            raise ValueError(f"stage {self.stage.pp_rank} needs the previous stage's hidden states")
        else:
            h = hidden
        rope_dtype = torch.float32 if native.enabled(h) else h.dtype
        cos_sin = body.rotary.cos_sin(batch.positions, max(batch.seq_lens_cpu), rope_dtype)
        for layer in body.layers.values():
            h = layer(h, batch, attn, cos_sin)
        lm_head = cast(nn.Module | None, self.lm_head)
        if body.norm is None or lm_head is None:
            return h
        h = body.norm(h.index_select(0, batch.logits_indices))
        return lm_head(h).float()

    def owns(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` belongs to this stage."""
        if name.startswith(_LAYER_PREFIX):
            index = int(name[len(_LAYER_PREFIX) :].split(".", 1)[0])
            return self.stage.layer_start <= index < (self.stage.layer_end or 0)
        if name.startswith("model.embed_tokens."):
            return self.is_first
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last
        return True  # e.g. rotary_emb buffers, which the loader skips

    def keeps(self, name: str) -> bool:
        """Whether :meth:`stage_weights` uses the checkpoint tensor ``name`` (read it or not)."""
        if name == "model.embed_tokens.weight" and self.full_config.tie_word_embeddings:
            return self.is_first or self.is_last
        return self.owns(name)

    def stage_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors of this stage; a tied head comes from the embedding's tensor.

        Tensors of other stages are skipped before they are read (for a safetensors mmap the
        name is all that was touched)."""
        tied_copy = self.is_last and not self.is_first and self.full_config.tie_word_embeddings
        for name, tensor in weights:
            if tied_copy and name == "model.embed_tokens.weight":
                yield "lm_head.weight", tensor
            elif self.owns(name):
                yield name, tensor

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """Install this stage's tensors (see :meth:`LlamaForCausalLM.load_weights`)."""
        super().load_weights(self.stage_weights(weights), dtype, device)
