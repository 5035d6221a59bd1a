"""A decode step's attention over quantized KV pages: the CPU kernel against bf16 and the torch path.

Shapes of SmolLM2-135M (9 query heads over 3 KV heads, head_dim 64, 16-token pages, 30
layers), bf16 activations, one sequence of ``--contexts`` tokens on scattered pages. Per
step, the 30 layers' calls of the attention backend as the engine makes them
(``TorchPagedAttentionBackend.forward``: the new row's store, then the attention), after
reading 256 MB (a step's weights evict the KV). Configurations, timed alternately, call for
call, in one process:

- ``bf16 kernel``: an unquantized bf16 pool on the C++ kernel (the reference of the ratios);
- ``int8 kernel``, ``fp8_e4m3 kernel``: quantized pools on the kernel (their codes decoded
  a block of 64 keys at a time, ``csrc/paged_attention_quant.h``);
- ``int8 torch``, ``fp8_e4m3 torch``: the same pools on the torch path (key blocks gathered
  and dequantized, then ATen's flash attention), the path they took before.

It prints each configuration's median time per step and its ratio to ``bf16 kernel``; on a
loaded machine quote the ratios, with ``--clock cpu`` and ``GOMP_SPINCOUNT=0``::

    GOMP_SPINCOUNT=0 python benchmarks/bench_quant_decode_attention.py --clock cpu --contexts 1000,4000,8000
"""

from __future__ import annotations

# Before torch: radixserve sets the process's OpenMP wait policy (see bench_runner_step.py).
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from radixkernels.reference import store_kv_ref  # noqa: E402
from radixserve.memory.pool import KVPool  # noqa: E402
from radixserve.model import native  # noqa: E402
from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend  # noqa: E402
from radixserve.model.forward_batch import ForwardBatch  # noqa: E402

HQ, HKV, D, PS, LAYERS = 9, 3, 64, 16, 30
ACT = torch.bfloat16


def filled_pool(kv_dtype: str, ctx: int, pages: list[int]) -> KVPool:
    """A pool of ``LAYERS`` layers whose first ``ctx`` positions on ``pages`` hold random K/V."""
    pool = KVPool(LAYERS, len(pages) + 1, PS, HKV, D, kv_dtype=kv_dtype, act_dtype=ACT)
    slots = torch.tensor([pages[i // PS] * PS + i % PS for i in range(ctx)], dtype=torch.int64)
    for layer in range(LAYERS):
        k, v = (torch.randn(ctx, HKV, D).to(ACT) for _ in range(2))
        ks = None if pool.k_scale is None else pool.k_scale[layer]
        vs = None if pool.v_scale is None else pool.v_scale[layer]
        store_kv_ref(pool.k_data[layer], pool.v_data[layer], ks, vs, k, v, slots, pool.fmt)
    return pool


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--contexts", default="1000,4000,8000")
    ap.add_argument("--dtypes", default="int8,fp8_e4m3")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--out", default="benchmarks/results/bench_quant_decode_attention.json")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.clock == "cpu" and os.environ.get("GOMP_SPINCOUNT") != "0":
        print("--clock cpu: set GOMP_SPINCOUNT=0, or spinning threads count as work", flush=True)
    if not native.load():
        raise SystemExit("the CPU kernels did not build here")
    evict = torch.ones(64 << 20)
    results = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        pages = list(range(1, -(-ctx // PS) + 1))
        random.Random(ctx).shuffle(pages)
        fb = ForwardBatch.from_pages([pages], [ctx - 1], [1], PS)
        backends = {"bf16 kernel": TorchPagedAttentionBackend(filled_pool("auto", ctx, pages))}
        for kv in args.dtypes.split(","):
            pool = filled_pool(kv, ctx, pages)
            backends[f"{kv} kernel"] = TorchPagedAttentionBackend(pool)
            backends[f"{kv} torch"] = TorchPagedAttentionBackend(pool, native_kernel=False)
        for name, b in backends.items():
            assert b.row_exact == name.endswith("kernel"), name  # the path named is the one taken
        q, k, v = (torch.randn(1, h, D).to(ACT) for h in (HQ, HKV, HKV))
        samples: dict[str, list[float]] = {name: [] for name in backends}
        for rep in range(args.reps + 1):
            names = list(backends) if rep % 2 == 0 else list(backends)[::-1]
            for name in names:
                b = backends[name]
                b.init_forward_metadata(fb)
                evict.sum()
                t = clock()
                for layer in range(LAYERS):
                    b.forward(layer, q, k, v, fb, D**-0.5)
                if rep > 0:  # the first round warms up
                    samples[name].append(clock() - t)
        med = {name: statistics.median(s) for name, s in samples.items()}
        row = {
            "context": ctx,
            "ms_per_step": {name: round(m * 1e3, 3) for name, m in med.items()},
            "ratio_to_bf16_kernel": {
                name: round(m / med["bf16 kernel"], 3) for name, m in med.items()
            },
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    record = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="minutes"),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
