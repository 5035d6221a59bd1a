"""IBM Granite 3.x (``granite``, and ``granitemoe``: its mixture-of-experts models, 1B-A400M
and 3B-A800M): Llama's layers with four scalars of its training recipe
(muP-style): the embeddings times ``embedding_multiplier``, the attention scores scaled by
``attention_multiplier`` (instead of ``head_dim ** -0.5``), each block's output times
``residual_multiplier`` before its residual add, and the logits divided by
``logits_scaling``. GraniteMoE's expert block (``block_sparse_moe``: ``input_linear`` the
experts' stacked gate and up rows, ``output_linear`` their down projections, ``router.layer``
the router: renamed as the stacked layout ``layers/moe.py`` reads) routes by the top-k of
the router's logits with a softmax over those k, which is the renormalised top-k of the
softmax.

The one-call CPU decoder stack has none of them: Granite takes the per-layer path; and the
pipeline stage body neither, so pipeline parallelism is refused.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family
from radixserve.model.families.moe import moe_config


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


def _moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    # Top-k of the router's logits, then a softmax over those k: the renormalised top-k.
    moe = moe_config(raw, experts_default=8, top_k_default=2, norm_topk_prob=True)
    return {**_fields(raw), "moe": moe}


_DEFAULTS = {
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie": False,
}

# GraniteMoE's expert block as the stacked layout (transformers 5's in-memory names) and
# the router as every other family names them: renamed before a tensor-parallel rank cuts
# its share, so each rank reads only its rows of every expert.
_MOE_NAMES = {
    ".block_sparse_moe.input_linear.weight": ".mlp.experts.gate_up_proj",
    ".block_sparse_moe.output_linear.weight": ".mlp.experts.down_proj",
    ".block_sparse_moe.router.layer.weight": ".mlp.gate.weight",
}


def _moe_weight_name(name: str) -> str:
    for theirs, ours in _MOE_NAMES.items():
        if name.endswith(theirs):
            return name.removesuffix(theirs) + ours
    return name


FAMILIES = (
    Family("granite", ("granite",), _DEFAULTS, _fields),
    Family("granitemoe", ("granitemoe",), _DEFAULTS, _moe_fields, weight_name=_moe_weight_name),
)
