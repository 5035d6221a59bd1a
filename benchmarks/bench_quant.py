"""Decode throughput of weight quantization: fp32, bf16, int8, int4 side by side, one process.

Three measurements per configuration, all greedy with ``ignore_eos`` (every configuration
does the same amount of work):

- ``single``: one request, a short prompt, ``--decode-tokens`` new tokens; decode tokens per
  second from the first token to the last (prefill excluded).
- ``c16``: 16 requests with distinct short prompts at once; decode tokens per second once
  all 16 are decoding.
- ``shared_c16``: 16 requests sharing a ~``--system-tokens`` system prompt (radix cache on,
  flushed before each run), distinct questions, ``--shared-tokens`` new tokens each; output
  tokens per second over the whole run (prefill included: the workload of the article's
  shared-system-prompt example).

Every engine is loaded once; the rounds interleave the configurations (rotating their
order), because this machine's speed drifts by up to 3x between runs: only same-run ratios
mean anything. The median of the rounds is reported.

    python benchmarks/bench_quant.py                       # SmolLM2, ~5 minutes on 2 cores
    python benchmarks/bench_quant.py --configs bf16,int8,int4 --rounds 1   # quick

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402

# name -> Engine keyword arguments
CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int4": {"dtype": "bfloat16", "quantization": "int4"},
    "int8+vocab": {"dtype": "bfloat16", "quantization": "int8", "quantize_embeddings": True},
    "int4+vocab": {"dtype": "bfloat16", "quantization": "int4", "quantize_embeddings": True},
    # --quant-dense-cache: batches of 4+ rows on a kept bf16 copy (+2 bytes per quantized weight)
    "int8+cache": {"dtype": "bfloat16", "quantization": "int8", "quant_dense_cache": True},
    "int4+cache": {"dtype": "bfloat16", "quantization": "int4", "quant_dense_cache": True},
}
QUESTIONS = [
    "What is a radix tree?",
    "Name three planets.",
    "How do bees make honey?",
    "Why is the sea salty?",
    "What is a prime number?",
    "Describe a cat.",
    "How does a compiler work?",
    "What is jazz?",
    "Explain gravity simply.",
    "What is origami?",
    "How do glaciers move?",
    "What is a volcano?",
    "Define typography.",
    "What is chess?",
    "How is glass made?",
    "Why do leaves fall?",
]


def _drain(engine: Engine, ids: list[str]) -> tuple[float | None, float, int]:
    """Step until every request finished: (time all had their first token, end time, tokens after it)."""
    pending, started = set(ids), set()
    t_all_started: float | None = None
    after = 0
    while pending:
        for out in engine.step():
            if out.new_token_ids:
                if out.request_id in started and t_all_started is not None:
                    after += len(out.new_token_ids)
                started.add(out.request_id)
            if out.finished:
                pending.discard(out.request_id)
        if t_all_started is None and len(started) == len(ids):
            t_all_started = time.perf_counter()
    return t_all_started, time.perf_counter(), after


def decode_rate(engine: Engine, prompts: list[list[int]], n: int) -> float:
    """Decode tokens per second once every request has its first token."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    t0, t1, tokens = _drain(engine, ids)
    assert t0 is not None
    return tokens / (t1 - t0)


def shared_rate(engine: Engine, system: list[int], questions: list[list[int]], n: int) -> float:
    """Output tokens per second of the shared-system-prompt batch (cache flushed first)."""
    assert engine.flush_cache(), "the cache must be idle to flush"
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    ids = [engine.add_request(system + q, params) for q in questions]
    _, t1, _ = _drain(engine, ids)
    return len(questions) * n / (t1 - t)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="default")
    ap.add_argument(
        "--configs", default="fp32,bf16,int8,int4,int4+vocab", help=f"from {', '.join(CONFIGS)}"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--shared-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results/bench_quant.json")
    args = ap.parse_args()

    names = args.configs.split(",")
    engines = {}
    for name in names:
        t = time.perf_counter()
        engines[name] = Engine(
            args.model,
            num_pages=1024,
            max_running_requests=16,
            num_threads=args.threads,
            **CONFIGS[name],
        )
        report = engines[name].model.quant_report
        print(
            f"loaded {name} in {time.perf_counter() - t:.1f}s"
            + (f" ({report.weight_bytes / 2**20:.0f} MiB weights)" if report else ""),
            flush=True,
        )
    tok = engines[names[0]].tokenizer
    system = tok(
        (
            "You are a careful, friendly assistant who answers questions about science, history and "
            "everyday life. Keep answers short and precise. "
        )
        * 40
    )["input_ids"][: args.system_tokens]
    questions = [tok(" Question: " + q)["input_ids"] for q in QUESTIONS]
    single_prompt = [tok("Once upon a time, in a small village,")["input_ids"]]
    results: dict[str, dict[str, list[float]]] = {
        n: {"single": [], "c16": [], "shared_c16": []} for n in names
    }
    for r in range(args.rounds + 1):  # round 0 warms every engine up and is not counted
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            e = engines[name]
            single = decode_rate(e, single_prompt, args.decode_tokens)
            c16 = decode_rate(e, questions, args.decode_tokens)
            shared = shared_rate(e, system, questions, args.shared_tokens)
            if r:
                for key, v in (("single", single), ("c16", c16), ("shared_c16", shared)):
                    results[name][key].append(v)
                print(
                    f"round {r} {name:>11}: single {single:6.1f}  c16 {c16:6.1f}  shared_c16 {shared:6.1f} tok/s",
                    flush=True,
                )
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in results.items()}
    base = "fp32" if "fp32" in med else names[0]
    print(
        f"\nmedians of {args.rounds} rounds ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads); ratios vs {base}:"
    )
    print("| config | weights MiB | single tok/s | c16 decode tok/s | shared c16 out tok/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows = []
    for n in names:
        rep = engines[n].model.quant_report
        from radixserve.model.quant.apply import module_weight_bytes

        mib = (rep.weight_bytes if rep else module_weight_bytes(engines[n].model)) / 2**20
        m, b = med[n], med[base]
        print(
            f"| {n} | {mib:.0f} | {m['single']:.1f} ({m['single'] / b['single']:.2f}x) | "
            f"{m['c16']:.1f} ({m['c16'] / b['c16']:.2f}x) | {m['shared_c16']:.1f} "
            f"({m['shared_c16'] / b['shared_c16']:.2f}x) |"
        )
        rows.append({"config": n, "weights_mib": mib, **m, "rounds": results[n]})
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": args.model,
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
