"""The attention block: fused qkv projection, the family's q/k norm, RoPE, the backend's
attention, output projection.

Options a family turns on through its :class:`~radixserve.model.config.ModelConfig`:

- ``attention_bias`` / ``o_proj_bias``: biases on q/k/v (Qwen2) and on the output (Llama's
  ``attention_bias`` sets both);
- ``qk_norm``: ``"head"`` normalizes each head of q and k over ``head_dim`` (Qwen3, OLMoE),
  ``"proj"`` the whole q and k projections (OLMo 2); both before RoPE;
- ``clip_qkv``: q, k and v clamped after the norms (OLMoE);
- ``rotary_dim`` below ``head_dim``: only the leading lanes rotate (Phi-4-mini);
- ``query_scale_beta``: each query scaled after RoPE by its position's temperature
  (Ministral 3); off the GPU's fused RoPE-and-store kernel, which does not scale;
- the layer's sliding window (``ModelConfig.layer_window``) and the scores' soft-cap
  (``attn_softcap``, Gemma 2), passed to the backend; the scores' scale
  (``ModelConfig.sm_scale``: Gemma's ``query_pre_attn_scalar``);
- ``attn_sinks``: gpt-oss's learned logit per query head (``sinks``, float32 for the
  backend), which joins each row's softmax denominator; passed to the backend, which applies
  it (only backends whose ``supports_sinks`` is set serve such a model).

The q/k norms write back into the fused projection, so everything after them (the CPU's
in-place RoPE, the GPU's fused RoPE-and-store kernel) runs as it does for Llama. Under tensor
parallelism a "proj" norm spans heads of every rank: each rank's float32 sums of squares of
its q and k lanes are all-reduced (one ``[T, 2]`` all-reduce per layer; gathering the
projections instead would move ``q + k`` values per row), then every lane scales by the whole
width's RMS.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.model import gpu_ops, native
from radixserve.model.attention.base import AttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.layers.norm import rms_norm, scale_normed
from radixserve.model.layers.rotary import apply_rotary, apply_rotary_interleaved
from radixserve.model.parallel import TPGroup


class Attention(nn.Module):
    """Self-attention of one layer. Under tensor parallelism (``tp``) ``cfg`` is the rank's
    local view (its own heads): qkv is column-parallel, o_proj row-parallel followed by one
    all-reduce."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_q_heads = cfg.num_q_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.sm_scale = cfg.sm_scale
        self.rotary_dim = cfg.rotary_dim
        self.rope = cfg.layer_rope(layer_id)  # False: a NoPE layer (SmolLM3)
        self.rope_interleaved = cfg.rope_interleaved  # GLM-4's pairs of neighbouring lanes
        self.qk_norm = cfg.qk_norm
        self.clip_qkv = cfg.clip_qkv
        self.qk_norm_tp = cfg.qk_norm_tp if tp is not None else None
        self.window = cfg.layer_window(layer_id)
        self.softcap = cfg.attn_softcap
        self.query_scale = (cfg.query_scale_beta, cfg.query_scale_period)
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm is not None:
            width = cfg.head_dim if cfg.qk_norm == "head" else None
            self.q_norm = rms_norm(width or self.q_size, cfg.rms_norm_eps, cfg.norm_plus_one)
            self.k_norm = rms_norm(width or self.kv_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.sinks = nn.Parameter(torch.empty(cfg.num_q_heads)) if cfg.attn_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        t = x.shape[0]
        flat = self.qkv_proj.forward(x)
        if self.qk_norm is not None:
            self._norm_qk(flat)
        if self.clip_qkv is not None:  # OLMoE: after the norms, before RoPE
            flat.clamp_(-self.clip_qkv, self.clip_qkv)
        qkv = flat.view(t, self.num_q_heads + 2 * self.num_kv_heads, self.head_dim)
        full_rotary = self.rotary_dim == self.head_dim and not self.rope_interleaved
        plain = self.window is None and self.softcap is None and self.sinks is None
        fusable = full_rotary and self.rope and not self.query_scale[0]
        if plain and fusable and gpu_ops.enabled(qkv) and attn.fuses_rope_store:
            # One kernel rotates q and k and writes k and v to the pool (Triton backend).
            out = attn.forward_qkv(
                self.layer_id, qkv, cos_sin, self.num_q_heads, batch, self.sm_scale
            )
            return self._out(out.reshape(t, self.q_size))
        n_qk = self.num_q_heads + self.num_kv_heads
        # q and k rotate together: one op for both (in place, one pass, with the CPU kernel).
        if not self.rope:
            qk = qkv[:, :n_qk]  # a NoPE layer: positions only through the causal mask
        elif full_rotary and native.enabled(qkv):
            qk = qkv[:, :n_qk]
            native.rotary_(qk, *cos_sin)
        elif self.rope_interleaved:
            qk = apply_rotary_interleaved(qkv[:, :n_qk], *cos_sin)
        else:
            qk = apply_rotary(qkv[:, :n_qk], *cos_sin)
        q, k = qk[:, : self.num_q_heads], qk[:, self.num_q_heads :]
        v = qkv[:, n_qk:]
        if self.query_scale[0]:
            q = q * _temperature(batch.positions, *self.query_scale).to(q.dtype)[:, None, None]
        if plain:
            out = attn.forward(self.layer_id, q, k, v, batch, self.sm_scale)
        else:
            if self.window is not None and batch.window_view is not None:
                batch = batch.window_view  # this layer's KV is in the window pool
            sinks = None if self.sinks is None else self.sinks.float()
            out = attn.forward(
                self.layer_id, q, k, v, batch, self.sm_scale, self.window, self.softcap, sinks
            )
        return self._out(out.reshape(t, self.q_size))

    def _norm_qk(self, flat: torch.Tensor) -> None:
        """The family's q/k norm, in place in the fused projection ``[T, q + 2 kv]``."""
        q, k = flat[:, : self.q_size], flat[:, self.q_size : self.q_size + self.kv_size]
        if self.qk_norm == "head":
            t = flat.shape[0]
            q = q.view(t, self.num_q_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
        elif self.qk_norm_tp is not None:
            self._norm_qk_over_ranks(q, k)
            return
        q.copy_(self.q_norm.forward(q))
        k.copy_(self.k_norm.forward(k))

    def _norm_qk_over_ranks(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """A "proj" q/k norm of this rank's lanes, the RMS taken over every rank's (module
        docstring); a rank sharing a replicated KV head with an earlier one adds no k sum."""
        assert self.tp is not None and self.qk_norm_tp is not None
        q_width, k_width, counts_k = self.qk_norm_tp
        qf, kf = q.float(), k.float()
        sums = torch.stack((qf.square().sum(-1), kf.square().sum(-1)), dim=-1)
        if not counts_k:
            sums[:, 1] = 0.0
        self.tp.all_reduce(sums)
        widths = torch.tensor([q_width, k_width], dtype=torch.float32, device=sums.device)
        inv = torch.rsqrt(sums / widths + self.q_norm.eps)
        q.copy_(scale_normed(self.q_norm, qf * inv[:, :1], q.dtype))
        k.copy_(scale_normed(self.k_norm, kf * inv[:, 1:], k.dtype))

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        out = self.o_proj.forward(x)
        return out if self.tp is None else self.tp.all_reduce(out)


def _temperature(positions: torch.Tensor, beta: float, period: int) -> torch.Tensor:
    """Each row's query scale, ``1 + beta * ln(1 + floor(position / period))`` in float32
    (1 exactly before ``period``), in transformers' Ministral 3's order of operations."""
    return 1.0 + beta * torch.log(1.0 + torch.floor(positions / period))
