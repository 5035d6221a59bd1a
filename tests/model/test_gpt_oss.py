"""gpt-oss beyond the family comparison (``test_families_vs_hf.py`` runs it against
transformers with sinks, windows, biases and the clamped SwiGLU biting): MXFP4 experts
decoded at load, the released config parsed, the expert activation's clamp, what a
tensor-parallel rank reads of the released layout, and a backend without sinks refused by
name (tensor parallelism against one rank: ``tests/distributed/test_tp_families.py``).

MXFP4: the decoding equals transformers' ``convert_moe_packed_tensors`` bit for bit (random
codes and scales, float32 and bf16), and a checkpoint whose experts are MXFP4 loads to the
same logits, exactly, as its decoded twin (``mxfp4_fixtures.py``), which itself matches
transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_models
import torch
from mxfp4_fixtures import quantize_mxfp4, write_mxfp4_twins

from radixserve.model.attention.dense import DenseAttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.layers.mlp import clamped_swiglu
from radixserve.model.loader import load_model
from radixserve.model.quant.mxfp4 import dequantize_mxfp4


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", **tiny_models.GPT_OSS
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_decoding_equals_transformers(dtype: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 24, 4), dtype=torch.uint8, generator=g)  # every exponent
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    got = dequantize_mxfp4(blocks, scales, dtype)  # [E, out, in]: a linear's layout
    assert got.dtype == dtype and torch.equal(got.transpose(1, 2), want)
    # Decoded a few rows at a time: the same values.
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype, rows_per_chunk=5), got)


def test_fixture_quantizer_round_trips() -> None:
    """The tests' quantizer: each value within half a step of e2m1 at its group's scale."""
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    back = dequantize_mxfp4(*quantize_mxfp4(w), torch.float32)
    # The widest e2m1 gap (4 -> 6) at a scale of up to twice amax / 6.
    step = w.view(4, 2, 32).abs().amax(-1, keepdim=True) / 6 * 2 * 2
    assert ((back - w).view(4, 2, 32).abs() <= step / 2 + 1e-6).all()
    assert (back - w).abs().max() > 0  # it did quantize


def test_mxfp4_checkpoint_loads_to_its_decoded_twin(gpt_oss_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    mx, twin = write_mxfp4_twins(gpt_oss_dir, tmp_path / "mxfp4", tmp_path / "twin")
    seqs = [[5, 9, 33, 2, 17, 40, 8, 11, 3], [7, 100, 4]]
    batch = ForwardBatch.for_full_sequences(seqs, all_logits=True)
    ours = load_model(mx)(batch, DenseAttentionBackend())
    twin_logits = load_model(twin)(batch, DenseAttentionBackend())
    assert torch.equal(ours, twin_logits)
    hf = AutoModelForCausalLM.from_pretrained(str(twin), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # bf16: decoded straight to the serving dtype, as the bf16 twin's weights.
    bf16 = load_model(mx, dtype=torch.bfloat16)
    expert = bf16.model.layers[0].mlp.experts[1]
    assert expert.down_proj.weight.dtype == torch.bfloat16
    twin_bf16 = load_model(twin, dtype=torch.bfloat16).model.layers[0].mlp.experts[1]
    assert torch.equal(expert.gate_up_proj.weight, twin_bf16.gate_up_proj.weight)


# gpt-oss-20b's config.json as published (openai/gpt-oss-20b), its layer_types elided to
# the rule they follow.
_GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}


def test_gpt_oss_20b_config_parses(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_GPT_OSS_20B))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads) == (24, 2880, 64, 8)
    assert (cfg.head_dim, cfg.vocab_size, cfg.intermediate_size) == (64, 201088, 2880)
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.attn_sinks
    assert cfg.layer_window(0) == 128 and cfg.layer_window(1) is None
    assert cfg.rope_theta == 150000.0
    rope = cfg.rope_scaling
    assert rope is not None and rope.rope_type == "yarn" and rope.factor == 32.0
    assert rope.original_max_position_embeddings == 4096 and not rope.truncate
    moe = cfg.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (32, 4, 2880)
    assert moe.router_bias and moe.expert_bias and moe.norm_topk_prob
    assert (moe.act, moe.swiglu_limit, moe.swiglu_alpha) == ("swiglu_clamped", 7.0, 1.702)
    assert not cfg.stack_shaped  # experts and sinks: the per-layer path
    # OpenAI's model card: 20.91B parameters, 3.61B active (the embedding not counted active).
    assert round(cfg.num_params / 1e7) == 2091
    assert round((cfg.num_active_params - cfg.vocab_size * cfg.hidden_size) / 1e7) == 361


def test_config_without_rope_is_transformers_default(tmp_path: Path) -> None:
    """No RoPE keys at all: transformers' GptOssConfig's YaRN (x32 over 4096, truncate
    false, base 150000), and its alternating windows from layer 0."""
    raw = {k: v for k, v in _GPT_OSS_20B.items() if k not in ("rope_scaling", "rope_theta")}
    del raw["layer_types"]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_theta == 150000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 32.0
    assert not cfg.rope_scaling.truncate
    assert [cfg.layer_window(i) for i in range(3)] == [128, None, 128]


def test_param_count_equals_transformers(gpt_oss_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(gpt_oss_dir), dtype=torch.float32)
    assert ModelConfig.from_pretrained(gpt_oss_dir).num_params == sum(
        p.numel() for p in hf.parameters()
    )


def test_clamped_swiglu_matches_transformers_experts() -> None:
    """The activation against transformers' own (``GptOssExperts._apply_gate`` on the
    interleaved gate/up), with values past the limit on both sides."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=16, swiglu_limit=1.5))
    gate_up = torch.randn(5, 32, generator=torch.Generator().manual_seed(2)) * 4
    want = experts._apply_gate(gate_up)
    got = clamped_swiglu(gate_up[:, 0::2], gate_up[:, 1::2], 1.702, 1.5)
    assert torch.equal(got, want)
    assert (gate_up.abs() > 1.5).any()


