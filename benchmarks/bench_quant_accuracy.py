"""Accuracy of weight quantization: every method against the float32 model, same prompts.

For the default model (SmolLM2-135M-Instruct) and a tiny random Llama (``tests/tiny_models``):

1. the float32 engine greedily continues every prompt (chat questions and plain text, the
   set of ``bench_kv_quant_accuracy.py``) by ``--new-tokens``; prompt + continuation are the
   evaluation sequences;
2. each configuration runs them teacher-forced (one ragged prefill): per position, the
   largest and mean absolute error of the log-probabilities against float32 (logits up to
   their per-row constant), mean KL(P_fp32 || P) and top-1 agreement;
3. perplexity of the prompts' own next tokens (real text), relative change to float32;
4. free-running: each configuration's engine greedily generates the same continuations;
   exact-match rate and mean agreeing-prefix fraction against float32.

Rows: bf16 (the whole model in bf16, a reference), and int8 / int4 weight-only with the
rest of the model in float32 (the matmuls take bf16 activations: see
radixserve/model/quant/linear.py), with the vocabulary matrices kept (default for small
models) or quantized (``+vocab``). fp8 runs through ``torch._scaled_mm`` on the CPU for its
numerics only (serving fp8 needs a GPU). For the default model, int4 loads straight from
its Q4_1 GGUF (group 32, the file's own codes).

    python benchmarks/bench_quant_accuracy.py [--models default,tiny] [--out JSON]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

# Before torch: radixserve sets the served process's OpenMP wait policy and spin count
# (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT), which the runtime reads once, when torch loads it.
import radixserve  # noqa: F401

# isort: split

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_kv_quant_accuracy import prompt_ids, teacher_forced_logprobs  # noqa: E402


def configs():
    from radixserve.model.quant import QuantConfig

    return {
        "fp32": (torch.float32, None, False),
        "bf16": (torch.bfloat16, None, False),
        "int8": (torch.float32, QuantConfig("int8"), False),
        "int4": (torch.float32, QuantConfig("int4"), False),
        "int8+vocab": (torch.float32, QuantConfig("int8", quantize_embeddings=True), False),
        "int4+vocab": (torch.float32, QuantConfig("int4", quantize_embeddings=True), False),
        "fp8 (CPU numerics)": (torch.float32, None, True),
    }


def load(path: Path, dtype: torch.dtype, qcfg, fp8: bool):
    from radixserve.model.loader import load_model
    from radixserve.model.quant.apply import (
        install,
        linear_targets,
        make_quantized_linear,
        quantize_weight,
    )

    model = load_model(path, dtype=dtype, quantization=qcfg, pack_linears=not fp8, announce=False)
    if fp8:  # the loader refuses fp8 off CUDA; the layer itself runs wherever _scaled_mm does
        with torch.no_grad():
            for name in linear_targets(model, with_head=False):
                lin = model.get_submodule(name)
                install(
                    model,
                    name,
                    make_quantized_linear(
                        "fp8",
                        quantize_weight("fp8", lin.weight, None, torch.bfloat16),
                        lin.bias,
                        torch.bfloat16,
                    ),
                )
    return model


def greedy(model, tokenizer_path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations through a full engine around an already-loaded model."""
    from radixserve.engine.engine import Engine
    from radixserve.sampling_params import SamplingParams

    engine = Engine(
        str(tokenizer_path),
        num_pages=2048,
        disable_radix_cache=True,
        dtype=str(model.dtype).removeprefix("torch."),
    )
    engine.model = model
    if hasattr(engine, "runner"):  # the model runner (issue 16) holds the model it forwards
        engine.runner.model = model
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def evaluate(name: str, path: Path, new_tokens: int, n_chat: int, n_text: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = prompt_ids(tok, n_chat, n_text)
    cfgs = configs()
    t0 = time.perf_counter()
    ref_model = load(path, *cfgs["fp32"])
    gens = {"fp32": greedy(ref_model, path, prompts, new_tokens)}
    seqs = [p + g for p, g in zip(prompts, gens["fp32"])]
    starts = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    pred_rows = torch.cat(
        [torch.arange(int(starts[i]), int(starts[i]) + len(p) - 1) for i, p in enumerate(prompts)]
    )
    targets = torch.tensor([t for p in prompts for t in p[1:]])
    base = teacher_forced_logprobs(ref_model, seqs, "auto", "torch", torch.device("cpu"))
    base_nll = -base[pred_rows].gather(1, targets[:, None]).mean()
    rows = []
    for cname, (dtype, qcfg, fp8) in cfgs.items():
        model = ref_model if cname == "fp32" else load(path, dtype, qcfg, fp8)
        lp = (
            base
            if cname == "fp32"
            else teacher_forced_logprobs(
                model, seqs, "auto", "torch", torch.device("cpu"), act_dtype=dtype
            ).float()
        )
        gen = gens["fp32"] if cname == "fp32" else greedy(model, path, prompts, new_tokens)
        err = (lp - base).abs()
        kl = (base.exp() * (base - lp)).sum(-1)
        nll = -lp[pred_rows].gather(1, targets[:, None]).mean()
        prefix = [
            next((i for i, (x, y) in enumerate(zip(g, a)) if x != y), len(a))
            for g, a in zip(gen, gens["fp32"])
        ]
        report = getattr(model, "quant_report", None)
        from radixserve.model.quant.apply import module_weight_bytes

        rows.append(
            {
                "config": cname,
                "weights_mib": module_weight_bytes(model) / 2**20,
                "source": report.source if report else "checkpoint",
                "group_size": report.group_size if report else None,
                "max_logprob_err": float(err.max()),
                "mean_logprob_err": float(err.mean()),
                "mean_kl": float(kl.mean()),
                "top1_agreement": float((lp.argmax(-1) == base.argmax(-1)).float().mean()),
                "ppl": float(torch.exp(nll)),
                "ppl_change_pct": float(100 * (torch.exp(nll - base_nll) - 1)),
                "greedy_exact_match": sum(g == a for g, a in zip(gen, gens["fp32"])) / len(gen),
                "greedy_agree_prefix_frac": sum(prefix) / (len(prefix) * new_tokens),
            }
        )
        print(f"  {name} {cname}: done ({time.perf_counter() - t0:.0f}s)", flush=True)
    return {
        "model": name,
        "path": str(path),
        "prompts": len(prompts),
        "positions": int(base.shape[0]),
        "new_tokens": new_tokens,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="default,tiny")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--n-chat", type=int, default=8)
    ap.add_argument("--n-text", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quant_accuracy.json"))
    args = ap.parse_args()

    from radixserve.model_store import resolve_model

    torch.manual_seed(0)
    results = []
    for name in args.models.split(","):
        if name == "tiny":
            import tiny_models

            path = tiny_models.build_tiny_llama(
                Path(tempfile.mkdtemp(prefix="quant-acc-")), hidden_size=128, intermediate_size=256
            )
        else:
            path = resolve_model(name)
        results.append(evaluate(name, path, args.new_tokens, args.n_chat, args.n_text))
    for res in results:
        print(
            f"\n{res['model']}: {res['prompts']} prompts, {res['positions']} positions, "
            f"{res['new_tokens']} greedy tokens"
        )
        print(
            "| config | weights MiB | max |Δ logprob| | mean |Δ logprob| | mean KL | top-1 agree "
            "| PPL (change) | greedy exact | greedy prefix |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in res["rows"]:
            g = f" g{r['group_size']}" if r["group_size"] else ""
            print(
                f"| {r['config']}{g} | {r['weights_mib']:.1f} | {r['max_logprob_err']:.3f} | "
                f"{r['mean_logprob_err']:.4f} | "
                f"{r['mean_kl']:.2e} | {100 * r['top1_agreement']:.1f}% | {r['ppl']:.2f} "
                f"({r['ppl_change_pct']:+.2f}%) | "
                f"{100 * r['greedy_exact_match']:.0f}% | {100 * r['greedy_agree_prefix_frac']:.1f}% |"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
