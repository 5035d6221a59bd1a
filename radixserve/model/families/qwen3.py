"""Qwen3 (dense): Qwen2's layout without the q/k/v bias, with an RMSNorm on each head of q
and k before RoPE (``q_norm``/``k_norm`` over ``head_dim``), and an explicit ``head_dim``
(128 in the released checkpoints, whatever the hidden size). Long-context checkpoints use
RoPE ``yarn``.

The one-call CPU decoder stack does not run q/k norms: Qwen3 takes the per-layer path.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family, qwen_window


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "qk_norm": "head",
        **qwen_window(raw),
        "head_dim_default": 128,
    }


FAMILIES = (
    Family(
        "qwen3",
        ("qwen3",),
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            "tie": False,
        },
        _fields,
    ),
)
