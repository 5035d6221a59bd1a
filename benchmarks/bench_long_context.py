"""Long prompts through HTTP: TTFT and time per output token against context length, for
radixserve (bf16 KV and each quantized KV dtype) beside vLLM-CPU and llama.cpp's
llama-server, and against both floors (issue 44).

Every server is started once and stays up, paused (SIGSTOP to its process group) while
another is measured (``--keep-idle-running``: left running, as in every run before session
32; the JSON's ``idle_cpu_share`` holds what each takes of a core while idle), so the peers
are measured A-B interleaved: each repetition visits every context length, and at each
length sends one request to every server in turn (the order rotates from one cell to the
next; the CPU's speed drifts). One request at a time, streamed, greedy, ``ignore_eos``:
exactly ``--max-tokens`` tokens. Prompts are random token ids, a new one per (repetition,
length) (nothing a server cached can hit), the same ids for every server of a cell.

- TTFT: send -> first streamed token; time per output token (TPOT): (end - TTFT) /
  (tokens - 1) (``peers/openai_load.py``).
- Compute floor of the prefill: linear FLOPs (2 x prompt x the checkpoint's projection
  weights, ``floor.checkpoint_matmul_weights``) plus causal attention FLOPs
  (``profile_long_context.attention_flops``) over the bf16 matrix rate
  (``profile_long_context.matrix_tflops``, a prefill chunk's MLP GEMM), measured in this
  process before each repetition, the servers idle; a cell's floor takes the best rate of
  the run so far (``tflops``; this repetition's own sample is ``tflops_measured``).
- Read floor of a decode token: the weights (``floor.checkpoint_weight_bytes``) plus the
  KV of the context at mid-answer (prompt + max_tokens / 2 tokens, at each KV dtype's
  bytes per token, ``radixserve.memory.footprint.kv_bytes_per_token``) over the read bandwidth
  (``floor.read_gbs``), sampled beside the matrix rate. ``kv_floor_ms`` is the KV part alone:
  the growth of TPOT with context is set against the growth of it.
- Paged read floors of a decode token's KV (bf16 KV): the same KV read as the engine lays it
  out, cold, and nothing computed (``bench_decode_attention.paged_read_ms``: every layer in
  turn after 256 MB read past them), sampled beside the read bandwidth, with the pages in
  ascending order (``contiguous_kv_floor_ms``: a fresh pool's free list hands one request
  such runs) and scattered at random (``paged_kv_floor_ms``: a pool that has cached and
  evicted many requests). The sequential rate of ``torch.sum`` over 512 MiB is the memory's
  best over a long read; a decode step reads a few MB once each after the weights evicted
  them. One request at a time, as here, a server's pages lie in ascending runs (a fresh
  pool's one run, a full pool's a few: tests/scheduling/test_scheduler.py), so the
  contiguous floor is the paged floor of this traffic, the scattered one a pool's worst
  case. The growth of TPOT is set against all three.

- ``--in-process``: the same engine as the bf16 radixserve server (its page size, pages,
  threads, running requests and window), built in this process, takes the same prompt at
  each cell as one more server (``radixserve-bf16-in-process``): TTFT from adding the
  request to the step that gives its first token, TPOT from there to the last. The growth of
  TPOT from the shortest context to the longest through HTTP, over the same growth in
  process, is what the serving path (router, worker loop, streaming) adds that grows with
  the context (issue 44); ``growth`` in the JSON holds it, and each server's growth over its
  KV read floor's. ``itl_median_ms`` (every cell): the median gap between two tokens, which
  a burst of another process on the machine moves less than the mean.

A context past the model's window (SmolLM2-135M: 8,192 positions) is cut to
window - max_tokens prompt tokens; the row keeps the asked ``context`` and the
``prompt_tokens`` sent.

::

    python benchmarks/bench_long_context.py --reps 2 \\
        --kv-dtypes auto,fp8_e4m3,int8,int4 --peers vllm-bf16,llamacpp-f32
    python benchmarks/bench_long_context.py --contexts 256,512 --max-tokens 8 \\
        --peers "" --out /tmp/long_context_smoke.json          # a smoke run
    python benchmarks/bench_long_context.py --contexts 1000,7500 --kv-dtypes auto \\
        --peers "" --in-process --reps 3 --out /tmp/long_context_serving.json  # HTTP vs in process

Writes ``--out`` (JSON; after every cell, so an interrupted run keeps what it measured) and
the plot beside it (``.png``: TTFT and TPOT against context length, the floors dashed).
To keep a run: an entry in ``results/index.json`` and a table, as benchmarks/README.md says.
"""

