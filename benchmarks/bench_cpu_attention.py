"""The CPU paged-attention kernel against the torch path it replaces, one layer's call.

Shapes of SmolLM2-135M (9 query heads over 3 KV heads, head_dim 64, 16-token pages), the
pool's pages scattered at random, one call per case timed after warm-up (median of
``--reps``); both paths read the same pages and their outputs are compared:

- ``prefill``: one 1024-token prompt, nothing cached (causal);
- ``extend``: a 25-token user turn after a 1000-token cached system prompt;
- ``chunk``: the second 512-token chunk of a 1024-token prompt;
- ``decode``: 16 sequences over 4 shared 1008-token system prompts, ~150 tokens of their
  own each (the ``shared_system`` workload's decode step);
- ``decode1``: one sequence of 80 tokens (a single stream's decode step);
- ``decode64``: 64 sequences of ~100 tokens each, nothing shared;
- ``long``: the last 2048-token chunk of a 7,500-token prompt (5,452 tokens before it:
  the long-context prefill's largest call, ``benchmarks/long_context.md``);
- ``decode_long``: one sequence's decode step after that prompt.

The torch path is ``TorchPagedAttentionBackend(native_kernel=False)``: page gathers, ATen's
CPU flash attention per part, the LSE merge (its batch metadata, built once per forward, is
outside the timing for both).

    python benchmarks/bench_cpu_attention.py                   # float32
    python benchmarks/bench_cpu_attention.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
from pathlib import Path

import torch
from timing import median_seconds

from radixserve.memory.pool import KVPool
from radixserve.model import native
from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend
from radixserve.model.forward_batch import ForwardBatch

HQ, HKV, D, PS = 9, 3, 64, 16


def _batch(seqs: list[tuple[list[int], int, int]]) -> ForwardBatch:
    """(pages, prefix, new tokens) per sequence."""
    return ForwardBatch.from_pages(
        [p for p, _, _ in seqs], [c for _, c, _ in seqs], [n for _, _, n in seqs], PS
    )


def _cases(free: list[int]) -> dict[str, ForwardBatch]:
    def take(n_tokens: int) -> list[int]:
        return [free.pop() for _ in range(-(-n_tokens // PS))]

    decode = []
    for _ in range(4):
        system = take(1008)
        for _ in range(4):
            decode.append((system + take(150), 1008 + 149, 1))
    return {
        "prefill": _batch([(take(1024), 0, 1024)]),
        "extend": _batch([(take(1025), 1000, 25)]),
        "chunk": _batch([(take(1024), 512, 512)]),
        "decode": _batch(decode),
        "decode1": _batch([(take(80), 79, 1)]),
        "decode64": _batch([(take(90 + i), 89 + i, 1) for i in range(64)]),
        "long": _batch([(take(7500), 5452, 2048)]),
        "decode_long": _batch([(take(7500), 7499, 1)]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/bench_cpu_attention.json")
    ap.add_argument("--cases", default=None, help="comma-separated cases (default: all)")
    args = ap.parse_args()
    if not native.load():
        print("the CPU kernel did not build here: nothing to compare")
        return 1
    dtype = getattr(torch, args.dtype)
    pool = KVPool(1, 2600, PS, HKV, D, kv_dtype="auto", act_dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    pool.k_data[0].copy_(torch.randn(pool.k_data[0].shape, generator=gen))
    pool.v_data[0].copy_(torch.randn(pool.v_data[0].shape, generator=gen))
    free = list(range(2600))
    random.Random(0).shuffle(free)
    rows = []
    wanted = set(args.cases.split(",")) if args.cases else None
    for name, fb in _cases(free).items():
        if wanted is not None and name not in wanted:
            continue
        q = torch.randn(fb.num_tokens, HQ, D, generator=gen).to(dtype)
        k = torch.randn(fb.num_tokens, HKV, D, generator=gen).to(dtype)
        times, outs = {}, {}
        for label, use in (("kernel", True), ("torch", False)):
            backend = TorchPagedAttentionBackend(pool, native_kernel=use)
            backend.init_forward_metadata(fb)  # the metadata, once
            outs[label] = backend.forward(0, q, k, k, fb, D**-0.5)
            times[label] = median_seconds(
                lambda: backend.forward(0, q, k, k, fb, D**-0.5), args.reps
            )
        err = (outs["kernel"].float() - outs["torch"].float()).abs().max().item()
        rows.append(
            {
                "case": name,
                "rows": fb.num_tokens,
                "kernel_ms": times["kernel"] * 1e3,
                "torch_ms": times["torch"] * 1e3,
                "speedup": times["torch"] / times["kernel"],
                "max_abs_diff": err,
            }
        )
    print(f"{args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"{'case':9s} {'rows':>5s} {'kernel ms':>10s} {'torch ms':>9s} {'speedup':>8s} {'max |diff|':>11s}"
    )
    for r in rows:
        print(
            f"{r['case']:9s} {r['rows']:5d} {r['kernel_ms']:10.2f} {r['torch_ms']:9.2f} {r['speedup']:7.2f}x "
            f"{r['max_abs_diff']:11.1e}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                "cases": rows,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
