"""Decode rows' CPU attention over every layer, against the same kernel at another commit.

Shapes of SmolLM2-135M (9 query heads over 3 KV heads, head_dim 64, 16-token pages, 30
layers), one sequence of ``--contexts`` tokens (``--batch N``: N of them, each on its own
pages) whose pages lie scattered in each layer's pool (on the memory a ``KVPool`` takes:
transparent huge pages where granted, as in the engine): the kernel call a batch-1 (batch-N)
decode step makes per layer (``--prefill``: every token of the sequences a new row, causally,
the call a cold prompt's prefill makes). Two timings per context and KV dtype:

- ``cold``: the 30 layers one after the other after reading 256 MB (the KV evicted, as the
  weights streamed through a step evict it), per layer;
- ``hot``: one layer's call repeated (its pages in the caches), per call.

``--clock cpu`` times with the process's CPU seconds (every thread's) instead of the wall
clock: on a machine loaded by other jobs a thread preempted mid-call stretches the wall time
by whole time slices, while CPU time counts only what ran. Run it with ``GOMP_SPINCOUNT=0``
(waiting threads then sleep at once, not spin on the clock):

    GOMP_SPINCOUNT=0 python benchmarks/bench_decode_attention.py --baseline HEAD --clock cpu \
        --dtypes bfloat16 --contexts 1000,2000,3000,4000,5000,6000,7000,7500,8000

``--read-floor`` adds a third timing, ``read cold``: the same pages read and nothing computed
(every byte of each page's K and V, a cache line a load; the next page's lines prefetched
while one is read where it lies elsewhere, its first few where it follows; the pages split
over the threads as the kernel splits its chunks), after the same eviction, per layer: the
floor a decode step's attention has on this machine for its KV as it lies, a page at a
time, rather than the steady rate of one long sequential read (``torch.sum`` over 512 MiB,
the floor ``bench_long_context.py`` samples).

    python benchmarks/bench_decode_attention.py --read-floor --dtypes bfloat16 --contexts 1000,7500

``--pages ascending`` lays each sequence's pages in ascending order, one run, as the engine's
pool hands them to one long request at a time (a fresh pool one run, a full one a few:
tests/scheduling/test_scheduler.py); the default, ``scattered``, in a random order, as a
pool that has cached and evicted many interleaved requests may:

    python benchmarks/bench_decode_attention.py --read-floor --pages ascending --contexts 1000,7500

``--dtypes`` names the pages' dtype: ``float32`` and ``bfloat16`` pages are read as such by
queries of their dtype; ``int8``, ``int4``, ``float8_e4m3fn`` and ``float8_e5m2`` pages hold
quantized codes (``paged_attention_quant``; int8 and int4 with a scale per slot and KV head,
int4 two codes a byte, fp8 at the scale 1.0 a pool starts from) read by bf16 queries, as a
bf16 model with a quantized KV cache:

    python benchmarks/bench_decode_attention.py --read-floor --dtypes bfloat16,int8,int4,float8_e4m3fn

``--ablate PARTS`` times, beside the current kernel, the current kernel with each part of a
bf16 decode row taken out (``decode_ablations.py``: the transposition of the keys, the
scores, the values' products, all the arithmetic, the prefetches), each built as the
baseline is: the current time less an ablated one's is what that part costs, from memory
and from the caches, on a VM without performance counters. The ablated outputs are wrong by
construction (``outputs_equal`` compares only the others):

    python benchmarks/bench_decode_attention.py --ablate key-transpose,scores,values,arithmetic,prefetch \
        --read-floor --pages ascending --dtypes bfloat16 --contexts 1000,7500 --reps 10

With ``--baseline REV`` the kernel source at that git revision is built beside the current
one (its operator library renamed) and both are timed alternately, call for call, and their
outputs compared: equal bits are expected whenever the revisions compute the same arithmetic.

    python benchmarks/bench_decode_attention.py
    python benchmarks/bench_decode_attention.py --baseline f98d7bc --contexts 600,1000
    python benchmarks/bench_decode_attention.py --baseline f98d7bc --batch 8 --contexts 600
    python benchmarks/bench_decode_attention.py --baseline f98d7bc --prefill --reps 3 --contexts 512
"""

from __future__ import annotations

# Before torch: radixserve sets the process's OpenMP wait policy (see bench_runner_step.py).
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # decode_ablations

from decode_ablations import ABLATIONS, ablated_sources  # noqa: E402

from radixserve.memory.pool import zeroed_storage  # noqa: E402
from radixserve.model import native  # noqa: E402

