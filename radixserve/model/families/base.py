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
