"""The causal LM every supported family runs (Llama, SmolLM2, Mistral, Qwen2, Qwen3, OLMo 2,
Phi-3/4, Gemma 2/3 (a multimodal checkpoint's text model too), and the MoE families) over a
flattened ragged batch; the layers are composed from ``model/layers/`` by the
family's config (``model/families/``).

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
:meth:`LlamaForCausalLM.load_weights` (Phi-3's checkpoints store them fused already).

Llama-shaped families, Mistral with its sliding window, Qwen3 with its per-head q/k norm,
OLMo 2 with its post-norms and whole-projection q/k norm, Gemma 2 and 3 with their sandwich
norms, windows, soft-caps and local RoPE (``ModelConfig.stack_shaped``: full rotary, dense
MLPs) run the CPU's one-call decoder stack; the others (partial-rotary Phi, MoE, OLMoE's
clipped q/k/v) take the per-layer path, which :attr:`LlamaForCausalLM.native_stack_reason` says.

Inside a forward the layers call their submodules' ``forward`` directly, not through
``nn.Module.__call__``: its hook bookkeeping costs ~1.4 us a call here, and a batch-1 decode
step makes ~270 such calls (~0.4 ms of a ~25 ms step). Hooks on these submodules therefore
do not run; nothing in radixserve registers any.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import cast

import torch
from torch import nn

from radixserve.model import cpu_gemv, native
from radixserve.model.attention.base import AttentionBackend, NativeLayersPlan
from radixserve.model.config import ModelConfig
from radixserve.model.decoder_stack import DecoderStack, LayerParts, StackLora, StackShape
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.layers.attention import Attention
from radixserve.model.layers.decoder import (
    DecoderLayer,
    PostNormDecoderLayer,
    PreNormDecoderLayer,
    SandwichDecoderLayer,
    decoder_layer,
)
from radixserve.model.layers.gpt_oss_experts import gpt_oss_expert_tensors
from radixserve.model.layers.mlp import GatedMLP
from radixserve.model.layers.moe import expert_checkpoint_names
from radixserve.model.layers.norm import RMSNorm, rms_norm, stack_weight
from radixserve.model.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq
from radixserve.model.lora.adapter import LoraAdapter
from radixserve.model.lora.registry import LoraRegistry, LoraRows, unwrap
from radixserve.model.parallel import ParallelLMHead, TPGroup, TPShard, VocabParallelEmbedding
from radixserve.model.quant.apply import QuantReport

__all__ = [
    "Attention",
    "DecoderLayer",
    "GatedMLP",
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "rope_inv_freq",
]

# The shared pieces under the names this module has always exported.
LlamaAttention = Attention
LlamaMLP = GatedMLP
LlamaDecoderLayer = PreNormDecoderLayer


def token_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """``nn.Embedding`` without its random init: the weights always come from a checkpoint,
    and on the meta device (where models are built) the init's ``normal_`` imports
    ``torch._dynamo``, a large import, into every worker's start-up for nothing."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (no LM head). ``cfg`` is the rank's local
    view under tensor parallelism (then the embedding is vocab-parallel)."""

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup | None = None, shard: TPShard | None = None
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            token_embedding(cfg.vocab_size, cfg.hidden_size)
            if shard is None
            else VocabParallelEmbedding(shard, cfg.hidden_size, tp)
        )
        self.layers = nn.ModuleList(decoder_layer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim
        )
        # Gemma 3's sliding layers rotate with a base of their own, unscaled.
        self.local_rotary = (
            None
            if cfg.local_rope_theta is None
            else RotaryEmbedding(cfg.head_dim, cfg.local_rope_theta, None, cfg.rotary_dim)
        )
        # Gemma: embeddings times sqrt(hidden), that factor rounded to the run dtype first.
        self.embed_scale = math.sqrt(cfg.hidden_size) if cfg.embed_scale else None


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma's final logits), or ``x`` when there is no cap."""
    return x if cap is None else torch.tanh(x / cap).mul_(cap)


# checkpoint projection -> (fused projection, shard index); shards are laid out in this order.
# Matched on the module's own name, so experts' ``experts.{e}.gate_proj`` fuse as ``mlp.gate_proj``.
_STACKED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _head_norms(attn: Attention) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A layer's q and k norm weights for the one-call stack (None: no q/k norm)."""
    if attn.qk_norm is None:
        return None
    return stack_weight(attn.q_norm), stack_weight(attn.k_norm)


def _layer_norms(layer: DecoderLayer) -> tuple[RMSNorm, ...]:
    """A decoder layer's norms in its layout's order (``decoder_stack.LayerParts``)."""
    if isinstance(layer, PostNormDecoderLayer):
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm
    if isinstance(layer, SandwichDecoderLayer):
        return (
            layer.input_layernorm,
            layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm,
            layer.post_feedforward_layernorm,
        )
    return layer.input_layernorm, layer.post_attention_layernorm


