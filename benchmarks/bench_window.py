"""Sliding-window KV memory and prefix-cache hit rate: a Gemma-3-shaped model with its window
pool against the same weights with the window disabled, under the same KV byte budget.

Two random-weight checkpoints from transformers' own Gemma 3 text classes (built once under
``--workdir``): the window model (``--window``, ``--pattern`` - 1 sliding layers to 1
global), and its copy whose ``config.json`` marks every layer ``full_attention`` (the same
weights; every layer keeps every token's KV). Both run through the offline engine with the
same KV bytes: ``--budget-seqs`` sequences of full KV for every layer (``N`` pages); the
window engine splits those bytes as start-up does (``G`` global + ``W`` window pages,
``radixserve/engine/window_setup.py``), the full engine gets the ``N`` pages.

Two workloads from ``workloads.shared_system`` (prompts several windows long), every request
submitted at once:

- ``shared``: ``--systems`` long system prompts shared by ``--requests`` one-turn chats;
- ``distinct``: the same sizes with a system prompt of its own per request (no sharing) and
  answers of ``--hold-tokens`` tokens, so requests stay while others arrive and the
  sequences held at once are what the pool's bytes allow.

Reported per workload and model: the peak of sequences running at once; the prefix-cache hit
rate (cached prompt tokens / prompt tokens) beside the workload's optimum; the peak of global
pages held by running requests and, for the window model, of window pages they need; output
tokens per second (on a loaded machine only the ratio of the two models means anything); for
the window model the window pages released by running requests and tombstoned in the tree,
and the tokens given up because a hit's last window was gone. Beside them the arithmetic: what the
pool allows for sequences of the distinct workload's length (``N // pages`` full; ``min(G //
pages, W // window pages)`` windowed), and what ``radixserve memory`` predicts (its KV
bytes per sequence with and without the window bound, for the same budget). Finally, for
the window model, ``--verify`` requests that hit the cache are rerun cold (radix cache off,
one at a time): their greedy tokens must equal the hit's.

vLLM reported its prefix-cache hit rate falling to 0 on hybrid models (issue #45238); this
measures ours on the same kind of model, against its own window-disabled twin.

    python benchmarks/bench_window.py            # window 512, prompts ~2k tokens
    python benchmarks/bench_window.py --quick    # tiny shapes: does it run

Writes ``--out`` (default ``benchmarks/results/bench_window.json``; ``--quick``: under /tmp).
"""

from __future__ import annotations

# Before torch: radixserve sets the OpenMP wait policy (read once, when torch loads).
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE))  # `workloads`, `provenance`
sys.path.insert(1, str(HERE.parent / "tests"))  # `tiny_models`: transformers' random checkpoints
import provenance  # noqa: E402
import workloads  # noqa: E402

from radixserve.engine.config import EngineConfig  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.engine.window_setup import plan_window_pool  # noqa: E402
from radixserve.memory.swa_cache import SWARadixCache  # noqa: E402
from radixserve.model.config import ModelConfig  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402


def gemma3_config(args: argparse.Namespace) -> dict[str, Any]:
    """transformers overrides of the window model (the full twin only changes layer_types)."""
    return {
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": args.hidden // 4,
        "query_pre_attn_scalar": args.hidden // 4,
        "sliding_window": args.window,
        "sliding_window_pattern": args.pattern,
        "max_position_embeddings": 8 * args.system_tokens + 1024,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }


def build_pair(workdir: Path, overrides: dict[str, Any]) -> tuple[Path, Path]:
    """(window model, its window-disabled twin), built once under ``workdir``."""
    import tiny_models

    key = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:12]
    window, full = workdir / f"gemma3-{key}", workdir / f"gemma3-{key}-full"
    if not (window / "config.json").exists():
        print(f"building a random Gemma 3 checkpoint in {window} ...", flush=True)
        tiny_models.build_tiny_family(window, "gemma3_text", tokenizer=True, **overrides)
    if not (full / "config.json").exists():
        shutil.copytree(window, full, dirs_exist_ok=True)
        raw = json.loads((window / "config.json").read_text())
        raw["layer_types"] = ["full_attention"] * int(raw["num_hidden_layers"])
        (full / "config.json").write_text(json.dumps(raw, indent=2))
    return window, full


