"""The fused-MoE Triton kernel (interpreted on the CPU) against its per-slot torch reference
and against the CPU's grouped MoE block: uneven routing, an expert with no slot, widths that
are no power of two, one row (a decode step) and rows spanning several blocks of one expert.
float32 (the interpreter's bf16 arithmetic is not the GPU's): within 1e-5 + 1e-4 relative."""

from __future__ import annotations

import os

import kvcases
import pytest
import torch

from radixkernels.moe import align_slots, fused_moe, fused_moe_ref
from radixserve.model.families.moe import MoEConfig
from radixserve.model.layers.moe import SparseMoeBlock


def _case(t: int, e: int, k: int, h: int, i: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.1
    w2 = torch.randn(e, h, i, generator=g) * 0.1
    logits = torch.randn(t, e, generator=g)
    logits[:, 1] -= 100.0  # expert 1 never chosen
    logits[:, 0] += 3.0  # expert 0 nearly always
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return x, w13, w2, weights, ids


def test_align_slots_groups_by_expert_and_pads() -> None:
    ids = torch.tensor([[3, 0], [0, 2], [3, 0]])
    slots, block_expert = align_slots(ids, num_experts=5, block_m=2)
    # expert 0: slots 1, 2, 5 (two blocks); expert 2: slot 3; expert 3: slots 0, 4; then unused.
    assert block_expert.tolist()[:4] == [0, 0, 2, 3] and set(block_expert.tolist()[4:]) == {-1}
    assert slots.tolist()[:8] == [1, 2, 5, 6, 3, 6, 0, 4]  # 6 = the padding sentinel


@pytest.mark.parametrize(
    "t,e,k,h,i",
    [(1, 8, 2, 64, 32), (37, 8, 2, 64, 32), (50, 6, 3, 48, 40), (5, 6, 4, 32, 24)],
)
def test_fused_moe_matches_reference(t: int, e: int, k: int, h: int, i: int) -> None:
    x, w13, w2, weights, ids = _case(t, e, k, h, i, seed=t + e)
    assert not (ids == 1).any() and (ids == 0).sum() > t // 2
    got = fused_moe(*(kvcases.dev(v) for v in (x, w13, w2, weights, ids)))
    torch.testing.assert_close(
        got.cpu(), fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-4
    )


def test_fused_moe_expert_parallel_slices_sum_to_the_whole() -> None:
    """Expert parallelism: each rank's kernel over its own experts ``[first, first + E/2)``
    (the other slots skipped, their rows zero) equals the reference restricted to them, and
    the two ranks' outputs add up to the whole layer's (what the all-reduce does). Rank 1's
    experts include the one no row chose."""
    x, w13, w2, weights, ids = _case(23, 8, 2, 48, 40, seed=3)
    half = []
    for first in (0, 4):
        w13_r, w2_r = w13[first : first + 4], w2[first : first + 4]
        got = fused_moe(
            *(kvcases.dev(v) for v in (x, w13_r, w2_r, weights, ids)), first_expert=first
        ).cpu()
        ref = fused_moe_ref(x, w13_r, w2_r, weights, ids, first_expert=first)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
        half.append(got)
    torch.testing.assert_close(
        half[0] + half[1], fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-4
    )


def test_fused_moe_matches_the_cpu_block() -> None:
    """The block's grouped torch path (what the CPU runs) and the kernel agree on one layer."""
    torch.manual_seed(0)
    block = SparseMoeBlock(64, MoEConfig(8, 2, 32, norm_topk_prob=True), bias=False)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(29, 64)
    weights, ids = block.gate(x)
    w13 = torch.stack([m.gate_up_proj.weight for m in block.experts])  # type: ignore[union-attr]
    w2 = torch.stack([m.down_proj.weight for m in block.experts])  # type: ignore[union-attr]
    with torch.no_grad():
        want = block(x)
        got = fused_moe(*(kvcases.dev(v.detach()) for v in (x, w13, w2, weights, ids)))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="forces the Triton ops on CPU tensors: interpreter only (gpu_check runs the kernels)",
)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_model_on_the_triton_path_matches_transformers(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The whole model with the fused Triton ops forced on (the CUDA path, interpreted): the
    MoE layers run the kernel on the experts' stacked weights (held once: each expert's
    linears become views into them) and the logits equal transformers' (Qwen2-MoE: its gated
    shared expert added to the kernel's output)."""
    import tiny_models
    from transformers import AutoModelForCausalLM

    from radixserve.model import gpu_ops
    from radixserve.model.attention.dense import DenseAttentionBackend
    from radixserve.model.forward_batch import ForwardBatch
    from radixserve.model.loader import load_model

    extra = (
        tiny_models.QWEN2_MOE
        if family == "qwen2_moe"
        else {"num_local_experts": 8, "num_experts_per_tok": 2}
    )
    path = tiny_models.build_tiny_family(tmp_path_factory.mktemp(family), family, **extra)
    model = load_model(path, pack_linears=False)
    seqs = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(20, 43))]
    with gpu_ops.forced(True):
        got = model(ForwardBatch.for_full_sequences(seqs, all_logits=True), DenseAttentionBackend())
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and block._w13 is not None
    assert block.experts[3].gate_up_proj.weight.data_ptr() == block._w13[3].data_ptr()  # type: ignore[union-attr]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
