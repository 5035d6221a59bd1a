"""The CPU paged decode-attention kernel against a float64 softmax reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from radixserve.model.attention import native

pytestmark = pytest.mark.skipif(not native.load(), reason="the CPU kernel did not build here (see the log)")


def _reference(
    q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, pages: list[int], n: int, scale: float
) -> torch.Tensor:
    """Attention of one row ``q`` [Hq, D] over the first ``n`` tokens of ``pages``, in float64."""
    hq, d = q.shape
    hkv = kp.shape[2]
    k = kp[pages].reshape(-1, hkv, d)[:n].double().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
    v = vp[pages].reshape(-1, hkv, d)[:n].double().repeat_interleave(hq // hkv, dim=1)
    w = torch.softmax(torch.einsum("hd,nhd->hn", q.double(), k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", w, v)


def _case(
    rng: random.Random, groups: list[tuple[int, int]], page_size: int, hq: int, hkv: int, d: int,
    q_dtype: torch.dtype, kv_dtype: torch.dtype,
) -> float:
    """Random pages for ``groups`` (members, shared pages) and the kernel's largest error."""
    num_pages = 4 + sum(s + m * 4 for m, s in groups)
    kp = torch.randn(num_pages, page_size, hkv, d).to(kv_dtype)
    vp = torch.randn(num_pages, page_size, hkv, d).to(kv_dtype)
    free = list(range(num_pages))
    rng.shuffle(free)
    members = sum(m for m, _ in groups)
    # Two rows not in the plan; q a view of a fused qkv projection, as the model passes it.
    q = torch.randn(members + 2, (hq + 2 * hkv) * d).to(q_dtype)[:, : hq * d].view(-1, hq, d)
    rows = list(range(members + 2))
    rng.shuffle(rows)
    plan_groups, own, full = [], [], []
    for m, s in groups:
        shared = [free.pop() for _ in range(s)]
        mine = []
        for _ in range(m):
            n_own = rng.randint(1, 3 * page_size + 1)
            pages = [free.pop() for _ in range(-(-n_own // page_size))]
            own.append((pages, n_own))
            full.append((shared + pages, s * page_size + n_own))
            mine.append(rows.pop())
        plan_groups.append((mine, shared))
    out = torch.full_like(q, 7.0)
    scale = 1 / math.sqrt(d)
    native.paged_decode_attention(q, kp, vp, out, native.DecodePlan.build(plan_groups, own), scale)
    err = 0.0
    planned = [r for rows_, _ in plan_groups for r in rows_]
    for r, (pages, n) in zip(planned, full):
        ref = _reference(q[r], kp, vp, pages, n, scale)
        err = max(err, (out[r].double() - ref).abs().max().item())
    for r in rows:  # untouched
        assert torch.all(out[r] == 7.0)
    return err


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("page_size", [1, 16, 5])
def test_matches_reference_float32(heads: tuple[int, int], page_size: int) -> None:
    rng = random.Random(page_size * 100 + heads[0])
    # A big group, a pair, singletons without shared pages; shared parts longer than a block.
    groups = [(5, 90 // page_size + 1), (2, 3), (1, 0), (1, 0)]
    assert _case(rng, groups, page_size, *heads, 64, torch.float32, torch.float32) < 2e-5


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype", "tol"),
    [(torch.bfloat16, torch.bfloat16, 2e-2), (torch.float16, torch.float16, 2e-3), (torch.float32, torch.bfloat16, 2e-5)],
)
def test_matches_reference_half_precisions(q_dtype: torch.dtype, kv_dtype: torch.dtype, tol: float) -> None:
    """Error is that of rounding the output (and for bf16 the query), not of the kernel."""
    assert _case(random.Random(3), [(3, 7), (1, 0)], 16, 9, 3, 64, q_dtype, kv_dtype) < tol


@pytest.mark.parametrize("d", [16, 32, 80, 128, 256])
def test_other_head_dims(d: int) -> None:
    assert _case(random.Random(d), [(2, 5), (1, 1)], 16, 6, 2, d, torch.float32, torch.float32) < 2e-5


def test_large_scores_do_not_overflow() -> None:
    """Scores far from 0 (a sharp softmax) stay finite: the running max is subtracted first."""
    kp = torch.zeros(2, 4, 1, 32)
    vp = torch.arange(256, dtype=torch.float32).view(2, 4, 1, 32)
    kp[1, 2, 0, 0] = 1.0
    q = torch.zeros(1, 1, 32)
    q[0, 0, 0] = 1e4
    out = torch.empty_like(q)
    plan = native.DecodePlan.build([([0], [0])], [([1], 4)])
    native.paged_decode_attention(q, kp, vp, out, plan, 1.0)
    torch.testing.assert_close(out[0, 0], vp[1, 2, 0])


def test_bad_arguments_raise() -> None:
    q = torch.randn(2, 9, 64)
    kp = torch.randn(4, 16, 3, 64)
    plan = native.DecodePlan.build([([0], [])], [([1], 3)])
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        native.paged_decode_attention(torch.randn(2, 8, 64), kp, kp, torch.empty(2, 8, 64), plan, 1.0)
    with pytest.raises(RuntimeError, match="head_dim of q"):
        native.paged_decode_attention(q, kp[..., :32].contiguous(), kp[..., :32].contiguous(), q.clone(), plan, 1.0)
    q40, kp40 = torch.randn(2, 9, 40), torch.randn(4, 16, 3, 40)
    with pytest.raises(RuntimeError, match="head_dim must be one of"):
        native.paged_decode_attention(q40, kp40, kp40, q40.clone(), plan, 1.0)
    assert not native.supported(torch.float32, torch.float32, torch.device("cpu"), head_dim=40)
    bad = native.DecodePlan.build([([0], [])], [([1], 3)])
    bad.own_len = bad.own_len.int()
    with pytest.raises(RuntimeError, match="own_len"):
        native.paged_decode_attention(q, kp, kp, q.clone(), bad, 1.0)
