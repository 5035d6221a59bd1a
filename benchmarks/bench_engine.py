"""Offline engine benchmark: a shared-prefix multi-turn chat workload, radix cache on vs off.

The workload: ``--systems`` long system prompts, each shared by ``--per-system``
conversations with distinct user questions; every conversation runs ``--turns`` turns
(the follow-up turns resend the whole history, as chat APIs do). All conversations of a
turn are submitted together, shuffled; greedy decoding, so both engines produce the same
tokens and do the same useful work.

Two engines (same model, same KV pool size) run the same workload, interleaved round by
round in one process (this machine's speed drifts by ~3x between runs, so only
same-run ratios mean anything): round r runs "on" then "off", round r+1 "off" then "on";
the "on" cache is flushed before every round so each round is the same cold start.

Reported per engine: throughput (prompt + output tokens per second, and output tokens per
second), TTFT (submission of the turn to the first token), prompt-token hit rate, and the
engine's achieved FLOP rate (model FLOPs of every forward, attention included, over wall
time) as a fraction of the matmul rate of this machine measured in the same run. The
workload's optimal hit rate comes from its prefix structure: each request can at best
reuse its longest common prefix with any earlier request's tokens (prompt + output), and
must compute its last prompt token.

    python benchmarks/bench_engine.py                      # SmolLM2 (fetched on first use), a few minutes
    python benchmarks/bench_engine.py --model /tmp/smol/hf --rounds 1 --per-system 2   # quick

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
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model_store import resolve_model  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402

TOPICS = [
    "astronomy",
    "cooking",
    "gardening",
    "chess",
    "medieval history",
    "sailing",
    "compilers",
    "beekeeping",
    "photography",
    "volcanoes",
    "jazz",
    "origami",
    "cryptography",
    "ceramics",
    "glaciers",
    "typography",
]
FACTS = [
    "Always explain the reasoning behind an answer in plain words before giving the conclusion.",
    "When the user is a beginner, avoid jargon and define every technical term you need to use.",
    "If a question is ambiguous, state the interpretation you chose and answer that one.",
    "Prefer concrete examples, small numbers and everyday comparisons over abstract statements.",
    "Never invent sources, dates or quotations; say that you are not sure when you are not.",
    "Keep answers short: two or three sentences unless the user asks for more detail.",
    "Safety comes first: point out risks, equipment and precautions whenever they matter.",
    "Use metric units, and give imperial units in parentheses when a reader might expect them.",
    "Be friendly and patient, and encourage the user to ask follow-up questions.",
    "Summarize long explanations with a one-line takeaway at the end.",
]
QUESTIONS = [
    "What should a complete beginner learn first about {t}?",
    "What is a common mistake people make with {t}?",
    "Can you recommend a good first project in {t}?",
    "How much time per week does {t} take?",
    "What equipment do I need to start with {t}?",
    "Why do people find {t} so rewarding?",
    "What is one surprising fact about {t}?",
    "How did {t} change over the last century?",
]
FOLLOW_UPS = [
    "Thanks. Can you say that again in one sentence?",
    "Interesting! Give me one concrete example.",
    "And what should I avoid doing?",
    "How would I know I am making progress?",
]


def system_prompt(topic: str, target_tokens: int, tok: Any, rng: random.Random) -> str:
    """A long, topic-specific system prompt of about ``target_tokens`` tokens."""
    lines = [f"You are an expert tutor in {topic}, helping users of an online learning service."]
    while len(tok.encode(" ".join(lines))) < target_tokens:
        fact = rng.choice(FACTS)
        lines.append(f"Rule {len(lines)} for {topic}: {fact}")
    return " ".join(lines)


def chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


class FlopCounter:
    """Wraps the runner's model forward: counts model FLOPs and forward wall time."""

    def __init__(self, engine: Engine) -> None:
        c = engine.model_config
        per_layer = (
            c.hidden_size * (c.q_size + 2 * c.kv_size)
            + c.q_size * c.hidden_size
            + 3 * c.hidden_size * c.intermediate_size
        )
        self.linear_params = per_layer * c.num_layers
        self.head_params = c.hidden_size * c.vocab_size
        self.attn_per_key = (
            4 * c.num_q_heads * c.head_dim * c.num_layers
        )  # QK^T and PV, per (query, key)
        self.flops = 0.0
        self.forward_s = 0.0
        self._inner = engine.runner.model.forward
        engine.runner.model.forward = self

    def __call__(self, fb: ForwardBatch, attn: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self._inner(fb, attn)
        self.forward_s += time.perf_counter() - t0
        keys = 0
        for seq, n in zip(fb.seq_lens_cpu, fb.extend_lens_cpu):
            p = seq - n  # rows at positions p..seq-1 see p+1..seq keys
            keys += (seq * (seq + 1) - p * (p + 1)) // 2
        self.flops += (
            2 * fb.num_tokens * self.linear_params + 2 * len(fb.logits_indices) * self.head_params
        )
        self.flops += keys * self.attn_per_key
        return out


def matmul_gflops(
    hidden: int, inter: int, dtype: torch.dtype, rows: int = 1024, reps: int = 10
) -> float:
    """This machine's GEMM rate in the engine's dtype on a prefill-shaped matmul, now."""
    a = torch.randn(rows, hidden, dtype=dtype)
    w = torch.randn(inter, hidden, dtype=dtype)
    torch.nn.functional.linear(a, w)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.linear(a, w)
    return 2 * rows * hidden * inter * reps / (time.perf_counter() - t0) / 1e9


def run_workload(
    engine: Engine,
    convs: list[list[dict[str, str]]],
    turns: int,
    max_tokens: int,
    follow_ups: list[str],
    order: list[int],
) -> dict[str, Any]:
    """All conversations turn by turn; returns timings, usage and the generated tokens."""
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    convs = [list(c) for c in convs]
    ttft: list[float] = []
    prompt_tokens = cached = completion = 0
    outputs: list[list[int]] = []
    sequences: list[list[int]] = []  # prompt + output of every request, in submission order
    t_start = time.perf_counter()
    for turn in range(turns):
        prompts = {i: chat_ids(tok, convs[i]) for i in order}
        t_submit = time.perf_counter()
        rid_of = {engine.add_request(prompts[i], params): i for i in order}
        got: dict[int, list[int]] = {i: [] for i in order}
        first: dict[int, float] = {}
        while engine.has_unfinished():
            for o in engine.step():
                i = rid_of[o.request_id]
                if o.new_token_ids and i not in first:
                    first[i] = time.perf_counter() - t_submit
                got[i] += o.new_token_ids
                if o.finished:
                    assert o.usage is not None and o.finish_reason == "length", o
                    prompt_tokens += o.usage.prompt_tokens
                    cached += o.usage.cached_tokens
                    completion += len(got[i])
        ttft += first.values()
        for i in order:
            text = tok.decode(got[i], skip_special_tokens=True)
            convs[i] += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": follow_ups[(i + turn) % len(follow_ups)]},
            ]
            outputs.append(got[i])
            sequences.append(prompts[i] + got[i])
    wall = time.perf_counter() - t_start
    return {
        "wall_s": wall,
        "ttft": ttft,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "outputs": outputs,
        "sequences": sequences,
    }


