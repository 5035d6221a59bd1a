"""Server start-up against another revision's: router, tokenizer processes and local workers
until every worker has joined, then one request through them.

    python benchmarks/bench_startup.py --baseline 038d5e3 --reps 8

Why: a change to how workers join (the CURVE handshake every local worker now makes, issue
#38) must not make `serve` slower to start. Workers are the test suite's fake workers (the
real worker loop around an engine without a model), so the figure is the serving path's
own start-up, not a model load. Each repetition starts a fresh Python process per revision,
the two revisions alternating (A-B-B-A), and reports wall seconds from building the
``LocalServer`` to ``start()`` returning, and the first request's round trip after it. The
baseline's source comes from ``git archive REV``; both use the default model's tokenizer.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter with the revision's tree first on the path. Older trees keep the
# launcher at radixserve.serving.launcher, newer ones under serving/router/.
CHILD = r"""
import json, sys, time
root, tok, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client
from radixserve.serving.prompts import load_tokenizer
try:
    from radixserve.serving.router.launcher import LocalServer
    from radixserve.serving.router.router import RouterConfig
except ImportError:
    from radixserve.serving.launcher import LocalServer
    from radixserve.serving.router import RouterConfig
tokenizer = load_tokenizer(tok)
vocab = tokenizer.get_vocab()
alphabet = [vocab[c] for c in "abcdefghijklmnopqrstuvwxyz" if c in vocab]
engine = {"alphabet": alphabet, "vocab_size": len(tokenizer)}
program = [sys.executable, root + "/tests/serving/fake_worker.py"]
t0 = time.perf_counter()
srv = LocalServer(tok, num_workers=workers, config=RouterConfig(endpoint="tcp://127.0.0.1:*"),
                  engine_config=engine, worker_program=program, tokenizer=tokenizer)
srv.start(timeout_s=120)
t1 = time.perf_counter()
with Client(srv.endpoint, timeout=60) as c:
    c.generate("hello there", params=SamplingParams(max_tokens=4))
t2 = time.perf_counter()
srv.close()
print(json.dumps({"start_s": t1 - t0, "first_request_s": t2 - t1}))
"""


def baseline_tree(rev: str, into: Path) -> Path:
    """The source of ``rev`` (its tracked files) unpacked under ``into``."""
    data = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
    ).stdout
    out = into / rev
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(out, filter="data")
    return out


def one_start(tree: Path, tokenizer: str, workers: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), tokenizer, str(workers)],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="git revision to compare with")
    ap.add_argument("--reps", type=int, default=8, help="starts per revision")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/bench_startup.json")
    args = ap.parse_args()
    from radixserve.model_store import resolve_model

    tokenizer = str(resolve_model("default"))
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    runs: dict[str, list[dict[str, float]]] = {"head": [], "baseline": []}
    with tempfile.TemporaryDirectory(prefix="radixserve-startup-") as tmp:
        trees = {"head": ROOT, "baseline": baseline_tree(args.baseline, Path(tmp))}
        for rep in range(args.reps):
            order = ("head", "baseline") if rep % 2 == 0 else ("baseline", "head")
            for name in order:
                r = one_start(trees[name], tokenizer, args.workers)
                runs[name].append(r)
                print(
                    f"rep {rep} {name}: start {r['start_s']:.3f} s, first request "
                    f"{r['first_request_s'] * 1000:.1f} ms",
                    flush=True,
                )
    ratios = [h["start_s"] / b["start_s"] for h, b in zip(runs["head"], runs["baseline"])]
    for name in runs:
        print(f"{name}: start-up {summary([r['start_s'] for r in runs[name]])} s")
    print(f"start-up head / baseline, per repetition: {summary(ratios)}")
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    out = {
        "benchmark": "bench_startup",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": head,
        "cpu_model": cpu,
        "cpus": os.cpu_count(),
        "command": "python benchmarks/bench_startup.py " + " ".join(sys.argv[1:]),
        "args": vars(args),
        "runs": runs,
        "start_ratio_head_over_baseline": ratios,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
