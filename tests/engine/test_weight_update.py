"""``Engine.update_weights_from_disk``: an engine that served checkpoint A and was given
checkpoint B answers as an engine started on B, token for token and logprob for logprob (in
float32 as transformers' B, in bfloat16 through the one-call CPU stack, with int8 weights,
on Gemma 2's ``1 + weight`` norms, with a LoRA adapter served), and no KV computed by A's
weights answers a request after it, from the radix tree or from the L3 tier; a checkpoint
of another architecture, or an update while requests run, is refused and changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tiny_models
from engine_helpers import greedy, hf_greedy, peft_greedy, random_prompts

from radixserve.engine.engine import Engine

N = 6
ENGINE: dict[str, Any] = dict(num_pages=128, page_size=4, num_threads=1)
PROMPTS = random_prompts([13, 9], seed=5)
PARAMS = greedy(N, logprobs=2)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints of one tiny Llama architecture: other random weights each."""
    return tuple(  # type: ignore[return-value]
        tiny_models.build_tiny_llama(tmp_path_factory.mktemp(f"llama{seed}"), seed=seed)
        for seed in (11, 12)
    )


def _answers(engine: Engine, lora: str | None = None) -> list[tuple[list[int], Any, int]]:
    """Each prompt's greedy tokens, their logprobs and how many prompt tokens were cached."""
    outs = [engine.generate([p], PARAMS, lora=lora)[0] for p in PROMPTS]
    return [(o.token_ids, o.logprobs, o.usage.cached_tokens) for o in outs]


def test_the_new_weights_answer_as_transformers_does_and_nothing_cached_survives(
    llamas: tuple[Path, Path],
) -> None:
    a, b = llamas
    engine = Engine(str(a), dtype="float32", **ENGINE)
    before = _answers(engine)
    assert [t for t, _, _ in before] == [hf_greedy(a, p, N) for p in PROMPTS]
    assert _answers(engine)[0][2] > 0  # the first prompt is cached now
    engine.update_weights_from_disk(str(b), weight_version="step-1")
    after = _answers(engine)
    assert [t for t, _, _ in after] == [hf_greedy(b, p, N) for p in PROMPTS]
    assert [cached for _, _, cached in after] == [0, 0]  # A's KV answers nothing
    assert engine.weight_version == "step-1" and engine.model_path == b
    engine.check_invariants()


@pytest.mark.parametrize(
    "config",
    [
        dict(dtype="bfloat16"),
        dict(dtype="bfloat16", quantization="int8"),
        dict(dtype="float32", decode_graphs="off", hicache_size=0.01),
    ],
    ids=["bf16-native-stack", "bf16-int8", "fp32-hierarchical"],
)
def test_an_updated_engine_answers_as_one_started_on_the_new_weights(
    llamas: tuple[Path, Path], config: dict[str, Any]
) -> None:
    a, b = llamas
    updated = Engine(str(a), **ENGINE, **config)
    _answers(updated)
    updated.update_weights_from_disk(str(b))
    assert _answers(updated) == _answers(Engine(str(b), **ENGINE, **config))
    updated.check_invariants()


def test_gemma_norms_the_stack_computed_are_computed_again(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_type, overrides = tiny_models.GEMMA_QUIRKS["gemma2"]
    a, b = (
        tiny_models.build_tiny_family(
            tmp_path_factory.mktemp(f"gemma{seed}"),
            model_type,
            seed=seed,
            tokenizer=True,
            **overrides,
        )
        for seed in (21, 22)
    )
    updated = Engine(str(a), dtype="bfloat16", **ENGINE)
    _answers(updated)
    updated.update_weights_from_disk(str(b))
    assert _answers(updated) == _answers(Engine(str(b), dtype="bfloat16", **ENGINE))


def test_a_served_adapter_applies_on_the_new_base(
    llamas: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = llamas
    adapter = tiny_models.build_lora_adapter(a, tmp_path / "adapter")
    engine = Engine(str(a), dtype="float32", lora_paths=[f"sql={adapter}"], **ENGINE)
    _answers(engine, lora="sql")
    engine.update_weights_from_disk(str(b))
    assert [t for t, _, _ in _answers(engine, lora="sql")] == [
        peft_greedy(b, adapter, p, N) for p in PROMPTS
    ]


def test_kv_of_the_old_weights_in_l3_never_answers(
    llamas: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = llamas
    config = dict(dtype="float32", hicache_storage_dir=str(tmp_path / "l3"), **ENGINE)
    engine = Engine(str(a), **config)
    _answers(engine)
    assert engine.cache.persist() > 0  # type: ignore[attr-defined]  # A's pages in L3
    engine.update_weights_from_disk(str(b))
    after = _answers(engine)
    assert [cached for _, _, cached in after] == [0, 0]
    assert [t for t, _, _ in after] == [hf_greedy(b, p, N) for p in PROMPTS]
    engine.close()


def test_what_is_refused_changes_nothing(llamas: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = llamas
    wider = tiny_models.build_tiny_llama(tmp_path / "wider", num_layers=3, seed=11)
    engine = Engine(str(a), dtype="float32", **ENGINE)
    before = _answers(engine)
    with pytest.raises(ValueError, match="num_layers 2 -> 3"):
        engine.update_weights_from_disk(str(wider))
    rid = engine.add_request(PROMPTS[0], PARAMS)
    engine.step()  # it runs: it holds KV of A's weights
    with pytest.raises(ValueError, match="requests are running"):
        engine.update_weights_from_disk(str(a))
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert [t for t, _, _ in _answers(engine)] == [t for t, _, _ in before]
    assert engine.weight_version == "default"