def optimal_cached(sequences: list[list[int]], prompt_lens: list[int]) -> int:
    """Sum over requests of min(longest common prefix with any earlier request, prompt_len - 1)."""
    total = 0
    for j, (seq, plen) in enumerate(zip(sequences, prompt_lens)):
        best = 0
        for prev in sequences[:j]:
            n = min(len(prev) - 1, plen - 1)  # the last token of prev never had its KV computed
            lo, hi = 0, n
            while lo < hi:  # largest m with prev[:m] == seq[:m]
                mid = (lo + hi + 1) // 2
                if prev[:mid] == seq[:mid]:
                    lo = mid
                else:
                    hi = mid - 1
            best = max(best, lo)
        total += best
    return total


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct) or a local HF directory",
    )
    ap.add_argument("--systems", type=int, default=3, help="distinct long system prompts")
    ap.add_argument("--per-system", type=int, default=6, help="conversations per system prompt")
    ap.add_argument("--turns", type=int, default=2, help="turns per conversation")
    ap.add_argument(
        "--system-tokens", type=int, default=400, help="approximate system prompt length"
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per turn")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved on/off rounds")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-num-tokens", type=int, default=1024, help="per-step token budget")
    ap.add_argument(
        "--kv-tokens", type=int, default=16384, help="KV pool size of each engine, tokens"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--dtype", default="float32", help="engine dtype (float32 | bfloat16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/bench_engine.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = resolve_model(args.model)
    common = dict(
        page_size=args.page_size,
        max_num_tokens=args.max_num_tokens,
        num_pages=args.kv_tokens // args.page_size,
        max_running_requests=64,
        dtype=args.dtype,
    )
    engines = {
        "on": Engine(path, **common),
        "off": Engine(path, disable_radix_cache=True, **common),
    }
    counters = {name: FlopCounter(e) for name, e in engines.items()}
    tok = engines["on"].tokenizer
    mc = engines["on"].model_config
    act_dtype = engines["on"].config.torch_dtype

    rng = random.Random(args.seed)
    topics = rng.sample(TOPICS, args.systems)
    systems = [system_prompt(t, args.system_tokens, tok, rng) for t in topics]
    convs: list[list[dict[str, str]]] = []
    for s, t in zip(systems, topics):
        for q in rng.sample(QUESTIONS, args.per_system):
            convs.append(
                [{"role": "system", "content": s}, {"role": "user", "content": q.format(t=t)}]
            )
    order = list(range(len(convs)))
    rng.shuffle(order)

    results: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    gemm: list[float] = []
    t_bench = time.perf_counter()
    for r in range(args.rounds):
        for name in ["on", "off"] if r % 2 == 0 else ["off", "on"]:
            gemm.append(matmul_gflops(mc.hidden_size, mc.intermediate_size, act_dtype))
            eng, fc = engines[name], counters[name]
            assert eng.flush_cache() or name == "off"
            f0, s0 = fc.flops, fc.forward_s
            res = run_workload(eng, convs, args.turns, args.max_tokens, FOLLOW_UPS, order)
            res["flops"], res["forward_s"] = fc.flops - f0, fc.forward_s - s0
            results[name].append(res)
            print(
                f"round {r} {name:3}: {res['wall_s']:7.1f} s, hit {res['cached_tokens'] / res['prompt_tokens']:.1%}, "
                f"{res['flops'] / res['wall_s'] / 1e9:.1f} GFLOP/s, gemm {gemm[-1]:.1f} GFLOP/s",
                flush=True,
            )
    gemm.append(matmul_gflops(mc.hidden_size, mc.intermediate_size, act_dtype))
    total_s = time.perf_counter() - t_bench

    identical = all(a["outputs"] == b["outputs"] for a, b in zip(results["on"], results["off"]))
    first = results["on"][0]
    prompt_lens = [len(s) - len(o) for s, o in zip(first["sequences"], first["outputs"])]
    opt = optimal_cached(first["sequences"], prompt_lens)
    gemm_rate = statistics.median(gemm)

    summary: dict[str, Any] = {}
    for name, runs in results.items():
        wall = sum(x["wall_s"] for x in runs)
        toks = sum(x["prompt_tokens"] + x["completion_tokens"] for x in runs)
        out_toks = sum(x["completion_tokens"] for x in runs)
        ttft = sorted(t for x in runs for t in x["ttft"])
        flops = sum(x["flops"] for x in runs)
        summary[name] = {
            "wall_s": wall,
            "throughput_tok_s": toks / wall,
            "output_tok_s": out_toks / wall,
            "ttft_mean_s": statistics.mean(ttft),
            "ttft_p50_s": ttft[len(ttft) // 2],
            "ttft_p90_s": ttft[int(len(ttft) * 0.9)],
            "hit_rate": sum(x["cached_tokens"] for x in runs)
            / sum(x["prompt_tokens"] for x in runs),
            "achieved_gflops": flops / wall / 1e9,
            "forward_gflops": flops / sum(x["forward_s"] for x in runs) / 1e9,
            "fraction_of_matmul": flops / wall / 1e9 / gemm_rate,
            "per_round_wall_s": [x["wall_s"] for x in runs],
        }
    on, off = summary["on"], summary["off"]
    opt_rate = opt / first["prompt_tokens"]
    report = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "model": str(path),
        "workload": {
            "systems": args.systems,
            "per_system": args.per_system,
            "turns": args.turns,
            "requests_per_round": len(convs) * args.turns,
            "system_tokens": args.system_tokens,
            "max_tokens": args.max_tokens,
            "prompt_tokens_per_round": first["prompt_tokens"],
            "optimal_cached_tokens": opt,
            "optimal_hit_rate": opt_rate,
        },
        "engine": common,
        "matmul_gflops_median": gemm_rate,
        "matmul_gflops_samples": gemm,
        "results": summary,
        "speedup_on_vs_off": on["throughput_tok_s"] / off["throughput_tok_s"],
        "ttft_mean_ratio_off_vs_on": off["ttft_mean_s"] / on["ttft_mean_s"],
        "hit_rate_vs_optimal": on["hit_rate"] / opt_rate if opt_rate else 1.0,
        "outputs_identical": identical,
        "bench_wall_s": total_s,
    }
    report["targets_met"] = {
        "speedup>=3": report["speedup_on_vs_off"] >= 3.0,
        "hit_rate>=95%_of_optimal": report["hit_rate_vs_optimal"] >= 0.95,
    }

    print(
        f"\nmodel {path.name if path.name != 'hf' else path}; {len(convs)} conversations x {args.turns} turns "
        f"({args.systems} system prompts of ~{args.system_tokens} tokens), {args.rounds} interleaved rounds"
    )
    print(
        f"{'':4} {'tok/s':>8} {'out tok/s':>9} {'TTFT mean':>9} {'p50':>7} {'p90':>7} "
        f"{'hit':>6} {'GFLOP/s':>8} {'of matmul':>9}"
    )
    for name in ("on", "off"):
        s = summary[name]
        print(
            f"{name:4} {s['throughput_tok_s']:8.1f} {s['output_tok_s']:9.2f} {s['ttft_mean_s']:8.2f}s "
            f"{s['ttft_p50_s']:6.2f}s {s['ttft_p90_s']:6.2f}s {s['hit_rate']:6.1%} {s['achieved_gflops']:8.1f} "
            f"{s['fraction_of_matmul']:9.1%}"
        )
    print(
        f"speedup on/off {report['speedup_on_vs_off']:.2f}x; hit rate {on['hit_rate']:.1%} of prompt tokens, "
        f"optimum {opt_rate:.1%} -> {report['hit_rate_vs_optimal']:.1%} of optimal; "
        f"matmul {gemm_rate:.1f} GFLOP/s; outputs identical: {identical}"
    )
    print(f"targets: {report['targets_met']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
