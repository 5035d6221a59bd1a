"""The family checkpoints the family tests build: each with its quirks active.

``name -> (model_type, transformers config overrides, runs the native decoder stack)``:
``FAMILIES`` for test_families_vs_hf.py, ``GEMMAS`` for test_gemma_vs_hf.py (and both for
test_decoder_layers.py's stack-against-per-layer checks).
"""

from __future__ import annotations

from typing import Any

from tiny_models import GEMMA_QUIRKS, GPT_OSS, GRANITE_SCALARS, MINISTRAL3, QWEN2_MOE

# Phi-3 longrope: sequences in the tests stay below the original context (64), where
# transformers rotates with the short factors too (see model/layers/rotary.py).
_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
}

FAMILIES: dict[str, tuple[str, dict[str, Any], bool]] = {
    # Per-head q/k RMSNorms (in the one-call stack too).
    "qwen3": ("qwen3", {}, True),
    # yarn with a short original context: the ramp and the attention factor (1.14) both bite.
    "qwen3_yarn": (
        "qwen3",
        {
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 10000.0,
            },
        },
        True,
    ),
    # Post-norms and whole-projection q/k norms (in the one-call stack too).
    "olmo2": ("olmo2", {}, True),
    # OLMo 3: OLMo 2's norms, a window of 8 on three layers of four, YaRN (its ramp and
    # attention factor biting) on the full layer only, the sliding layers' RoPE unscaled.
    "olmo3": (
        "olmo3",
        {
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "max_position_embeddings": 64,
            "rope_parameters": {
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                    "rope_theta": 10000.0,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 50000.0},
            },
        },
        True,
    ),
    # Fused qkv / gate_up in the checkpoint, longrope (attention factor 1.15, short factors != 1).
    "phi3_longrope": (
        "phi3",
        {
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 64,
            "rope_parameters": _LONGROPE,
        },
        True,
    ),
    # Mistral with its sliding window far shorter than the prompts (up to 46 tokens); in the
    # one-call stack too (each layer through its window's plan).
    "mistral_window": ("mistral", {"sliding_window": 8}, True),
    # Phi-4-mini's partial rotary (half of each head here).
    "phi3_partial": ("phi3", {"partial_rotary_factor": 0.5}, False),
    # SmolLM3: every second layer without RoPE (NoPE, no_rope_layer_interval 2 of 4 layers),
    # biases on all four attention projections, tied embeddings.
    "smollm3": (
        "smollm3",
        {"num_hidden_layers": 4, "no_rope_layer_interval": 2, "attention_bias": True},
        False,
    ),
    # Granite 3.x: its four scalars far from 1 (the scores' scale, the embeddings', the
    # blocks' outputs' and the logits' divisor), biases on the attention projections.
    "granite": ("granite", {**GRANITE_SCALARS, "attention_bias": True}, False),
    # GraniteMoE: Granite's scalars and a stacked expert block (input_linear, output_linear,
    # router.layer), top-2 of 8 renormalised.
    "granitemoe": (
        "granitemoe",
        {"num_local_experts": 8, "num_experts_per_tok": 2, **GRANITE_SCALARS},
        False,
    ),
    # GLM-4: plain sandwich norms under its own names, q/k/v biases, the MLP's gate and up
    # stored fused, RoPE on half of each head with neighbouring lanes paired.
    "glm4": ("glm4", {}, False),
    # GLM-4.5: sigmoid routing with a correction bias, among the best of 2 groups, scaled by
    # 2.5; a shared expert; the first layer dense; per-head q/k norms; half RoPE in halves.
    "glm4_moe": (
        "glm4_moe",
        {
            "num_hidden_layers": 3,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "use_qk_norm": True,
            "attention_bias": True,
        },
        False,
    ),
    # Ministral 3, in the one-call stack where no row is past the temperature's period and
    # per layer where one is.
    "ministral3": ("ministral3", MINISTRAL3, True),
    # Mistral 3's multimodal checkpoint (a Pixtral tower) served as its Ministral 3 text model.
    "mistral3": (
        "mistral3",
        {**MINISTRAL3, "text_model_type": "ministral3", "tie_word_embeddings": False},
        True,
    ),
    # Mixture of experts (8 experts, uneven routing on random weights; test_moe.py covers an
    # expert with no row, both checkpoint layouts and quantized experts):
    # Qwen3-MoE with renormalised top-2 and a dense layer between two sparse ones.
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
        False,
    ),
    # Qwen2-MoE: q/k/v bias, top-2 not renormalised (the released default), a shared expert
    # (width 96) under its sigmoid gate (random weights: gates not saturated), a dense
    # layer via mlp_only_layers.
    "qwen2_moe": ("qwen2_moe", QWEN2_MOE, False),
    # Mixtral: block_sparse_moe / w1 w3 w2 names, top-2 always renormalised.
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}, False),
    # OLMoE: pre-norm, whole-projection q/k norms, clip_qkv that bites, top-3 not renormalised.
    "olmoe": ("olmoe", {"num_experts": 8, "num_experts_per_tok": 3, "clip_qkv": 1.5}, False),
    # gpt-oss: attention sinks, a window of 4 on alternating layers, q/k/v/o, router and
    # expert biases, the clamped SwiGLU biting, interleaved gate/up, YaRN x32 (tiny_models).
    "gpt_oss": ("gpt_oss", GPT_OSS, False),
}

# Gemma 2 and 3 with every quirk biting (tiny_models.GEMMA_QUIRKS); both run in the one-call
# stack (sandwich norms, windows, soft-caps).
GEMMAS: dict[str, tuple[str, dict[str, Any], bool]] = {
    name: (model_type, overrides, True) for name, (model_type, overrides) in GEMMA_QUIRKS.items()
}
