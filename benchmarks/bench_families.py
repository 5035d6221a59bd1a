"""Each model family's decode step against the weight-reading floor, beside Llama's.

The one-call CPU decoder stack runs Llama-shaped layers (Llama, Qwen2, SmolLM2) and these
families' quirks (Mistral's window, Qwen3's q/k norms, Gemma 3's sandwich norms and sliding
layers, Phi-3's fused projections, OLMo 2's post-norms); each result says whether the stack
served the family's forwards (``stack_served``, checked over the warm-up steps) or why not
(``native_stack_reason``). This measures what each family's decode step
costs: one random-weight checkpoint per family from transformers' own config and model
classes (built once under ``--workdir``), all of the default model's shape (SmolLM2-135M:
hidden 576, 30 layers, 9 query and 3 KV heads of 64, MLP 1536, vocabulary 49,152) so that
their steps read about the same bytes, each through the offline engine in bf16, ``--batch``
requests of ``--prompt-tokens`` tokens decoding together. The median step over ``--steps``
decode steps is taken round after round, the families interleaved so that the machine's
drift hits all alike; the floor is every weight read once at the bandwidth sampled just
before (``floor.py``), and each step's ratio to it says how much goes to anything other
than reading weights.

    python benchmarks/bench_families.py                  # every family, batch 1
    python benchmarks/bench_families.py --smoke          # tiny shapes, a few steps: does it run

Writes ``--out`` (default ``benchmarks/results/bench_families.json``; ``--smoke``: under /tmp).
"""

from __future__ import annotations

# Before torch: radixserve sets the OpenMP wait policy (read once, when torch loads).
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE))  # `floor`, `provenance`
sys.path.insert(1, str(HERE.parent / "tests"))  # `tiny_models`: transformers' random checkpoints
from bench_moe import build, drain, median_step_ms, start_decodes  # noqa: E402
from floor import read_gbs, read_source  # noqa: E402
from provenance import header  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402

#: transformers model_type -> what its layers add to Llama's (transformers' defaults keep
#: each family's quirks: Mistral's and Gemma 3's windows, Gemma 3's 5:1 layer pattern).
FAMILIES = {
    "llama": "none (the reference)",
    "qwen2": "q/k/v biases",
    "mistral": "a sliding window",
    "qwen3": "q/k RMSNorm",
    "gemma3_text": "sandwich norms, sliding layers, embedding scale, q/k RMSNorm",
    "phi3": "fused qkv and gate-up weights in the checkpoint",
    "olmo2": "post-norms, q/k RMSNorm over all heads",
}


def shape(args: argparse.Namespace) -> dict[str, Any]:
    """transformers config overrides every family shares: the default model's shape."""
    return {
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "vocab_size": args.vocab,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
    }


def weight_bytes(engine: Engine) -> int:
    """Bytes of every weight the engine holds (a tied embedding counted once)."""
    seen: set[int] = set()
    total = 0
    for p in engine.model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def warm_up(engine: Engine, batch: int, prompt_tokens: int) -> bool:
    """A few steps for the one-time costs; whether the one-call stack served every forward
    of them (counted here only: the timed steps run as they are)."""
    model = engine.model
    served: list[bool] = []
    choose = model._native_stack

    def counted(*args: Any) -> Any:
        chosen = choose(*args)
        served.append(chosen is not None)
        return chosen

    model._native_stack = counted  # type: ignore[method-assign]
    try:
        run(engine, batch, 2, prompt_tokens)
    finally:
        delattr(model, "_native_stack")
    return bool(served) and all(served)


def run(engine: Engine, batch: int, steps: int, prompt_tokens: int) -> float:
    """The median of ``steps`` decode steps of ``batch`` requests after their prefills (ms)."""
    start_decodes(engine, batch, steps, prompt_tokens)
    step_ms = median_step_ms(engine, steps)
    drain(engine)
    return step_ms


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=str(Path.home() / ".cache/radixserve/bench_families"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few steps")
    args = ap.parse_args(argv)
    for name in args.families.split(","):
        if name not in FAMILIES:
            ap.error(f"unknown family {name!r} (known: {', '.join(FAMILIES)})")
    if args.smoke:
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 64, 128, 2, 4, 2
        args.vocab, args.steps, args.rounds = 512, 3, 1
        args.workdir = args.workdir if "--workdir" in (argv or sys.argv) else tempfile.mkdtemp()
    if args.out is None:
        tmp = Path(tempfile.gettempdir()) / "bench_families_smoke.json"
        args.out = str(tmp if args.smoke else HERE / "results" / "bench_families.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.families.split(",")
    workdir = Path(args.workdir)
    paths = {name: build(workdir, name, shape(args)) for name in names}
    pages = max(64, args.batch * (args.prompt_tokens + args.steps + 8) // 16 + 8)
    engines = {
        name: Engine(str(path), dtype=args.dtype, num_pages=pages, max_running_requests=args.batch)
        for name, path in paths.items()
    }
    served = {name: warm_up(e, args.batch, args.prompt_tokens) for name, e in engines.items()}
    src = read_source("cpu")
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name, engine in engines.items():  # interleaved: drift hits every family alike
            gbs = read_gbs(src)
            ms = run(engine, args.batch, args.steps, args.prompt_tokens)
            floor_ms = weight_bytes(engine) / gbs / 1e6
            rounds[name].append({"step_ms": ms, "read_gbs": gbs, "floor_ratio": ms / floor_ms})
    results: dict[str, Any] = {}
    for name, engine in engines.items():
        rs = rounds[name]
        results[name] = {
            "layers": FAMILIES[name],
            "native_stack_reason": engine.model.native_stack_reason,
            "stack_served": served[name],
            "weight_bytes": weight_bytes(engine),
            "step_ms_median": statistics.median(r["step_ms"] for r in rs),
            "floor_ratio_median": statistics.median(r["floor_ratio"] for r in rs),
            "rounds": rs,
        }
        r = results[name]
        print(
            f"{name:12s} {r['step_ms_median']:7.2f} ms a step, {r['floor_ratio_median']:.2f}x "
            f"the weight floor ({r['weight_bytes'] / 1e6:.0f} MB); "
            f"{'one-call stack' if served[name] else r['native_stack_reason'] or 'per-layer path'}",
            flush=True,
        )
        engine.close()
    llama = results.get("llama")
    if llama is not None:
        for r in results.values():
            r["step_over_llama"] = r["step_ms_median"] / llama["step_ms_median"]
    doc = {
        **header("bench_families"),
        "command": " ".join(["python", "benchmarks/bench_families.py", *(argv or sys.argv[1:])]),
        "args": vars(args),
        "shape": shape(args),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
