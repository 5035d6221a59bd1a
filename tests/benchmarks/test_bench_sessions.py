"""benchmarks/bench_sessions.py: the workload has the issue's shape, is seeded, and leases
keep the returning turns' context that LRU loses (cache accounting only, no model)."""

from __future__ import annotations

from bench_modules import load

bench = load("bench_sessions.py", "bench_sessions")


def test_small_run_has_the_shape_and_leases_keep_the_context() -> None:
    args = bench.parse(["--agents", "4", "--turns", "4", "--system", "400", "--out", ""])
    out = {}
    for name, cfg in bench.CONFIGS.items():
        out[name] = bench.summarize(bench.run(args, name, cfg["leases"], cfg["policy"]))
    lru, leases = out["lru"], out["leases"]
    assert 1.2 <= lru["pool_tokens"] / lru["agents_combined_context"] <= 1.5 + 1e-9
    assert lru["churn_tokens_per_shortest_pause"] >= 2 * lru["pool_tokens"] - 1
    assert lru["returning_turns"] == leases["returning_turns"] == 4 * 3
    assert leases["cached_fraction_mean"] >= 0.95 > lru["cached_fraction_mean"]
    assert leases["churn_tokens_computed"] == lru["churn_tokens_computed"]
    again = bench.summarize(bench.run(args, "lru", False, "lru"))
    assert again == lru  # seeded
