"""SmolLM3: Llama's layers, but some attend without RoPE (NoPE): ``no_rope_layers`` has a 1
for each layer that rotates q and k and a 0 for each that does not (by default every
``no_rope_layer_interval``-th layer, counting from 1: layers 3, 7, 11, ... of 36 in the 3B).
Without positions in q and k those layers attend by content alone, the causal mask being
the only order they see (``ModelConfig.layer_rope``).

``attention_bias`` puts a bias on all four projections, as Llama's. A window (with
``use_sliding_window``) slides on the NoPE layers unless ``layer_types`` says otherwise, as
transformers' config derives it. The one-call CPU decoder stack rotates every layer:
SmolLM3 takes the per-layer path.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.families.base import Family


def rope_flags(raw: dict[str, Any]) -> list[int]:
    """Per layer, 1 if it uses RoPE (``no_rope_layers``, or its default by the interval)."""
    n = int(raw["num_hidden_layers"])
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n:
        raise ValueError(f"no_rope_layers names {len(flags)} layers of {n}")
    return [int(f) for f in flags]


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    flags = rope_flags(raw)
    bias = bool(raw.get("attention_bias", False))
    out: dict[str, Any] = {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "nope_layers": tuple(i for i, f in enumerate(flags) if not f),
    }
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if window:
        types = ["full_attention" if f else "sliding_attention" for f in flags]
        out["sliding_window"] = window
        out["layer_types"] = raw.get("layer_types") or types
    return out


FAMILIES = (
    Family(
        "smollm3",
        ("smollm3",),
        {
            "rope_theta": 2000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            "tie": True,
        },
        _fields,
    ),
)
