"""OLMoE (``olmoe``): pre-norm layers (unlike OLMo 2), RMSNorms over the whole q and k
projections before RoPE (as OLMo 2), an optional ``clip_qkv`` clamp of q, k and v after
them, and an expert block per layer whose top-k weights are renormalised only with
``norm_topk_prob`` (false in OLMoE-1B-7B).

Runs the per-layer path (q/k norms, experts). Under tensor parallelism the q/k norms' sums
of squares are all-reduced (as OLMo 2's) and each expert is cut on its MLP width
(``model/layers/moe.py``).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family
from radixserve.model.families.moe import moe_config


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    clip = raw.get("clip_qkv")
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "qk_norm": "proj",
        "clip_qkv": None if clip is None else float(clip),
        "moe": moe_config(raw, experts_default=64, top_k_default=8),
    }


FAMILIES = (
    Family(
        "olmoe",
        ("olmoe",),
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096,
            "tie": False,
        },
        _fields,
    ),
)
