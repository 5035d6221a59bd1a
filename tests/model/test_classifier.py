"""Sequence-classification checkpoints (reward models, multi-label classifiers): the engine's
logits equal transformers' ``*ForSequenceClassification`` ``logits`` for a one-label Llama
(Skywork-Reward's shape) and a three-label Qwen3, in a batch, cold and with a prefix from
the cache, and at the last non-pad token as transformers pools it; generation is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import greedy, hf_class_logits, random_prompts
from tiny_models import GEMMA_QUIRKS, build_tiny_family

from radixserve.engine.engine import Engine
from radixserve.model.classifier import class_probs, classifier_of
from radixserve.model.config import ModelConfig


def close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fixture", ["tiny_reward_dir", "tiny_classifier_dir"])
def test_logits_cold_warm_and_batched(fixture: str, request: pytest.FixtureRequest) -> None:
    """A batch of prompts in one call; then prompts extending them (their prefixes cached)
    and one ending in pad tokens (transformers pools the token before them)."""
    model_dir: Path = request.getfixturevalue(fixture)
    engine = Engine(str(model_dir), num_pages=128, page_size=4)
    head = engine.model_config.classifier
    assert head is not None
    cold = random_prompts([9, 17, 4], seed=61)
    for got, p in zip(engine.classify(cold), cold):
        close(got.logits, hf_class_logits(model_dir, p))
        assert len(got.logits) == head.num_labels
    warm = [cold[1] + [5, 6, 7], cold[0] + [8], cold[1] + [9, 2, 2]]
    outs = engine.generate(warm, engine_embed())
    assert [o.usage.cached_tokens for o in outs] == [16, 8, 16]
    for o, p in zip(outs, warm):
        assert o.embedding is not None
        close(o.embedding, hf_class_logits(model_dir, p))
    assert outs[2].usage.prompt_tokens == 18  # run up to the pooled token
    engine.check_invariants()


def engine_embed() -> Any:
    from radixserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, return_embedding=True)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_other_families(family: str, tmp_path: Path) -> None:
    """Qwen2's (q/k/v bias) and Gemma 2's (soft-caps, sandwich norms, embedding scale, a
    window shorter than the prompts: transformers caps no classifier logit) two-label heads."""
    overrides = GEMMA_QUIRKS["gemma2"][1] if family == "gemma2" else {}
    model_dir = build_tiny_family(tmp_path, family, classifier=True, **overrides)
    prompts = random_prompts([5, 14], seed=63)
    engine = Engine(str(model_dir), num_pages=64, page_size=4)
    for got, p in zip(engine.classify(prompts), prompts):
        assert len(got.logits) == 2  # transformers' default num_labels
        close(got.logits, hf_class_logits(model_dir, p))


def test_probs_and_labels(tiny_classifier_dir: Path, tiny_reward_dir: Path) -> None:
    """Softmax over three named labels, argmax's name; a sigmoid for one label (vLLM's)."""
    prompt = random_prompts([11], seed=62)[0]
    three = Engine(str(tiny_classifier_dir), num_pages=64, page_size=4).classify([prompt])[0]
    want = hf_class_logits(tiny_classifier_dir, prompt)
    close(three.probs, torch.softmax(want, -1))
    assert three.label == ("negative", "neutral", "positive")[int(want.argmax())]
    one = Engine(str(tiny_reward_dir), num_pages=64, page_size=4).classify([prompt])[0]
    close(one.probs, torch.sigmoid(hf_class_logits(tiny_reward_dir, prompt)))
    assert one.label == "LABEL_0"


def test_generation_refused(tiny_reward_dir: Path, tiny_llama_dir: Path) -> None:
    engine = Engine(str(tiny_reward_dir), num_pages=64, page_size=4)
    with pytest.raises(ValueError, match="sequence classifier .* not generation"):
        engine.add_request([5, 6, 7], greedy(4))
    causal = Engine(str(tiny_llama_dir), num_pages=64, page_size=4)
    with pytest.raises(ValueError, match="not a sequence classifier"):
        causal.classify([[5, 6, 7]])


def test_config_reads_the_head() -> None:
    archs = ["Qwen3ForSequenceClassification"]
    head = classifier_of({"id2label": {"1": "b", "0": "a"}, "pad_token_id": 7}, archs)
    assert head is not None and head.labels == ("a", "b") and head.pad_token_id == 7
    default = classifier_of({}, ["LlamaForSequenceClassification"])
    assert default is not None and default.labels == ("LABEL_0", "LABEL_1")
    assert classifier_of({"id2label": {"0": "x"}}, ["LlamaForCausalLM"]) is None
    assert head.pooled_prompt([3, 7, 4, 7, 7]) == [3, 7, 4]
    assert head.pooled_prompt([7, 7]) == [7]
    with pytest.raises(ValueError, match="id2label"):
        classifier_of({"id2label": {"0": "a", "2": "c"}}, archs)
    assert class_probs([0.0]) == [0.5] and class_probs([-1000.0])[0] == 0.0
    # vLLM's activation by transformers' problem_type: none said or single-label (above).
    assert class_probs([0.0, 0.0]) == [0.5, 0.5]
    assert class_probs([2.0, -1.0], "regression") == [2.0, -1.0]
    assert class_probs([0.0, 1000.0], "multi_label_classification") == [0.5, 1.0]
    regression = classifier_of({"problem_type": "regression", "num_labels": 1}, archs)
    assert regression is not None and regression.problem_type == "regression"


def test_model_config_of_a_checkpoint(tiny_classifier_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(str(tiny_classifier_dir))
    assert cfg.classifier is not None and cfg.classifier.num_labels == 3
