"""The MoE decode step against the dense model of the same active size, and both against the
weight-reading floor.

Two random-weight checkpoints (transformers' own config and model classes, built once under
``--workdir``): a mixture-of-experts model (``--family qwen3_moe``, or ``olmoe``) with
``--experts`` experts of width ``--expert-width``, ``--top-k`` per token, and the dense model
of the same family's attention (``qwen3``; ``olmo2`` for OLMoE) whose MLP width is
``top_k x expert_width``: the same attention, embedding and LM head, and the same MLP
parameters read per token at batch 1. Both run through the offline engine, ``--batch`` requests
(default 1 and 16) of ``--prompt-tokens`` tokens decoding together; the median step over
``--steps`` decode steps is taken round after round, the two models interleaved so that the
machine's drift hits both alike.

The floor: the weights a step reads, once, at the memory bandwidth this machine shows reading
a large tensor (``floor.py``), sampled before every round. For the dense model, every weight.
For the MoE model, every weight but the experts, plus the experts the step's rows were
routed to (counted per sparse layer on one more decode step: ``top_k`` at batch 1, up to
every expert for a batch). The ratio of a step to its floor says how much of it is anything
other than reading weights; the MoE step over the dense one says what the routing costs.

    python benchmarks/bench_moe.py                          # Qwen3-MoE-shaped, fp32, batch 1 and 16
    python benchmarks/bench_moe.py --family olmoe --dtype bfloat16
    python benchmarks/bench_moe.py --smoke                  # tiny shapes, a few steps: does it run

Writes ``--out`` (default ``benchmarks/results/bench_moe.json``; ``--smoke``: under /tmp).
"""

from __future__ import annotations

# Before torch: radixserve sets the OpenMP wait policy (read once, when torch loads).
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE))  # `floor`
sys.path.insert(1, str(HERE.parent / "tests"))  # `tiny_models`: transformers' random checkpoints
from floor import read_gbs, read_source  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model.layers.moe import SparseMoeBlock  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402

DENSE_OF = {"qwen3_moe": "qwen3", "olmoe": "olmo2"}


def shapes(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """transformers config overrides of the MoE model and of its dense counterpart."""
    common: dict[str, Any] = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "vocab_size": args.vocab,
        "initializer_range": 0.02,
    }
    experts = {"num_experts": args.experts, "num_experts_per_tok": args.top_k}
    if args.family == "qwen3_moe":
        moe = {**common, **experts, "moe_intermediate_size": args.expert_width}
        moe |= {"norm_topk_prob": True, "intermediate_size": args.top_k * args.expert_width}
    else:
        moe = {**common, **experts, "intermediate_size": args.expert_width}
    dense = {**common, "intermediate_size": args.top_k * args.expert_width}
    return moe, dense


def build(workdir: Path, model_type: str, overrides: dict[str, Any]) -> Path:
    """The random checkpoint of these overrides, built once under ``workdir``."""
    import tiny_models

    key = json.dumps(overrides, sort_keys=True).encode()
    out = workdir / f"{model_type}-{hashlib.sha256(key).hexdigest()[:12]}"
    if not (out / "config.json").exists():
        print(f"building a random {model_type} checkpoint in {out} ...", flush=True)
        tiny_models.build_tiny_family(out, model_type, tokenizer=True, **overrides)
    return out


def weight_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes of every weight but the experts', bytes of one expert of one layer)."""
    other = experts = count = 0
    for module in engine.model.modules():
        if isinstance(module, SparseMoeBlock):
            count += len(module.experts)
            experts += sum(p.numel() * p.element_size() for p in module.experts.parameters())
    total = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    other = total - experts
    return other, experts // count if count else 0


def experts_touched(engine: Engine) -> float:
    """Distinct experts one decode step's rows are routed to, averaged over the sparse layers
    (one step, not timed: the hooks read the routing back to the host)."""
    seen: list[int] = []
    # The block calls ``gate.forward`` directly (no module hooks): wrap it on the instance.
    gates = [m.gate for m in engine.model.modules() if isinstance(m, SparseMoeBlock)]

    def counting(route: Any) -> Any:
        def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            weights, ids = route(x)
            seen.append(int(ids.unique().numel()))
            return weights, ids

        return forward

    for gate in gates:
        gate.forward = counting(gate.forward)
    try:
        engine.step()
    finally:
        for gate in gates:
            del gate.forward  # back to the class's method
    return statistics.mean(seen) if seen else 0.0


def start_decodes(engine: Engine, batch: int, steps: int, prompt_tokens: int) -> None:
    """``batch`` requests of ``prompt_tokens`` random tokens, prefilled, one decode step taken:
    from here each step decodes every request (at least ``steps`` more of them)."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    vocab = engine.model.config.vocab_size
    for _ in range(batch):
        engine.add_request(torch.randint(3, vocab, (prompt_tokens,), generator=g).tolist(), params)
    while any(r.num_pending > 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefills
    engine.step()


def median_step_ms(engine: Engine, steps: int) -> float:
    """The median of ``steps`` engine steps, in ms."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def drain(engine: Engine) -> None:
    """Run the engine's requests to their end."""
    while engine.has_unfinished():
        engine.step()


