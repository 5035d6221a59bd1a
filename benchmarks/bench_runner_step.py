"""Where one engine step's time goes: scheduling, input preparation, forward, sampling, output.

Runs ``--batch`` requests (default 1, 16 and 64) of the default model through the offline
engine, decoding together after their prefills, with the static-buffer decode path (CUDA
graphs on CUDA) and overlap scheduling each on and off, interleaved in one run so that the
machine's drift hits every configuration alike. For each it reports the median decode step and its split::

    schedule   Scheduler.schedule: batch decision, page allocation, the StepPlan's host lists
    prepare    packing the plan and the sampling inputs, the one host->device copy, page-table patch
    forward    the model forward; a static decode step's DecodeGraphs.run (its buffer
               fills and, on CUDA, the graph replay)
    sample     the sampler on the device and the one read back
    process    Scheduler.process: tokens appended, stop checks, cache inserts, outputs

On CUDA the launches return at once, so the split comes from as many steps again with a
device synchronize around every part (each part then holds its own device time; those
steps lose the overlap, the timed ones keep it). ``--model DIR`` serves a local checkpoint
(gpu_check passes a SmolLM2-shaped random one: nothing is fetched).

    python benchmarks/bench_runner_step.py                         # SmolLM2 fp32, batch 1/16/64
    python benchmarks/bench_runner_step.py --batch 1 --dtype bfloat16 --steps 30
    python benchmarks/bench_runner_step.py --native-stack --batch 1 --prompt-tokens 540

The weight-streaming floor (every weight read once at the memory bandwidth this machine
shows reading a large tensor in the weights' memory, host RAM or the GPU's HBM, sampled
between the timed rounds of the same run) is printed
with the batch-1 step's ratio to it: the median step against the median read, and each round
against the read taken just before it (the median of those paired ratios drifts least).
"""

from __future__ import annotations

# Before torch: radixserve sets the served process's OpenMP wait policy and spin count
# (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT), which the runtime reads once, when torch loads it.
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))  # `timing`, after a PYTHONPATH checkout
from floor import read_gbs, read_source  # noqa: E402
from timing import time_calls  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402


