"""ModelConfig parsing: both config.json layouts, defaults, eos ids, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from radixserve.model.config import ModelConfig, RopeScaling

LEGACY_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}


def test_legacy_layout_llama31() -> None:
    cfg = ModelConfig.from_dict(LEGACY_LLAMA31)
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 8 and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert cfg.eos_token_ids == (128001, 128008, 128009)
    assert cfg.torch_dtype == torch.bfloat16
    assert cfg.num_params == pytest.approx(8.03e9, rel=0.01)


def test_v5_layout_and_generation_config(tiny_llama_dir: Path) -> None:
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    assert "rope_parameters" in raw  # transformers 5 writes this layout
    cfg = ModelConfig.from_pretrained(tiny_llama_dir)
    assert (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_scaling) == (4, 2, 16, None)
    assert cfg.eos_token_ids == (2,)
    # A bare config.json works too (plan for models you don't have).
    assert ModelConfig.from_pretrained(tiny_llama_dir / "config.json") == cfg


def test_qwen2_bias_and_mistral_window() -> None:
    qwen = ModelConfig.from_dict(
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "vocab_size": 512,
            "sliding_window": 4096,
            "use_sliding_window": False,
        }
    )
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.sliding_window is None
    mistral = ModelConfig.from_dict(
        {
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_hidden_layers": 32,
            "vocab_size": 32000,
            "sliding_window": 4096,
        }
    )
    assert mistral.sliding_window == 4096 and mistral.architecture == "MistralForCausalLM"


def test_linear_scaling_and_legacy_type_key() -> None:
    cfg = ModelConfig.from_dict(
        {**LEGACY_LLAMA31, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert cfg.rope_scaling == RopeScaling("linear", 2.0)


@pytest.mark.parametrize("rope_type", ["dynamic", "ntk"])
def test_unsupported_rope_type_is_a_clear_error(rope_type: str) -> None:
    raw = {**LEGACY_LLAMA31, "rope_scaling": {"rope_type": rope_type, "factor": 4.0}}
    with pytest.raises(ValueError, match=f"unsupported rope scaling type '{rope_type}'"):
        ModelConfig.from_dict(raw)


def test_yarn_and_longrope_are_read() -> None:
    yarn = ModelConfig.from_dict(
        {
            **LEGACY_LLAMA31,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        }
    )
    assert yarn.rope_scaling == RopeScaling("yarn", 4.0, original_max_position_embeddings=32768)
    # Phi-3 keeps the pretraining length outside rope_scaling; the factor is then derived.
    phi = ModelConfig.from_dict(
        {
            **LEGACY_LLAMA31,
            "model_type": "phi3",
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0] * 64,
                "long_factor": [2.0] * 64,
            },
        }
    )
    assert phi.rope_scaling is not None and phi.rope_scaling.factor == 32.0
    assert phi.rope_scaling.original_max_position_embeddings == 4096
    assert phi.rope_scaling.long_factor == (2.0,) * 64 and phi.fused_checkpoint


def test_unsupported_architecture() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_dict({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_pretrained(tmp_path)


def test_layer_windows() -> None:
    """Which layers slide: all (Mistral), those layer_types marks, Qwen's from max_window_layers."""
    base = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "vocab_size": 100,
    }
    mistral = ModelConfig.from_dict({**base, "model_type": "mistral", "sliding_window": 8})
    assert [mistral.layer_window(i) for i in range(4)] == [8] * 4 and not mistral.llama_shaped
    types = ["sliding_attention", "full_attention"] * 2
    mixed = ModelConfig.from_dict(
        {**base, "model_type": "mistral", "sliding_window": 8, "layer_types": types}
    )
    assert [mixed.layer_window(i) for i in range(4)] == [8, None, 8, None]
    qwen = {**base, "model_type": "qwen3", "sliding_window": 8, "max_window_layers": 3}
    assert ModelConfig.from_dict(qwen).sliding_window is None  # without use_sliding_window
    on = ModelConfig.from_dict({**qwen, "use_sliding_window": True})
    assert [on.layer_window(i) for i in range(4)] == [None, None, None, 8]
    assert ModelConfig.from_dict({**base, "model_type": "llama"}).llama_shaped


def test_mistral_small_3_multimodal_config_reads_its_text_model() -> None:
    """Mistral Small 3.1's config (its shape): a ``mistral`` text model under ``text_config``,
    no tie at the top level (the text model's, untied, applies), no query temperature."""
    raw = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "head_dim": 128,
            "hidden_size": 5120,
            "intermediate_size": 32768,
            "model_type": "mistral",
            "num_attention_heads": 32,
            "num_hidden_layers": 40,
            "num_key_value_heads": 8,
            "rope_theta": 1_000_000_000.0,
            "sliding_window": None,
            "vocab_size": 131072,
        },
        "vision_config": {"model_type": "pixtral", "hidden_size": 1024},
    }
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.model_type, cfg.architecture) == ("mistral3", "Mistral3ForConditionalGeneration")
    assert (cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (40, 32, 8, 128)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rms_norm_eps) == (1e9, None, 1e-6)
    assert not cfg.tie_word_embeddings and cfg.torch_dtype == torch.bfloat16
    assert cfg.sliding_window is None and cfg.query_scale_beta == 0.0
    assert not cfg.scales_queries(1_000_000)
    ministral = {**raw, "text_config": {**raw["text_config"], "model_type": "ministral3"}}
    ministral["text_config"]["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 16384,
        "llama_4_scaling_beta": 0.1,
    }
    del ministral["text_config"]["rope_theta"]
    cfg = ModelConfig.from_dict(ministral)
    assert (cfg.rope_theta, cfg.rms_norm_eps) == (1e6, 1e-5)
    assert (cfg.query_scale_beta, cfg.query_scale_period) == (0.1, 16384)
    assert not cfg.scales_queries(16384) and cfg.scales_queries(16385)
    with pytest.raises(ValueError, match="'mistral4' text model is not supported"):
        ModelConfig.from_dict(
            {**raw, "text_config": {**raw["text_config"], "model_type": "mistral4"}}
        )


def test_olmo3_legacy_rope_scales_only_the_full_layers() -> None:
    """OLMo 3's legacy layout (``rope_theta`` + ``rope_scaling``, as its long-context
    checkpoints write it): YaRN on the full layers, the sliding layers on the same base
    unscaled; every fourth layer full by default; a scaled sliding RoPE is refused."""
    raw = {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_hidden_layers": 8,
        "vocab_size": 100278,
        "max_position_embeddings": 65536,
        "rope_theta": 500000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "attention_factor": 1.2,
        },
        "sliding_window": 4096,
    }
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (500000.0, 500000.0)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn"
    assert cfg.layer_types == ("sliding_attention",) * 3 + ("full_attention",) + (
        "sliding_attention",
    ) * 3 + ("full_attention",)
    assert [cfg.layer_window(i) for i in (0, 3)] == [4096, None]
    assert cfg.qk_norm == "proj" and cfg.norm_layout == "post"
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}
    v5 = {**raw, "rope_parameters": {"sliding_attention": scaled, "full_attention": {}}}
    with pytest.raises(ValueError, match="OLMo 3 with a scaled RoPE on its sliding layers"):
        ModelConfig.from_dict(v5)
