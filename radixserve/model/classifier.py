"""Sequence-classification checkpoints (``*ForSequenceClassification``): reward models for RL
(Skywork-Reward on Llama 3.1 and Qwen3, one label) and multi-label classifiers.

Such a checkpoint is a served family's decoder with a ``score`` head ([num_labels, hidden])
in place of the LM head. transformers pools the final norm's output at the sequence's last
token that is not ``pad_token_id`` and multiplies it by the head; radixserve computes the same
vector where it computes a prompt's embedding (``return_embedding``), so a classifier's
"embedding" is its class logits (as SGLang answers a reward model's ``/classify``). What the
serving layer adds on top (softmax, the label's name) is in :func:`class_probs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

_SUFFIX = "ForSequenceClassification"


@dataclass(frozen=True)
class ClassifierHead:
    """What a classifier checkpoint's config says about its head: the labels' names in class
    order (``id2label``; ``LABEL_i`` where it names none) and the pad token transformers
    skips when it picks the pooled token."""

    labels: tuple[str, ...]
    pad_token_id: int | None = None
    # transformers' problem_type (what the head was trained for; None: not said), which
    # picks the probabilities' activation (:func:`class_probs`).
    problem_type: str | None = None

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def pooled_prompt(self, ids: list[int]) -> list[int]:
        """The prompt up to the token transformers pools: its last one that is not the pad
        token (trailing pads dropped; a prompt of pads only keeps its first, as transformers'
        argmax over an all-false mask picks position 0). Causal attention makes the pooled
        row's value independent of what follows it, so running the shorter prompt gives
        transformers' logits exactly and caches nothing a pad would not change."""
        pad = self.pad_token_id
        end = len(ids)
        while pad is not None and end > 1 and ids[end - 1] == pad:
            end -= 1
        return ids if end == len(ids) else ids[:end]


def classifier_of(raw: dict[str, Any], architectures: Sequence[str]) -> ClassifierHead | None:
    """The head of a ``*ForSequenceClassification`` config (None for any other architecture).

    ``id2label``'s keys are class indices (strings in config.json); without it the config's
    ``num_labels`` (transformers' default 2) gives ``LABEL_0``...``LABEL_{n-1}``."""
    if not architectures or not architectures[0].endswith(_SUFFIX):
        return None
    named = {int(k): str(v) for k, v in (raw.get("id2label") or {}).items()}
    n = len(named) or int(raw.get("num_labels") or 2)
    if n < 1 or (named and sorted(named) != list(range(n))):
        raise ValueError(f"id2label must name classes 0..n-1, got {sorted(named)}")
    pad, problem = raw.get("pad_token_id"), raw.get("problem_type")
    return ClassifierHead(
        labels=tuple(named.get(i, f"LABEL_{i}") for i in range(n)),
        pad_token_id=int(pad) if isinstance(pad, int) else None,
        problem_type=problem if isinstance(problem, str) and problem else None,
    )


class Classification(NamedTuple):
    """One input's classification: the head's raw ``logits`` (a reward model's score is
    ``logits[0]``), their ``probs`` (:func:`class_probs`) and the most likely ``label``."""

    logits: list[float]
    probs: list[float]
    label: str


def classify(head: ClassifierHead, logits: Sequence[float]) -> Classification:
    """``logits`` (the engine's embedding of a classifier's prompt) read as ``head``'s classes."""
    if len(logits) != head.num_labels:
        raise ValueError(f"{len(logits)} logits for a head of {head.num_labels} labels")
    probs = class_probs(logits, head.problem_type)
    best = max(range(len(probs)), key=probs.__getitem__)
    return Classification(list(logits), probs, head.labels[best])


def class_probs(logits: Sequence[float], problem_type: str | None = None) -> list[float]:
    """vLLM's classification activation, by the head's ``problem_type`` as transformers'
    loss reads it: ``regression`` the logits as they are, ``multi_label_classification`` a
    sigmoid of each; otherwise (``single_label_classification``, or none said) a softmax
    over two or more labels and a sigmoid of a single logit (a reward model's score)."""
    if problem_type == "regression":
        return list(logits)
    if problem_type == "multi_label_classification" or len(logits) == 1:
        return [_sigmoid(x) for x in logits]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)  # no overflow for a very negative logit
    return e / (1.0 + e)
