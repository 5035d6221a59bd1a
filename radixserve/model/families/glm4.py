"""GLM-4 (``glm4``: GLM-4-9B-0414, GLM-4-32B-0414): norms before and after each block, as
Gemma's sandwich but plain (``input_layernorm`` and ``post_self_attn_layernorm`` around the
attention, ``post_attention_layernorm`` and ``post_mlp_layernorm`` around the MLP: renamed
to the sandwich layer's names), biases on q/k/v (not on the output), the MLP's gate and up
stored fused (``gate_up_proj``), and RoPE on half of each head (``partial_rotary_factor``
0.5 where the config is silent) with neighbouring lanes paired (``rope_interleaved``).

The one-call CPU decoder stack rotates halves of whole heads: GLM-4 takes the per-layer
path; pipeline parallelism is refused, as for every sandwich layout.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family
from radixserve.model.families.moe import MoEConfig

# GLM-4's norm names -> the sandwich layer's (model/layers/decoder.py).
_NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}


def _weight_name(name: str) -> str:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _NORMS:
        parts[-2] = _NORMS[parts[-2]]
    return ".".join(parts)


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        "attention_bias": bool(raw.get("attention_bias", True)),
        "o_proj_bias": False,
        "norm_layout": "sandwich",
        "rope_interleaved": True,
    }


def _moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's: pre-norm layers (Llama's), q/k/v biases, optional per-head q/k norms,
    half RoPE in halves (not paired), and an expert block from ``first_k_dense_replace`` on."""
    n = int(raw["num_hidden_layers"])
    dense_below = int(raw.get("first_k_dense_replace", 1))
    shared = int(raw.get("n_shared_experts", 1)) * int(raw["moe_intermediate_size"])
    moe = MoEConfig(
        int(raw.get("n_routed_experts", 128)),
        int(raw.get("num_experts_per_tok", 8)),
        int(raw["moe_intermediate_size"]),
        bool(raw.get("norm_topk_prob", True)),
        tuple(range(min(dense_below, n))),
        shared_expert_size=shared,
        scoring="sigmoid",
        n_group=int(raw.get("n_group", 1)),
        topk_group=int(raw.get("topk_group", 1)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
    )
    return {
        "attention_bias": bool(raw.get("attention_bias", False)),
        "o_proj_bias": False,
        "qk_norm": "head" if raw.get("use_qk_norm") else None,
        "moe": moe,
    }


def _moe_weight_name(name: str) -> str:
    """GLM-4.5's shared experts (``shared_experts``) under the expert block's name."""
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


_MOE_DEFAULTS = {
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie": False,
    "partial_rotary_factor": 0.5,
}

FAMILIES = (
    Family(
        "glm4",
        ("glm4",),
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1.5625e-07,
            "max_position_embeddings": 32768,
            "tie": False,
            "partial_rotary_factor": 0.5,
        },
        _fields,
        weight_name=_weight_name,
    ),
    Family("glm4_moe", ("glm4_moe",), _MOE_DEFAULTS, _moe_fields, weight_name=_moe_weight_name),
)
