"""Attention sinks (gpt-oss) on every CPU attention path, against a float64 reference.

A sink is a learned logit per query head that joins each row's softmax denominator and has
no value: ``out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sink))``. The reference computes
exactly that; the paths under test are the torch math (``windowed.masked_attention``, its
blocked online-softmax form past ``KV_BLOCK_TOKENS`` keys), the CPU kernel (prefill and
decode rows, windowed, over shared pages, over int8, int4 and fp8 pages) and the paged backend's
two paths on one pool. Sinks are drawn around the scores' size (spread 2), so that they take
a visible share of each row's weight: every test also checks that dropping them changes the
output. Tolerances: float32 1e-5 (2e-5 between the two paged paths, as
``test_native_quant_attention.py``), bf16 2e-2.
"""

from __future__ import annotations

import random

import pytest
import torch
from paged_reference import last_rows_attention

from radixserve.model import native
from radixserve.model.attention import blocked
from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend
from radixserve.model.attention.windowed import masked_attention
from radixserve.model.forward_batch import ForwardBatch

needs_kernel = pytest.mark.skipif(
    not native.load(), reason="the CPU kernel did not build here (see the log)"
)


def _sinks(hq: int, seed: int) -> torch.Tensor:
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("blocks", [False, True], ids=["one_block", "blocked"])
def test_torch_math_matches_reference(
    window: int | None, blocks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``masked_attention`` (the dense backend's and the paged torch path's) and its blocked
    form (keys 16 at a time here), an extend of 7 rows over 40 keys."""
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, n, rows = 6, 2, 16, 40, 7
    q, k, v = (torch.randn(x, h, d, generator=g) for x, h in ((rows, hq), (n, hkv), (n, hkv)))
    sinks = _sinks(hq, 2)
    pos = torch.arange(n)
    if blocks:
        monkeypatch.setattr(blocked, "KV_BLOCK_TOKENS", 16)
    attend = blocked.masked_attention_blocks if blocks else masked_attention
    out = attend(q, k, v, pos[n - rows :], pos, 0.25, window, None, sinks)
    want = last_rows_attention(q, k, v, 0.25, window, sinks=sinks)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    without = last_rows_attention(q, k, v, 0.25, window)
    assert (want - without).abs().max() > 1e-2  # the sinks bite


@needs_kernel
@pytest.mark.parametrize(
    "dtype,d,page_size,window,tol",
    [
        (torch.float32, 16, 4, None, 1e-5),
        (torch.float32, 64, 16, 9, 1e-5),
        (torch.bfloat16, 64, 1, 130, 2e-2),
        (torch.bfloat16, 32, 4, None, 2e-2),
    ],
)
def test_kernel_matches_reference(
    dtype: torch.dtype, d: int, page_size: int, window: int | None, tol: float
) -> None:
    """Decode rows, a prefill and extends over a prefix (past the kernel's 64-key blocks and
    128-key chunks), each member's pages from the first its window reaches."""
    rng = random.Random(d)
    hq, hkv = 6, 2
    seqs = [(300, 1), (41, 1), (150, 150), (260, 90), (5, 3)]
    num_pages = sum(-(-n // page_size) for n, _ in seqs) + 1
    kp = torch.randn(num_pages, page_size, hkv, d).to(dtype)
    vp = torch.randn(num_pages, page_size, hkv, d).to(dtype)
    free = list(range(num_pages))
    rng.shuffle(free)
    q = (torch.randn(sum(e for _, e in seqs), hq, d) * 2).to(dtype)
    sinks = _sinks(hq, d)
    scale = d**-0.5
    parts, refs, plain, row = [], [], [], 0
    for n, e in seqs:
        pages = [free.pop() for _ in range(-(-n // page_size))]
        k, v = (t[pages].reshape(-1, hkv, d)[:n] for t in (kp, vp))
        refs.append(last_rows_attention(q[row : row + e], k, v, scale, window, sinks=sinks))
        plain.append(last_rows_attention(q[row : row + e], k, v, scale, window))
        skip = max(0, n - e - window + 1) // page_size if window else 0
        parts.append(([native.Member(row, e, pages[skip:], n - skip * page_size)], []))
        row += e
    out = torch.full_like(q, float("nan"))
    plan = native.AttentionPlan.build(parts)
    native.paged_attention(q, kp, vp, out, plan, scale, window=window, sinks=sinks)
    torch.testing.assert_close(out.double(), torch.cat(refs), atol=tol, rtol=tol)
    assert (torch.cat(refs) - torch.cat(plain)).abs().max() > 10 * tol


@needs_kernel
def test_kernel_over_shared_pages() -> None:
    """Two members reading a shared run first (the cascade plan): one sink per row, after
    the shared and the own keys."""
    d, ps, hq, hkv, scale = 16, 4, 4, 2, 0.25
    kp, vp = torch.randn(8, ps, hkv, d), torch.randn(8, ps, hkv, d)
    q = torch.randn(5, hq, d) * 2
    sinks = _sinks(hq, 3)
    members = [native.Member(0, 2, [2, 3], 7), native.Member(2, 3, [4], 4)]
    out = torch.full_like(q, float("nan"))
    native.paged_attention(
        q, kp, vp, out, native.AttentionPlan.build([(members, [0, 1])]), scale, sinks=sinks
    )
    refs = []
    for m, rows in zip(members, (slice(0, 2), slice(2, 5))):
        pages = [0, 1, *m.pages]
        n = 2 * ps + m.own_len
        k, v = (t[pages].reshape(-1, hkv, d)[:n] for t in (kp, vp))
        refs.append(last_rows_attention(q[rows], k, v, scale, None, sinks=sinks))
    torch.testing.assert_close(out.double(), torch.cat(refs), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 50])
def test_kernel_decode_row_equals_prefill_row(dtype: torch.dtype, window: int | None) -> None:
    """The kernel's exactness survives the sinks: each prefill row of a 300-token sequence
    (several chunks) and a decode step at its position over the same run give the same bits.
    (With a window the decode reads the same pages here: a run that starts at a later page,
    as the backend's window plans start a decode's, chunks its keys from another key and
    need not agree bit for bit, sinks or not.)"""
    d, ps, hq, hkv, n = 64, 16, 8, 2, 300
    pages = list(range(-(-n // ps)))
    kp = torch.randn(len(pages), ps, hkv, d).to(dtype)
    vp = torch.randn(len(pages), ps, hkv, d).to(dtype)
    q = torch.randn(n, hq, d).to(dtype)
    sinks = _sinks(hq, 4)
    prefill = torch.empty_like(q)
    plan = native.AttentionPlan.build([([native.Member(0, n, pages, n)], [])])
    native.paged_attention(q, kp, vp, prefill, plan, 0.125, window=window, sinks=sinks)
    for pos in (0, 63, 64, 127, 128, 200, n - 1):
        row = q[pos : pos + 1]
        decode = torch.empty_like(row)
        member = native.Member(0, 1, pages[: pos // ps + 1], pos + 1)
        step = native.AttentionPlan.build([([member], [])])
        native.paged_attention(row, kp, vp, decode, step, 0.125, window=window, sinks=sinks)
        assert torch.equal(decode[0], prefill[pos]), pos


def _paged_paths(
    kv_dtype: str, window: int | None, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer call of a mixed batch (two decodes, an extend over a prefix, a prefill) on
    the paged backend's kernel path and its torch path, each on its own pool holding the
    same history (quantized alike by the torch store)."""
    from radixkernels.reference import store_kv_ref
    from radixserve.memory.pool import KVPool

    hq, hkv, d, ps = 9, 3, 64, 4
    prefix, extend = [37, 12, 20, 0], [1, 1, 9, 14]
    need = [-(-(p + e) // ps) for p, e in zip(prefix, extend)]
    perm = torch.randperm(sum(need) + 1, generator=torch.Generator().manual_seed(5)).tolist()
    fb = ForwardBatch.from_pages([[perm.pop() for _ in range(n)] for n in need], prefix, extend, ps)
    assert fb.page_lists_cpu is not None
    slots = torch.tensor(
        [
            fb.page_lists_cpu[b][j // ps] * ps + j % ps
            for b, n in enumerate(prefix)
            for j in range(n)
        ]
    )
    g = torch.Generator().manual_seed(6)
    hist_k, hist_v = (torch.randn(len(slots), hkv, d, generator=g) for _ in range(2))
    q, k, v = (torch.randn(fb.num_tokens, h, d, generator=g) for h in (hq, hkv, hkv))
    outs = []
    for kernel in (True, False):
        pool = KVPool(1, sum(need) + 2, ps, hkv, d, kv_dtype=kv_dtype)
        ks = None if pool.k_scale is None else pool.k_scale[0]
        vs = None if pool.v_scale is None else pool.v_scale[0]
        store_kv_ref(pool.k_data[0], pool.v_data[0], ks, vs, hist_k, hist_v, slots, pool.fmt)
        backend = TorchPagedAttentionBackend(pool, native_kernel=kernel)
        assert backend._native == kernel  # the path under test is the one taken
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(0, q, k, v, fb, d**-0.5, window, None, sinks))
    return outs[0], outs[1]


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("window", [None, 6])
def test_paged_backend_paths_agree(kv_dtype: str, window: int | None) -> None:
    """The paged backend's kernel path and its torch path (``_masked``) apply the sinks
    alike, over float, int8, int4 and fp8 pages (quantized KV dtypes serve sinks through the
    same code: the sink joins the denominator after the keys are decoded and attended)."""
    sinks = _sinks(9, 7)
    kernel, torch_path = _paged_paths(kv_dtype, window, sinks)
    torch.testing.assert_close(kernel, torch_path, atol=2e-5, rtol=2e-5)
    without, _ = _paged_paths(kv_dtype, window, None)
    assert (kernel - without).abs().max() > 1e-2
