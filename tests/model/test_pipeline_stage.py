"""Pipeline stages: layers [a, b) only, chained stage to stage, give the whole model's logits
(Llama, Qwen2, MQA; and OLMo 2, Phi-3, Qwen3-MoE, OLMoE)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models
import torch

from radixserve.memory.pool import KVPool
from radixserve.memory.sharding import stage_shards
from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.loader import load_model
from radixserve.model.pipeline_stage import LlamaPipelineStage


def _pool(cfg: ModelConfig, layers: int) -> KVPool:
    return KVPool(layers, 16, 4, cfg.num_kv_heads, cfg.head_dim)


def _steps(vocab: int) -> list[ForwardBatch]:
    """A two-sequence prefill (5 and 3 tokens) and one decode step over it, on pages 1-4."""
    g = torch.Generator().manual_seed(0)
    pages = [[1, 2], [3, 4]]
    prefill = ForwardBatch.from_pages(pages, [0, 0], [5, 3], 4)
    prefill.input_ids = torch.randint(3, vocab, (8,), generator=g)
    prefill.logits_indices = torch.tensor([4, 7])
    decode = ForwardBatch.from_pages(pages, [5, 3], [1, 1], 4)
    decode.input_ids = torch.randint(3, vocab, (2,), generator=g)
    decode.logits_indices = torch.tensor([0, 1])
    return [prefill, decode]


def run_whole(path: Path) -> list[torch.Tensor]:
    model = load_model(path, torch.float32, pack_linears=False)
    attn = TorchPagedAttentionBackend(_pool(model.config, model.config.num_layers))
    out = []
    for batch in _steps(model.config.vocab_size):
        attn.init_forward_metadata(batch)
        out.append(model(batch, attn))
    return out


def run_stages(path: Path, pp: int) -> list[torch.Tensor]:
    cfg = ModelConfig.from_pretrained(path)
    stages, backends = [], []
    for shard in stage_shards(cfg.num_layers, 1, pp):
        stage = load_model(path, torch.float32, pack_linears=False, stage=shard)
        assert isinstance(stage, LlamaPipelineStage)
        stages.append(stage)
        # Each stage's pool holds its own layers only, in the same page layout.
        backends.append(TorchPagedAttentionBackend(_pool(cfg, stage.num_local_layers)))
    out = []
    for batch in _steps(cfg.vocab_size):
        hidden = None
        for stage, attn in zip(stages, backends, strict=True):
            attn.init_forward_metadata(batch)
            hidden = stage(batch, attn, hidden)
        assert hidden is not None
        out.append(hidden)
    return out


@pytest.mark.parametrize(
    ("fixture", "pp"),
    [("tiny_llama_dir", 2), ("tiny_qwen2_dir", 2), ("tiny_mqa_dir", 2), ("tiny_mqa_dir", 3)],
)
def test_stages_chain_to_whole_model(fixture: str, pp: int, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    for whole, staged in zip(run_whole(path), run_stages(path, pp), strict=True):
        assert whole.shape == staged.shape
        torch.testing.assert_close(staged, whole, rtol=1e-5, atol=1e-5)


# The new families whose layers a stage body builds as the whole model does (Gemma's
# embedding scale, soft-cap and local RoPE are not in the stage body: refused there).
_FAMILIES = {
    "olmo2": ("olmo2", {}),  # post-norms, whole-projection q/k norms
    "phi3": ("phi3", {"partial_rotary_factor": 0.5}),  # fused qkv/gate_up, partial rotary
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_hidden_layers": 3,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
        },
    ),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 1.5}),
    # a shared expert beside the routed ones, a dense layer
    "qwen2_moe": ("qwen2_moe", {**tiny_models.QWEN2_MOE, "num_experts": 4}),
    # a multimodal checkpoint's text model; the query temperature from position 4 on
    "mistral3": (
        "mistral3",
        {
            "max_position_embeddings": 64,
            "rope_parameters": {
                **tiny_models.MINISTRAL3["rope_parameters"],  # type: ignore[dict-item]
                "original_max_position_embeddings": 4,
            },
            "text_model_type": "ministral3",
            "tie_word_embeddings": False,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(_FAMILIES))
def test_new_family_stages_chain_to_whole_model(name: str, tmp_path: Path) -> None:
    model_type, extra = _FAMILIES[name]
    path = tiny_models.build_tiny_family(tmp_path, model_type, **extra)
    for whole, staged in zip(run_whole(path), run_stages(path, 2), strict=True):
        torch.testing.assert_close(staged, whole, rtol=1e-5, atol=1e-5)


def test_stage_holds_only_its_layers(tiny_qwen2_dir: Path, tiny_mqa_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_mqa_dir)  # 3 layers: stages [0, 2) and [2, 3)
    first, last = (
        load_model(tiny_mqa_dir, torch.float32, pack_linears=False, stage=s)
        for s in stage_shards(cfg.num_layers, 1, 2)
    )
    names0 = {n for n, _ in first.named_parameters()}
    names1 = {n for n, _ in last.named_parameters()}
    assert "model.embed_tokens.weight" in names0 and "lm_head.weight" not in names0
    assert {n.split(".")[2] for n in names0 if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in names1 if n.startswith("model.layers.")} == {"2"}
    assert "model.embed_tokens.weight" not in names1 and "model.norm.weight" in names1
    # Local pool indices: the last stage's only layer writes layer 0 of its pool.
    assert last.model.layers["2"].self_attn.layer_id == 0
    # Tied embeddings (Qwen2): the last stage's head is a copy of the embedding tensor.
    qcfg = ModelConfig.from_pretrained(tiny_qwen2_dir)
    assert qcfg.tie_word_embeddings
    whole = load_model(tiny_qwen2_dir, torch.float32, pack_linears=False)
    tail = load_model(
        tiny_qwen2_dir, torch.float32, pack_linears=False, stage=stage_shards(2, 1, 2)[1]
    )
    assert torch.equal(tail.lm_head.weight, whole.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="hidden states"):
        tail(_steps(qcfg.vocab_size)[0], TorchPagedAttentionBackend(_pool(qcfg, 1)))
