"""The bf16 GEMV kernel (``gemv_dense``) of this tree against an earlier commit's, by row count.

Speculative decoding verifies k + 1 rows a step on this kernel; from a few rows it is bound
by its arithmetic (a dot product per 32 inputs, output and row, and a horizontal sum per
output and row), no longer by reading the weight. This times every linear layer of the
default model's shapes (SmolLM2-135M, bf16: per layer qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536; then the 49152 x 576 head), ``--layers`` copies of each so that
the weights stream from memory as in a decode step, at each of ``--rows``, through this
tree's kernel and through ``--rev``'s (rebuilt from ``git show`` as a second library whose
ops live under ``radixserve_rev``: ``bench_int8_kernel.build_rev``), alternating passes.
Both kernels' outputs are compared: equal bits expected (the same sums in the same order).

Per row count it prints the median pass of each kernel, their ratio, and each over the
weight-read floor (the pass's weight bytes at the read bandwidth sampled between passes,
``floor.read_gbs``). ``--clock cpu`` times in the process's CPU seconds (every thread's),
which other jobs on a shared machine disturb far less than the wall clock::

    python benchmarks/bench_gemv_rows.py                          # against 65731b6, 1 thread
    python benchmarks/bench_gemv_rows.py --rev HEAD~1 --rows 1,9 --passes 20 --threads 2

``--stack`` also times the whole decoder stack (``decoder_layers``, the engine's one-call
forward over every layer) of an offline engine of the default model in bf16, decode steps
of 1 and of 9 requests (9 rows through every linear: a verify step of ``k`` = 8 without its
attention over one shared context), the stack's op of either library alternating step by
step; every linear kept on the GEMV kernel at 9 rows, as a speculating step keeps it
(``cpu_linear.RowInvariantLinears``). It builds all of ``--rev``'s kernels (minutes).
"""

from __future__ import annotations

# Before torch: radixserve sets the process's OpenMP wait policy (see bench_runner_step.py).
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))  # after a PYTHONPATH checkout
from bench_int8_kernel import build_rev  # noqa: E402
from floor import read_gbs, read_source  # noqa: E402
from provenance import header  # noqa: E402

from radixserve.memory.hugepages import hugepage_buffer  # noqa: E402

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query and 3 KV heads of 64, vocab 49152.
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)


def kernel_rows(args: argparse.Namespace, clock: Callable[[], float]) -> list[dict[str, Any]]:
    """Every linear of a pass through either kernel, at each row count (one record each)."""
    ours, theirs = torch.ops.radixserve_cpu.gemv_dense, torch.ops.radixserve_rev.gemv_dense
    g = torch.Generator().manual_seed(0)

    def weight(shape: tuple[int, int]) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.05).bfloat16()

    # (name, weight) in a decode step's order: the layers, then the head; all in one buffer
    # on transparent huge pages where granted, as an engine holds its weights.
    shapes = [s for _ in range(args.layers) for s in LAYER_SHAPES.items()]
    shapes.append(("head", HEAD_SHAPE))
    nbytes = sum(2 * n * k for _, (n, k) in shapes)
    buf = hugepage_buffer(nbytes)
    store = (buf if buf is not None else torch.empty(nbytes, dtype=torch.uint8)).view(
        torch.bfloat16
    )
    linears, at = [], 0
    for name, (n, k) in shapes:
        w = store[at : at + n * k].view(n, k)
        w.copy_(weight((n, k)))
        linears.append((name, w))
        at += n * k
    src = read_source()
    print(
        f"{len(linears)} bf16 linears ({nbytes / 1e6:.0f} MB, huge pages: {buf is not None}), "
        f"{torch.get_num_threads()} thread(s), {args.clock} clock; this tree against "
        f"{args.rev}, ms per pass"
    )
    print("| rows | this tree | " + args.rev + " | ratio | tree / floor | rev / floor | by layer |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    records = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {
            k: torch.randn(m, k, generator=g).bfloat16() for k in {w.shape[1] for _, w in linears}
        }
        for _, w in linears[:4] + linears[-1:]:  # both kernels: the same bits
            x = xs[w.shape[1]]
            assert torch.equal(ours(x, w, None), theirs(x, w, None)), (m, tuple(w.shape))
        times: dict[str, list[float]] = {"tree": [], "rev": []}
        parts: dict[str, dict[str, list[float]]] = {"tree": {}, "rev": {}}
        floors: list[float] = []
        for p in range(args.passes + 1):
            floors.append(nbytes / read_gbs(src) / 1e6)
            for which in ("tree", "rev") if p % 2 else ("rev", "tree"):
                op = ours if which == "tree" else theirs
                by: dict[str, float] = {}
                t = clock()
                for name, w in linears:
                    t0 = clock()
                    op(xs[w.shape[1]], w, None)
                    by[name] = by.get(name, 0.0) + clock() - t0
                if p:  # the first pass warms up
                    times[which].append((clock() - t) * 1e3)
                    for name, s in by.items():
                        parts[which].setdefault(name, []).append(s * 1e3)
        a, b = statistics.median(times["tree"]), statistics.median(times["rev"])
        floor = statistics.median(floors)
        layer_ratios = " ".join(
            f"{name} {statistics.median(parts['tree'][name]) / statistics.median(parts['rev'][name]):.2f}"
            for name in parts["tree"]
        )
        print(
            f"| {m} | {a:.2f} | {b:.2f} | {a / b:.3f}x | {a / floor:.2f} | {b / floor:.2f} "
            f"| {layer_ratios} |",
            flush=True,
        )
        records.append(
            {
                "rows": m,
                "tree_ms": a,
                "rev_ms": b,
                "ratio": a / b,
                "floor_ms": floor,
                "tree_passes_ms": times["tree"],
                "rev_passes_ms": times["rev"],
                "layer_ratios": {
                    name: statistics.median(parts["tree"][name])
                    / statistics.median(parts["rev"][name])
                    for name in parts["tree"]
                },
            }
        )
    return records