def test_backend_without_sinks_is_refused_by_name(gpt_oss_dir: Path) -> None:
    """A backend that does not apply sinks is refused at start-up, never run without them
    (every backend here applies them: the Triton kernels' are in
    ``tests/kernels/test_kernel_sinks.py``)."""
    from radixserve.engine.model_runner import check_backend_serves
    from radixserve.model.attention.base import AttentionBackend

    class NoSinks(DenseAttentionBackend):  # any backend without supports_sinks
        supports_sinks = False

    model = load_model(gpt_oss_dir)
    with pytest.raises(ValueError, match="gpt_oss has attention sinks.*NoSinks"):
        check_backend_serves(model, NoSinks())
    check_backend_serves(model, DenseAttentionBackend())
    pytest.importorskip("triton")
    from radixserve.model.attention.triton_paged import TritonPagedAttentionBackend

    assert TritonPagedAttentionBackend.supports_sinks
    assert not AttentionBackend.supports_sinks  # a new backend must say it applies them


def test_tensor_parallel_slices_of_the_released_layout(tmp_path: Path) -> None:
    """What a rank reads of gpt-oss-20b's tensors: its heads' sinks, its rows of the
    interleaved gate/up (one run) and of down, the MXFP4 blocks in whole groups of 32 (at
    TP 4: 23, 23, 22, 22 groups of the 90), the router whole, the down bias on rank 0; under
    expert parallelism its experts whole; a cut inside an MXFP4 group refused by name."""
    from radixserve.model.parallel import checkpoint_slice, shard_for_rank

    cfg = ModelConfig.from_dict(_GPT_OSS_20B)

    def cut(name: str, rank: int, tp: int, ep: bool = False) -> object:
        c = checkpoint_slice(f"model.layers.0.{name}", shard_for_rank(cfg, rank, tp, ep), 64)
        return c and (c.dim, c.ranges, c.zero)

    assert cut("self_attn.sinks", 1, 2) == (0, ((32, 64),), False)
    assert cut("mlp.experts.gate_up_proj_blocks", 1, 2) == (1, ((2880, 5760),), False)
    assert cut("mlp.experts.gate_up_proj_scales", 1, 2) == (1, ((2880, 5760),), False)
    assert cut("mlp.experts.gate_up_proj", 1, 2) == (2, ((2880, 5760),), False)  # bf16 [E, H, 2I]
    assert cut("mlp.experts.gate_up_proj_bias", 1, 2) == (1, ((2880, 5760),), False)
    assert cut("mlp.experts.down_proj", 1, 2) == (1, ((1440, 2880),), False)
    assert cut("mlp.experts.down_proj_blocks", 1, 2) == (2, ((45, 90),), False)
    assert cut("mlp.experts.down_proj_bias", 0, 2) is None
    assert cut("mlp.experts.down_proj_bias", 1, 2) == (0, ((0, 0),), True)
    assert cut("mlp.router.weight", 1, 2) is None and cut("mlp.router.bias", 1, 2) is None
    assert [cut("mlp.experts.down_proj_blocks", r, 4) for r in range(4)] == [
        (2, ((0, 23),), False),
        (2, ((23, 46),), False),
        (2, ((46, 68),), False),
        (2, ((68, 90),), False),
    ]
    assert cut("mlp.experts.down_proj_bias", 1, 4, ep=True) == (0, ((8, 16),), False)
    narrow = ModelConfig.from_dict({**_GPT_OSS_20B, "intermediate_size": 48})  # 24 + 24 rows
    with pytest.raises(ValueError, match="inside MXFP4 groups of 32"):
        checkpoint_slice(
            "model.layers.0.mlp.experts.down_proj_blocks", shard_for_rank(narrow, 1, 2), 64
        )


