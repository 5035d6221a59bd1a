"""Fused mixture-of-experts MLP on the GPU: the step's (row, expert) slots grouped by expert
into blocks of ``BLOCK_M``, one grouped GEMM per projection over all experts at once (each
program multiplies one block of one expert's rows by a tile of that expert's weights), with
no host read anywhere, so a decode step that runs it can be captured in a CUDA graph.
Semantics: :func:`fused_moe_ref` (and the CPU's grouped path in ``model/layers/moe.py``).

Block layout (``align_slots``), as vLLM's ``moe_align_block_size`` lays it out::

    slots (row * top_k + j) sorted by expert, each expert's run padded to a multiple of BLOCK_M
    | e0 e0 e0 pad | e2 pad pad pad | e3 e3 e3 e3 | e3 pad pad pad | -1 ... (unused blocks)
    block_expert: 0, 2, 3, 3, -1, ...   (experts without a slot get no block)

The number of blocks is bounded without reading the counts (``T * top_k // BLOCK_M + E``
blocks at most); the unused ones exit at once. Padding slots carry the sentinel
``T * top_k`` and are neither read nor written.

Expert parallelism (``first_expert``): ``w13``/``w2`` hold only a rank's experts
``[first, first + E)``; the slots routed elsewhere are sent to a sentinel expert ``E`` whose
blocks are marked ``-1`` (vLLM's ``expert_map`` to -1), so they are neither computed nor
written, and their rows of the output stay zero.

The projections run in float32 accumulators; operands are upcast before ``tl.dot`` (the
interpreter multiplies bf16 wrongly, ARCHITECTURE.md). ``tl.dot`` of float32 operands is TF32
on the GPU unless told otherwise, and the interpreter is always exact: float32 rows take
``ieee`` (on the first GPU run, 2026-12-04 on an H200, the default TF32 put the kernel up to
0.025 off the reference where the interpreter had matched it to 1e-5); 16-bit rows keep TF32,
which holds a bf16 or fp16 value exactly. The routed weight multiplies the down
projection's rows; the ``top_k`` rows of each token are summed after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def align_slots(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_slots [blocks * block_m], block_expert [blocks])`` for expert ids ``[T, k]``
    (module docstring), computed on the device without a host read."""
    flat = ids.flatten()
    n = flat.numel()
    max_blocks = n // block_m + num_experts
    # Not torch.bincount: on CUDA it reads the largest id back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat.index_select(0, order)
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=flat.device) - first_of_expert.index_select(0, sorted_experts)
    dest = starts.index_select(0, sorted_experts) + rank
    slots = torch.full((max_blocks * block_m,), n, dtype=torch.int64, device=flat.device)
    slots.scatter_(0, dest, order)
    block_start = torch.arange(max_blocks, device=flat.device) * block_m
    expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(expert < num_experts, expert, torch.full_like(expert, -1))
    return slots, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: tokens (first projection, A_DIV = top_k) or slots (second, A_DIV = 1)
    w_ptr,  # [E, N, K]
    out_ptr,  # [slots, N]
    slots_ptr,  # [blocks * BLOCK_M]
    block_expert_ptr,  # [blocks]
    weights_ptr,  # [slots] routed weights (read when MUL_WEIGHT)
    num_slots,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    A_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,  # "ieee" for float32 rows, "tf32" for 16-bit ones (module docstring)
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + offs_m)
    valid = slot < num_slots
    a_row = (slot // A_DIV).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & (offs_k[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        w = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(a, w, input_precision=PREC)
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + slot, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        out_ptr + slot.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & (offs_n[None, :] < N),
    )


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    slots: torch.Tensor,
    block_expert: torch.Tensor,
    num_slots: int,
    a_div: int,
    weights: torch.Tensor | None,
    block_m: int,
    zeroed: bool = False,
) -> torch.Tensor:
    _, n, k = w.shape
    alloc = torch.zeros if zeroed else torch.empty
    out = alloc(num_slots, n, dtype=a.dtype, device=a.device)
    block_n = min(64, triton.next_power_of_2(n))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        slots,
        block_expert,
        weights if weights is not None else out,
        num_slots,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_DIV=a_div,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PREC="ieee" if torch.float32 in (a.dtype, w.dtype) else "tf32",
    )
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block_m: int = 16,
    first_expert: int | None = None,
) -> torch.Tensor:
    """The MoE MLP of rows ``x [T, H]``: experts' fused gate/up ``w13 [E, 2I, H]`` and down
    ``w2 [E, H, I]``, routing ``weights``/``ids`` ``[T, k]``. Returns ``[T, H]`` in x's dtype.
    ``first_expert`` (expert parallelism): the weights are global experts
    ``[first_expert, first_expert + E)``; slots routed to other experts add nothing."""
    t, h = x.shape
    top_k = ids.shape[1]
    num_slots = t * top_k
    if t == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    num_experts = w13.shape[0]
    if first_expert is None:
        slots, block_expert = align_slots(ids, num_experts, block_m)
    else:
        local = ids - first_expert
        held = (local >= 0) & (local < num_experts)
        local = torch.where(held, local, torch.full_like(local, num_experts))
        slots, block_expert = align_slots(local, num_experts + 1, block_m)
        block_expert = torch.where(
            block_expert == num_experts, torch.full_like(block_expert, -1), block_expert
        )
    gate_up = _grouped_gemm(x, w13, slots, block_expert, num_slots, top_k, None, block_m)
    inter = w13.shape[1] // 2
    act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:]).contiguous()
    flat_w = weights.flatten().to(torch.float32).contiguous()
    down = _grouped_gemm(
        act, w2, slots, block_expert, num_slots, 1, flat_w, block_m, first_expert is not None
    )
    return down.view(t, top_k, h).sum(dim=1)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int | None = None,
) -> torch.Tensor:
    """Plain torch, one (row, slot) at a time in float32: the kernel's semantics."""
    t, top_k = ids.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for row in range(t):
        for j in range(top_k):
            e = int(ids[row, j]) - (first_expert or 0)
            if not 0 <= e < w13.shape[0]:
                continue
            gu = w13[e].float() @ x[row].float()
            act = F.silu(gu[:inter]) * gu[inter:]
            out[row] += float(weights[row, j]) * (w2[e].float() @ act)
    return out.to(x.dtype)
