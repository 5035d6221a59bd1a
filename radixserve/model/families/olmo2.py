"""OLMo 2: the norms after the blocks (``post_attention_layernorm`` on the attention's output
and ``post_feedforward_layernorm`` on the MLP's, each before the residual add; no input
norm) and RMSNorms over the whole q and k projections (not per head) before RoPE.

The one-call CPU decoder stack is pre-norm only: OLMo 2 takes the per-layer path. Its q/k
norms span every head: under tensor parallelism the ranks all-reduce their sums of squares
(``model/layers/attention.py``).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias, "qk_norm": "proj", "norm_layout": "post"}


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
)
