"""Builders for tiny random checkpoints the tests create themselves (no network).

Each builder writes a complete Hugging Face directory: ``config.json``, ``model.safetensors``
(saved by transformers' own model class from a fixed-seed random init), and a small
byte-level BPE tokenizer with a ChatML chat template, so every layer of radixserve (config,
loader, model, tokenizer, chat template, engine) can run against it in milliseconds.

Token ids of the special tokens match SmolLM2's: ``<|endoftext|>`` = 0,
``<|im_start|>`` = 1, ``<|im_end|>`` = 2 (the eos).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN_ID = 2
TOKENIZER_VOCAB = 512

# A Gemma-3-shaped sliding-window checkpoint (build_tiny_family "gemma3_text"): two sliding
# layers (window 8) and one global, soft-caps and two RoPE bases, for the window pool's tests.
GEMMA3_SWA: dict[str, object] = {
    "num_hidden_layers": 3,
    "sliding_window": 8,
    "sliding_window_pattern": 3,  # sliding, sliding, global
    "query_pre_attn_scalar": 24,
    "final_logit_softcapping": 2.0,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
}

# Gemma 2 and 3 with every quirk biting (build_tiny_family; tests/model/test_gemma_vs_hf.py
# says how): a window far shorter than the prompts, soft-caps that bite,
# query_pre_attn_scalar 24 (head_dim 16), Gemma 3's two RoPE bases (local 100; global 1e6 with
# linear x4) and its sliding_window_pattern 2, so both layer kinds recur.
# name -> (model_type, transformers config overrides)
GEMMA_WINDOW = 6
_GEMMA: dict[str, object] = {
    "num_hidden_layers": 3,
    "sliding_window": GEMMA_WINDOW,
    "query_pre_attn_scalar": 24,
    "final_logit_softcapping": 2.0,
}
_GEMMA3: dict[str, object] = {
    **_GEMMA,
    "sliding_window_pattern": 2,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
}
GEMMA_QUIRKS: dict[str, tuple[str, dict[str, object]]] = {
    "gemma2": ("gemma2", {**_GEMMA, "attn_logit_softcapping": 1.0}),
    "gemma3": ("gemma3_text", _GEMMA3),
    # The multimodal checkpoint (Gemma3ForConditionalGeneration, build_tiny_family "gemma3":
    # the same text model under text_config, a tiny vision tower beside it). Its final cap is
    # in the config but transformers' conditional model does not apply it (nor does radixserve).
    "gemma3_multimodal": ("gemma3", _GEMMA3),
}
# The vision tower of the tiny multimodal Gemma 3 (SigLIP: 28x28 images, 4 patches, pooled
# to mm_tokens_per_image 4); radixserve never reads it.
GEMMA3_VISION: dict[str, object] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}
# Mistral 3's Pixtral vision tower, as small (never read by radixserve, run by transformers
# only for images).
PIXTRAL_VISION: dict[str, object] = {
    "model_type": "pixtral",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "head_dim": 16,
    "image_size": 32,
    "patch_size": 8,
}
# The multimodal model types: their vision tower and what else their top level sets.
_MULTIMODAL: dict[str, dict[str, object]] = {
    "gemma3": {"vision_config": GEMMA3_VISION, "mm_tokens_per_image": 4},
    "mistral3": {"vision_config": PIXTRAL_VISION, "image_token_index": 10},
}
# What a multimodal config says at its top level (the rest goes under text_config).
_TOP_LEVEL = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")

# Qwen2-MoE with its quirks biting (build_tiny_family "qwen2_moe"): 8 experts of width 32,
# top-2 not renormalised, a shared expert of width 96 under its sigmoid gate, layer 1 dense
# (mlp_only_layers), q/k/v bias (made non-zero by build_tiny_family).
# Ministral 3: YaRN with mscale = mscale_all_dim (attention factor 1) from an original
# context of 16, and the query temperature past it (beta 0.5: a query at position 48 is
# scaled by 1.69).
MINISTRAL3: dict[str, object] = {
    "max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.5,
    },
}

# Granite's four scalars far from 1 (the embeddings', the scores' scale, the blocks'
# outputs' and the logits' divisor): every one bites.
GRANITE_SCALARS: dict[str, object] = {
    "embedding_multiplier": 4.0,
    "attention_multiplier": 0.05,
    "residual_multiplier": 0.3,
    "logits_scaling": 2.5,
}
QWEN2_MOE: dict[str, object] = {
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 96,
    "norm_topk_prob": False,
    "mlp_only_layers": [1],
}

# gpt-oss with every quirk biting (build_tiny_family "gpt_oss"): a window of 4 on layers 0
# and 2 (layer 1 full), far shorter than the prompts; 4 experts of width 32, top-2; the
# SwiGLU's clamp at 1.0 (7.0 in the released models: too far for tiny random weights to
# reach); sinks drawn with a spread of 1 (build_tiny_family), the expert and router biases
# non-zero; RoPE as the released configs: YaRN x32 over 4096, truncate false.
GPT_OSS: dict[str, object] = {
    "num_hidden_layers": 3,
    "sliding_window": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 32,
    "swiglu_limit": 1.0,
    "max_position_embeddings": 131072,
}

# The same ChatML template SmolLM2 ships (without its default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Short built-in training text: enough merges for a ~512-entry vocabulary.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A radix tree over token ids indexes the pages
of a paged KV cache, so a prefix that many requests share is computed once and reused.
You are a helpful assistant. What is the capital of France? The capital of France is Paris.
Hello, world! How are you today? I am fine, thank you. Let us count: one two three four five
six seven eight nine ten eleven twelve. Numbers 0123456789 and symbols: + - * / = < > ( ) [ ].
Prefix caching, continuous batching, paged attention, eviction, least recently used pages.
The scheduler batches prefill and decode steps; the model computes logits for each sequence.
Once upon a time there was a little model that wanted to generate text quickly and correctly.
def main(): print("hello") # code is text too; return 0 if ok else 1
Ünïcödé characters, emojis 🙂 and multi-byte sequences like 日本語 must round-trip as bytes.
"""


