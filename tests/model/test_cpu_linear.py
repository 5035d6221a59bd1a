"""oneDNN pre-packed linears: same results as nn.Linear, same parameters, opt-out honoured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from radixserve.model import cpu_gemv
from radixserve.model.cpu_linear import (
    GEMV_MAX_ROWS,
    PackedLinear,
    onednn_linear_supported,
    pack_linears,
)
from radixserve.model.loader import load_model

pytestmark = pytest.mark.skipif(
    not onednn_linear_supported(torch.float32), reason="no oneDNN in this torch build"
)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
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
