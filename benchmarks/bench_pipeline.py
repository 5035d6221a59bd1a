"""Pipeline parallelism on this machine: time per step, send/recv time, the pipeline's bubble.

Runs the same greedy batch (prefill, then decode steps) on one engine per configuration —
PP 1 (one process), PP 2 (two stage processes), optionally TP 2 x PP 2 — interleaved over
``--rounds`` so the machine's drift hits every configuration alike, and reports per step:

- wall time of one engine step (decode steps and the whole run),
- on rank 0: the plan broadcast, the sends, and the wait for the last stage's logits,
- per rank: its compute share of the wall time; the **bubble** is the rest (``1 − compute /
  wall``), the time a stage waits for a plan, for activations or for the logits.

With one batch in the pipe each stage of a 2-stage pipeline computes at most half the time
(bubble >= 50 %); on a 2-core CPU nothing runs faster with more ranks either: this measures the
cost of the machinery, not a speed-up. Run it under the shared lock:

    flock /work/bench.lock python benchmarks/bench_pipeline.py --quick
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_once(engine: Engine, batch: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One batch to completion, step by step; the step times and (PP) every rank's stats."""
    runner = engine.runner
    comm = getattr(runner, "comm", None)
    if comm is not None:
        comm.gather_stats()  # zero every rank's counters
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for ids in batch:
        engine.add_request(ids, params)
    steps: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        s = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    ranks = comm.gather_stats() if comm is not None else []
    decode = steps[1:] if len(steps) > 1 else steps  # after the one prefill step
    return {
        "wall_s": wall,
        "steps": len(steps),
        "decode_step_s": statistics.median(decode),
        "ranks": ranks,
    }


def summarize(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    wall = statistics.median(r["wall_s"] for r in runs)
    out: dict[str, Any] = {
        "config": name,
        "wall_s": wall,
        "steps": runs[0]["steps"],
        "step_ms": 1000 * wall / runs[0]["steps"],
        "decode_step_ms": 1000 * statistics.median(r["decode_step_s"] for r in runs),
    }
    if runs[0]["ranks"]:
        n = runs[0]["steps"]
        per_rank = []
        for i in range(len(runs[0]["ranks"])):
            stats = [r["ranks"][i] for r in runs]
            compute = statistics.median(s["compute_seconds"] for s in stats)
            per_rank.append(
                {
                    "rank": i,
                    "compute_share": compute / wall,
                    "bubble": 1 - compute / wall,
                    "recv_ms_per_step": 1000
                    * statistics.median(s["recv_seconds"] for s in stats)
                    / n,
                    "send_ms_per_step": 1000
                    * statistics.median(s["send_seconds"] for s in stats)
                    / n,
                    "plan_ms_per_step": 1000
                    * statistics.median(s["plan_seconds"] for s in stats)
                    / n,
                    "bytes_sent_per_step": statistics.median(s["bytes_sent"] for s in stats) / n,
                }
            )
        out["ranks"] = per_rank
        r0 = per_rank[0]
        out["comm_ms_per_step"] = r0["plan_ms_per_step"] + r0["send_ms_per_step"]
        out["bubble_mean"] = statistics.mean(r["bubble"] for r in per_rank)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, default=8, help="requests per run")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tp2pp2", action="store_true", help="also TP 2 x PP 2 (4 ranks)")
    ap.add_argument("--quick", action="store_true", help="batch 4, 16 tokens, 2 rounds")
    ap.add_argument("--out", default="benchmarks/results/bench_pipeline.json")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.max_tokens, args.rounds = 4, 16, 2
    common = dict(num_pages=512, page_size=16, max_num_tokens=1024, max_running_requests=16)
    configs: dict[str, dict[str, Any]] = {"PP 1": {}, "PP 2": {"pipeline_parallel_size": 2}}
    if args.tp2pp2:
        configs["TP 2 x PP 2"] = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}
    engines = {name: Engine(args.model, **common, **extra) for name, extra in configs.items()}
    try:
        vocab = next(iter(engines.values())).model_config.vocab_size
        batch = prompts(args.batch, args.prompt_len, vocab)
        for e in engines.values():  # warm: one run each, not measured
            run_once(e, batch, 2)
            e.flush_cache()
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        for _ in range(args.rounds):  # interleaved: drift hits every configuration alike
            for name, e in engines.items():
                runs[name].append(run_once(e, batch, args.max_tokens))
                e.flush_cache()  # cold each time: the same prefill work
        results = [summarize(name, r) for name, r in runs.items()]
    finally:
        for e in engines.values():
            e.close()
    base = results[0]["step_ms"]
    print(
        f"# {args.batch} requests x {args.prompt_len} prompt + {args.max_tokens} new tokens, greedy; "
        f"{os.cpu_count()} CPUs, torch threads split over the ranks"
    )
    print(
        f"{'config':<14}{'step ms':>9}{'decode step ms':>16}{'vs PP 1':>9}{'comm ms/step':>14}{'bubble':>8}"
    )
    for r in results:
        comm = f"{r['comm_ms_per_step']:.2f}" if "comm_ms_per_step" in r else "-"
        bubble = f"{100 * r['bubble_mean']:.0f}%" if "bubble_mean" in r else "-"
        print(
            f"{r['config']:<14}{r['step_ms']:>9.1f}{r['decode_step_ms']:>16.1f}{r['step_ms'] / base:>8.2f}x"
            f"{comm:>14}{bubble:>8}"
        )
        for rank in r.get("ranks", []):
            print(
                f"    rank {rank['rank']}: compute {100 * rank['compute_share']:.0f}% of the wall time, "
                f"waits {rank['recv_ms_per_step']:.2f} ms/step for activations/logits, "
                f"sends {rank['send_ms_per_step']:.2f} ms/step, plan {rank['plan_ms_per_step']:.2f} ms/step, "
                f"{rank['bytes_sent_per_step'] / 1024:.0f} KiB/step"
            )
    meta = {
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
        "torch": torch.__version__,
    }
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
