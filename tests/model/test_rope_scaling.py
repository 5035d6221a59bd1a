"""RoPE scaling ``yarn`` and ``longrope``: radixserve's inverse frequencies and attention factor
against transformers' own ``ROPE_INIT_FUNCTIONS`` on the same config, and longrope's table
switching to the long factors at the original context (per position, see
``model/layers/rotary.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.model.config import ModelConfig
from radixserve.model.layers.rotary import RotaryEmbedding, rope_attention_factor, rope_inv_freq

BASE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 1,
    "vocab_size": 100,
}


def _theirs(model_type: str, seq_len: int | None = None, **kw: Any) -> tuple[torch.Tensor, float]:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.for_model(model_type, **BASE, **kw)
    rope_type = cfg.rope_parameters["rope_type"]
    inv, factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), seq_len=seq_len)
    return inv, float(factor)


def _ours(model_type: str, **kw: Any) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": model_type, **BASE, **kw})


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 4.0, "original_max_position_embeddings": 4096},
        {"factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16, "beta_slow": 2},
        {"factor": 4.0, "original_max_position_embeddings": 4096, "truncate": False},
        {
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
        {"factor": 4.0, "original_max_position_embeddings": 4096, "attention_factor": 1.3},
    ],
    ids=["qwen", "betas", "untruncated", "mscale", "explicit-factor"],
)
def test_yarn_matches_transformers(params: dict[str, Any]) -> None:
    rope = {"rope_type": "yarn", "rope_theta": 1000000.0, **params}
    max_pos = int(params["factor"] * params["original_max_position_embeddings"])
    inv, factor = _theirs("qwen3", rope_parameters=rope, max_position_embeddings=max_pos)
    cfg = _ours("qwen3", rope_parameters=rope, max_position_embeddings=max_pos)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn"
    torch.testing.assert_close(rope_inv_freq(64, cfg.rope_theta, cfg.rope_scaling), inv)
    assert rope_attention_factor(cfg.rope_scaling) == pytest.approx(factor)


def _phi3_longrope(**extra: Any) -> dict[str, Any]:
    return {
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(32)],
            "long_factor": [1.5 + 0.5 * i for i in range(32)],
            **extra,
        },
    }


@pytest.mark.parametrize("extra", [{}, {"attention_factor": 1.1}], ids=["derived", "explicit"])
def test_longrope_matches_transformers(extra: dict[str, Any]) -> None:
    kw = _phi3_longrope(**extra)
    short, factor = _theirs("phi3", **kw)
    long, _ = _theirs("phi3", seq_len=5000, **kw)
    cfg = _ours("phi3", **kw)
    s = cfg.rope_scaling
    assert s is not None and s.original_max_position_embeddings == 4096 and s.factor == 32.0
    torch.testing.assert_close(rope_inv_freq(64, cfg.rope_theta, s), short)
    torch.testing.assert_close(rope_inv_freq(64, cfg.rope_theta, s, long=True), long)
    assert rope_attention_factor(s) == pytest.approx(factor)

    # Positions below the original context rotate with the short factors, from it on with the long.
    rotary = RotaryEmbedding(64, cfg.rope_theta, s)
    pos = torch.tensor([0, 1, 4095, 4096, 6000])
    cos, sin = rotary.cos_sin(pos, 6001, torch.float32)
    angles = torch.stack(
        [p * (short if p < 4096 else long) for p in pos.tolist()]  # type: ignore[misc]
    )
    angles = torch.cat((angles, angles), dim=-1)
    torch.testing.assert_close(cos[:, 0], angles.cos() * factor, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin[:, 0], angles.sin() * factor, atol=1e-5, rtol=1e-5)
