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
    python benchmarks/bench_quant.py --layer-rows 1,4,8,16,32   # one layer's linears per path
    python benchmarks/bench_quant.py --llamacpp q4_1,f32   # llama-server beside (peers built)

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

# Before torch, as the served process does: radixserve sets OMP_WAIT_POLICY=PASSIVE and
# GOMP_SPINCOUNT, which the OpenMP runtime reads once, when torch loads it.
import radixserve  # noqa: F401

# isort: split

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
    # the same weights with float32 activations (what `--quantization int8` alone gives)
    "int8-fp32": {"dtype": "float32", "quantization": "int8"},
    "int4-fp32": {"dtype": "float32", "quantization": "int4"},
    "int8+vocab": {"dtype": "bfloat16", "quantization": "int8", "quantize_embeddings": True},
    "int4+vocab": {"dtype": "bfloat16", "quantization": "int4", "quantize_embeddings": True},
    # --quant-dense-cache: batches of 4+ rows on a kept bf16 copy (+2 bytes per quantized weight)
    "int8+cache": {"dtype": "bfloat16", "quantization": "int8", "quant_dense_cache": True},
    "int4+cache": {"dtype": "bfloat16", "quantization": "int4", "quant_dense_cache": True},
    # int4 on torch's tinygemm kernel instead of cpu_gemv's (what served int4 before it)
    "int4-tinygemm": {"dtype": "bfloat16", "quantization": "int4"},
    "int4+vocab-tinygemm": {
        "dtype": "bfloat16",
        "quantization": "int4",
        "quantize_embeddings": True,
    },
}


def int4_on_tinygemm(model: torch.nn.Module) -> int:
    """Rebuild every cpu_gemv Int4Linear of ``model`` on tinygemm (the same weights)."""
    from radixserve.model.quant.linear import Int4Linear

    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int4Linear) and child.gemv:
                new = Int4Linear(child.int4_weight(), child.bias, child.compute_dtype, gemv=False)
                new.dense_min_rows = new.default_dense_min_rows = child.default_dense_min_rows
                setattr(parent, name, new)
                n += 1
    return n


# Applied to a configuration's model once loaded.
POST_LOAD = {"int4-tinygemm": int4_on_tinygemm, "int4+vocab-tinygemm": int4_on_tinygemm}
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


