"""Accuracy of the quantized KV cache on SmolLM2: each KV dtype against the unquantized pool.

For a fixed set of prompts (chat questions in the model's template, and plain text):

1. the unquantized engine (``kv_cache_dtype="auto"``) greedily continues every prompt by
   ``--new-tokens`` tokens; prompt + continuation are the evaluation sequences;
2. every sequence is run teacher-forced, as one ragged prefill through the paged attention
   backend, once per KV dtype: every position's next-token distribution is computed from
   K/V read back out of that dtype's pool (the new rows are stored, quantized, before they
   are read, exactly as for later decode steps);
3. per KV dtype, against "auto" at every position: mean KL(P_auto || P_dtype) and top-1
   (greedy) agreement; and the perplexity of the prompts' own next tokens (relative change);
4. free-running: the engine with each KV dtype greedily generates the same continuations;
   exact-match rate and mean agreeing-prefix length against the unquantized run.

KV bytes per token (all layers, K and V, scales included) are reported next to them, with
a 16-bit baseline since that is what a GPU deployment stores for "auto".

``--dtype bfloat16`` runs the model and its activations in bf16 (float32 by default), as
served; on the CPU the attention then reads every pool through the C++ kernel (int4's
rotated queries rounded to bf16 there). ``--no-cpu-kernels`` turns the C++ kernels off
(``RADIXSERVE_CPU_KERNELS=0``), so the same run measures the torch path instead.

    python benchmarks/bench_kv_quant_accuracy.py [--model PATH] [--dtype bfloat16] [--no-cpu-kernels] [--out JSON]

Prints a table (also as markdown) and writes JSON. CPU: about 2-4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path

# Before torch: radixserve sets the served process's OpenMP wait policy and spin count
# (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT), which the runtime reads once, when torch loads it.
import radixserve  # noqa: F401

# isort: split

import torch  # noqa: E402

from radixkernels.kv_format import KVFormat  # noqa: E402

KV_DTYPES = ["auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]

CHAT = [
    "What is the capital of France, and what is it famous for?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "Give me three tips for learning a new programming language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How many legs does a spider have? Answer briefly.",
    "Translate 'good morning, how are you?' into Spanish.",
]
TEXT = [
    "The mitochondria is an organelle found in most eukaryotic cells. It generates most of the "
    "chemical energy needed to power the cell's biochemical reactions, stored in a molecule called",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n',
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. Neil Armstrong and Buzz "
    "Aldrin spent about two and a half hours outside the lunar module, while Michael Collins",
    "To make a simple tomato sauce, heat olive oil in a pan, add chopped garlic and onions, and",
    "The stock market fell sharply on Tuesday as investors reacted to news that the central bank",
    "Photosynthesis is the process by which green plants use sunlight to synthesize foods from",
    "Once upon a time, in a small village at the edge of a great forest, there lived a young girl",
    "A prime number is a natural number greater than 1 that is not a product of two smaller",
]


def prompt_ids(tokenizer, n_chat: int, n_text: int) -> list[list[int]]:
    """Token ids of the prompts: chat questions through the model's template, then plain text."""
    out = []
    for q in CHAT[:n_chat]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    out += [tokenizer(t)["input_ids"] for t in TEXT[:n_text]]
    return out


