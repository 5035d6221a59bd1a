"""Would a token tree draft better than a chain? The radix drafter's acceptance, replayed.

Issue 43 asks for a token tree for the ``radix`` drafter if it measures better than a chain.
A tree verifies several continuations at once: more verify rows a step, for the longest
run any branch gets accepted. This measures what that could gain before building it, as an
upper bound: the greedy outputs of bench_speculative.py's greedy workloads (copy, chat,
fork; generated here in process by the default model, bf16, one request at a time, in the
benchmark's order) are replayed through the ``radix`` drafter's index
(:class:`~radixserve.speculative.suffix_index.SuffixIndex`, fed as the drafter feeds it: the
prompt when computed, the request's own output as it decodes, the whole sequence when it
ends). At each verify step the drafter proposes up to ``k`` tokens; the step keeps the
drafts that equal the model's greedy tokens, plus the model's next token. A chain proposes
the best match's continuation (what the drafter does); a tree of ``B`` branches the ``B``
best distinct continuations (``SuffixIndex.candidates``), accepting the longest run any
branch gets, its verify rows the nodes of the branches' trie plus one. ``k`` is fixed (no
adaptive ``k``, for chain and tree alike).

Per workload and shape it prints and writes: verify steps, tokens per step (the output over
the steps), verify rows per step, and tokens per step over the chain's. A tree measures
better only if its tokens per step grow by more than its extra rows cost: on the CPU a
verify step of 9 rows costs about 1.8x a one-row step's linears
(results/bench_gemv_rows_s28.json), so rows are not free.

    python benchmarks/bench_draft_tree.py --per-workload 6 --k 8 --branches 2,3,4 \\
        --out benchmarks/results/bench_draft_tree.json
"""

from __future__ import annotations

# Before torch: radixserve sets the process's OpenMP wait policy (see bench_runner_step.py).
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from radixserve.speculative.suffix_index import SuffixIndex  # noqa: E402

GREEDY_WORKLOADS = ("copy", "chat", "fork")


def generate(per_workload: int, seed: int, max_tokens: int, threads: int) -> list[dict[str, Any]]:
    """The greedy workloads' prompts and greedy outputs (token ids), in the benchmark's order."""
    from bench_speculative import build

    from radixserve.engine.engine import Engine
    from radixserve.model_store import resolve_model
    from radixserve.sampling_params import SamplingParams

    engine = Engine(resolve_model(None), dtype="bfloat16", num_threads=threads)
    try:
        out = []
        for name, reqs in build(per_workload, seed).items():
            if name not in GREEDY_WORKLOADS:
                continue
            for req in reqs:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
                (res,) = engine.generate([req["prompt"]], params)
                out.append(
                    {"workload": name, "prompt": res.prompt_token_ids, "output": res.token_ids}
                )
        return out
    finally:
        engine.close()


def trie_nodes(branches: list[list[int]]) -> int:
    """Distinct prefixes of the branches: the tree's draft tokens (each one verify row)."""
    return len({tuple(b[: i + 1]) for b in branches for i in range(len(b))})


def accepted(branch: list[int], truth: list[int]) -> int:
    """How many of ``branch``'s tokens equal the greedy continuation ``truth``, from the first."""
    n = 0
    while n < len(branch) and n < len(truth) and branch[n] == truth[n]:
        n += 1
    return n


def replay(requests: list[dict[str, Any]], k: int, branches: int) -> dict[str, dict[str, float]]:
    """Every request through a fresh index, ``branches`` continuations a step (1: the chain):
    per workload, its verify steps, output tokens and verify rows."""
    index = SuffixIndex()
    totals: dict[str, dict[str, float]] = {}
    for req in requests:
        prompt, output = list(req["prompt"]), list(req["output"])
        seq = index.add(None, prompt)
        t = totals.setdefault(req["workload"], {"steps": 0, "tokens": 0, "rows": 0})
        m = 1  # the first output token comes from the prefill
        t["tokens"] += 1
        while m < len(output):
            context = prompt + output[:m]
            index.grow(seq, context)
            cands = index.candidates(None, context, min(k, len(output) - m - 1), branches)
            truth = output[m:]
            best = max((accepted(c, truth) for c in cands), default=0)
            step = min(best + 1, len(output) - m)
            t["steps"] += 1
            t["tokens"] += step
            t["rows"] += 1 + trie_nodes(cands)
            m += step
        index.extend(seq, prompt + output)
    return totals


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--per-workload", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--branches", default="2,3,4", help="tree widths to set against the chain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/bench_draft_tree.json")
    args = ap.parse_args()
    sys.path.insert(1, str(Path(__file__).resolve().parent))
    from provenance import header

    requests = generate(args.per_workload, args.seed, args.max_tokens, args.threads)
    shapes = [1] + [int(b) for b in args.branches.split(",") if b]
    results: dict[str, dict[str, dict[str, float]]] = {}
    for b in shapes:
        shape = "chain" if b == 1 else f"tree{b}"
        results[shape] = replay(requests, args.k, b)
    for shape, per in results.items():
        for w, t in per.items():
            chain = results["chain"][w]
            t["tokens_per_step"] = t["tokens"] / t["steps"]
            t["rows_per_step"] = t["rows"] / t["steps"]
            t["tokens_per_step_over_chain"] = t["tokens_per_step"] / (
                chain["tokens"] / chain["steps"]
            )
            print(shape, w, json.dumps({k: round(v, 3) for k, v in t.items()}))
    doc = {
        **header("bench_draft_tree"),
        "args": vars(args),
        "requests": requests,
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
