"""Triton prefix-extend attention against extend_attention_ref.

Tolerances: see ``kvcases.ATTN_TOL`` (fp32 2e-5, fp16 2e-3, bf16 2e-2). One batch mixes a
decode row (extend 1 on a long prefix), a fresh prefill (no prefix), a chunk whose prefix
ends mid-page, and an extend longer than one query block (under the interpreter a program covers 32 score
rows, 32 // group tokens) so causal masking crosses block edges. Each program covers a group of query heads
(GQA), so groups of 1, 2, 3, 4 and 12 all appear. Outputs are NaN-poisoned, and rows between
sequences belong to no one and must stay untouched.
"""

from __future__ import annotations

import kvcases
import pytest
import torch

from radixkernels import extend_attention
from radixkernels.reference import extend_attention_ref

CASES = [
    # kv_dtype, act, Hq, Hkv, head_dim, page_size
    ("auto", torch.float32, 9, 3, 64, 4),
    ("auto", torch.bfloat16, 4, 1, 16, 1),
    ("int8", torch.float16, 4, 2, 64, 16),
    ("int4", torch.float32, 9, 3, 64, 1),
    ("int4", torch.bfloat16, 4, 4, 128, 4),
    ("fp8_e4m3", torch.float32, 4, 2, 128, 2),
    ("fp8_e5m2", torch.bfloat16, 9, 3, 16, 8),
    (
        "auto",
        torch.float16,
        12,
        1,
        32,
        2,
    ),  # group of 12: score rows past 2 tokens x 12 heads are masked
]


@pytest.mark.parametrize("kv_dtype,act,hq,hkv,head_dim,page_size", CASES)
def test_extend_matches_reference(
    kv_dtype: str, act: torch.dtype, hq: int, hkv: int, head_dim: int, page_size: int
) -> None:
    lens = [29, 19, 2 * page_size + 3, 34]
    exts = [1, 19, page_size + 2, 21]
    case = kvcases.build_case(kv_dtype, act, hkv, head_dim, page_size, lens, seed=hq * head_dim)
    gap = 2  # unused rows between sequences' rows: must stay poisoned
    starts, row = [], 0
    for e in exts:
        starts.append(row)
        row += e + gap
    q = kvcases.dev(kvcases.random_kv((row, hq, head_dim), act, torch.Generator().manual_seed(5)))
    args = (
        q,
        case.k_data,
        case.v_data,
        case.k_scale,
        case.v_scale,
        case.fmt,
        case.page_table,
        case.seq_lens,
        kvcases.dev(torch.tensor(exts, dtype=torch.int32)),
        kvcases.dev(torch.tensor(starts, dtype=torch.int32)),
        case.page_size,
        head_dim**-0.5,
    )
    out = torch.full_like(q, float("nan"))
    res = extend_attention(*args, max_extend_len=max(exts), out=out)
    assert res is out
    used = torch.zeros(row, dtype=torch.bool, device=q.device)
    for s, e in zip(starts, exts):
        used[s : s + e] = True
    assert torch.isnan(out[~used]).all(), "kernel wrote rows that belong to no sequence"
    ref = extend_attention_ref(*args)
    kvcases.assert_close(out[used], ref[used], act, f"extend {kv_dtype}")


def test_extend_handles_decode_only_batch_without_max_len() -> None:
    """Extend length 1 everywhere (the engine may route decode rows here); grid from a device max."""
    lens = [3, 17, 8]
    case = kvcases.build_case("int8", torch.float32, 2, 32, 4, lens, seed=2)
    q = kvcases.dev(torch.randn(3, 6, 32))
    args = (
        q,
        case.k_data,
        case.v_data,
        case.k_scale,
        case.v_scale,
        case.fmt,
        case.page_table,
        case.seq_lens,
        kvcases.dev(torch.ones(3, dtype=torch.int32)),
        kvcases.dev(torch.arange(3, dtype=torch.int32)),
        case.page_size,
        0.17,
    )
    kvcases.assert_close(
        extend_attention(*args), extend_attention_ref(*args), torch.float32, "extend decode rows"
    )
