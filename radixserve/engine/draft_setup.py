"""Start-up of the ``draft`` drafter: load the draft model, check it fits the target, size its KV.

The draft must speak the target's tokens: the same vocabulary size and the same tokenizer
(token strings to ids), or its drafts would mean other text; it must reach the target's
context length without running RoPE past its trained positions. Each is refused at start-up
with a message that names it.

Its KV pool holds as many tokens as the target's (each request that drafts keeps its whole
context there), in the draft's own dims; its bytes come on top of the memory planner's
budget for the target (docs/speculative.md says why it is not the same pool).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from radixserve.engine.config import EngineConfig
from radixserve.model.config import ModelConfig
from radixserve.speculative.draft_model import DraftModelDrafter

__all__ = ["check_draft_fits", "make_draft_drafter"]


def check_draft_fits(
    draft: ModelConfig,
    target: ModelConfig,
    draft_vocab: dict[str, int],
    target_vocab: dict[str, int],
    max_model_len: int,
) -> None:
    """Raise ``ValueError`` unless the draft can propose tokens for the target."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the model's "
            f"({target.vocab_size}): a draft needs the same tokenizer and vocabulary"
        )
    if draft_vocab != target_vocab:
        raise ValueError(
            "the draft model's tokenizer maps tokens to other ids than the model's: a draft "
            "needs the same tokenizer"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the draft model reaches {draft.max_position_embeddings} positions, the model "
            f"{max_model_len}: lower max_model_len or use a draft of the same context length"
        )


def make_draft_drafter(
    cfg: EngineConfig,
    target: ModelConfig,
    tokenizer: Any,
    num_pages: int,
    max_model_len: int,
    device: torch.device,
) -> DraftModelDrafter:
    """The drafter of ``cfg.speculative_draft_model``, checked against the target."""
    from transformers import AutoTokenizer

    from radixserve.model.loader import load_model

    assert cfg.speculative_draft_model is not None
    path = Path(cfg.speculative_draft_model)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_draft_model {str(path)!r} is not a checkpoint directory")
    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"the draft model at {path} has no usable tokenizer: {e}") from None
    model = load_model(path, dtype=cfg.torch_dtype, device=device)
    check_draft_fits(
        model.config,
        target,
        draft_tokenizer.get_vocab(),
        tokenizer.get_vocab(),
        max_model_len,
    )
    return DraftModelDrafter(model, num_pages, cfg.page_size, prefill_chunk=cfg.max_num_tokens)
