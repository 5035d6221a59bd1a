"""Tensor-parallel layers: two gloo ranks (spawned processes on loopback) give the same logits
as one rank, for tiny Llama/Qwen2 models with 4 query over 2 KV heads, an uneven 9-over-3 split
(SmolLM2's shape) and one KV head replicated on both ranks (MQA)."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import tiny_models
import torch
import torch.multiprocessing as mp
from tp_ranks import run_two_ranks

from radixserve.model.attention.dense import DenseAttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.loader import load_model
from radixserve.model.parallel import (
    TPGroup,
    checkpoint_slice,
    shard_for_rank,
    tcp_store,
)

LENGTHS = (5, 1, 9)
TIMEOUT = datetime.timedelta(seconds=60)


def _seqs(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _logits(path: Path, tp: TPGroup | None) -> torch.Tensor:
    model = load_model(path, tp=tp)
    batch = ForwardBatch.for_full_sequences(_seqs(model.config.vocab_size), all_logits=True)
    return model(batch, DenseAttentionBackend())


def _rank(rank: int, port: int, paths: list[Path], out: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = tcp_store("127.0.0.1", port, rank, 2, TIMEOUT)
    tp = TPGroup.create(store, rank, 2, torch.device("cpu"), TIMEOUT, "127.0.0.1")
    for path in paths:
        logits = _logits(path, tp)
        if rank == 0:  # by value: a shared tensor's descriptor dies with this process
            out.put((str(path), logits.numpy()))


def test_shard_split_rules() -> None:
    smol = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "num_hidden_layers": 30,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
        }
    )
    two = [shard_for_rank(smol, r, 2) for r in range(2)]
    assert [(s.q_heads, s.kv_heads) for s in two] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    four = [shard_for_rank(smol, r, 4) for r in range(4)]  # KV head 0 replicated on ranks 0-1
    assert [(s.q_heads, s.kv_heads) for s in four] == [
        ((0, 2), (0, 1)),
        ((2, 3), (0, 1)),
        ((3, 6), (1, 2)),
        ((6, 9), (2, 3)),
    ]
    assert [s.intermediate for s in four] == [(0, 384), (384, 768), (768, 1152), (1152, 1536)]
    # Rank 0 holds the largest share: sizing memory from it bounds every rank.
    assert two[0].local_config(smol).num_kv_heads == 2
    with pytest.raises(ValueError, match="too large"):
        shard_for_rank(smol, 0, 16)
    cut = checkpoint_slice("model.layers.0.self_attn.o_proj.weight", two[1], 64)
    assert cut is not None and (cut.dim, cut.lo, cut.hi) == (1, 384, 576)
    bias = checkpoint_slice("model.layers.0.mlp.down_proj.bias", two[1], 64)
    assert bias is not None and bias.zero  # row-parallel bias: added by rank 0 only
    assert checkpoint_slice("model.layers.0.mlp.down_proj.bias", two[0], 64) is None


def test_two_ranks_match_one(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path, tiny_mqa_dir: Path, tmp_path: Path
) -> None:
    nine_over_three = tiny_models.build_tiny_llama(
        tmp_path / "q9kv3",
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=16,
        hidden_size=144,
        vocab_size=509,
    )
    paths = [tiny_llama_dir, tiny_qwen2_dir, tiny_mqa_dir, nine_over_three]
    pairs, _ = run_two_ranks(_rank, (paths,), len(paths))
    got = {name: torch.from_numpy(logits) for name, logits in pairs}
    for path in paths:
        ref = _logits(path, None)
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(got[str(path)], ref, atol=2e-5, rtol=2e-5)
