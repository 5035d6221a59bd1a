"""Builders for kernel tests: a poisoned paged pool filled with random K/V for ragged sequences.

Every sequence's pages are scattered randomly over the pool; every slot the test does not
fill holds poison (NaN for float storage, NaN scales for int storage), and page-table
entries past a sequence's last page point at a dedicated all-poison page, so a kernel that
reads one slot too many produces NaN instead of a silently plausible number.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from radixkernels.kv_format import KVCacheDtype, KVFormat
from radixkernels.reference import store_kv_ref
from radixserve.model.forward_batch import ForwardBatch

# Where kernel tests run: the CPU under the Triton interpreter (the default, see
# tests/conftest.py), or the GPU when benchmarks/gpu_check.sh exports TRITON_INTERPRET=0.
DEVICE = torch.device(
    "cuda"
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and torch.cuda.is_available()
    else "cpu"
)


def dev(t: torch.Tensor) -> torch.Tensor:
    """Move a test tensor (built on the CPU for reproducibility) to the kernel test device."""
    return t.to(DEVICE)


def dev_batch(fb: ForwardBatch) -> ForwardBatch:
    """``fb`` with its tensors on the kernel test device (its host lists kept)."""
    moved = {
        f.name: getattr(fb, f.name).to(DEVICE)
        for f in dataclasses.fields(fb)
        if isinstance(getattr(fb, f.name), torch.Tensor)
    }
    return dataclasses.replace(fb, **moved)


# Kernel-vs-reference tolerances on attention outputs, per activation dtype. Both sides
# dequantize the same stored codes, so what remains is arithmetic: fp32 accumulation order,
# the 16-bit output rounding (the interpreter truncates to bf16), and on a GPU the 16-bit
# cast of probabilities before the P@V dot.
ATTN_TOL: dict[torch.dtype, tuple[float, float]] = {  # (atol, rtol)
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass
class PagedCase:
    """A populated pool for one layer plus the batch geometry that reads it."""

    fmt: KVFormat
    k_data: torch.Tensor
    v_data: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    page_table: torch.Tensor  # [B, max_pages + 1] int32, padded with the poison page
    seq_lens: torch.Tensor  # [B] int32
    page_size: int
    poison_page: int

    def slots_of(self, b: int, positions: torch.Tensor) -> torch.Tensor:
        """Pool slots of the given positions of sequence ``b``."""
        ps = self.page_size
        positions = positions.to(self.page_table.device)
        return self.page_table[b, positions // ps].long() * ps + positions % ps


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with values no correct kernel would produce or read without noticing."""
    if t.dtype.is_floating_point:
        if t.element_size() == 1:  # fp8: NaN code (0x7f is NaN in e4m3fn, and in e5m2)
            t.view(torch.uint8).fill_(0x7F)
        else:
            t.fill_(float("nan"))
    else:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.int32).to(t.dtype))
    return t


