"""What a mixture-of-experts checkpoint adds to its family's config: :class:`MoEConfig`, read
from ``config.json`` by :func:`moe_config` (the keys differ between families)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts MLPs of a checkpoint (``model/layers/moe.py`` runs them).

    Routing is ``softmax`` over the router's logits, then the ``top_k`` largest, renormalised
    to sum to one when ``norm_topk_prob`` (Mixtral always, Qwen3-MoE and OLMoE per config).
    ``dense_layers``: layers whose MLP is a plain dense one of the model's ``intermediate_size``
    (Qwen3-MoE's ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips).
    ``expert_range``: under expert parallelism, the experts ``[lo, hi)`` this rank holds
    whole (``TPShard.local_config``); None: every expert (one process, or each expert cut on
    its width).
    ``shared_expert_size``: the MLP width of a shared expert that every row runs beside its
    routed ones (Qwen2-MoE, DeepSeek); 0: none. ``shared_expert_gate``: its output scaled by
    ``sigmoid(x @ shared_expert_gate)`` per row (Qwen2-MoE) rather than added as it is."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's MLP width
    norm_topk_prob: bool
    dense_layers: tuple[int, ...] = ()
    expert_range: tuple[int, int] | None = None
    shared_expert_size: int = 0
    shared_expert_gate: bool = False
    # DeepSeek-V3's and GLM-4.5's routing (``sigmoid``): each expert's score is the sigmoid of
    # its logit; experts are chosen by score plus a learned correction bias
    # (``e_score_correction_bias``), among the ``topk_group`` best of ``n_group`` groups (a
    # group scored by its two best), weighted by their scores (renormalised per
    # ``norm_topk_prob``) times ``routed_scaling_factor``. "softmax": the others' routing.
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # gpt-oss (``families/gpt_oss.py``): a bias on the router's logits and on each expert's
    # projections, and the experts' activation. "silu": SiLU(gate) * up (every other family);
    # "swiglu_clamped": gate clamped to at most ``swiglu_limit``, up to +-``swiglu_limit``,
    # then (up + 1) * gate * sigmoid(``swiglu_alpha`` * gate).
    router_bias: bool = False
    expert_bias: bool = False
    act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # How the checkpoint stores the experts: "per_expert" (``experts.{e}.gate_proj`` ..., or
    # transformers 5's stacked ``[E, 2I, H]``; ``layers/moe.py``) or "gpt_oss" (stacked,
    # transposed, gate and up interleaved, biases beside, MXFP4 blocks in the released
    # checkpoints; ``layers/gpt_oss_experts.py``).
    checkpoint_layout: str = "per_expert"

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer``'s MLP is the expert block."""
        return layer not in self.dense_layers

    @property
    def held_experts(self) -> tuple[int, int]:
        """The experts ``[lo, hi)`` whose weights this model (or rank) holds."""
        return self.expert_range or (0, self.num_experts)

    @property
    def num_held_experts(self) -> int:
        lo, hi = self.held_experts
        return hi - lo


def moe_config(
    raw: dict[str, Any],
    *,
    experts_default: int,
    top_k_default: int,
    norm_topk_prob: bool | None = None,
    expert_width_key: str = "intermediate_size",
    shared_expert_key: str | None = None,
    shared_expert_gate: bool = False,
) -> MoEConfig:
    """The :class:`MoEConfig` of a raw ``config.json``. ``num_experts`` and
    ``num_local_experts`` are both accepted (transformers maps one onto the other);
    ``norm_topk_prob`` given here is the family's fixed choice (Mixtral), else the config's.
    Qwen3-MoE's and Qwen2-MoE's ``decoder_sparse_step`` / ``mlp_only_layers`` make some layers
    dense. ``shared_expert_key``: the config key of a shared expert's width (absent or 0: no
    shared expert)."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or experts_default)
    top_k = int(raw.get("num_experts_per_tok") or top_k_default)
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts={experts}]")
    n = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step") or 1)
    mlp_only = set(raw.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(n) if i in mlp_only or (i + 1) % step != 0)
    norm = bool(raw.get("norm_topk_prob", False)) if norm_topk_prob is None else norm_topk_prob
    shared = int(raw.get(shared_expert_key) or 0) if shared_expert_key else 0
    return MoEConfig(
        experts,
        top_k,
        int(raw[expert_width_key]),
        norm,
        dense,
        shared_expert_size=shared,
        shared_expert_gate=shared_expert_gate and shared > 0,
    )
