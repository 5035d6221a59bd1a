"""Tensor parallelism 2 for every family beyond Llama/Qwen2 (``model/families/``): two gloo
ranks (spawned once for all families) give one rank's logits, greedy tokens and logprobs.

Each family's tiny random checkpoint (transformers' own config and model class) has the
quirks that tensor parallelism could break active:

- Mistral 3: a multimodal checkpoint's text model, Ministral 3's query temperature;
- Qwen3 and Gemma 3: per-head q/k norms; Gemma 2/3: a window (6) shorter than the prompts,
  soft-caps that bite, ``query_pre_attn_scalar``, the embedding scale, Gemma 3's two RoPE
  bases, tied embeddings (a vocabulary-parallel tied head);
- Phi-3: ``qkv_proj`` / ``gate_up_proj`` stored fused (each rank reads its rows of every
  part), longrope;
- OLMo 2 (2 KV heads: one per rank) and OLMoE (1 KV head: replicated on both ranks, so only
  rank 0 adds its k lanes): q/k norms over the whole projection, whose sums of squares the
  ranks all-reduce; OLMoE's ``clip_qkv``;
- Qwen3-MoE (an odd expert width, 25: 13 + 12 rows per rank; a dense layer between sparse
  ones), Mixtral (``w1``/``w3``/``w2``) and OLMoE (top-3 not renormalised): every expert cut
  on its MLP width, the router whole on each rank. Separately, one expert block whose router
  sends every row to expert 0 and none to expert 5 gives the unsharded block's rows; and
  the Qwen3-MoE checkpoint re-saved with stacked experts (transformers 5's layout).
- Qwen2-MoE: a shared expert beside the routed ones, cut on its own (odd) width, 37: 19 +
  18 rows, its sigmoid gate whole on each rank scaling each rank's partial output before
  the one all-reduce; q/k/v bias; not renormalised; a dense layer.
- gpt-oss: attention sinks (each rank its heads'), a window of 4 on alternating layers,
  q/k/v/o biases (o's on rank 0), the router's bias whole, its stacked experts with gate and
  up interleaved cut on their width (16 + 16 of 32: each rank's rows of both one run), the
  experts' down bias on rank 0, the clamped SwiGLU biting; and a gpt-oss checkpoint whose
  experts are MXFP4 (width 64: two groups of 32, one per rank, so each rank reads whole
  groups of down's blocks and its run of gate/up's), at TP 2 and expert parallel.
- The four MoE families again under expert parallelism (``--expert-parallel``: each rank
  holds 4 of the 8 experts whole, computes the slots routed to them, one all-reduce sums the
  halves, Qwen2-MoE's shared expert still cut on its width; random routers, so decode steps
  leave experts of either rank without a row), and the expert block under it twice: every
  row to expert 0 (rank 0's) and none to expert 5 (rank 1's); every row to experts 0 and 1
  only, so rank 1 receives no token at all.

Tolerance (float32, as ``tests/model/test_tensor_parallel_layers.py``): logits within 2e-5
abs + 2e-5 rel of one rank's; logprobs within 1e-4 (``test_pipeline_parallel.py``); greedy
tokens identical. One rank's results are in turn transformers' (``tests/model/``).
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import Any

import pytest
import tiny_models
import torch
import torch.multiprocessing as mp
from mxfp4_fixtures import write_mxfp4_twins
from tp_ranks import run_two_ranks

from radixserve.distributed.topology import TensorParallel
from radixserve.engine.engine import Engine
from radixserve.model.attention.dense import DenseAttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.families.moe import MoEConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.layers.moe import SparseMoeBlock
from radixserve.model.loader import load_model
from radixserve.model.parallel import (
    TPGroup,
    checkpoint_slice,
    shard_for_rank,
    tcp_store,
)
from radixserve.sampling_params import SamplingParams

TIMEOUT = datetime.timedelta(seconds=60)
ATOL = RTOL = 2e-5
LOGPROB_ATOL = 1e-4
NEW_TOKENS = 6
_MOE = {"num_experts_per_tok": 2}
# name -> (model_type, transformers config overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {}),
    # Gemma's quirk configs (tiny_models.GEMMA_QUIRKS), with tied embeddings.
    **{
        name: (model_type, {**overrides, "tie_word_embeddings": True})
        for name, (model_type, overrides) in tiny_models.GEMMA_QUIRKS.items()
    },
    "phi3": (
        "phi3",
        {
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
        },
    ),
    "olmo2": ("olmo2", {}),
    # OLMo 3: OLMo 2's norms (their sums of squares all-reduced), a window of 6 on three
    # layers of four, the sliding layers' own RoPE base.
    "olmo3": (
        "olmo3",
        {
            "num_hidden_layers": 4,
            "sliding_window": 6,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50000.0},
            },
        },
    ),
    # Sandwich norms under its own names, fused gate_up cut per rank, interleaved half RoPE.
    "glm4": ("glm4", {}),
    # NoPE on every second layer, biases on the four attention projections.
    "smollm3": (
        "smollm3",
        {"num_hidden_layers": 4, "no_rope_layer_interval": 2, "attention_bias": True},
    ),
    "granite": ("granite", tiny_models.GRANITE_SCALARS),
    # Mistral 3's multimodal checkpoint (its text model's names renamed before a rank cuts
    # its share), Ministral 3's YaRN and query temperature.
    "mistral3": (
        "mistral3",
        {**tiny_models.MINISTRAL3, "text_model_type": "ministral3", "tie_word_embeddings": False},
    ),
    "glm4_moe": (
        "glm4_moe",
        {
            "num_hidden_layers": 3,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 25,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "use_qk_norm": True,
        },
    ),
    "granitemoe": (
        "granitemoe",
        {**_MOE, "num_local_experts": 8, "intermediate_size": 48, "residual_multiplier": 0.3},
    ),
    "qwen3_moe": (
        "qwen3_moe",
        {
            **_MOE,
            "num_hidden_layers": 3,
            "num_experts": 8,
            "moe_intermediate_size": 25,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    # Odd widths: each expert 25 (13 + 12 rows), the shared expert 37 (19 + 18).
    "qwen2_moe": (
        "qwen2_moe",
        {
            **tiny_models.QWEN2_MOE,
            "moe_intermediate_size": 25,
            "shared_expert_intermediate_size": 37,
        },
    ),
    "mixtral": ("mixtral", {**_MOE, "num_local_experts": 8, "intermediate_size": 48}),
    "olmoe": (
        "olmoe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "intermediate_size": 32,
            "clip_qkv": 1.5,
            "num_key_value_heads": 1,
        },
    ),
    "gpt_oss": ("gpt_oss", {**tiny_models.GPT_OSS, "num_local_experts": 8}),
}


def _seqs(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, tiny_models.TOKENIZER_VOCAB, (n,), generator=g).tolist() for n in lengths
    ]


def _run_family(path: Path, tp: TPGroup | None, expert_parallel: bool = False) -> dict[str, Any]:
    """Ragged all-row logits, then greedy decoding (the whole sequences again every step:
    the model's sharding is what is checked, not the paged backends) with each token's logprob."""
    model = load_model(path, tp=tp, expert_parallel=expert_parallel)
    if expert_parallel and tp is not None:  # each rank holds 4 of the 8 experts whole
        held = model.local_config.moe.expert_range if model.local_config.moe else None
        assert held == (4 * tp.rank, 4 * tp.rank + 4), held
    attn = DenseAttentionBackend()
    logits = model(ForwardBatch.for_full_sequences(_seqs((7, 1, 23, 12), 0), all_logits=True), attn)
    seqs = _seqs((9, 17, 3), 1)
    tokens: list[list[int]] = [[] for _ in seqs]
    logprobs: list[list[float]] = [[] for _ in seqs]
    for _ in range(NEW_TOKENS):
        last = torch.log_softmax(model(ForwardBatch.for_full_sequences(seqs), attn), dim=-1)
        for i, row in enumerate(last):
            tok = int(row.argmax())
            tokens[i].append(tok)
            logprobs[i].append(float(row[tok]))
            seqs[i] = seqs[i] + [tok]
    return {"logits": logits, "tokens": tokens, "logprobs": logprobs}


# gpt-oss with MXFP4 experts (mxfp4_fixtures.py), each expert 64 wide: one group of 32 a rank.
MXFP4 = "gpt_oss_mxfp4"
# The expert parallel runs: name -> the one-rank result they must equal.
EP_CASES = {
    f"{name}_ep": name
    for name in (
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "olmoe",
        "granitemoe",
        "glm4_moe",
        "gpt_oss",
        MXFP4,
    )
}
# Uneven expert blocks: name -> (expert parallel, the experts every row is routed to).
BLOCKS: dict[str, tuple[bool, tuple[int, ...]]] = {
    "uneven_block": (False, (0,)),
    "uneven_block_ep": (True, (0,)),
    "empty_rank_block_ep": (True, (0, 1)),
}


def _uneven_block(
    tp: TPGroup | None, expert_parallel: bool = False, favourite: tuple[int, ...] = (0,)
) -> tuple[torch.Tensor, list[int]]:
    """One expert block (8 experts, top-2, width 25) whose router sends every row to the
    ``favourite`` experts and none to expert 5 (``tests/model/test_moe.py``'s construction),
    each rank holding its rows of every expert, or with ``expert_parallel`` its 4 whole
    experts; returns its output and the experts' row counts."""
    hidden, width, experts = 64, 25, 8
    g = torch.Generator().manual_seed(5)
    router = torch.randn(experts, hidden, generator=g) * 0.2
    router[:, 0] = 0.0
    for e in favourite:
        router[e, 0] = 20.0
    router[5, 0] = -20.0
    gate_up = torch.randn(experts, 2 * width, hidden, generator=g) * 0.2
    down = torch.randn(experts, hidden, width, generator=g) * 0.2
    x = torch.randn(37, hidden, generator=g)
    x[:, 0] = x[:, 0].abs() + 0.5
    lo, hi = 0, width
    held = None
    if tp is not None and expert_parallel:
        held = (4 * tp.rank, 4 * tp.rank + 4)
    elif tp is not None:
        cfg = ModelConfig.from_dict(
            {
                "model_type": "qwen3_moe",
                "hidden_size": hidden,
                "intermediate_size": 128,
                "moe_intermediate_size": width,
                "num_experts": experts,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 1,
                "vocab_size": 512,
            }
        )
        lo, hi = shard_for_rank(cfg, tp.rank, tp.world_size).expert_intermediate
    moe = MoEConfig(experts, 2, hi - lo, True, expert_range=held)
    block = SparseMoeBlock(hidden, moe, bias=False, tp=tp)
    with torch.no_grad():
        block.gate.weight.copy_(router)
        for i, mlp in enumerate(block.experts):
            e = block.first_expert + i
            rows = torch.cat([gate_up[e, lo:hi], gate_up[e, width + lo : width + hi]])
            mlp.gate_up_proj.weight.copy_(rows)
            mlp.down_proj.weight.copy_(down[e, :, lo:hi])
        return block(x), block.expert_counts(x).tolist()


def _rank(rank: int, port: int, paths: dict[str, Path], out: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = tcp_store("127.0.0.1", port, rank, 2, TIMEOUT)
    tp = TPGroup.create(store, rank, 2, torch.device("cpu"), TIMEOUT, "127.0.0.1")
    # Tensors go as numpy arrays (pickled by value: a torch tensor would be shared through a
    # file descriptor that dies with this process).
    for name, path in paths.items():
        result = _run_family(path, tp)
        if rank == 0:
            out.put((name, {**result, "logits": result["logits"].numpy()}))
    for name, family in EP_CASES.items():
        result = _run_family(paths[family], tp, expert_parallel=True)
        if rank == 0:
            out.put((name, {**result, "logits": result["logits"].numpy()}))
    for name, (expert_parallel, favourite) in BLOCKS.items():
        block, counts = _uneven_block(tp, expert_parallel, favourite)
        if rank == 0:
            out.put((name, (block.numpy(), counts)))


# Qwen3-MoE's checkpoint re-saved in transformers 5's stacked expert layout
# (``experts.gate_up_proj [E, 2I, H]``: each rank reads its rows of gate and of up).
STACKED = "qwen3_moe_stacked"


def _save_stacked(src: Path, out: Path) -> Path:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


@pytest.fixture(scope="module")
def case_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {
        name: tiny_models.build_tiny_family(tmp_path_factory.mktemp(name), model_type, **extra)
        for name, (model_type, extra) in CASES.items()
    }
    dirs[STACKED] = _save_stacked(dirs["qwen3_moe"], tmp_path_factory.mktemp(STACKED))
    src = tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("gpt_oss_64"),
        "gpt_oss",
        **{**tiny_models.GPT_OSS, "num_local_experts": 8, "intermediate_size": 64},
    )
    root = tmp_path_factory.mktemp(MXFP4)
    dirs[MXFP4] = write_mxfp4_twins(src, root / "mxfp4", root / "twin")[0]
    return dirs


@pytest.fixture(scope="module")
def tp2_results(case_dirs: dict[str, Path]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(two ranks' results, one rank's) for every case, from one spawn of two ranks; one
    rank's are computed here while the ranks run."""
    paths = case_dirs

    def one_rank() -> dict[str, Any]:
        want: dict[str, Any] = {name: _run_family(path, None) for name, path in paths.items()}
        for name, (_, favourite) in BLOCKS.items():
            want[name] = _uneven_block(None, False, favourite)
        return want

    results = len(paths) + len(EP_CASES) + len(BLOCKS)
    pairs, want = run_two_ranks(_rank, (paths,), results, one_rank)
    return dict(pairs), want


@pytest.mark.parametrize("name", [*CASES, STACKED, MXFP4, *EP_CASES])
def test_tp2_equals_one_rank(name: str, tp2_results: tuple[dict[str, Any], dict[str, Any]]) -> None:
    got, want = tp2_results[0][name], tp2_results[1][EP_CASES.get(name, name)]
    assert want["logits"].abs().max() > 1.0
    torch.testing.assert_close(
        torch.from_numpy(got["logits"]), want["logits"], atol=ATOL, rtol=RTOL
    )
    assert got["tokens"] == want["tokens"]
    torch.testing.assert_close(
        torch.tensor(got["logprobs"]), torch.tensor(want["logprobs"]), atol=LOGPROB_ATOL, rtol=0
    )


@pytest.mark.parametrize("name", list(BLOCKS))
def test_tp2_expert_block_with_uneven_routing(
    name: str, tp2_results: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    (got, got_counts), (want, want_counts) = (r[name] for r in tp2_results)
    assert got_counts == want_counts  # the same routing on every rank
    assert want_counts[0] == 37 and want_counts[5] == 0
    if name == "empty_rank_block_ep":  # experts 4-7, rank 1's, receive no row
        assert want_counts[:2] == [37, 37] and sum(want_counts[4:]) == 0
    else:
        assert len(set(want_counts)) > 2
    torch.testing.assert_close(torch.from_numpy(got), want, atol=ATOL, rtol=RTOL)


def _engine_run(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = engine.generate(prompts, params)
    engine.check_invariants()
    return [(o.token_ids, [lp.logprob for lp in o.logprobs or []]) for o in outs]


def test_gemma3_engine_tp2_equals_one_process(
    case_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """The whole serving path at TP 2 (paged CPU attention with the window on each rank's
    heads, prefill in chunks of 16, a batch of mixed lengths, cold then warm) for Gemma 3,
    the family with the most quirks: one process's greedy tokens and logprobs. Both keep the
    window layers' KV in a window pool (no start-up warning); at TP 2 every rank's window map
    equals rank 0's after each round (the audit in ``check_invariants``). The pool under
    pressure, step by step: ``test_window_pool_tp.py``."""
    caplog.set_level(logging.WARNING, logger="radixserve.engine.window_setup")
    path = case_dirs["gemma3"]
    base = _seqs((20,), 2)[0]
    prompts = [base + t for t in _seqs((3, 17, 9), 3)] + _seqs((1,), 4)
    config = {"page_size": 4, "num_pages": 96, "max_num_tokens": 16}
    single = Engine(str(path), **config)  # type: ignore[arg-type]
    try:
        single_window_layers = single.pool.window_layers
        assert single_window_layers  # the window pool, prompts longer than the window
        want = [_engine_run(single, prompts) for _ in ("cold", "warm")]
    finally:
        single.close()
    engine = Engine(str(path), tensor_parallel_size=2, dist_timeout=30.0, **config)  # type: ignore[arg-type]
    try:
        assert isinstance(engine.topology, TensorParallel)
        assert engine.pool.window_layers == single_window_layers
        assert not [r for r in caplog.records if "no window pool" in r.getMessage()]
        for rnd, expected in zip(("cold", "warm"), want, strict=True):
            for (ids, lps), (want_ids, want_lps) in zip(
                _engine_run(engine, prompts), expected, strict=True
            ):
                assert ids == want_ids, rnd
                assert lps == pytest.approx(want_lps, abs=LOGPROB_ATOL), rnd
        assert engine.stats().cached_prompt_tokens_total >= 3 * 20  # the warm round hit
    finally:
        engine.close()
    for proc in engine.topology.ranks.procs.values():
        assert not proc.is_alive()


def test_planned_weight_bytes_are_rank_zeros_shard(case_dirs: dict[str, Path]) -> None:
    """``radixserve memory --tp 2``'s weight bytes per device (the planner's formula) are rank
    0's shard as built, for every family (Gemma's four norms a layer, q/k norms per head or
    over the rank's slice of the projection, fused tensors, experts cut on their width)."""
    from radixserve.memory.footprint import weight_bytes
    from radixserve.memory.sharding import DeviceShard
    from radixserve.model.llama import LlamaForCausalLM

    for name in CASES:
        path = case_dirs[name]
        cfg = ModelConfig.from_pretrained(path)
        with torch.device("meta"):  # the tie is made at load: count the head once
            rank0 = LlamaForCausalLM(cfg, TPGroup(None, 0, 2, torch.device("cpu")))
        held = sum(
            p.numel()
            for n, p in rank0.named_parameters()
            if not (cfg.tie_word_embeddings and n == "lm_head.weight")
        )
        planned = weight_bytes(cfg, torch.float32, shard=DeviceShard(tp_size=2))
        assert abs(planned - 4 * held) <= 3, name  # the MoE layers' mean, rounded


def test_checkpoint_slices_of_the_new_layouts() -> None:
    """Phi-3's fused tensors, experts (per expert, Mixtral's names, stacked) and whole-projection
    q/k norms: what rank 1 of 2 reads of each."""
    base = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "vocab_size": 512,
    }
    phi = shard_for_rank(ModelConfig.from_dict({**base, "model_type": "phi3"}), 1, 2)
    qkv = checkpoint_slice("model.layers.0.self_attn.qkv_proj.weight", phi, 16)
    # q rows 32-63 of 64, then k rows 16-31 and v rows 16-31 of 32 each (after q's 64).
    assert qkv is not None and qkv.ranges == ((32, 64), (80, 96), (112, 128))
    gate_up = checkpoint_slice("model.layers.0.mlp.gate_up_proj.weight", phi, 16)
    assert gate_up is not None and gate_up.ranges == ((64, 128), (192, 256))
    moe = ModelConfig.from_dict(
        {
            **base,
            "model_type": "olmoe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "num_key_value_heads": 1,
        }
    )
    one, two = (shard_for_rank(moe, r, 2) for r in range(2))
    assert one.kv_owner and not two.kv_owner  # the shared KV head's k lanes count once
    assert two.local_config(moe).qk_norm_tp == (64, 16, False)
    assert two.local_config(moe).moe == MoEConfig(4, 2, 64, False)
    cuts = {
        n: checkpoint_slice(f"model.layers.0.{n}", two, 16)
        for n in (
            "mlp.experts.3.gate_proj.weight",
            "block_sparse_moe.experts.3.w2.weight",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
            "mlp.gate.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
        )
    }
    assert [c and (c.dim, c.ranges) for c in cuts.values()] == [
        (0, ((64, 128),)),
        (1, ((64, 128),)),
        (1, ((64, 128), (192, 256))),
        (2, ((64, 128),)),
        None,  # the router: whole on every rank
        (0, ((32, 64),)),
        (0, ((0, 16),)),  # the replicated KV head's norm weights
    ]
    # Qwen2-MoE's shared expert: cut on its own width (37: rank 1 holds rows 19-36), in
    # either expert layout; its gate whole.
    qwen2_moe = ModelConfig.from_dict(
        {
            **base,
            "model_type": "qwen2_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 37,
        }
    )
    for expert_parallel in (False, True):
        shard = shard_for_rank(qwen2_moe, 1, 2, expert_parallel)
        assert shard.local_config(qwen2_moe).moe.shared_expert_size == 18  # type: ignore[union-attr]
        shared = {
            n: checkpoint_slice(f"model.layers.0.mlp.{n}", shard, 16)
            for n in (
                "shared_expert.gate_proj.weight",
                "shared_expert.up_proj.weight",
                "shared_expert.down_proj.weight",
                "shared_expert_gate.weight",
            )
        }
        assert [c and (c.dim, c.ranges) for c in shared.values()] == [
            (0, ((19, 37),)),
            (0, ((19, 37),)),
            (1, ((19, 37),)),
            None,
        ]
    qwen3 = shard_for_rank(ModelConfig.from_dict({**base, "model_type": "qwen3"}), 1, 2)
    assert checkpoint_slice("model.layers.0.self_attn.q_norm.weight", qwen3, 16) is None
