"""Pipeline parallelism: an engine whose layers run as stages in several rank processes (gloo)
gives the single-process engine's greedy tokens and logprobs, and keeps its KV accounting."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from engine_helpers import random_prompts

from radixserve.distributed.ranks import RankFailure
from radixserve.distributed.topology import PipelineParallel
from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

CONFIG = {"num_pages": 48, "page_size": 4, "max_num_tokens": 12, "max_running_requests": 4}


def _run(
    engine: Engine, prompts: list[list[int]], prompt_logprobs: bool
) -> list[tuple[list[int], list[float | None]]]:
    """Greedy tokens with their logprobs (and the prompt's: every logits row goes to rank 0),
    each with the logprobs of two named tokens (SGLang's token_ids_logprob)."""
    params = SamplingParams(
        max_tokens=6,
        temperature=0.0,
        logprobs=0,
        prompt_logprobs_start=1 if prompt_logprobs else None,
        logprob_token_ids=[3, 11],
    )
    outs = engine.generate(prompts, params)
    engine.check_invariants()
    return [
        (
            o.token_ids,
            [v for lp in o.logprobs or [] for v in (lp.logprob, *lp.asked)]
            + list(o.prompt_logprobs or [])
            + [v for asked in o.prompt_asked_logprobs or [] for v in asked],
        )
        for o in outs
    ]


def _compare(model_dir: Path, pp: int, tp: int = 1, **extra: str) -> None:
    # Chunked prefill (12-token budget), a shared prefix (warm cache on the second call).
    prompts = random_prompts([9, 17, 5])
    again = [prompts[1][:12] + [7, 8, 9], prompts[0]]
    single = Engine(str(model_dir), **CONFIG)
    expected = _run(single, prompts, True), _run(single, again, False)
    staged = Engine(str(model_dir), **CONFIG, pipeline_parallel_size=pp, tensor_parallel_size=tp)
    try:
        assert (
            isinstance(staged.topology, PipelineParallel)
            and len(staged.topology.launch.procs) == tp * pp - 1
        )
        got = _run(staged, prompts, True), _run(staged, again, False)
        assert staged.stats().cached_prompt_tokens_total > 0  # the second call hit the cache
        for want_batch, got_batch in zip(expected, got, strict=True):
            for (want_ids, want_lp), (got_ids, got_lp) in zip(want_batch, got_batch, strict=True):
                assert got_ids == want_ids
                assert got_lp == pytest.approx(want_lp, abs=1e-4)
        # Every page comes back once the requests are done and the cache is flushed.
        assert staged.flush_cache()
        assert staged.allocator.num_free == staged.allocator.num_pages
        assert staged.pool.num_layers == staged.model.num_local_layers  # type: ignore[attr-defined]
    finally:
        staged.close()
    assert isinstance(staged.topology, PipelineParallel)
    assert all(p.poll() is not None for p in staged.topology.launch.procs.values())


def test_pp2_llama_equals_single(tiny_llama_dir: Path) -> None:
    _compare(tiny_llama_dir, 2)


def test_pp2_qwen2_tied_overlap_equals_single(tiny_qwen2_dir: Path) -> None:
    # Overlap scheduling: each decode plan names the step before's tokens (future rows),
    # which rank 0 fills in from its host copy before the broadcast.
    _compare(tiny_qwen2_dir, 2, overlap_schedule="on")


@pytest.mark.slow
def test_pp3_uneven_stages(tiny_mqa_dir: Path) -> None:
    _compare(tiny_mqa_dir, 3)  # 3 layers, 1 KV head: one layer per stage


@pytest.mark.slow
def test_tp2_pp2_four_ranks_equal_single(tiny_qwen2_dir: Path) -> None:
    """Each stage a TP group of 2 (4 ranks): q/k/v bias, tied embeddings split by vocabulary."""
    _compare(tiny_qwen2_dir, 2, tp=2)


def test_dead_rank_fails_the_engine_naming_it(tiny_llama_dir: Path) -> None:
    engine = Engine(str(tiny_llama_dir), **CONFIG, pipeline_parallel_size=2)
    try:
        assert isinstance(engine.topology, PipelineParallel)
        engine.check_health()
        proc = engine.topology.launch.procs[1]
        proc.kill()
        proc.wait()
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"pipeline rank 1 \(pid \d+\) exited with code -9"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 10  # the dead rank's sockets closed: no timeout wait
        engine.check_invariants()  # the failed request gave its pages back
        with pytest.raises(RankFailure, match="rank 1"):
            engine.check_health()
    finally:
        engine.close()


def test_stats_account_every_rank(tiny_llama_dir: Path) -> None:
    """The benchmark's counters: each rank's compute, waits and sends, gathered on rank 0."""
    engine = Engine(str(tiny_llama_dir), **CONFIG, pipeline_parallel_size=2)
    try:
        assert isinstance(engine.topology, PipelineParallel)
        comm = engine.topology.launch.comm
        comm.gather_stats()  # zeroes them
        engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0))
        first, last = comm.gather_stats()
        assert first["steps"] == last["steps"] == 4  # a prefill and three decode steps
        assert first["compute_seconds"] > 0 and last["compute_seconds"] > 0
        assert first["plan_seconds"] > 0 and last["recv_seconds"] > 0
        # Rank 0 sends hidden states [rows, 64] fp32; rank 1 the logits [1, 512] fp32.
        assert first["bytes_sent"] == (4 + 1 + 1 + 1) * 64 * 4
        assert last["bytes_sent"] == 4 * 512 * 4
        assert comm.gather_stats()[1]["steps"] == 0
        # Rank 0 never holds the final norm's output: hidden states are refused up front.
        hidden = SamplingParams(max_tokens=2, return_hidden_states=True)
        with pytest.raises(ValueError, match="hidden states are not returned with pipeline"):
            engine.add_request([5, 6, 7], hidden)
    finally:
        engine.close()


