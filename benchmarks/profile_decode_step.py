"""A torch.profiler table of decode steps: which ops a step's time goes to.

One request (or ``--batch`` of them) of the default model decodes through the offline
engine; after ``--warmup`` steps, ``--steps`` more run under ``torch.profiler`` and the ops
are printed by self CPU time, with the time per step::

    python benchmarks/profile_decode_step.py                    # SmolLM2 fp32, batch 1
    python benchmarks/profile_decode_step.py --dtype bfloat16 --batch 16
    RADIXSERVE_CPU_KERNELS=0 python benchmarks/profile_decode_step.py   # the torch paths

The profiler adds a few microseconds per op: the op counts and the split are what to read,
``bench_runner_step.py`` gives the step times.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model_store import resolve_model  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="a local HF directory (default: SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=25, help="ops to print")
    args = ap.parse_args()

    engine = Engine(
        resolve_model(args.model),
        dtype=args.dtype,
        device="cpu",
        num_pages=1024,
        max_model_len=2048,
    )
    prompt = engine.tokenizer.encode("Write a short story about a lighthouse keeper and a storm.")
    params = SamplingParams(
        max_tokens=args.warmup + args.steps + 10, ignore_eos=True, temperature=0.0
    )
    for i in range(args.batch):
        engine.add_request(list(prompt) + [i], params)
    for _ in range(args.warmup):
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = (time.perf_counter() - t) / args.steps
    print(
        f"{args.dtype}, batch {args.batch}: {wall * 1e3:.1f} ms/step under the profiler "
        f"({torch.get_num_threads()} threads); table totals over {args.steps} steps"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
