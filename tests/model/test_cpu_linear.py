"""oneDNN pre-packed linears: same results as nn.Linear, same parameters, opt-out honoured;
rows padded to few counts, each of which the warm-up builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from radixserve.model import cpu_gemv, cpu_linear, native
from radixserve.model.cpu_linear import (
    GEMV_MAX_ROWS,
    PackedLinear,
    onednn_linear_supported,
    onednn_rows,
    pack_linears,
    warm_onednn,
)
from radixserve.model.loader import load_model

pytestmark = pytest.mark.skipif(
    not onednn_linear_supported(torch.float32), reason="no oneDNN in this torch build"
)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 300, 513])
def test_packed_linear_matches_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(lin)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            packed(x.view(1, rows, 96)), lin(x).view(1, rows, 200), atol=1e-5, rtol=1e-5
        )


def test_pack_linears_keeps_parameters_and_ties(tiny_qwen2_dir: Path) -> None:
    plain = load_model(tiny_qwen2_dir, pack_linears=False)
    model = load_model(tiny_qwen2_dir)  # packs on CPU by default
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert (
        model.lm_head.weight is model.model.embed_tokens.weight
    )  # tied head still shares its weight
    assert pack_linears(model) == 0  # nothing left to pack


def test_only_quantized_models_keep_the_head_on_one_kernel(tiny_qwen2_dir: Path) -> None:
    """A quantized model's head runs oneDNN at every row count (its logits must not depend on
    the batch); a plain model's head takes the small-batch kernel like its other layers."""
    plain = load_model(tiny_qwen2_dir)
    assert isinstance(plain.lm_head, PackedLinear)
    assert plain.lm_head.gemv_max_rows == (GEMV_MAX_ROWS if cpu_gemv.available() else 0)
    quantized = load_model(tiny_qwen2_dir, quantization="int8", announce=False)
    assert isinstance(quantized.lm_head, PackedLinear)
    assert quantized.lm_head.gemv_max_rows == 0


@pytest.mark.skipif(
    not onednn_linear_supported(torch.bfloat16), reason="no bfloat16 oneDNN on this CPU"
)
def test_bfloat16_packed_linear_matches_linear() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(lin)(x), lin(x), atol=2e-2, rtol=2e-2)


def test_onednn_rows_pad_little_to_few_counts() -> None:
    """Every row count runs at one of at most 16 counts per power of two, at most 1/16 (or 7 rows)
    above it; powers of two from 8 up are not padded."""
    padded = [onednn_rows(m) for m in range(1, 8193)]
    for m, rows in enumerate(padded, start=1):
        assert m <= rows <= m + max(7, m // 16), m
        assert onednn_rows(rows) == rows
    assert padded == sorted(padded)
    assert all(onednn_rows(1 << p) == 1 << p for p in range(3, 14))
    assert len(set(padded[:2048])) == 80  # a step of up to 2048 tokens: 80 kernels per shape


@pytest.mark.skipif(not native.load(), reason="CPU kernels not built here")
def test_native_stack_pads_rows_as_python_does() -> None:
    """The C++ decoder stack multiplies through oneDNN at the same padded counts (the warm-up
    builds those)."""
    assert all(torch.ops.radixserve_cpu.onednn_rows(m) == onednn_rows(m) for m in range(1, 5000))


def test_warm_onednn_builds_every_count_once_per_shape(
    tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(tiny_qwen2_dir)
    calls: list[tuple[int, torch.Tensor]] = []
    run = cpu_linear.onednn_linear

    def counted(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((x.shape[0], w))
        return run(x, w, bias)

    monkeypatch.setattr(cpu_linear, "onednn_linear", counted)
    assert warm_onednn(model, max_rows=100, head_rows=20) == len(calls)
    counts = sorted({onednn_rows(m) for m in range(1, 101)})
    by_shape: dict[tuple[int, int, bool], list[torch.Tensor]] = {}
    for m in model.modules():
        if isinstance(m, PackedLinear) and m is not model.lm_head:
            by_shape.setdefault((m.in_features, m.out_features, m.bias is None), []).append(
                m.packed
            )
    assert len(by_shape) >= 3
    for weights in by_shape.values():
        # One weight of each shape stands for all (oneDNN keys its kernels by shape).
        runs = [sorted(r for r, w in calls if w is packed) for packed in weights]
        assert [r for r in runs if r] == [counts], runs
    assert sorted(r for r, w in calls if w is model.lm_head.packed) == [8, 16, 24]


def test_engine_warm_up_builds_its_step_budget(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's warm-up builds oneDNN's kernels for every step the scheduler can make:
    up to ``max_num_tokens`` rows, the head's up to one per running request."""
    from radixserve.engine.engine import Engine

    seen: list[tuple[int, int]] = []

    def record(model: nn.Module, max_rows: int, head_rows: int) -> int:
        seen.append((max_rows, head_rows))
        return 0

    monkeypatch.setattr(cpu_linear, "warm_onednn", record)
    monkeypatch.setenv(cpu_linear.WARM_UP_ENV, "1")  # the suite's engines skip it (conftest)
    Engine(str(tiny_llama_dir), num_pages=64, max_num_tokens=48, max_running_requests=3)
    assert seen == [(48, 3)]
    monkeypatch.setenv(cpu_linear.WARM_UP_ENV, "0")
    Engine(str(tiny_llama_dir), num_pages=64, max_num_tokens=48, max_running_requests=3)
    assert seen == [(48, 3)]  # skipped
