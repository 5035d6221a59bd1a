"""What CURVE costs the router: plain vs CURVE-authenticated ZeroMQ sockets, same machine.

Two routers with one model-free fake worker each (``tests/serving/fake_worker.py``), one
with plain sockets on 127.0.0.1 and one with ``radixserve keys`` keys on both ports, so
that only the transport differs. Measured interleaved request by request, alternating
which goes first (this machine's speed drifts, and other jobs share its two cores): the
latency of a router round trip (``health``) and of a streamed generation (``--tokens``
tokens, one chunk per token) through router and worker; medians over all requests.

    python benchmarks/bench_curve.py                # well under a minute on 2 cores
    python benchmarks/bench_curve.py --requests 8000 --tokens 64

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "serving"))

import tiny_models  # noqa: E402

from radixserve.sampling_params import SamplingParams  # noqa: E402
from radixserve.serving.client import Client  # noqa: E402
from radixserve.serving.prompts import load_tokenizer  # noqa: E402
from radixserve.serving.router.launcher import LocalServer  # noqa: E402
from radixserve.serving.router.router import RouterConfig  # noqa: E402
from radixserve.serving.wire import protocol as p  # noqa: E402
from radixserve.serving.wire.security import (  # noqa: E402
    PeerKeys,
    generate_keys,
    load_peer_keys,
    load_router_keys,
)

FAKE_WORKER = [sys.executable, str(ROOT / "tests" / "serving" / "fake_worker.py")]


def _median_ms(samples: list[float]) -> float:
    return 1000.0 * statistics.median(samples)


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _stream(client: Client, prompt: str, tokens: int) -> None:
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    for ev in client.stream(prompt, params=params):
        if isinstance(ev, p.GenerateFinal):
            assert ev.usage.completion_tokens == tokens


def _measure(
    clients: dict[str, Client], requests: int, tokens: int
) -> dict[str, dict[str, list[float]]]:
    """Per setup: round-trip and stream latencies, each request run on every setup in turn."""
    out: dict[str, dict[str, list[float]]] = {
        name: {"roundtrip": [], "stream": []} for name in clients
    }
    names = list(clients)
    for i in range(requests):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name]["roundtrip"].append(_timed(clients[name].health))
            if i % 4 == 0:
                out[name]["stream"].append(
                    _timed(lambda: _stream(clients[name], f"request {i}", tokens))
                )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=2000,
        help="health round trips per setup (and a quarter as many streams)",
    )
    ap.add_argument("--tokens", type=int, default=16, help="tokens per streamed generation")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "curve.json"))
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = Path(tmp) / "tokenizer"
        tiny_models.build_tokenizer(tok_dir)
        tokenizer = load_tokenizer(tok_dir)
        roles = generate_keys(Path(tmp) / "keys")
        vocab = tokenizer.get_vocab()
        engine = {
            "alphabet": [vocab[c] for c in "abcdefghijklmnopqrstuvwxyz" if c in vocab],
            "vocab_size": len(tokenizer),
        }
        setups: dict[str, tuple[RouterConfig, PeerKeys | None]] = {
            "plain": (RouterConfig(endpoint="tcp://127.0.0.1:*"), None),
            "curve": (
                RouterConfig(endpoint="tcp://127.0.0.1:*", keys=load_router_keys(roles["router"])),
                load_peer_keys(roles["client"]),
            ),
        }
        servers = {
            name: LocalServer(
                tok_dir,
                num_workers=1,
                config=cfg,
                engine_config=engine,
                worker_program=FAKE_WORKER,
                tokenizer=tokenizer,
            ).start(60)
            for name, (cfg, _) in setups.items()
        }
        try:
            clients = {
                name: Client(servers[name].endpoint, timeout=30, curve=keys)
                for name, (_, keys) in setups.items()
            }
            _measure(
                clients, 20, args.tokens
            )  # warm-up: connections, handshakes, first allocations
            samples = _measure(clients, args.requests, args.tokens)
            for c in clients.values():
                c.close()
        finally:
            for srv in servers.values():
                srv.close()

    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.processor() or '?'}, python {platform.python_version()}",
        "args": vars(args),
        "median": {
            name: {f"{k}_ms": _median_ms(v) for k, v in s.items()} for name, s in samples.items()
        },
        "p90": {
            name: {f"{k}_ms": 1000.0 * statistics.quantiles(v, n=10)[-1] for k, v in s.items()}
            for name, s in samples.items()
        },
        "samples": {name: {k: len(v) for k, v in s.items()} for name, s in samples.items()},
    }
    med = result["median"]
    print(f"{'':8} {'router round trip (ms)':>24} {f'{args.tokens}-token stream (ms)':>24}")
    for name in setups:
        print(f"{name:8} {med[name]['roundtrip_ms']:24.3f} {med[name]['stream_ms']:24.3f}")
    print(
        f"{'ratio':8} {med['curve']['roundtrip_ms'] / med['plain']['roundtrip_ms']:24.2f} "
        f"{med['curve']['stream_ms'] / med['plain']['stream_ms']:24.2f}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
