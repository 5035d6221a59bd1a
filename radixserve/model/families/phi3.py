"""Phi-3 and Phi-4 (``model_type`` ``phi3``): Llama's layout with q/k/v and gate/up already
fused in the checkpoint (``qkv_proj``, ``gate_up_proj``, in the order radixserve fuses them,
so they load as they are), RoPE ``longrope`` on the long-context checkpoints
(``original_max_position_embeddings`` outside ``rope_scaling``), and on Phi-4-mini a
``partial_rotary_factor`` (only the leading lanes of each head rotate).

Full-rotary Phi-3 runs the one-call CPU decoder stack like Llama; partial rotary takes the
per-layer path. Under tensor parallelism each rank reads its rows of every part of the
fused tensors (``model/parallel.py``).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "o_proj_bias": False,
        "sliding_window": raw.get("sliding_window"),
        "fused_checkpoint": True,
    }


FAMILIES = (
    Family(
        "phi3",
        ("phi3",),
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096,
            "tie": False,
        },
        _fields,
    ),
)
