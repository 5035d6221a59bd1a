"""Hierarchical prefix cache benchmark: shared prefixes several times larger than L1.

The workload (``workloads.shared_system``): ``--systems`` system prompts of about
``--system-tokens`` tokens, ``--requests`` one-turn chats under them in shuffled order, kept
``--concurrency`` in flight (closed loop). The L1 pool holds about ``--l1-systems`` system
prompts (plus room for the running requests), so without lower tiers most returning system
prompts were evicted by the time they come back. Configurations (same model, same L1):

    L1            the radix cache alone
    L1+L2         + host memory for every prefix (``--enable-hierarchical-cache``)
    L1+L2+L3      + a small L2 (as big as L1) spilling to page files (``--hicache-storage-dir``)
    unbounded     L1 large enough for everything (the hit-rate reference)

Each configuration runs in a subprocess of its own, one at a time (four engines with
full-size pools in one process do not fit a small VM), in an order rotated every round
(``--rounds``; a 2-core VM's speed drifts: ratios of one run are the figures to read, and
the table gives per-round medians). Throughput is tokens over the time spent in engine steps.

Then a restart: the L1+L2+L3 run shuts its engine down (writing L1 and L2 to its
directory); a new process starts an engine over the same directory ("warm") beside one
without ("cold"), and the first ``--restart-requests`` requests (distinct system prompts)
run one at a time on each, alternating; TTFT is the wall time of a one-token generation.

    python benchmarks/bench_hicache.py                    # SmolLM2 (fetched on first use), a few minutes
    # the issue's workload: 32 prompts of ~1000 tokens over an L1 of 8, 4 chats per prompt:
    python benchmarks/bench_hicache.py --systems 32 --system-tokens 1000 --requests 128 --l1-systems 8

Prints a table and writes JSON (``--out``).
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
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import torch  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))  # `workloads`, after a PYTHONPATH checkout

import workloads as wl  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model_store import resolve_model  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402


class Driver:
    """Feeds one engine the workload, ``concurrency`` requests in flight, and times its steps."""

    def __init__(
        self,
        name: str,
        engine: Engine,
        prompts: list[tuple[int, ...]],
        max_tokens: int,
        concurrency: int,
    ) -> None:
        self.name, self.engine = name, engine
        self.queue = deque(prompts)
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.concurrency = concurrency
        self.in_flight = 0
        self.busy_s = 0.0
        self.tokens = 0
        self.outputs: dict[str, list[int]] = {}

    @property
    def done(self) -> bool:
        return not self.queue and self.in_flight == 0

    def step(self) -> None:
        while self.queue and self.in_flight < self.concurrency:
            prompt = self.queue.popleft()
            self.engine.add_request(list(prompt), self.params)
            self.in_flight += 1
            self.tokens += len(prompt)
        t0 = time.perf_counter()
        outs = self.engine.step()
        self.busy_s += time.perf_counter() - t0
        for o in outs:
            self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            self.tokens += len(o.new_token_ids)
            if o.finished:
                self.in_flight -= 1

    def result(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {
            "throughput_tok_s": self.tokens / self.busy_s,
            "hit_rate": s.hit_rate,
            "busy_s": self.busy_s,
            "tokens": self.tokens,
            "computed_tokens": s.computed_tokens_total,
            "demoted_pages": s.demoted_pages_total,
            "loaded_l2_pages": s.loaded_host_pages_total,
            "loaded_l3_pages": s.loaded_storage_pages_total,
            "l3_written_pages": s.storage_written_pages_total,
        }


def ttft(engine: Engine, prompt: tuple[int, ...]) -> tuple[float, int]:
    """Wall time of a one-token generation (prefill + first token) and the cached prompt tokens."""
    t0 = time.perf_counter()
    (out,) = engine.generate(
        [list(prompt)], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    )
    return time.perf_counter() - t0, out.usage.cached_tokens


CONFIGS = ("L1", "L1+L2", "L1+L2+L3", "unbounded")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--systems", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--l1-systems", type=int, default=4, help="system prompts L1 holds")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--restart-requests", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="rounds, configuration order rotated")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/bench_hicache.json")
    # Internal: one configuration in this process, its result as JSON to --result.
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--storage", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--page-bytes", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.concurrency > args.l1_systems:
        ap.error(
            "--concurrency must not exceed --l1-systems "
            "(each request in flight holds its system prompt in L1)"
        )
    return args


class Setup(NamedTuple):
    """The workload and the pool sizes every configuration shares."""

    model: Path
    prompts: list[tuple[int, ...]]
    l1_pages: int
    all_pages: int
    base: dict[str, int]


def setup(args: argparse.Namespace) -> Setup:
    from transformers import AutoTokenizer

    model = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(model))
    work = wl.shared_system(
        tok,
        seed=args.seed,
        systems=args.systems,
        requests=args.requests,
        system_tokens=args.system_tokens,
        max_tokens=args.max_tokens,
    )
    prompts = [s[0].prompt_ids for s in work.sessions]
    longest = max(len(p) for p in prompts) + args.max_tokens
    ps = args.page_size
    # L1: the system prompts it should hold, plus each request's own tail (question + output).
    tail_pages = -(-(longest - args.system_tokens) // ps) + 1
    l1_pages = args.l1_systems * -(-args.system_tokens // ps) + args.concurrency * tail_pages
    # Unbounded: every system prompt and every request's tail stay cached.
    all_pages = (
        args.systems * -(-args.system_tokens // ps) + (len(prompts) + args.concurrency) * tail_pages
    )
    base = {"page_size": ps, "max_num_tokens": 2048, "max_running_requests": args.concurrency}
    return Setup(model, prompts, l1_pages, all_pages, base)


def make_engine(name: str, st: Setup, page_bytes: int, storage: str | None) -> Engine:
    """The engine of configuration ``name`` (``warm``/``cold``: the restart's)."""
    gib = page_bytes / 2**30
    if name == "L1" or name == "cold":
        return Engine(str(st.model), num_pages=st.l1_pages, **st.base)
    if name == "L1+L2":
        return Engine(
            str(st.model),
            num_pages=st.l1_pages,
            enable_hierarchical_cache=True,
            hicache_size=st.all_pages * gib,
            **st.base,
        )
    if name in ("L1+L2+L3", "warm"):
        return Engine(
            str(st.model),
            num_pages=st.l1_pages,
            hicache_size=st.l1_pages * gib,
            hicache_storage_dir=storage,
            **st.base,
        )
    if name == "unbounded":
        return Engine(str(st.model), num_pages=st.all_pages, **st.base)
    raise ValueError(f"unknown configuration {name!r}")


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Replay the workload on configuration ``name`` (in this process)."""
    st = setup(args)
    engine = make_engine(name, st, args.page_bytes, args.storage)
    d = Driver(name, engine, st.prompts, args.max_tokens, args.concurrency)
    while not d.done:
        d.step()
    out = d.result()
    out["outputs"] = sorted(d.outputs.values())
    if name == "L1+L2+L3":
        engine.close()  # a clean shutdown writes L1 and L2 to the directory
    return out


def run_restart(args: argparse.Namespace) -> dict[str, Any]:
    """TTFT of the first requests (distinct system prompts) on a warm and a cold engine."""
    st = setup(args)
    warm = make_engine("warm", st, args.page_bytes, args.storage)
    cold = make_engine("cold", st, args.page_bytes, None)
    firsts: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for p in st.prompts:
        head = p[: args.system_tokens // 2]
        if head not in seen:
            seen.add(head)
            firsts.append(p)
    ttft_s: dict[str, list[float]] = {"warm": [], "cold": []}
    cached: dict[str, list[int]] = {"warm": [], "cold": []}
    for i, p in enumerate(firsts[: args.restart_requests]):
        pair = (("warm", warm), ("cold", cold))
        for name, e in pair if i % 2 == 0 else pair[::-1]:
            t, c = ttft(e, p)
            ttft_s[name].append(t)
            cached[name].append(c)
    return {"ttft_s": ttft_s, "cached_tokens": cached}


def _child(args: argparse.Namespace, name: str, storage: str, page_bytes: int) -> dict[str, Any]:
    """Run configuration ``name`` in a fresh interpreter; return its result."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--one", name]
    cmd += ["--storage", storage, "--page-bytes", str(page_bytes), "--result", result]
    try:
        subprocess.run(cmd, check=True)
        return json.loads(Path(result).read_text())
    finally:
        Path(result).unlink(missing_ok=True)