# A decoder layer's linears in the one-call stack's order (LayerParts.linears).
STACK_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _stack_parts(layer: DecoderLayer) -> LayerParts:
    """A decoder layer as the one-call stack's parts."""
    mlp = cast("GatedMLP", layer.mlp)
    # The stack runs only forwards without adapted rows: a LoRA layer's base is the layer.
    linears = (
        unwrap(layer.self_attn.qkv_proj),
        unwrap(layer.self_attn.o_proj),
        unwrap(mlp.gate_up_proj),
        unwrap(mlp.down_proj),
    )
    norms = tuple(stack_weight(norm) for norm in _layer_norms(layer))
    return LayerParts(norms, linears, _head_norms(layer.self_attn), layer.self_attn.window)


def _stacked_target(name: str) -> tuple[str, int | None]:
    """``(parameter name, shard)`` of checkpoint tensor ``name`` (shard None: unfused)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED:
        fused, idx = _STACKED[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), idx
    return name, None


class LlamaForCausalLM(nn.Module):
    """The causal LM: ``forward(batch, attn)`` returns float32 logits of ``batch.logits_indices``.

    With ``tp`` (a :class:`~radixserve.model.parallel.TPGroup` of two or more ranks) the model
    holds rank ``tp.rank``'s shard (:func:`~radixserve.model.parallel.shard_for_rank`) and
    every rank's forward returns the full logits. ``config`` stays the whole model's;
    ``local_config`` is this rank's share (heads, MLP width, vocabulary rows; with
    ``expert_parallel``, a MoE model's own whole experts instead of every expert's rows).
    """

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup | None = None, expert_parallel: bool = False
    ) -> None:
        super().__init__()
        if tp is not None:
            from radixserve.model.families import family_of

            family = family_of(cfg.model_type)
            if family is not None and family.tensor_parallel is not None:
                raise ValueError(
                    f"tensor parallelism is not supported for {cfg.model_type}: "
                    f"{family.tensor_parallel}"
                )
        self.config = cfg
        self.tp = tp
        self.shard: TPShard | None = None
        self.local_config = cfg
        if tp is not None:
            from radixserve.model.parallel import shard_for_rank

            self.shard = shard_for_rank(cfg, tp.rank, tp.world_size, expert_parallel)
            self.local_config = self.shard.local_config(cfg)
        self.model = LlamaModel(self.local_config, tp, self.shard)
        self.lm_head: nn.Linear | ParallelLMHead = (
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if self.shard is None
            else ParallelLMHead(self.shard, cfg.hidden_size, cfg.vocab_size, tp)
        )
        # What the loader's quantization did, None when the weights are as loaded.
        self.quant_report: QuantReport | None = None
        # Run the decoder layers of small CPU forwards in one native call (decoder_stack.py);
        # False keeps the per-layer Python path (the tests compare the two).
        self.native_stack = True
        self._stack: DecoderStack | None = None
        # A base model's checkpoint without an LM head (load_weights): embeddings only.
        self.embeddings_only = False
        # A sequence classifier's score head ([num_labels, hidden]: model/classifier.py): its
        # embedding is the class logits, and it serves nothing else. None for other models.
        self.score: nn.Module | None = None
        if cfg.classifier is not None:
            if tp is not None:
                raise ValueError("tensor parallelism is not supported for sequence classifiers")
            self.score = nn.Linear(cfg.hidden_size, cfg.classifier.num_labels, bias=False)
        # The LoRA adapters served beside the weights (serve_lora); None: none. Each one's
        # form for the one-call stack is made at its first step there (LoraRegistry.memo).
        self.lora: LoraRegistry | None = None

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
        if self.model.embed_scale is not None:
            h = h * torch.tensor(self.model.embed_scale, dtype=h.dtype)
        if self.config.embedding_multiplier != 1.0:  # Granite's
            h = h * self.config.embedding_multiplier
        # The CPU kernel's RoPE takes float32 angles (rounding once, after the rotation).
        rope_dtype = torch.float32 if native.enabled(h) else h.dtype
        max_len = max(batch.seq_lens_cpu)
        cos_sin = self.model.rotary.cos_sin(batch.positions, max_len, rope_dtype)
        local = self.model.local_rotary
        local_cos_sin = (
            cos_sin if local is None else local.cos_sin(batch.positions, max_len, rope_dtype)
        )
        # The one-call stack adds one LoRA adapter's deltas to every row; a step mixing
        # adapters (or the base model and one) takes the per-layer path.
        lora = None if batch.lora is None else self._stack_lora(batch.lora)
        stack = (
            None if batch.lora is not None and lora is None else self._native_stack(h, batch, attn)
        )
        if stack is not None:  # every layer in one native call (decoder_stack.py)
            stack[0].run(h, cos_sin, stack[1], None if local is None else local_cos_sin, lora)
        else:
            with self._lora_applied(batch):
                for layer in cast("list[DecoderLayer]", self.model.layers):
                    windowed = layer.self_attn.window is not None
                    h = layer.forward(h, batch, attn, local_cos_sin if windowed else cos_sin)
        # The final norm is per row: only the rows whose logits are wanted need it.
        h = self.model.norm(h.index_select(0, batch.logits_indices))
        if batch.keep_hidden:
            batch.hidden = h
        logits = self.lm_head(h).float()
        if self.config.logits_scaling != 1.0:  # Granite's
            logits.div_(self.config.logits_scaling)
        return soft_cap(logits, self.config.final_softcap)

    def pooled(self, h: torch.Tensor) -> torch.Tensor:
        """A prompt's embedding from the final norm's output at its last token (``h``: [N,
        hidden]): that output itself, or a classifier's logits ([N, num_labels]: the score
        head applied here, on the worker, so that num_labels floats cross to the router rather
        than hidden_size)."""
        return h if self.score is None else self.score(h)

    def _lora_applied(self, batch: ForwardBatch) -> AbstractContextManager[None]:
        """Where the batch has adapted rows, the adapters' deltas are added within."""
        if batch.lora is None:
            return nullcontext()
        assert self.lora is not None, "a batch names LoRA rows, but no adapter is served"
        return self.lora.applied(batch.lora)

    def _stack_lora(self, rows: LoraRows) -> StackLora | None:
        """The one-call stack's form of the adapter that owns every row of a step (None:
        the step mixes adapters, or its deltas would not run the GEMV kernel there)."""
        if len(rows.groups) != 1 or rows.groups[0][1] is not None or not cpu_gemv.available():
            return None
        assert self.lora is not None, "a batch names LoRA rows, but no adapter is served"
        adapter = rows.groups[0][0]
        return self.lora.memo(adapter, "stack", lambda: self._stack_form(adapter))

    def _stack_form(self, adapter: LoraAdapter) -> StackLora | None:
        """``adapter`` as the one-call stack takes it (None: its matrices are not in the
        activations' dtype, which the kernel multiplies in)."""
        matrices: list[torch.Tensor | None] = []
        first_cols: list[int] = []
        for layer in range(len(self.model.layers)):
            for name in STACK_LINEARS:
                delta = adapter.deltas.get(f"model.layers.{layer}.{name}")
                matrices += [None, None] if delta is None else [delta.a, delta.b]
                first_cols.append(0 if delta is None else delta.lo)
        same = all(m is None or m.dtype == self.dtype for m in matrices)
        return StackLora(matrices, first_cols) if same else None

    def serve_lora(
        self, specs: Sequence[str], max_rank: int, max_loaded: int | None = None
    ) -> LoraRegistry:
        """Load the LoRA adapters of ``specs`` (``name=path``; none: adapters only loaded
        while serving) and wrap the layers they adapt (:mod:`radixserve.model.lora`); after
        loading and quantization. Under tensor parallelism each rank serves its share of
        every adapter (:mod:`radixserve.model.lora.tp`)."""
        self.lora = LoraRegistry.load(self, specs, max_rank, max_loaded)
        return self.lora

    def output_slice(self, layer: str) -> tuple[str, int, int]:
        """Where checkpoint layer ``layer`` (e.g. ``model.layers.0.self_attn.q_proj``)
        lands: the module that computes it here and its output columns (q/k/v and gate/up
        are fused). ``AttributeError`` where the model has no such layer."""
        target, shard = _stacked_target(layer + ".weight")
        module_name = target.rsplit(".", 1)[0]
        out = cast("nn.Linear", self.get_submodule(module_name)).out_features
        if shard is None:
            return module_name, 0, out
        cfg = self.local_config
        qkv = module_name.endswith("qkv_proj")
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size] if qkv else [out // 2, out // 2]
        lo = sum(sizes[:shard])
        return module_name, lo, lo + sizes[shard]

    @property
    def native_stack_reason(self) -> str | None:
        """Why the one-call CPU decoder stack never runs this model (None: it can, where the
        forward is on the CPU and its linears are ones the stack runs)."""
        if not self.native_stack:
            return "turned off (native_stack = False)"
        if self.tp is not None:
            return "tensor parallelism (each layer all-reduces)"
        if not self.config.stack_shaped:
            return (
                f"{self.config.model_type}'s layers are not the one-call stack's (partial "
                "rotary, NoPE layers, experts, clipped q/k/v or Granite's multipliers): the "
                "per-layer path runs them"
            )
        return None

    def weights_replaced(self) -> None:
        """New weights were copied in (:mod:`~radixserve.model.weight_update`): the decoder
        stack is described again from the layers at its next forward (it lists oneDNN's
        packed weights, which are rebound, and Gemma's ``1 + weight`` norms, which it
        computed)."""
        self._stack = None

    def _native_stack(
        self, h: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> tuple[DecoderStack, NativeLayersPlan] | None:
        """The one-call decoder stack and the step's attention plan, where they serve this
        forward: CPU kernels, one process's whole model, few enough rows, the native attention."""
        if self.native_stack_reason is not None or not native.enabled(h):
            return None
        if self.config.scales_queries(max(batch.seq_lens_cpu)):
            return None  # a query past the temperature's period: the stack does not scale
        if self._stack is None:  # described once, after loading and quantization replaced modules
            self._stack = self._describe_stack(h.dtype)
        if h.shape[0] > self._stack.max_rows():
            return None
        plan = attn.native_layers_plan(batch, self._stack.windows)
        return None if plan is None else (self._stack, plan)

    def _describe_stack(self, act_dtype: torch.dtype) -> DecoderStack:
        """This model's layers as :class:`DecoderStack` parts (their modules as they are now)."""
        layers = cast("list[DecoderLayer]", list(self.model.layers))
        attn, cfg = layers[0].self_attn, self.config
        return DecoderStack(
            [_stack_parts(layer) for layer in layers],
            StackShape(
                attn.num_q_heads,
                attn.num_kv_heads,
                attn.sm_scale,
                attn.qk_norm,
                cfg.norm_layout,
                cfg.norm_plus_one,
                cfg.hidden_act,
                attn.softcap,
            ),
            self.local_config.rms_norm_eps,
            act_dtype,
        )

    # -- weights -------------------------------------------------------------------------

    def _shard_sizes(self, fused: str) -> list[int]:
        cfg = self.local_config
        if fused.endswith("qkv_proj"):
            return [cfg.q_size, cfg.kv_size, cfg.kv_size]
        # A dense MLP's or an expert's width: half the fused gate_up rows.
        width = cast("nn.Linear", self.get_submodule(fused)).weight.shape[0] // 2
        return [width, width]

    def _headless(self) -> bool:
        """Whether the checkpoint held no LM head where this model needs one (a base model's
        checkpoint; not a pipeline stage without the head, nor a tensor-parallel shard)."""
        head = self.lm_head.weight if self.lm_head is not None else None
        embed = self.model.embed_tokens
        return head is not None and head.is_meta and embed is not None and self.tp is None

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
        moe = self.config.moe
        if moe is not None and moe.checkpoint_layout == "gpt_oss":
            weights = gpt_oss_expert_tensors(weights, dtype)
        for name, tensor in expert_checkpoint_names(weights):
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some checkpoints store the tied head anyway; the embedding is the one used
            if name == "score.bias" and self.score is not None and "score.bias" not in params:
                params[name] = self._score_bias()  # the few classifiers whose head has one
            target, shard = _stacked_target(name)
            if target not in params:
                raise KeyError(f"unexpected weight {name!r} in checkpoint")
            if shard is None:
                self._set_param(target, tensor.to(device=device, dtype=dtype))
                if target.rsplit(".", 2)[-2] in ("qkv_proj", "gate_up_proj"):
                    # Stored fused (Phi-3): every shard at once, in radixserve's order.
                    filled.update(f"{target}#{i}" for i in range(3))
                    continue
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
        elif self._headless():
            # A base model's checkpoint (an embedding model): no head to generate with. The
            # embedding stands in, so that a step's forward runs; the engine serves only
            # embeddings (embeddings_only).
            self.lm_head.weight = self.model.embed_tokens.weight
            self.embeddings_only = True
        if self.score is not None:  # a classifier generates nothing (the head may be tied)
            self.embeddings_only = True
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

    def _score_bias(self) -> nn.Parameter:
        """A classifier's head given a (meta) bias for its checkpoint's ``score.bias``."""
        head = cast("nn.Linear", self.score)
        head.bias = nn.Parameter(torch.empty(head.out_features, device="meta"), False)
        return head.bias

    def _set_param(self, name: str, tensor: torch.Tensor) -> None:
        module_name, _, attr = name.rpartition(".")
        module = self.get_submodule(module_name)
        old = module._parameters[attr]
        if old is not None and tuple(old.shape) != tuple(tensor.shape):
            raise ValueError(
                f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model {tuple(old.shape)}"
            )
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
