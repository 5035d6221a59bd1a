"""A cluster-wide prefix store (Mooncake) against per-worker L3: two workers, shared system
prompts arriving at both.

The workload (seeded token ids; real workers behind a real router, round-robin routing, a
ZeroMQ client sending one request after another)::

    --systems S system prompts of --system tokens (S made odd, so that round-robin sends
    each system prompt alternately to the two workers), --rounds R rounds; in each round
    every system prompt gets a fresh question (--question tokens) and generates --decode
    tokens

Each worker has a small L1 (--l1-pages pages of 16 tokens; L2 the default, twice that), so
the system prompts do not stay in its memory between rounds: a reuse comes from L3.

Configurations, each its own server, one after the other:

    per-worker-l3  --hicache-storage-backend file, each worker its own directory: a worker
                   reuses only the system prompts it computed itself
    mooncake       --hicache-storage-backend mooncake, one local mooncake_master (the one
                   `serve` starts): a worker reuses what either worker computed

Reported per configuration: the hit rate (cached prompt tokens / prompt tokens, from the
responses' usage), the workers' L3 hits, misses and bytes read/written (their own counters),
TTFT p50 (client side, to the first streamed chunk) and throughput (requests and generated
tokens per second). The expected difference: per-worker L3 computes each system prompt once
on each worker, the store once in all. On a loaded or small machine compare the two
configurations of one run (ratios), never absolute times.

    python benchmarks/bench_store.py                    # minutes on 2 cores
    python benchmarks/bench_store.py --quick --out ''   # a smoke check, print only

Writes JSON to ``benchmarks/results/bench_store.json`` (provenance.header: date, commit,
machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # provenance, bench_disagg
from bench_disagg import _pct  # noqa: E402
from provenance import header  # noqa: E402

from radixserve.sampling_params import SamplingParams  # noqa: E402
from radixserve.serving.client import Client  # noqa: E402
from radixserve.serving.router.launcher import LocalServer  # noqa: E402
from radixserve.serving.router.router import RouterConfig  # noqa: E402
from radixserve.serving.wire import protocol as p  # noqa: E402

CONFIGS = ("per-worker-l3", "mooncake")
PAGE_SIZE = 16
STORAGE_COUNTERS = (
    "storage_hits_total",
    "storage_misses_total",
    "storage_read_bytes_total",
    "storage_written_bytes_total",
)


def arrivals(
    seed: int, systems: int, system: int, rounds: int, question: int, vocab: int
) -> list[tuple[int, list[int]]]:
    """The requests in sending order, each as (its system prompt's index, its token ids):
    round-major, every system prompt once per round."""
    rng = random.Random(seed)
    heads = [[rng.randrange(100, vocab) for _ in range(system)] for _ in range(systems)]
    out = []
    for _ in range(rounds):
        for s, head in enumerate(heads):
            out.append((s, head + [rng.randrange(100, vocab) for _ in range(question)]))
    return out


class Sample(NamedTuple):
    """One request as the client saw it."""

    prompt_tokens: int
    cached_tokens: int
    l3_tokens: int  # of cached_tokens, those loaded from L3 (usage.cached_disk_tokens)
    output_tokens: int
    ttft_s: float


def summarize(
    samples: list[Sample], workers: list[dict[str, Any]], wall_s: float
) -> dict[str, Any]:
    """A configuration's figures from its requests and its workers' engine stats."""
    prompt = sum(s.prompt_tokens for s in samples)
    out: dict[str, Any] = {
        "requests": len(samples),
        "prompt_tokens": prompt,
        "cached_tokens": sum(s.cached_tokens for s in samples),
        "hit_rate": sum(s.cached_tokens for s in samples) / prompt if prompt else float("nan"),
        "l3_cached_tokens": sum(s.l3_tokens for s in samples),
        "ttft_p50_ms": 1e3 * _pct([s.ttft_s for s in samples], 0.5),
        "requests_per_s": len(samples) / wall_s if wall_s > 0 else float("nan"),
        "output_tokens_per_s": sum(s.output_tokens for s in samples) / wall_s
        if wall_s > 0
        else float("nan"),
    }
    for k in STORAGE_COUNTERS:
        out[k.removesuffix("_total").removeprefix("storage_")] = sum(
            int(w.get(k, 0)) for w in workers
        )
    out["per_worker_cached_tokens"] = [int(w.get("cached_prompt_tokens_total", 0)) for w in workers]
    return out


def _one(c: Client, prompt: list[int], params: SamplingParams) -> Sample:
    start, first = time.perf_counter(), None
    final: p.GenerateFinal | None = None
    for ev in c.stream(input_ids=prompt, params=params):
        if first is None:
            first = time.perf_counter() - start
        if isinstance(ev, p.GenerateFinal):
            final = ev
    assert final is not None and final.usage is not None and first is not None
    u = final.usage
    return Sample(
        u.prompt_tokens, u.cached_tokens or 0, u.cached_disk_tokens, u.completion_tokens, first
    )


def run(args: argparse.Namespace, model: str, name: str, root: Path) -> dict[str, Any]:
    """One configuration: its own server (and master), the whole workload, its figures."""
    from contextlib import ExitStack

    reqs = arrivals(args.seed, args.systems, args.system, args.rounds, args.question, args.vocab)
    params = SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True)
    engine: dict[str, Any] = {
        "page_size": PAGE_SIZE,
        "num_pages": args.l1_pages,
        "enable_hierarchical_cache": True,
    }
    with ExitStack() as stack:
        if name == "mooncake":
            from radixserve.distributed.mooncake_master import LocalMaster

            master = stack.enter_context(LocalMaster(root / "master.log"))
            store = {**master.config, "global_segment_size": args.segment}
            engine["hicache_storage_backend"] = "mooncake"
            engine["hicache_storage_backend_extra_config"] = json.dumps(store)
            overrides = None
        else:  # each worker its own directory
            overrides = [{"hicache_storage_dir": str(root / f"l3-{i}")} for i in range(2)]
        router = RouterConfig(
            endpoint="tcp://127.0.0.1:*", tokenizer_workers=1, routing="round_robin"
        )
        srv = stack.enter_context(
            LocalServer(
                model,
                num_workers=2,
                config=router,
                engine_config=engine,
                worker_overrides=overrides,
            )
        )
        with Client(srv.endpoint, timeout=600) as c:
            start = time.perf_counter()
            samples = [_one(c, prompt, params) for _, prompt in reqs]
            wall = time.perf_counter() - start
            workers = [w.engine for w in c.stats().workers if w.alive]
    return summarize(samples, workers, wall)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="default", help="checkpoint (default: SmolLM2-135M)")
    ap.add_argument("--systems", type=int, default=7, help="system prompts (made odd)")
    ap.add_argument("--system", type=int, default=256, help="tokens of each system prompt")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--question", type=int, default=16, help="tokens of each question")
    ap.add_argument("--decode", type=int, default=8, help="tokens each request generates")
    ap.add_argument("--l1-pages", type=int, default=24, help="each worker's KV pool (16 tokens)")
    ap.add_argument("--segment", default="512mb", help="each worker's share of the store")
    ap.add_argument("--vocab", type=int, default=40000, help="token ids drawn below this")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke-sized run")
    ap.add_argument("--out", default="benchmarks/results/bench_store.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.systems, args.system, args.rounds, args.decode, args.l1_pages = 3, 64, 2, 2, 8
    args.systems += args.systems % 2 == 0  # odd: round-robin alternates each system's worker
    for name in args.configs.split(","):
        if name not in CONFIGS:
            ap.error(f"unknown configuration {name!r} (known: {', '.join(CONFIGS)})")
    return args


def main() -> None:
    args = parse()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from radixserve.model_store import resolve_model

    model = str(resolve_model(args.model))
    results: dict[str, Any] = {}
    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-store-") as root:
            results[name] = run(args, model, name, Path(root))
        print(name, json.dumps(results[name]), flush=True)
    if len(results) == len(CONFIGS):
        per, store = results["per-worker-l3"], results["mooncake"]
        results["ttft_p50_ratio_mooncake_over_per_worker"] = (
            store["ttft_p50_ms"] / per["ttft_p50_ms"]
        )
    if not args.out:
        return
    doc = {
        **header("bench_store"),
        "note": "two workers on the same machine, round-robin; figures are this run's ratios",
        "args": vars(args),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
