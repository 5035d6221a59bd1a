"""The default model's weights on transparent huge pages against the same weights without.

Builds two engines of the default model in one process: one as ``load_model`` leaves it (its
weights copied into one ``MADV_HUGEPAGE`` buffer, ``radixserve/memory/hugepages.py``) and one
loaded with that move skipped (weights where loading put them: 4 KB pages). Then, alternating
between the two in every round, it times

- ``gemv``: the small-batch kernel over the 120 layer matrices in model order, one row, as a
  batch-1 decode step reads them (GB/s), beside ``torch.sum`` over 512 MiB (the read rate);
- ``step``: a batch-1 greedy decode step at ``--context`` tokens.

    python benchmarks/bench_hugepages.py                       # bf16
    python benchmarks/bench_hugepages.py --dtype float32
"""

from __future__ import annotations

# Before torch: radixserve sets the process's OpenMP wait policy (see bench_runner_step.py).
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))  # `floor`, after a PYTHONPATH checkout
from floor import read_gbs, read_source  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.memory import hugepages  # noqa: E402
from radixserve.model.cpu_linear import PackedLinear  # noqa: E402
from radixserve.model_store import resolve_model  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402


def huge_kb() -> int:
    """This process's anonymous memory on huge pages, in kB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def layer_weights(engine: Engine) -> list[torch.Tensor]:
    """The weights the small-batch kernel reads in a decode step, in model order (no LM head)."""
    return [
        m._gemv_weight for m in engine.model.model.layers.modules() if isinstance(m, PackedLinear)
    ]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument(
        "--out", default=None, help="JSON results (default: results/hugepages_<dtype>.json)"
    )
    args = ap.parse_args()

    def engine() -> Engine:
        return Engine(
            resolve_model(None),
            dtype=args.dtype,
            device="cpu",
            num_pages=1024,
            max_model_len=4096,
            max_running_requests=1,
        )

    base = huge_kb()
    engines = {"huge pages": engine()}
    moved_kb = huge_kb() - base
    with mock.patch.object(hugepages, "move_to_hugepages", return_value=0):
        engines["4 KB pages"] = engine()
    gemv = torch.ops.radixserve_cpu.gemv_dense
    weights = {name: layer_weights(e) for name, e in engines.items()}
    nbytes = sum(w.numel() * w.element_size() for w in weights["huge pages"])
    xs = {
        k: torch.randn(1, k).to(getattr(torch, args.dtype))
        for k in {w.shape[1] for w in weights["huge pages"]}
    }
    read = read_source()
    rng = torch.Generator().manual_seed(0)
    for e in engines.values():
        prompt = torch.randint(100, 20000, (args.context,), generator=rng).tolist()
        e.add_request(prompt, SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True))
        while e.scheduler.waiting or any(r.num_pending > 1 for r in e.scheduler.running):
            e.step()
        e.step()
    samples: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        samples.setdefault("torch.sum GB/s", []).append(read_gbs(read))
        order = list(engines) if rnd % 2 == 0 else list(engines)[::-1]
        for name in order:
            t = time.perf_counter()
            for w in weights[name]:
                gemv(xs[w.shape[1]], w, None)
            samples.setdefault(f"{name} gemv GB/s", []).append(
                nbytes / (time.perf_counter() - t) / 1e9
            )
            t = time.perf_counter()
            for _ in range(3):
                engines[name].step()
            samples.setdefault(f"{name} step ms", []).append((time.perf_counter() - t) / 3 * 1e3)
    medians = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    record = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="minutes"),
        "dtype": args.dtype,
        "context": args.context,
        "layer_weight_mb": round(nbytes / 1e6, 1),
        "huge_page_mb_mapped": moved_kb // 1024,
        "medians": medians,
        "step_ratio": round(medians["huge pages step ms"] / medians["4 KB pages step ms"], 3),
    }
    print(json.dumps(record, indent=2))
    out = Path(args.out or Path(__file__).parent / "results" / f"hugepages_{args.dtype}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