from __future__ import annotations

# Before torch: radixserve sets the process's OpenMP wait policy (see bench_runner_step.py).
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import asyncio  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `floor`, `peers`, the profile

from bench_decode_attention import paged_read_ms  # noqa: E402
from floor import (  # noqa: E402
    checkpoint_matmul_weights,
    checkpoint_weight_bytes,
    read_gbs,
    read_source,
)
from peers import servers  # noqa: E402
from peers.openai_load import ReplayConfig, RequestResult, replay  # noqa: E402
from profile_long_context import attention_flops, machine, matrix_tflops  # noqa: E402

from radixserve.memory.footprint import kv_bytes_per_token  # noqa: E402
from radixserve.model.config import ModelConfig  # noqa: E402


@dataclass(frozen=True)
class Prompt:
    """One request as ``openai_load`` sends it (token ids, ``/v1/completions``)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    messages: tuple[Any, ...] = ()


@dataclass
class Server:
    """One server under test: its name in the results, its KV dtype (radixserve), its process."""

    name: str
    spec: servers.PeerSpec
    kv_dtype: str | None
    proc: servers.ServerProcess | None = None


IN_PROCESS = "radixserve-bf16-in-process"


class InProcess:
    """The bf16 radixserve server's engine in this process (``--in-process``): the same
    configuration as ``peers/servers.py`` starts ``radixserve serve`` with, no sockets."""

    name = IN_PROCESS

    def __init__(self, model_dir: Path, max_ctx: int, kv_gib: float) -> None:
        from radixserve.engine.engine import Engine

        per_tok = kv_bytes_per_token(ModelConfig.from_pretrained(model_dir), "auto", torch.bfloat16)
        self.engine = Engine(
            model_dir,
            dtype="bfloat16",
            device="cpu",
            page_size=16,
            num_pages=int(kv_gib * 2**30 // (int(per_tok) * 16)),
            num_threads=servers.THREADS,
            max_running_requests=1,
            max_model_len=max_ctx,
        )

    def send(self, prompt: Prompt) -> RequestResult:
        """One request, greedy, ``ignore_eos``; timed as ``openai_load`` times a stream."""
        from radixserve.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=prompt.max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        self.engine.add_request(list(prompt.prompt_ids), params)
        stamps: list[float] = []
        cached = 0
        while self.engine.has_unfinished():
            outs = self.engine.step()
            now = time.perf_counter()
            for o in outs:
                stamps += [now] * len(o.new_token_ids)
                if o.usage is not None:
                    cached = o.usage.cached_tokens
        return RequestResult(
            ttft=stamps[0] - t0,
            e2e=stamps[-1] - t0,
            itl=[b - a for a, b in zip(stamps, stamps[1:])],
            prompt_tokens=len(prompt.prompt_ids),
            completion_tokens=len(stamps),
            cached_tokens=cached,
            text="",
            finish_reason="length",
        )


def radixserve_name(kv: str) -> str:
    return "radixserve-bf16" if kv == "auto" else f"radixserve-bf16-kv-{kv}"


def start(
    srv: Server, model_dir: Path, max_ctx: int, kv_gib: float, log_dir: Path
) -> servers.ServerProcess:
    """Start ``srv`` (radixserve with ``--kv-cache-dtype`` appended) and wait until it is ready."""
    port = servers.free_port()
    cmd, env = servers.command(srv.spec, model_dir, port, kv_gib, max_ctx, 1)
    if srv.kv_dtype is not None:
        cmd += ["--kv-cache-dtype", srv.kv_dtype]
    proc = servers.ServerProcess(cmd, env, port, log_dir / f"{srv.name}.log", srv.spec.ready_path)
    try:
        proc.wait_ready(srv.spec.startup_timeout_s)
    except Exception:
        proc.stop()
        raise
    return proc


IDLE_SAMPLE_S = 10.0


def idle_cpu_share(group: list[Server]) -> dict[str, float]:
    """Each started server's CPU time while idle, as a share of one core, over
    ``IDLE_SAMPLE_S`` seconds with every server up and none asked anything: what a server
    left running would take from the one being measured (the reason the others are paused,
    ``quiet``)."""
    procs = {s.name: s.proc for s in group if s.proc is not None}
    before = {name: proc.cpu_seconds() for name, proc in procs.items()}
    time.sleep(IDLE_SAMPLE_S)  # the sampling window itself
    return {
        name: (proc.cpu_seconds() - before[name]) / IDLE_SAMPLE_S for name, proc in procs.items()
    }


# Sent, untimed, to a server just resumed, until one is answered (``wake``): after a pause
# longer than their heartbeats, servers reconnect their own processes (radixserve's worker
# its connection to the router, which answers 503 "no live worker" until the worker has
# said hello again), and the timed request should not wait on that or fail for it.
WAKE = Prompt(tuple(range(1000, 1016)), 1)
WAKE_DEADLINE_S = 120.0


def wake(srv: Server, tok: Any, timeout_s: float) -> int:
    """Send ``WAKE`` to ``srv`` until it is answered; how many were refused first."""
    deadline = time.monotonic() + WAKE_DEADLINE_S
    refused = 0
    while (r := send(srv, WAKE, tok, timeout_s)).error:
        refused += 1
        if time.monotonic() > deadline:
            raise RuntimeError(f"{srv.name} still refuses after waking: {r.error}")
        time.sleep(0.2)  # polling a server that reconnects its own processes
    return refused


def quiet(group: list[Server], measured: Server | None, keep_running: bool) -> bool:
    """Resume ``measured`` and pause every other server (``ServerProcess.pause``), so that
    one engine has the machine while it is timed: the in-process engine and the floors'
    samples (``measured`` None) get it to themselves too. ``keep_running``: leave them all
    running (each paused one is resumed). Whether ``measured`` was paused until now."""
    woken = False
    for srv in group:
        if srv.proc is None:
            continue
        if srv is measured or keep_running:
            woken |= srv is measured and srv.proc.paused
            srv.proc.resume()
        else:
            srv.proc.pause()
    return woken


def send(srv: Server, prompt: Prompt, tok: Any, timeout_s: float) -> RequestResult:
    """One streamed request (``tok`` counts the tokens where a server sends no usage)."""
    assert srv.proc is not None
    cfg = ReplayConfig(
        srv.proc.base_url,
        "smollm2",
        mode=srv.spec.mode,
        extra_body=srv.spec.extra_body,
        include_usage=srv.spec.include_usage,
        timeout_s=timeout_s,
    )
    out, _ = asyncio.run(replay(cfg, [[prompt]], 1, tok))
    return out[0][0]


def floors(
    cfg: ModelConfig,
    prompt_tokens: int,
    max_tokens: int,
    tflops: float,
    gbs: float,
    weights: int,
    matmul_weights: int,
    kv_dtypes: list[str],
) -> dict[str, Any]:
    """The compute floor of the prefill (s) and, per KV dtype, the read floor of a decode
    token (ms) and its KV part."""
    flops = 2 * prompt_tokens * matmul_weights + attention_flops(
        cfg.num_layers, cfg.num_q_heads, cfg.head_dim, 0, prompt_tokens
    )
    mid = prompt_tokens + max_tokens / 2
    kv_ms = {
        kv: kv_bytes_per_token(cfg, kv, torch.bfloat16) * mid / (gbs * 1e9) * 1e3
        for kv in kv_dtypes
    }
    weight_ms = weights / (gbs * 1e9) * 1e3
    return {
        "prefill_flops": flops,
        "compute_floor_s": flops / (tflops * 1e12),
        "weight_floor_ms": weight_ms,
        "kv_floor_ms": kv_ms,
        "decode_floor_ms": {kv: weight_ms + ms for kv, ms in kv_ms.items()},
    }


def summary(doc: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per server and context: the median TTFT (s) and TPOT (ms) over the repetitions."""
    cells: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for c in doc["cells"]:
        if c.get("error") is None:
            cells.setdefault(c["server"], {}).setdefault(c["context"], []).append(c)
    return {
        name: {
            str(ctx): {
                "ttft_s": statistics.median(c["ttft_s"] for c in rows),
                "tpot_ms": statistics.median(c["tpot_ms"] for c in rows),
                **(
                    {"itl_median_ms": statistics.median(c["itl_median_ms"] for c in rows)}
                    if all(c.get("itl_median_ms") is not None for c in rows)
                    else {}
                ),
                "n": len(rows),
            }
            for ctx, rows in sorted(by_ctx.items())
        }
        for name, by_ctx in cells.items()
    }


