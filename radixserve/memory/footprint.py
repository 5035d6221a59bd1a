"""What a model costs in bytes: its KV per token, its weights, one forward's activations.

The KV cache of one token is, for K and V, in every layer, for every KV head, ``head_dim``
values::

    bytes/token = 2 (K, V) × num_layers × kv_heads × (head_dim × storage bytes + scale bytes)

The per-head term comes from :class:`radixkernels.kv_format.KVFormat` (the same object the
pool allocates from and the kernels read), so the planner's numbers are the pool's numbers:
int8/int4 pay a float32 scale per (token, KV head), fp8 a static per-head scale per layer
(a constant, counted in the pool's fixed bytes). GQA enters through ``kv_heads``: Llama-2-70B
keeps 8 KV heads for 64 query heads, an 8× smaller cache than multi-head attention.

Every figure takes a ``shard`` (:mod:`radixserve.memory.sharding`): what one device of a
TP × PP worker holds. :mod:`radixserve.memory.planner` adds them up against a budget.
"""

from __future__ import annotations

import math

import torch

from radixkernels.kv_format import SCALE_DTYPE, KVCacheDtype, KVFormat
from radixserve.memory.interfaces import ModelDims
from radixserve.memory.sharding import (
    WHOLE_MODEL,
    DeviceShard,
    kv_heads_per_rank,
    q_heads_per_rank,
)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_format(
    cfg: ModelDims, kv_dtype: KVCacheDtype | str = "auto", act_dtype: torch.dtype = torch.float16
) -> KVFormat:
    """The pool's storage format for this model's head_dim."""
    return KVFormat.create(kv_dtype, act_dtype, cfg.head_dim)


def kv_bytes_per_token(
    cfg: ModelDims,
    kv_dtype: KVCacheDtype | str = "auto",
    act_dtype: torch.dtype = torch.float16,
    shard: DeviceShard = WHOLE_MODEL,
) -> int:
    """Bytes one token's K and V occupy in the pool, per-token scales included: all layers, or
    with ``shard`` those one device of a TP × PP worker keeps (its layers, its KV heads)."""
    return kv_format(cfg, kv_dtype, act_dtype).bytes_per_token(
        shard.layers(cfg.num_layers), kv_heads_per_rank(cfg.num_kv_heads, shard.tp_size)
    )


def kv_bytes_per_sequence(
    cfg: ModelDims,
    seq_len: int,
    kv_dtype: KVCacheDtype | str = "auto",
    act_dtype: torch.dtype = torch.float16,
) -> int:
    """KV bytes of one sequence of ``seq_len`` tokens."""
    return seq_len * kv_bytes_per_token(cfg, kv_dtype, act_dtype)


def kv_fixed_bytes(
    cfg: ModelDims, kv_dtype: KVCacheDtype | str = "auto", shard: DeviceShard = WHOLE_MODEL
) -> int:
    """Bytes of the pool that do not grow with tokens: fp8's static per-(layer, head) scales."""
    if KVCacheDtype(kv_dtype).has_head_scales:
        heads = kv_heads_per_rank(cfg.num_kv_heads, shard.tp_size)
        return 2 * shard.layers(cfg.num_layers) * heads * SCALE_DTYPE.itemsize
    return 0


