"""Gemma 2 and Gemma 3 (text) against transformers' own implementation, on tiny random
checkpoints (``families.GEMMAS``) saved by transformers' config and model classes with every
quirk biting:

- a sliding window (6) far shorter than the prompts (up to 40 tokens), interleaved with
  global layers (Gemma 3 with ``sliding_window_pattern`` 2 here, so both kinds recur);
- soft-caps that bite: Gemma 2's attention cap 1.0 (scores reach ~4) and final cap 2.0 on
  both (logits reach ~2, the cap's tanh is far from linear there);
- ``query_pre_attn_scalar`` 24 (not ``head_dim`` 16), ``1 + weight`` norms with perturbed
  weights, the sqrt(hidden) embedding scale, GELU-tanh MLP;
- Gemma 3's per-head q/k norms and its two RoPE bases: local 100 on the sliding layers,
  global 1e6 with ``linear`` x4 scaling on the full ones;
- Gemma 3's multimodal checkpoint (``model_type`` ``gemma3``, ``Gemma3ForConditionalGeneration``
  with a tiny vision tower, the text model's weights under ``language_model.model.``, the
  untied head under ``language_model.lm_head``): radixserve serves its text model, compared
  with transformers' conditional-generation model itself on text-only input ids (its text
  path: no final soft-cap whatever the text config says, which radixserve follows); also
  loaded from transformers' in-memory names (``model.language_model.``) and from a released
  checkpoint's sparse ``text_config``.

Tolerance (float32): logits |ours - hf| <= 1e-4 + 1e-4 |hf| (measured ~7e-6 on logits up to
~2); per-token logprobs within 1e-4; greedy tokens identical. The engine runs are cold, then
warm (the prompts' cached prefixes reused), with prefill in chunks of at most 16 tokens and a
batch of mixed lengths, on the CPU's paged attention, the layers in the one-call native stack.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models
import torch
from families import GEMMAS
from tiny_models import GEMMA_WINDOW as WINDOW

from radixserve.engine.engine import Engine
from radixserve.model.attention.dense import DenseAttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.loader import load_model
from radixserve.sampling_params import SamplingParams

ATOL = RTOL = 1e-4
LOGPROB_ATOL = 1e-4
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(GEMMAS))
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides, _ = GEMMAS[request.param]
    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp(request.param), model_type, tokenizer=True, **overrides
    )


def _hf(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _seqs(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, tiny_models.TOKENIZER_VOCAB, (n,), generator=g).tolist() for n in lengths
    ]


def test_config_reads_the_quirks(gemma: Path) -> None:
    model = load_model(gemma)
    cfg = model.config
    assert model.native_stack_reason is None  # the one-call CPU stack runs every quirk
    kinds = cfg.layer_types
    assert kinds is not None and set(kinds) == {"sliding_attention", "full_attention"}
    assert [cfg.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert cfg.sm_scale == 24**-0.5 and not cfg.llama_shaped
    # The conditional-generation model applies no final cap (transformers), the others 2.0.
    assert cfg.final_softcap == (None if cfg.model_type == "gemma3" else 2.0)
    if cfg.model_type in ("gemma3_text", "gemma3"):
        assert (cfg.local_rope_theta, cfg.rope_theta, cfg.qk_norm) == (100.0, 1e6, "head")
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 4.0
    else:
        assert cfg.attn_softcap == 1.0


def test_ragged_logits_match_transformers(gemma: Path) -> None:
    model = load_model(gemma)
    seqs = _seqs((7, 1, 23, 12), seed=0)
    ours = model(ForwardBatch.for_full_sequences(seqs, all_logits=True), DenseAttentionBackend())
    hf = _hf(gemma)
    # `radixserve memory`'s parameter count (the config's arithmetic) is transformers' own
    # (the text model's, without a multimodal checkpoint's vision tower and projector).
    text = [p for n, p in hf.named_parameters() if "vision" not in n and "multi_modal" not in n]
    assert len(text) < len(list(hf.parameters())) or model.config.model_type != "gemma3"
    assert model.config.num_params == sum(p.numel() for p in text)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    if model.config.final_softcap is not None:
        assert 1.5 < ref.abs().max() < 2.0  # the final cap (2.0) bites
    else:  # the multimodal model's logits, uncapped, go past the cap its config names
        assert ref.abs().max() > 2.0
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def test_engine_greedy_and_logprobs_cold_and_warm(gemma: Path) -> None:
    """Greedy continuations and their logprobs equal transformers' (teacher-forced on the
    continuation: identical argmax at every step is identical greedy decoding)."""
    base = _seqs((20,), seed=1)[0]
    tails = _seqs((3, 17, 1, 9), seed=2)
    prompts = [base + tails[0], base[:11] + tails[1], tails[2], base + tails[3], _seqs((40,), 3)[0]]
    hf = _hf(gemma)
    engine = Engine(str(gemma), page_size=4, num_pages=256, max_num_tokens=16)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
        for rnd in ("cold", "warm"):
            outs = engine.generate(prompts, params)
            engine.check_invariants()
            for prompt, out in zip(prompts, outs):
                seq = prompt + out.token_ids
                with torch.no_grad():
                    ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
                rows = ref[len(prompt) - 1 : len(seq) - 1]
                assert out.token_ids == rows.argmax(-1).tolist(), rnd
                assert out.logprobs is not None
                got = torch.tensor([lp.logprob for lp in out.logprobs])
                want = rows.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
                torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
            if rnd == "warm":
                # Every prompt but the 1-token one reused its cached whole pages.
                cached = [o.usage.cached_tokens for o in outs]
                assert cached == [(len(p) - 1) // 4 * 4 for p in prompts]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides, _ = GEMMAS["gemma3_multimodal"]
    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("gemma3_mm"), model_type, **overrides
    )


def test_multimodal_names_and_vision_tower_skipped(gemma3_multimodal: Path, tmp_path: Path) -> None:
    """The checkpoint as transformers 5 holds it in memory (``model.language_model.``,
    ``model.vision_tower.``, ``lm_head``) loads to bit-identical logits; the vision tower's
    and projector's tensors are never read (``iter_safetensors`` yields none of them)."""
    from safetensors.torch import save_file

    from radixserve.model.loader import checkpoint_names, iter_safetensors

    hf = _hf(gemma3_multimodal)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in state
    assert any(k.startswith("model.vision_tower.") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((gemma3_multimodal / "config.json").read_text())
    cfg = ModelConfig.from_pretrained(tmp_path)
    for path in (gemma3_multimodal, tmp_path):
        names = [n for n, _ in iter_safetensors(path, rename=checkpoint_names(cfg))]
        assert names and all(
            n.startswith(("model.layers.", "model.embed", "model.norm", "lm_head")) for n in names
        )
    seqs = _seqs((7, 1, 23), seed=4)
    batch = ForwardBatch.for_full_sequences(seqs, all_logits=True)
    want = load_model(gemma3_multimodal)(batch, DenseAttentionBackend())
    got = load_model(tmp_path)(
        ForwardBatch.for_full_sequences(seqs, all_logits=True), DenseAttentionBackend()
    )
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_released_multimodal_config_reads_text_defaults() -> None:
    """A released multimodal config (Gemma 3 4B's shape) writes its ``text_config`` sparsely,
    relying on transformers' ``Gemma3TextConfig`` defaults: the parse fills them in, and the
    top level's eos, dtype and tie apply."""
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
    }
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.model_type, cfg.architecture) == ("gemma3", "Gemma3ForConditionalGeneration")
    assert (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262_208)
    assert cfg.sm_scale == 256**-0.5 and cfg.tie_word_embeddings and cfg.final_softcap is None
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 10000.0)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert cfg.eos_token_ids == (1, 106) and cfg.torch_dtype == torch.bfloat16
    assert cfg.layer_types is not None and cfg.layer_types[:6] == (
        *("sliding_attention",) * 5,
        "full_attention",
    )
    assert cfg.layer_window(0) == 1024 and cfg.layer_window(5) is None