def random_kv(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random K/V rows with a spread of magnitudes (outliers and small values), never all zeros."""
    x = torch.randn(shape, generator=gen)
    x = x * torch.exp(torch.randn(shape[:-1] + (1,), generator=gen))  # per-row magnitude spread
    return x.to(dtype)


def build_case(
    kv_dtype: str,
    act_dtype: torch.dtype,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    seed: int = 0,
) -> PagedCase:
    """Scatter the sequences' pages over a poisoned pool and store random K/V for every position.

    Built on the CPU (reference store), then moved to :data:`DEVICE`.
    """
    gen = torch.Generator().manual_seed(seed)
    fmt = KVFormat.create(kv_dtype, act_dtype, head_dim)
    pages_per_seq = [(L + page_size - 1) // page_size for L in seq_lens]
    num_pages = sum(pages_per_seq) + 3  # spare pages stay poisoned
    shape = (num_pages, page_size, kv_heads, fmt.packed_head_dim)
    k_data = poison_(torch.empty(shape, dtype=fmt.storage_dtype))
    v_data = poison_(torch.empty(shape, dtype=fmt.storage_dtype))
    if fmt.kv_dtype.has_token_scales:
        k_scale = poison_(torch.empty(shape[:3]))
        v_scale = poison_(torch.empty(shape[:3]))
    elif fmt.kv_dtype.has_head_scales:
        # Calibrated-looking static scales (not 1.0, so that the scale path is exercised).
        k_scale = 0.5 + torch.rand(kv_heads, generator=gen)
        v_scale = 0.5 + torch.rand(kv_heads, generator=gen)
    else:
        k_scale = v_scale = None
    perm = torch.randperm(num_pages, generator=gen)
    poison_page = int(perm[-1])
    page_table = torch.full((len(seq_lens), max(pages_per_seq) + 1), poison_page, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        page_table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    case = PagedCase(
        fmt,
        k_data,
        v_data,
        k_scale,
        v_scale,
        page_table,
        torch.tensor(seq_lens, dtype=torch.int32),
        page_size,
        poison_page,
    )
    slots = torch.cat([case.slots_of(b, torch.arange(L)) for b, L in enumerate(seq_lens)])
    k = random_kv((len(slots), kv_heads, head_dim), act_dtype, gen)
    v = random_kv((len(slots), kv_heads, head_dim), act_dtype, gen)
    store_kv_ref(k_data, v_data, k_scale, v_scale, k, v, slots, fmt)
    if DEVICE.type != "cpu":
        for name in ("k_data", "v_data", "k_scale", "v_scale", "page_table", "seq_lens"):
            t = getattr(case, name)
            if t is not None:
                setattr(case, name, dev(t))
    return case


class Call(NamedTuple):
    """One kernel call's inputs over a :class:`PagedCase`: the queries, the arguments before
    the kernel's options (``args``, then ``rest``: the references take the same)."""

    case: PagedCase
    q: torch.Tensor
    args: tuple[Any, ...]
    rest: tuple[Any, ...]


def decode_call(
    kv_dtype: str, act: torch.dtype, hq: int, hkv: int, d: int, page_size: int,
    lens: list[int], seed: int,
) -> Call:  # fmt: skip
    """A decode row per sequence of ``lens`` tokens (queries scaled x3: the scores bite)."""
    case = build_case(kv_dtype, act, hkv, d, page_size, lens, seed=seed)
    q = dev(random_kv((len(lens), hq, d), act, torch.Generator().manual_seed(7)) * 3)
    args = (q, case.k_data, case.v_data, case.k_scale, case.v_scale, case.fmt)
    return Call(case, q, args, (case.page_table, case.seq_lens, case.page_size, d**-0.5))


def extend_call(
    kv_dtype: str, act: torch.dtype, hq: int, hkv: int, d: int, page_size: int,
    lens: list[int], exts: list[int], seed: int,
) -> Call:  # fmt: skip
    """The last ``exts[b]`` tokens of each sequence of ``lens`` as new rows, packed."""
    case = build_case(kv_dtype, act, hkv, d, page_size, lens, seed=seed)
    starts = [sum(exts[:i]) for i in range(len(exts))]
    q = dev(random_kv((sum(exts), hq, d), act, torch.Generator().manual_seed(5)) * 3)
    args = (q, case.k_data, case.v_data, case.k_scale, case.v_scale, case.fmt, case.page_table)
    rest = (
        case.seq_lens,
        dev(torch.tensor(exts, dtype=torch.int32)),
        dev(torch.tensor(starts, dtype=torch.int32)),
        case.page_size,
        d**-0.5,
    )
    return Call(case, q, args, rest)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Kernel output vs reference with the per-dtype tolerance, and no NaN anywhere."""
    assert not torch.isnan(out).any(), f"{what}: NaN in kernel output (unwritten or poisoned read)"
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(
        out.float(), ref.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def is_quantized(kv_dtype: str) -> bool:
    return KVCacheDtype(kv_dtype).is_quantized
