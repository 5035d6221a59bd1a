"""Where a long prompt's time goes: prefill and decode, split and set against their floors.

One in-process engine per KV dtype (default model, CPU), one request at a time, for each
context length of ``--lengths``:

- **prefill** of a fresh random prompt (nothing cached), timed without a profiler (TTFT),
  then a second fresh prompt of the same length under ``torch.profiler``, its ops' self
  time classed as linear layers, attention or the rest. Each class is set against its
  floor: linear FLOPs (2 x rows x non-embedding weights) and causal attention FLOPs
  (4 x layers x query heads x head_dim x L(L+1)/2) over the bf16 matrix rate this run
  measures. The chunked-prefill schedule is reported too: how many steps (chunks), each
  chunk's time, and how much of the attention goes to re-reading the earlier chunks' KV
  (attention FLOPs of chunk c over its own rows alone, against over all its keys).
- **decode** on top of the first prompt (its prefix cached, so no second prefill):
  median step time over ``--decode-tokens``, against the weight-streaming floor (weight
  bytes over the read bandwidth measured in the same run) plus the KV floor (the KV bytes
  a step reads over the same bandwidth); then the same decode with the per-layer path
  (``native_stack = False``) under the profiler, for attention's share of a step.
- **host work** of a decode step: the same decode with the model's forward replaced by a
  constant logits row (median wall time of a step: scheduling, staging, the attention
  plan, sampling), and the Python lines one such step runs in radixserve's code, a count
  no other process moves: neither should grow with the context (issue 44).

::

    python benchmarks/profile_long_context.py                                  # bf16, 1k-8k
    python benchmarks/profile_long_context.py --kv-dtypes auto,fp8_e4m3,int8,int4 \\
        --out benchmarks/results/profile_long_context.json

The profiler's self times are on the calling thread (an op's intra-op threads inside its
own time): read them as shares, and the unprofiled TTFT and step times as the times.
"""

from __future__ import annotations

# Before torch: radixserve sets the process's OpenMP wait policy (see bench_runner_step.py).
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))  # `floor`, after a PYTHONPATH checkout
from floor import read_gbs, read_source  # noqa: E402
from provenance import machine  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model_store import resolve_model  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402

# Profiler op names by class (self time; anything else is "other").
ATTENTION_OPS = ("paged_attention", "scaled_dot_product", "flash_attention", "_softmax")
LINEAR_OPS = ("gemv", "aten::mm", "aten::addmm", "aten::linear", "mkldnn", "onednn", "_weight_int")


def op_class(name: str) -> str:
    """``attention``, ``linear`` or ``other`` for a profiler op name."""
    if any(s in name for s in ATTENTION_OPS):
        return "attention"
    if any(s in name for s in LINEAR_OPS):
        return "linear"
    return "other"


def split_self_ms(prof: torch.profiler.profile) -> dict[str, float]:
    """Self CPU milliseconds of the profiled ops by class (top-level ops only count once)."""
    out = {"attention": 0.0, "linear": 0.0, "other": 0.0}
    for ev in prof.key_averages():
        out[op_class(ev.key)] += ev.self_cpu_time_total / 1e3
    return out


def top_ops(prof: torch.profiler.profile, n: int = 8) -> list[tuple[str, float]]:
    """The ``n`` ops of most self CPU milliseconds: what "other" is made of."""
    evs = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [(e.key, round(e.self_cpu_time_total / 1e3, 2)) for e in evs[:n]]