def test_released_expert_layout_lands_in_the_experts_shapes() -> None:
    """gpt-oss-20b's expert tensors as the released checkpoint shapes them (two experts of
    its width 2880, MXFP4) become per-expert tensors of the MoE block's shapes (a linear's
    ``[out, in]``: gate and up ``[2880, 2880]`` each, down ``[2880, 2880]``, biases), with
    each layer's blocks paired to its scales whichever comes first."""
    from radixserve.model.layers.gpt_oss_experts import gpt_oss_expert_tensors

    e, h, i = 2, 2880, 2880
    p = "model.layers.3.mlp."
    u8 = torch.uint8
    weights = [
        (p + "experts.gate_up_proj_scales", torch.full((e, 2 * i, h // 32), 127, dtype=u8)),
        (p + "experts.gate_up_proj_blocks", torch.zeros(e, 2 * i, h // 32, 16, dtype=u8)),
        (p + "experts.gate_up_proj_bias", torch.zeros(e, 2 * i)),
        (p + "experts.down_proj_blocks", torch.zeros(e, h, i // 32, 16, dtype=u8)),
        (p + "experts.down_proj_scales", torch.full((e, h, i // 32), 127, dtype=u8)),
        (p + "experts.down_proj_bias", torch.zeros(e, h)),
        (p + "router.weight", torch.zeros(32, h)),
        (p + "router.bias", torch.zeros(32)),
    ]
    shapes = {n: tuple(t.shape) for n, t in gpt_oss_expert_tensors(weights, torch.bfloat16)}
    assert shapes == {
        **{
            f"{p}experts.{x}.{proj}.{kind}": (i, h) if kind == "weight" else (i,)
            for x in range(e)
            for proj in ("gate_proj", "up_proj")
            for kind in ("weight", "bias")
        },
        **{f"{p}experts.{x}.down_proj.weight": (h, i) for x in range(e)},
        **{f"{p}experts.{x}.down_proj.bias": (h,) for x in range(e)},
        p + "gate.weight": (32, h),
        p + "gate.bias": (32,),
    }
