"""Triton paged decode attention against paged_decode_attention_ref.

Tolerances (kernel vs reference, same stored codes): see ``kvcases.ATTN_TOL`` —
fp32 2e-5, fp16 2e-3, bf16 2e-2 (absolute and relative). Sequence lengths cross page
boundaries and split boundaries; splits outnumbering a short sequence's blocks leave empty
splits that the reduce stage must skip; outputs are NaN-poisoned before the call.
"""

from __future__ import annotations

import kvcases
import pytest
import torch

from radixkernels import paged_decode_attention
from radixkernels.reference import paged_decode_attention_ref

CASES = [
    # kv_dtype, act, Hq, Hkv, head_dim, page_size, num_kv_splits
    ("auto", torch.float32, 9, 3, 64, 4, 3),  # SmolLM2 head group, flash-decoding splits
    ("auto", torch.bfloat16, 4, 2, 16, 1, 1),  # tiny-model head_dim, single split path
    ("int8", torch.float32, 4, 1, 128, 16, 2),  # MQA, head_dim 128, big pages
    ("int8", torch.bfloat16, 9, 3, 64, 1, 4),
    ("int4", torch.float32, 9, 3, 64, 8, 5),  # more splits than blocks for short sequences
    ("int4", torch.float16, 4, 2, 16, 2, 2),  # packed head dim 8 < 16: padded dot
    ("fp8_e4m3", torch.float16, 4, 4, 128, 4, 2),  # MHA
    ("fp8_e5m2", torch.float32, 4, 2, 64, 1, 3),
]


@pytest.mark.parametrize("kv_dtype,act,hq,hkv,head_dim,page_size,splits", CASES)
def test_paged_decode_matches_reference(
    kv_dtype: str, act: torch.dtype, hq: int, hkv: int, head_dim: int, page_size: int, splits: int
) -> None:
    lens = [1, page_size + 1, 3 * page_size - 1, 37]
    case = kvcases.build_case(kv_dtype, act, hkv, head_dim, page_size, lens, seed=hq + head_dim)
    q = kvcases.dev(
        kvcases.random_kv((len(lens), hq, head_dim), act, torch.Generator().manual_seed(7))
    )
    sm_scale = head_dim**-0.5
    args = (
        q,
        case.k_data,
        case.v_data,
        case.k_scale,
        case.v_scale,
        case.fmt,
        case.page_table,
        case.seq_lens,
        case.page_size,
        sm_scale,
    )
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(*args, num_kv_splits=splits, out=out)
    assert res is out
    kvcases.assert_close(out, paged_decode_attention_ref(*args), act, f"decode {kv_dtype}")


def test_paged_decode_noncontiguous_q_and_default_splits() -> None:
    """q as a view of a fused projection; default split count; int32 page table with padding."""
    lens = [5, 20]
    case = kvcases.build_case("auto", torch.float32, 2, 32, 4, lens, seed=11)
    fused = kvcases.dev(torch.randn(2, 12, 32))
    q = fused[:, 2:6]
    args = (
        q,
        case.k_data,
        case.v_data,
        case.k_scale,
        case.v_scale,
        case.fmt,
        case.page_table,
        case.seq_lens,
        case.page_size,
        0.2,
    )
    out = paged_decode_attention(*args)
    kvcases.assert_close(
        out, paged_decode_attention_ref(*args), torch.float32, "decode noncontiguous q"
    )
