"""The scheduler/runner split: one host->device copy and at most one read back per step.

The runner's only transfer points are its staging buffer's ``upload`` and ``read``
(:mod:`radixserve.engine.staging`); the counts below hold the line. On CUDA the same steps
also run under ``torch.cuda.set_sync_debug_mode("error")``, so an implicit synchronizing
read anywhere in a step fails the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import greedy, hf_greedy, random_prompts

from radixserve.engine.staging import StagingBuffer, StagingLayout
from radixserve.sampling_params import SamplingParams


def _mixed_params() -> list[SamplingParams]:
    """Every sampling stage at least once: greedy, top-k/p, min-p, penalties, min_tokens,
    logprobs, prompt logprobs, a seed."""
    return [
        greedy(6),
        SamplingParams(max_tokens=6, temperature=0.8, top_k=5, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(
            max_tokens=6, temperature=1.0, min_p=0.1, repetition_penalty=1.3, ignore_eos=True
        ),
        SamplingParams(
            max_tokens=6,
            temperature=0.0,
            frequency_penalty=0.5,
            presence_penalty=0.2,
            min_tokens=3,
            logprobs=3,
            prompt_logprobs_start=0,
            ignore_eos=True,
        ),
    ]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_each_step_is_one_copy_in_and_at_most_one_read_back(
    tiny_llama_dir: Path, make_engine, overlap: str
) -> None:
    engine = make_engine(tiny_llama_dir, page_size=4, max_num_tokens=24, overlap_schedule=overlap)
    counter = engine.runner.transfers
    prompts = random_prompts([30, 9, 17, 5], seed=40)  # 30 tokens: a chunked prefill (budget 24)
    for ids, p in zip(prompts, _mixed_params()):
        engine.add_request(ids, p)
    calls = 0
    while engine.has_unfinished():
        h2d, d2h, steps = counter.h2d, counter.d2h, engine.scheduler.counters.steps
        outs = engine.step()
        engine.check_invariants()
        launched = engine.scheduler.counters.steps - steps
        assert counter.h2d - h2d == launched <= 1, "a step's inputs must travel in one copy"
        assert counter.d2h - d2h <= launched, "a step's results must come back in one read"
        if overlap == "off" and any(o.new_token_ids for o in outs):
            assert counter.d2h - d2h == 1
        calls += 1
    steps = engine.scheduler.counters.steps
    assert steps > 6 and counter.h2d == steps and counter.d2h <= steps
    assert engine.stats().pages_in_use == 0


def test_a_prefill_chunk_that_samples_nothing_reads_nothing_back(
    tiny_llama_dir: Path, make_engine
) -> None:
    engine = make_engine(tiny_llama_dir, page_size=4, max_num_tokens=8)
    engine.add_request(random_prompts([20], seed=41)[0], greedy(2))
    counter = engine.runner.transfers
    engine.step()  # first chunk of 8: nothing to sample, nothing to read
    assert (counter.h2d, counter.d2h) == (1, 0)


def test_greedy_tokens_unchanged_through_the_runner(tiny_llama_dir: Path, make_engine) -> None:
    engine = make_engine(tiny_llama_dir, page_size=4)
    prompts = random_prompts([7, 13], seed=42)
    outs = engine.generate(prompts, greedy(8))
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_llama_dir, p, 8) for p in prompts]


def test_slots_come_from_host_page_lists_not_the_device_table(
    tiny_llama_dir: Path, make_engine
) -> None:
    """The CPU path never reads the device page table: with every patch of it dropped and the
    table zeroed instead, KV slots (from host page lists) and the attention (host lists too)
    are still right, so the greedy tokens still match transformers."""
    engine = make_engine(tiny_llama_dir, page_size=4)
    runner = engine.runner

    def zero_instead(plan, staged) -> None:  # type: ignore[no-untyped-def]
        runner.page_table.zero_()

    runner._patch_page_table = zero_instead  # type: ignore[method-assign]
    prompts = random_prompts([9, 14], seed=43)
    outs = engine.generate(prompts, greedy(6))
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_llama_dir, p, 6) for p in prompts]


def test_staging_views_and_readback_roundtrip() -> None:
    staging = StagingBuffer(torch.device("cpu"))
    layout = StagingLayout()
    layout.ints("a", [1, 2, 3])
    layout.int_tensor("m", torch.tensor([[-1, 7]], dtype=torch.int32))
    layout.floats("f", [0.5, -2.25])
    staged = staging.upload(layout)
    assert staged.i("a").tolist() == [1, 2, 3] and staged.i("m").tolist() == [-1, 7]
    assert staged.f("f").tolist() == [0.5, -2.25]
    first = staged.i("a")
    staging.upload(layout)  # the next step's upload must not overwrite this step's views
    assert first.tolist() == [1, 2, 3]
    big = 2**40 + 1  # token ids and the like are exact through the float64 read
    assert staging.read([torch.tensor([big, 5]), torch.tensor([0.25])]) == [
        [float(big), 5.0],
        [0.25],
    ]
    assert (staging.counter.h2d, staging.counter.d2h) == (2, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.sh)")
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_cuda_steps_have_no_implicit_sync(
    tiny_llama_dir: Path, make_engine, monkeypatch, overlap: str
) -> None:
    """Every synchronizing call in a step raises, except the one wait the runner means to do
    (the event of its one read back)."""
    from radixserve.engine import staging

    real_wait = staging.PendingRead.wait

    def allowed_wait(self):  # type: ignore[no-untyped-def]
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real_wait(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(staging.PendingRead, "wait", allowed_wait)
    engine = make_engine(
        tiny_llama_dir,
        page_size=16,
        device="cuda",
        attention_backend="triton",
        overlap_schedule=overlap,
    )
    for ids, p in zip(random_prompts([30, 9, 17, 5], seed=44), _mixed_params()):
        engine.add_request(ids, p)
    engine.step()  # first step: lazy initialisations (cuBLAS handles, kernel compiles) may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert engine.stats().pages_in_use == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_warm_start_runs_the_shapes_a_first_request_brings(
    tiny_llama_dir: Path, make_engine, monkeypatch: pytest.MonkeyPatch, page_size: int
) -> None:
    """Before ready: prefills of the typical prompt lengths that fit, a greedy and a sampled
    decode, all on the scratch page; afterwards nothing is held and outputs are unchanged."""
    from radixserve.engine.model_runner import WARM_PREFILL_LENGTHS, ModelRunner

    seen: list[tuple[int, int, float]] = []
    real = ModelRunner.execute

    def spy(self, plan):  # type: ignore[no-untyped-def]
        seen.append(
            (plan.extend_lens[0], plan.prefix_lens[0], plan.sample_rows[0].params.temperature)
        )
        assert set(plan.page_lists[0]) == {self.scratch_page}
        return real(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    engine = make_engine(tiny_llama_dir, page_size=page_size, num_pages=512, max_model_len=300)
    monkeypatch.setattr(ModelRunner, "execute", real)
    fits = sorted({n for n in WARM_PREFILL_LENGTHS if n < 300} | {4})
    assert [n for n, prefix, _ in seen if prefix == 0] == fits
    decodes = [(prefix, t) for n, prefix, t in seen if prefix > 0]
    assert len(decodes) == 2 and decodes[0][1] == 0.0 and decodes[1][1] > 0.0
    assert engine.runner.transfers.h2d == 0 and engine.stats().pages_in_use == 0
    engine.check_invariants()
    prompts = random_prompts([12, 5], seed=45)
    outs = engine.generate(prompts, greedy(5))
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_llama_dir, ids, 5) for ids in prompts]