def main() -> None:
    args = parse_args()
    if args.one is not None:
        res = run_restart(args) if args.one == "restart" else run_config(args.one, args)
        Path(args.result).write_text(json.dumps(res))
        return
    # A timeout's SIGTERM unwinds (subprocess.run then kills the running configuration).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = [c for c in args.configs.split(",") if c]
    st = setup(args)
    probe = Engine(str(st.model), num_pages=1, **st.base)
    page_bytes = probe.pool.bytes_per_page
    del probe
    print(
        f"{len(st.prompts)} requests, {args.systems} system prompts of ~{args.system_tokens} "
        f"tokens; L1 {st.l1_pages} pages of {args.page_size} (~{args.l1_systems} system "
        f"prompts), unbounded {st.all_pages}; one process per configuration",
        flush=True,
    )
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    restarts: list[dict[str, Any]] = []
    same: dict[str, bool] = {}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        storage = tempfile.mkdtemp(prefix="bench-hicache-")
        try:
            outputs: dict[str, list[list[int]]] = {}
            for name in order:
                res = _child(args, name, storage, page_bytes)
                outputs[name] = res.pop("outputs")
                rounds[name].append(res)
                print(
                    f"round {r} {name:<10} {res['throughput_tok_s']:7.0f} tok/s  "
                    f"hit {res['hit_rate']:.3f}  busy {res['busy_s']:.1f} s",
                    flush=True,
                )
                # Keep what is measured so far (a run cut short by a timeout still reports).
                partial = Path(args.out).with_suffix(".partial.json")
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=2))
            if "L1+L2+L3" in names and args.restart_requests > 0:
                restarts.append(_child(args, "restart", storage, page_bytes))
            if "unbounded" in outputs:
                for name, outs in outputs.items():
                    same[name] = same.get(name, True) and outs == outputs["unbounded"]
        finally:
            shutil.rmtree(storage, ignore_errors=True)

    results = {
        n: {
            k: statistics.median(x[k] for x in rs)
            for k, v in rs[0].items()
            if isinstance(v, (int, float))
        }
        for n, rs in rounds.items()
    }
    ref = results.get("L1") or next(iter(results.values()))
    unb = results.get("unbounded")
    print(
        f"\n{'config':<11} {'throughput':>11} {'vs L1':>6} {'hit rate':>9} {'of unbounded':>13} "
        f"{'L2 loads':>9} {'L3 loads':>9}"
    )
    for name, r in results.items():
        of_unb = r["hit_rate"] / unb["hit_rate"] if unb else float("nan")
        print(
            f"{name:<11} {r['throughput_tok_s']:>8.0f} t/s "
            f"{r['throughput_tok_s'] / ref['throughput_tok_s']:>5.2f}x {r['hit_rate']:>8.1%} "
            f"{of_unb:>12.1%} {r['loaded_l2_pages']:>9.0f} {r['loaded_l3_pages']:>9.0f}"
        )
    restart: dict[str, Any] = {}
    if restarts:
        warm = [t for x in restarts for t in x["ttft_s"]["warm"]]
        cold = [t for x in restarts for t in x["ttft_s"]["cold"]]
        w, c = statistics.median(warm), statistics.median(cold)
        restart = {"runs": restarts, "median_warm_s": w, "median_cold_s": c}
        print(
            f"\nrestart, first {len(restarts[0]['ttft_s']['warm'])} requests x {len(restarts)} "
            f"rounds: TTFT median warm {w * 1000:.0f} ms, cold {c * 1000:.0f} ms ({c / w:.1f}x "
            f"lower warm); cached tokens warm {restarts[0]['cached_tokens']['warm']}, cold "
            f"{restarts[0]['cached_tokens']['cold']}"
        )
    print(f"greedy outputs identical to the unbounded cache's: {same}")
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_avg_at_end": os.getloadavg(),
        },
        "args": {k: v for k, v in vars(args).items() if v is not None or k == "model"},
        "l1_pages": st.l1_pages,
        "unbounded_pages": st.all_pages,
        "results": results,
        "rounds": rounds,
        "outputs_identical": same,
        "restart": restart,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
