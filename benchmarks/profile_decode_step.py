"""A torch.profiler table of decode steps: which ops a step's time goes to.

One request (or ``--batch`` of them) of the default model decodes through the offline
engine; after ``--warmup`` steps, ``--steps`` more run under ``torch.profiler`` and the ops
are printed by self CPU time, with the time per step::

    python benchmarks/profile_decode_step.py                    # SmolLM2 fp32, batch 1
    python benchmarks/profile_decode_step.py --dtype bfloat16 --batch 16
    RADIXSERVE_CPU_KERNELS=0 python benchmarks/profile_decode_step.py   # the torch paths
    python benchmarks/profile_decode_step.py --split --steps 100

The profiler adds a few microseconds per op: the op counts and the split are what to read,
``bench_runner_step.py`` gives the step times. ``--split`` runs no profiler: on one thread
it times the forward and every linear layer in this thread's CPU time, which a loaded,
shared machine disturbs far less than wall-clock time, and prints the forward's time
outside the linear layers.
"""

from __future__ import annotations

# Before torch: radixserve sets the served process's OpenMP wait policy and spin count
# (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT), which the runtime reads once, when torch loads it.
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))  # `timing`, after a PYTHONPATH checkout
from timing import time_calls  # noqa: E402

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
    ap.add_argument(
        "--split", action="store_true", help="one thread, CPU time: linear layers vs the rest"
    )
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
    if args.split:
        return _split(engine, args.steps, args.dtype, args.batch)
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


def _split(engine: Engine, steps: int, dtype: str, batch: int) -> int:
    """Time ``steps`` steps on one thread: the forward, and the linear layers within it."""
    torch.set_num_threads(1)
    acc = {"forward": 0.0, "linear": 0.0}

    linears = [m for m in engine.model.modules() if hasattr(m, "in_features")]
    for m in linears:
        time_calls(m, "forward", "linear", acc, time.thread_time)
    time_calls(engine.runner.model, "forward", "forward", acc, time.thread_time)
    t = time.thread_time()
    for _ in range(steps):
        engine.step()
    step = (time.thread_time() - t) / steps
    fwd, lin = acc["forward"] / steps, acc["linear"] / steps
    print(
        f"{dtype}, batch {batch}, 1 thread, CPU ms per step: step {step * 1e3:.2f}, forward "
        f"{fwd * 1e3:.2f}, linear layers {lin * 1e3:.2f} ({len(linears)} modules), "
        f"forward outside them {(fwd - lin) * 1e3:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
