"""Time to first token of prompts of lengths the engine has not run before, against the same
lengths again: what a new prefill shape costs (oneDNN builds a kernel per GEMM row count).

One in-process engine (default model, CPU), then ``--lengths`` prompts of distinct lengths
drawn from ``--range`` (none a count oneDNN runs unpadded), each of fresh random token ids (no
prefix is cached), one at a time: the "new" pass. Then the same lengths in another order, of
other token ids: the "seen" pass. Reported: the engine's warm-up time, each pass's median
and worst TTFT, and the median of the per-length ratios new/seen.

    python benchmarks/bench_prefill_lengths.py                      # bf16, 24 lengths in 100-700
    python benchmarks/bench_prefill_lengths.py --dtype float32 --lengths 16

The radixserve measured is the one this script imports: run it from a worktree of another
revision (``PYTHONPATH=<worktree> python benchmarks/bench_prefill_lengths.py``) to compare.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
import time
from pathlib import Path

# Before torch: radixserve sets the process's OpenMP wait policy (see bench_runner_step.py).
import radixserve  # noqa: F401

# isort: split

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model_store import resolve_model  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402


def ttft_ms(engine: Engine, prompt: list[int]) -> float:
    """Milliseconds from adding a one-token greedy request to its token, the engine otherwise
    idle."""
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while not any(o.new_token_ids for o in engine.step()):
        pass
    elapsed = (time.perf_counter() - t0) * 1e3
    while engine.step():  # the finished request's release
        pass
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--lengths", type=int, default=24, help="distinct prompt lengths")
    ap.add_argument("--range", type=int, nargs=2, default=(100, 700), metavar=("LO", "HI"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the summary here (JSON)")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    # Not a multiple of 8: every count oneDNN runs unpadded is one (cpu_linear.onednn_rows), and
    # so are the warm-up's 64- and 256-token prefills. Written out rather than imported, so that
    # the script also runs against revisions without the padding.
    pool = [n for n in range(args.range[0], args.range[1]) if n % 8]
    lengths = rng.sample(pool, args.lengths)
    t0 = time.perf_counter()
    engine = Engine(
        resolve_model(None), dtype=args.dtype, device="cpu", max_model_len=args.range[1] + 8
    )
    start_s = time.perf_counter() - t0
    warm_s = next((v for k, v in engine.startup_seconds.items() if k.startswith("warm-up")), 0.0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    new = {n: ttft_ms(engine, prompt(n)) for n in lengths}
    seen = {n: ttft_ms(engine, prompt(n)) for n in rng.sample(lengths, len(lengths))}
    ratios = [new[n] / seen[n] for n in lengths]
    summary = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "radixserve": str(Path(radixserve.__file__).resolve().parent),
        "dtype": args.dtype,
        "lengths": lengths,
        "engine_start_s": round(start_s, 2),
        "warm_up_s": round(warm_s, 2),
        "new_ttft_ms": {
            "median": round(statistics.median(new.values()), 1),
            "max": round(max(new.values()), 1),
        },
        "seen_ttft_ms": {
            "median": round(statistics.median(seen.values()), 1),
            "max": round(max(seen.values()), 1),
        },
        "new_over_seen": {
            "median": round(statistics.median(ratios), 3),
            "max": round(max(ratios), 3),
        },
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
