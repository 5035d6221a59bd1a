"""Speculative decoding through HTTP: acceptance and tokens/s per drafter and workload.

Starts one ``radixserve serve --http-port 0`` per configuration (no speculation, and each
``--speculative-algorithm`` asked for), then replays seeded workloads one request at a time
through ``/v1/completions``, the configurations interleaved request by request (this
machine's speed drifts: only same-run ratios mean anything)::

    copy      answer by quoting a long document, and edit code (rename, reformat): the
              answer repeats the prompt
    chat      multi-turn chat whose later answers repeat earlier turns' text
    fork      a prompt program forked into branches over one document (a DSL ``fork``):
              later branches can draft from what earlier ones answered
    nocopy    creative writing at temperature 0.8: nothing to copy; sampled requests
              speculate by rejection sampling, adaptive k turning their drafts off

Then ``--concurrency`` (16) requests at a time on the peers benchmark's shared-system chats
(benchmarks/workloads.py), per configuration in rotated rounds, each round with chats of its
own (``--concurrent-only``: this phase alone; ``concurrent.over_off`` in the JSON: each
configuration's tokens/s over ``off``'s round by round, median and range). Before and after, the
per-token weight-streaming floor (benchmarks/floor.py: the checkpoint's weight bytes over
the read bandwidth sampled then), against which one request's time per token is set.
Every request's record is kept in the JSON, in the order it ran.

Configuration ``draft`` runs ``--speculative-algorithm draft`` with ``--draft-model DIR``, or,
without one, a truncated-layer draft of the model made on the fly (its first
``--draft-layers`` layers, embeddings, norm and head: ``radixserve.speculative.make_draft``;
no distilled draft of the default model exists, and this is not one).

Per configuration and workload: requests, output tokens, tokens/s (sum of tokens over sum
of wall time, the prefill included), decode tokens/s (each request streamed: the tokens
after its first over the time after its first token, summed; speculation speeds the decode,
not the prefill), drafted and accepted tokens (usage's completion_tokens_details), acceptance
rate and mean accepted length per verification (1 + accepted / verify steps is the
engine's figure; here accepted / drafted and tokens per forward are from usage alone).

    python benchmarks/bench_speculative.py --configs off,ngram,radix --per-workload 4
    python benchmarks/bench_speculative.py --configs off,draft --draft-layers 6
    python benchmarks/bench_speculative.py --configs off,radix --concurrent-only \\
        --concurrent-rounds 8
    python benchmarks/bench_speculative.py --model /path/to/hf --max-tokens 16 --out ''

Writes JSON (``--out``); results go into benchmarks/README.md through the results flow.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

WORDS = (
    "cache page prefix token tree request model batch decode prefill memory evict lock "
    "worker router stream kernel thread layer weight budget queue tenant session"
).split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def copy_workload(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Prompts whose answers quote them: a document to quote, code to edit."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            doc = " ".join(_sentence(rng, rng.randint(8, 14)) for _ in range(12))
            prompt = f"Document:\n{doc}\n\nQuote the document's first three sentences exactly.\n"
        else:
            body = "\n".join(f"    total += item_{j} * weight_{j}" for j in range(12))
            code = f"def score(items):\n    total = 0\n{body}\n    return total\n"
            prompt = f"{code}\nRewrite this function with `total` renamed to `acc`:\n"
        out.append({"prompt": prompt, "temperature": 0.0})
    return out


def chat_workload(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Multi-turn chats: the last turn asks to repeat an earlier answer."""
    out = []
    for _ in range(n):
        turns = []
        for _ in range(3):
            turns.append(f"User: {_sentence(rng, 6)}\nAssistant: {_sentence(rng, 20)}")
        prompt = "\n".join(turns) + "\nUser: Repeat your first answer word for word.\nAssistant:"
        out.append({"prompt": prompt, "temperature": 0.0})
    return out