def matrix_tflops(rows: int, k: int, n: int, dtype: torch.dtype, reps: int = 5) -> float:
    """TFLOP/s of ``[rows, k] @ [k, n]`` in ``dtype``, the fastest of ``reps``: the rate a
    prefill's GEMMs can run at on this machine now. A floor takes the best rate seen, not the
    median: on a shared VM a sample slowed by another process would lower the floor's rate
    and flatter everything set against it."""
    a, b = torch.randn(rows, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * rows * k * n / min(times) / 1e12


def attention_flops(layers: int, q_heads: int, head_dim: int, start: int, rows: int) -> float:
    """Causal attention FLOPs of ``rows`` new tokens after ``start`` cached ones: QK^T and PV,
    2 FLOPs per multiply-add each, over the keys each row sees (``bench_long_context.py``
    imports it for its compute floor)."""
    keys = rows * start + rows * (rows + 1) / 2
    return 4 * layers * q_heads * head_dim * keys


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and weight buffer a decode step reads, each storage once."""
    seen: set[int] = set()
    total = 0
    tensors: Iterable[tuple[str, torch.Tensor]] = [
        *model.named_parameters(),
        *((n, b) for n, b in model.named_buffers() if n.endswith(("qweight", "scale", "packed"))),
    ]
    for _, t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total


class Profiler:
    """One engine and the measurements of one KV dtype."""

    def __init__(self, args: argparse.Namespace, kv_dtype: str) -> None:
        longest = max(args.lengths) + args.decode_tokens + 64
        self.engine = Engine(
            resolve_model(args.model),
            dtype=args.dtype,
            kv_cache_dtype=kv_dtype,
            device="cpu",
            num_threads=args.threads,
            max_model_len=longest,
            max_num_tokens=args.chunk,
            num_pages=2 * longest // 16 + 64,
            max_running_requests=4,
        )
        self.rng = random.Random(args.seed)
        self.args = args
        cfg = self.engine.model_config
        self.layers, self.q_heads, self.head_dim = cfg.num_layers, cfg.num_q_heads, cfg.head_dim
        self.weights = weight_bytes(self.engine.model)
        # Multiply-adds per prompt token in the linear layers (the head runs on one row only).
        self.matmul_weights = sum(
            m.in_features * m.out_features
            for name, m in self.engine.model.named_modules()
            if hasattr(m, "in_features") and not name.endswith("lm_head")
        )

    def prompt(self, n: int) -> list[int]:
        return [
            self.rng.randrange(100, self.engine.model_config.vocab_size - 100) for _ in range(n)
        ]

    def run_until_token(self, prompt: list[int], max_tokens: int) -> list[float]:
        """Wall seconds of every step from adding the request to its first token."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(prompt, params)
        steps: list[float] = []
        while True:
            t = time.perf_counter()
            outs = self.engine.step()
            steps.append(time.perf_counter() - t)
            if any(o.new_token_ids for o in outs):
                return steps

    def drain(self) -> list[float]:
        """Wall seconds of every remaining step (the decode steps), until the engine is idle."""
        steps: list[float] = []
        while True:
            t = time.perf_counter()
            outs = self.engine.step()
            if not outs and not self.engine.has_unfinished():
                return steps
            steps.append(time.perf_counter() - t)

    def attention_flops(self, start: int, rows: int) -> float:
        """Causal attention FLOPs of ``rows`` new tokens after ``start`` cached ones."""
        return attention_flops(self.layers, self.q_heads, self.head_dim, start, rows)

    def prefill(self, n: int, tflops: float) -> dict[str, Any]:
        prompt = self.prompt(n)
        steps = self.run_until_token(prompt, 1)
        self.drain()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            self.run_until_token(self.prompt(n), 1)
        self.drain()
        split = split_self_ms(prof)
        chunk = self.args.chunk
        starts = list(range(0, n, chunk))
        attn = sum(self.attention_flops(s, min(chunk, n - s)) for s in starts)
        own = sum(self.attention_flops(0, min(chunk, n - s)) for s in starts)
        linear_flops = 2 * n * self.matmul_weights
        return {
            "prompt": prompt,
            "ttft_s": sum(steps),
            "chunks": len(steps),
            "chunk_s": steps,
            "profiled_ms": split,
            "profiled_top_ops": top_ops(prof),
            "linear_floor_ms": linear_flops / (tflops * 1e12) * 1e3,
            "attention_floor_ms": attn / (tflops * 1e12) * 1e3,
            "attention_rereads_earlier_kv": 1 - own / attn,
        }

    def decode(self, prompt: list[int], gbs: float) -> dict[str, Any]:
        k = self.args.decode_tokens
        self.run_until_token(prompt, k + 1)
        steps = self.drain()
        step_ms = statistics.median(steps) * 1e3
        model = self.engine.model
        native = getattr(model, "native_stack", None)
        if native is not None:
            model.native_stack = False  # per layer, so attention shows as ops of its own
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            self.run_until_token(prompt, k + 1)
            self.drain()
        if native is not None:
            model.native_stack = native
        split = {c: v / k for c, v in split_self_ms(prof).items()}
        pool = self.engine.pool
        kv_bytes = pool.bytes_per_page / pool.page_size * len(prompt)
        host_ms, host_lines = self.host_work(prompt)
        return {
            "step_ms": step_ms,
            "host_ms": host_ms,
            "host_python_lines": host_lines,
            "weight_floor_ms": self.weights / (gbs * 1e9) * 1e3,
            "kv_floor_ms": kv_bytes / (gbs * 1e9) * 1e3,
            "per_layer_profiled_ms_per_step": split,
            "per_layer_top_ops": top_ops(prof),
        }

    def host_work(self, prompt: list[int]) -> tuple[float, int]:
        """A decode step's host work on top of ``prompt`` (cached): the median wall ms of
        ``--decode-tokens`` steps with the model's forward replaced by a constant logits row
        (scheduling, staging, the attention plan, sampling, outputs: everything but the
        kernels), and the Python lines one such step runs in radixserve's code (``sys.settrace``;
        a count that no other process on the machine moves). Neither should grow with the
        context (issue 44). The stubbed steps write no KV: the cache is flushed after them."""
        eng = self.engine
        runner = eng.runner
        logits = torch.zeros(1, eng.model_config.vocab_size)
        runner._forward = lambda batch, plan, staged: logits.expand(len(plan.logits_indices), -1)  # type: ignore[method-assign]
        package = str(Path(radixserve.__file__).parent)
        lines = 0

        def trace(frame: Any, event: str, arg: Any) -> Any:
            nonlocal lines
            if not frame.f_code.co_filename.startswith(package):
                return None
            lines += event == "line"
            return trace

        try:
            k = self.args.decode_tokens
            self.run_until_token(prompt, k + 2)
            eng.step()  # the first decode step (a page may open): not the one counted
            sys.settrace(trace)
            try:
                eng.step()
            finally:
                sys.settrace(None)
            steps = self.drain()
        finally:
            del runner._forward  # the class's method again
        eng.flush_cache()
        return statistics.median(steps) * 1e3, lines


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="a local HF directory (default: SmolLM2-135M)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-dtypes", default="auto", help="comma-separated --kv-cache-dtype values")
    ap.add_argument(
        "--lengths",
        default="1000,3000,6000,7500,8000",
        type=lambda s: [int(x) for x in s.split(",")],
    )
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_tokens: the prefill chunk")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    src = read_source()
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "args": {k: v for k, v in vars(args).items()},
        "results": [],
    }
    for kv in args.kv_dtypes.split(","):
        prof = Profiler(args, kv)
        cfg = prof.engine.model_config
        for n in args.lengths:
            tflops = matrix_tflops(
                args.chunk, cfg.hidden_size, cfg.intermediate_size, torch.bfloat16
            )
            gbs = statistics.median(read_gbs(src) for _ in range(3))
            pre = prof.prefill(n, tflops)
            dec = prof.decode(pre.pop("prompt"), gbs)
            row = {"kv_dtype": kv, "tokens": n, "tflops": tflops, "read_gbs": gbs, **pre, **dec}
            report["results"].append(row)
            print(summary_line(row), flush=True)
        del prof
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def summary_line(r: dict[str, Any]) -> str:
    p = r["profiled_ms"]
    total = sum(p.values()) or 1.0
    return (
        f"kv {r['kv_dtype']:>8} L={r['tokens']:>5}: TTFT {r['ttft_s']:.2f} s in {r['chunks']} "
        f"chunks (linear {p['linear'] / total:.0%} at {p['linear'] / r['linear_floor_ms']:.1f}x "
        f"its floor, attention {p['attention'] / total:.0%} at "
        f"{p['attention'] / r['attention_floor_ms']:.1f}x, "
        f"{r['attention_rereads_earlier_kv']:.0%} of attention on earlier chunks); "
        f"decode {r['step_ms']:.1f} ms/step vs floors weights {r['weight_floor_ms']:.1f} + "
        f"KV {r['kv_floor_ms']:.2f} ms "
        f"(per-layer attention {r['per_layer_profiled_ms_per_step']['attention']:.1f} ms/step); "
        f"host work {r['host_ms'] * 1e3:.0f} us/step, {r['host_python_lines']} Python lines"
    )


if __name__ == "__main__":
    raise SystemExit(main())
