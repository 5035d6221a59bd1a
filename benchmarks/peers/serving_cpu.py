"""CPU time per streamed token of each process (and its busiest threads) of ``radixserve serve``,
and its time per output token against the weight-streaming floor.

    python benchmarks/peers/serving_cpu.py                      # 8 requests x 128 tokens, c=1
    python benchmarks/peers/serving_cpu.py --dtype bfloat16 --requests 16

Starts radixserve exactly as ``bench_peers.py`` does (HTTP gateway and router in one
process, tokenizer pool, one worker), replays the ``shared_system`` workload one request at
a time, and reads ``/proc`` CPU times (``psutil``) of every process and thread before and
after: on a machine whose cores the worker's compute threads keep busy, the router process's
CPU per token is time taken from the step. The client's (this process's, the load client of
``peers/openai_load.py``) is printed too: it runs on the same cores.

The weight-streaming floor (``benchmarks/floor.py``: the served dtype's weights read once at
the bandwidth a 512 MiB read shows, on huge pages as the worker's weights are) is sampled in
this process while the server idles, three reads before the replay and three after; the
inter-token latency's median over it is the model runner's "within 1.2x of the floor,
through HTTP" target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Before torch: radixserve sets the process's OpenMP wait policy (see bench_runner_step.py).
import radixserve  # noqa: E402, F401

# isort: split

import psutil  # noqa: E402
import torch  # noqa: E402
import workloads as wl  # noqa: E402
from floor import checkpoint_weight_bytes, read_gbs, read_source  # noqa: E402

from peers import servers  # noqa: E402
from peers.openai_load import ReplayConfig, replay, summarize  # noqa: E402


def _thread_times(p: psutil.Process) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in p.threads()}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="also write the summary here (JSON)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from radixserve.model_store import ensure_default_model

    model_dir = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    spec = servers.peer_spec("radixserve" if args.dtype == "float32" else "radixserve-bf16")
    port = servers.free_port()
    cmd, env = servers.command(spec, model_dir, port, 2.0, 2048, 1)
    log = servers.PEERS_ROOT / "logs" / "serving_cpu.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    srv = servers.ServerProcess(cmd, env, port, log, spec.ready_path)
    try:
        srv.wait_ready(600)
        top = psutil.Process(srv.proc.pid)
        procs = [top, *top.children(recursive=True)]
        names = {p.pid: " ".join(a for a in p.cmdline()[2:4] if ":" not in a) for p in procs}
        work = wl.build(
            "shared_system",
            tok,
            salt=4242,
            requests=args.requests,
            system_tokens=500,
            max_tokens=args.max_tokens,
        )
        cfg = ReplayConfig(srv.base_url, "smollm2", extra_body=spec.extra_body)
        # As many threads as the worker computes on: the floor's read takes them while it idles.
        torch.set_num_threads(servers.THREADS)
        src = read_source()
        reads = [read_gbs(src) for _ in range(3)]
        before = {p.pid: _thread_times(p) for p in procs}
        client0 = psutil.Process().cpu_times()
        results, wall = asyncio.run(replay(cfg, work.sessions, 1, tok))
        client1 = psutil.Process().cpu_times()
        after = {p.pid: _thread_times(p) for p in procs}
        reads += [read_gbs(src) for _ in range(3)]
        del src
    finally:
        srv.stop()
    stats = summarize([r for session in results for r in session], wall)
    tokens = stats["output_tokens"]
    gbs = sorted(reads)[len(reads) // 2]
    nbytes = checkpoint_weight_bytes(model_dir, getattr(torch, args.dtype))
    floor_ms = nbytes / gbs / 1e6
    summary: dict[str, object] = {
        "dtype": args.dtype,
        "output_tokens": tokens,
        "itl_p50_ms": round(stats["itl_ms"]["p50"], 2),
        "weight_bytes": nbytes,
        "read_gbs": [round(g, 1) for g in reads],
        "floor_ms": round(floor_ms, 2),
        "itl_over_floor": round(stats["itl_ms"]["p50"] / floor_ms, 3),
        "processes": [],
    }
    for p in procs:
        spent = sorted(
            (after[p.pid].get(tid, t0) - t0 for tid, t0 in before[p.pid].items()), reverse=True
        )
        row = {
            "command": names[p.pid],
            "ms_per_token": round(sum(spent) / tokens * 1e3, 3),
            "busiest_threads_ms_per_token": [round(s / tokens * 1e3, 3) for s in spent[:4]],
        }
        summary["processes"].append(row)  # type: ignore[union-attr]
        print(
            f"{row['command']:40s} {row['ms_per_token']:8.3f} ms/token  threads {row['busiest_threads_ms_per_token']}"
        )
    client_ms = (client1.user + client1.system - client0.user - client0.system) / tokens * 1e3
    summary["client_ms_per_token"] = round(client_ms, 3)
    print(f"{'client (this process)':40s} {client_ms:8.3f} ms/token")
    print(f"{tokens} tokens, ITL p50 {summary['itl_p50_ms']} ms")
    print(
        f"weight-streaming floor {floor_ms:.1f} ms ({nbytes / 1e6:.0f} MB at {gbs:.1f} GB/s, the "
        f"median of {len(reads)} reads around the replay): ITL p50 {summary['itl_over_floor']}x"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
