"""benchmarks/bench_store.py's arithmetic (no server: the benchmark itself starts two real
workers per configuration, too heavy for the suite): the workload is seeded, round-robin
sends each system prompt to both workers, and the figures add up."""

from __future__ import annotations

from bench_modules import load

bench = load("bench_store.py", "bench_store")


def test_round_robin_sends_every_system_prompt_to_both_workers() -> None:
    args = bench.parse(["--systems", "4", "--rounds", "2", "--out", ""])
    assert args.systems == 5  # made odd
    reqs = bench.arrivals(args.seed, args.systems, args.system, args.rounds, args.question, 999)
    assert reqs == bench.arrivals(
        args.seed, args.systems, args.system, args.rounds, args.question, 999
    )
    assert len(reqs) == 5 * 2 and all(len(t) == args.system + args.question for _, t in reqs)
    workers = {s: {i % 2 for i, (sys_i, _) in enumerate(reqs) if sys_i == s} for s in range(5)}
    assert all(w == {0, 1} for w in workers.values())
    heads = {s: t[: args.system] for s, t in reqs}
    assert (
        all(t[: args.system] == heads[s] for s, t in reqs)
        and len(set(map(tuple, heads.values()))) == 5
    )
    assert len({tuple(t) for _, t in reqs}) == 10  # every question is new


def test_summarize_adds_up_requests_and_worker_counters() -> None:
    samples = [
        bench.Sample(100, 0, 0, 4, 0.3),
        bench.Sample(100, 64, 64, 4, 0.1),
        bench.Sample(50, 16, 0, 4, 0.2),
    ]
    workers = [
        {
            "storage_hits_total": 4,
            "storage_misses_total": 2,
            "storage_read_bytes_total": 10,
            "storage_written_bytes_total": 30,
            "cached_prompt_tokens_total": 64,
        },
        {
            "storage_hits_total": 0,
            "storage_misses_total": 3,
            "storage_read_bytes_total": 0,
            "storage_written_bytes_total": 20,
            "cached_prompt_tokens_total": 16,
        },
    ]
    out = bench.summarize(samples, workers, 2.0)
    assert out["requests"] == 3 and out["prompt_tokens"] == 250 and out["cached_tokens"] == 80
    assert out["hit_rate"] == 80 / 250 and out["l3_cached_tokens"] == 64
    assert (out["hits"], out["misses"], out["read_bytes"], out["written_bytes"]) == (4, 5, 10, 50)
    assert out["ttft_p50_ms"] == 200.0
    assert out["requests_per_s"] == 1.5 and out["output_tokens_per_s"] == 6.0
    assert out["per_worker_cached_tokens"] == [64, 16]
