"""The first request after "serving" against a second one of the same shape, through HTTP.

Each start is a fresh ``radixserve serve --http-port`` (one worker, the command
``bench_peers.py`` runs, ``peers/servers.py``): wait until ``/health`` answers, send one
streamed ``/v1/completions`` request of ``--prompt-tokens`` token ids and ``--max-tokens``
greedy tokens, then a second one of the same shape (other token ids: nothing of the first
is in the prefix cache), and compare their times to first token. The target is a ratio of
at most 2 on every start: "ready" has to mean that everything a first request needs is warm
(prefill shapes, sampler, detokenizer, tokenizer pool, the HTTP path).

    python benchmarks/bench_first_request.py                          # 3 starts x 2 prompt lengths
    python benchmarks/bench_first_request.py --starts 5 --prompt-tokens 20 100 500 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # `workloads`, `peers` as top-level modules

import workloads as wl  # noqa: E402
from peers import servers  # noqa: E402
from peers.openai_load import ReplayConfig, RequestResult, replay  # noqa: E402

_WORDS = (
    "the river city market morning light people walked along old streets while children "
    "played near a small garden and the baker opened his shop to sell fresh bread before "
    "rain came over hills where farmers worked long days with their animals in quiet fields"
).split()


def text_prompt(tok: Any, rng: random.Random, n: int) -> list[int]:
    """``n`` token ids of English-like text (a real continuation streams text from its first
    token; random ids may start with tokens that decode to nothing, delaying the first chunk)."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(" ".join(rng.choice(_WORDS) for _ in range(n)), add_special_tokens=False)
    return ids[:n]


def one_request(base_url: str, prompt: list[int], max_tokens: int, tok: Any) -> RequestResult:
    cfg = ReplayConfig(base_url, "smollm2", extra_body={"ignore_eos": True})
    req = wl.Request((), tuple(prompt), max_tokens)
    out, _ = asyncio.run(replay(cfg, [[req]], 1, tok))
    r = out[0][0]
    if r.error:
        raise RuntimeError(r.error)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--starts", type=int, default=3, help="fresh servers per prompt length")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[40, 300])
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", default="benchmarks/results/bench_first_request.json")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    from radixserve.model_store import resolve_model

    model_dir = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    spec = servers.peer_spec("radixserve-bf16" if args.dtype == "bfloat16" else "radixserve")
    rng = random.Random(0)
    log = servers.PEERS_ROOT / "logs" / "bench_first_request.log"
    runs: list[dict[str, Any]] = []
    for n in args.prompt_tokens:
        for start in range(args.starts):
            port = servers.free_port()
            cmd, env = servers.command(spec, model_dir, port, 0.5, 2048, 16)
            t0 = time.perf_counter()
            with servers.ServerProcess(cmd, env, port, log, spec.ready_path) as srv:
                srv.wait_ready(spec.startup_timeout_s)
                ready_s = time.perf_counter() - t0
                prompts = [text_prompt(tok, rng, n) for _ in range(2)]
                first, second = (
                    one_request(srv.base_url, p, args.max_tokens, tok) for p in prompts
                )
            ratio = first.ttft / second.ttft
            runs.append(
                {
                    "prompt_tokens": n,
                    "start": start,
                    "ready_s": ready_s,
                    "ttft_first_ms": first.ttft * 1e3,
                    "ttft_second_ms": second.ttft * 1e3,
                    "ratio": ratio,
                    "e2e_first_ms": first.e2e * 1e3,
                    "e2e_second_ms": second.e2e * 1e3,
                }
            )
            print(
                f"prompt {n:4d} start {start}: ready in {ready_s:5.1f} s; TTFT first {first.ttft * 1e3:7.1f} ms, "
                f"second {second.ttft * 1e3:7.1f} ms ({ratio:.2f}x)",
                flush=True,
            )
    ratios = [r["ratio"] for r in runs]
    print(
        f"first/second TTFT over {len(runs)} fresh starts: median {statistics.median(ratios):.2f}x, "
        f"worst {max(ratios):.2f}x (target <= 2x)"
    )
    out = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "dtype": args.dtype,
        "load_avg_at_end": os.getloadavg(),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
