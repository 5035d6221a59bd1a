"""LoRA adapters on two tensor-parallel ranks (gloo, spawned once for the module): each rank
serves its share of every adapter (B's rows of q/k/v/gate/up, A's columns of o/down), and
a batch mixing two adapters and the base model gives one rank's greedy tokens and logprobs
and, per adapter, PEFT's tokens. The model has one KV head over the two ranks (replicated:
both add the same k/v delta rows) and an odd MLP width (38 + 37 rows: uneven row-parallel
cuts). Adapters loaded and unloaded while serving reach both ranks in the same slots; one
that rank 1 cannot read (files changed after rank 0 read them), or that fits neither (a
shape mismatch), is served by no rank, and the engine keeps serving.

Tolerance: logprobs within 1e-4 of one rank's (``test_tp_families.py``'s), tokens identical.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiny_models
from engine_helpers import greedy, peft_greedy, random_prompts, run_to_completion, tokens_of

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import StepOutput

N = 6
LOGPROB_ATOL = 1e-4
ADAPTERS = ("all", "mix")


@pytest.fixture(scope="module")
def kv1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 query heads over 1 KV head (replicated on both ranks), an odd MLP width."""
    return tiny_models.build_tiny_llama(
        tmp_path_factory.mktemp("kv1"), num_kv_heads=1, intermediate_size=75
    )


@pytest.fixture(scope="module")
def adapter_dirs(kv1_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of other ranks and targets: every projection (rank 4); q, v, o, up and
    down (rank 8)."""
    root = tmp_path_factory.mktemp("kv1_loras")
    mix = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    return {
        "all": tiny_models.build_lora_adapter(kv1_dir, root / "all"),
        "mix": tiny_models.build_lora_adapter(kv1_dir, root / "mix", targets=mix, rank=8, seed=1),
    }


def _engine(path: Path, adapters: dict[str, Path], tp: int) -> Engine:
    specs = tuple(f"{name}={adapters[name]}" for name in ADAPTERS)
    kw = {"page_size": 4, "num_pages": 128, "dist_timeout": 30.0}
    return Engine(str(path), tensor_parallel_size=tp, lora_paths=specs, **kw)


@pytest.fixture(scope="module")
def engines(kv1_dir: Path, adapter_dirs: dict[str, Path]) -> Iterator[tuple[Engine, Engine]]:
    """A two-rank engine and a one-rank one, both serving the two adapters."""
    one = _engine(kv1_dir, adapter_dirs, 1)
    two = _engine(kv1_dir, adapter_dirs, 2)
    try:
        yield two, one
    finally:
        two.close()
        one.close()


def _mixed(
    engine: Engine, prompts: list[list[int]], loras: list[str | None]
) -> list[list[StepOutput]]:
    """Every prompt with its adapter, in one batch, each with its logprobs."""
    assert engine.flush_cache()
    rids = [engine.add_request(p, greedy(N, logprobs=0), lora=a) for p, a in zip(prompts, loras)]
    outs = run_to_completion(engine)
    return [outs[r] for r in rids]


def _assert_same(got: list[list[StepOutput]], want: list[list[StepOutput]]) -> None:
    """The same greedy tokens, logprobs within LOGPROB_ATOL."""
    assert [tokens_of(o) for o in got] == [tokens_of(o) for o in want]
    for g, w in zip(got, want):
        lg = [lp.logprob for o in g for lp in o.new_logprobs or []]
        lw = [lp.logprob for o in w for lp in o.new_logprobs or []]
        assert len(lg) == len(lw) == N
        assert lg == pytest.approx(lw, abs=LOGPROB_ATOL)


def test_mixed_adapters_equal_one_rank_and_peft(
    engines: tuple[Engine, Engine], kv1_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    two, one = engines
    assert two.model.local_config.num_kv_heads == 1  # the one KV head on each rank
    prompts = random_prompts([9, 14, 6, 11], seed=41)
    loras: list[str | None] = ["all", None, "mix", "all"]
    got = _mixed(two, prompts, loras)
    _assert_same(got, _mixed(one, prompts, loras))
    assert tokens_of(got[0]) == peft_greedy(kv1_dir, adapter_dirs["all"], prompts[0], N)
    assert tokens_of(got[2]) == peft_greedy(kv1_dir, adapter_dirs["mix"], prompts[2], N)
    two.check_invariants()


def test_loads_and_unloads_reach_every_rank_or_none(
    engines: tuple[Engine, Engine],
    kv1_dir: Path,
    adapter_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    two, one = engines
    prompts = random_prompts([7, 12, 10], seed=42)
    extra = tiny_models.build_lora_adapter(kv1_dir, tmp_path / "extra", rank=2, seed=3)
    # Unload "all" (slot 1 drains, then frees), load "extra" into it on both engines.
    for engine in (two, one):
        engine.unload_lora_adapter("all")
        engine.load_lora_adapter("extra", str(extra))
        assert list(engine.lora_adapters) == ["extra", "mix"]
    loras: list[str | None] = ["extra", "mix", None]
    before = _mixed(two, prompts, loras)
    _assert_same(before, _mixed(one, prompts, loras))
    assert tokens_of(before[0]) == peft_greedy(kv1_dir, extra, prompts[0], N)

    # A shape mismatch (another model's adapter) fits no rank: rank 0 refuses, sends nothing.
    other = tiny_models.build_tiny_llama(tmp_path / "wide", hidden_size=96, num_kv_heads=1)
    wide = tiny_models.build_lora_adapter(other, tmp_path / "wide_lora")
    with pytest.raises(ValueError, match="LoRA matrices are"):
        two.load_lora_adapter("wide", str(wide))
    # Rank 0 reads a good adapter; its files change before the other rank reads them
    # (the worker reads off the step loop): rank 1 refuses, so no rank serves it.
    swapped = tmp_path / "swapped"
    shutil.copytree(adapter_dirs["all"], swapped)
    adapter = two.read_lora_adapter("swapped", str(swapped))
    shutil.rmtree(swapped)
    shutil.copytree(wide, swapped)
    with pytest.raises(ValueError, match="another tensor-parallel rank could not load it"):
        two.add_lora_adapter(adapter)
    assert list(two.lora_adapters) == ["extra", "mix"]
    # Both ranks go on serving the same adapters in the same slots.
    _assert_same(_mixed(two, prompts, loras), before)
    # Another load after the refusals takes the same free slot on both ranks.
    for engine in (two, one):
        engine.load_lora_adapter("all", str(adapter_dirs["all"]))
    loras = ["all", "extra", "mix"]
    _assert_same(_mixed(two, prompts, loras), _mixed(one, prompts, loras))
    two.check_invariants()
