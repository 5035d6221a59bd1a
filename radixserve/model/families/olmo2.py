"""OLMo 2 and OLMo 3: the norms after the blocks (``post_attention_layernorm`` on the
attention's output and ``post_feedforward_layernorm`` on the MLP's, each before the residual
add; no input norm) and RMSNorms over the whole q and k projections (not per head) before RoPE.

OLMo 3 adds sliding-window layers (``sliding_window``, 4096; ``layer_types``, by default
every fourth layer full) whose RoPE is unscaled, the full layers' with the checkpoint's
scaling (YaRN on the long-context ones): ``rope_parameters`` per layer type
(:func:`~radixserve.model.families.base.layer_type_rope`).

The one-call CPU decoder stack is pre-norm only: OLMo 2 takes the per-layer path. Its q/k
norms span every head: under tensor parallelism the ranks all-reduce their sums of squares
(``model/layers/attention.py``).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family, layer_type_rope


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias, "qk_norm": "proj", "norm_layout": "post"}


def _olmo3(raw: dict[str, Any]) -> dict[str, Any]:
    window = raw.get("sliding_window", 4096)
    n = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)
    ]
    theta = float(raw.get("rope_theta") or 500_000.0)  # the legacy layout's, both layer types'
    local_theta, rope_raw = layer_type_rope(raw, "OLMo 3", theta, 500_000.0)
    return {
        **_fields(raw),
        "sliding_window": window,
        "layer_types": types if window else None,
        "local_rope_theta": local_theta,
        "rope_raw": rope_raw,
    }


FAMILIES = (
    Family(
        "olmo2",
        ("olmo2",),
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 2048,
            "tie": False,
        },
        _fields,
    ),
    Family(
        "olmo3",
        ("olmo3",),
        {
            "rope_theta": 500_000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 2048,
            "tie": False,
        },
        _olmo3,
    ),
)
