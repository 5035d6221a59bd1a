"""What serving LoRA adapters costs: decode rates of adapted requests against the base
model's, in one engine, one process.

One engine serves the default model in bfloat16 with ``--adapters`` random LoRA adapters
(PEFT's, rank ``--rank`` on all seven projections, written to a temporary directory). Each
round times, in an order that rotates, greedy decoding with ``ignore_eos`` (every case does
the same work):

- ``base``: the base model's requests (the engine's own path: the one-call CPU decoder
  stack where it serves);
- ``one_adapter``: the same prompts, every request with adapter 0;
- ``mixed``: the same prompts spread over every adapter and the base model.

each at ``--batch`` concurrent requests (1: one stream). A rate is decode tokens per second
once every request has its first token; the figures are each round's adapted rate over the
base rate of the same round (this machine's speed drifts between runs: only same-round
ratios mean anything).

    python benchmarks/bench_lora.py --batch 1,8 --rounds 5 --out benchmarks/results/bench_lora_s47_stack.json
"""

from __future__ import annotations

# Before torch, as the served process does (OMP_WAIT_POLICY, GOMP_SPINCOUNT).
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))  # provenance
from provenance import header  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model_store import resolve_model  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = ("base", "one_adapter", "mixed")


def write_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[str]:
    """``count`` random adapters of the model, saved by PEFT; their ``name=path`` specs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    specs = []
    for i in range(count):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), init_lora_weights=False
        )
        peft_model = get_peft_model(model, config)
        peft_model.save_pretrained(str(out / f"a{i}"))
        specs.append(f"a{i}={out / f'a{i}'}")
    return specs


def decode_rate(engine: Engine, prompts: list[list[int]], loras: list[str | None], n: int) -> float:
    """Decode tokens per second once every request has its first token."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params, lora=a) for p, a in zip(prompts, loras)]
    pending, started = set(ids), set()
    t0: float | None = None
    tokens = 0
    while pending:
        for out in engine.step():
            if out.new_token_ids and out.request_id in started and t0 is not None:
                tokens += len(out.new_token_ids)
            if out.new_token_ids:
                started.add(out.request_id)
            if out.finished:
                pending.discard(out.request_id)
        if t0 is None and len(started) == len(ids):
            t0 = time.perf_counter()
    assert t0 is not None
    return tokens / (time.perf_counter() - t0)


def case_loras(case: str, batch: int, adapters: int) -> list[str | None]:
    if case == "base":
        return [None] * batch
    if case == "one_adapter":
        return ["a0"] * batch
    names: list[str | None] = [f"a{i}" for i in range(adapters)] + [None]
    return [names[i % len(names)] for i in range(batch)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        specs = write_adapters(model_dir, Path(tmp), args.adapters, args.rank)
        engine = Engine(model_dir, dtype="bfloat16", lora_paths=specs, max_lora_rank=args.rank)
        tok = engine.tokenizer
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            for batch in args.batch:
                prompts = [
                    tok.encode(f"Question {r}.{i}: tell me about the sea.") for i in range(batch)
                ]
                order = CASES[r % 3 :] + CASES[: r % 3]
                rates = {}
                for case in order:
                    engine.flush_cache()
                    loras = case_loras(case, batch, args.adapters)
                    rates[case] = decode_rate(engine, prompts, loras, args.decode_tokens)
                row[str(batch)] = rates
                print(
                    f"round {r} batch {batch}: "
                    + ", ".join(f"{c} {v:.1f} tok/s" for c, v in rates.items())
                )
            rounds.append(row)
        engine.close()
    return {
        **header("bench_lora"),
        "model": str(model_dir),
        "dtype": "bfloat16",
        "adapters": args.adapters,
        "rank": args.rank,
        "decode_tokens": args.decode_tokens,
        "rounds": rounds,
    }


def summarize(result: dict[str, Any]) -> None:
    for batch in result["rounds"][0]:
        for case in CASES[1:]:
            ratios = [r[batch][case] / r[batch]["base"] for r in result["rounds"]]
            print(
                f"batch {batch}: {case} over base: median {statistics.median(ratios):.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f}x, {len(ratios)} rounds)"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2)")
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = run(args)
    summarize(result)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