def nocopy_workload(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Creative writing, sampled: nothing to copy."""
    topics = ["a lighthouse", "a city at night", "an old map", "the first snow", "a robot"]
    return [
        {
            "prompt": f"Write a short poem about {rng.choice(topics)}.\n",
            "temperature": 0.8,
            "ignore_eos": True,  # sampled lengths differ per run: time the same count
        }
        for _ in range(n)
    ]


def fork_workload(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """A prompt program forked into branches (what a DSL ``fork`` sends): one shared document,
    then each branch's own instruction; later branches can draft from earlier ones' answers."""
    doc = " ".join(_sentence(rng, rng.randint(8, 14)) for _ in range(10))
    asks = (
        "Quote the second sentence exactly.",
        "Repeat the document's first two sentences.",
        "Copy the last sentence word for word.",
        "Write out the first sentence again.",
    )
    return [
        {"prompt": f"Document:\n{doc}\n\n{asks[i % len(asks)]}\n", "temperature": 0.0}
        for i in range(n)
    ]


WORKLOADS = {
    "copy": copy_workload,
    "chat": chat_workload,
    "fork": fork_workload,
    "nocopy": nocopy_workload,
}


def build(per_workload: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    """Every workload's requests, seeded (the same for every configuration)."""
    return {
        name: make(random.Random(f"{seed}-{name}"), per_workload)
        for name, make in WORKLOADS.items()
    }


def summarize(results: list[dict[str, Any]]) -> dict[str, float]:
    """Totals and ratios over one configuration's results on one workload."""
    tokens = sum(r["tokens"] for r in results)
    seconds = sum(r["seconds"] for r in results)
    drafted = sum(r["drafted"] for r in results)
    accepted = sum(r["accepted"] for r in results)
    # Decoding alone: the tokens after each request's first over the time after it (the
    # prefill, which speculation does not touch, left out).
    decode_tokens = sum(r["tokens"] - 1 for r in results if "decode_s" in r)
    decode_s = sum(r["decode_s"] for r in results if "decode_s" in r)
    return {
        "requests": len(results),
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
    }


def sse_chunks(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI-style event stream's ``data:`` lines, up to ``[DONE]``."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


def one_request(client: Any, req: dict[str, Any], max_tokens: int, seed: int) -> dict[str, Any]:
    """One request, streamed: its wall time (``seconds``), the time to its first token
    (``ttft_s``) and its decode time after it (``decode_s``), and usage's token counts."""
    body = {
        "model": "default",
        "prompt": req["prompt"],
        "max_tokens": max_tokens,
        "temperature": req["temperature"],
        "seed": seed,
        "ignore_eos": req.get("ignore_eos", False),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for chunk in sse_chunks(r.iter_lines()):
            if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    seconds = time.perf_counter() - t0
    details = usage.get("completion_tokens_details") or {}
    accepted = details.get("accepted_prediction_tokens", 0)
    ttft = (first if first is not None else t0 + seconds) - t0
    return {
        "tokens": usage["completion_tokens"],
        "seconds": seconds,
        "ttft_s": ttft,
        "decode_s": seconds - ttft,
        "accepted": accepted,
        "drafted": accepted + details.get("rejected_prediction_tokens", 0),
    }


class Server:
    """``radixserve serve --http-port 0`` in a subprocess, stopped with SIGTERM."""

    def __init__(self, model: str, extra: list[str]) -> None:
        cmd = [sys.executable, "-m", "radixserve", "serve", "--workers", "1", "--http-port", "0"]
        cmd += ["--endpoint", "tcp://127.0.0.1:*"] + (["--model", model] if model else []) + extra
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.url = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            m = re.search(r"HTTP on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                break
        if not self.url:
            self.stop()
            raise RuntimeError("the server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def draft_flags(args: argparse.Namespace, workdir: Path) -> list[str]:
    """The ``draft`` configuration's flags: ``--draft-model``, or a truncated-layer draft of the
    model (its first ``--draft-layers`` layers, a fifth of them by default) made in ``workdir``."""
    path = args.draft_model
    if not path:
        from radixserve.model_store import resolve_model
        from radixserve.speculative.make_draft import make_truncated_draft

        model = resolve_model(args.model or None)
        layers = args.draft_layers
        if layers is None:
            total = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
            layers = max(1, total // 5)
        path = str(make_truncated_draft(model, workdir / f"draft-{layers}", layers))
    return ["--speculative-algorithm", "draft", "--speculative-draft-model", path]


def start_servers(args: argparse.Namespace, configs: list[str], workdir: Path) -> dict[str, Server]:
    """One server per configuration, alike but for the speculative flags."""
    common = ["--num-threads", str(args.threads), "--dtype", args.dtype]
    servers: dict[str, Server] = {}
    for c in configs:
        spec = [] if c == "off" else ["--speculative-algorithm", c]
        if c == "draft":
            spec = draft_flags(args, workdir)
        spec += ["--speculative-num-tokens", str(args.k)] if spec else []
        servers[c] = Server(args.model, common + spec)
    return servers


def one_at_a_time(
    args: argparse.Namespace, clients: dict[str, Any], configs: list[str]
) -> list[dict[str, Any]]:
    """Every workload's requests, one at a time, the configurations' order rotated per request
    (A-B-C, B-C-A, ...: drift in the machine's speed falls on all alike). Every request's
    record is kept, in the order it ran."""
    records = []
    for name, reqs in build(args.per_workload, args.seed).items():
        for i, req in enumerate(reqs):
            order = configs[i % len(configs) :] + configs[: i % len(configs)]
            for c in order:
                r = one_request(clients[c], req, args.max_tokens, args.seed + i)
                records.append({"config": c, "workload": name, "request": i, **r})
    return records


def shared_system_concurrent(
    args: argparse.Namespace, servers: dict[str, Server], configs: list[str]
) -> dict[str, Any]:
    """``--concurrency`` requests at a time on benchmarks/workloads.py's shared-system chats
    (the peers benchmark's workload), per configuration in rotated rounds (two
    configurations: A-B, B-A, ...): output tokens/s, and what was drafted and accepted (many
    decoding at once: drafting stops above 8). Each round has chats of its own (the
    workload's seed plus the round): a round's system prompts are cached after its first
    requests, never from an earlier round, so every round measures the same thing. A round
    before them is not recorded (each server's first batch of this size)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from transformers import AutoTokenizer

    from radixserve.model_store import resolve_model

    sys.path.insert(1, str(Path(__file__).resolve().parent))
    import workloads

    tok = AutoTokenizer.from_pretrained(resolve_model(args.model or None))

    def round_bodies(r: int) -> list[dict[str, Any]]:
        wl = workloads.shared_system(
            tok,
            seed=args.seed + r,
            requests=args.concurrent_requests,
            system_tokens=500,
            max_tokens=args.max_tokens,
        )
        return [
            {
                "model": "default",
                "messages": list(s[0].messages),
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            for s in wl.sessions
        ]

    def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
        with httpx.Client(base_url=url, timeout=600) as cl:
            r = cl.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            usage = r.json()["usage"]
        details = usage.get("completion_tokens_details") or {}
        acc = details.get("accepted_prediction_tokens", 0)
        return {
            "tokens": usage["completion_tokens"],
            "accepted": acc,
            "drafted": acc + details.get("rejected_prediction_tokens", 0),
        }

    def run_round(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(args.concurrency) as pool:
            return list(pool.map(lambda b: post(url, b), bodies))

    # A round of chats of their own first, not recorded: every server's first batch of
    # this size (its allocations, its first steps of each shape) is not timed.
    warm = round_bodies(-1)
    for c in configs:
        run_round(servers[c].url, warm)
    rounds: list[dict[str, Any]] = []
    for r in range(args.concurrent_rounds):
        bodies = round_bodies(r)
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for c in order:
            t0 = time.perf_counter()
            done = run_round(servers[c].url, bodies)
            wall = time.perf_counter() - t0
            tokens = sum(d["tokens"] for d in done)
            rounds.append(
                {
                    "config": c,
                    "round": r,
                    "tokens": tokens,
                    "wall_s": wall,
                    "tokens_per_s": tokens / wall,
                    "drafted": sum(d["drafted"] for d in done),
                    "accepted": sum(d["accepted"] for d in done),
                }
            )
    return {
        "concurrency": args.concurrency,
        "requests": args.concurrent_requests,
        "fresh_chats_per_round": True,
        "rounds": rounds,
        "over_off": concurrent_over_off(rounds),
    }


def concurrent_over_off(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per configuration: its tokens/s over ``off``'s in the same round, median and range over
    the rounds (empty without ``off``)."""
    by = {(r["config"], r["round"]): r["tokens_per_s"] for r in rounds}
    out: dict[str, dict[str, float]] = {}
    for c in sorted({r["config"] for r in rounds} - {"off"}):
        ratios = [v / by[("off", n)] for (cc, n), v in by.items() if cc == c and ("off", n) in by]
        if ratios:
            out[c] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
                "rounds": len(ratios),
            }
    return out


def weight_floor_ms(args: argparse.Namespace) -> dict[str, float]:
    """The per-token weight-streaming floor of one request's decode step: the served
    checkpoint's weight bytes over the read bandwidth sampled now (benchmarks/floor.py)."""
    import torch

    sys.path.insert(1, str(Path(__file__).resolve().parent))
    from floor import checkpoint_weight_bytes, read_gbs, read_source

    from radixserve.model_store import resolve_model

    torch.set_num_threads(args.threads)
    src = read_source()
    gbs = sorted(read_gbs(src) for _ in range(5))[2]
    del src
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    nbytes = checkpoint_weight_bytes(resolve_model(args.model or None), dtype)
    return {"read_gbs_median": gbs, "weight_bytes": nbytes, "floor_ms": nbytes / gbs / 1e6}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import httpx

    configs = [c for c in args.configs.split(",") if c]
    workdir = tempfile.TemporaryDirectory(prefix="bench_speculative_")
    servers: dict[str, Server] = {}
    try:
        servers = start_servers(args, configs, Path(workdir.name))
        floor_before = weight_floor_ms(args)
        records: list[dict[str, Any]] = []
        if not args.concurrent_only:
            clients = {c: httpx.Client(base_url=s.url, timeout=600) for c, s in servers.items()}
            records = one_at_a_time(args, clients, configs)
            for cl in clients.values():
                cl.close()
        concurrent = (
            shared_system_concurrent(args, servers, configs) if args.concurrency > 1 else None
        )
        floor_after = weight_floor_ms(args)
    finally:
        for s in servers.values():
            s.stop()
        workdir.cleanup()
    table = summarize_records(records, configs)
    return {
        "args": vars(args),
        "results": table,
        "requests": records,
        "floor": {"before": floor_before, "after": floor_after},
        "concurrent": concurrent,
    }


def summarize_records(records: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    """Per configuration and workload: totals, acceptance and the speed-up over ``off``."""
    table: dict[str, dict[str, Any]] = {}
    for c in configs:
        per: dict[str, list[dict[str, Any]]] = {}
        for r in records:
            if r["config"] == c:
                per.setdefault(r["workload"], []).append(r)
        table[c] = {w: summarize(rs) for w, rs in per.items()}
    if "off" in table:
        for per_w in table.values():
            for w, row in per_w.items():
                base = table["off"][w]["tokens_per_s"]
                row["speedup_vs_off"] = row["tokens_per_s"] / base if base else 0.0
                base = table["off"][w]["decode_tokens_per_s"]
                row["decode_speedup_vs_off"] = row["decode_tokens_per_s"] / base if base else 0.0
    return table


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="", help="a local HF dir (default: the default model)")
    ap.add_argument("--configs", default="off,ngram,radix", help="off, ngram, radix, draft")
    ap.add_argument("--draft-model", default="", help="draft's checkpoint (default: truncated)")
    ap.add_argument(
        "--draft-layers", type=int, default=None, help="truncated draft's layers (default: 1/5)"
    )
    ap.add_argument("--per-workload", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8, help="--speculative-num-tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--concurrency", type=int, default=16, help="the shared-system phase (1: skip it)"
    )
    ap.add_argument("--concurrent-requests", type=int, default=32)
    ap.add_argument("--concurrent-rounds", type=int, default=2)
    ap.add_argument(
        "--concurrent-only",
        action="store_true",
        help="the shared-system phase alone (no one-at-a-time workloads)",
    )
    ap.add_argument("--out", default="benchmarks/results/bench_speculative.json")
    return ap.parse_args(argv)


def main() -> None:
    args = parse()
    sys.path.insert(1, str(Path(__file__).resolve().parent))
    from provenance import header

    out = {**header("bench_speculative"), **run(args)}
    for c, per in out["results"].items():
        for w, row in per.items():
            print(c, w, json.dumps(row))
    if out["concurrent"] is not None:
        for c, ratio in out["concurrent"]["over_off"].items():
            print(c, f"{args.concurrency} at a time, over off:", json.dumps(ratio))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
