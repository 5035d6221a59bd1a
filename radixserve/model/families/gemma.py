"""Gemma 2 and Gemma 3 (text: ``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``).

What sets them apart from Llama, as transformers implements them:

- sliding-window and global layers interleaved (``layer_types``; without it Gemma 2
  alternates, local first, and Gemma 3 has ``sliding_window_pattern - 1`` local layers per
  global one), the window per layer (``ModelConfig.layer_window``);
- "sandwich" norms: ``h += norm(attn(norm(h)))``, ``h += norm(mlp(norm(h)))``; every RMSNorm
  scales by ``1 + weight``;
- the embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the run dtype first);
- scores scaled by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- a GELU (tanh approximation) gate in the MLP;
- Gemma 2: attention scores and final logits soft-capped (``cap * tanh(x / cap)``);
- Gemma 3: per-head q/k RMSNorms before RoPE, no attention soft-cap (transformers ignores
  ``attn_logit_softcapping`` for Gemma 3), and two RoPE bases: the global layers use
  ``rope_theta`` with the checkpoint's ``rope_scaling`` (``linear`` x8 on 4B and larger), the
  sliding layers the local base (``rope_local_base_freq``, 10 000) unscaled. Both the
  legacy keys and transformers v5's per-layer-type ``rope_parameters`` are read.

Tensor parallelism runs as Llama's (every quirk is per head, per row or after the logits'
gather); pipeline parallelism is refused (the stage body has no embedding scale, soft-cap or
local RoPE), so is bidirectional
attention (``use_bidirectional_attention``, an embedding-model variant).

The multimodal checkpoints (``model_type`` ``gemma3``, ``Gemma3ForConditionalGeneration``:
Gemma 3 4B, 12B, 27B) are served as their text model, as vLLM serves text-only requests to
them: the config's ``text_config`` (which released checkpoints write sparsely, relying on
``Gemma3TextConfig``'s defaults, filled in here) with the top level's eos, dtype and tie; the
weights under ``language_model.model.`` (how the checkpoints and transformers 5's
``save_pretrained`` name them) or ``model.language_model.`` (transformers 5's in-memory
names), the head ``language_model.lm_head`` / ``lm_head`` where stored (tied otherwise); the
vision tower's and the projector's tensors are never read. Images are not supported (the
HTTP layer refuses image content parts). One difference from ``gemma3_text``: transformers'
``Gemma3ForConditionalGeneration`` applies no final logit soft-cap whatever its text config
says (only ``Gemma3ForCausalLM`` does; the released checkpoints set none), and radixserve
follows it.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import (
    Family,
    layer_type_rope,
    text_model_config,
    text_model_weight_name,
)


def _get(raw: dict[str, Any], key: str, default: Any) -> Any:
    """``raw[key]``, where a key present with ``null`` means None (not the default)."""
    return raw[key] if key in raw else default


def _layer_types(raw: dict[str, Any], pattern: int) -> list[str]:
    """The checkpoint's ``layer_types``, or transformers' default: every ``pattern``-th layer
    global, the others sliding."""
    given = raw.get("layer_types")
    if given:
        return list(given)
    n = int(raw["num_hidden_layers"])
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


def _common(raw: dict[str, Any], pattern: int) -> dict[str, Any]:
    if raw.get("use_bidirectional_attention"):
        raise ValueError(
            "Gemma with use_bidirectional_attention (an encoder variant) is not supported"
        )
    bias = bool(raw.get("attention_bias", False))
    window = _get(raw, "sliding_window", 4096)
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        # transformers reads ``hidden_activation`` only (Gemma 1's ``hidden_act`` "gelu" meant tanh too).
        "hidden_act": raw.get("hidden_activation") or "gelu_pytorch_tanh",
        "norm_layout": "sandwich",
        "norm_plus_one": True,
        "embed_scale": True,
        "query_pre_attn_scalar": float(_get(raw, "query_pre_attn_scalar", 256)),
        "sliding_window": window,
        "layer_types": _layer_types(raw, pattern) if window else None,
    }


def _gemma2(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        **_common(raw, 2),
        "attn_softcap": _get(raw, "attn_logit_softcapping", 50.0),
        "final_softcap": _get(raw, "final_logit_softcapping", 30.0),
    }


def _gemma3(raw: dict[str, Any]) -> dict[str, Any]:
    # Legacy layout: the local base apart (rope_local_base_freq).
    legacy_local = float(raw.get("rope_local_base_freq") or 10000.0)
    local_theta, rope_raw = layer_type_rope(raw, "Gemma 3", legacy_local, 1_000_000.0)
    return {
        **_common(raw, int(raw.get("sliding_window_pattern") or 6)),
        "qk_norm": "head",
        "final_softcap": _get(raw, "final_logit_softcapping", None),
        "local_rope_theta": local_theta,
        "rope_raw": rope_raw,
    }


# Gemma3TextConfig's defaults (transformers) for the keys the parser needs: the released
# multimodal checkpoints' text_config omits those equal to them.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
}


def _gemma3_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    return text_model_config(raw, _GEMMA3_TEXT_DEFAULTS)


def _gemma3_conditional(raw: dict[str, Any]) -> dict[str, Any]:
    return {**_gemma3(raw), "final_softcap": None}


FAMILIES = (
    Family(
        "gemma2",
        ("gemma2",),
        {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "tie": True},
        _gemma2,
    ),
    Family(
        "gemma3",
        ("gemma3_text",),
        {
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131_072,
            "tie": True,
        },
        _gemma3,
    ),
    Family(
        "gemma3_multimodal",
        ("gemma3",),
        {
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131_072,
            "tie": True,
        },
        _gemma3_conditional,
        text_config=_gemma3_text_config,
        weight_name=text_model_weight_name,
    ),
)