def run(engine: Engine, batch: int, steps: int, prompt_tokens: int) -> dict[str, Any]:
    """``steps`` decode steps of ``batch`` requests after their prefills: the median step,
    and the experts one more step touched (MoE)."""
    start_decodes(engine, batch, steps, prompt_tokens)
    step_ms = median_step_ms(engine, steps)
    touched = experts_touched(engine)
    drain(engine)
    return {"step_ms": step_ms, "experts_touched": touched}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--family", choices=sorted(DENSE_OF), default="qwen3_moe")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-width", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=str(Path.home() / ".cache/radixserve/bench_moe"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few steps")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.heads, args.kv_heads = 64, 2, 4, 2
        args.vocab, args.experts, args.top_k, args.expert_width = 512, 8, 2, 32
        args.steps, args.rounds, args.batch = 3, 1, [1, 4]
        args.workdir = args.workdir if "--workdir" in sys.argv else tempfile.mkdtemp()
    if args.out is None:
        tmp = Path(tempfile.gettempdir()) / "bench_moe_smoke.json"
        args.out = str(tmp if args.smoke else HERE / "results" / "bench_moe.json")
    return args


def main() -> int:
    args = parse_args()
    moe_cfg, dense_cfg = shapes(args)
    workdir = Path(args.workdir)
    paths = {
        "moe": build(workdir, args.family, moe_cfg),
        "dense": build(workdir, DENSE_OF[args.family], dense_cfg),
    }
    engines = {
        name: Engine(
            str(path),
            dtype=args.dtype,
            device=args.device,
            num_pages=max(256, max(args.batch) * (args.prompt_tokens + args.steps + 8) // 16 + 8),
            max_running_requests=max(args.batch),
        )
        for name, path in paths.items()
    }
    sizes = {name: weight_bytes(e) for name, e in engines.items()}
    for engine in engines.values():  # warm-up: the first steps' one-time costs
        run(engine, max(args.batch), 2, args.prompt_tokens)
    read_src = read_source(args.device)
    results: list[dict[str, Any]] = []
    for batch in args.batch:
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():  # interleaved: drift hits both alike
                gbs = read_gbs(read_src)
                r = run(engine, batch, args.steps, args.prompt_tokens)
                other, per_expert = sizes[name]
                sparse = sum(isinstance(m, SparseMoeBlock) for m in engine.model.modules())
                nbytes = other + round(r["experts_touched"] * per_expert * sparse)
                r |= {"read_gbs": gbs, "floor_bytes": nbytes, "floor_ms": nbytes / gbs / 1e6}
                rounds[name].append(r)
        entry: dict[str, Any] = {"batch": batch}
        for name, rs in rounds.items():
            ms = statistics.median(r["step_ms"] for r in rs)
            ratios = [r["step_ms"] / r["floor_ms"] for r in rs]
            entry[name] = {
                "step_ms_median": ms,
                "rounds_step_ms": [r["step_ms"] for r in rs],
                "floor_bytes": rs[-1]["floor_bytes"],
                "floor_ratio_median": statistics.median(ratios),
                "experts_touched_mean": statistics.mean(r["experts_touched"] for r in rs),
            }
        pairs = [m["step_ms"] / d["step_ms"] for m, d in zip(rounds["moe"], rounds["dense"])]
        entry["moe_over_dense_median"] = statistics.median(pairs)
        results.append(entry)
        m, d = entry["moe"], entry["dense"]
        print(
            f"batch {batch:3d}: MoE {m['step_ms_median']:.2f} ms/step ({m['floor_ratio_median']:.2f}x "
            f"its floor, {m['experts_touched_mean']:.1f} of {args.experts} experts a layer), dense "
            f"{d['step_ms_median']:.2f} ms/step ({d['floor_ratio_median']:.2f}x); MoE / dense "
            f"{entry['moe_over_dense_median']:.2f}x (median of {args.rounds} interleaved rounds)",
            flush=True,
        )
    params = {
        name: {
            "total": sum(p.numel() for p in e.model.parameters()),
            "active_per_token": e.model.config.num_active_params,
        }
        for name, e in engines.items()
    }
    for engine in engines.values():
        engine.close()
    out = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/bench_moe.py", *sys.argv[1:]]),
        "machine": {"arch": os.uname().machine, "cores": os.cpu_count()},
        "family": args.family,
        "dense_family": DENSE_OF[args.family],
        "dtype": args.dtype,
        "device": args.device,
        "moe_config": moe_cfg,
        "dense_config": dense_cfg,
        "params": params,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