def pool_allows(
    n_full: int, plan: tuple[int, int], seq_len: int, args: argparse.Namespace
) -> dict[str, int]:
    """Distinct sequences of ``seq_len`` tokens the pools hold at once, by arithmetic: full KV
    needs ``pages(seq_len)`` pages each; the window pool ``pages(seq_len)`` global pages and
    the window and the chunk being written, plus a page of rounding, in window pages."""
    ps = args.page_size
    pages = math.ceil(seq_len / ps)
    g, w = plan
    window_pages = math.ceil(min(seq_len, args.window + args.chunk) / ps) + 1
    return {"full": n_full // pages, "window": min(g // pages, w // window_pages)}


def memory_prediction(
    path: Path, seq_len: int, budget: int, args: argparse.Namespace
) -> dict[str, Any]:
    """What ``radixserve memory`` says for this model: KV bytes per sequence with full KV and
    with the window bound, and the sequences ``budget`` KV bytes hold for each."""
    from radixserve.commands.memory import _arguments, memory_report

    ap = argparse.ArgumentParser()
    _arguments(ap)
    margs = ap.parse_args(
        ["--model", str(path), "--seq-len", str(seq_len), "--page-size", str(args.page_size)]
        + ["--max-num-tokens", str(args.chunk), "--device", "cpu", "--memory-budget", "1GiB"]
    )
    rep = memory_report(ModelConfig.from_pretrained(path), margs)
    bound = rep["sliding_window"]
    full = int(rep["kv_bytes_per_sequence"])
    return {
        "kv_bytes_per_sequence_full": full,
        "kv_bytes_per_sequence_window": int(bound.bytes_per_sequence),
        "sequences_full": budget // full,
        "sequences_window": budget // int(bound.bytes_per_sequence),
        "text": bound.describe().strip(),
    }


def run(engine: Engine, wl: workloads.Workload) -> dict[str, Any]:
    """Every request of ``wl`` submitted at once, stepped to the end: peak running, hit rate,
    output tokens per second, and per request (prompt, tokens, cached tokens)."""
    reqs = wl.requests
    ids = []
    for r in reqs:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(list(r.prompt_ids), params))
    toks: dict[str, list[int]] = {i: [] for i in ids}
    cached: dict[str, int] = {}
    peak = held = in_window = 0
    cache = engine.cache
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            if o.usage is not None:
                cached[o.request_id] = o.usage.cached_tokens
        running = engine.scheduler.running
        peak = max(peak, len(running))
        held = max(held, sum(len(r.pages) for r in running))
        if isinstance(cache, SWARadixCache):
            in_window = max(in_window, cache.num_window_in_use)
    wall = time.perf_counter() - t0
    prompt = sum(len(r.prompt_ids) for r in reqs)
    out = sum(len(t) for t in toks.values())
    return {
        "peak_running": peak,
        # Summed over running requests (a page two requests share counts twice): global
        # pages (every page without a window), and window pages running requests need.
        "peak_pages_held_by_running": held,
        "peak_window_pages_in_use": in_window,
        "prompt_tokens": prompt,
        "cached_prompt_tokens": sum(cached.values()),
        "hit_rate": sum(cached.values()) / prompt,
        "output_tokens": out,
        "output_tokens_per_s": out / wall,
        "per_request": [(list(r.prompt_ids), toks[i], cached[i]) for r, i in zip(reqs, ids)],
    }


def window_counters(engine: Engine) -> dict[str, int]:
    cache = engine.cache
    assert isinstance(cache, SWARadixCache)
    return {
        "window_pages_released": cache.window.released_pages,
        "window_pages_tombstoned": cache.window_evicted_pages,
        "window_cut_tokens": cache.window_cut_tokens,
    }


