"""benchmarks/bench_sessions.py: the workload has the issue's shape, is seeded, and leases
keep the returning turns' context that LRU loses (cache accounting only, no model)."""

from __future__ import annotations

from pathlib import Path

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


def test_the_shape_is_checked_on_the_run_as_it_went() -> None:
    """``shape``: the pool against the agents' context, and the churn that arrived within
    each actual pause, in pools (a run whose pauses saw less than two pools says so)."""
    args = bench.parse(
        "--agents 2 --turns 2 --system 200 --tool 40 --answer 8 --churn-prompt 64 --out ''".split()
    )
    r = bench.run(args, "lru", False, "lru")
    s = bench.shape(args, r.pool_tokens, r.combined_context, r.pauses, r.churn, r.span_s)
    assert s["pool_ok"] and 1.2 <= s["pool_over_context"] <= 1.5
    assert s["pauses"] == 2 and s["churn_ok"] and s["churn_pools_per_pause_min"] >= 2.0
    assert s["leases_fit"] and s["running_churn_tokens"] == 64 + 8  # one churn request at once
    crowded = bench.shape(args, r.pool_tokens, r.combined_context, r.pauses, r.churn, 1.0, None, 4)
    assert not crowded["leases_fit"]  # 4 churn requests running leave no room for the leases
    in_pause = [
        sum(n for t, n in r.churn if a <= t < b) / r.pool_tokens for a, b in r.pauses
    ]  # the same count, the slow way
    assert s["churn_pools_per_pause_min"] == round(min(in_pause), 3)
    thin = bench.shape(args, r.pool_tokens, r.combined_context, r.pauses, r.churn[::4], r.span_s)
    assert not thin["churn_ok"]  # a quarter of the churn: under two pools per pause
    big = bench.shape(args, 2 * r.combined_context, r.combined_context, [], [], 1.0)
    assert not big["pool_ok"] and not big["churn_ok"]


def test_the_http_mode_sends_the_workload_and_reads_what_the_server_cached(
    tiny_llama_dir: Path,
) -> None:
    """``--peer``'s driver against a scripted OpenAI server on loopback (a perfect prefix
    cache: cached = the longest page-aligned prefix it saw before): each turn extends the
    agent's previous prompt under its ``prompt_cache_key``, churn is unkeyed, and every
    returning turn reads as fully cached. The server commands size both pools alike."""
    import asyncio
    import json
    import sys

    from aiohttp import web
    from bench_modules import BENCHMARKS

    sys.path.insert(0, str(BENCHMARKS))
    from peers import sessions_http as sh

    args = bench.parse(
        "--peer radixserve --agents 2 --turns 3 --system 40 --tool 20 --answer 3 "
        "--churn-prompt 30 --pause-min 0.02 --pause-max 0.04 --out ''".split()
    )
    plan = sh.make_plan(args, vocab=1000, page_size=16)
    assert all(0 < t < 1000 for t in plan.system + plan.churn[0])
    assert plan.churn_rate * args.pause_min * (30 + 3) >= 2 * plan.pool_tokens - 1
    seen: list[list[int]] = []
    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        cached = max((_common(prompt, p) for p in seen), default=0) // 16 * 16
        seen.append(prompt)
        bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 3}
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        for ev in ({"choices": [{"text": "abc", "finish_reason": "length"}]}, {"usage": usage}):
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> sh.HttpResult:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            return await sh.run_http(f"http://127.0.0.1:{port}", plan, args, 16, keyed=True)
        finally:
            await runner.cleanup()

    measured = asyncio.run(main())
    out = sh.summarize_http(measured, plan, args)
    assert out["errors"] == 0 and out["returning_turns"] == 2 * 2
    assert len(measured.pauses) == 2 * 2 and all(a < b for a, b in measured.pauses)
    assert plan.combined_context == 40 + 2 * 3 * (20 + 3)
    assert out["cached_fraction_min"] == 1.0 and out["churn_requests"] > 0
    turns = [b for b in bodies if "prompt_cache_key" in b]
    assert len(turns) == 6 and len(bodies) == 6 + out["churn_requests"]
    for key in ("agent-0", "agent-1"):
        mine = [b["prompt"] for b in turns if b["prompt_cache_key"] == key]
        assert all(mine[i + 1][: len(mine[i])] == mine[i] for i in range(2))
    assert all(b["ignore_eos"] and b["max_tokens"] == 3 for b in bodies)

    cfg = {"leases": True, "policy": "lru"}
    cmd, _, _ = sh.serve_command("radixserve", cfg, tiny_llama_dir, 1, plan, 16)
    assert int(cmd[cmd.index("--num-pages") + 1]) * 16 == plan.pool_tokens
    assert cmd[cmd.index("--session-leases") + 1] == "on"


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
