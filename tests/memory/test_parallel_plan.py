"""Memory per device under tensor × pipeline parallelism, with hand-computed numbers.

The article's worked example: Llama-2-70B on 8 × 80 GB as TP 4 × PP 2, fp8 KV, 0.85
utilization, max_model_len 4096. The article runs 64 sequences; the plan shows 599 fit.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.memory.parallel_plan import plan_parallel_memory
from radixserve.memory.planner import (
    GiB,
    activation_reserve_bytes,
    kv_bytes_per_token,
    kv_fixed_bytes,
    weight_bytes,
)
from radixserve.memory.sharding import (
    DeviceShard,
    kv_heads_per_rank,
    q_heads_per_rank,
    split_sizes,
    stage_layer_ranges,
    stage_shards,
)
from radixserve.model.config import ModelConfig
from radixserve.presets import preset_path


def preset(name: str) -> ModelConfig:
    path = preset_path(name)
    assert path is not None
    return ModelConfig.from_pretrained(path)


def test_stage_layer_ranges() -> None:
    assert stage_layer_ranges(80, 1) == [(0, 80)]
    assert stage_layer_ranges(80, 2) == [(0, 40), (40, 80)]
    # The extra layers go to the stages before the last, the middle ones first.
    assert stage_layer_ranges(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert stage_layer_ranges(5, 2) == [(0, 3), (3, 5)]
    assert stage_layer_ranges(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError):
        stage_layer_ranges(2, 3)
    shards = stage_shards(30, tp=2, pp=3)
    assert [(s.has_embedding, s.has_lm_head) for s in shards] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    assert sum(s.layers(30) for s in shards) == 30 and shards[1].tp_size == 2


def test_head_splits() -> None:
    assert kv_heads_per_rank(8, 4) == 2
    assert kv_heads_per_rank(8, 1) == 8
    assert kv_heads_per_rank(3, 4) == 1  # SmolLM2: fewer KV heads than ranks -> one replica each
    assert kv_heads_per_rank(2, 4) == 1
    assert kv_heads_per_rank(3, 2) == 2  # uneven: the larger share sizes the device
    assert split_sizes(9, 2) == [5, 4] and split_sizes(8, 4) == [2, 2, 2, 2]
    # Query heads follow their KV head's group (as radixserve.model.parallel splits them).
    assert q_heads_per_rank(64, 8, 4) == 16
    assert q_heads_per_rank(9, 3, 2) == 6  # rank 0: KV heads 0-1 and their 6 query heads
    assert q_heads_per_rank(9, 3, 4) == 3  # ranks 0-1 share KV head 0, rank 2 has head 1 alone
    assert q_heads_per_rank(9, 3, 8) == 2


def test_weights_split_by_tp_and_pp() -> None:
    cfg = preset("llama-2-70b")
    fp16 = torch.float16
    # PP alone partitions the untied model exactly.
    stages = stage_shards(cfg.num_layers, 1, 2)
    assert sum(weight_bytes(cfg, fp16, shard=s) for s in stages) == cfg.num_params * 2
    # TP 4: everything divides by 4 except the norms (2 per layer + the final one), replicated.
    tp4 = DeviceShard(tp_size=4)
    norms = (2 * 80 + 1) * 8192 * 2
    assert 4 * weight_bytes(cfg, fp16, shard=tp4) == cfg.num_params * 2 + 3 * norms
    # Tied embeddings: one copy with PP 1, the last stage's own copy with PP 2.
    small = preset("smollm2-135m")
    emb = small.vocab_size * small.hidden_size * 4
    s0, s1 = stage_shards(small.num_layers, 1, 2)
    whole = weight_bytes(small, torch.float32)
    assert (
        weight_bytes(small, torch.float32, shard=s0) + weight_bytes(small, torch.float32, shard=s1)
        == whole + emb
    )


def test_article_example_llama2_70b_tp4_pp2() -> None:
    cfg = preset("llama-2-70b")
    plan = plan_parallel_memory(
        cfg,
        tp=4,
        pp=2,
        kv_dtype="fp8_e4m3",
        act_dtype=torch.float16,
        page_size=16,
        device_total=80 * 10**9,
        memory_utilization=0.85,
        max_num_tokens=2048,
    )
    s0, s1 = plan.stages
    assert s0.budget_bytes == s1.budget_bytes == 68 * 10**9
    # Per TP rank: 16 query heads, 2 KV heads, 7168 MLP rows, 8000 vocabulary rows; 40 layers.
    per_layer = ((16 + 2 * 2) * 128 * 8192 + 8192 * 16 * 128 + 3 * 8192 * 7168 + 2 * 8192) * 2
    assert per_layer == 427_851_776
    assert s0.weight_bytes == 40 * per_layer + 8000 * 8192 * 2 == 17_245_143_040
    assert s1.weight_bytes == 40 * per_layer + 8000 * 8192 * 2 + 8192 * 2 == 17_245_159_424
    # KV per token per device: 2 (K, V) x 40 layers x 2 KV heads x 128 x 1 B (fp8).
    assert s0.bytes_per_token == s1.bytes_per_token == 2 * 40 * 2 * 128 == 20_480
    assert s0.kv_fixed_bytes == 2 * 40 * 2 * 4
    row = 4 * 8192 + 2 * 16 * 128 + 2 * 2 * 128 + 3 * 7168
    assert s0.activation_reserve_bytes == 2048 * row * 2
    assert s1.activation_reserve_bytes == 2048 * (row * 2 + 32000 * 4)  # logits: last stage
    # The last stage is the tighter one; every device holds that many pages.
    expected = (68 * 10**9 - 17_245_159_424 - 2048 * (row * 2 + 32000 * 4) - 640) // (20_480 * 16)
    assert plan.num_pages == s1.num_pages == expected == 153_355 < s0.num_pages
    assert plan.max_sequences(4096) == 153_355 // 256 == 599  # vs the article's 64
    # "~500 of 640 GB used": the pools take what the budget leaves after the weights.
    assert plan.total_budget_bytes == 8 * 68 * 10**9
    assert 505 * GiB < plan.total_used_bytes <= plan.total_budget_bytes
    assert plan.total_weight_bytes == 4 * (17_245_143_040 + 17_245_159_424)
    assert plan.stage_plan(0).num_pages == plan.num_pages


def test_single_device_unchanged_by_whole_shard() -> None:
    cfg = preset("llama-2-7b")
    whole = DeviceShard()
    assert kv_bytes_per_token(cfg, "auto", torch.float16, whole) == 512 * 1024
    assert kv_fixed_bytes(cfg, "fp8_e4m3", whole) == 2 * 32 * 32 * 4
    assert activation_reserve_bytes(cfg, 8, torch.float16, whole) == activation_reserve_bytes(
        cfg, 8, torch.float16
    )
    one = plan_parallel_memory(cfg, 1, 1, act_dtype=torch.float16, memory_budget=80 * GiB)
    assert one.num_pages == 33 * 256 + one.num_pages % 256 and one.max_sequences(4096) == 33


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-2-70b", "llama-2-7b"])
def test_planner_sizes_the_largest_rank_of_the_model_split(name: str) -> None:
    """The planner's per-device heads are the largest any rank of radixserve.model.parallel holds."""
    from radixserve.model.parallel import shard_for_rank

    cfg = preset(name)
    for tp in (1, 2, 3, 4, 8):
        shards = [shard_for_rank(cfg, r, tp) for r in range(tp)]
        assert max(s.num_q_heads for s in shards) == q_heads_per_rank(
            cfg.num_q_heads, cfg.num_kv_heads, tp
        )
        assert max(s.num_kv_heads for s in shards) == kv_heads_per_rank(cfg.num_kv_heads, tp)
        assert max(s.intermediate_size for s in shards) == split_sizes(cfg.intermediate_size, tp)[0]
