"""The Triton backend sends decode rows to the decode kernel and extend rows to the extend kernel.

Mixed batches (decodes beside prefill chunks, in the scheduler's decode-first layout and in
SGLang's decode-last one), ragged lengths, prefixes ending mid-page and on page edges, and
head groups of 3 (SmolLM2's 9/3) and 4. Outputs are compared with the torch reference
(``paged_attention_ref``) over the same pool; kernel calls are recorded to check the split.
"""

from __future__ import annotations

from typing import Any

import kvcases
import pytest
import torch
from paged_reference import layer0, reference_attention

from radixkernels.reference import store_kv_ref
from radixserve.memory.pool import KVPool
from radixserve.model.attention.triton_paged import (
    RowSplit,
    TritonPagedAttentionBackend,
    split_rows,
)
from radixserve.model.forward_batch import ForwardBatch


def test_split_rows() -> None:
    assert split_rows([1, 1, 5, 3, 1]) == RowSplit(2, 4, 5, 5, 11)
    assert split_rows([1, 1, 1]) == RowSplit(3, 3, 0, 3, 3)  # decode-only
    assert split_rows([7, 1, 2]) == RowSplit(
        0, 3, 7, 3, 10
    )  # a 1-row sequence between extends stays there
    assert split_rows([4, 1, 1]) == RowSplit(0, 1, 4, 3, 6)  # SGLang's layout: decodes last
    assert split_rows([6]) == RowSplit(0, 1, 6, 1, 6)


def _batch(prefix: list[int], extend: list[int], page_size: int, num_pages: int) -> ForwardBatch:
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(len(prefix))).tolist()
    pages = [[perm.pop() for _ in range(-(-(p + e) // page_size))] for p, e in zip(prefix, extend)]
    return ForwardBatch.from_pages(pages, prefix, extend, page_size)


class _Spy:
    """Wraps a kernel entry point, recording the number of sequences of each call."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls: list[int] = []

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(int(args[6].shape[0]))  # page_table rows = sequences
        return self.fn(*args, **kwargs)


LAYOUTS = {
    # name: (prefix lens, extend lens, expected decode calls' sizes, expected extend calls' sizes)
    "decodes-first": ([7, 0, 12, 4, 9], [1, 1, 5, 4, 18], [2], [3]),
    "decodes-last": ([3, 8, 15, 4], [6, 17, 1, 1], [2], [2]),
    "both-ends": ([5, 2, 0, 11], [1, 9, 3, 1], [1, 1], [2]),
    "decode-only": ([4, 0, 23], [1, 1, 1], [3], []),
    "extend-only": ([0, 6], [11, 7], [], [2]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "heads,page_size,kv_dtype", [((9, 3), 4, "auto"), ((8, 2), 1, "int8")], ids=["gqa9-3", "gqa8-2"]
)
def test_rows_go_to_their_kernel(
    layout: str, heads: tuple[int, int], page_size: int, kv_dtype: str
) -> None:
    prefix, extend, want_decode, want_extend = LAYOUTS[layout]
    hq, hkv = heads
    d = 32
    num_pages = 64 // page_size + 16
    fb = _batch(prefix, extend, page_size, num_pages)
    # The kernels' pool and batch on the device under test (the GPU under gpu_check.sh, where
    # the backend refuses CPU tensors once triton is compiled); the reference stays on the CPU.
    pool = KVPool(1, num_pages, page_size, hkv, d, kv_dtype=kv_dtype, device=kvcases.DEVICE)
    ref_pool = KVPool(1, num_pages, page_size, hkv, d, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(11)
    # The cached prefixes: the same history in both pools.
    slots = [
        int(fb.page_table[b, pos // page_size]) * page_size + pos % page_size
        for b, n in enumerate(prefix)
        for pos in range(n)
    ]
    hist_k, hist_v = (
        torch.randn(len(slots), hkv, d, generator=g),
        torch.randn(len(slots), hkv, d, generator=g),
    )
    for p in (pool, ref_pool):
        store_kv_ref(
            p.k_data[0],
            p.v_data[0],
            layer0(p.k_scale),
            layer0(p.v_scale),
            hist_k.to(p.device),
            hist_v.to(p.device),
            torch.tensor(slots, dtype=torch.int64, device=p.device),
            p.fmt,
        )
    backend = TritonPagedAttentionBackend(pool)
    backend._decode, backend._extend = spy_d, spy_e = _Spy(backend._decode), _Spy(backend._extend)
    t = fb.num_tokens
    q = torch.randn(t, hq, d, generator=g)
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    fb_dev = kvcases.dev_batch(fb)
    assert fb_dev.page_table.device.type == pool.device.type == kvcases.DEVICE.type
    backend.init_forward_metadata(fb_dev)
    out = backend.forward(0, *map(kvcases.dev, (q, k, v)), fb_dev, d**-0.5)
    assert spy_d.calls == want_decode and spy_e.calls == want_extend
    ref = reference_attention(q, k, v, fb, ref_pool, page_size, d**-0.5)
    kvcases.assert_close(out.cpu(), ref, torch.float32, f"{layout} {heads}")
