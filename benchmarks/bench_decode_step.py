"""One engine decode step on the shared-system workload, and where its time goes.

It also reports the first step, a 2048-token prefill of the uncached system prompts.

``--requests`` one-turn chats under ``--systems`` long system prompts (the ``shared_system``
workload of ``benchmarks/workloads.py``) run together through the offline engine; the
median step time after the prefill steps is the decode step. ``--breakdown`` times the
linear layers, the attention backend (its page gathers and attention calls) and the rest.

    python benchmarks/bench_decode_step.py                     # SmolLM2 fp32, 16 requests, 4 prompts
    python benchmarks/bench_decode_step.py --breakdown --dtype bfloat16

To compare two versions of radixserve on the same machine, run it back to back with the
other checkout first on the path (the workload module is always this checkout's)::

    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_decode_step.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))  # `workloads`, after a PYTHONPATH checkout

import workloads as wl  # noqa: E402
from timing import time_calls  # noqa: E402

import radixserve  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402


def _instrument(engine: Engine, acc: dict[str, float]) -> None:
    """Time categories of a forward; what this radixserve version lacks is skipped."""
    from radixserve.model.attention import torch_paged

    time_calls(engine.model, "forward", "model", acc)
    time_calls(type(engine.attn), "forward", "attention", acc)
    time_calls(type(engine.attn), "_gather", "attention: page gathers", acc)
    if hasattr(torch_paged, "attention_with_lse"):
        time_calls(torch_paged, "attention_with_lse", "attention: attention calls", acc)
    try:
        from radixserve.model.cpu_linear import PackedLinear

        time_calls(PackedLinear, "forward", "linear layers", acc)
    except ImportError:
        import torch.nn

        time_calls(torch.nn.Linear, "forward", "linear layers", acc)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct) or a local HF directory",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument(
        "--breakdown", action="store_true", help="time linear layers / attention / the rest"
    )
    ap.add_argument("--out", default="benchmarks/results/bench_decode_step.json")
    args = ap.parse_args()

    from radixserve.model_store import resolve_model

    engine = Engine(
        resolve_model(None if args.model == "default" else args.model),
        dtype=args.dtype,
        num_pages=4096,
        max_model_len=2048,
    )
    work = wl.build(
        "shared_system", engine.tokenizer, requests=args.requests, systems=args.systems, salt=7
    )
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    for req in work.requests:
        engine.add_request(list(req.prompt_ids), params)
    acc: dict[str, float] = collections.defaultdict(float)
    steps: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        if args.breakdown and len(steps) == 10:
            _instrument(engine, acc)  # from the decode steps on
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    decode = steps[10:]  # the first steps prefill the system prompts and the user turns
    result = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "radixserve": str(Path(radixserve.__file__).resolve().parent),
        "dtype": args.dtype,
        "requests": args.requests,
        "systems": args.systems,
        "decode_step_ms_median": statistics.median(decode) * 1e3,
        # The first step prefills max_num_tokens (2048) tokens of the uncached system prompts.
        "first_prefill_step_ms": steps[0] * 1e3,
        "output_tok_per_s_incl_prefill": args.requests * args.max_tokens / wall,
        "breakdown_ms_per_step": {k: v / len(decode) * 1e3 for k, v in acc.items()},
    }
    print(f"radixserve from {result['radixserve']}")
    print(
        f"{args.dtype}, {args.requests} requests over {args.systems} system prompts: decode step median "
        f"{result['decode_step_ms_median']:.1f} ms; {result['output_tok_per_s_incl_prefill']:.1f} output tok/s "
        f"including the prefill; first (2048-token prefill) step {result['first_prefill_step_ms']:.0f} ms"
    )
    for key, ms in sorted(result["breakdown_ms_per_step"].items()):
        print(f"  {key:28s} {ms:6.1f} ms/step")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
