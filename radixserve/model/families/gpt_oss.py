"""gpt-oss (``gpt_oss``: gpt-oss-20b, gpt-oss-120b): a pre-norm mixture-of-experts model
with four quirks over its kin:

- attention sinks: a learned logit per query head (``self_attn.sinks``) that joins each
  row's softmax denominator and is then dropped (``ModelConfig.attn_sinks``; the attention
  backends apply it, ``model/attention/``);
- a window of ``sliding_window`` (128) on alternating layers (``layer_types``; by default the
  even-numbered layers slide, as transformers derives it), one RoPE for all of them;
- biases on q/k/v/o (``attention_bias``), on the router's logits and on every expert's
  projections; routing is the softmax over the top-k logits, which is the renormalised top-k
  of the softmax over all of them (``norm_topk_prob``);
- the experts' clamped SwiGLU (``swiglu_limit`` 7, alpha 1.702) and their checkpoint layout
  (``MoEConfig.checkpoint_layout`` "gpt_oss": fused, transposed, gate and up interleaved,
  MXFP4 blocks in the released checkpoints, dequantized at load).

RoPE is YaRN (factor 32 over an original 4096, ``truncate`` false): transformers' config
assumes exactly that where a config.json says nothing about RoPE, base 150000.

Runs the per-layer path on the CPU (experts, sinks); every attention backend applies the
sinks (the CPU kernel, the torch paths, the Triton kernels). On CUDA the biased experts take
the MoE block's grouped torch path, not the fused Triton MoE kernel. Under tensor
parallelism each rank takes its heads' sinks and its rows of every expert (in whole MXFP4
groups of 32 where the width allows), or with ``--expert-parallel`` its experts whole
(``model/tp_shard.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from radixserve.model.families.base import Family
from radixserve.model.families.moe import moe_config

# transformers' GptOssConfig where a config.json names no RoPE at all.
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_DEFAULT_THETA = 150_000.0


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", True))
    n = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window", 128)
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    moe = replace(
        moe_config(raw, experts_default=128, top_k_default=4, norm_topk_prob=True),
        router_bias=True,
        expert_bias=True,
        act="swiglu_clamped",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        checkpoint_layout="gpt_oss",
    )
    out: dict[str, Any] = {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "sliding_window": window,
        "layer_types": types if window else None,
        "attn_sinks": True,
        "moe": moe,
    }
    if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
        theta = raw.get("rope_theta") or _DEFAULT_THETA
        out["rope_raw"] = {**raw, "rope_parameters": {**_DEFAULT_ROPE, "rope_theta": theta}}
    return out


FAMILIES = (
    Family(
        "gpt_oss",
        ("gpt_oss",),
        {
            "rope_theta": _DEFAULT_THETA,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "tie": False,
        },
        _fields,
    ),
)
