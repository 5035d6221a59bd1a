"""Weights moved into one huge-page buffer keep their values, ties and views."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from radixserve.memory import hugepages

needs_advice = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform"
)


def _module() -> nn.Module:
    """Tied embedding and head, a fused weight with slices, a buffer and a view of it."""
    m = nn.Module()
    m.embed = nn.Embedding(300, 24)
    m.head = nn.Linear(24, 300, bias=False)
    m.head.weight = m.embed.weight
    m.fused = nn.Linear(24, 48)
    m.register_buffer("scale", torch.arange(12, dtype=torch.bfloat16))
    m.register_buffer("scale_row", m.scale.view(3, 4)[:, 1:])
    m.register_buffer("codes", torch.randint(-8, 8, (5, 7), dtype=torch.int8))
    return m


@needs_advice
def test_values_ties_and_views_survive() -> None:
    m = _module()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    strides = {k: v.stride() for k, v in m.state_dict().items()}
    params = {k: id(p) for k, p in m.named_parameters()}
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage() for t in m.state_dict().values()
    }
    assert len(storages) == 5  # the tie and the view share their bases' storages
    moved = hugepages.move_to_hugepages(m)
    assert moved == sum(-(-s.nbytes() // 64) * 64 for s in storages.values())
    after = m.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
        assert after[k].stride() == strides[k] and after[k].dtype == v.dtype, k
    # The same Parameter objects, the tie kept, one storage for everything.
    assert {k: id(p) for k, p in m.named_parameters()} == params
    assert m.head.weight is m.embed.weight
    storages = {t.untyped_storage().data_ptr() for t in after.values()}
    assert len(storages) == 1
    # A view still aliases its base: a write through one shows in the other.
    m.scale[5] = 100.0
    assert m.scale_row[1, 0].item() == 100.0
    # Every tensor starts on a cache line; the buffer on a 2 MB boundary.
    assert all(t.data_ptr() % 64 == 0 for k, t in after.items() if k != "scale_row")
    assert min(t.data_ptr() for t in after.values()) % hugepages.HUGE_PAGE == 0


@needs_advice
def test_only_the_viewed_bytes_move() -> None:
    """A weight that views part of a bigger storage (the rest referenced by nothing of the
    module) moves alone: the arena holds what the module uses, not whole storages."""
    m = nn.Module()
    big = torch.randn(1000, 64)
    m.w = nn.Parameter(big[100:110], requires_grad=False)
    m.register_buffer("col", torch.arange(40, dtype=torch.int16).view(8, 5)[2:, 3])
    want_w, want_col = m.w.clone(), m.col.clone()
    moved = hugepages.move_to_hugepages(m)
    assert moved == 10 * 64 * 4 + 64  # the 10 rows; the column's 6 int16 within 64 bytes
    assert torch.equal(m.w, want_w) and torch.equal(m.col, want_col)
    assert m.w.untyped_storage().data_ptr() == m.col.untyped_storage().data_ptr()
    assert m.w.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()


def test_without_the_advice_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    m = _module()
    ptrs = {k: v.data_ptr() for k, v in m.state_dict().items()}
    assert hugepages.move_to_hugepages(m) == 0
    assert {k: v.data_ptr() for k, v in m.state_dict().items()} == ptrs


@needs_advice
def test_loaded_cpu_model_lives_in_one_buffer(tiny_llama_dir: Path) -> None:
    """load_model moves a CPU model's weights before packing its linears, so the views the
    packed layers keep (the small-batch kernels' weights) point into the huge-page buffer."""
    from radixserve.model.cpu_linear import PackedLinear
    from radixserve.model.loader import load_model

    model = load_model(tiny_llama_dir, dtype=torch.float32)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed, "the tiny model's linears were not packed"
    for m in packed:
        assert m._gemv_weight.untyped_storage().data_ptr() in storages