HQ, HKV, D, PS, LAYERS = 9, 3, 64, 16, 30
ROOT = Path(__file__).resolve().parents[1]
SOURCE = "radixserve/model/csrc/paged_attention.cpp"

#: Page dtypes read as quantized codes (``paged_attention_quant``), with bf16 queries.
QUANTIZED = {
    "int8": torch.int8,
    "int4": torch.uint8,  # two codes a byte (rows of D // 2 bytes)
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def build_ops(lib: str, files: dict[str, str]) -> Any:
    """The attention ops built from the kernel's headers as they are now with ``files`` (name
    to text) over them, under the library name ``lib`` (its ``paged_attention`` and
    ``paged_attention_quant``), beside the current ones in this process."""
    from torch.utils import cpp_extension

    with tempfile.TemporaryDirectory(prefix=f"{lib}_") as tmp:
        build = Path(tmp)
        for header in (ROOT / SOURCE).parent.glob("*.h"):  # headers as they are now, then
            (build / header.name).write_text(header.read_text())
        for name, text in files.items():  # the given sources and headers over them
            (build / name).write_text(text)
        text = (build / "paged_attention.cpp").read_text()
        text = text.replace("TORCH_LIBRARY(radixserve_cpu, m)", f"TORCH_LIBRARY({lib}, m)")
        (build / "paged_attention.cpp").write_text(text)
        # Its own C++ namespace too: the headers' inline functions (a thread's Scratch among
        # them) are shared symbols, which the loader binds to the first library's, so an
        # earlier Scratch of another layout was this build's (and crashed it).
        for source in build.iterdir():
            source.write_text(re.sub(r"\bradixserve_cpu\b", f"{lib}_cpu", source.read_text()))
        # The attention op's own sources: since the split, store_kv.cpp writes the new rows.
        sources = [
            build / n for n in ("paged_attention.cpp", "store_kv.cpp") if (build / n).exists()
        ]
        cpp_extension.load(
            name=lib,
            sources=[str(p) for p in sources],
            extra_cflags=native.CFLAGS,
            extra_ldflags=native.LDFLAGS,
            is_python_module=False,
        )
    return getattr(torch.ops, lib)


def baseline_ops(rev: str) -> Any:
    """The attention ops as of git revision ``rev`` (its sources and headers over today's
    headers), built under the library name ``attn_base``."""

    def show(path: str) -> str:
        return subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout

    csrc = str(Path(SOURCE).parent)
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, f"{csrc}/"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    files = {Path(p).name: show(p) for p in listed if p.endswith((".h", ".cpp"))}
    return build_ops("attn_base", files)


def ablated_ops(name: str) -> Any:
    """The current attention ops with one part taken out (``decode_ablations.ABLATIONS``),
    built under the library name ``attn_ablate_<name>``: their outputs are wrong, their time
    is the kernel's without that part."""
    csrc = (ROOT / SOURCE).parent
    files = {p.name: p.read_text() for p in csrc.iterdir() if p.suffix == ".cpp"}
    files.update(ablated_sources(name, csrc))
    return build_ops(f"attn_ablate_{name.replace('-', '_')}", files)


READ_SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <cstring>

// Every byte of the pages ``pages`` of ``k`` and ``v`` (K then V of each page), a cache line a
// load, the pages split over the threads in runs. Where the next page does not follow this
// one in memory its lines are prefetched while this one is read; where it does, only its
// first few (the hardware prefetcher streams the rest: prefetching every line there read
// slower). A checksum, so that the loads stay.
int64_t read_pages(const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages) {
  typedef uint64_t line_t __attribute__((vector_size(64)));
  const char* kb = static_cast<const char*>(k.data_ptr());
  const char* vb = static_cast<const char*>(v.data_ptr());
  const int64_t bytes = k.stride(0) * k.element_size(), n = pages.numel();
  const int64_t* ids = pages.data_ptr<int64_t>();
  uint64_t sum = 0;
#pragma omp parallel num_threads(at::get_num_threads()) reduction(^ : sum)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
    line_t acc = {};
    for (int64_t i = lo; i < hi; ++i) {
      if (i + 1 < hi) {
        const int64_t ahead = ids[i + 1] == ids[i] + 1 ? std::min<int64_t>(bytes, 512) : bytes;
        for (int64_t b = 0; b < ahead; b += 64) {
          __builtin_prefetch(kb + ids[i + 1] * bytes + b, 0, 2);
          __builtin_prefetch(vb + ids[i + 1] * bytes + b, 0, 2);
        }
      }
      for (const char* base : {kb + ids[i] * bytes, vb + ids[i] * bytes}) {
        for (int64_t b = 0; b < bytes; b += 64) {
          line_t w;
          std::memcpy(&w, base + b, sizeof w);
          acc ^= w;
        }
      }
    }
    for (int j = 0; j < 8; ++j) sum ^= acc[j];
  }
  return static_cast<int64_t>(sum);
}
"""


@functools.cache
def read_op() -> Callable[..., int]:
    """``read_pages(k, v, pages)``: the pages read and nothing computed (``--read-floor``),
    built once a process (``paged_read_ms`` asks for it at every sample)."""
    from torch.utils import cpp_extension

    module = cpp_extension.load_inline(
        name="bench_read_pages",
        cpp_sources=READ_SOURCE,
        functions=["read_pages"],
        extra_cflags=native.CFLAGS,
        extra_ldflags=native.LDFLAGS,
    )
    return module.read_pages


def paged_read_ms(
    tokens: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    samples: int = 3,
    scattered: bool = True,
) -> float:
    """One decode token's KV read as the engine lays it out and nothing computed: ``tokens``
    tokens of K and V per layer on pages of each layer's pool (a KVPool's memory), every
    layer read in turn after 256 MB read past them (a step's weights evict its KV): the
    median of ``samples`` such passes, in ms (``bench_long_context.py``'s paged floors).
    ``scattered``: the pages in a random order, as a pool that has cached and evicted many
    requests hands them out; else in ascending order, as a fresh pool's free list does."""
    read = read_op()
    pages = -(-tokens // page_size)
    shape = (pages + 1, page_size, kv_heads, head_dim)
    pools = []
    for layer in range(layers):
        k = zeroed_storage(shape, dtype, torch.device("cpu"), False)
        v = zeroed_storage(shape, dtype, torch.device("cpu"), False)
        k.fill_(1.0), v.fill_(1.0)  # touched: an untouched page would read the shared zero page
        order = list(range(1, pages + 1))
        if scattered:
            random.Random(layer).shuffle(order)
        pools.append((k, v, torch.tensor(order, dtype=torch.int64)))
    evict = torch.ones(64 << 20)
    times = []
    for _ in range(samples):
        evict.sum()
        t = time.perf_counter()
        for k, v, ids in pools:
            read(k, v, ids)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def filled_pool(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K or V pool of ``shape`` on the memory a KVPool takes (huge pages where
    granted, as the engine's), filled as the engine fills one, and its scales: random values
    in ``dtype``, no scales (an empty tensor); int8 codes over the whole range with a positive
    scale per (slot, KV head), as ``store_kv`` quantizes; int4 (uint8: ``shape`` of D // 2
    bytes a row) random bytes, two codes each, with such scales; fp8 codes of normal values,
    with the per-KV-head scale 1.0 an fp8 pool starts from."""
    page = torch.randn(shape)
    pool = zeroed_storage(shape, dtype, torch.device("cpu"), False)
    if dtype == torch.uint8:
        pool.copy_(torch.randint(0, 256, shape, dtype=torch.uint8))
        return pool, (page.abs().amax(-1) / 7).contiguous()
    if dtype == torch.int8:
        scale = page.abs().amax(-1) / 127
        pool.copy_(torch.round(page / scale.unsqueeze(-1)).clamp_(-127, 127))
        return pool, scale.contiguous()
    pool.copy_(page)
    if dtype in QUANTIZED.values():
        return pool, torch.ones(shape[2])
    return pool, torch.empty(0)


def layers_for(
    ctx: int, dtype: torch.dtype, batch: int = 1, prefill: bool = False, scattered: bool = True
) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: its K and V pools, their scales (``filled_pool``) and the plan's index
    tensors for ``batch`` sequences of ``ctx`` tokens, each on its own pages, all pages in a
    random order (``scattered``; else ascending); each sequence's last token is its new row
    (``prefill``: all of them, causally)."""
    new = ctx if prefill else 1
    pages = -(-ctx // PS)
    out = []
    for layer in range(LAYERS):
        shape = (batch * pages + 1, PS, HKV, D // 2 if dtype == torch.uint8 else D)
        k, k_scale = filled_pool(shape, dtype)
        v, v_scale = filled_pool(shape, dtype)
        order = list(range(1, batch * pages + 1))
        if scattered:
            random.Random(layer).shuffle(order)
        groups: list[tuple[list[native.Member], list[int]]] = [
            ([native.Member(b * new, new, order[b * pages : (b + 1) * pages], ctx)], [])
            for b in range(batch)
        ]
        plan = native.AttentionPlan.build(groups)
        out.append((k, v, k_scale, v_scale, *plan.tensors()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--contexts", default="256,600,1000,2000")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--baseline", help="git revision whose kernel to time alongside")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--batch", type=int, default=1, help="decode rows, each over its own pages (a batch-N step)"
    )
    ap.add_argument(
        "--prefill",
        action="store_true",
        help="every token of each sequence a new row (a prompt's prefill) instead of the last",
    )
    ap.add_argument(
        "--read-floor",
        action="store_true",
        help="also time a bare cold read of the same pages per layer (``read cold``)",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the process's CPU seconds, all threads (a loaded machine; GOMP_SPINCOUNT=0)",
    )
    ap.add_argument(
        "--pages",
        choices=("scattered", "ascending"),
        default="scattered",
        help="each sequence's pages in a random order, or in ascending order (one run)",
    )
    ap.add_argument(
        "--ablate",
        default="",
        help=f"comma-separated parts to take out, each a kernel timed alongside ({', '.join(ABLATIONS)})",
    )
    ap.add_argument("--out", default="benchmarks/results/bench_decode_attention.json")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.clock == "cpu" and os.environ.get("GOMP_SPINCOUNT") != "0":
        print("--clock cpu: set GOMP_SPINCOUNT=0, or spinning threads count as work", flush=True)
    if not native.load():
        raise SystemExit("the CPU kernels did not build here")
    ops: dict[str, Any] = {"current": torch.ops.radixserve_cpu}
    if args.baseline:
        ops[args.baseline] = baseline_ops(args.baseline)
    ablations = [a for a in args.ablate.split(",") if a]
    if unknown := set(ablations) - set(ABLATIONS):
        ap.error(f"--ablate: no such part {sorted(unknown)}; the parts: {', '.join(ABLATIONS)}")
    for name in ablations:
        ops[f"without {name}"] = ablated_ops(name)
    read = read_op() if args.read_floor else None
    evict = torch.ones(64 << 20)
    results = []
    for dtype_name in args.dtypes.split(","):
        dtype = QUANTIZED.get(dtype_name) or getattr(torch, dtype_name)
        quantized = dtype in QUANTIZED.values()
        for ctx in (int(c) for c in args.contexts.split(",")):
            layers = layers_for(ctx, dtype, args.batch, args.prefill, args.pages == "scattered")
            q_dtype = torch.bfloat16 if quantized else dtype
            q = torch.randn(args.batch * (ctx if args.prefill else 1), HQ, D).to(q_dtype)
            outs = {name: torch.empty_like(q) for name in ops}

            def call(name: str, layer: tuple[torch.Tensor, ...]) -> None:
                k, v, k_scale, v_scale, *plan = layer
                if quantized:
                    ops[name].paged_attention_quant(
                        q, k, v, outs[name], *plan, D**-0.5, k_scale, v_scale, None, None, None
                    )
                else:
                    ops[name].paged_attention(q, k, v, outs[name], *plan, D**-0.5, None, None, None)

            samples: dict[str, list[float]] = {}
            for rep in range(args.reps):
                names = list(ops) if rep % 2 == 0 else list(ops)[::-1]
                for name in names:
                    evict.sum()
                    t = clock()
                    for layer in layers:
                        call(name, layer)
                    samples.setdefault(f"{name} cold", []).append((clock() - t) / LAYERS)
                    call(name, layers[0])
                    t = clock()
                    for _ in range(LAYERS):
                        call(name, layers[0])
                    samples.setdefault(f"{name} hot", []).append((clock() - t) / LAYERS)
                if read is not None:
                    evict.sum()
                    t = clock()
                    for k, v, _, _, *plan in layers:
                        read(k, v, plan[5])  # the plan's own_pages (codes only, not scales)
                    samples.setdefault("read cold", []).append((clock() - t) / LAYERS)
            exact = [o for name, o in outs.items() if not name.startswith("without ")]
            same = all(torch.equal(o, outs["current"]) for o in exact)
            row = {
                "dtype": dtype_name,
                "context": ctx,
                "us_per_layer": {
                    k: round(statistics.median(v) * 1e6, 1) for k, v in samples.items()
                },
                "batch": args.batch,
                "prefill": args.prefill,
                "kv_mb_per_layer": round(
                    2 * args.batch * ctx * HKV * layers[0][0][0, 0, 0].nbytes / 1e6, 3
                ),
                "outputs_equal": same,
                "samples_us": {k: [round(x * 1e6, 1) for x in v] for k, v in samples.items()},
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    record = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="minutes"),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "baseline": args.baseline,
        "pages": args.pages,
        "ablations": {name: ABLATIONS[name].what for name in ablations},
        "results": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
