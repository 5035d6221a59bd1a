"""The Triton decode and extend kernels with a sliding window and an attention soft-cap
(Gemma 2/3, Mistral) against the torch references, under the interpreter on the CPU.

Each case sets a window shorter than most sequences and, in some, a soft-cap that bites
(scores up to ~10 against a cap of 2). After the reference is taken, the K/V of every
position that no new row's window reaches are poisoned (NaN, or NaN scales for int8), so
a kernel that reads outside the window gives NaN. Tolerances: ``kvcases.ATTN_TOL``.
"""

from __future__ import annotations

import kvcases
import pytest
import torch

from radixkernels import extend_attention, paged_decode_attention
from radixkernels.reference import extend_attention_ref, paged_decode_attention_ref

CASES = [
    # kv_dtype, act, Hq, Hkv, head_dim, page_size, window, softcap
    ("auto", torch.float32, 9, 3, 64, 4, 7, None),
    ("auto", torch.float32, 4, 2, 16, 1, 5, 2.0),
    ("int8", torch.float16, 4, 1, 64, 8, 13, 2.0),
    ("auto", torch.bfloat16, 4, 4, 32, 2, 64, 2.0),  # window longer than every sequence
    # bf16's query blocks are longer than the window: a block's later rows see nothing of
    # its first KV block (their max stayed -inf, which gave NaN rows before the kernel
    # rescaled by a finite stand-in).
    ("auto", torch.bfloat16, 4, 4, 32, 2, 5, 2.0),
    ("fp8_e4m3", torch.bfloat16, 4, 4, 32, 2, 5, None),
]


def _hide(case: kvcases.PagedCase, b: int, upto: int) -> None:
    """Poison positions ``0 .. upto - 1`` of sequence ``b`` (K, V and any token scales)."""
    if upto <= 0:
        return
    slots = case.slots_of(b, torch.arange(upto))
    tensors = [case.k_data, case.v_data]
    if case.fmt.kv_dtype.has_token_scales:
        tensors += [case.k_scale, case.v_scale]
    for t in tensors:
        assert t is not None
        flat = t.view(-1, *t.shape[2:])
        flat[slots] = kvcases.poison_(flat[slots].clone())
        if t.dtype in (torch.int8, torch.uint8) and not case.fmt.kv_dtype.has_token_scales:
            raise AssertionError("int codes cannot be poisoned without scales")


@pytest.mark.parametrize("kv_dtype,act,hq,hkv,head_dim,page_size,window,softcap", CASES)
def test_decode_window_softcap(
    kv_dtype: str,
    act: torch.dtype,
    hq: int,
    hkv: int,
    head_dim: int,
    page_size: int,
    window: int,
    softcap: float | None,
) -> None:
    lens = [1, page_size + 1, 3 * page_size - 1, 37]
    case, q, args, rest = kvcases.decode_call(
        kv_dtype, act, hq, hkv, head_dim, page_size, lens, seed=hq + window
    )
    ref = paged_decode_attention_ref(*args, *rest, window=window, softcap=softcap)
    full = paged_decode_attention_ref(*args, *rest)
    assert not torch.allclose(ref.float(), full.float(), atol=1e-2)  # the quirks matter
    for b, n in enumerate(lens):
        _hide(case, b, n - window)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(
            *args, *rest, num_kv_splits=splits, out=out, window=window, softcap=softcap
        )
        kvcases.assert_close(out, ref, act, f"decode window={window} splits={splits}")


@pytest.mark.parametrize("kv_dtype,act,hq,hkv,head_dim,page_size,window,softcap", CASES)
def test_extend_window_softcap(
    kv_dtype: str,
    act: torch.dtype,
    hq: int,
    hkv: int,
    head_dim: int,
    page_size: int,
    window: int,
    softcap: float | None,
) -> None:
    # A decode row on a long prefix, a fresh prefill, a chunk ending mid-page, an extend
    # longer than one query block (so windows start inside and across blocks).
    lens = [29, 19, 2 * page_size + 3, 34]
    exts = [1, 19, page_size + 2, 21]
    case, q, args, rest = kvcases.extend_call(
        kv_dtype, act, hq, hkv, head_dim, page_size, lens, exts, seed=hq * window
    )
    ref = extend_attention_ref(*args, *rest, window=window, softcap=softcap)
    for b, (n, e) in enumerate(zip(lens, exts)):
        _hide(case, b, n - e - window + 1)  # before the first new row's window
    out = torch.full_like(q, float("nan"))
    extend_attention(
        *args, *rest, max_extend_len=max(exts), out=out, window=window, softcap=softcap
    )
    kvcases.assert_close(out, ref, act, f"extend window={window}")
