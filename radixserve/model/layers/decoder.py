"""Decoder layers: where the norms sit around the attention and MLP blocks.

- :class:`PreNormDecoderLayer` (Llama, Qwen, Mistral, Phi-3): ``h += attn(norm(h))``,
  ``h += mlp(norm(h))``; the CPU's one-call decoder stack runs it and the post-norm one.
- the MLP block is the dense :class:`GatedMLP` or, in a mixture-of-experts layer,
  :class:`SparseMoeBlock` (:func:`mlp_block`);
- :class:`PostNormDecoderLayer` (OLMo 2): the norms on the blocks' outputs,
  ``h += norm(attn(h))``, ``h += norm(mlp(h))``.
- :class:`SandwichDecoderLayer` (Gemma 2/3): both, ``h += norm(attn(norm(h)))``,
  ``h += norm(mlp(norm(h)))``, with Gemma's ``1 + weight`` norms and GELU MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.model.attention.base import AttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.layers.attention import Attention
from radixserve.model.layers.mlp import GatedMLP
from radixserve.model.layers.moe import SparseMoeBlock
from radixserve.model.layers.norm import RMSNorm, rms_norm
from radixserve.model.parallel import TPGroup


def mlp_block(cfg: ModelConfig, layer_id: int, tp: TPGroup | None) -> GatedMLP | SparseMoeBlock:
    """Layer ``layer_id``'s MLP: the expert block where the config has experts for it, else
    the dense gated MLP (the config's gate activation)."""
    if cfg.moe is not None and cfg.moe.is_sparse(layer_id):
        return SparseMoeBlock(cfg.hidden_size, cfg.moe, cfg.mlp_bias, tp)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp, cfg.hidden_act)


class PreNormDecoderLayer(nn.Module):
    """Pre-norm attention block and pre-norm MLP block, each with a residual add."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp_block(cfg, layer_id, tp)
        self.residual_multiplier = cfg.residual_multiplier  # Granite's; 1 elsewhere

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        # Residual adds in place: ``h`` is this forward's own activation (the embedding's
        # output at layer 0), and in-place adds skip a row-sized allocation per block.
        a = self.self_attn.forward(self.input_layernorm.forward(h), batch, attn, cos_sin)
        m = self.residual_multiplier
        if m != 1.0:
            a.mul_(m)
        # h += a and the norm of the sum in one pass (one kernel on the GPU).
        out = self.mlp.forward(self.post_attention_layernorm.forward(a, residual=h))
        return h.add_(out) if m == 1.0 else h.add_(out, alpha=m)


class PostNormDecoderLayer(nn.Module):
    """Attention and MLP blocks whose outputs are normalized before the residual add (OLMo 2;
    the checkpoint names the norms ``post_attention_layernorm`` and
    ``post_feedforward_layernorm``)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp_block(cfg, layer_id, tp)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        a = self.self_attn.forward(h, batch, attn, cos_sin)
        h = h.add_(self.post_attention_layernorm.forward(a))
        return h.add_(self.post_feedforward_layernorm.forward(self.mlp.forward(h)))


class SandwichDecoderLayer(nn.Module):
    """Norms before and after each block (Gemma), the checkpoint's four norm names."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        h, eps, plus_one = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one
        self.input_layernorm = rms_norm(h, eps, plus_one)
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = rms_norm(h, eps, plus_one)
        self.pre_feedforward_layernorm = rms_norm(h, eps, plus_one)
        self.mlp = mlp_block(cfg, layer_id, tp)
        self.post_feedforward_layernorm = rms_norm(h, eps, plus_one)

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        a = self.self_attn.forward(self.input_layernorm.forward(h), batch, attn, cos_sin)
        h = h.add_(self.post_attention_layernorm.forward(a))
        m = self.mlp.forward(self.pre_feedforward_layernorm.forward(h))
        return h.add_(self.post_feedforward_layernorm.forward(m))


DecoderLayer = PreNormDecoderLayer | PostNormDecoderLayer | SandwichDecoderLayer


def decoder_layer(cfg: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> DecoderLayer:
    """The decoder layer of ``cfg``'s family (its ``norm_layout``)."""
    if cfg.norm_layout == "post":
        return PostNormDecoderLayer(cfg, layer_id, tp)
    if cfg.norm_layout == "sandwich":
        return SandwichDecoderLayer(cfg, layer_id, tp)
    return PreNormDecoderLayer(cfg, layer_id, tp)