def verify_hits(
    path: Path, hits: list[tuple[list[int], list[int], int]], kw: dict[str, Any]
) -> dict[str, int]:
    """Rerun requests that hit the cache cold (radix cache off, one at a time): how many
    give the same greedy tokens."""
    engine = Engine(str(path), disable_radix_cache=True, **kw)
    same = 0
    try:
        for prompt, tokens, _ in hits:
            params = SamplingParams(max_tokens=len(tokens), temperature=0.0, ignore_eos=True)
            (out,) = engine.generate([prompt], params)
            same += out.token_ids == tokens
    finally:
        engine.close()
    return {"checked": len(hits), "equal": same}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--pattern", type=int, default=6, help="every n-th layer global (5:1)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hold-tokens", type=int, default=256, help="max_tokens of `distinct`")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="max_num_tokens (prefill chunk)")
    ap.add_argument(
        "--budget-seqs", type=float, default=6.0, help="KV bytes: this many full-KV sequences"
    )
    ap.add_argument("--window-kv-ratio", type=float, default=0.5)
    ap.add_argument("--verify", type=int, default=4, help="hit requests rerun cold")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=str(Path.home() / ".cache/radixserve/bench_window"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few requests")
    given = argv if argv is not None else sys.argv[1:]
    if "--quick" in given:  # tiny shapes; options given beside --quick still win
        ap.set_defaults(window=32, layers=6, hidden=64, system_tokens=160, systems=2)
        ap.set_defaults(requests=8, max_tokens=6, hold_tokens=48, page_size=4, chunk=64)
        ap.set_defaults(verify=2, workdir=None)
    args = ap.parse_args(argv)
    if args.workdir is None:
        args.workdir = tempfile.mkdtemp(prefix="bench_window_")
    if args.out is None:
        tmp = Path(tempfile.gettempdir()) / "bench_window_quick.json"
        args.out = str(tmp if args.quick else HERE / "results" / "bench_window.json")
    return args


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoTokenizer

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    overrides = gemma3_config(args)
    window_path, full_path = build_pair(Path(args.workdir), overrides)
    tok = AutoTokenizer.from_pretrained(str(window_path))
    shape = {"requests": args.requests, "system_tokens": args.system_tokens}
    wls = {
        "shared": workloads.shared_system(
            tok, seed=args.seed, systems=args.systems, max_tokens=args.max_tokens, **shape
        ),
        # Long answers: requests stay while others arrive, so the pool's bytes bound them.
        "distinct": workloads.shared_system(
            tok, seed=args.seed, systems=args.requests, max_tokens=args.hold_tokens, **shape
        ),
    }
    seq_len = max(len(r.prompt_ids) for r in wls["distinct"].requests) + args.hold_tokens
    mc = ModelConfig.from_pretrained(window_path)
    assert ModelConfig.from_pretrained(full_path).layer_window(0) is None
    n_full = math.ceil(args.budget_seqs * seq_len / args.page_size)
    ecfg = EngineConfig(page_size=args.page_size, window_kv_ratio=args.window_kv_ratio)
    plan = plan_window_pool(ecfg, mc, n_full, window_map=True)
    assert plan is not None
    kw: dict[str, Any] = {"page_size": args.page_size, "max_num_tokens": args.chunk}
    kw["max_running_requests"] = args.requests
    engines = {
        "window": Engine(
            str(window_path), num_pages=plan.num_pages, window_kv_ratio=args.window_kv_ratio, **kw
        ),
        "full": Engine(str(full_path), num_pages=n_full, **kw),
    }
    budget = engines["full"].pool.nbytes
    results: dict[str, Any] = {}
    hits: list[tuple[list[int], list[int], int]] = []
    try:
        for wname, wl in wls.items():
            row: dict[str, Any] = {"workload": wl.summary(args.page_size)}
            for name, engine in engines.items():
                engine.cache.reset()
                before = window_counters(engine) if name == "window" else {}
                r = run(engine, wl)
                per = r.pop("per_request")
                if name == "window":
                    after = window_counters(engine)
                    r |= {k: after[k] - before[k] for k in after}
                    if wname == "shared":
                        hits = [p for p in per if p[2] > 0][: args.verify]
                row[name] = r
                print(
                    f"{wname:8s} {name:6s} peak running {r['peak_running']:3d}, hit rate "
                    f"{r['hit_rate']:.3f}, {r['output_tokens_per_s']:.1f} output tok/s",
                    flush=True,
                )
            row["window_over_full_throughput"] = (
                row["window"]["output_tokens_per_s"] / row["full"]["output_tokens_per_s"]
            )
            results[wname] = row
        pools = {
            name: {
                "nbytes": e.pool.nbytes,
                "pages": e.pool.num_pages,
                "window_pages": e.pool.num_window_pages if e.pool.window_layers else 0,
            }
            for name, e in engines.items()
        }
    finally:
        for e in engines.values():
            e.close()
    verified = verify_hits(window_path, hits, kw) if hits else {"checked": 0, "equal": 0}
    print(f"hits rerun cold: {verified['equal']} of {verified['checked']} equal", flush=True)
    out = {
        **provenance.header("bench_window"),
        "command": " ".join(
            ["python", "benchmarks/bench_window.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "seed": args.seed,
        "quick": args.quick,
        "model": overrides,
        "window_layers": sorted(plan.layers),
        "page_size": args.page_size,
        "chunk": args.chunk,
        "window_kv_ratio": args.window_kv_ratio,
        "budget": {
            "full_kv_pages": n_full,
            "global_pages": plan.num_pages,
            "window_pages": plan.num_window_pages,
            "kv_bytes": budget,
        },
        "pools": pools,
        "seq_len": seq_len,
        "pool_allows": pool_allows(n_full, (plan.num_pages, plan.num_window_pages), seq_len, args),
        "radixserve_memory": memory_prediction(window_path, seq_len, budget, args),
        "results": results,
        "hits_rerun_cold": verified,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
