"""The model facts radixserve needs, read from a Hugging Face ``config.json``.

The JSON is parsed directly (not through ``transformers.AutoConfig``) for two reasons: the
memory calculator must answer in milliseconds for models the user doesn't have, and the
file format is the stable contract while transformers' config classes change between major
versions (v5 moved ``rope_theta``/``rope_scaling`` into ``rope_parameters``). Both layouts
are accepted here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.model.classifier import ClassifierHead, classifier_of
from radixserve.model.families import family_of, supported_model_types
from radixserve.model.families.moe import MoEConfig

# model_type -> its family module under model/families/ (config defaults and quirks).
SUPPORTED_MODEL_TYPES = supported_model_types()
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (``rope_type`` ``linear``, ``llama3``, ``yarn`` or ``longrope``;
    the fields each type reads are as in transformers' ``rope_parameters``)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    attention_factor: float | None = None  # yarn, longrope: cos/sin scale (None: derived)
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts of one checkpoint of a supported family (``model/families/``).

    The fields after ``torch_dtype`` are the families' quirks, each off (Llama's layout)
    by default; the shared layers in ``model/layers/`` read them."""

    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections
    o_proj_bias: bool  # bias on the output projection (Llama's attention_bias; never Qwen2)
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: torch.dtype  # dtype the checkpoint was saved in (not necessarily the run dtype)
    sliding_window: int | None = (
        None  # the window of the layers that slide (all, without layer_types)
    )
    # Per layer "sliding_attention" | "full_attention" (Gemma 2/3 interleave them); None: all alike.
    layer_types: tuple[str, ...] | None = None
    qk_norm: str | None = None  # "head" (Qwen3: per head) | "proj" (OLMo 2: whole projection)
    # A *ForSequenceClassification checkpoint's score head (model/classifier.py); None: none.
    classifier: ClassifierHead | None = None
    # "pre" (Llama) | "post" (OLMo 2: norms on the blocks' outputs) | "sandwich" (Gemma: both)
    norm_layout: str = "pre"
    partial_rotary_factor: float = 1.0  # the rotated fraction of each head (Phi-4-mini 0.75)
    fused_checkpoint: bool = False  # q/k/v and gate/up stored fused (Phi-3)
    # Gemma 2/3 (``families/gemma.py``); each off for every other family.
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" | "gelu_pytorch_tanh"
    norm_plus_one: bool = False  # RMSNorms scale by (1 + weight) (Gemma)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    query_pre_attn_scalar: float | None = None  # scores scale by its -1/2, not head_dim's
    attn_softcap: float | None = None  # attention scores: cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # logits: cap * tanh(l / cap) (Gemma 2, some Gemma 3)
    local_rope_theta: float | None = None  # the sliding layers' own RoPE base (Gemma 3)
    clip_qkv: float | None = None  # q, k, v clamped to [-clip, clip] after the q/k norms (OLMoE)
    # A tensor-parallel rank's view (``TPShard.local_config``) of a "proj" q/k norm: the whole
    # q and k widths it averages over, and whether this rank's k lanes count in the ranks' sum
    # (not on the second and later ranks sharing a replicated KV head). None: one rank.
    qk_norm_tp: tuple[int, int, bool] | None = None
    moe: MoEConfig | None = None  # expert MLPs (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE)
    nope_layers: tuple[int, ...] = ()  # layers whose q and k are not rotated (SmolLM3)
    rope_interleaved: bool = False  # RoPE on neighbouring lanes' pairs (GLM-4), not halves
    # Granite's scalars (``families/granite.py``); 1.0 (no effect) for every other family.
    embedding_multiplier: float = 1.0  # the embeddings' factor
    attention_multiplier: float = 1.0  # the scores' scale in place of head_dim's (when not 1)
    residual_multiplier: float = 1.0  # each block's output's factor before the residual add
    logits_scaling: float = 1.0  # the logits' divisor
    # Ministral 3's query temperature (Llama 4's scaling): each query times
    # 1 + beta * ln(1 + floor(position / period)) after RoPE, 1 before the first period's end,
    # sharper attention past it (``rope_parameters.llama_4_scaling_beta``); 0.0: none.
    query_scale_beta: float = 0.0
    query_scale_period: int = 0
    # gpt-oss's attention sinks: a learned logit per query head (``self_attn.sinks``) that
    # joins every row's softmax denominator (its probability then dropped), so a row can
    # attend to "nothing"; only backends that apply it serve such a model.
    attn_sinks: bool = False

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_rope(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` rotates q and k (False: a NoPE layer, SmolLM3)."""
        return layer not in self.nope_layers

    def scales_queries(self, seq_len: int) -> bool:
        """Whether a sequence of ``seq_len`` tokens has queries the temperature scales (a
        position at or past ``query_scale_period``)."""
        return self.query_scale_beta != 0.0 and seq_len > self.query_scale_period

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: it attends over everything)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def sm_scale(self) -> float:
        """The attention scores' scale (``head_dim ** -0.5`` unless the family says otherwise)."""
        if self.attention_multiplier != 1.0:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def llama_shaped(self) -> bool:
        """Whether the layers are Llama's: pre-norms, no q/k norm, no window, SiLU, plain
        norms and scores, and everything else :attr:`stack_shaped` asks."""
        return (
            self.qk_norm is None
            and self.norm_layout == "pre"
            and self.sliding_window is None
            and self.hidden_act == "silu"
            and not self.norm_plus_one
            and self.query_pre_attn_scalar is None
            and self.attn_softcap is None
            and self.stack_shaped
        )

    @property
    def stack_shaped(self) -> bool:
        """Whether the one-call CPU decoder stack runs these layers: Llama's, with Qwen3's
        per-head or OLMo 2's whole-projection q/k norm, pre-norms, OLMo 2's post-norms or
        Gemma's sandwich norms (Gemma's ``1 + weight`` norms only there), sliding windows on
        any layers (the stack gives each layer its window's plan and, Gemma 3, its RoPE base),
        SiLU or GELU-tanh gates, Gemma's scores' scale and soft-cap; full rotary on every
        layer, dense MLPs, no clipped q/k/v."""
        return (
            self.qk_norm in (None, "head", "proj")
            and self.norm_layout in ("pre", "post", "sandwich")
            and (not self.norm_plus_one or self.norm_layout == "sandwich")
            and self.rotary_dim == self.head_dim
            and self.hidden_act in ("silu", "gelu_pytorch_tanh")
            and self.moe is None
            and self.clip_qkv is None
            and not self.nope_layers
            and not self.rope_interleaved
            and not self.scaled
            and not self.attn_sinks
        )

    @property
    def scaled(self) -> bool:
        """Whether Granite's multipliers act (any of them not 1)."""
        return (
            self.embedding_multiplier,
            self.attention_multiplier,
            self.residual_multiplier,
            self.logits_scaling,
        ) != (1.0, 1.0, 1.0, 1.0)

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied; every expert held counted:
        all of them, or a rank's own under expert parallelism)."""
        attn = self._attn_params()
        return self._count_params(attn, active=False)

    @property
    def num_active_params(self) -> int:
        """Parameters one token's forward reads: with experts, only its ``top_k`` of each
        sparse layer's (and the router, and the shared expert where there is one); equal to
        :attr:`num_params` for dense models."""
        return self._count_params(self._attn_params(), active=True)

    def _attn_params(self) -> int:
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attn += h
        if self.qk_norm == "head":
            attn += 2 * self.head_dim
        elif self.qk_norm == "proj":
            attn += self.q_size + self.kv_size
        if self.attn_sinks:
            attn += self.num_q_heads
        return attn

    def _count_params(self, attn: int, active: bool) -> int:
        h, v = self.hidden_size, self.vocab_size

        def mlp(i: int, bias: bool = self.mlp_bias) -> int:
            return 3 * h * i + (2 * i + h if bias else 0)

        total = 0
        for layer in range(self.num_layers):
            if self.moe is not None and self.moe.is_sparse(layer):
                moe = self.moe
                experts = moe.top_k if active else moe.num_held_experts
                width = mlp(moe.intermediate_size, self.mlp_bias or moe.expert_bias)
                total += experts * width + moe.num_experts * (h + (1 if moe.router_bias else 0))
                if self.moe.shared_expert_size:  # every row runs it: active as well as held
                    total += mlp(self.moe.shared_expert_size)
                    total += h if self.moe.shared_expert_gate else 0
            else:
                total += mlp(self.intermediate_size)
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        norms = (4 if self.norm_layout == "sandwich" else 2) * h  # Gemma: pre and post norms
        return self.num_layers * (attn + norms) + total + emb + h

    @staticmethod
    def from_pretrained(path_or_config_json: str | Path) -> ModelConfig:
        """Read a checkpoint directory (its ``config.json`` and ``generation_config.json``)
        or a bare ``config.json`` file."""
        path = Path(path_or_config_json)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        raw = json.loads(cfg_file.read_text())
        eos = _as_ids(raw.get("eos_token_id"))
        gen_file = cfg_file.parent / "generation_config.json"
        if path.is_dir() and gen_file.is_file():
            eos = eos + tuple(
                t
                for t in _as_ids(json.loads(gen_file.read_text()).get("eos_token_id"))
                if t not in eos
            )
        return ModelConfig.from_dict(raw, eos_token_ids=eos)

    @staticmethod
    def from_dict(raw: dict[str, Any], eos_token_ids: tuple[int, ...] | None = None) -> ModelConfig:
        """Build from the parsed JSON of a ``config.json``."""
        model_type = raw.get("model_type")
        archs = raw.get("architectures") or []
        family = family_of(model_type)
        if family is None or not isinstance(model_type, str):
            raise ValueError(
                f"unsupported model_type {model_type!r} (architectures {archs}); "
                f"radixserve implements {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if family.text_config is not None:  # a multimodal checkpoint: its text model's config
            raw = family.text_config(raw)
            archs = raw.get("architectures") or archs
        d = family.defaults
        quirks = dict(family.fields(raw))
        hidden = int(raw["hidden_size"])
        n_q = int(raw["num_attention_heads"])
        n_kv = int(raw.get("num_key_value_heads") or n_q)
        head_dim = int(raw.get("head_dim") or quirks.pop("head_dim_default", 0) or hidden // n_q)
        quirks.pop("head_dim_default", None)
        if n_q % n_kv:
            raise ValueError(
                f"num_attention_heads {n_q} is not a multiple of num_key_value_heads {n_kv}"
            )
        act = quirks.pop("hidden_act", None) or raw.get("hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r} (only {', '.join(_ACTIVATIONS)})")
        max_pos = int(raw.get("max_position_embeddings", d["max_position_embeddings"]))
        # A family whose layers differ in RoPE (Gemma 3) hands over the global layers' part.
        rope_raw = quirks.pop("rope_raw", None) or raw
        rope_theta, rope_scaling = _parse_rope(rope_raw, d["rope_theta"], max_pos)
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        window = quirks.pop("sliding_window", None)
        layer_types = quirks.pop("layer_types", None) or raw.get("layer_types")
        if layer_types is not None and len(layer_types) != int(raw["num_hidden_layers"]):
            raise ValueError("layer_types must name every layer")
        return ModelConfig(
            architecture=archs[0] if archs else f"{model_type.capitalize()}ForCausalLM",
            model_type=model_type,
            num_layers=int(raw["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_q_heads=n_q,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", d["rms_norm_eps"])),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", d["tie"])),
            attention_bias=bool(quirks.pop("attention_bias")),
            o_proj_bias=bool(quirks.pop("o_proj_bias")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=eos_token_ids
            if eos_token_ids is not None
            else _as_ids(raw.get("eos_token_id")),
            torch_dtype=_DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32),
            sliding_window=int(window) if window else None,
            layer_types=tuple(layer_types) if window and layer_types else None,
            partial_rotary_factor=_partial_rotary_factor(raw, d.get("partial_rotary_factor", 1.0)),
            hidden_act=act,
            classifier=classifier_of(raw, archs),
            **quirks,
        )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _partial_rotary_factor(raw: dict[str, Any], default: float = 1.0) -> float:
    """The rotated fraction of each head (``default``: the family's, where the config is
    silent: GLM-4's half)."""
    params = raw.get("rope_parameters") or {}
    value = raw.get("partial_rotary_factor") or params.get("partial_rotary_factor") or default
    factor = float(value)
    if not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return factor


def _parse_rope(
    raw: dict[str, Any], default_theta: float, max_pos: int
) -> tuple[float, RopeScaling | None]:
    """Accept both the legacy (``rope_theta`` + ``rope_scaling``) and the transformers v5
    (``rope_parameters``) layouts."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    theta = float(
        raw.get("rope_theta")
        or params.get("rope_theta")
        or scaling.get("rope_theta")
        or default_theta
    )
    spec = scaling or params
    rope_type = spec.get("rope_type") or spec.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; radixserve supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    # Phi-3 keeps the pretraining length outside rope_scaling; transformers prefers it there.
    orig = int(
        raw.get("original_max_position_embeddings")
        or spec.get("original_max_position_embeddings")
        or (max_pos if rope_type in ("yarn", "longrope") else 8192)
    )
    raw_factor = spec.get("factor")
    if raw_factor is None and rope_type in ("yarn", "longrope"):
        raw_factor = max_pos / orig  # as transformers derives it
    factor = float(raw_factor) if raw_factor is not None else float("nan")
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"rope scaling factor must be positive, got {raw_factor}")
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    attention_factor = spec.get("attention_factor")
    if rope_type == "yarn":
        return theta, RopeScaling(
            "yarn",
            factor,
            original_max_position_embeddings=orig,
            beta_fast=float(spec.get("beta_fast") or 32.0),
            beta_slow=float(spec.get("beta_slow") or 1.0),
            mscale=spec.get("mscale"),
            mscale_all_dim=spec.get("mscale_all_dim"),
            truncate=bool(spec.get("truncate", True)),
            attention_factor=None if attention_factor is None else float(attention_factor),
        )
    if rope_type == "longrope":
        return theta, RopeScaling(
            "longrope",
            factor,
            original_max_position_embeddings=orig,
            attention_factor=None if attention_factor is None else float(attention_factor),
            short_factor=tuple(float(f) for f in spec["short_factor"]),
            long_factor=tuple(float(f) for f in spec["long_factor"]),
        )
    return theta, RopeScaling(
        "llama3",
        factor,
        low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
        high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(spec.get("original_max_position_embeddings", 8192)),
    )
