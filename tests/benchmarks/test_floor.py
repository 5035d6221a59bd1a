"""The weight-streaming floor's byte count: a checkpoint's weights at the served dtype, a tied
head once, as the engine holds them."""

from __future__ import annotations

from pathlib import Path

import bench_modules
import pytest
import torch

from radixserve.engine.engine import Engine
from radixserve.memory import hugepages

floor = bench_modules.load("floor.py", "bench_floor")


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])  # untied, tied head
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_bytes_are_the_engines_weights(
    fixture: str, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    model_dir = request.getfixturevalue(fixture)
    engine = Engine(model_dir, dtype=dtype, device="cpu", num_pages=64)
    held = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert floor.checkpoint_weight_bytes(model_dir, dtype) == held


def test_read_gbs_is_a_rate() -> None:
    assert floor.read_gbs(torch.ones(1 << 20)) > 0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's smaps")
def test_read_source_sits_on_huge_pages_like_the_weights() -> None:
    src = floor.read_source()
    assert src.dtype == torch.float32 and src.numel() * 4 == 512 << 20
    assert float(src[-1]) == 1.0
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        # "hg": advised MADV_HUGEPAGE, as the engine's weight arena is.
        assert "hg" in hugepages.vm_flags(src.data_ptr())
