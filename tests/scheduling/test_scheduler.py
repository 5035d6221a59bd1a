"""The scheduler on its own, with a fake model: budgets, chunking, aging, page accounting."""

from __future__ import annotations

from radixserve.memory.allocator import PageAllocator
from radixserve.memory.radix_cache import RadixCache
from radixserve.sampling_params import SamplingParams
from radixserve.scheduling.plan import StepPlan, StepResult
from radixserve.scheduling.request import Request
from radixserve.scheduling.scheduler import RequestOutput, Scheduler, SchedulerConfig

V = 64


class FakeRunner:
    """Next token = (input token + 1) % V; records every plan's shape and checks its slots
    against a host model of the page table built only from the plans' page-table writes."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.batches: list[tuple[list[int], list[int]]] = []
        self.table: dict[tuple[int, int], int] = {}
        self.fail_with: BaseException | None = None

    def execute(self, plan: StepPlan) -> StepResult:
        if self.fail_with is not None:
            raise self.fail_with
        self.batches.append((list(plan.extend_lens), list(plan.positions)))
        self.table.update(zip(zip(plan.write_rows, plan.write_cols), plan.write_pages))
        ps = self.page_size
        seq_of_row = [b for b, n in enumerate(plan.extend_lens) for _ in range(n)]
        for t, pos in enumerate(plan.positions):
            row = plan.table_rows[seq_of_row[t]]
            assert plan.out_slots[t] == self.table[row, pos // ps] * ps + pos % ps
        ns = len(plan.sample_rows)
        tokens = [(plan.input_ids[i] + 1) % V for i in plan.logits_indices[:ns]]
        return StepResult(tokens, [None] * ns, [0.0] * len(plan.prompt_targets))


class Harness:
    """A scheduler driven like the engine drives it, with the fake runner."""

    def __init__(self, s: Scheduler, runner: FakeRunner) -> None:
        self.s, self.runner = s, runner

    def __getattr__(self, name: str) -> object:
        return getattr(self.s, name)

    def step(self) -> list[RequestOutput]:
        out = self.s.take_outputs()
        batch = self.s.schedule()
        if batch is None:
            return out
        try:
            result = self.runner.execute(batch.plan)
        except Exception as e:
            return out + self.s.fail(batch, e)
        return out + self.s.process(batch, result)

    def has_unfinished(self) -> bool:
        return self.s.has_unfinished()


def make(num_pages: int = 64, page_size: int = 4, **kw: object) -> tuple[Harness, FakeRunner]:
    cfg = SchedulerConfig(
        page_size=page_size,
        max_num_tokens=kw.pop("max_num_tokens", 16),  # type: ignore[arg-type]
        max_running_requests=kw.pop("max_running_requests", 8),  # type: ignore[arg-type]
        max_total_len=num_pages * page_size,
        **kw,
    )  # type: ignore[arg-type]
    alloc = PageAllocator(num_pages)
    cache = RadixCache(alloc, page_size)
    runner = FakeRunner(page_size)
    return Harness(Scheduler(cfg, cache, alloc), runner), runner


def request(rid: str, prompt: list[int], n: int = 4) -> Request:
    return Request(
        rid,
        list(prompt),
        len(prompt),
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        256,
    )


def drain(s: Harness) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while s.has_unfinished():
        for o in s.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        s.check_invariants()
    return out


def test_token_budget_and_chunking() -> None:
    s, model = make(max_num_tokens=10)
    s.add(request("a", list(range(1, 26)), n=3))  # 25 tokens: chunks of 10, 10, 5
    s.add(request("b", [30, 31], n=3))
    out = drain(s)
    assert out == {"a": [26, 27, 28], "b": [32, 33, 34]}
    # Every step stays within the budget; decodes ride along with the chunks.
    assert all(sum(lens) <= 10 for lens, _ in model.batches)
    assert model.batches[0][0] == [10]
    assert model.batches[1][0] == [10]
    assert model.batches[2][0] == [5, 2]


def test_positions_continue_after_cached_prefix() -> None:
    s, model = make()
    s.add(request("a", list(range(1, 13)), n=1))
    drain(s)
    s.add(request("b", list(range(1, 13)) + [40], n=1))
    drain(s)
    lens, positions = model.batches[-1]
    assert lens == [1] and positions == [12]  # 12 cached tokens, one computed
    assert s.counters.cached_prompt_tokens == 12


def test_aging_bound_admits_a_cold_request_among_hot_ones() -> None:
    s, _ = make(max_running_requests=1, lpm_max_bypass=2, defer_shared_prefix_tokens=0)
    hot = list(range(1, 17))
    s.add(request("warmup", hot, n=1))
    drain(s)
    s.add(request("cold", [50] * 16, n=1))
    order: list[str] = []
    for i in range(6):
        s.add(request(f"hot{i}", hot + [i + 20], n=1))
    while s.has_unfinished():
        order += [o.request_id for o in s.step() if o.finished]
    # LPM alone would serve all six hot requests first; the bound lets two pass, then the cold one.
    assert order.index("cold") == 2


def test_retraction_keeps_output_and_releases_pages() -> None:
    s, _ = make(
        num_pages=12,
        page_size=2,
        max_num_tokens=64,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
    )
    for i in range(3):
        s.add(request(f"r{i}", [i * 10 + 1] * 5, n=8))
    out = drain(s)
    assert s.counters.retractions > 0
    assert out == {f"r{i}": [(i * 10 + 1 + k) % V for k in range(1, 9)] for i in range(3)}
    assert s.allocator.num_free + s.cache.num_evictable_pages == 12


def test_admission_reserves_no_more_than_the_context_allows() -> None:
    """A huge max_tokens must not reserve pages past what the request can ever hold."""
    s, _ = make(num_pages=64, page_size=4, max_num_tokens=256)
    for i in range(4):
        r = request(f"r{i}", [i * 10 + 1] * 30, n=4096)
        r.max_total_len = 40  # the context: at most 10 more tokens, 3 more pages
        s.add(r)
    first = s.step()
    assert len(s.running) == 4  # 4 x 10 pages fit in 64; reserving for 4096 tokens admitted one
    out = drain(s)
    for o in first:
        out[o.request_id] = o.new_token_ids + out.get(o.request_id, [])
    assert sorted(len(toks) for toks in out.values()) == [10] * 4  # stopped by the context
    assert s.allocator.num_free + s.cache.num_evictable_pages == 64


def test_a_retracted_request_reserves_only_its_remaining_output() -> None:
    s, _ = make(num_pages=64, page_size=4)
    r = request("r", [1] * 8, n=40)
    r.token_ids += [2] * 36  # retracted after 36 of its 40 tokens
    assert s.new_token_ratio.expected_len(r) <= len(r.token_ids) + 4


def test_a_failing_step_finishes_the_batch_with_an_error() -> None:
    s, runner = make()
    s.add(request("a", [1, 2, 3, 4, 5], n=4))
    s.step()  # prefill: a holds pages now
    runner.fail_with = MemoryError("no device memory")
    outs = s.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "error")]
    s.check_invariants()
    assert not s.has_unfinished()
    assert s.allocator.num_free + s.cache.num_evictable_pages == 64


def test_cache_stats_count_a_deferred_request_once() -> None:
    """Requests passed over (deferred behind a shared prefix) do not inflate the hit counters."""
    s, _ = make(num_pages=64, page_size=4, max_num_tokens=16, defer_shared_prefix_tokens=4)
    shared = list(range(1, 25))
    s.add(request("a", shared + [40], n=2))
    s.add(request("b", shared + [50], n=2))  # waits while a computes the shared prefix
    drain(s)
    assert s.cache.stats.queried_tokens == 2 * 24  # each prompt's match limit, once


def test_one_request_at_a_time_reads_its_pages_in_ascending_runs() -> None:
    """Long unique prompts one at a time (bench_long_context.py's traffic): a fresh pool hands
    a request one ascending run of pages, and a full one, whose cache evicts the least
    recently used requests whole, a few runs (each evicted request's pages come back in their
    order). A decode step reads a long context's pages in their order, and ascending runs
    read at nearly the memory's sequential rate, pages scattered at random well below it
    (bench_decode_attention.py's ``--pages``)."""
    s, _ = make(num_pages=96, page_size=4, max_num_tokens=64, max_running_requests=1)
    pages: list[list[int]] = []
    for i, length in enumerate([40, 60, 80, 100] * 3):
        prompt = [1 + (7 * i + 3 * t) % (V - 1) for t in range(length)]
        prompt[0] = 1 + i  # no prefix in common with another request
        s.add(request(f"r{i}", prompt, n=8))
        s.step()  # admitted: every page of the prompt and its output taken at once
        pages.append(list(s.requests[f"r{i}"].pages))
        drain(s)
    jumps = [sum(b != a + 1 for a, b in zip(p, p[1:])) for p in pages]
    assert jumps[:4] == [0, 0, 0, 0]  # 78 of the pool's 96 pages: nothing evicted yet
    assert sum(jumps[4:]) > 0  # evicted for the later ones
    assert sum(jumps) <= 0.1 * sum(len(p) - 1 for p in pages), jumps
