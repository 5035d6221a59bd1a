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
)
