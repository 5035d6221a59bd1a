"""Model families, one module each, registered by the ``model_type`` of ``config.json``.

A family module says how its checkpoints differ from Llama's: its config defaults (what
transformers' config class assumes when a key is absent) and :class:`Family.fields`, the
:class:`~radixserve.model.config.ModelConfig` fields its quirks set (biases, q/k norms, norm
layout, a fused checkpoint layout, a sliding window, partial rotary, Gemma's soft-caps,
gpt-oss's attention sinks). The model is then composed from the shared pieces in
``model/layers/`` by those fields. Adding a dense family is one module here and a test
against transformers.

These modules import nothing heavy: ``radixserve memory`` reads configs through them.
"""

from __future__ import annotations

from radixserve.model.families import (
    gemma,
    glm4,
    gpt_oss,
    granite,
    llama,
    mistral3,
    mixtral,
    olmo2,
    olmoe,
    phi3,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    smollm3,
)
from radixserve.model.families.base import Family

__all__ = ["Family", "family_of", "supported_model_types"]


def _registry() -> dict[str, Family]:
    out: dict[str, Family] = {}
    for module in (
        llama,
        qwen3,
        olmo2,
        phi3,
        gemma,
        qwen3_moe,
        qwen2_moe,
        mixtral,
        olmoe,
        smollm3,
        granite,
        glm4,
        mistral3,
        gpt_oss,
    ):
        for fam in module.FAMILIES:
            for model_type in fam.model_types:
                out[model_type] = fam
    return out


_FAMILIES: dict[str, Family] | None = None


def family_of(model_type: str | None) -> Family | None:
    """The family registered for ``model_type``, or None."""
    global _FAMILIES
    if _FAMILIES is None:
        _FAMILIES = _registry()
    return _FAMILIES.get(model_type or "")


def supported_model_types() -> tuple[str, ...]:
    """Every registered ``model_type``, in registration order."""
    family_of(None)
    assert _FAMILIES is not None
    return tuple(_FAMILIES)