def stack_rows(args: argparse.Namespace, clock: Callable[[], float]) -> list[dict[str, Any]]:
    """Decode steps of 1 and 9 requests, the decoder stack's op of either library."""
    from radixserve.engine.engine import Engine
    from radixserve.model.cpu_linear import PackedLinear
    from radixserve.sampling_params import SamplingParams

    ns = torch.ops.radixserve_cpu
    ops = {"tree": ns.decoder_layers, "rev": torch.ops.radixserve_rev.decoder_layers}
    steps = args.stack_steps
    print(
        f"decoder stack, bf16, {args.threads} thread(s), ms per step's stack call "
        f"({args.clock} clock)"
    )
    print("| rows | this tree | " + args.rev + " | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    base: dict[str, float] = {}
    records = []
    for rows in (1, 9):
        engine = Engine(
            None, dtype="bfloat16", num_pages=512, max_running_requests=rows, decode_graphs="off"
        )
        torch.set_num_threads(args.threads)  # the engine sets the machine's count
        for module in engine.model.modules():  # every linear on GEMV, as a verify step's
            if isinstance(module, PackedLinear) and module.gemv_max_rows > 0:
                module.gemv_max_rows = 64
        acc: dict[str, list[float]] = {"tree": [], "rev": []}
        current = ["tree"]

        def timed(*a: Any, _acc: dict[str, list[float]] = acc) -> Any:
            t = clock()
            try:
                return ops[current[0]](*a)
            finally:
                _acc[current[0]].append((clock() - t) * 1e3)

        params = SamplingParams(max_tokens=2 * steps + 8, temperature=0.0, ignore_eos=True)
        g = torch.Generator().manual_seed(rows)
        vocab = engine.model.config.vocab_size
        for _ in range(rows):
            engine.add_request(torch.randint(10, vocab, (32,), generator=g).tolist(), params)
        while engine.scheduler.waiting or any(r.num_pending > 1 for r in engine.scheduler.running):
            engine.step()
        for _ in range(2):
            engine.step()
        ns.decoder_layers = timed  # type: ignore[attr-defined]  # looked up each forward
        try:
            for i in range(2 * steps):
                current[0] = ("tree", "rev")[(i + i // 2) % 2]  # ABBA order
                engine.step()
        finally:
            ns.decoder_layers = ops["tree"]  # type: ignore[attr-defined]
        while engine.has_unfinished():
            engine.step()
        if not acc["tree"] or len(acc["tree"]) != len(acc["rev"]):
            raise SystemExit("the decode steps did not run the native decoder stack")
        a, b = statistics.median(acc["tree"]), statistics.median(acc["rev"])
        base.setdefault("tree", a)
        base.setdefault("rev", b)
        print(f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.3f}x |", flush=True)
        records.append({"rows": rows, "tree_ms": a, "rev_ms": b, "ratio": a / b})
    print(
        f"9 rows over 1 row: this tree {a / base['tree']:.2f}x, {args.rev} {b / base['rev']:.2f}x"
    )
    return records


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rev", default="65731b6", help="the earlier commit (default: before 16-sum)")
    ap.add_argument("--rows", default="1,2,4,5,9,16")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--passes", type=int, default=12, help="timed passes per kernel and row count")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--stack", action="store_true", help="also the decoder stack at 1 and 9 rows")
    ap.add_argument("--stack-steps", type=int, default=60, help="decode steps per library")
    ap.add_argument("--out", default=None, help="write the records here (JSON)")
    args = ap.parse_args()

    from radixserve.model import cpu_gemv

    if not cpu_gemv.available():
        raise SystemExit("the CPU kernels are not built here (need AVX-512 bf16)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        build_rev(args.rev, Path(tmp), linears_only=not args.stack)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    report = {**header("bench_gemv_rows"), "args": vars(args), "threads": torch.get_num_threads()}
    with torch.inference_mode():
        report["kernel"] = kernel_rows(args, clock)
    if args.stack:
        report["stack"] = stack_rows(args, clock)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
