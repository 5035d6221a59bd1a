"""Llama and its close kin, Mistral and Qwen2: pre-norm layers, SiLU-gated MLP, RoPE.

Qwen2 puts a bias on q/k/v (never on the output); Llama's ``attention_bias`` puts one on all
four projections. Mistral's and Qwen2's sliding window (Qwen2 only with
``use_sliding_window``) is applied per layer (``ModelConfig.layer_window``).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family, qwen_window

_TIED = {"tie": False}


def llama_fields(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "sliding_window": raw.get("sliding_window"),
    }


def _qwen2(raw: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True, "o_proj_bias": False, **qwen_window(raw)}


FAMILIES = (
    Family(
        "llama",
        ("llama",),
        {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, **_TIED},
        llama_fields,
    ),
    Family(
        "mistral",
        ("mistral",),
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096 * 32,
            **_TIED,
        },
        llama_fields,
    ),
    Family(
        "qwen2",
        ("qwen2",),
        {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, **_TIED},
        _qwen2,
    ),
)