def test_micro_batches_cut_whole_sequences() -> None:
    from radixserve.distributed.pipeline.micro import split_micro_batches
    from radixserve.scheduling.plan import StepPlan

    def plan(extend: list[int], logits: list[int]) -> StepPlan:
        n, b = sum(extend), len(extend)
        return StepPlan(
            [0] * n, list(range(n)), list(range(n)), list(range(b)), [0] * b, extend,
            extend, [[0]] * b, [], [], [], logits, [], [], [], [],
        )  # fmt: skip

    # Decode: 6 one-row sequences in 2 groups of 3 rows; the logits follow their rows.
    a, b = split_micro_batches(plan([1] * 6, list(range(6))), 2)
    assert (a.seq_lo, a.seq_hi, a.row_lo, a.row_hi) == (0, 3, 0, 3) and a.logits == [0, 1, 2]
    assert (b.seq_lo, b.seq_hi, b.row_lo, b.row_hi) == (3, 6, 3, 6) and b.logits == [3, 4, 5]
    # A long prefill and two decodes: the cut falls after the prefill; prompt-logprob rows
    # (listed after the sample rows) land in their sequence's group.
    a, b = split_micro_batches(plan([10, 1, 1], [9, 10, 11, 3]), 2)
    assert (a.seq_hi, a.row_hi, a.logits) == (1, 10, [0, 3]) and (b.seq_lo, b.logits) == (1, [1, 2])
    # Never more groups than sequences, never an empty group.
    assert len(split_micro_batches(plan([5], [4]), 4)) == 1
    groups = split_micro_batches(plan([1, 1, 30], [0, 1, 31]), 3)
    assert [(g.seq_lo, g.seq_hi) for g in groups] == [(0, 1), (1, 2), (2, 3)]


def test_hung_rank_fails_the_step_after_the_timeout(tiny_llama_dir: Path) -> None:
    engine = Engine(str(tiny_llama_dir), **CONFIG, pipeline_parallel_size=2, dist_timeout=2.0)
    try:
        assert isinstance(engine.topology, PipelineParallel)
        proc = engine.topology.launch.procs[1]
        os.kill(proc.pid, signal.SIGSTOP)  # alive but silent: its sockets stay open
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="pipeline transfer failed"):
            while engine.has_unfinished():
                engine.step()
        assert 1.5 < time.monotonic() - t0 < 30
        engine.check_invariants()
    finally:
        t0 = time.monotonic()
        engine.close()  # kills the stopped rank at once: no grace period after a failure
    assert engine.topology.launch.procs[1].poll() is not None
    assert time.monotonic() - t0 < 5


def test_pp2_weights_updated_on_every_stage_or_none(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Each stage's rank loads its share of the new checkpoint and copies it only once
    every rank could: the answers are then the new weights' transformers tokens (a stage
    left on the old weights would mix them); a checkpoint whose second stage's layer does
    not fit, which rank 0's stage loads fine, changes no stage."""
    import tiny_models
    from engine_helpers import greedy, hf_greedy
    from safetensors.torch import load_file, save_file

    b = tiny_models.build_tiny_llama(tmp_path / "b", seed=62)
    broken = tiny_models.build_tiny_llama(tmp_path / "broken", seed=63)
    (shard,) = broken.glob("*.safetensors")
    tensors = load_file(str(shard))
    name = "model.layers.1.mlp.down_proj.weight"  # layer 1: the second stage's
    tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    prompt = random_prompts([9], seed=64)[0]
    engine = Engine(str(tiny_llama_dir), **CONFIG, pipeline_parallel_size=2)
    try:
        assert engine.generate([prompt], greedy(6))[0].token_ids == hf_greedy(
            tiny_llama_dir, prompt, 6
        )
        engine.update_weights_from_disk(str(b), weight_version="v2")
        (out,) = engine.generate([prompt], greedy(6))
        assert out.token_ids == hf_greedy(b, prompt, 6) and out.usage.cached_tokens == 0
        with pytest.raises(ValueError, match="another pipeline rank refused"):
            engine.update_weights_from_disk(str(broken))
        assert engine.generate([prompt], greedy(6))[0].token_ids == out.token_ids
        assert engine.weight_version == "v2"
        engine.check_invariants()
    finally:
        engine.close()
