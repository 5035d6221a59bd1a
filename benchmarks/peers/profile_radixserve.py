"""Where radixserve's worker spends its time under a bench_peers workload (py-spy).

    python benchmarks/peers/profile_radixserve.py --workload shared_system --concurrency 16 --seconds 30

Starts radixserve exactly as ``bench_peers.py`` does (HTTP gateway, 1 worker), replays the
workload, samples the worker process with py-spy (``--native`` off: Python frames; time in
torch ops is attributed to the Python line that called them) while the load runs, and
prints the share of samples per category: model matmuls (linear layers, lm head),
attention, sampling, the scheduler / batch building / radix cache (Python overhead per
step), ZeroMQ I/O, idle. py-spy lives in its own venv: ``~/.cache/radixserve/peers/tools``
(``python -m venv ~/.cache/radixserve/peers/tools && ~/.cache/radixserve/peers/tools/bin/pip
install py-spy==0.4.3``). Writes the summary to ``--out``; the collapsed stacks (for a
flame graph) go to ``~/.cache/radixserve/peers/logs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import workloads as wl  # noqa: E402

from peers import servers  # noqa: E402
from peers.openai_load import ReplayConfig, replay, summarize  # noqa: E402

# First matching (substring of a frame, category) wins; frames are scanned leaf -> root.
CATEGORIES = [
    # The CPU's one-call decoder stack: every layer's linears, attention and norms in one op,
    # which py-spy's Python frames cannot split (bench_runner_step.py times its parts).
    ("decoder_stack", "native decoder stack (all layers)"),
    ("sdpa", "attention"),
    ("attention", "attention"),
    ("paged", "attention"),
    ("rotary", "attention (rope)"),
    ("rope", "attention (rope)"),
    ("linear", "matmul (linear / lm head)"),
    ("lm_head", "matmul (linear / lm head)"),
    ("logits", "matmul (linear / lm head)"),
    ("mlp", "matmul (linear / lm head)"),
    ("rms_norm", "norms / elementwise"),
    ("norm", "norms / elementwise"),
    ("sampl", "sampling"),
    ("detok", "detokenize"),
    ("radix_cache", "radix cache"),
    ("allocator", "page allocator"),
    ("scheduler", "scheduler / batch building"),
    ("forward_batch", "scheduler / batch building"),
    ("model_runner", "scheduler / batch building"),
    ("zmq", "ZeroMQ I/O"),
    ("msgspec", "ZeroMQ I/O"),
    ("poll", "idle / waiting"),
    ("wait", "idle / waiting"),
]


def categorize(stack: str) -> str:
    frames = stack.split(";")
    for frame in reversed(frames):
        low = frame.lower()
        for key, cat in CATEGORIES:
            if key in low:
                return cat
    return "other (Python)"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", default="shared_system", choices=list(wl.WORKLOADS))
    ap.add_argument(
        "--peer",
        default="radixserve",
        choices=[p for p in servers.PEERS if p.startswith("radixserve")],
    )
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/profile_radixserve.txt")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from radixserve.model_store import ensure_default_model

    model_dir = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    spec = servers.peer_spec(args.peer)
    port = servers.free_port()
    cmd, env = servers.command(spec, model_dir, port, 2.0, 2048, args.concurrency)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = (
        servers.PEERS_ROOT / "logs"
    )  # server log and collapsed stacks stay out of the repository
    scratch.mkdir(parents=True, exist_ok=True)
    srv = servers.ServerProcess(cmd, env, port, scratch / f"{out.stem}.log", spec.ready_path)
    try:
        srv.wait_ready(600)
        kw = (
            {"requests": args.requests}
            if args.workload != "multi_turn"
            else {"conversations": args.requests // 4}
        )
        w = wl.build(args.workload, tok, salt=4242, **kw)
        worker = max(
            psutil.Process(srv.proc.pid).children(recursive=True), key=lambda p: p.memory_info().rss
        )
        pyspy = Path(servers.PEERS_ROOT) / "tools" / "bin" / "py-spy"
        raw = scratch / f"{out.stem}.collapsed"
        prof = subprocess.Popen(
            [
                str(pyspy),
                "record",
                "-p",
                str(worker.pid),
                "-d",
                str(args.seconds),
                "-r",
                "50",
                "-f",
                "raw",
                "-o",
                str(raw),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        cfg = ReplayConfig(srv.base_url, "smollm2", extra_body=spec.extra_body)
        result: dict = {}

        def load() -> None:
            res, wall = asyncio.run(replay(cfg, w.sessions, args.concurrency, tok))
            result.update(summarize([r for s in res for r in s], wall))

        t = threading.Thread(target=load)
        t.start()
        prof.wait(args.seconds + 60)
        t.join()
    finally:
        srv.stop()
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        counts[categorize(stack)] += int(n)
    total = sum(counts.values()) or 1
    lines = [
        f"radixserve worker profile ({args.peer}, {args.workload}, concurrency {args.concurrency}, "
        f"{args.seconds} s of py-spy at 50 Hz, {total} samples); load: "
        f"{result.get('output_tok_per_s', 0):.1f} out tok/s over the whole replay"
    ]
    lines += [f"  {cat:32s} {n / total:6.1%}" for cat, n in counts.most_common()]
    # The heaviest leaf frames, for the notes.
    leaves: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        leaves[stack.split(";")[-1]] += int(n)
    lines.append("  top leaf frames:")
    lines += [f"    {n / total:6.1%}  {frame[:140]}" for frame, n in leaves.most_common(15)]
    text = "\n".join(lines)
    print(text)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
