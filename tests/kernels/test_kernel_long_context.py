"""The Triton decode and extend kernels over contexts longer than one split / one KV block.

The other kernel tests keep sequences under ~40 positions, so under the interpreter (16-key
blocks) a decode split holds one block at most and an extend program walks a few. Here a
decode row's context spans several blocks in every split (flash-decoding: each split's own
online softmax over its blocks, then the log-sum-exp merge of the splits), and an extend
chunk attends over a prefix of many blocks before its own causal rows (FlashAttention's
loop over KV blocks), against the torch references, on the SmolLM2 head group (9/3, d64),
with an unquantized and an int8 pool. Tolerance: float32's ``kvcases.ATTN_TOL`` (2e-5)
grown with the square root of the keys summed against the ~40 of the other tests (600 keys:
~4x, so 1e-4): the kernel applies int8's per-token scales to score and probability columns,
the reference to the dequantized rows, and their roundings add up over the keys.
"""

from __future__ import annotations

import kvcases
import pytest
import torch

from radixkernels import extend_attention, paged_decode_attention
from radixkernels.reference import extend_attention_ref, paged_decode_attention_ref

HQ, HKV, D, PAGE = 9, 3, 64, 16
# Longer than 4 splits x 16-key blocks by far (split_len 160: ten blocks a split), ragged.
DECODE_LENS = [613, 255, 97]
SPLITS = 4
TOL = 1e-4


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in kernel output (unwritten or poisoned read)"
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_decode_splits_of_many_blocks(kv_dtype: str) -> None:
    case = kvcases.build_case(kv_dtype, torch.float32, HKV, D, PAGE, DECODE_LENS, seed=3)
    q = kvcases.dev(
        kvcases.random_kv(
            (len(DECODE_LENS), HQ, D), torch.float32, torch.Generator().manual_seed(4)
        )
    )
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
        D**-0.5,
    )
    ref = paged_decode_attention_ref(*args)
    for splits in (1, SPLITS):  # the one-split path writes the output directly
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(*args, num_kv_splits=splits, out=out)
        assert_close(out, ref, f"decode {kv_dtype}, {splits} splits")


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_extend_over_a_long_prefix(kv_dtype: str) -> None:
    """A 40-row chunk after 560 cached positions (35 KV blocks of 16 before its own rows)
    beside a decode row over 300."""
    lens, exts = [600, 300], [40, 1]
    case = kvcases.build_case(kv_dtype, torch.float32, HKV, D, PAGE, lens, seed=5)
    starts = [0, exts[0]]
    q = kvcases.dev(
        kvcases.random_kv((sum(exts), HQ, D), torch.float32, torch.Generator().manual_seed(6))
    )
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
        D**-0.5,
    )
    out = torch.full_like(q, float("nan"))
    extend_attention(*args, max_extend_len=max(exts), out=out)
    assert_close(out, extend_attention_ref(*args), f"extend {kv_dtype}")