def growth(doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per server, from the shortest context of the run to the longest: the growth of TPOT
    and of the median inter-token gap (ms), the growth of its KV read floor (the server's KV
    dtype; bf16 for peers), each growth over that floor's, and for every radixserve server
    run beside the in-process engine, its growth over the in-process one's (issue 44's
    measure: 1 when the serving path adds nothing that grows with the context)."""
    summ = doc["summary"]
    kv_of: dict[str, str] = doc.get("kv_dtype_of", {})
    out: dict[str, dict[str, float]] = {}
    for name, by_ctx in summ.items():
        if len(by_ctx) < 2:
            continue
        lo, hi = min(by_ctx, key=int), max(by_ctx, key=int)
        kv = kv_of.get(name, "auto")
        # Each floor's median at both ends: the sequential one at the server's KV dtype, the
        # paged ones (bf16 KV's) where the run sampled them.
        floors = doc["floors"]
        reads: dict[str, Callable[[dict[str, Any]], float]] = {}
        if kv in floors[0]["kv_floor_ms"]:
            reads["kv_floor_ms"] = lambda f: f["kv_floor_ms"][kv]
        for paged in ("paged_kv_floor_ms", "contiguous_kv_floor_ms"):
            if kv == "auto" and all(paged in f for f in floors):
                reads[paged] = lambda f, paged=paged: f[paged]
        growths = {
            floor: statistics.median(read(f) for f in floors if str(f["context"]) == hi)
            - statistics.median(read(f) for f in floors if str(f["context"]) == lo)
            for floor, read in reads.items()
        }
        g: dict[str, float] = {"from": int(lo), "to": int(hi)}
        for key in ("tpot_ms", "itl_median_ms"):
            if key in by_ctx[lo] and key in by_ctx[hi]:
                g[key] = by_ctx[hi][key] - by_ctx[lo][key]
                for floor, grew in growths.items():
                    g[f"{key}_over_{floor.removesuffix('_ms')}"] = g[key] / grew
        g.update(growths)
        out[name] = g
    base = out.get(IN_PROCESS)
    if base is not None:
        for name, g in out.items():
            if name != IN_PROCESS and name.startswith("radixserve") and kv_of.get(name) == "auto":
                for key in ("tpot_ms", "itl_median_ms"):
                    if key in g and base.get(key):
                        g[f"{key}_over_in_process"] = g[key] / base[key]
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    """TTFT and TPOT against context length, one line per server, the floors dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_d) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, by_ctx in doc["summary"].items():
        xs = [int(c) for c in by_ctx]
        ax_t.plot(xs, [v["ttft_s"] for v in by_ctx.values()], marker="o", label=name)
        ax_d.plot(xs, [v["tpot_ms"] for v in by_ctx.values()], marker="o", label=name)
    fl: dict[int, list[dict[str, Any]]] = {}
    for f in doc["floors"]:
        fl.setdefault(f["context"], []).append(f)
    xs = sorted(fl)
    if xs:
        ax_t.plot(
            xs,
            [statistics.median(f["compute_floor_s"] for f in fl[x]) for x in xs],
            "k--",
            label="compute floor (bf16 matrix rate)",
        )
        for kv in doc["args"]["kv_dtypes"].split(","):
            ax_d.plot(
                xs,
                [statistics.median(f["decode_floor_ms"][kv] for f in fl[x]) for x in xs],
                "--",
                label=f"read floor, weights + {kv} KV",
            )
    for ax, what in ((ax_t, "TTFT (s)"), (ax_d, "time per output token (ms)")):
        ax.set_xlabel("context (prompt tokens asked)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{doc['benchmark']}, {doc['date']} ({doc['machine']['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--contexts", default="1000,3000,6000,7500,8000")
    ap.add_argument(
        "--kv-dtypes",
        default="auto,fp8_e4m3,int8,int4",
        help="radixserve servers, one per --kv-cache-dtype (auto: bf16 KV)",
    )
    ap.add_argument(
        "--peers",
        default="vllm-bf16,llamacpp-f32",
        help=f"other servers (names in peers/servers.py: {', '.join(servers.PEERS)})",
    )
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-gib", type=float, default=1.0, help="KV cache budget per server")
    ap.add_argument("--request-timeout", type=float, default=900.0)
    ap.add_argument(
        "--in-process",
        action="store_true",
        help=f"also the bf16 server's engine in this process ({IN_PROCESS}): what HTTP adds",
    )
    ap.add_argument(
        "--keep-idle-running",
        action="store_true",
        help="leave the servers not being measured running, as every run before session 32 did "
        "(default: paused, see the module's docstring)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a local HF directory (default: SmolLM2-135M)")
    ap.add_argument("--out", default="benchmarks/results/bench_long_context.json")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from transformers import AutoTokenizer

    from radixserve.model_store import resolve_model

    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    window = cfg.max_position_embeddings
    contexts = [int(x) for x in args.contexts.split(",") if x]
    kv_dtypes = [kv for kv in args.kv_dtypes.split(",") if kv]
    spec = servers.peer_spec("radixserve-bf16")
    group = [Server(radixserve_name(kv), spec, None if kv == "auto" else kv) for kv in kv_dtypes]
    group += [Server(p, servers.peer_spec(p), None) for p in args.peers.split(",") if p]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": "bench_long_context",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="minutes"),
        "machine": {**machine(), "load_avg_at_start": os.getloadavg()},
        "model": str(model_dir),
        "model_window": window,
        "args": vars(args),
        "servers": {
            s.name: s.spec.label + (f", KV {s.kv_dtype}" if s.kv_dtype else "") for s in group
        },
        "kv_dtype_of": {s.name: s.kv_dtype or "auto" for s in group if s.spec is spec}
        | ({IN_PROCESS: "auto"} if args.in_process else {}),
        "startup_s": {},
        "failures": {},
        "floors": [],
        "cells": [],
    }

    def save() -> None:
        doc["summary"] = summary(doc)
        doc["growth"] = growth(doc)
        out.write_text(json.dumps(doc, indent=1) + "\n")

    log_dir = servers.PEERS_ROOT / "logs"  # server logs stay out of the repository
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for srv in group:
            t0 = time.perf_counter()
            try:
                srv.proc = start(srv, model_dir, window, args.kv_gib, log_dir)
            except Exception as exc:  # noqa: BLE001 - a server that cannot run: recorded, skipped
                doc["failures"][srv.name] = f"{type(exc).__name__}: {exc}"
                print(f"[{srv.name}] FAILED to start: {exc}", flush=True)
                continue
            doc["startup_s"][srv.name] = time.perf_counter() - t0
            warm = send(srv, Prompt(tuple(range(1000, 1256)), 8), tok, args.request_timeout)
            print(f"[{srv.name}] up; warm-up error: {warm.error}", flush=True)
        live: list[Server | InProcess] = [s for s in group if s.proc is not None]
        doc["idle_cpu_share"] = idle_cpu_share(group)
        if args.in_process:
            inproc = InProcess(model_dir, window, args.kv_gib)
            inproc.send(Prompt(tuple(range(1000, 1256)), 8))
            live.append(inproc)
        weights = checkpoint_weight_bytes(model_dir, torch.bfloat16)
        matmul_weights = checkpoint_matmul_weights(model_dir)
        src = read_source()
        rng = random.Random(args.seed)
        turn = 0
        tflops = 0.0
        for rep in range(args.reps):
            # The best rate of the run so far: a sample taken while another process held a
            # core (0.62 against 2.34 TFLOP/s in one run on the 2-core Xeon) must not lower
            # the floor of every cell after it.
            quiet(group, None, args.keep_idle_running)
            measured = matrix_tflops(2048, cfg.hidden_size, cfg.intermediate_size, torch.bfloat16)
            tflops = max(tflops, measured)
            gbs = statistics.median(read_gbs(src) for _ in range(3))
            for ctx in contexts:
                n = min(ctx, window - args.max_tokens)
                ids = tuple(rng.randrange(100, cfg.vocab_size - 100) for _ in range(n))
                f = floors(cfg, n, args.max_tokens, tflops, gbs, weights, matmul_weights, kv_dtypes)
                paged = {
                    name: paged_read_ms(
                        round(n + args.max_tokens / 2),
                        cfg.num_layers,
                        cfg.num_kv_heads,
                        cfg.head_dim,
                        spec.page_size,
                        torch.bfloat16,
                        scattered=scattered,
                    )
                    for name, scattered in (
                        ("paged_kv_floor_ms", True),
                        ("contiguous_kv_floor_ms", False),
                    )
                }
                doc["floors"].append(
                    {
                        "rep": rep,
                        "context": ctx,
                        "prompt_tokens": n,
                        "tflops": tflops,
                        "tflops_measured": measured,
                        "read_gbs": gbs,
                        **paged,
                        **f,
                    }
                )
                order = live[turn % len(live) :] + live[: turn % len(live)] if live else []
                turn += 1
                for srv in order:
                    timed = srv if isinstance(srv, Server) else None
                    refused = 0
                    if quiet(group, timed, args.keep_idle_running) and timed is not None:
                        refused = wake(timed, tok, args.request_timeout)
                    load_before = os.getloadavg()[0]
                    prompt = Prompt(ids, args.max_tokens)
                    if isinstance(srv, InProcess):
                        r = srv.send(prompt)
                    else:
                        r = send(srv, prompt, tok, args.request_timeout)
                    cell = {
                        "server": srv.name,
                        "rep": rep,
                        "context": ctx,
                        "prompt_tokens": r.prompt_tokens,
                        "completion_tokens": r.completion_tokens,
                        "cached_tokens": r.cached_tokens,
                        "ttft_s": r.ttft,
                        "tpot_ms": (r.e2e - r.ttft) / max(1, r.completion_tokens - 1) * 1e3,
                        "itl_median_ms": statistics.median(r.itl) * 1e3 if r.itl else None,
                        "error": r.error,
                        "load_avg_before": load_before,
                        "wake_refused": refused,
                    }
                    doc["cells"].append(cell)
                    save()
                    print(
                        f"rep {rep} ctx {ctx:>5} {srv.name:>26}: TTFT {r.ttft:.2f} s "
                        f"({r.ttft / f['compute_floor_s']:.1f}x floor), TPOT {cell['tpot_ms']:.1f} ms, "
                        f"{r.completion_tokens} tokens{'; ' + r.error if r.error else ''}",
                        flush=True,
                    )
    finally:
        for srv in group:
            if srv.proc is not None:
                srv.proc.stop()
    save()
    for name, g in doc["growth"].items():
        print(
            f"growth {g['from']} -> {g['to']} {name:>26}: "
            + ", ".join(f"{k} {v:.2f}" for k, v in g.items() if k not in ("from", "to"))
        )
    png = out.with_suffix(".png")
    plot(doc, png)
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
