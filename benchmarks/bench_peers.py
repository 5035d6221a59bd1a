"""radixserve against real peers, side by side, on the same SmolLM2 weights.

One command per workload (``benchmarks/workloads.py``; ``tree`` is the DSL fork/tree
program of ``benchmarks/peers/dsl_tree.py``)::

    python benchmarks/bench_peers.py --workload shared_system
    python benchmarks/bench_peers.py --workload multi_turn
    python benchmarks/bench_peers.py --workload few_shot
    python benchmarks/bench_peers.py --workload tree
    python benchmarks/report.py                      # Markdown table + PNG plots from the JSON

The figures in benchmarks/README.md came from these runs (the exact command of each run is
printed above its table in ``results/peers_report.md``). The headline, at the workload's
default size::

    python benchmarks/bench_peers.py --workload shared_system --tag full --concurrency 4,16 --reps 2 \
        --peers radixserve,radixserve-nocache,vllm-fp32,radixserve-bf16,vllm-bf16 \
        --peer-concurrency radixserve-nocache=16
    python benchmarks/bench_peers.py --workload shared_system --tag full3 --concurrency 16 --reps 3 \
        --peers radixserve,radixserve-nocache,radixserve-bf16,vllm-bf16

and smaller ones (``--scale 0.5``: a few minutes per cell at most)::

    python benchmarks/bench_peers.py --workload shared_system --scale 0.5 --tag sweep --concurrency 4,16 \
        --peers radixserve,radixserve-nocache,vllm-fp32,llamacpp-f32,radixserve-bf16,vllm-bf16
    python benchmarks/bench_peers.py --workload shared_system --scale 0.5 --tag c16 --concurrency 16 --reps 2 \
        --peers radixserve,vllm-fp32,radixserve-bf16,vllm-bf16
    python benchmarks/bench_peers.py --workload shared_system --scale 0.5 --tag spin --concurrency 4,16 \
        --peers radixserve,radixserve-spin,vllm-fp32
    python benchmarks/bench_peers.py --workload shared_system --scale 0.5 --tag bf16 --concurrency 4,16 \
        --peers radixserve-bf16,vllm-bf16
    python benchmarks/bench_peers.py --workload shared_system --scale 0.5 --tag onoff --concurrency 16 \
        --peers radixserve,radixserve-nocache
    for w in few_shot multi_turn tree; do
        python benchmarks/bench_peers.py --workload $w --scale 0.5 --concurrency 8 \
            --peers radixserve,radixserve-nocache,vllm-fp32,llamacpp-f32
    done

The slow peers (transformers' ``serve`` and ``generate_batch``, llama-server on the Q4_1
GGUF) beside radixserve (the first session's runs of them are kept in ``results/session1/``)::

    python benchmarks/bench_peers.py --workload shared_system --scale 0.5 --tag allpeers --concurrency 4,16 \
        --peers radixserve,transformers-serve,llamacpp-q4_1,transformers-cb \
        --peer-concurrency transformers-serve=4 --peer-concurrency transformers-cb=16

Peers (``--peers``, names in ``benchmarks/peers/servers.py``; set them up first with
``bash benchmarks/peers/setup_peers.sh``): radixserve with the radix cache on / off (its
HTTP gateway, the same OpenAI path as the peers), vLLM's CPU build (block 16 and 128,
fp32 and bf16), llama.cpp's llama-server (f32 and Q4_1 GGUF, parallel slots, prompt
cache), ``transformers serve --continuous-batching`` and transformers' in-process
``generate_batch``.

Protocol: peers run one at a time, never two at once; each repetition starts every peer
in turn (the order rotates between repetitions, the CPU's speed drifts), measures every
concurrency level on it, and stops it. Every (repetition, concurrency) cell gets its own
salt, so no cell hits on what an earlier cell left in a peer's cache; all peers see the
same token ids in a cell. Greedy, ``ignore_eos`` (exactly ``max_tokens`` tokens) where
the peer has it. Each cell is bounded by ``--cell-timeout``. Results are appended to
``benchmarks/results/peers_<workload>.json`` after every cell (raw per-request records
go to ``..._raw.json``), so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # `workloads`, `peers` as top-level modules

import workloads as wl  # noqa: E402
from peers import servers  # noqa: E402
from peers.openai_load import ReplayConfig, RequestResult, replay, summarize, to_json  # noqa: E402

DEFAULT_PEERS = {
    "shared_system": "radixserve,radixserve-nocache,vllm-fp32,vllm-bf16,llamacpp-f32,llamacpp-q4_1,"
    "transformers-serve,transformers-cb",
    "multi_turn": "radixserve,radixserve-nocache,vllm-fp32,llamacpp-f32",
    "few_shot": "radixserve,radixserve-nocache,vllm-fp32,llamacpp-f32",
    "tree": "radixserve,radixserve-nocache,vllm-fp32,llamacpp-f32",
}


def sizes(workload: str, c: int, scale: float) -> dict[str, Any]:
    """Workload size for concurrency ``c`` (enough requests to keep ``c`` busy, bounded)."""
    n = max(8, min(64, 4 * c))
    n = max(2, int(n * scale))
    if workload == "shared_system":  # ~8 requests per system prompt (4 prompts at most)
        return {"requests": n, "systems": max(1, min(4, n // 8))}
    if workload == "few_shot":
        return {"requests": n}
    if workload == "multi_turn":  # c conversations in flight, 4 turns each
        return {"conversations": max(2, c)}
    if workload == "tree":
        return {"programs": max(1, min(16, c) if scale >= 1 else max(1, int(c * scale)))}
    raise ValueError(workload)


def build_workload(name: str, tok: Any, c: int, salt: int, args: argparse.Namespace) -> wl.Workload:
    kw = sizes(name, c, args.scale)
    if args.max_tokens:
        kw["max_tokens"] = args.max_tokens
    if name == "shared_system" and args.system_tokens:
        kw["system_tokens"] = args.system_tokens
    return wl.build(name, tok, seed=args.seed, salt=salt, **kw)


# ----------------------------------------------------------------------------- one cell
def run_http_cell(
    spec: servers.PeerSpec,
    srv: servers.ServerProcess,
    model_name: str,
    workload: str,
    tok: Any,
    c: int,
    salt: int,
    args: argparse.Namespace,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    cfg = ReplayConfig(
        srv.base_url,
        model_name,
        mode=spec.mode,
        extra_body=spec.extra_body,
        include_usage=spec.include_usage,
        timeout_s=args.cell_timeout,
    )
    srv.reset_window()
    if workload == "tree":
        return _tree_cell(spec, srv, model_name, tok, c, salt, args)
    w = build_workload(workload, tok, c, salt, args)
    try:
        per_session, wall = asyncio.run(
            asyncio.wait_for(replay(cfg, w.sessions, c, tok), args.cell_timeout)
        )
    except TimeoutError:
        return {"error": f"cell timed out after {args.cell_timeout:.0f} s"}, []
    flat = [r for s in per_session for r in s]
    res = summarize(flat, wall)
    res.update(
        optimal_hit_rate=w.optimal_hit_rate(1),
        optimal_hit_rate_page16=w.optimal_hit_rate(16),
        optimal_hit_rate_peer=w.optimal_hit_rate(spec.page_size),
        page_size=spec.page_size,
        peak_rss_bytes=srv.window_peak_rss,
        workload=w.summary(16),
    )
    res["sample_outputs"] = [r.text[:200] for r in flat[:2]]
    return res, [to_json(r) for r in flat]


def _tree_cell(
    spec: servers.PeerSpec,
    srv: servers.ServerProcess,
    model_name: str,
    tok: Any,
    c: int,
    salt: int,
    args: argparse.Namespace,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from peers.dsl_tree import OpenAIBackend, run_tree

    backend = OpenAIBackend(
        srv.base_url,
        model_name,
        tok,
        chat_template=tok.chat_template,
        mode=spec.mode,
        extra_body=spec.extra_body,
        include_usage=spec.include_usage,
        timeout_s=args.cell_timeout,
    )
    try:
        programs = sizes("tree", c, args.scale)["programs"]
        states, wall = run_tree(backend, programs, c, salt=salt)
    finally:
        backend.close()
    calls = sorted(backend.calls, key=lambda x: x["start"])
    flat = [
        RequestResult(
            ttft=x["ttft"],
            e2e=x["e2e"],
            itl=x["itl"],
            prompt_tokens=x["prompt_tokens"],
            completion_tokens=x["completion_tokens"],
            cached_tokens=x["cached_tokens"],
            text="",
            finish_reason=None,
            error=x["error"],
            start=x["start"],
        )
        for x in calls
    ]
    res = summarize(flat, wall)
    prompts = [x["prompt_ids"] for x in calls]
    cacheable = [x["prompt_ids"] + x["answer_ids"] for x in calls]
    res.update(
        optimal_hit_rate=wl.optimal_hit_rate(prompts, 1, cacheable),
        optimal_hit_rate_page16=wl.optimal_hit_rate(prompts, 16, cacheable),
        optimal_hit_rate_peer=wl.optimal_hit_rate(prompts, spec.page_size, cacheable),
        page_size=spec.page_size,
        peak_rss_bytes=srv.window_peak_rss,
        programs=len(states),
        program_errors=sum(1 for s in states if s.error is not None),
        workload={
            "name": "tree",
            "programs": len(states),
            "calls": len(calls),
            "prompt_tokens": sum(len(p) for p in prompts),
        },
    )
    res["sample_outputs"] = (
        [str(states[0]["verdict"])[:200]] if states and states[0].error is None else []
    )
    return res, [to_json(r) for r in flat]


def run_inproc_cell(
    spec: servers.PeerSpec,
    model_dir: Path,
    workload: str,
    tok: Any,
    c: int,
    salt: int,
    args: argparse.Namespace,
    log: Path,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """transformers' generate_batch in its venv: all requests at once, ``c`` per batch."""
    if workload == "tree":
        return {
            "error": "not run: the DSL tree needs a server (generate_batch is offline, one call)"
        }, []
    w = build_workload(workload, tok, c, salt, args)
    reqs = w.requests
    with tempfile.TemporaryDirectory() as td:
        inp, out = Path(td) / "in.json", Path(td) / "out.json"
        inp.write_text(
            json.dumps(
                {
                    "model": str(model_dir),
                    "prompts": [list(r.prompt_ids) for r in reqs],
                    "max_tokens": [r.max_tokens for r in reqs],
                    "max_batch": c,
                    "page_size": 16,
                    "ignore_eos": True,
                    "threads": servers.THREADS,
                    "warmup_prompt": list(reqs[0].prompt_ids[:32]),
                }
            )
        )
        py = servers._venv_python("transformers")
        runner = Path(__file__).resolve().parent / "peers" / "hf_cb_runner.py"
        env = servers.peer_env({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(servers.THREADS)})
        with open(log, "ab") as lf:
            try:
                proc = subprocess.run(
                    [py, str(runner), str(inp), str(out)],
                    env=env,
                    stdout=lf,
                    stderr=subprocess.STDOUT,
                    cwd=td,
                    timeout=args.cell_timeout + 120,
                )
            except subprocess.TimeoutExpired:
                return {"error": f"cell timed out after {args.cell_timeout:.0f} s"}, []
        if proc.returncode != 0 or not out.exists():
            return {"error": f"generate_batch runner failed (rc {proc.returncode}); see {log}"}, []
        data = json.loads(out.read_text())
    flat = []
    for r, o in zip(reqs, data["results"]):
        text = tok.decode(o["output_ids"], skip_special_tokens=True)  # as the servers detokenize
        flat.append(
            RequestResult(
                ttft=o["ttft"] or data["wall_s"],
                e2e=o["e2e"] or data["wall_s"],
                itl=o["itl"],
                prompt_tokens=len(r.prompt_ids),
                completion_tokens=len(o["output_ids"]),
                cached_tokens=None,
                text=text,
                finish_reason=None,
                error=o["error"],
            )
        )
    res = summarize(flat, data["wall_s"])
    res.update(
        optimal_hit_rate=w.optimal_hit_rate(1),
        optimal_hit_rate_page16=w.optimal_hit_rate(16),
        optimal_hit_rate_peer=w.optimal_hit_rate(spec.page_size),
        page_size=spec.page_size,
        peak_rss_bytes=data["peak_rss"],
        workload=w.summary(16),
        offline=True,
        versions={"transformers": data["transformers"], "torch": data["torch"]},
    )
    res["sample_outputs"] = [x.text[:200] for x in flat[:2]]
    return res, [to_json(x) for x in flat]


