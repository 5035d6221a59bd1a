"""Serving benchmark: a shared-prefix chat workload replayed through the ZeroMQ router.

Compares, in one run, interleaved round by round (this machine's speed drifts):

* ``1w``            one worker (routing is moot),
* ``2w-cache``      two workers, cache-aware routing (prefix groups kept together: load in
                    outstanding prompt tokens, in-flight prefixes followed; the default),
* ``2w-cache-req``  two workers, cache-aware routing as it was before (load in requests in
                    flight, gap 4, in-flight prefixes not followed),
* ``2w-rr``         two workers, round-robin routing,
* ``2w-events``     two workers, cache-aware routing on the workers' KV events
                    (``--router-prefix-source events``) instead of the router's tries.

The workload: ``--systems`` long system prompts, each shared by ``--per-system`` chat
requests with short distinct user questions, shuffled. Every request streams; the client
measures TTFT (send -> first token), ITL (gaps between streamed tokens) and end-to-end
latency; the router's usage reports cached prompt tokens (hit rate). Requests are sent at a
fixed ``--concurrency`` or as a Poisson process at ``--rate`` requests/s. Each worker's KV
pool is capped at ``--kv-tokens`` tokens, so a worker cannot hold every system prompt:
routing decides how much prefix computation is repeated.

All servers start before the first round (idle ones cost no CPU), and every round flushes
the caches first, so each configuration replays the same cold-start workload.

    python benchmarks/bench_serving.py                     # SmolLM2, a few minutes on 2 cores
    python benchmarks/bench_serving.py --model /path/to/hf --rounds 1 --per-system 4   # quick
    python benchmarks/bench_serving.py --systems 4 --per-system 16 --system-words 1100 \
        --concurrency 16 --kv-tokens 16384 --rounds 1   # issue 20's prefix-group workload

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import AsyncClient, Client
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig
from radixserve.serving.wire import protocol as p

sys.path.insert(1, str(Path(__file__).resolve().parent))  # `workloads`, after a PYTHONPATH checkout
import workloads as wl  # noqa: E402

TOPICS = wl.TOPICS
# The first twelve questions: the workload the published bench_serving figures were run on.
QUESTIONS = wl.QUESTIONS[:12]


def system_prompt(topic: str, words: int) -> str:
    """A long, topic-specific system prompt (deterministic filler around real instructions)."""
    rng = random.Random(topic)
    rules = [
        f"Rule {i + 1}: when discussing {topic}, "
        + " ".join(
            rng.choice(
                [
                    "be precise",
                    "cite examples",
                    "avoid jargon",
                    "define terms",
                    "stay concise",
                    "give numbers",
                    "mention safety",
                    "compare options",
                    "explain trade-offs",
                    "use analogies",
                ]
            )
            for _ in range(6)
        )
        + "."
        for i in range(max(1, words // 30))
    ]
    return f"You are an expert tutor in {topic}. " + " ".join(rules)


def build_workload(
    systems: int, per_system: int, words: int, seed: int
) -> list[list[dict[str, str]]]:
    """Chat requests: ``systems`` shared system prompts x ``per_system`` questions, shuffled."""
    reqs = [
        [
            {"role": "system", "content": system_prompt(TOPICS[s % len(TOPICS)], words)},
            {
                "role": "user",
                "content": QUESTIONS[(q + s) % len(QUESTIONS)] + f" (request {s}.{q})",
            },
        ]
        for s in range(systems)
        for q in range(per_system)
    ]
    random.Random(seed).shuffle(reqs)
    return reqs


def ideal_hit_rate(model: Path, workload: list[list[dict[str, str]]], page_size: int) -> float:
    """Hit rate of an unbounded prefix cache seeing the requests in order (whole pages, and
    never a prompt's last token): the ceiling any routing can reach on this workload."""
    from radixserve.prefix import common_prefix_len
    from radixserve.serving.prompts import load_tokenizer

    tok = load_tokenizer(model)
    seqs = [
        tuple(
            tok.encode(
                tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
        )
        for m in workload
    ]
    hit = 0
    for i, ids in enumerate(seqs):
        best = max([common_prefix_len(ids, prev) for prev in seqs[:i]], default=0)
        hit += min(best, len(ids) - 1) // page_size * page_size
    return hit / max(1, sum(map(len, seqs)))


async def _one(
    client: AsyncClient, messages: list[dict[str, str]], params: SamplingParams
) -> dict[str, Any]:
    t0 = time.perf_counter()
    stamps: list[float] = []
    final: p.GenerateFinal | None = None
    async for ev in client.stream(messages=messages, params=params):
        if isinstance(ev, p.GenerateChunk):
            stamps.extend([time.perf_counter()] * max(1, len(ev.token_ids)))
        else:
            final = ev
    assert final is not None
    end = time.perf_counter()
    return {
        "ttft": stamps[0] - t0 if stamps else end - t0,
        "itl": list(np.diff(stamps)) if len(stamps) > 1 else [],
        "e2e": end - t0,
        "prompt": final.usage.prompt_tokens,
        "cached": final.usage.cached_tokens,
        "completion": final.usage.completion_tokens,
        "worker": final.worker_id,
    }


async def replay(
    endpoint: str,
    workload: list[list[dict[str, str]]],
    params: SamplingParams,
    concurrency: int,
    rate: float | None,
    seed: int,
) -> dict[str, Any]:
    """Send the workload; return throughput, latency percentiles and hit rate."""
    client = AsyncClient(endpoint, timeout=600)
    sem = asyncio.Semaphore(concurrency if rate is None else len(workload))
    rng = random.Random(seed)

    async def gated(msgs: list[dict[str, str]], delay: float) -> dict[str, Any]:
        await asyncio.sleep(delay)  # Poisson arrival time (0 under fixed concurrency)
        async with sem:
            return await _one(client, msgs, params)

    delays, t = [], 0.0
    for _ in workload:
        delays.append(t)
        if rate is not None:
            t += rng.expovariate(rate)
    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(gated(m, d) for m, d in zip(workload, delays)))
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    ttft = np.array([r["ttft"] for r in results]) * 1000
    itl = np.array([x for r in results for x in r["itl"]]) * 1000
    e2e = np.array([r["e2e"] for r in results])
    out_tokens = sum(r["completion"] for r in results)
    prompt_tokens = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)

    def pct(a: np.ndarray) -> dict[str, float]:
        return {
            f"p{q}": float(np.percentile(a, q)) if len(a) else float("nan") for q in (50, 90, 99)
        }

    per_worker: dict[str, int] = {}
    for r in results:
        per_worker[str(r["worker"])] = per_worker.get(str(r["worker"]), 0) + 1
    return {
        "wall_s": wall,
        "requests": len(results),
        "req_per_s": len(results) / wall,
        "output_tok_per_s": out_tokens / wall,
        "total_tok_per_s": (out_tokens + prompt_tokens) / wall,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / max(1, prompt_tokens),
        "ttft_ms": pct(ttft),
        "itl_ms": pct(itl),
        "e2e_s": pct(e2e),
        "requests_per_worker": per_worker,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a local HF dir"
    )
    ap.add_argument("--systems", type=int, default=6, help="distinct shared system prompts")
    ap.add_argument("--per-system", type=int, default=4, help="requests per system prompt")
    ap.add_argument(
        "--system-words", type=int, default=600, help="approximate words per system prompt"
    )
    ap.add_argument(
        "--max-tokens", type=int, default=12, help="output tokens per request (ignore_eos)"
    )
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson request rate (req/s) instead of concurrency",
    )
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per configuration")
    ap.add_argument("--kv-tokens", type=int, default=2048, help="KV pool per worker, in tokens")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--configs",
        default="1w,2w-cache,2w-rr",
        help="comma-separated subset of 1w,2w-cache,2w-cache-req,2w-rr,2w-events",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/bench_serving.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from radixserve.model_store import resolve_model

    model = resolve_model(None if args.model == "default" else args.model)
    cores = os.cpu_count() or 1
    layouts: dict[str, tuple[int, dict[str, Any]]] = {
        "1w": (1, {}),
        "2w-cache": (2, {}),
        "2w-cache-req": (
            2,
            {"balance_load": "requests", "balance_abs_threshold": 4, "follow_in_flight": False},
        ),
        "2w-rr": (2, {"routing": "round_robin"}),
        "2w-events": (2, {"prefix_source": "events"}),
    }
    names = [c for c in args.configs.split(",") if c]
    engine = dict(
        page_size=args.page_size,
        num_pages=max(1, args.kv_tokens // args.page_size),
        max_num_tokens=1024,
        max_running_requests=32,
    )
    servers: dict[str, LocalServer] = {}
    workload = build_workload(args.systems, args.per_system, args.system_words, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ideal = ideal_hit_rate(model, workload, args.page_size)
    print(f"workload: {len(workload)} requests, ideal hit rate {ideal:.3f}", flush=True)
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        for name in names:
            n, routing = layouts[name]
            cfg = RouterConfig(endpoint="tcp://127.0.0.1:*", worker_timeout_s=300, **routing)
            servers[name] = LocalServer(
                model,
                num_workers=n,
                config=cfg,
                engine_config={**engine, "num_threads": max(1, cores // n)},
            )
        for srv in servers.values():
            srv.start(timeout_s=600)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
            for name in order:
                srv = servers[name]
                _flush(srv)
                res = asyncio.run(
                    replay(
                        srv.endpoint, workload, params, args.concurrency, args.rate, args.seed + r
                    )
                )
                rounds[name].append(res)
                print(
                    f"round {r} {name:9s} {res['output_tok_per_s']:7.1f} out tok/s  hit {res['hit_rate']:.2f}  "
                    f"ttft p50 {res['ttft_ms']['p50']:7.0f} ms  itl p50 {res['itl_ms']['p50']:6.1f} ms",
                    flush=True,
                )
    finally:
        for srv in servers.values():
            srv.close()

    summary = {name: _median(rs) for name, rs in rounds.items()}
    print(
        f"\n{'config':10s} {'out tok/s':>10s} {'req/s':>7s} {'hit':>5s} {'TTFT p50/p90/p99 ms':>22s} "
        f"{'ITL p50/p90/p99 ms':>20s}  per-worker requests"
    )
    for name, s in summary.items():
        t, i = s["ttft_ms"], s["itl_ms"]
        print(
            f"{name:10s} {s['output_tok_per_s']:10.1f} {s['req_per_s']:7.2f} {s['hit_rate']:5.2f} "
            f"{t['p50']:6.0f}/{t['p90']:6.0f}/{t['p99']:6.0f}   {i['p50']:5.1f}/{i['p90']:5.1f}/{i['p99']:6.1f}  "
            f"{rounds[name][-1]['requests_per_worker']}"
        )
    base = summary.get("1w")
    ratios = {}
    for name, s in summary.items():
        if base is not None and name != "1w":
            ratios[f"{name}/1w throughput"] = s["output_tok_per_s"] / base["output_tok_per_s"]
    for name, s in summary.items():
        if base is not None and name != "1w":
            ratios[f"{name}/1w prompt-cache reuse"] = s["hit_rate"] / max(1e-9, base["hit_rate"])
    if "2w-cache" in summary and "2w-cache-req" in summary:
        new, old = summary["2w-cache"], summary["2w-cache-req"]
        ratios["2w-cache/2w-cache-req throughput"] = (
            new["output_tok_per_s"] / old["output_tok_per_s"]
        )
        ratios["2w-cache/2w-cache-req TTFT p90"] = new["ttft_ms"]["p90"] / old["ttft_ms"]["p90"]
    if "2w-cache" in summary and "2w-rr" in summary:
        ratios["2w-cache/2w-rr throughput"] = (
            summary["2w-cache"]["output_tok_per_s"] / summary["2w-rr"]["output_tok_per_s"]
        )
        ratios["2w-rr/2w-cache TTFT p50"] = (
            summary["2w-rr"]["ttft_ms"]["p50"] / summary["2w-cache"]["ttft_ms"]["p50"]
        )
    if "2w-cache" in summary and "2w-events" in summary:
        ev, tr = summary["2w-events"], summary["2w-cache"]
        ratios["2w-events/2w-cache throughput"] = ev["output_tok_per_s"] / tr["output_tok_per_s"]
        ratios["2w-events/2w-cache TTFT p90"] = ev["ttft_ms"]["p90"] / tr["ttft_ms"]["p90"]
        ratios["2w-events/2w-cache prompt-cache reuse"] = ev["hit_rate"] / max(1e-9, tr["hit_rate"])
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_serving",
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "machine": {
                    "cpu": platform.processor() or platform.machine(),
                    "cores": cores,
                    "python": sys.version.split()[0],
                },
                "model": str(model),
                "args": vars(args),
                "engine": engine,
                "ideal_hit_rate": ideal,
                "summary": summary,
                "ratios": ratios,
                "rounds": rounds,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


def _flush(srv: LocalServer) -> None:
    # A keyless router takes a flush only from its own process: a client over inproc.
    with Client(srv.router.inproc_endpoint, timeout=60, context=srv.router.context) as client:
        if not client.flush_cache():
            raise RuntimeError("flush_cache refused (requests still running?)")


def _median(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric median over rounds (nested percentile dicts too)."""
    out: dict[str, Any] = {}
    for k, v in rs[0].items():
        if isinstance(v, dict) and all(isinstance(x, (int, float)) for x in v.values()):
            out[k] = {kk: float(np.median([r[k][kk] for r in rs])) for kk in v}
        elif isinstance(v, (int, float)):
            out[k] = float(np.median([r[k] for r in rs]))
    return out


if __name__ == "__main__":
    sys.exit(main())
