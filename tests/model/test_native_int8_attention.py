"""The CPU kernel's integer path: int8 pages read by bf16 queries (paged_attention_int8.h).

Its arithmetic is not the decoding paths' (the codes widened, never rounded to bf16, their
scales applied after exact integer sums; the queries and probabilities as 16-bit integers),
so it is not held to their bits but to what they promise:

- against attention computed in float64 over the stored codes, it is closer than the same
  kernel over the codes decoded to bf16 (what int8 pages gave before);
- a row's bits do not depend on the call it rides in: a decode row equals the prefill row of
  its position, and each sequence computed alone equals it computed beside the others (the
  property speculative decoding's verify rows rely on), for windows and soft-caps too, and
  for decode rows of few query heads per KV head (read from the pages) and of many (from a
  block made ready for them).
"""

from __future__ import annotations

import math

import pytest
import torch

from radixkernels.reference import dequantize_ref, store_kv_ref
from radixserve.memory.pool import KVPool
from radixserve.model import native

pytestmark = pytest.mark.skipif(
    not (native.load() and native.int8_attention_in_integers(64)),
    reason="no integer path here (the CPU kernel did not build, or no AVX-512 VNNI, or AMX)",
)

PS = 16


def _pool(hkv: int, d: int, num_pages: int, seed: int) -> KVPool:
    """A one-layer int8 pool, every slot holding random rows quantized by the torch store."""
    pool = KVPool(1, num_pages, PS, hkv, d, kv_dtype="int8", act_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(num_pages * PS, dtype=torch.int64)
    k = (torch.randn(len(slots), hkv, d, generator=g) * 2).bfloat16()
    v = torch.randn(len(slots), hkv, d, generator=g).bfloat16()
    assert pool.k_scale is not None and pool.v_scale is not None
    store_kv_ref(
        pool.k_data[0], pool.v_data[0], pool.k_scale[0], pool.v_scale[0], k, v, slots, pool.fmt
    )
    return pool


def _run(
    pool: KVPool,
    q: torch.Tensor,
    parts: list[tuple[list[native.Member], list[int]]],
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The kernel over the pool's int8 pages for the plan of ``parts``."""
    assert pool.k_scale is not None and pool.v_scale is not None
    out = torch.full_like(q, float("nan"))
    native.paged_attention(
        q, pool.k_data[0], pool.v_data[0], out, native.AttentionPlan.build(parts),
        q.shape[-1] ** -0.5, window=window, softcap=softcap,
        scales=(pool.k_scale[0], pool.v_scale[0]),
    )  # fmt: skip
    assert not out.isnan().any()
    return out


def _exact(
    k: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    parts: list[tuple[list[native.Member], list[int]]],
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention in float64 over pages ``k``, ``v`` ([pages, PS, hkv, d], float64)."""
    hq, d = q.shape[1], q.shape[2]
    grp = hq // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for members, shared in parts:
        for m in members:
            pages = shared + m.pages
            keys = torch.cat([k[p] for p in pages])[: len(shared) * PS + m.own_len]
            vals = torch.cat([v[p] for p in pages])[: len(shared) * PS + m.own_len]
            for t in range(m.new_len):
                last = len(keys) - m.new_len + t
                lo = max(0, last - window + 1) if window else 0
                rows = q[m.q_start + t].double()
                kh = keys[lo : last + 1].repeat_interleave(grp, dim=1)  # [n, hq, d]
                vh = vals[lo : last + 1].repeat_interleave(grp, dim=1)
                s = torch.einsum("hd,nhd->hn", rows, kh) / math.sqrt(d)
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                out[m.q_start + t] = torch.einsum("hn,nhd->hd", s.softmax(-1), vh)
    return out


def _members(
    specs: list[tuple[int, int]], perm: list[int]
) -> tuple[list[tuple[list[native.Member], list[int]]], int]:
    """One sequence per (new rows, keys) of ``specs``, each a group of its own, on pages taken
    from ``perm``: the plan's parts and the rows they take."""
    parts: list[tuple[list[native.Member], list[int]]] = []
    rows = 0
    for new, keys in specs:
        pages = [perm.pop() for _ in range(-(-keys // PS))]
        parts.append(([native.Member(rows, new, pages, keys)], []))
        rows += new
    return parts, rows


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(
    "quirks", [(None, None), (100, None), (None, 2.0)], ids=["plain", "window", "softcap"]
)
def test_closer_to_exact_than_the_codes_decoded_to_bf16(
    d: int, quirks: tuple[int | None, float | None]
) -> None:
    """Decode rows (9 query heads over 3 KV heads: rows from the pages), extends and a
    prefill (a block made ready), a group sharing a prefix; error against float64 attention
    over code * scale, set against the kernel over the pages decoded to bf16."""
    window, softcap = quirks
    hq, hkv, num_pages = 9, 3, 200
    pool = _pool(hkv, d, num_pages, seed=1)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(2)).tolist()
    parts, rows = _members([(1, 700), (1, 129), (37, 437), (200, 200), (5, 64)], perm)
    if window is None:  # (a window's plan shares no pages)
        shared = [perm.pop() for _ in range(6)]
        two = [
            native.Member(rows, 1, [perm.pop()], 9),
            native.Member(rows + 1, 3, [perm.pop()], 16),
        ]
        parts.append((two, shared))
        rows += 4
    q = (torch.randn(rows, hq, d, generator=torch.Generator().manual_seed(3)) * 2).bfloat16()
    got = _run(pool, q, parts, window, softcap)
    assert pool.k_scale is not None and pool.v_scale is not None
    k_dec = dequantize_ref(pool.k_data[0], pool.k_scale[0], pool.fmt)  # float32, unrounded
    v_dec = dequantize_ref(pool.v_data[0], pool.v_scale[0], pool.fmt)
    decoded = torch.full_like(q, float("nan"))
    native.paged_attention(
        q, k_dec.bfloat16(), v_dec.bfloat16(), decoded, native.AttentionPlan.build(parts),
        d**-0.5, window=window, softcap=softcap,
    )  # fmt: skip
    exact = _exact(k_dec.double(), v_dec.double(), q, parts, window, softcap)
    err, err_decoded = (got.double() - exact).abs(), (decoded.double() - exact).abs()
    assert err.mean() <= 0.75 * err_decoded.mean()
    assert err.max() <= err_decoded.max()


@pytest.mark.parametrize(
    "shape", [(9, 3, 64), (8, 1, 64), (4, 4, 64), (6, 2, 128), (2, 1, 256)],
    ids=["gqa3", "gqa8", "mha", "d128", "d256"],
)  # fmt: skip
@pytest.mark.parametrize("quirks", [(None, None), (100, 2.0)], ids=["plain", "window-softcap"])
def test_a_decode_row_is_the_prefill_row_of_its_position(
    shape: tuple[int, int, int], quirks: tuple[int | None, float | None]
) -> None:
    """A 700-token prompt's prefill over its pages, then the decode row of each of several
    positions (ends of blocks and chunks, and past them) over the same pages: bit for bit.
    Decode rows of up to 4 query heads per KV head read the codes in place, keys in the
    lanes; 8 take the block made ready, rows in the lanes, as the prefill's rows do."""
    window, softcap = quirks
    hq, hkv, d = shape
    n = 700
    pool = _pool(hkv, d, -(-n // PS) + 1, seed=4)
    pages = list(range(-(-n // PS)))[::-1]  # scattered: last page first
    q = (torch.randn(n, hq, d, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    full = _run(pool, q, [([native.Member(0, n, pages, n)], [])], window, softcap)
    for pos in (0, 1, 63, 64, 65, 255, 256, 257, 511, 699):
        row = _run(
            pool, q[pos : pos + 1], [([native.Member(0, 1, pages, pos + 1)], [])], window, softcap
        )
        assert torch.equal(row[0], full[pos]), pos


def test_each_sequence_alone_is_the_same_as_beside_the_others() -> None:
    """Every sequence of a mixed call (decode rows, extends, a prefill, a group over a shared
    prefix) computed in a call of its own gives the same bits."""
    hq, hkv, d, num_pages = 9, 3, 64, 160
    pool = _pool(hkv, d, num_pages, seed=6)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(7)).tolist()
    parts, rows = _members([(1, 900), (1, 65), (24, 600), (70, 70)], perm)
    shared = [perm.pop() for _ in range(8)]
    parts.append(
        (
            [native.Member(rows, 2, [perm.pop()], 5), native.Member(rows + 2, 1, [perm.pop()], 1)],
            shared,
        )
    )
    rows += 3
    q = (torch.randn(rows, hq, d, generator=torch.Generator().manual_seed(8)) * 2).bfloat16()
    together = _run(pool, q, parts)
    for members, sh in parts:
        first = members[0].q_start
        count = sum(m.new_len for m in members)
        alone = [native.Member(m.q_start - first, m.new_len, m.pages, m.own_len) for m in members]
        got = _run(pool, q[first : first + count], [(alone, sh)])
        assert torch.equal(got, together[first : first + count])
