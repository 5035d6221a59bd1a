"""Radix cache bookkeeping benchmark: match+insert throughput, eviction cost, per-step overhead.

For each shared-prefix workload shape and page size, with the pool sized to ``--tokens``
cached tokens (default 1M):

* ``build``   requests go through the scheduler's calls (match_prefix of prompt[:-1], lock,
              alloc, cache_prefix of prompt+answer, unlock, free the private tail) until
              the tree holds ``--tokens`` tokens: request tokens/s, µs/request, hit rate;
* ``match``   match_prefix of prompts already in the tree (hot): query tokens/s;
* ``decode``  a steady-state serving loop at batch ``--batch`` with the pool full: every
              step each request appends a token (alloc a page when it crosses a page
              boundary, evicting LRU leaves), finished requests cache their sequence and
              release, new ones are admitted (match, lock, alloc, cache_prefix): the cache's
              bookkeeping per decode step, µs;
* ``evict``   draining the full tree in 64-token chunks: µs per freed page.

Shapes: ``chats`` (4 system prompts of ~1000 tokens, many chats of 64-256 + 64-256 tokens
under them), ``multiturn`` (deep chains: 64 conversations of 40 turns, each turn a request
over the whole history), ``fewshot`` (8 few-shot prefixes of ~2000 tokens after a shared
instruction, wide fans of short questions). Lengths are random, not page-aligned.

The bookkeeping per step is printed beside one SmolLM2 decode step at batch ``--batch``
(paged torch attention over ``--ctx`` tokens of history, and the dense 64×1-token forward
as a lower bound), timed interleaved with the bookkeeping (this machine's speed drifts).

    python benchmarks/bench_radix_cache.py                      # ~2-4 min on 2 cores
    python benchmarks/bench_radix_cache.py --tokens 100000 --no-model   # quick

Prints a table and writes JSON to ``benchmarks/results/bench_radix_cache.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# Before torch: radixserve sets the served process's OpenMP wait policy and spin count
# (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT), which the runtime reads once, when torch loads it.
import radixserve  # noqa: F401

# isort: split

from radixserve.memory import OutOfPagesError, PageAllocator, RadixCache  # noqa: E402  (pure Python: no torch)

Request = tuple[list[int], list[int]]  # (prompt, prompt + answer)
VOCAB = (100, 49000)


def _toks(rng: random.Random, lo: int, hi: int) -> list[int]:
    return rng.choices(range(*VOCAB), k=rng.randint(lo, hi))


def chats(seed: int) -> Iterator[Request]:
    rng = random.Random(seed)
    systems = [
        _toks(rng, 900, 1100) for _ in range(4)
    ]  # lengths not page-aligned, like real prompts
    while True:
        prompt = rng.choice(systems) + _toks(rng, 64, 256)
        yield prompt, prompt + _toks(rng, 64, 256)


def multiturn(seed: int, conversations: int = 64, turns: int = 40) -> Iterator[Request]:
    rng = random.Random(seed)
    system = _toks(rng, 200, 300)
    histories = [list(system) for _ in range(conversations)]
    counts = [0] * conversations
    for i in itertools.cycle(range(conversations)):
        if counts[i] == turns:
            histories[i], counts[i] = list(system), 0
        prompt = histories[i] + _toks(rng, 32, 128)
        full = prompt + _toks(rng, 32, 128)
        histories[i], counts[i] = full, counts[i] + 1
        yield prompt, full


def fewshot(seed: int) -> Iterator[Request]:
    rng = random.Random(seed)
    instruction = _toks(rng, 100, 150)
    prefixes = [instruction + _toks(rng, 1900, 2100) for _ in range(8)]
    while True:
        prompt = rng.choice(prefixes) + _toks(rng, 64, 192)
        yield prompt, prompt + _toks(rng, 16, 64)


SHAPES = {"chats": chats, "multiturn": multiturn, "fewshot": fewshot}


def _pages_for(n_tokens: int, ps: int) -> int:
    return -(-n_tokens // ps)


def serve_once(cache: RadixCache, alloc: PageAllocator, prompt: list[int], full: list[int]) -> None:
    """One request through the scheduler's calls, prefill and decode folded into one insert."""
    ps = cache.page_size
    m = cache.match_prefix(prompt[:-1])
    cache.lock(m.node)
    pages = m.pages + alloc.alloc(_pages_for(len(full), ps) - len(m.pages))
    c = cache.cache_prefix(full, pages, m.node)
    cache.unlock(c.node)
    alloc.free(c.pages[c.cached_len // ps :])


def build(cache: RadixCache, alloc: PageAllocator, gen: Iterator[Request], target: int) -> dict:
    ps = cache.page_size
    s0 = cache.stats
    n_req = n_tok = 0
    elapsed = 0.0
    recent: list[list[int]] = []
    while True:
        prompt, full = next(gen)
        if (
            cache.total_cached_tokens + len(full) > target
            or alloc.num_free < _pages_for(len(full), ps) + 1
        ):
            break
        t0 = time.thread_time()
        serve_once(cache, alloc, prompt, full)
        elapsed += time.thread_time() - t0
        n_req += 1
        n_tok += len(full)
        recent.append(prompt)
        if len(recent) > 2000:
            del recent[:1000]
    s1 = cache.stats
    return {
        "requests": n_req,
        "request_tokens": n_tok,
        "cached_tokens": cache.total_cached_tokens,
        "tokens_per_s": n_tok / elapsed,
        "us_per_request": 1e6 * elapsed / n_req,
        "hit_rate": (s1.hit_tokens - s0.hit_tokens) / max(1, s1.queried_tokens - s0.queried_tokens),
        "_recent": recent,
    }


def hot_match(cache: RadixCache, prompts: list[list[int]], n: int = 500) -> dict:
    rng = random.Random(1)
    sample = rng.sample(prompts, min(n, len(prompts)))
    tokens = sum(len(p) for p in sample)
    t0 = time.thread_time()
    for p in sample:
        cache.match_prefix(p, record_stats=False)
    dt_ = time.thread_time() - t0
    return {
        "tokens_per_s": tokens / dt_,
        "us_per_match": 1e6 * dt_ / len(sample),
        "avg_query_tokens": tokens / len(sample),
    }


class _Running:
    __slots__ = ("tokens", "answer", "emitted", "pages", "node")

    def __init__(
        self, tokens: list[int], answer: list[int], pages: list[int], node: object
    ) -> None:
        self.tokens, self.answer, self.emitted, self.pages, self.node = (
            tokens,
            answer,
            0,
            pages,
            node,
        )


def decode_sim(
    cache: RadixCache,
    alloc: PageAllocator,
    gen: Iterator[Request],
    batch: int,
    steps: int,
    warmup: int,
) -> dict:
    """Steady-state serving loop with a full pool; returns the cache's bookkeeping per decode step.

    Only the cache and allocator calls are timed (not this loop's own token appends), by
    wall clock and by this thread's CPU time: the bookkeeping is one thread, so its CPU time
    is what it would take on an idle machine (this one is shared).
    """
    ps = cache.page_size
    running: list[_Running] = []
    wall = cpu = 0.0
    evicted0 = admitted = finished = retracted = 0
    pending: list[Request] = []
    clock, tclock = time.perf_counter, time.thread_time
    for step in range(warmup + steps):
        if step == warmup:
            wall = cpu = 0.0
            evicted0, admitted, finished, retracted = cache.stats.evicted_pages, 0, 0, 0
        while len(pending) < batch - len(running):
            pending.append(next(gen))
        t0, c0 = clock(), tclock()
        while pending and len(running) < batch:  # admission + prefill (one chunk)
            prompt, full = pending[0]
            m = cache.match_prefix(prompt[:-1])
            cache.lock(m.node)
            try:
                new = alloc.alloc(_pages_for(len(prompt), ps) - len(m.pages))
            except OutOfPagesError:
                cache.unlock(m.node)
                break
            pending.pop(0)
            c = cache.cache_prefix(prompt, m.pages + new, m.node)
            running.append(_Running(list(prompt), full[len(prompt) :], c.pages, c.node))
            admitted += 1
        wall += clock() - t0
        cpu += tclock() - c0
        still: list[_Running] = []
        for r in running:  # one decode token each
            r.tokens.append(r.answer[r.emitted])
            r.emitted += 1
            done = r.emitted == len(r.answer)
            if len(r.pages) * ps >= len(r.tokens) and not done:
                still.append(r)
                continue
            t0, c0 = clock(), tclock()
            if len(r.pages) * ps < len(r.tokens):
                try:
                    r.pages += alloc.alloc(1)
                except OutOfPagesError:  # retract: give everything back
                    cache.unlock(r.node)
                    alloc.free(r.pages[r.node.depth // ps :])
                    retracted += 1
                    done = True
            if done:
                c = cache.cache_prefix(
                    r.tokens[:-1], r.pages, r.node
                )  # the last token has no KV yet
                cache.unlock(c.node)
                alloc.free(c.pages[c.cached_len // ps :])
                finished += 1
            else:
                still.append(r)
            wall += clock() - t0
            cpu += tclock() - c0
        running = still
    for r in running:  # release what is left (not timed)
        cache.unlock(r.node)
        alloc.free(r.pages[r.node.depth // ps :])
    return {
        "us_per_step": 1e6 * wall / steps,
        "cpu_us_per_step": 1e6 * cpu / steps,
        "admitted_per_step": admitted / steps,
        "finished_per_step": finished / steps,
        "evicted_pages_per_step": (cache.stats.evicted_pages - evicted0) / steps,
        "retracted": retracted,
    }


def drain(cache: RadixCache) -> dict:
    ps = cache.page_size
    chunk = max(1, 64 // ps)
    pages = cache.num_evictable_pages
    t0 = time.thread_time()
    while cache.evict(chunk):
        pass
    dt_ = time.thread_time() - t0
    return {
        "us_per_page": 1e6 * dt_ / max(1, pages),
        "us_per_64_tokens": 1e6 * dt_ / max(1, pages * ps / 64),
        "pages": pages,
    }


def run_shape(shape: str, ps: int, target: int, batch: int, steps: int, seed: int) -> dict:
    gc.collect()
    alloc = PageAllocator(_pages_for(target, ps) + batch * _pages_for(4096, ps))
    cache = RadixCache(alloc, ps)
    gen = SHAPES[shape](seed)
    b = build(cache, alloc, gen, target)
    recent = b.pop("_recent")
    m = hot_match(cache, recent)
    nodes = _count_nodes(cache)
    # Fill the headroom so that the decode loop runs with eviction, as a full server does.
    while alloc.num_free > batch * _pages_for(300, ps):
        prompt, full = next(gen)
        serve_once(cache, alloc, prompt, full)
    d = decode_sim(cache, alloc, gen, batch, steps, warmup=steps // 2)
    e = drain(cache)
    cache.check_invariants()
    return {
        "shape": shape,
        "page_size": ps,
        "nodes": nodes,
        "build": b,
        "match": m,
        "decode": d,
        "evict": e,
    }


def _count_nodes(cache: RadixCache) -> int:
    stack, n = list(cache._roots.values()), 0
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        n += 1
    return n


# ------------------------------------------------------------------ the model side


def load_decode_step(model_path: str, batch: int, ctx: int):
    """Returns (paged_step, dense_step) callables that run one SmolLM2 forward at batch ``batch``."""
    import torch

    from radixserve.memory import KVPool
    from radixserve.model.attention.dense import DenseAttentionBackend
    from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend
    from radixserve.model.forward_batch import ForwardBatch
    from radixserve.model.loader import load_model

    model = load_model(model_path, dtype=torch.float32)
    cfg = model.config
    ps = 16
    per_seq = _pages_for(ctx + 1, ps)
    pool = KVPool(cfg.num_layers, batch * per_seq, ps, cfg.num_kv_heads, cfg.head_dim)
    for t in pool.k_data + pool.v_data:
        t.normal_()
    table = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), ctx + 1, dtype=torch.int32)
    ones = torch.ones(batch, dtype=torch.int32)
    paged = ForwardBatch(
        input_ids=torch.randint(100, 40000, (batch,)),
        positions=torch.full((batch,), ctx, dtype=torch.int64),
        seq_lens=lens,
        extend_lens=ones,
        prefix_lens=lens - 1,
        extend_start_loc=torch.arange(batch, dtype=torch.int32),
        logits_indices=torch.arange(batch, dtype=torch.int64),
        seq_lens_cpu=[ctx + 1] * batch,
        extend_lens_cpu=[1] * batch,
        out_cache_loc=(table[:, ctx // ps].to(torch.int64) * ps + ctx % ps),
        page_table=table,
        page_size=ps,
    )
    dense = ForwardBatch.for_full_sequences([[7]] * batch)
    paged_attn, dense_attn = TorchPagedAttentionBackend(pool), DenseAttentionBackend()

    def paged_step() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(paged, paged_attn)
        return time.perf_counter() - t0

    def dense_step() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(dense, dense_attn)
        return time.perf_counter() - t0

    paged_step(), dense_step()  # warm up
    return paged_step, dense_step


def compare_with_model(args: argparse.Namespace, results: list[dict]) -> dict:
    paged_step, dense_step = load_decode_step(args.model, args.batch, args.ctx)
    rounds = []
    for _ in range(3):  # interleaved: model steps, then the bookkeeping of the chats shape at ps 16
        paged = min(paged_step() for _ in range(3))
        dense = min(dense_step() for _ in range(3))
        d = run_shape("chats", 16, min(args.tokens, 200_000), args.batch, 100, args.seed + 7)[
            "decode"
        ]
        rounds.append(
            {
                "paged_step_ms": 1e3 * paged,
                "dense_step_ms": 1e3 * dense,
                "bookkeeping_cpu_us": d["cpu_us_per_step"],
                "bookkeeping_wall_us": d["us_per_step"],
            }
        )
    paged_ms = statistics.median(r["paged_step_ms"] for r in rounds)
    dense_ms = statistics.median(r["dense_step_ms"] for r in rounds)
    book = statistics.median(r["bookkeeping_cpu_us"] for r in rounds)
    worst = max(results, key=lambda r: r["decode"]["cpu_us_per_step"]) if results else None
    out = {
        "batch": args.batch,
        "ctx": args.ctx,
        "rounds": rounds,
        "paged_step_ms": paged_ms,
        "dense_step_ms": dense_ms,
        "bookkeeping_cpu_us": book,
        "ratio_paged": book / (1e3 * paged_ms),
        "ratio_dense": book / (1e3 * dense_ms),
    }
    if worst is not None:
        out["worst"] = {
            "shape": worst["shape"],
            "page_size": worst["page_size"],
            "cpu_us_per_step": worst["decode"]["cpu_us_per_step"],
            "ratio_dense": worst["decode"]["cpu_us_per_step"] / (1e3 * dense_ms),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1_000_000, help="cached tokens the pool holds")
    p.add_argument("--page-sizes", default="1,16,64")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--steps", type=int, default=300, help="measured decode steps (after as many/2 warm-up)"
    )
    p.add_argument("--ctx", type=int, default=256, help="history length of the paged decode step")
    p.add_argument("--model", default=os.environ.get("RADIXSERVE_BENCH_MODEL", "/tmp/smol/hf"))
    p.add_argument("--no-model", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "bench_radix_cache.json")
    )
    args = p.parse_args()

    results = []
    print(
        f"{'shape':10} {'ps':>3} {'nodes':>7} {'build tok/s':>12} {'us/req':>7} {'hit':>6} "
        f"{'match tok/s':>12} {'us/match':>8} {'step us':>8} {'(wall)':>8} {'evict/step':>10} {'evict us/pg':>11}"
    )
    for shape in args.shapes.split(","):
        for ps in (int(x) for x in args.page_sizes.split(",")):
            r = run_shape(shape, ps, args.tokens, args.batch, args.steps, args.seed)
            results.append(r)
            b, m, d, e = r["build"], r["match"], r["decode"], r["evict"]
            print(
                f"{shape:10} {ps:>3} {r['nodes']:>7} {b['tokens_per_s']:>12,.0f} {b['us_per_request']:>7.1f} "
                f"{b['hit_rate']:>6.3f} {m['tokens_per_s']:>12,.0f} {m['us_per_match']:>8.1f} "
                f"{d['cpu_us_per_step']:>8.1f} {d['us_per_step']:>8.1f} "
                f"{d['evicted_pages_per_step']:>10.1f} {e['us_per_page']:>11.2f}",
                flush=True,
            )

    model = None
    if args.no_model or not Path(args.model).is_dir():
        print(
            f"\nmodel comparison skipped ({'--no-model' if args.no_model else f'no model at {args.model}'}): "
            "the 5% target needs a SmolLM2 decode step beside the bookkeeping figures above"
        )
    else:
        model = compare_with_model(args, results)
        print(
            f"\nSmolLM2 decode step at batch {args.batch} (fp32, CPU, torch {_torch_threads()} threads; best of 3),"
            " interleaved with the cache bookkeeping of the chats shape at page size 16 (CPU time):"
        )
        for r in model["rounds"]:
            print(
                f"  paged, {args.ctx} tokens of history: {r['paged_step_ms']:7.1f} ms   dense 64x1 token: "
                f"{r['dense_step_ms']:7.1f} ms   bookkeeping: {r['bookkeeping_cpu_us']:6.1f} us "
                f"(wall {r['bookkeeping_wall_us']:.1f} us)"
            )
        print(
            f"  median bookkeeping = {100 * model['ratio_paged']:.4f}% of the paged step, "
            f"{100 * model['ratio_dense']:.4f}% of the dense lower bound (target < 5%)"
        )
        if "worst" in model:
            w = model["worst"]
            print(
                f"  worst row of the table ({w['shape']}, page size {w['page_size']}): {w['cpu_us_per_step']:.1f} us "
                f"= {100 * w['ratio_dense']:.4f}% of the dense step"
            )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "radix_cache",
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "machine": {
                    "python": sys.version.split()[0],
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                },
                "args": vars(args),
                "results": results,
                "model_comparison": model,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
