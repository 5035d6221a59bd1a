"""Qwen3-MoE (``qwen3_moe``): Qwen3's attention (per-head q/k norms, no bias) with expert MLPs
of ``moe_intermediate_size``; ``norm_topk_prob`` (true in the released checkpoints) renormalises
the top-k routing weights; ``decoder_sparse_step`` and ``mlp_only_layers`` leave some layers
with a dense MLP of ``intermediate_size``.

Runs the per-layer path (q/k norms, experts). Under tensor parallelism each expert is cut on
its MLP width (``model/layers/moe.py``).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family, qwen_window
from radixserve.model.families.moe import moe_config


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    moe = moe_config(
        raw, experts_default=128, top_k_default=8, expert_width_key="moe_intermediate_size"
    )
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "qk_norm": "head",
        **qwen_window(raw),
        "moe": moe,
    }


FAMILIES = (
    Family(
        "qwen3_moe",
        ("qwen3_moe",),
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            "tie": False,
        },
        _fields,
    ),
)
