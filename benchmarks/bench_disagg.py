"""Prefill/decode disaggregation against colocated workers: decode inter-token latency under
long prompts, and what the KV transfer costs.

The workload (seeded token ids, real workers behind a real router, ZeroMQ clients)::

    decoders  --decoders streams with a short prompt (--short tokens) generating --decode
              tokens each (ignore_eos), started together
    prompts   --long-prompts prompts of --long tokens each (max_tokens 1), sent one after
              another while the decoders run

Configurations, each its own server on this machine, run one after the other:

    colocated  2 workers (cache-aware routing): long prompts and decodes share workers
    disagg     1 prefill + 1 decode worker (serve --disaggregation prefill:1,decode:1)

Reported per configuration: the decoders' inter-token gaps (client-side, between streamed
chunks) p50 / p99 / max, the long prompts' TTFT p50; for disagg also the transfer's bytes
and seconds per moved prompt token (the workers' own counters). What two cores can show:
both configurations run two worker processes on the same two cores, so disaggregation
cannot add compute here; it only moves where the prefill runs. On a loaded or small machine
compare the two configurations of one run (ratios), never absolute times.

    python benchmarks/bench_disagg.py                  # minutes on 2 cores
    python benchmarks/bench_disagg.py --quick --out ''  # a smoke check, print only

Writes JSON to ``benchmarks/results/bench_disagg.json`` (date, commit, CPU model).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # provenance
from provenance import machine as provenance_machine  # noqa: E402

from radixserve.sampling_params import SamplingParams  # noqa: E402
from radixserve.serving.client import Client  # noqa: E402
from radixserve.serving.router.launcher import LocalServer  # noqa: E402
from radixserve.serving.router.router import RouterConfig  # noqa: E402
from radixserve.serving.wire import protocol as p  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _decoder(endpoint: str, prompt: list[int], n: int, gaps: list[float]) -> None:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with Client(endpoint, timeout=600) as c:
        last = None
        for ev in c.stream(input_ids=prompt, params=params):
            now = time.perf_counter()
            if isinstance(ev, p.GenerateChunk) and last is not None:
                gaps.append(now - last)
            last = now


def run(args: argparse.Namespace, model: str, disagg: bool) -> dict[str, Any]:
    rng = random.Random(args.seed)
    vocab = args.vocab
    shorts = [[rng.randrange(100, vocab) for _ in range(args.short)] for _ in range(args.decoders)]
    longs = [
        [rng.randrange(100, vocab) for _ in range(args.long)] for _ in range(args.long_prompts)
    ]
    router = RouterConfig(endpoint="tcp://127.0.0.1:*", tokenizer_workers=1, disaggregation=disagg)
    overrides = (
        [{"disaggregation_mode": "prefill"}, {"disaggregation_mode": "decode"}] if disagg else None
    )
    engine = {"max_num_tokens": args.chunk} if args.chunk else {}
    with LocalServer(
        model, num_workers=2, config=router, engine_config=engine, worker_overrides=overrides
    ) as srv:
        gaps: list[float] = []
        threads = [
            threading.Thread(target=_decoder, args=(srv.endpoint, s, args.decode, gaps))
            for s in shorts
        ]
        for t in threads:
            t.start()
        ttfts = []
        with Client(srv.endpoint, timeout=600) as c:
            one = SamplingParams(max_tokens=1, temperature=0.0)
            for prompt in longs:
                start = time.perf_counter()
                c.generate(input_ids=prompt, params=one)
                ttfts.append(time.perf_counter() - start)
            for t in threads:
                t.join()
            workers = [w.engine for w in c.stats().workers]
    out: dict[str, Any] = {
        "itl_p50_ms": 1e3 * _pct(gaps, 0.5),
        "itl_p99_ms": 1e3 * _pct(gaps, 0.99),
        "itl_max_ms": 1e3 * max(gaps, default=float("nan")),
        "gaps": len(gaps),
        "long_ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else float("nan"),
    }
    moved = [w["disaggregation"] for w in workers if w.get("disaggregation")]
    pre = [d for d in moved if d["mode"] == "prefill"]
    if pre:
        tokens = sum(d["moved_tokens"] for d in pre)
        t = [d["transfer"] for d in pre]
        out["transfer_bytes"] = sum(x["bytes"] for x in t)
        out["transfer_seconds"] = sum(x["seconds"] for x in t)
        out["moved_tokens"] = tokens
        out["bytes_per_token"] = out["transfer_bytes"] / tokens if tokens else float("nan")
        out["us_per_token"] = 1e6 * out["transfer_seconds"] / tokens if tokens else float("nan")
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="default", help="checkpoint (default: SmolLM2-135M)")
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--short", type=int, default=32, help="decoders' prompt tokens")
    ap.add_argument("--decode", type=int, default=128, help="tokens each decoder generates")
    ap.add_argument("--long-prompts", type=int, default=6)
    ap.add_argument("--long", type=int, default=1024, help="tokens of each long prompt")
    ap.add_argument("--chunk", type=int, default=0, help="max_num_tokens (0: the default)")
    ap.add_argument("--vocab", type=int, default=40000, help="token ids drawn below this")
    ap.add_argument("--configs", default="colocated,disagg")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke-sized run")
    ap.add_argument("--out", default="benchmarks/results/bench_disagg.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.decoders, args.decode, args.long_prompts, args.long = 1, 8, 1, 64
    return args


def main() -> None:
    args = parse()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from radixserve.model_store import resolve_model

    model = str(resolve_model(args.model))
    results = {}
    for name in args.configs.split(","):
        results[name] = run(args, model, disagg=name == "disagg")
        print(name, json.dumps(results[name]), flush=True)
    if "colocated" in results and "disagg" in results:
        c, d = results["colocated"], results["disagg"]
        results["itl_p99_ratio_disagg_over_colocated"] = d["itl_p99_ms"] / c["itl_p99_ms"]
    if not args.out:
        return
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    doc = {
        "benchmark": "bench_disagg",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "cpu_model": provenance_machine()["cpu"],
        "cpus": os.cpu_count(),
        "note": "two worker processes on the same cores in both configurations",
        "args": vars(args),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