def greedy_continuations(
    model_path: Path,
    prompts: list[list[int]],
    n: int,
    kv_dtype: str,
    backend: str,
    device: str,
    dtype: str = "float32",
) -> list[list[int]]:
    from radixserve.engine.engine import Engine
    from radixserve.sampling_params import SamplingParams

    # No prefix cache: each prompt is computed from scratch in every dtype's pool (the
    # chat prompts share their template's system prompt, which would otherwise be reused).
    engine = Engine(
        str(model_path),
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        attention_backend=backend,
        device=device,
        num_pages=4096,
        page_size=16,
        disable_radix_cache=True,
    )
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def teacher_forced_logprobs(
    model,
    seqs: list[list[int]],
    kv_dtype: str,
    backend: str,
    device: torch.device,
    act_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Log-probabilities ``[sum(len), vocab]`` of every position of every sequence, KV through ``kv_dtype``'s pool."""
    from radixserve.engine.model_runner import make_attention_backend
    from radixserve.memory.pool import KVPool
    from radixserve.model.forward_batch import ForwardBatch

    cfg = model.config
    page_size = 16
    pages = [(len(s) + page_size - 1) // page_size for s in seqs]
    pool = KVPool(
        cfg.num_layers,
        sum(pages),
        page_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        kv_dtype=kv_dtype,
        act_dtype=act_dtype,
        device=device,
    )
    batch = ForwardBatch.for_full_sequences(seqs, device=device, all_logits=True)
    table = torch.zeros((len(seqs), max(pages)), dtype=torch.int32)
    first = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    batch.page_table = table.to(device)
    batch.page_size = page_size
    batch.out_cache_loc = torch.cat(
        [
            table[b, torch.arange(len(s)) // page_size].long() * page_size
            + torch.arange(len(s)) % page_size
            for b, s in enumerate(seqs)
        ]
    ).to(device)
    attn = make_attention_backend(backend, pool)
    batch.page_lists_cpu = table.tolist()
    with torch.inference_mode():
        attn.init_forward_metadata(batch)
        return torch.log_softmax(model.forward(batch, attn).float(), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=None,
        help="HF checkpoint dir (default: SmolLM2-135M-Instruct via model_store)",
    )
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--n-chat", type=int, default=len(CHAT))
    ap.add_argument("--n-text", type=int, default=len(TEXT))
    ap.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="model and activations"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--no-cpu-kernels",
        action="store_true",
        help="the torch paths instead of the C++ kernels (RADIXSERVE_CPU_KERNELS=0)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_quant_accuracy.json"))
    args = ap.parse_args()
    if args.no_cpu_kernels:  # read when the kernels are first loaded, below
        os.environ["RADIXSERVE_CPU_KERNELS"] = "0"

    from transformers import AutoTokenizer

    from radixserve.model.loader import load_model
    from radixserve.model_store import resolve_model

    torch.manual_seed(0)
    t_start = time.perf_counter()
    model_path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    device = torch.device(args.device)
    act_dtype = getattr(torch, args.dtype)
    model = load_model(model_path, dtype=act_dtype, device=device)
    cfg = model.config
    prompts = prompt_ids(tokenizer, args.n_chat, args.n_text)

    # Free-running greedy continuations, the unquantized ones first: they also extend the
    # teacher-forced sequences, so the model's own answers are scored, not only the prompts.
    gens = {
        kd: greedy_continuations(
            model_path,
            prompts,
            args.new_tokens,
            kd,
            args.attention_backend,
            args.device,
            args.dtype,
        )
        for kd in KV_DTYPES
    }
    seqs = [p + g for p, g in zip(prompts, gens["auto"])]
    starts = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    # Perplexity on the prompts' own tokens (real text, not the model's greedy output, which
    # the unquantized model is biased towards): rows predicting prompt tokens 1..len-1.
    pred_rows = torch.cat(
        [torch.arange(int(starts[i]), int(starts[i]) + len(p) - 1) for i, p in enumerate(prompts)]
    )
    targets = torch.tensor([t for p in prompts for t in p[1:]])

    def logprobs(kd: str) -> torch.Tensor:
        return teacher_forced_logprobs(
            model, seqs, kd, args.attention_backend, device, act_dtype
        ).cpu()

    base = logprobs("auto")
    base_nll = -base[pred_rows].gather(1, targets[:, None]).mean()
    base_p = base.exp()
    rows = []
    for kd in KV_DTYPES:
        lp = base if kd == "auto" else logprobs(kd)
        kl = (base_p * (base - lp)).sum(-1)  # KL(P_auto || P_kd) per position
        nll = -lp[pred_rows].gather(1, targets[:, None]).mean()
        agree_tf = (lp.argmax(-1) == base.argmax(-1)).float().mean()
        same = [g == a for g, a in zip(gens[kd], gens["auto"])]
        prefix = [
            next((i for i, (x, y) in enumerate(zip(g, a)) if x != y), len(a))
            for g, a in zip(gens[kd], gens["auto"])
        ]
        fmt16 = KVFormat.create(kd, torch.bfloat16, cfg.head_dim)
        rows.append(
            {
                "kv_dtype": kd,
                "kv_bytes_per_token": fmt16.bytes_per_token(cfg.num_layers, cfg.num_kv_heads),
                "mean_kl": float(kl.mean()),
                "max_kl": float(kl.max()),
                "top1_agreement": float(agree_tf),
                "ppl": float(torch.exp(nll)),
                "ppl_change_pct": float(100 * (torch.exp(nll - base_nll) - 1)),
                "greedy_exact_match": sum(same) / len(same),
                "greedy_agree_prefix_frac": sum(prefix) / (len(prefix) * args.new_tokens),
            }
        )
    positions = int(base.shape[0])
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": str(model_path),
        "device": args.device,
        "attention_backend": args.attention_backend,
        "activation_dtype": args.dtype,
        "cpu_kernels": os.environ.get("RADIXSERVE_CPU_KERNELS", "1") != "0",
        "prompts": len(prompts),
        "positions": positions,
        "new_tokens": args.new_tokens,
        "fp8_scales": "static per head, 1.0 (uncalibrated)",
        "seconds": time.perf_counter() - t_start,
        "results": rows,
    }
    print(
        f"KV-cache quantization accuracy: {model_path.name}, {len(prompts)} prompts, {positions} positions, "
        f"{args.new_tokens} greedy tokens each ({result['seconds']:.0f}s)"
    )
    print(
        "| KV dtype | bytes/token | vs 16-bit | mean KL | top-1 agree | PPL change | greedy exact | greedy prefix |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    b16 = rows[0]["kv_bytes_per_token"]
    for r in rows:
        print(
            f"| {r['kv_dtype']} | {r['kv_bytes_per_token']} | {r['kv_bytes_per_token'] / b16:.2f}x | "
            f"{r['mean_kl']:.2e} | {100 * r['top1_agreement']:.2f}% | {r['ppl_change_pct']:+.2f}% | "
            f"{100 * r['greedy_exact_match']:.0f}% | {100 * r['greedy_agree_prefix_frac']:.1f}% |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
