"""radixserve's Llama-family model on a flattened ragged batch vs transformers per sequence.

Tolerance (float32): |ours - hf| <= 1e-4 + 1e-4 * |hf| on the tiny checkpoints, whose logits
reach ~4 in magnitude; the measured difference is ~2e-6 (fused matmuls round differently).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models
import torch

from radixserve.model.attention.dense import DenseAttentionBackend
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.loader import load_model

ATOL = 1e-4
RTOL = 1e-4
LENGTHS = (7, 1, 23, 12)


def _hf_logits(
    path: Path, seqs: list[list[int]], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0].float() for s in seqs]


def _random_seqs(vocab: int, lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _check_ragged(path: Path) -> None:
    model = load_model(path)
    seqs = _random_seqs(model.config.vocab_size)
    batch = ForwardBatch.for_full_sequences(seqs, all_logits=True)
    ours = model(batch, DenseAttentionBackend())
    assert ours.dtype == torch.float32 and ours.shape == (sum(LENGTHS), model.config.vocab_size)
    ref = torch.cat(_hf_logits(path, seqs))
    assert ref.abs().max() > 1.0  # the random init is not degenerate
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    # Last-row-only logits (what the engine asks for) are the same rows.
    last = model(ForwardBatch.for_full_sequences(seqs), DenseAttentionBackend())
    ends = torch.tensor(LENGTHS).cumsum(0) - 1
    torch.testing.assert_close(last, ref[ends], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mqa_dir", "tiny_llama_hd64_dir"]
)
def test_ragged_batch_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    _check_ragged(request.getfixturevalue(fixture))


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
    ids=["linear", "llama3"],
)
def test_rope_scaling_matches_transformers(rope_scaling: dict, tmp_path: Path) -> None:
    # A small original context makes llama3's three frequency bands all occur at head_dim 16.
    path = tiny_models.build_tiny_llama(tmp_path, rope_theta=500000.0, rope_scaling=rope_scaling)
    _check_ragged(path)


def test_untied_and_tied_heads(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    untied = load_model(tiny_llama_dir)
    assert not untied.config.tie_word_embeddings
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    tied = load_model(tiny_qwen2_dir)
    assert tied.config.tie_word_embeddings and tied.config.attention_bias
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.model.layers[0].self_attn.qkv_proj.bias is not None
    assert tied.model.layers[0].self_attn.o_proj.bias is None


def test_bfloat16_greedy_tokens_close(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    seqs = _random_seqs(model.config.vocab_size, lengths=(9, 4), seed=3)
    ours = model(ForwardBatch.for_full_sequences(seqs, all_logits=True), DenseAttentionBackend())
    assert ours.dtype == torch.float32
    ref = torch.cat(_hf_logits(tiny_llama_dir, seqs))
    # bf16 keeps 8 bits of mantissa: compare loosely against the float32 reference.
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()


def test_positions_are_per_token(tiny_llama_dir: Path) -> None:
    """RoPE reads ``batch.positions`` row by row: non-contiguous positions match HF's position_ids."""
    from transformers import AutoModelForCausalLM

    model = load_model(tiny_llama_dir)
    batch = ForwardBatch.for_full_sequences([[5, 6, 7, 8], [9, 10]], all_logits=True)
    batch.positions = torch.tensor([0, 3, 4, 9, 2, 7])
    ours = model(batch, DenseAttentionBackend())
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.cat(
            [
                hf(torch.tensor([[5, 6, 7, 8]]), position_ids=torch.tensor([[0, 3, 4, 9]])).logits[
                    0
                ],
                hf(torch.tensor([[9, 10]]), position_ids=torch.tensor([[2, 7]])).logits[0],
            ]
        )
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    contiguous = model(
        ForwardBatch.for_full_sequences([[5, 6, 7, 8]], all_logits=True), DenseAttentionBackend()
    )
    assert (contiguous[3] - ours[3]).abs().max() > 1e-3
