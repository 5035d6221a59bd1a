"""Mixtral (``mixtral``): Mistral's attention and an expert block per layer
(``block_sparse_moe`` in the checkpoint, experts ``w1``/``w3``/``w2`` for gate/up/down),
softmax over the router's logits, top-k, always renormalised to sum to one. The sliding
window, where a config sets one, is applied as Mistral's.

Runs the per-layer path (experts). Under tensor parallelism each expert is cut on its MLP
width (``model/layers/moe.py``).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family
from radixserve.model.families.moe import moe_config


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "o_proj_bias": False,
        "sliding_window": raw.get("sliding_window"),
        "moe": moe_config(raw, experts_default=8, top_k_default=2, norm_topk_prob=True),
    }


FAMILIES = (
    Family(
        "mixtral",
        ("mixtral",),
        {
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096 * 32,
            "tie": False,
        },
        _fields,
    ),
)
