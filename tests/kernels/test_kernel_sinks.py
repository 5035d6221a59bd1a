"""The Triton decode and extend kernels with attention sinks (gpt-oss: a logit per query
head in every row's softmax denominator) against the torch references, under the
interpreter on the CPU (and on a GPU from ``benchmarks/gpu_check.sh``).

Decode runs with one split (the sink joins in stage 1) and three (it joins in stage 2's
merge, once); extend with rows across query blocks. Cases cover GQA 9/3, windows beside
the sinks, int8 and fp8 pages. The references' sink is checked against the CPU backends'
``masked_attention`` (itself against float64 in ``tests/model/test_attention_sinks.py``).
Sinks are drawn with a spread of 2 so that each changes its rows' outputs visibly.
Tolerances: ``kvcases.ATTN_TOL``.
"""

from __future__ import annotations

import kvcases
import pytest
import torch

from radixkernels import extend_attention, paged_decode_attention
from radixkernels.reference import (
    extend_attention_ref,
    gather_kv_ref,
    paged_decode_attention_ref,
    sequence_slots,
)
from radixserve.model.attention.windowed import masked_attention

CASES = [
    # kv_dtype, act, Hq, Hkv, head_dim, page_size, window
    ("auto", torch.float32, 9, 3, 64, 4, None),
    ("auto", torch.float32, 4, 2, 16, 1, 5),
    ("int8", torch.float16, 4, 1, 64, 8, 13),
    ("fp8_e4m3", torch.bfloat16, 4, 4, 32, 2, None),
    ("fp8_e4m3", torch.bfloat16, 4, 4, 32, 2, 5),
]


def _sinks(hq: int, seed: int) -> torch.Tensor:
    return kvcases.dev(torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2.0)


@pytest.mark.parametrize("kv_dtype,act,hq,hkv,head_dim,page_size,window", CASES)
def test_decode_sinks(
    kv_dtype: str,
    act: torch.dtype,
    hq: int,
    hkv: int,
    head_dim: int,
    page_size: int,
    window: int | None,
) -> None:
    lens = [1, page_size + 1, 3 * page_size - 1, 37]
    _, q, args, rest = kvcases.decode_call(
        kv_dtype, act, hq, hkv, head_dim, page_size, lens, seed=hq + head_dim
    )
    sinks = _sinks(hq, head_dim)
    ref = paged_decode_attention_ref(*args, *rest, window=window, sinks=sinks)
    plain = paged_decode_attention_ref(*args, *rest, window=window)
    assert not torch.allclose(ref.float(), plain.float(), atol=1e-2)  # the sinks matter
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(
            *args, *rest, num_kv_splits=splits, out=out, window=window, sinks=sinks
        )
        kvcases.assert_close(out, ref, act, f"decode sinks splits={splits}")


@pytest.mark.parametrize("kv_dtype,act,hq,hkv,head_dim,page_size,window", CASES)
def test_extend_sinks(
    kv_dtype: str,
    act: torch.dtype,
    hq: int,
    hkv: int,
    head_dim: int,
    page_size: int,
    window: int | None,
) -> None:
    lens = [29, 19, 2 * page_size + 3, 34]
    exts = [1, 19, page_size + 2, 21]
    _, q, args, rest = kvcases.extend_call(
        kv_dtype, act, hq, hkv, head_dim, page_size, lens, exts, seed=hq * head_dim
    )
    sinks = _sinks(hq, head_dim + 1)
    ref = extend_attention_ref(*args, *rest, window=window, sinks=sinks)
    plain = extend_attention_ref(*args, *rest, window=window)
    assert not torch.allclose(ref.float(), plain.float(), atol=1e-2)
    out = torch.full_like(q, float("nan"))
    extend_attention(*args, *rest, max_extend_len=max(exts), out=out, window=window, sinks=sinks)
    kvcases.assert_close(out, ref, act, "extend sinks")


def test_reference_sinks_equal_the_cpu_backends_math() -> None:
    """The references' sink against ``masked_attention``'s on the same gathered K/V."""
    lens, exts, hq, hkv, d, ps = [23], [9], 6, 2, 16, 4
    case = kvcases.build_case("auto", torch.float32, hkv, d, ps, lens, seed=3)
    q = kvcases.dev(torch.randn(9, hq, d, generator=torch.Generator().manual_seed(4)))
    sinks = _sinks(hq, 5)
    ext = kvcases.dev(torch.tensor(exts, dtype=torch.int32))
    start = kvcases.dev(torch.tensor([0], dtype=torch.int32))
    ref = extend_attention_ref(
        q, case.k_data, case.v_data, None, None, case.fmt, case.page_table,
        case.seq_lens, ext, start, ps, 0.25, window=6, sinks=sinks,
    )  # fmt: skip
    slots = sequence_slots(case.page_table[0], lens[0], ps)
    k = gather_kv_ref(case.k_data, None, case.fmt, slots)
    v = gather_kv_ref(case.v_data, None, case.fmt, slots)
    pos = torch.arange(lens[0], device=q.device)
    want = masked_attention(q, k, v, pos[-9:], pos, 0.25, 6, None, sinks)
    torch.testing.assert_close(ref, want, atol=1e-6, rtol=1e-6)
