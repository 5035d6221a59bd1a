"""Qwen2-MoE (``qwen2_moe``: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias,
``qkv_bias`` in transformers 5's config, on when absent) with an expert block per sparse layer
of ``moe_intermediate_size`` experts, ``norm_topk_prob`` (off in the released checkpoints),
plus a shared expert of ``shared_expert_intermediate_size`` that every row runs, its output
scaled by ``sigmoid(x @ shared_expert_gate)`` per row before it joins the routed experts'
sum (``MoEConfig.shared_expert_size`` / ``shared_expert_gate``; ``model/layers/moe.py``).
``decoder_sparse_step`` and ``mlp_only_layers`` leave some layers with a dense MLP of
``intermediate_size``; ``num_experts`` 0 makes every layer dense, as transformers builds it.

The window (``use_sliding_window``; off in the released checkpoints) follows the config's
``layer_types``, or without it transformers 5's Qwen2-MoE rule: the odd-numbered layers
(``(i + 1) % 2``) below ``max_window_layers`` slide.

Runs the per-layer path (experts). Under tensor parallelism each routed expert and the
shared expert are cut on their MLP widths (the router and the shared expert's gate whole on
every rank); with ``--expert-parallel`` the routed experts are spread whole and the shared
expert is still cut on its width.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family
from radixserve.model.families.moe import moe_config


def _window(raw: dict[str, Any]) -> dict[str, Any]:
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if not window:
        return {"sliding_window": None}
    n = int(raw["num_hidden_layers"])
    first_full = int(raw.get("max_window_layers", 28))
    types = [
        "sliding_attention" if (i + 1) % 2 and i < first_full else "full_attention"
        for i in range(n)
    ]
    return {"sliding_window": window, "layer_types": raw.get("layer_types") or types}


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("qkv_bias", True))
    moe = None
    if raw.get("num_experts", 60) != 0:
        moe = moe_config(
            raw,
            experts_default=60,
            top_k_default=4,
            expert_width_key="moe_intermediate_size",
            shared_expert_key="shared_expert_intermediate_size",
            shared_expert_gate=True,
        )
    return {"attention_bias": bias, "o_proj_bias": False, **_window(raw), "moe": moe}


FAMILIES = (
    Family(
        "qwen2_moe",
        ("qwen2_moe",),
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            "tie": False,
        },
        _fields,
    ),
)
