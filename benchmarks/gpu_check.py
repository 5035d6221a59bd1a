"""The whole engine on one GPU in three short commands, one JSON report (driven by gpu_check.sh).

Three parts, each meant to finish in under six minutes on one H200 (``--budget-s``, default
330 s of phases: the rest is the offline wheel install and start-up)::

    --part 1   decode_bandwidth  the paged decode kernel's bandwidth against the device's copy
                                 bandwidth (>= 70 % the aim), extend TFLOP/s against SDPA
               greedy_vs_hf      engine greedy tokens = transformers' on tiny random checkpoints
                                 built here (Llama / Qwen2 / MQA; fp32 identical, bf16 agreement)
               default_model     the same on SmolLM2-135M-Instruct, only when its converted
                                 weights are already on disk (nothing is fetched; says so)
    --part 2   decode_table      decode steps/s of a SmolLM2-shaped model, batch 1/16/64/256 x
                                 context 1k/4k, eager and CUDA-graphed (the graph speed-up)
               shared_system     4 system prompts x 1000 tokens, 64 chats, radix cache on / off
               serve_http        one ``radixserve serve --device cuda`` on a tiny checkpoint,
                                 64 concurrent chats with a shared system prompt over HTTP
               quant_linear      the CUDA quantized-linear tests and batch-1 int8 timings
                                 (Triton GEMV, dequantized weights, torch's int8pack, bf16)
               model_runner      the runner's no-implicit-sync test and bench_runner_step.py
                                 --model <the SmolLM2-shaped checkpoint> (no fetch)
    --part 3   kernel_tests      pytest tests/kernels compiled for this GPU (TRITON_INTERPRET=0)

Every phase has an estimate (seconds on one H200, the runs' measured times:
``PHASES``); a phase whose estimate does not fit what is left of the budget is skipped and
reported as such, a subprocess phase is stopped when the budget runs out, and each phase
prints its estimated and measured time. The report (``--out``) is rewritten after every
phase, keeping the phases of earlier runs (parts 1, 2 and 3 fill one file).

``--dry-run`` runs the same driver on the CPU with tiny shapes and the torch backend; the
phases that need a GPU are listed with their commands: what CI checks.
"""

from __future__ import annotations

import os

# Before torch: radixserve sets the served process's OpenMP wait policy and spin count
# (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT), which the runtime reads once, when torch loads it.
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the tests' checkpoint builders
sys.path.insert(1, str(ROOT / "benchmarks"))

import gpu_check_phases as ph  # noqa: E402
import gpu_check_serve  # noqa: E402
import torch  # noqa: E402
from gpu_check_phases import Ctx  # noqa: E402

DEFAULT_BUDGET_S = 330.0


@dataclass(frozen=True)
class Phase:
    """One phase: its part, its estimated seconds on one H200 and in a CPU dry run."""

    name: str
    part: int
    estimate_s: float
    dry_estimate_s: float
    run: Callable[[Ctx], dict[str, Any]]

    def estimate(self, dry: bool) -> float:
        return self.dry_estimate_s if dry else self.estimate_s


# In run order: each part leads with what the README needs (bandwidth fraction; graph
# speed-up, shared-system throughput), the open-ended test runs last (they stop at the budget).
PHASES = [
    # H200 estimates: the longer of the two runs' measured seconds (2026-12-04, benchmarks/
    # results/gpu_check_s24_*.json, gpu_check_s26.json) rounded up; default_model has not run
    # (a code read's estimate). The kernel tests alone fill part 3's budget.
    Phase("decode_bandwidth", 1, 85, 1, ph.phase_decode_bandwidth),
    Phase("greedy_vs_hf", 1, 40, 40, ph.phase_greedy_vs_hf),
    Phase("default_model", 1, 45, 1, ph.phase_default_model),
    Phase("kernel_tests", 3, 230, 1, ph.phase_kernel_tests),
    Phase("decode_table", 2, 15, 15, ph.phase_decode_table),
    Phase("shared_system", 2, 10, 20, ph.phase_shared_system),
    Phase("serve_http", 2, 50, 60, gpu_check_serve.phase_serve_http),
    Phase("quant_linear", 2, 105, 1, ph.phase_quant_linear),
    Phase("model_runner", 2, 60, 60, ph.phase_model_runner),
]
BY_NAME = {p.name: p for p in PHASES}