def build_tokenizer(out_dir: str | Path, vocab_size: int = TOKENIZER_VOCAB):
    """Train a byte-level BPE tokenizer on the built-in text and save it to ``out_dir``.

    Returns the ``PreTrainedTokenizerFast`` (ChatML template, eos ``<|im_end|>``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def _save_model(model, out_dir: Path) -> None:
    model.save_pretrained(str(out_dir), safe_serialization=True)


def build_tiny_llama(
    out_dir: str | Path,
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = TOKENIZER_VOCAB,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """A random Llama checkpoint (GQA by default: 4 query heads over 2 KV heads).

    ``head_dim`` is independent of ``hidden_size`` (as in Llama's config), so kernels can be
    tested with a realistic ``head_dim=64`` on an otherwise tiny model.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rope: dict = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_q_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        rope_parameters=rope,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    _randomize_norms(model, seed)
    _save_model(model, out)
    build_tokenizer(out)
    return out


def build_tiny_reasoner(out_dir: str | Path) -> Path:
    """The tiny Llama with ``<think>`` and ``</think>`` as single tokens (ids 512 and 513, in a
    vocabulary of 516), as reasoning models' tokenizers have them."""
    from transformers import AutoTokenizer

    out = build_tiny_llama(out_dir, vocab_size=TOKENIZER_VOCAB + 4)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(str(out))
    return out


def build_tiny_qwen2(
    out_dir: str | Path,
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = TOKENIZER_VOCAB,
    tie_word_embeddings: bool = True,
    seed: int = 1,
) -> Path:
    """A random Qwen2 checkpoint: q/k/v projections with bias, GQA, tied embeddings."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_q_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    # transformers zero-initialises biases; random ones make the bias path observable.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.2)
    _randomize_norms(model, seed)
    _save_model(model, out)
    build_tokenizer(out)
    return out


def build_tiny_mqa(out_dir: str | Path, *, head_dim: int = 16, seed: int = 2) -> Path:
    """A random Llama checkpoint with multi-query attention (4 query heads, 1 KV head), 3 layers."""
    return build_tiny_llama(
        out_dir,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        num_layers=3,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        seed=seed,
    )


def _randomize_norms(model, seed: int) -> None:
    """RMSNorm weights init to 1; perturb them so a wrong norm placement shows in logits."""
    import torch

    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))


def build_tiny_family(
    out_dir: str | Path,
    model_type: str,
    *,
    seed: int = 3,
    tokenizer: bool = False,
    classifier: bool = False,
    **overrides: object,
) -> Path:
    """A random checkpoint of any family transformers knows by ``model_type`` (its own config
    and model class), tiny and GQA like :func:`build_tiny_llama`; ``overrides`` set the
    family's quirks (``rope_parameters``, ``partial_rotary_factor``, ``sliding_window``...).
    Every norm weight (q/k norms included) is perturbed, every bias (a router's correction
    bias and gpt-oss's expert biases too) and attention sink made non-zero.

    ``model_type`` ``gemma3`` is the multimodal ``Gemma3ForConditionalGeneration``, ``mistral3``
    ``Mistral3ForConditionalGeneration`` (its text model's type the override
    ``text_model_type``): the text model's keys go under ``text_config`` (the token ids and
    the tie at the top level too), with a tiny vision tower (:data:`_MULTIMODAL`).

    ``classifier``: the family's ``*ForSequenceClassification`` (its ``score`` head in place
    of the LM head; ``num_labels`` / ``id2label`` among the overrides)."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, object] = {
        "vocab_size": TOKENIZER_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": EOS_TOKEN_ID,
    }
    kwargs.update(overrides)
    model_class: Any = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    if model_type in _MULTIMODAL:
        top = {k: kwargs.pop(k) for k in _TOP_LEVEL if k in kwargs}
        text_type = kwargs.pop("text_model_type", None)
        cfg = AutoConfig.for_model(
            model_type,
            text_config={**kwargs, **top, **({"model_type": text_type} if text_type else {})},
            initializer_range=kwargs["initializer_range"],
            **_MULTIMODAL[model_type],
            **top,
        )
        if model_type == "mistral3":
            model_class = AutoModelForImageTextToText
    else:
        cfg = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = model_class.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", "_bias")):  # gpt-oss's experts: gate_up_proj_bias ...
                p.normal_(0.0, 0.2)
            elif name.endswith(".sinks"):  # gpt-oss's attention sinks, large enough to bite
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():  # sigmoid routing's correction (GLM-4.5)
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    _randomize_norms(model, seed)
    _save_model(model, out)
    if tokenizer:
        build_tokenizer(out)
    return out


def build_lora_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    targets: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    rank: int = 4,
    alpha: float = 8.0,
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """A random LoRA adapter of the checkpoint at ``base_dir``, saved by PEFT itself
    (``adapter_config.json`` and ``adapter_model.safetensors``). PEFT starts B at zero (an
    adapter that changes nothing); here both matrices are random, large enough that the
    adapted model's greedy tokens differ from the base's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=use_rslora,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    peft_model.save_pretrained(str(out))
    return out