class LlamaCppServer:
    """llama.cpp's ``llama-server`` on a GGUF of the same weights (built by
    ``benchmarks/peers/setup_peers.sh llamacpp``), measured like the engines: greedy,
    ``ignore_eos``, the same token-id prompts, streamed over its OpenAI completions API."""

    def __init__(self, kind: str, slots: int = 16, extra_args: tuple[str, ...] = ()) -> None:
        from peers import servers

        from radixserve.model_store import resolve_model

        spec = servers.peer_spec(f"llamacpp-{kind}")
        port = servers.free_port()
        cmd, env = servers.command(spec, resolve_model(None), port, 1.0, 1024, slots)
        cmd = [*cmd, *extra_args]
        log = servers.PEERS_ROOT / "logs" / f"bench_quant-{spec.name}.log"
        self.proc = servers.ServerProcess(cmd, servers.peer_env(env), port, log, spec.ready_path)
        self.proc.wait_ready(spec.startup_timeout_s)
        self.url = self.proc.base_url + "/v1/completions"

    def _stream(self, prompt: list[int], n: int, stamps: list[float]) -> None:
        """One streamed request; the arrival time of each token's chunk into ``stamps``."""
        import httpx

        body = {
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", self.url, json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                if choices and choices[0].get("text"):
                    stamps.append(time.perf_counter())

    def decode_rate(self, prompts: list[list[int]], n: int) -> float:
        """Decode tokens per second once every request has its first token (as ``decode_rate``)."""
        import threading

        stamps: list[list[float]] = [[] for _ in prompts]
        threads = [
            threading.Thread(target=self._stream, args=(p, n, s)) for p, s in zip(prompts, stamps)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t0, t1 = max(s[0] for s in stamps), max(s[-1] for s in stamps)
        return sum(1 for s in stamps for t in s if t > t0) / (t1 - t0)

    def close(self) -> None:
        self.proc.stop()


def layer_times(model: str, rows: list[int], rounds: int) -> None:
    """Microseconds for one decoder layer's four linears (SmolLM2's shapes, random weights)
    at each row count: bf16 (oneDNN pre-packed, the bf16 model's path) against int8 / int4 on
    their packed kernels, on a kept bf16 copy (--quant-dense-cache), and decoded per call;
    the bf16 and int8 layers also with the small-batch kernels (cpu_gemv) off and forced on,
    and int4 on torch's tinygemm kernel instead of cpu_gemv's."""
    from radixserve.model.config import ModelConfig
    from radixserve.model.cpu_linear import PackedLinear
    from radixserve.model.quant.apply import make_quantized_linear, quantize_weight
    from radixserve.model_store import resolve_model

    cfg = ModelConfig.from_pretrained(resolve_model(None if model == "default" else model))
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = [(cfg.q_size + 2 * cfg.kv_size, h), (h, cfg.q_size), (2 * i, h), (h, i)]
    torch.manual_seed(0)
    ws = [torch.randn(n, k) * 0.05 for n, k in shapes]
    from radixserve.model import cpu_gemv

    layers: dict[str, list[Any]] = {"bf16": [], "bf16 oneDNN": [], "bf16 gemv": []}
    for w in ws:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        lin.weight.data.copy_(w)
        layers["bf16"].append(PackedLinear(lin))
        if cpu_gemv.available():
            layers["bf16 oneDNN"].append(PackedLinear(lin, gemv_max_rows=0))
            layers["bf16 gemv"].append(PackedLinear(lin, gemv_max_rows=1 << 30))
    for method, group in (("int8", None), ("int4", 32)):
        for kind in ("kernel", "cached", "per-call"):
            made = [
                make_quantized_linear(
                    method, quantize_weight(method, w, group, torch.bfloat16), None, torch.bfloat16
                )
                for w in ws
            ]
            for m in made:
                if kind == "kernel":
                    m.dense_min_rows = 1 << 30
                elif kind == "cached":
                    m.cache_dense_weight(1)
                else:
                    m.dense_min_rows = 1
            layers[f"{method} {kind}"] = made
        if method == "int8" and cpu_gemv.available():  # torch's _weight_int8pack_mm
            from radixserve.model.quant.linear import Int8Linear

            made = [
                Int8Linear(quantize_weight(method, w, group, torch.bfloat16), None, gemv=False)
                for w in ws
            ]
            for m in made:
                m.dense_min_rows = 1 << 30
            layers["int8 torch kernel"] = made
    if cpu_gemv.available():  # torch's tinygemm int4 kernel (what Int4Linear ran before)
        from radixserve.model.quant.linear import Int4Linear

        made = [
            Int4Linear(quantize_weight("int4", w, 32, torch.bfloat16), None, gemv=False) for w in ws
        ]
        for m in made:
            m.dense_min_rows = 1 << 30
        layers["int4 tinygemm"] = made
    layers = {name: ls for name, ls in layers.items() if ls}
    print(f"us per layer (4 linears, {shapes}), median of {rounds} interleaved rounds:")
    print("| rows | " + " | ".join(layers) + " |")
    print("| ---: |" + " ---: |" * len(layers))
    with torch.inference_mode():
        for m in rows:
            xs = [torch.randn(m, k, dtype=torch.bfloat16) for _, k in shapes]
            times: dict[str, list[float]] = {name: [] for name in layers}
            for r in range(rounds + 1):
                for name, ls in layers.items():
                    t = time.perf_counter()
                    for _ in range(5):
                        for x, lin in zip(xs, ls):
                            lin(x)
                    if r:
                        times[name].append((time.perf_counter() - t) / 5 * 1e6)
            meds = [statistics.median(v) for v in times.values()]
            print(f"| {m} | " + " | ".join(f"{v:.0f}" for v in meds) + " |", flush=True)


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
    ap.add_argument(
        "--llamacpp",
        default="",
        help="also llama.cpp's llama-server on these GGUFs (q4_1,f32), interleaved in the rounds",
    )
    ap.add_argument(
        "--llamacpp-args",
        default="",
        help="extra llama-server flags, e.g. '--poll 0' (its threads sleep instead of spinning "
        "while they wait: on a shared machine spinning threads stall each other)",
    )
    ap.add_argument(
        "--layer-rows",
        default=None,
        help="instead: time one layer's linears per path at these row counts, e.g. 1,4,8,16,32",
    )
    args = ap.parse_args()
    if args.layer_rows:
        if args.threads:
            torch.set_num_threads(args.threads)
        layer_times(args.model, [int(r) for r in args.layer_rows.split(",")], args.rounds)
        return

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
        if name in POST_LOAD:
            print(f"{name}: {POST_LOAD[name](engines[name].model)} layers rebuilt", flush=True)
        report = engines[name].model.quant_report
        print(
            f"loaded {name} in {time.perf_counter() - t:.1f}s"
            + (f" ({report.weight_bytes / 2**20:.0f} MiB weights)" if report else ""),
            flush=True,
        )
    extra = tuple(args.llamacpp_args.split())
    servers_ = {
        f"llama.cpp {k}": LlamaCppServer(k, extra_args=extra) for k in args.llamacpp.split(",") if k
    }
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
    every = names + list(servers_)
    results: dict[str, dict[str, list[float]]] = {
        n: {"single": [], "c16": [], "shared_c16": []} for n in every
    }
    for r in range(args.rounds + 1):  # round 0 warms every engine up and is not counted
        order = every[r % len(every) :] + every[: r % len(every)]
        for name in order:
            if name in servers_:  # no shared-prompt figure: llama-server's cache is per slot
                srv = servers_[name]
                single = srv.decode_rate(single_prompt, args.decode_tokens)
                c16 = srv.decode_rate(questions, args.decode_tokens)
                shared = float("nan")
            else:
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
    for srv in servers_.values():
        srv.close()
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in results.items()}
    base = "fp32" if "fp32" in med else names[0]
    print(
        f"\nmedians of {args.rounds} rounds ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads); ratios vs {base}:"
    )
    print("| config | weights MiB | single tok/s | c16 decode tok/s | shared c16 out tok/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows = []
    for n in every:
        from radixserve.model.quant.apply import module_weight_bytes

        if n in servers_:
            mib = float("nan")  # llama.cpp's GGUF: see the file's size
        else:
            rep = engines[n].model.quant_report
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