def select(part: str, names: str | None) -> list[Phase]:
    """The phases to run: ``--phases`` names (in the given order) or every phase of ``part``."""
    if names:
        unknown = [n for n in names.split(",") if n not in BY_NAME]
        if unknown:
            raise SystemExit(f"gpu_check: unknown phase(s) {unknown}; known: {list(BY_NAME)}")
        return [BY_NAME[n] for n in names.split(",")]
    return [p for p in PHASES if part == "all" or str(p.part) == part]


def machine(ctx: Ctx) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    if ctx.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count
        )
    import triton

    info["triton"] = triton.__version__
    return info


def load_report(out: Path) -> dict[str, Any]:
    """The report ``out`` holds already (earlier parts), or a new one."""
    try:
        old = json.loads(out.read_text())
        if isinstance(old, dict) and isinstance(old.get("phases"), dict):
            old.setdefault("runs", [])
            return old
    except (OSError, ValueError):
        pass
    return {"phases": {}, "runs": []}


def run_phases(
    ctx: Ctx, phases: list[Phase], budget_s: float, report: dict[str, Any], out: Path
) -> list[str]:
    """Run ``phases`` within ``budget_s``; returns the names that failed. Writes ``out`` after each."""
    failed: list[str] = []
    start = time.monotonic()
    ctx.deadline = start + budget_s
    for phase in phases:
        est = phase.estimate(ctx.dry)
        left = ctx.deadline - time.monotonic()
        print(f"== {phase.name} (part {phase.part}): estimated {est:.0f} s, {left:.0f} s left ==")
        t0 = time.perf_counter()
        if est > left:
            result: dict[str, Any] = {
                "ok": True,
                "skipped": f"budget: estimated {est:.0f} s, {max(left, 0):.0f} s of "
                f"--budget-s {budget_s:.0f} left",
            }
        else:
            try:
                result = phase.run(ctx)
                result["ok"] = True
            except Exception as e:  # record and go on: one report covers every phase
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000]}
                failed.append(phase.name)
        result.update(part=phase.part, estimated_s=est)
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        status = "FAILED" if not result["ok"] else "skipped" if "skipped" in result else "ok"
        print(
            f"   {phase.name}: {status} in {result['elapsed_s']} s (estimated {est:.0f} s)"
            + (f": {result['skipped']}" if "skipped" in result else ""),
            flush=True,
        )
        report["phases"][phase.name] = result
        out.write_text(json.dumps(report, indent=2))  # partial reports survive a timeout
    return failed


def summary(report: dict[str, Any], names: list[str]) -> str:
    """One line per phase of this run: status, measured and estimated seconds."""
    lines = [f"{'phase':18s} {'status':8s} {'measured':>9s} {'estimated':>9s}"]
    for name in names:
        r = report["phases"][name]
        status = "FAILED" if not r["ok"] else "skipped" if "skipped" in r else "ok"
        lines.append(f"{name:18s} {status:8s} {r['elapsed_s']:8.1f}s {r['estimated_s']:8.0f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_check.json"))
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny shapes, GPU-only phases listed"
    )
    ap.add_argument("--part", choices=("1", "2", "3", "all"), default="all")
    ap.add_argument("--phases", default=None, help="comma-separated phase names (overrides --part)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch; use --dry-run on the CPU", file=sys.stderr)
        return 2
    phases = select(args.part, args.phases)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = load_report(out)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ctx = Ctx(args.dry_run, Path(tmp))
        report["runs"].append(
            {
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "part": args.part,
                "phases": [p.name for p in phases],
                "budget_s": args.budget_s,
                "dry_run": ctx.dry,
                "machine": machine(ctx),
            }
        )
        report["dry_run"] = ctx.dry
        failed = run_phases(ctx, phases, args.budget_s, report, out)
    print(summary(report, [p.name for p in phases]))
    print(f"gpu_check: report in {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