# ----------------------------------------------------------------------------- main loop
def warmup_and_probe(
    spec: servers.PeerSpec, srv: servers.ServerProcess, model_name: str, tok: Any
) -> dict[str, Any]:
    """One short greedy request (the probe every peer answers: outputs are compared)."""
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
    ]
    req = wl.Request(tuple(msgs), wl.render(tok, msgs), 32)
    cfg = ReplayConfig(
        srv.base_url, model_name, mode=spec.mode, extra_body={}, include_usage=spec.include_usage
    )
    out, _ = asyncio.run(replay(cfg, [[req]], 1, tok))
    r = out[0][0]
    return {
        "text": r.text,
        "error": r.error,
        "completion_tokens": r.completion_tokens,
        "prompt_tokens": r.prompt_tokens,
        "sent_prompt_tokens": len(req.prompt_ids),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", required=True, choices=[*wl.WORKLOADS, "tree"])
    ap.add_argument(
        "--peers", default=None, help=f"comma-separated, from: {', '.join(servers.PEERS)}"
    )
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels")
    ap.add_argument(
        "--peer-concurrency",
        action="append",
        default=[],
        metavar="PEER=C1,C2",
        help="run PEER only at these levels (slow peers; repeatable)",
    )
    ap.add_argument(
        "--reps", type=int, default=1, help="repetitions (peer order rotates each time)"
    )
    ap.add_argument(
        "--scale", type=float, default=1.0, help="shrink the workloads (e.g. 0.25 for a smoke run)"
    )
    ap.add_argument(
        "--max-tokens", type=int, default=None, help="override the workload's answer length"
    )
    ap.add_argument(
        "--system-tokens", type=int, default=None, help="shared_system: system prompt length"
    )
    ap.add_argument("--kv-gib", type=float, default=2.0, help="KV cache budget per peer (GiB)")
    ap.add_argument("--max-ctx", type=int, default=2048, help="context length per sequence")
    ap.add_argument("--cell-timeout", type=float, default=300.0, help="seconds per measured cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a local HF dir"
    )
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from transformers import AutoTokenizer

    from radixserve.model_store import resolve_model

    model_dir = resolve_model(None if args.model == "default" else args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    peers = [
        servers.peer_spec(p) for p in (args.peers or DEFAULT_PEERS[args.workload]).split(",") if p
    ]
    levels = [int(x) for x in args.concurrency.split(",") if x]
    only = {
        k: [int(x) for x in v.split(",")]
        for k, v in (item.split("=", 1) for item in args.peer_concurrency)
    }
    max_running = max(levels)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"peers_{args.workload}{('_' + args.tag) if args.tag else ''}"
    out_path, raw_path = out_dir / f"{stem}.json", out_dir / f"{stem}_raw.json"
    log_dir = servers.PEERS_ROOT / "logs"  # server logs stay out of the repository
    doc: dict[str, Any] = {
        "benchmark": "bench_peers",
        "workload": args.workload,
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": sys.version.split()[0],
            "load_avg_at_start": os.getloadavg(),
        },
        "model": str(model_dir),
        "args": vars(args),
        "peers": {
            p.name: {"label": p.label, "precision": p.precision, "note": p.note} for p in peers
        },
        "cells": [],
        "probes": {},
        "startup_s": {},
    }
    raw: dict[str, Any] = {}

    def save() -> None:
        out_path.write_text(json.dumps(doc, indent=1))
        raw_path.write_text(json.dumps(raw))

    for rep in range(args.reps):
        order = peers[rep % len(peers) :] + peers[: rep % len(peers)]
        for spec in order:
            log = log_dir / f"{spec.name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            srv = None
            try:
                if spec.kind == "http":
                    port = servers.free_port()
                    cmd, env = servers.command(
                        spec, model_dir, port, args.kv_gib, args.max_ctx, max_running
                    )
                    t0 = time.perf_counter()
                    srv = servers.ServerProcess(cmd, env, port, log, spec.ready_path)
                    srv.wait_ready(spec.startup_timeout_s)
                    doc["startup_s"].setdefault(spec.name, []).append(time.perf_counter() - t0)
                    model_name = str(model_dir) if spec.name == "transformers-serve" else "smollm2"
                    probe = warmup_and_probe(spec, srv, model_name, tok)
                    doc["probes"].setdefault(spec.name, probe)
                    print(
                        f"[{spec.name}] up in {doc['startup_s'][spec.name][-1]:.0f} s; probe: {probe['text']!r}",
                        flush=True,
                    )
                for c in [c for c in levels if c in only.get(spec.name, levels)]:
                    salt = (args.seed * 7919 + rep * 1009 + c * 31) % 100000
                    load = os.getloadavg()[0]
                    if spec.kind == "http":
                        res, recs = run_http_cell(
                            spec, srv, model_name, args.workload, tok, c, salt, args
                        )
                    else:
                        res, recs = run_inproc_cell(
                            spec, model_dir, args.workload, tok, c, salt, args, log
                        )
                    res.update(
                        peer=spec.name,
                        label=spec.label,
                        precision=spec.precision,
                        concurrency=c,
                        rep=rep,
                        salt=salt,
                        load_avg_before=load,
                    )
                    doc["cells"].append(res)
                    raw[f"{spec.name}/c{c}/rep{rep}"] = recs
                    save()
                    _print_cell(res)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run gets its reason recorded
                msg = f"{type(exc).__name__}: {exc}"
                print(f"[{spec.name}] FAILED: {msg}", flush=True)
                doc.setdefault("failures", {}).setdefault(spec.name, []).append(msg)
                save()
            finally:
                if srv is not None:
                    srv.stop()
    save()
    print(f"wrote {out_path} and {raw_path}")
    return 0


def _print_cell(r: dict[str, Any]) -> None:
    if "error" in r and "output_tok_per_s" not in r:
        print(f"  {r['peer']:20s} c={r['concurrency']:<3d} ERROR {r['error']}", flush=True)
        return
    hit = "n/a" if r.get("hit_rate") is None else f"{r['hit_rate']:.3f}"
    print(
        f"  {r['peer']:20s} c={r['concurrency']:<3d} out {r['output_tok_per_s']:7.1f} tok/s  total "
        f"{r['total_tok_per_s']:8.1f} tok/s  TTFT p50/p90 {r['ttft_ms']['p50']:7.0f}/{r['ttft_ms']['p90']:7.0f} ms  "
        f"ITL p50 {r['itl_ms']['p50']:6.1f} ms  hit {hit} (opt {r['optimal_hit_rate_peer']:.3f})  "
        f"RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB  err {r['errors']}  load {r['load_avg_before']:.1f}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
