"""KV memory calculator: the article's worked example, GQA, quantized bytes with scales, the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixkernels.kv_format import KVFormat
from radixserve.memory.planner import (
    GiB,
    MemorySnapshot,
    format_bytes,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    memory_snapshot,
    parse_bytes,
    plan_memory,
    weight_bytes,
)
from radixserve.model.config import ModelConfig
from radixserve.presets import list_presets, preset_path


def preset(name: str) -> ModelConfig:
    path = preset_path(name)
    assert path is not None
    return ModelConfig.from_pretrained(path)


def test_presets_shipped() -> None:
    assert {"llama-2-7b", "llama-2-13b", "llama-2-70b", "smollm2-135m"} <= set(list_presets())
    assert preset("llama-2-7b").num_params == 6_738_415_616  # the published parameter count
    assert preset("llama-2-13b").num_params == 13_015_864_320
    assert preset("llama-2-70b").num_params == 68_976_648_192
    assert preset("smollm2-135m").num_params == 134_515_008


def test_article_example_llama2_7b() -> None:
    """Llama-2-7B, 4096 tokens, batch 1, FP16 -> 2 GiB of KV per sequence."""
    cfg = preset("llama-2-7b")
    per_token = kv_bytes_per_token(cfg, "auto", torch.float16)
    assert per_token == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    assert kv_bytes_per_sequence(cfg, 4096, "auto", torch.float16) == 2 * GiB


def test_gqa_llama2_70b() -> None:
    cfg = preset("llama-2-70b")
    assert (cfg.num_q_heads, cfg.num_kv_heads) == (64, 8)
    per_seq = kv_bytes_per_sequence(cfg, 4096, "auto", torch.float16)
    assert per_seq == 2 * 80 * 8 * 128 * 2 * 4096 == int(1.25 * GiB)
    # With one KV head per query head it would be 8x more.
    assert per_seq * 8 == 2 * 80 * 64 * 128 * 2 * 4096


def test_quantized_bytes_include_scales() -> None:
    cfg = preset("llama-2-7b")
    fp16 = kv_bytes_per_token(cfg, "auto", torch.float16)
    scales = 2 * 32 * 32 * 4  # one fp32 scale per (token, KV head), for K and V
    assert kv_bytes_per_token(cfg, "int8", torch.float16) == fp16 // 2 + scales
    assert kv_bytes_per_token(cfg, "int4", torch.float16) == fp16 // 4 + scales
    assert kv_bytes_per_token(cfg, "fp8_e4m3", torch.float16) == fp16 // 2  # static per-head scales
    # Never the article's 37.5% / 18.75%: 8 and 4 bits out of 16 are 50% and 25% before scales.
    assert kv_bytes_per_token(cfg, "int8", torch.float16) / fp16 == pytest.approx(0.515625)
    assert kv_bytes_per_token(cfg, "int4", torch.float16) / fp16 == pytest.approx(0.265625)
    # Same accounting as the pool's layout (KVFormat is the single source of truth).
    fmt = KVFormat.create("int4", torch.float16, 128)
    assert kv_bytes_per_token(cfg, "int4", torch.float16) == fmt.bytes_per_token(32, 32)


def test_plan_memory_arithmetic() -> None:
    cfg = preset("llama-2-7b")
    plan = plan_memory(
        cfg,
        kv_dtype="auto",
        page_size=16,
        act_dtype=torch.float16,
        memory_budget=80 * GiB,
        device="cpu",
    )
    assert plan.weight_bytes == weight_bytes(cfg, torch.float16) == 6_738_415_616 * 2
    assert plan.bytes_per_page == 16 * 512 * 1024
    assert plan.kv_budget_bytes == 80 * GiB - plan.weight_bytes - plan.activation_reserve_bytes
    assert plan.num_pages == plan.kv_budget_bytes // plan.bytes_per_page
    assert plan.max_tokens == plan.num_pages * 16
    assert plan.pages_per_sequence(4096) == 256 and plan.pages_per_sequence(4097) == 257
    assert plan.max_sequences(4096) == plan.num_pages // 256 == 33
    # Quantized KV holds ~2x the pages in the same budget.
    int8 = plan_memory(
        cfg, kv_dtype="int8", page_size=16, act_dtype=torch.float16, memory_budget=80 * GiB
    )
    assert int8.num_pages == int8.kv_budget_bytes // (16 * (256 * 1024 + 8192))
    capped = plan_memory(cfg, act_dtype=torch.float16, memory_budget=80 * GiB, max_num_pages=10)
    assert capped.num_pages == 10


def test_plan_too_small_and_fp8_fixed_bytes() -> None:
    cfg = preset("llama-2-70b")
    plan = plan_memory(cfg, act_dtype=torch.float16, memory_budget=24 * GiB)
    assert plan.num_pages == 0 and plan.kv_budget_bytes == 0  # weights alone exceed the budget
    fp8 = plan_memory(preset("smollm2-135m"), kv_dtype="fp8_e4m3", memory_budget=GiB)
    assert fp8.kv_fixed_bytes == 2 * 30 * 3 * 4
    with pytest.raises(ValueError):
        plan_memory(cfg, memory_utilization=1.5)


def test_plan_from_device_memory() -> None:
    plan = plan_memory(
        preset("smollm2-135m"), act_dtype=torch.float32, device="cpu", memory_utilization=0.5
    )
    assert 0 < plan.budget_bytes and "cpu" in plan.budget_source
    assert plan.num_pages > 0


def test_memory_snapshot_cpu() -> None:
    snap = memory_snapshot("cpu", pool_bytes=1234)
    assert isinstance(snap, MemorySnapshot)
    assert (
        snap.rss_bytes > 10 * 2**20
        and snap.total_bytes > snap.rss_bytes
        and snap.pool_bytes == 1234
    )


def test_bytes_formatting() -> None:
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("24 GB") == 24 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")
    assert format_bytes(2 * GiB) == "2.00 GiB" and format_bytes(512 * 1024) == "512.0 KiB"


def test_checkpoint_dir_config(tiny_mqa_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_mqa_dir)
    assert kv_bytes_per_token(cfg, "auto", torch.float32) == 2 * 3 * 1 * 16 * 4