def weight_bytes(
    cfg: ModelDims,
    dtype: torch.dtype,
    quantization: str | None = None,
    group_size: int | None = None,
    quantize_embeddings: bool = False,
    quant_dense_cache: bool = False,
    shard: DeviceShard = WHOLE_MODEL,
) -> int:
    """Bytes of the model's weights when run in ``dtype`` (tied embeddings counted once).

    With ``quantization`` (int8 | int4 | fp8, radixserve.model.quant's formats) the decoder
    linears cost, per ``[N, K]`` weight: int8 ``N K + 2 N`` (bf16 scale per channel), int4
    ``N K / 2 + 4 N K / group`` (bf16 scale and zero per group), fp8 ``N K + 4 N``. With
    ``quantize_embeddings`` the embedding is int8 rows (``V H + 4 V``) and the LM head a
    quantized linear of its own (also when tied); otherwise both stay in ``dtype``.
    ``quant_dense_cache`` adds a bf16 copy (``2 N K``) of every int8/int4 decoder linear.

    With ``shard`` (one device of a TP × PP worker, :mod:`radixserve.memory.sharding`): its
    stage's layers, each linear a ``1/tp`` slice (query heads, KV heads or their replica,
    intermediate rows), the vocabulary-parallel embedding on the first stage and LM head on
    the last (a tied head is a copy there when the stages differ), norms whole.
    """
    act = _dtype_bytes(dtype)
    if quantization is None and shard.is_whole_model:
        return cfg.num_params * act
    tp = shard.tp_size
    h, v = cfg.hidden_size, math.ceil(cfg.vocab_size / tp)
    q = q_heads_per_rank(cfg.num_q_heads, cfg.num_kv_heads, tp) * cfg.head_dim
    kv = kv_heads_per_rank(cfg.num_kv_heads, tp) * cfg.head_dim
    i = math.ceil(cfg.intermediate_size / tp)
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    # Mixture of experts (ModelConfig.moe; not part of ModelDims, which dense models satisfy).
    moe = getattr(cfg, "moe", None)
    mi = math.ceil(moe.intermediate_size / tp) if moe is not None else i
    held = moe.num_held_experts if moe is not None else 0
    if moe is not None and shard.expert_parallel:  # whole experts, E / tp of them
        mi, held = moe.intermediate_size, held // tp
    # A shared expert (Qwen2-MoE): cut on its width on every rank, expert parallel or not.
    si = math.ceil(moe.shared_expert_size / tp) if moe is not None else 0
    if quantization == "int4" and group_size is None:
        ks = [k for _, k in shapes] + [mi] + ([si] if si else [])
        group_size = next((g for g in (128, 64, 32) if all(k % g == 0 for k in ks)), 32)

    def linear(n: int, k: int) -> int:
        if quantization is None:
            return n * k * act
        if quantization == "int8":
            return n * k + 2 * n
        if quantization == "int4":
            assert group_size is not None
            return n * k // 2 + 4 * n * (k // group_size)
        if quantization == "fp8":
            return n * k + 4 * n
        raise ValueError(f"unknown quantization {quantization!r}")

    def linear_with_copy(n: int, k: int) -> int:
        dense_copy = quant_dense_cache and quantization not in (None, "fp8")
        return linear(n, k) + (2 * n * k if dense_copy else 0)

    quantize_embeddings = quantize_embeddings and quantization is not None
    # + the layer's norms: two, or four in Gemma's sandwich layout; q/k norms per head, or
    # over the (rank's slice of the) projection (ModelConfig fields; ModelDims lacks them).
    norms = 4 if getattr(cfg, "norm_layout", "pre") == "sandwich" else 2
    qk_norm = getattr(cfg, "qk_norm", None)
    qk = {"head": 2 * cfg.head_dim, "proj": q + kv}.get(qk_norm or "", 0)
    attn = sum(linear_with_copy(n, k) for n, k in shapes[:2]) + (norms * h + qk) * act
    attn += act * _attention_extras(cfg, q, kv)

    def mlp(width: int, biased: bool = cfg.mlp_bias) -> int:
        bias = act * (2 * width + h if biased else 0)
        return linear_with_copy(2 * width, h) + linear_with_copy(h, width) + bias

    if moe is None:
        per_layer = attn + mlp(i)
    else:  # every expert held (all, or a rank's own; gpt-oss's biased), the whole router (never
        # quantized; sigmoid routing's correction bias, gpt-oss's bias), a shared expert and gate.
        shared = mlp(si) + (h * act if moe.shared_expert_gate else 0) if si else 0
        router = moe.num_experts * (h + (moe.scoring == "sigmoid") + moe.router_bias) * act
        expert = mlp(mi, cfg.mlp_bias or moe.expert_bias)
        mlps = sum(
            held * expert + router + shared if moe.is_sparse(layer) else mlp(i)
            for layer in range(cfg.num_layers)
        )
        per_layer = attn + mlps // cfg.num_layers  # the layers' mean (exact when all alike)
    vocab = 0
    if shard.has_embedding:
        vocab += v * h + 4 * v if quantize_embeddings else v * h * act
    if shard.has_lm_head:
        if quantize_embeddings:
            vocab += linear_with_copy(v, h)
        elif not (cfg.tie_word_embeddings and shard.has_embedding):
            vocab += v * h * act  # its own head, or with PP the last stage's copy of a tied one
        vocab += h * act  # the final norm
    return shard.layers(cfg.num_layers) * per_layer + vocab


def _attention_extras(cfg: ModelDims, q: int, kv: int) -> int:
    """A layer's attention parameters beside its linears and norms, on a rank holding ``q``
    query and ``kv`` KV lanes: the q/k/v and output biases and gpt-oss's sinks (per head)."""
    sinks = q // cfg.head_dim if getattr(cfg, "attn_sinks", False) else 0
    o_bias = cfg.hidden_size if cfg.o_proj_bias else 0
    return (q + 2 * kv if cfg.attention_bias else 0) + o_bias + sinks


def activation_reserve_bytes(
    cfg: ModelDims, max_num_tokens: int, act_dtype: torch.dtype, shard: DeviceShard = WHOLE_MODEL
) -> int:
    """A bound on the transient memory of one forward of ``max_num_tokens`` rows.

    Per row, the live tensors of one layer at its widest point: residual, normed input,
    q/k/v, attention output, gate/up and the gated product (3 × intermediate), plus float32
    logits for every row (prompt logprobs may ask for all of them). With ``shard``, the head
    and intermediate widths are the TP rank's share; logits only on the last stage (gathered
    to the whole vocabulary).
    """
    tp = shard.tp_size
    q = q_heads_per_rank(cfg.num_q_heads, cfg.num_kv_heads, tp) * cfg.head_dim
    kv = kv_heads_per_rank(cfg.num_kv_heads, tp) * cfg.head_dim
    per_row = 4 * cfg.hidden_size + 2 * q + 2 * kv + 3 * math.ceil(cfg.intermediate_size / tp)
    logits = cfg.vocab_size * 4 if shard.has_lm_head else 0
    return max_num_tokens * (per_row * _dtype_bytes(act_dtype) + logits)
