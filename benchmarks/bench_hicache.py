"""Hierarchical prefix cache benchmark: shared prefixes several times larger than L1.

The workload (``workloads.shared_system``): ``--systems`` system prompts of about
``--system-tokens`` tokens, ``--requests`` one-turn chats under them in shuffled order, kept
``--concurrency`` in flight (closed loop). The L1 pool holds about ``--l1-systems`` system
prompts (plus room for the running requests), so without lower tiers most returning system
prompts were evicted by the time they come back.

Four engines (same model, same L1) run it at once, interleaved step by step in one process
(a 2-core CPU VM's speed drifts by ~3x between runs: only same-run ratios mean anything); each
engine's throughput is its tokens over the time spent in its own steps:

    L1            the radix cache alone
    L1+L2         + host memory for every prefix (``--enable-hierarchical-cache``)
    L1+L2+L3      + a small L2 (as big as L1) spilling to page files (``--hicache-storage-dir``)
    unbounded     L1 large enough for everything (the hit-rate reference)

Then a restart: the L1+L2+L3 engine shuts down (writing L1 and L2 to its directory), a new
engine starts over the same directory ("warm") beside one without ("cold"), and the first
``--restart-requests`` requests (distinct system prompts) run one at a time on each,
alternating; TTFT is the wall time of a one-token generation.

    python benchmarks/bench_hicache.py                    # SmolLM2 (fetched on first use), a few minutes
    # 32 prompts of ~1000 tokens over an L1 of 8:
    python benchmarks/bench_hicache.py --systems 32 --system-tokens 1000 --requests 64 --l1-systems 8

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))  # `workloads`, after a PYTHONPATH checkout

import workloads as wl  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model_store import resolve_model  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402


class Driver:
    """Feeds one engine the workload, ``concurrency`` requests in flight, and times its steps."""

    def __init__(
        self,
        name: str,
        engine: Engine,
        prompts: list[tuple[int, ...]],
        max_tokens: int,
        concurrency: int,
    ) -> None:
        self.name, self.engine = name, engine
        self.queue = deque(prompts)
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.concurrency = concurrency
        self.in_flight = 0
        self.busy_s = 0.0
        self.tokens = 0
        self.outputs: dict[str, list[int]] = {}

    @property
    def done(self) -> bool:
        return not self.queue and self.in_flight == 0

    def step(self) -> None:
        while self.queue and self.in_flight < self.concurrency:
            prompt = self.queue.popleft()
            self.engine.add_request(list(prompt), self.params)
            self.in_flight += 1
            self.tokens += len(prompt)
        t0 = time.perf_counter()
        outs = self.engine.step()
        self.busy_s += time.perf_counter() - t0
        for o in outs:
            self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            self.tokens += len(o.new_token_ids)
            if o.finished:
                self.in_flight -= 1

    def result(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {
            "throughput_tok_s": self.tokens / self.busy_s,
            "hit_rate": s.hit_rate,
            "busy_s": self.busy_s,
            "tokens": self.tokens,
            "computed_tokens": s.computed_tokens_total,
            "demoted_pages": s.demoted_pages_total,
            "loaded_l2_pages": s.loaded_host_pages_total,
            "loaded_l3_pages": s.loaded_storage_pages_total,
            "l3_written_pages": s.storage_written_pages_total,
        }


def ttft(engine: Engine, prompt: tuple[int, ...]) -> tuple[float, int]:
    """Wall time of a one-token generation (prefill + first token) and the cached prompt tokens."""
    t0 = time.perf_counter()
    (out,) = engine.generate(
        [list(prompt)], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    )
    return time.perf_counter() - t0, out.usage.cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--systems", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--l1-systems", type=int, default=4, help="system prompts L1 holds")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--restart-requests", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/bench_hicache.json")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    model = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(model))
    work = wl.shared_system(
        tok,
        seed=args.seed,
        systems=args.systems,
        requests=args.requests,
        system_tokens=args.system_tokens,
        max_tokens=args.max_tokens,
    )
    prompts = [s[0].prompt_ids for s in work.sessions]
    longest = max(len(p) for p in prompts) + args.max_tokens
    ps = args.page_size
    if args.concurrency > args.l1_systems:
        ap.error(
            "--concurrency must not exceed --l1-systems (each request in flight holds its system prompt in L1)"
        )
    # L1: the system prompts it should hold, plus each request's own tail (question + output).
    tail_pages = -(-(longest - args.system_tokens) // ps) + 1
    l1_pages = args.l1_systems * -(-args.system_tokens // ps) + args.concurrency * tail_pages
    # Unbounded: every system prompt and every request's tail stay cached.
    all_pages = (
        args.systems * -(-args.system_tokens // ps) + (len(prompts) + args.concurrency) * tail_pages
    )
    base = {"page_size": ps, "max_num_tokens": 2048, "max_running_requests": args.concurrency}
    probe = Engine(str(model), num_pages=1, **base)
    page_gib = probe.pool.bytes_per_page / 2**30
    del probe
    storage = tempfile.mkdtemp(prefix="bench-hicache-")
    try:
        engines = {
            "L1": Engine(str(model), num_pages=l1_pages, **base),
            "L1+L2": Engine(
                str(model),
                num_pages=l1_pages,
                enable_hierarchical_cache=True,
                hicache_size=all_pages * page_gib,
                **base,
            ),
            "L1+L2+L3": Engine(
                str(model),
                num_pages=l1_pages,
                hicache_size=l1_pages * page_gib,
                hicache_storage_dir=storage,
                **base,
            ),
            "unbounded": Engine(str(model), num_pages=all_pages, **base),
        }
        drivers = [
            Driver(name, e, prompts, args.max_tokens, args.concurrency)
            for name, e in engines.items()
        ]
        print(
            f"{len(prompts)} requests, {args.systems} system prompts of ~{args.system_tokens} tokens; "
            f"L1 {l1_pages} pages of {ps} (~{args.l1_systems} system prompts), unbounded {all_pages}",
            flush=True,
        )
        k = 0
        while not all(d.done for d in drivers):
            order = drivers if k % 2 == 0 else drivers[::-1]  # alternate who goes first
            for d in order:
                if not d.done:
                    d.step()
            k += 1
        results = {d.name: d.result() for d in drivers}
        ref = drivers[-1].outputs
        same = {d.name: sorted(d.outputs.values()) == sorted(ref.values()) for d in drivers}
        for name in list(engines):
            if name != "L1+L2+L3":
                del engines[name]
        gc.collect()

        # Restart: the tiered engine shuts down; a warm one starts over its directory.
        engines["L1+L2+L3"].close()
        del engines["L1+L2+L3"], drivers
        warm = Engine(
            str(model),
            num_pages=l1_pages,
            hicache_size=l1_pages * page_gib,
            hicache_storage_dir=storage,
            **base,
        )
        cold = Engine(str(model), num_pages=l1_pages, **base)
        firsts: list[tuple[int, ...]] = []
        seen: set[tuple[int, ...]] = set()
        for p in prompts:
            head = p[: args.system_tokens // 2]
            if head not in seen:
                seen.add(head)
                firsts.append(p)
        restart: dict[str, list[float]] = {"warm": [], "cold": []}
        cached: dict[str, list[int]] = {"warm": [], "cold": []}
        for i, p in enumerate(firsts[: args.restart_requests]):
            for name, e in (
                (("warm", warm), ("cold", cold)) if i % 2 == 0 else (("cold", cold), ("warm", warm))
            ):
                t, c = ttft(e, p)
                restart[name].append(t)
                cached[name].append(c)
    finally:
        shutil.rmtree(storage, ignore_errors=True)

    l1 = results["L1"]["throughput_tok_s"]
    print(
        f"\n{'config':<11} {'throughput':>11} {'vs L1':>6} {'hit rate':>9} {'of unbounded':>13} "
        f"{'L2 loads':>9} {'L3 loads':>9}"
    )
    for name, r in results.items():
        print(
            f"{name:<11} {r['throughput_tok_s']:>8.0f} t/s {r['throughput_tok_s'] / l1:>5.2f}x {r['hit_rate']:>8.1%} "
            f"{r['hit_rate'] / results['unbounded']['hit_rate']:>12.1%} "
            f"{r['loaded_l2_pages']:>9} {r['loaded_l3_pages']:>9}"
        )
    w, c = statistics.median(restart["warm"]), statistics.median(restart["cold"])
    print(
        f"\nrestart, first {len(restart['warm'])} requests: TTFT median warm {w * 1000:.0f} ms, cold {c * 1000:.0f} ms "
        f"({c / w:.1f}x lower warm); cached tokens warm {cached['warm']}, cold {cached['cold']}"
    )
    print(f"greedy outputs identical to the unbounded cache's: {same}")
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "args": vars(args),
        "l1_pages": l1_pages,
        "unbounded_pages": all_pages,
        "results": results,
        "outputs_identical": same,
        "restart": {
            "ttft_s": restart,
            "cached_tokens": cached,
            "median_warm_s": w,
            "median_cold_s": c,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
