"""DenseAttentionBackend against a naive per-sequence softmax(QK^T)V with explicit GQA expansion."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.attention.dense import DenseAttentionBackend
from radixserve.model.forward_batch import ForwardBatch


def _naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize(
    "hq,hkv", [(4, 4), (4, 2), (9, 3), (6, 1)], ids=["mha", "gqa2", "gqa3-smollm2", "mqa6"]
)
def test_dense_matches_naive(hq: int, hkv: int) -> None:
    lens = [5, 1, 17, 8]
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    t, d = sum(lens), 16
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    batch = ForwardBatch.for_full_sequences([[1] * n for n in lens])
    out = DenseAttentionBackend().forward(0, q, k, v, batch, sm_scale=d**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, _naive(q, k, v, lens, d**-0.5), atol=1e-5, rtol=1e-5)


def test_sequences_do_not_see_each_other() -> None:
    lens = [3, 4]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 2, 8, generator=g) for _ in range(3))
    batch = ForwardBatch.for_full_sequences([[1] * n for n in lens])
    out = DenseAttentionBackend().forward(0, q, k, v, batch, 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[3:], v2[3:] = 100.0, -100.0  # change the second sequence only
    out2 = DenseAttentionBackend().forward(0, q, k2, v2, batch, 0.3)
    torch.testing.assert_close(out[:3], out2[:3])


def test_rejects_cached_prefix() -> None:
    batch = ForwardBatch.for_full_sequences([[1, 2, 3]])
    batch.seq_lens_cpu = [5]  # 2 tokens already cached: needs a paged backend
    x = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="full sequences"):
        DenseAttentionBackend().forward(0, x, x, x, batch, 1.0)


def test_equal_lengths_batched_path() -> None:
    lens = [6, 6, 6]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(18, h, 16, generator=g) for h in (9, 3, 3))
    batch = ForwardBatch.for_full_sequences([[1] * n for n in lens])
    out = DenseAttentionBackend().forward(0, q, k, v, batch, 0.25)
    torch.testing.assert_close(out, _naive(q, k, v, lens, 0.25), atol=1e-5, rtol=1e-5)
