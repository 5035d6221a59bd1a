"""Program reuse: a DSL program batch with a shared few-shot prefix, radix cache on vs off.

Each program: a long system prompt with few-shot examples (shared by all runs), a user
question, a short answer, then a follow-up turn (which extends the run's own history).
The same batch runs on two in-process engines — radix cache enabled and disabled —
interleaved over several rounds (the CPU's speed drifts between runs, so the ratio of
neighbouring runs is what to read). Prints and writes JSON: wall time, prompt tokens,
reused tokens, hit rate and the optimum hit rate for this workload.

    python benchmarks/dsl_program_reuse.py                  # SmolLM2 (default model)
    python benchmarks/dsl_program_reuse.py --model DIR --programs 32 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from frontend_dsl import assistant, batch_usage, gen, program, system, user
from frontend_dsl.engine_backend import EngineBackend
from radixserve.prefix import common_prefix_len

FEW_SHOT = [
    ("What is the capital of Italy?", "Rome."),
    ("What is the capital of Spain?", "Madrid."),
    ("What is the capital of Germany?", "Berlin."),
    ("What is the capital of Japan?", "Tokyo."),
    ("What is the capital of Canada?", "Ottawa."),
    ("What is the capital of Egypt?", "Cairo."),
]
COUNTRIES = [
    "France",
    "Portugal",
    "Greece",
    "Norway",
    "Kenya",
    "Peru",
    "Chile",
    "India",
    "China",
    "Brazil",
    "Mexico",
    "Sweden",
    "Poland",
    "Austria",
    "Ireland",
    "Turkey",
]


@program
def capital_quiz(s, country: str, answer_tokens: int):
    s += system(
        "You are a geography quiz master. Answer with the city name only. "
        "Here are examples of good answers:\n" + "\n".join(f"Q: {q}\nA: {a}" for q, a in FEW_SHOT)
    )
    s += user(f"What is the capital of {country}?")
    s += assistant(gen("capital", max_tokens=answer_tokens, stop=["\n"]))
    s += user("And its population, roughly?")
    s += assistant(gen("population", max_tokens=answer_tokens, stop=["\n"]))


GEN_PROMPT = "<|im_start|>assistant\n"


def ideal_hit_rate(backend: EngineBackend, states: list, page: int) -> float:
    """The hit rate of an ideal prefix cache of unbounded size on this batch's calls.

    Calls in the order the batch issues them (every first turn, then every second turn);
    each may reuse the longest page-aligned prefix it shares with an earlier call's prompt +
    answer, short of its own last prompt token (whose logits must be computed).
    """
    turns: list[list[tuple[str, str]]] = [[], []]
    for state in states:
        text = state.text()
        cut = 0
        for k, name in enumerate(("capital", "population")):
            cut = text.index(GEN_PROMPT, cut) + len(GEN_PROMPT)
            turns[k].append((text[:cut], state[name]))
    seen: list[list[int]] = []
    sent = hit = 0
    for calls in turns:
        for prompt, answer in calls:
            ids, done = backend.tokenize([prompt, prompt + answer])
            best = max((common_prefix_len(ids, s) for s in seen), default=0)
            hit += min(best, len(ids) - 1) // page * page
            sent += len(ids)
            seen.append(done[:-1])
    return hit / sent


def run_once(backend: EngineBackend, n: int, answer_tokens: int) -> dict[str, float]:
    assert backend.flush_cache()
    batch = [
        {
            "country": COUNTRIES[i % len(COUNTRIES)] + ("" if i < len(COUNTRIES) else f" ({i})"),
            "answer_tokens": answer_tokens,
        }
        for i in range(n)
    ]
    t0 = time.perf_counter()
    states = capital_quiz.run_batch(
        batch, backend=backend, concurrency=n, defaults={"temperature": 0.0}
    )
    wall = time.perf_counter() - t0
    for s in states:
        s.raise_for_error()
    usage = batch_usage(states)
    optimum = ideal_hit_rate(backend, states, backend.engine.config.page_size)
    return {
        "wall_s": wall,
        "prompt_tokens": usage.prompt_tokens,
        "reused_tokens": usage.cached_tokens,
        "hit_rate": usage.hit_rate,
        "optimum_hit_rate": optimum,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="HF checkpoint dir (default: SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--programs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/dsl_program_reuse.json")
    args = ap.parse_args()
    engine_cfg = dict(page_size=16, max_num_tokens=2048, num_pages=2048)
    backends = {
        "cache": EngineBackend(model=args.model, **engine_cfg),
        "no_cache": EngineBackend(model=args.model, disable_radix_cache=True, **engine_cfg),
    }
    results: dict[str, list[dict[str, float]]] = {k: [] for k in backends}
    run_once(backends["cache"], 2, args.answer_tokens)  # warm up both (first-call overheads)
    run_once(backends["no_cache"], 2, args.answer_tokens)
    for r in range(args.rounds):
        for name, backend in backends.items():
            res = run_once(backend, args.programs, args.answer_tokens)
            results[name].append(res)
            print(
                f"round {r} {name:>8}: {res['wall_s']:6.2f} s, {res['prompt_tokens']} prompt tokens, "
                f"{res['reused_tokens']} reused, hit rate {res['hit_rate']:.3f} "
                f"(optimum {res['optimum_hit_rate']:.3f})"
            )
    ratios = [c["wall_s"] / n["wall_s"] for c, n in zip(results["cache"], results["no_cache"])]
    summary = {
        "programs": args.programs,
        "rounds": results,
        "time_ratio_cache_over_no_cache": ratios,
        "median_ratio": statistics.median(ratios),
        "hit_rate": results["cache"][-1]["hit_rate"],
        "optimum_hit_rate": results["cache"][-1]["optimum_hit_rate"],
    }
    print(
        f"cache / no cache wall time (interleaved rounds): {', '.join(f'{x:.2f}' for x in ratios)}; "
        f"hit rate {summary['hit_rate']:.3f} of optimum {summary['optimum_hit_rate']:.3f}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    for backend in backends.values():
        backend.close()


if __name__ == "__main__":
    main()
