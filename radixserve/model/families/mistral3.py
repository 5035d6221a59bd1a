"""Mistral 3: Ministral 3 (``ministral3``) and the multimodal checkpoints (``mistral3``,
``Mistral3ForConditionalGeneration``: Mistral Small 3.1 / 3.2, Magistral Small, Devstral 2,
Ministral 3) served as their text model.

Ministral 3 is Mistral's layer with YaRN RoPE and a query temperature (Llama 4's attention
scaling): after RoPE each query is multiplied by ``1 + beta * ln(1 + floor(position / L))``
with ``beta`` the ``rope_parameters``' ``llama_4_scaling_beta`` and ``L`` its
``original_max_position_embeddings`` (``ModelConfig.query_scale_beta``), so nothing changes
within the pretraining length and attention sharpens past it.

A multimodal checkpoint's text model is its ``text_config`` (``mistral`` for Mistral Small 3.x,
``ministral3`` for the later ones) over that type's config defaults, the top level's eos,
dtype and tie where it writes them; its weights are under ``language_model.model.`` (the
released checkpoints) or ``model.language_model.`` (transformers 5's in-memory names); the
Pixtral vision tower and the projector are never read, as vLLM serves text-only requests.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family, text_model_config, text_model_weight_name
from radixserve.model.families.llama import llama_fields

# transformers' config defaults of the two text models, for the keys a checkpoint may omit.
_MINISTRAL3 = {
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262_144,
    "tie": False,
}
_TEXT_DEFAULTS: dict[str | None, dict[str, Any]] = {
    "ministral3": {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 262_144,
        "tie_word_embeddings": False,
    },
    "mistral": {  # (a RoPE base in rope_parameters, which the checkpoint's replace whole)
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 * 32,
        "tie_word_embeddings": False,
    },
}


def _ministral3(raw: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    beta = float(params.get("llama_4_scaling_beta") or 0.0)
    fields = llama_fields(raw)
    if beta:
        period = params.get("original_max_position_embeddings")
        if not period:
            raise ValueError("llama_4_scaling_beta needs original_max_position_embeddings")
        fields.update(query_scale_beta=beta, query_scale_period=int(period))
    return fields


def _mistral3_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    text_type = (raw.get("text_config") or {}).get("model_type", "mistral")
    if text_type not in _TEXT_DEFAULTS:
        raise ValueError(
            f"mistral3 with a {text_type!r} text model is not supported "
            f"(radixserve serves {', '.join(sorted(k for k in _TEXT_DEFAULTS if k))})"
        )
    return text_model_config(raw, _TEXT_DEFAULTS[text_type])


FAMILIES = (
    Family("ministral3", ("ministral3",), _MINISTRAL3, _ministral3),
    Family(
        "mistral3",
        ("mistral3",),
        _MINISTRAL3,
        _ministral3,
        text_config=_mistral3_text_config,
        weight_name=text_model_weight_name,
    ),
)
