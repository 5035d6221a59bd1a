"""The CPU paged-attention kernel with a sliding window (Gemma, Mistral) and an attention
soft-cap (Gemma 2) against a float64 reference: each row at position p sees keys
p - window < j <= p; scores become ``cap * tanh(score / cap)`` before the softmax.

Contexts cross the kernel's 64-key blocks and 128-key chunks, extends span several blocks
(so rows of one block have different window starts), and each member's pages start at the
first page its first row's window reaches (as the torch-paged backend plans them), so the
window's first key lies inside a page. Pages outside the plan hold NaN: a read of them
would show. Tolerances: float32 1e-5, bfloat16 pages and queries 2e-2 (the kernel's own
rounding of bf16 values, as in ``test_native_attention.py``). Queries are scaled so that
scores reach ~10 against a cap of 2: the cap bites.
"""

from __future__ import annotations

import random

import pytest
import torch
from paged_reference import last_rows_attention

from radixserve.model import native

pytestmark = pytest.mark.skipif(
    not native.load(), reason="the CPU kernel did not build here (see the log)"
)


@pytest.mark.parametrize(
    "dtype,d,page_size,window,softcap,tol",
    [
        (torch.float32, 16, 4, 70, None, 1e-5),
        (torch.float32, 64, 16, 9, 2.0, 1e-5),
        (torch.bfloat16, 64, 1, 130, None, 2e-2),
        (torch.bfloat16, 32, 4, 130, 2.0, 2e-2),
        (torch.float32, 16, 8, 1, None, 1e-5),  # every row sees only itself
        (torch.float32, 64, 4, None, 2.0, 1e-5),  # the cap alone
    ],
)
def test_window_and_softcap_match_reference(
    dtype: torch.dtype,
    d: int,
    page_size: int,
    window: int | None,
    softcap: float | None,
    tol: float,
) -> None:
    rng = random.Random(window)
    hq, hkv = 6, 2
    # (keys of the sequence, new rows): decodes, a prefill, extends over a prefix.
    seqs = [(300, 1), (41, 1), (150, 150), (260, 90), (5, 3), ((window or 7) + 3, 2)]
    num_pages = sum(-(-n // page_size) for n, _ in seqs) + 3
    kp = torch.randn(num_pages, page_size, hkv, d).to(dtype)
    vp = torch.randn(num_pages, page_size, hkv, d).to(dtype)
    free = list(range(num_pages))
    rng.shuffle(free)
    q = (torch.randn(sum(e for _, e in seqs), hq, d) * 3).to(dtype)
    scale = d**-0.5
    parts, refs, row = [], [], 0
    used: set[int] = set()
    for n, e in seqs:
        pages = [free.pop() for _ in range(-(-n // page_size))]
        k, v = (t[pages].reshape(-1, hkv, d)[:n] for t in (kp, vp))
        refs.append(last_rows_attention(q[row : row + e], k, v, scale, window, softcap))
        # Pages before every row's window (the plan torch_paged makes).
        skip = max(0, n - e - window + 1) // page_size if window else 0
        used.update(pages[skip:])
        parts.append(([native.Member(row, e, pages[skip:], n - skip * page_size)], []))
        row += e
    for p in set(range(num_pages)) - used:
        kp[p] = float("nan")
        vp[p] = float("nan")
    out = torch.full_like(q, float("nan"))
    plan = native.AttentionPlan.build(parts)
    native.paged_attention(q, kp, vp, out, plan, scale, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), torch.cat(refs), atol=tol, rtol=tol)


def test_window_refuses_shared_pages() -> None:
    kp = torch.randn(4, 4, 1, 16)
    q = torch.randn(1, 1, 16)
    plan = native.AttentionPlan.build([([native.Member(0, 1, [1], 3)], [0])])
    with pytest.raises(RuntimeError, match="shares no pages"):
        native.paged_attention(q, kp, kp.clone(), torch.empty_like(q), plan, 0.25, window=4)


def test_softcap_over_shared_pages() -> None:
    """Two members reading a shared run first (the cascade plan): the cap applies there too."""
    d, ps, hq, hkv, scale, cap = 16, 4, 4, 2, 0.25, 2.0
    kp, vp = torch.randn(8, ps, hkv, d), torch.randn(8, ps, hkv, d)
    q = torch.randn(5, hq, d) * 3
    members = [native.Member(0, 2, [2, 3], 7), native.Member(2, 3, [4], 4)]
    out = torch.full_like(q, float("nan"))
    plan = native.AttentionPlan.build([(members, [0, 1])])
    native.paged_attention(q, kp, vp, out, plan, scale, softcap=cap)
    refs = []
    for m, rows in zip(members, (slice(0, 2), slice(2, 5))):
        pages = [0, 1, *m.pages]
        n = 2 * ps + m.own_len
        k, v = (t[pages].reshape(-1, hkv, d)[:n] for t in (kp, vp))
        refs.append(last_rows_attention(q[rows], k, v, scale, None, cap))
    torch.testing.assert_close(out.double(), torch.cat(refs), atol=1e-5, rtol=1e-5)
