"""IBM Granite 3.x (``granite``): Llama's layers with four scalars of its training recipe
(muP-style): the embeddings times ``embedding_multiplier``, the attention scores scaled by
``attention_multiplier`` (instead of ``head_dim ** -0.5``), each block's output times
``residual_multiplier`` before its residual add, and the logits divided by
``logits_scaling``.

The one-call CPU decoder stack has none of them: Granite takes the per-layer path; and the
pipeline stage body neither, so pipeline parallelism is refused.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
        "attention_multiplier": float(raw.get("attention_multiplier", 1.0)),
        "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
        "logits_scaling": float(raw.get("logits_scaling", 1.0)),
    }


FAMILIES = (
    Family(
        "granite",
        ("granite",),
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 2048,
            "tie": False,
        },
        _fields,
    ),
)
