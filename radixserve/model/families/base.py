"""What a family module declares (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    """One architecture family as the config parser and the loader see it."""

    name: str
    model_types: tuple[str, ...]
    # transformers' defaults for keys a config.json may omit: rope_theta, rms_norm_eps,
    # max_position_embeddings, tie (tie_word_embeddings).
    defaults: dict[str, Any]
    # raw config.json -> the family's ModelConfig fields (its quirks).
    fields: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda raw: {})
    # What the family supports beyond one process's plain model (with the reason when not).
    tensor_parallel: str | None = None  # None: supported; else why not
    # A multimodal checkpoint served as its text model (Gemma 3's ``gemma3``): the raw
    # config.json -> the text model's raw config, which the parser then reads (its
    # ``model_type`` stays the checkpoint's, so this family's ``fields`` apply). None: the
    # config.json is the model's own.
    text_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # Checkpoint tensor name -> the text model's name (``model.layers...``, ``lm_head``), or
    # None for a tensor the text model does not use (a vision tower's: never read).
    weight_name: Callable[[str], str | None] | None = None


# What the top level of a multimodal config says for the whole model (over its text_config).
TOP_LEVEL_KEYS = ("eos_token_id", "tie_word_embeddings", "torch_dtype", "dtype", "architectures")

# Checkpoint prefixes of a multimodal checkpoint's text model -> radixserve's names.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),  # the released checkpoints, transformers 5's saves
    ("model.language_model.", "model."),  # transformers 5's in-memory names
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)


def text_model_config(raw: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's text model as a config of its own: ``text_config`` over
    ``defaults`` (what its config class assumes where the checkpoint is silent), with what the
    top level says for the whole model (``TOP_LEVEL_KEYS``); ``model_type`` stays the
    checkpoint's, so that its family's fields apply."""
    text = {**defaults, **(raw.get("text_config") or {})}
    text.update({k: raw[k] for k in TOP_LEVEL_KEYS if raw.get(k) is not None})
    text["model_type"] = raw["model_type"]
    return text


def text_model_weight_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name -> its text model's, or None (the vision tower,
    the multimodal projector: never read)."""
    for prefix, ours in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return None


def layer_type_rope(
    raw: dict[str, Any], family: str, legacy_local_theta: float, default_theta: float
) -> tuple[float, dict[str, Any]]:
    """RoPE for models whose sliding and full layers differ in it (Gemma 3, OLMo 3):
    ``(the sliding layers' base, the raw config whose RoPE keys are the full layers')``.
    transformers v5 writes ``rope_parameters`` per layer type; the legacy layout's
    ``rope_theta`` and ``rope_scaling`` are the full layers', the sliding layers' base
    ``legacy_local_theta`` (unscaled). A scaled RoPE on the sliding layers is refused."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" not in params and "sliding_attention" not in params:
        return legacy_local_theta, raw
    local = params.get("sliding_attention") or {}
    if (local.get("rope_type") or "default") != "default":
        raise ValueError(f"{family} with a scaled RoPE on its sliding layers is not supported")
    glob = dict(params.get("full_attention") or {"rope_type": "default"})
    glob.setdefault("rope_theta", default_theta)
    rope_raw = {**raw, "rope_parameters": glob, "rope_scaling": None, "rope_theta": None}
    return float(local.get("rope_theta") or legacy_local_theta), rope_raw


def qwen_window(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/3's window: only with ``use_sliding_window``, and then (without ``layer_types``)
    on the layers from ``max_window_layers`` on, as transformers' Qwen configs derive it."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if window is None:
        return {"sliding_window": None}
    n = int(raw["num_hidden_layers"])
    first = int(raw.get("max_window_layers", n))
    types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return {"sliding_window": window, "layer_types": raw.get("layer_types") or types}