class SplitClock:
    """The parts' clock: plain wall time, or (``syncing``, on CUDA) wall time after a device
    synchronize, so that each part holds its own device work rather than the launches
    alone (the split's steps are then not the timed steps: they lose the overlap)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.syncing = False

    def __call__(self) -> float:
        if self.syncing:
            torch.cuda.synchronize()
        return time.perf_counter()


def instrument(engine: Engine, acc: dict[str, float], clock: SplitClock | None = None) -> None:
    """Time the step's parts (instance attributes: only this engine is affected). Idempotent.

    A decode step from the static buffers (a CUDA graph replay, which never calls the
    model's forward) is timed as ``forward`` at ``DecodeGraphs.run``: its buffer fills and
    the replay."""
    if getattr(engine, "_bench_acc", None) is not None:
        engine._bench_acc.clear()  # type: ignore[attr-defined]
        return
    engine._bench_acc = acc  # type: ignore[attr-defined]
    clock = clock or SplitClock(cuda=False)
    engine._bench_clock = clock  # type: ignore[attr-defined]
    r, s = engine.runner, engine.scheduler

    def tc(obj: Any, name: str, key: str) -> None:
        time_calls(obj, name, key, acc, clock)

    tc(s, "schedule", "schedule")
    tc(s, "advance", "process")  # process() = advance + resolve; overlap calls them apart
    tc(s, "resolve", "process")
    tc(r, "_stage", "prepare")
    tc(r.sampler, "prepare", "prepare")
    tc(r.staging, "upload", "prepare")
    tc(r, "_patch_page_table", "prepare")
    # The eager path's forward; the static path's run (it calls the forward it was built
    # with, untimed, or replays a graph): each step counted once.
    tc(r.model, "forward", "forward")
    if r.decode_graphs is not None:
        tc(r.decode_graphs, "run", "forward")
    tc(r.sampler, "sample_staged", "sample")
    tc(r.staging, "read", "sample")


def weight_bytes(engine: Engine) -> int:
    """Bytes of every weight a decode step reads once (a tied head counted once)."""
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


def token_range(engine: Engine) -> tuple[int, int]:
    """Prompt token ids drawn from [100, 20000), within the vocabulary (a tiny checkpoint's)."""
    vocab = engine.model.config.vocab_size
    return (100, 20000) if vocab > 20000 else (3, vocab)


def ttft_ms(engine: Engine, seed: int, tokens: int = 32) -> float:
    """Time to the first token of one ``tokens``-token prompt (prefill + first sample), alone."""
    g = torch.Generator().manual_seed(seed)
    rid = engine.add_request(
        torch.randint(*token_range(engine), (tokens,), generator=g).tolist(),
        SamplingParams(max_tokens=1, temperature=0.0),
    )
    t = time.perf_counter()
    while True:
        if any(o.request_id == rid and o.new_token_ids for o in engine.step()):
            ms = (time.perf_counter() - t) * 1e3
            break
    while engine.has_unfinished():
        engine.step()
    return ms


def _label(mode: tuple[str, str]) -> str:
    """``static <g> overlap <o>``, or ``native stack <on|off>``."""
    if mode[0] == "stack":
        return f"native stack {mode[1]}"
    return f"static {mode[0]:3s} overlap {mode[1]:3s}"


def run(engine: Engine, batch: int, steps: int, prompt_tokens: int = 32) -> dict[str, Any]:
    """Median step of ``steps`` decode steps of ``batch`` requests, and its split (on CUDA
    from ``steps`` more steps with the syncing clock: the timed ones keep their overlap)."""
    cuda = engine.runner.device.type == "cuda"
    params = SamplingParams(
        max_tokens=steps * (2 if cuda else 1) + 2, temperature=0.0, ignore_eos=True
    )
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(*token_range(engine), (prompt_tokens,), generator=g).tolist()
        engine.add_request(prompt, params)
    while any(r.num_pending > 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefills
    engine.step()  # (overlap: the last prefill's results come with the next step)
    acc: dict[str, float] = getattr(engine, "_bench_acc", None) or collections.defaultdict(float)
    instrument(engine, acc, SplitClock(cuda))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    split_total = sum(times)
    if cuda:  # the split from steps of their own, each part synchronized
        clock: SplitClock = engine._bench_clock  # type: ignore[attr-defined]
        acc.clear()
        clock.syncing = True
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        split_total = time.perf_counter() - t
        clock.syncing = False
    parts = {k: v / steps * 1e3 for k, v in acc.items()}  # before the tail steps add to acc
    while engine.has_unfinished():
        engine.step()
    total = sum(times)
    parts["other"] = split_total / steps * 1e3 - sum(parts.values())
    return {
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_mean": total / steps * 1e3,
        "parts_ms": parts,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--num-pages", type=int, default=1024)
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=32,
        help="each request's prompt: the decode steps attend over this many tokens and more",
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved repetitions per configuration"
    )
    ap.add_argument(
        "--ttft-tokens",
        type=int,
        default=32,
        help="the prompt of the first and second requests timed alone (a cold prefill)",
    )
    ap.add_argument(
        "--native-stack",
        action="store_true",
        help="compare the CPU's one-call decoder stack on and off instead (graphs, overlap: defaults)",
    )
    ap.add_argument("--out", default="benchmarks/results/bench_runner_step.json")
    args = ap.parse_args()
    from radixserve.model_store import resolve_model

    path = resolve_model(None if args.model == "default" else args.model)

    def engine(**kw: Any) -> Engine:
        return Engine(
            path,
            dtype=args.dtype,
            device=args.device,
            num_pages=args.num_pages,
            max_model_len=max(2048, args.ttft_tokens + 1, args.prompt_tokens + args.steps + 2),
            max_running_requests=max(args.batch),
            **kw,
        )

    # (static decode, overlap) pairs; with --native-stack, ("stack", on/off) instead.
    modes: list[tuple[str, str]]
    if args.native_stack:
        modes = [("stack", "on"), ("stack", "off")]
        engines = {m: engine() for m in modes}
        for (_, on), e in engines.items():
            e.model.native_stack = on == "on"
    else:
        modes = [(g, o) for g in ("off", "on") for o in ("off", "on")]
        engines = {(g, o): engine(decode_graphs=g, overlap_schedule=o) for g, o in modes}
    # The first request on a fresh engine against a second one of the same shape (warm start).
    first = {m: ttft_ms(e, 1, args.ttft_tokens) for m, e in engines.items()}
    second = {m: ttft_ms(e, 2, args.ttft_tokens) for m, e in engines.items()}
    for m in modes:
        print(
            f"{_label(m)}: first request TTFT {first[m]:.1f} ms, second {second[m]:.1f} ms "
            f"({first[m] / second[m]:.2f}x)",
            flush=True,
        )
    read_src = read_source(args.device)  # the weights' memory: host RAM, or the GPU's HBM
    read_samples = [read_gbs(read_src) for _ in range(3)]
    results: list[dict[str, Any]] = []
    for batch in args.batch:
        rounds: dict[tuple[str, str], list[dict[str, Any]]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for m in modes:  # interleaved, round after round: drift hits every configuration alike
                read_samples.append(read_gbs(read_src))
                rounds[m].append(run(engines[m], batch, args.steps, args.prompt_tokens))
                rounds[m][-1]["read_gbs_before"] = read_samples[-1]
        for (g, o), rs in rounds.items():
            med = statistics.median(r["step_ms_median"] for r in rs)
            parts = {
                k: statistics.median(r["parts_ms"].get(k, 0.0) for r in rs)
                for k in rs[0]["parts_ms"]
            }
            results.append(
                {
                    "batch": batch,
                    "mode": _label((g, o)),
                    "static_decode": g,
                    "overlap": o,
                    "step_ms_median": med,
                    "rounds_ms": [r["step_ms_median"] for r in rs],
                    "rounds_read_gbs": [r["read_gbs_before"] for r in rs],
                    "parts_ms": parts,
                }
            )
            shown = "  ".join(f"{k} {v:5.1f}" for k, v in sorted(parts.items()))
            each = ", ".join(f"{r['step_ms_median']:.1f}" for r in rs)
            print(
                f"batch {batch:3d} {_label((g, o))}: step {med:6.1f} ms (median of {args.rounds} "
                f"rounds: {each}; {shown})",
                flush=True,
            )
    # The floor at the median bandwidth the reads between rounds saw (the steps are medians
    # too), and at the best one (a burst: the lowest floor).
    nbytes = weight_bytes(engines[modes[0]])
    for r in results:
        # Each round against the read just before it: this VM's bandwidth moves within
        # minutes, and a round and its own read see the same machine.
        r["paired_floor_ratios"] = [
            ms / (nbytes / g / 1e6) for ms, g in zip(r["rounds_ms"], r["rounds_read_gbs"])
        ]
        r["paired_floor_ratio_median"] = statistics.median(r["paired_floor_ratios"])
    gbs, best_gbs = statistics.median(read_samples), max(read_samples)
    floor_ms, best_floor_ms = nbytes / gbs / 1e6, nbytes / best_gbs / 1e6
    print(
        f"weight-streaming floor: {floor_ms:.1f} ms per step ({nbytes / 1e6:.0f} MB at "
        f"{gbs:.1f} GB/s, the median of {len(read_samples)} reads between rounds); "
        f"{best_floor_ms:.1f} ms at the best read ({best_gbs:.1f} GB/s)"
    )
    for r in results:
        if r["batch"] == 1:
            print(
                f"batch   1 {r['mode']}: {r['step_ms_median'] / floor_ms:.2f}x the floor "
                f"({r['step_ms_median'] / best_floor_ms:.2f}x at the best read; each round "
                f"against the read just before it: median "
                f"{r['paired_floor_ratio_median']:.2f}x, rounds "
                + ", ".join(f"{x:.2f}" for x in r["paired_floor_ratios"])
                + ")"
            )
    out = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "dtype": args.dtype,
        "device": args.device,
        "prompt_tokens": args.prompt_tokens,
        "weight_bytes": nbytes,
        "weight_floor_ms": floor_ms,
        "read_gbs": gbs,
        "weight_floor_ms_best_read": best_floor_ms,
        "read_gbs_samples": read_samples,
        "results": results,
        "ttft_tokens": args.ttft_tokens,
        "ttft_first_second_ms": {_label(m): [first[m], second[m]] for m in modes},
        "cpu_amx": os.environ.get("RADIXSERVE_CPU_AMX", "1") != "0",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
