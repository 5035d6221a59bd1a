"""One Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a flattened ragged batch.

Every sequence's new rows are concatenated into ``T`` rows (no padding); each row carries its
own position, so RoPE and the attention backend need no per-sequence loops here. Numerics
follow transformers' implementation step for step (RMSNorm in float32 then cast back, RoPE
with ``rotate_half``, SiLU-gated MLP), so float32 logits match it to rounding.

CPU-friendly fusions: q/k/v are one ``qkv_proj`` matmul and gate/up one ``gate_up_proj``
matmul (one large GEMM beats three small ones at 2 threads); RoPE rotates q and k in one op.
On the CPU, RoPE, SiLU(gate) * up and RMSNorm (with its residual add) are one-pass kernels
(``native.py``, float32 inside, rounded once: in bf16 that differs from transformers'
op-by-op rounding by an ulp or so).
The checkpoint's separate tensors are copied into slices of the fused weights by
:meth:`LlamaForCausalLM.load_weights`.

Inside a forward the layers call their submodules' ``forward`` directly, not through
``nn.Module.__call__``: its hook bookkeeping costs ~1.4 us a call here, and a batch-1 decode
step makes ~270 such calls (~0.4 ms of a ~25 ms step). Hooks on these submodules therefore
do not run; nothing in radixserve registers any.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import gpu_ops, native
from radixserve.model.attention.base import AttentionBackend, NativeLayersPlan
from radixserve.model.config import ModelConfig, RopeScaling
from radixserve.model.decoder_stack import AttentionShape, DecoderStack, LayerParts
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.parallel import ParallelLMHead, TPGroup, TPShard, VocabParallelEmbedding


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Normalize ``x``; with ``residual``, first ``residual += x`` (in place) and normalize that."""
        if gpu_ops.enabled(x):  # one Triton pass, the residual add included
            from radixkernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, residual=residual)
        if (
            native.enabled(x)
            and x.dim() == 2
            and x.is_contiguous()
            and self.weight.dtype == x.dtype
            and (residual is None or residual.is_contiguous())
        ):  # the add and the norm in one pass (torch's CPU rms_norm is ~6 ops)
            return native.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual.add_(x)
        # torch's fused rms_norm: one op instead of five (60 norms per decode step add up on a CPU).
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32, CPU) for the config's RoPE type."""
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    )
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by ``factor``, short ones kept, a smooth ramp between.
        old_ctx = scaling.original_max_position_embeddings
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {scaling.rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding: a cos/sin table indexed by each row's position.

    The table grows on demand (doubling), sized from the batch's host-side sequence lengths,
    so a forward never syncs the device to learn the largest position.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = rope_inv_freq(
            head_dim, theta, scaling
        )  # plain attribute: stays out of state_dict
        self._cos: torch.Tensor | None = None  # [L, head_dim] float32
        self._sin: torch.Tensor | None = None

    def _ensure(self, length: int, device: torch.device) -> None:
        if self._cos is not None and self._cos.shape[0] >= length and self._cos.device == device:
            return
        n = max(4096, 1 << max(0, length - 1).bit_length())
        inv = self.inv_freq.to(device)
        freqs = torch.outer(torch.arange(n, dtype=torch.float32, device=device), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def cos_sin(
        self, positions: torch.Tensor, max_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of each row's position, ``[T, 1, head_dim]`` in ``dtype``; computed once per
        forward and shared by every layer. ``max_len`` bounds the positions (host-side)."""
        self._ensure(max_len, positions.device)
        assert self._cos is not None and self._sin is not None
        cos = self._cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self._sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` (transformers' ``rotate_half`` convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    """Fused qkv projection, RoPE, the backend's attention, output projection.

    Under tensor parallelism (``tp``) ``cfg`` is the rank's local view (its own heads): qkv is
    column-parallel, o_proj row-parallel followed by one all-reduce."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_q_heads = cfg.num_q_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.sm_scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x).view(
            t, self.num_q_heads + 2 * self.num_kv_heads, self.head_dim
        )
        if gpu_ops.enabled(qkv) and attn.fuses_rope_store:
            # One kernel rotates q and k and writes k and v to the pool (Triton backend).
            out = attn.forward_qkv(
                self.layer_id, qkv, cos_sin, self.num_q_heads, batch, self.sm_scale
            )
            return self._out(out.reshape(t, self.q_size))
        n_qk = self.num_q_heads + self.num_kv_heads
        # q and k rotate together: one op for both (in place, one pass, with the CPU kernel).
        if native.enabled(qkv):
            qk = qkv[:, :n_qk]
            native.rotary_(qk, *cos_sin)
        else:
            qk = apply_rotary(qkv[:, :n_qk], *cos_sin)
        q, k = qk[:, : self.num_q_heads], qk[:, self.num_q_heads :]
        v = qkv[:, n_qk:]
        out = attn.forward(self.layer_id, q, k, v, batch, self.sm_scale)
        return self._out(out.reshape(t, self.q_size))

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        out = self.o_proj.forward(x)
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaMLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one matmul (column-parallel under tensor
    parallelism, down_proj row-parallel followed by one all-reduce)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._forward(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if gpu_ops.enabled(gate_up):
            from radixkernels.fused import silu_mul

            return self.down_proj.forward(silu_mul(gate_up))
        if native.enabled(gate_up):  # one pass over gate and up
            return self.down_proj.forward(native.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        # In place into silu's fresh output: one allocation less (2.9 -> 2.0 ms at 2048 rows here).
        return self.down_proj.forward(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block and pre-norm MLP block, each with a residual add."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

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
        # h += a and the norm of the sum in one pass (one kernel on the GPU).
        return h.add_(self.mlp.forward(self.post_attention_layernorm.forward(a, residual=h)))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (no LM head). ``cfg`` is the rank's local
    view under tensor parallelism (then the embedding is vocab-parallel)."""

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup | None = None, shard: TPShard | None = None
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            if shard is None
            else VocabParallelEmbedding(shard, cfg.hidden_size, tp)
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


# checkpoint suffix -> (fused parameter suffix, shard index); shards are laid out in this order.
_STACKED: dict[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """The causal LM: ``forward(batch, attn)`` returns float32 logits of ``batch.logits_indices``.

    With ``tp`` (a :class:`~radixserve.model.parallel.TPGroup` of two or more ranks) the model
    holds rank ``tp.rank``'s shard (:func:`~radixserve.model.parallel.shard_for_rank`) and
    every rank's forward returns the full logits. ``config`` stays the whole model's;
    ``local_config`` is this rank's share (heads, MLP width, vocabulary rows).
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.shard: TPShard | None = None
        self.local_config = cfg
        if tp is not None:
            from radixserve.model.parallel import shard_for_rank

            self.shard = shard_for_rank(cfg, tp.rank, tp.world_size)
            self.local_config = self.shard.local_config(cfg)
        self.model = LlamaModel(self.local_config, tp, self.shard)
        self.lm_head: nn.Linear | ParallelLMHead = (
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if self.shard is None
            else ParallelLMHead(self.shard, cfg.hidden_size, cfg.vocab_size, tp)
        )
        # What the loader's quantization did (a quant.apply.QuantReport; not imported here:
        # quant.apply is typed against this module), None when the weights are as loaded.
        self.quant_report: Any = None
        # Run the decoder layers of small CPU forwards in one native call (decoder_stack.py);
        # False keeps the per-layer Python path (the tests compare the two).
        self.native_stack = True
        self._stack: DecoderStack | None = None

    # From the final norm, which no quantization replaces (the embedding may be int8).
    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Run every layer over the batch's ``T`` rows; logits ``[len(logits_indices), vocab]`` float32."""
        h = self.model.embed_tokens(batch.input_ids)
        # The CPU kernel's RoPE takes float32 angles (rounding once, after the rotation).
        rope_dtype = torch.float32 if native.enabled(h) else h.dtype
        cos_sin = self.model.rotary.cos_sin(batch.positions, max(batch.seq_lens_cpu), rope_dtype)
        stack = self._native_stack(h, batch, attn)
        if stack is not None:  # every layer in one native call (decoder_stack.py)
            stack[0].run(h, cos_sin, stack[1])
        else:
            for layer in self.model.layers:
                h = layer.forward(h, batch, attn, cos_sin)
        # The final norm is per row: only the rows whose logits are wanted need it.
        h = self.model.norm(h.index_select(0, batch.logits_indices))
        return self.lm_head(h).float()

    def _native_stack(
        self, h: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> tuple[DecoderStack, NativeLayersPlan] | None:
        """The one-call decoder stack and the step's attention plan, where they serve this
        forward: CPU kernels, one process's whole model, few enough rows, the native attention."""
        if not self.native_stack or self.tp is not None or not native.enabled(h):
            return None
        if self._stack is None:  # described once, after loading and quantization replaced modules
            self._stack = self._describe_stack(h.dtype)
        if h.shape[0] > self._stack.max_rows():
            return None
        plan = attn.native_layers_plan(batch)
        return None if plan is None else (self._stack, plan)

    def _describe_stack(self, act_dtype: torch.dtype) -> DecoderStack:
        """This model's layers as :class:`DecoderStack` parts (their modules as they are now)."""
        layers = cast("list[LlamaDecoderLayer]", list(self.model.layers))
        attn = layers[0].self_attn
        return DecoderStack(
            [
                LayerParts(
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    (
                        layer.self_attn.qkv_proj,
                        layer.self_attn.o_proj,
                        layer.mlp.gate_up_proj,
                        layer.mlp.down_proj,
                    ),
                )
                for layer in layers
            ],
            AttentionShape(attn.num_q_heads, attn.num_kv_heads, attn.sm_scale),
            self.local_config.rms_norm_eps,
            act_dtype,
        )

    # -- weights -------------------------------------------------------------------------

    def _shard_sizes(self, fused: str) -> list[int]:
        cfg = self.local_config
        if fused.endswith("qkv_proj"):
            return [cfg.q_size, cfg.kv_size, cfg.kv_size]
        return [cfg.intermediate_size, cfg.intermediate_size]

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """Install checkpoint tensors (HF names) into the parameters.

        The model is expected to be built on the ``meta`` device: an unfused tensor that
        already has the target dtype and device becomes the parameter as is (for a
        safetensors mmap, zero copy); others are converted once; q/k/v and gate/up shards
        are copied once into their slice of a freshly allocated fused weight.
        """
        device = torch.device(device)
        params = dict(self.named_parameters(remove_duplicate=False))
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some checkpoints store the tied head anyway; the embedding is the one used
            target, shard = name, None
            for suffix, (fused, idx) in _STACKED.items():
                if f".{suffix}." in name:
                    target, shard = name.replace(suffix, fused), idx
                    break
            if target not in params:
                raise KeyError(f"unexpected weight {name!r} in checkpoint")
            if shard is None:
                self._set_param(target, tensor.to(device=device, dtype=dtype))
            else:
                fused_param = self.get_parameter(target)
                if fused_param.is_meta:
                    self._set_param(
                        target, torch.empty(fused_param.shape, dtype=dtype, device=device)
                    )
                    fused_param = self.get_parameter(target)
                sizes = self._shard_sizes(target.rsplit(".", 1)[0])
                start = sum(sizes[:shard])
                dst = fused_param.data[start : start + sizes[shard]]
                if dst.shape != tensor.shape:
                    raise ValueError(
                        f"shape mismatch for {name}: {tuple(tensor.shape)} vs {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
            filled.add(f"{target}#{shard}")
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        missing = [n for n, p in self.named_parameters() if p.is_meta]
        if missing:
            raise KeyError(
                f"checkpoint is missing weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
        expected_shards = {
            f"{n}#{i}"
            for n in params
            if n.endswith(("qkv_proj.weight", "qkv_proj.bias"))
            for i in range(3)
        } | {
            f"{n}#{i}"
            for n in params
            if n.endswith(("gate_up_proj.weight", "gate_up_proj.bias"))
            for i in range(2)
        }
        if not expected_shards <= filled:
            raise KeyError(f"checkpoint is missing shards {sorted(expected_shards - filled)[:5]}")

    def _set_param(self, name: str, tensor: torch.Tensor) -> None:
        module_name, _, attr = name.rpartition(".")
        module = self.get_submodule(module_name)
        old = module._parameters[attr]
        if old is not None and tuple(old.shape) != tuple(tensor.shape):
            raise ValueError(
                f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model {tuple(old.shape)}"
            )
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
