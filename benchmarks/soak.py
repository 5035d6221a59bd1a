"""Soak: a long run of mixed, partly hostile HTTP traffic against ``radixserve serve``.

Not a CI test: it takes minutes. It starts ``radixserve serve --workers 2 --http-port 0``
(the default model unless ``--model``) as a subprocess, as a user would, and sends
``--requests`` requests (1000 at ``--scale 1``) at ``--concurrency`` 32:

* chat and completion requests, most streamed (SSE), with shared system prompts;
* a quarter of all requests (``--disconnect-share`` of the streamed ones) hang up after
  their first chunk;
* oversize bodies (over ``--max-request-bytes``: 413), prompts over the character limit,
  malformed JSON, lone surrogates (``"\\udc80"``) and invalid parameters (all 400);
* worker 0 is killed (SIGKILL) at 1/3 of the run and again at 2/3 (once it is back): the
  server reaps it and starts it again (``--restart-workers``, the default).

It reports every request's outcome (the JSON holds one record per request; the table
counts them by kind and outcome), each worker's KV accounting once the server is idle at
the end (no page may be in use), the server's invariant check, and the resident memory of
the router (the ``serve`` process), its tokenizer processes and its workers before the
traffic and after it. ``--scale 0.3`` runs 300 requests.

    python benchmarks/soak.py                      # ~5-10 min on a 2-core CPU VM
    python benchmarks/soak.py --scale 0.2          # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

TOPICS = ["astronomy", "cooking", "chess", "sailing", "compilers", "jazz", "origami", "volcanoes"]
KINDS = {  # kind -> share of the requests
    "chat_stream": 0.40,
    "completion_stream": 0.12,
    "chat": 0.12,
    "generate": 0.10,
    "oversize": 0.06,
    "too_long": 0.05,
    "malformed_json": 0.05,
    "surrogate": 0.05,
    "bad_params": 0.05,
}


def rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` (``None`` when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return None
    return None


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the workers and tokenizer processes of ``serve``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    out.append(int(entry))
            except (FileNotFoundError, IndexError, ValueError):
                continue
    return sorted(out)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def memory(serve_pid: int) -> dict[str, Any]:
    """RSS of the router process, its tokenizer processes and its workers."""
    procs = children(serve_pid)
    return {
        "router": rss_bytes(serve_pid),
        "tokenizers": {pid: rss_bytes(pid) for pid in procs if "tokenizer_pool" in cmdline(pid)},
        "workers": {pid: rss_bytes(pid) for pid in procs if "serving.worker" in cmdline(pid)},
    }


class Server:
    """``radixserve serve`` in a subprocess; its output is echoed to a log file and scanned."""

    def __init__(self, args: argparse.Namespace, log_path: Path) -> None:
        cmd = [
            sys.executable,
            "-m",
            "radixserve",
            "serve",
            "--model",
            args.model,
            "--workers",
            "2",
            "--port",
            "0",
            "--http-port",
            "0",
            "--max-request-bytes",
            str(args.max_request_bytes),
            "--log-level",
            "WARNING",
            "--memory-log-interval",
            "0",
            *args.engine_flags.split(),
        ]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", RADIXSERVE_DEBUG_INVARIANTS="1"),
        )
        self.url = ""
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.write(line)
                self.log.flush()
                self.lines.append(line)
                m = re.search(r"HTTP on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(600) or not self.url:
            self.stop()
            raise RuntimeError("the server did not start; see " + str(log_path))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def chat_body(rng: random.Random, stream: bool, max_tokens: int) -> dict[str, Any]:
    topic = rng.choice(TOPICS)
    system = f"You are a patient expert on {topic}. " * 6
    return {
        "model": "default",
        "stream": stream,
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": rng.randrange(1 << 30),
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {rng.randrange(10_000)} about {topic}?"},
        ],
    }


async def one(
    c: httpx.AsyncClient,
    i: int,
    kind: str,
    args: argparse.Namespace,
    rng: random.Random,
    ctx_chars: int,
) -> dict[str, Any]:
    """Send request ``i`` of ``kind``; return its record (kind, HTTP status, outcome, seconds)."""
    rec: dict[str, Any] = {"i": i, "kind": kind}
    t0 = time.monotonic()
    disconnect = kind.endswith("_stream") and rng.random() < args.disconnect_share
    rec["disconnect"] = disconnect
    try:
        if kind in ("chat_stream", "completion_stream"):
            if kind == "chat_stream":
                path, body = "/v1/chat/completions", chat_body(rng, True, args.max_tokens)
            else:
                path, body = (
                    "/v1/completions",
                    {
                        "model": "default",
                        "prompt": f"Once upon a time in {rng.choice(TOPICS)},",
                        "max_tokens": args.max_tokens,
                        "stream": True,
                    },
                )
            async with c.stream("POST", path, json=body) as r:
                rec["status"] = r.status_code
                if r.status_code != 200:
                    rec["outcome"] = f"http_{r.status_code}"
                    await r.aread()
                    rec["error"] = r.text[:200]
                else:
                    chunks, err = 0, None
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        data = json.loads(line[6:])
                        if "error" in data:
                            err = data["error"].get("code") or data["error"].get("type")
                            break
                        chunks += 1
                        if disconnect:
                            break  # leaving the block closes the connection: the client hangs up
                    rec["chunks"] = chunks
                    rec["outcome"] = (
                        "disconnected"
                        if disconnect and err is None
                        else (f"stream_error_{err}" if err else "ok")
                    )
        elif kind in ("chat", "generate"):
            if kind == "chat":
                r = await c.post(
                    "/v1/chat/completions", json=chat_body(rng, False, args.max_tokens)
                )
            else:
                r = await c.post(
                    "/generate",
                    json={
                        "text": f"The {rng.choice(TOPICS)} club met on",
                        "sampling_params": {"max_new_tokens": args.max_tokens},
                    },
                )
            rec["status"] = r.status_code
            rec["outcome"] = "ok" if r.status_code == 200 else f"http_{r.status_code}"
            if r.status_code != 200:
                rec["error"] = r.text[:200]
        else:
            if kind == "oversize":
                content = json.dumps(
                    {
                        "model": "default",
                        "messages": [
                            {
                                "role": "user",
                                "content": "hello world " * (args.max_request_bytes // 12 + 1000),
                            }
                        ],
                    }
                ).encode()
            elif kind == "too_long":  # under the byte limit, over the context's character limit
                content = json.dumps(
                    {"model": "default", "prompt": "z" * (ctx_chars + 10), "max_tokens": 2}
                ).encode()
            elif kind == "malformed_json":
                content = (
                    b'{"model": "default", "messages": [{"role": "user", "content": "unterminated'
                )
            elif kind == "surrogate":
                content = (
                    b'{"model": "default", "max_tokens": 2, "messages": [{"role": "user", '
                    b'"content": "bad \\udc80 text"}]}'
                )
            else:
                content = json.dumps(
                    {
                        "model": "default",
                        "max_tokens": -5,
                        "temperature": 9.0,
                        "messages": [{"role": "user", "content": "hi"}],
                    }
                ).encode()
            path = "/v1/completions" if kind == "too_long" else "/v1/chat/completions"
            r = await c.post(path, content=content, headers={"content-type": "application/json"})
            rec["status"] = r.status_code
            expected = 413 if kind == "oversize" else 400
            rec["outcome"] = "refused" if r.status_code == expected else f"http_{r.status_code}"
            if r.status_code != expected:
                rec["error"] = r.text[:200]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec["outcome"] = f"client_error_{type(exc).__name__}"
        rec["error"] = str(exc)[:200]
    rec["seconds"] = round(time.monotonic() - t0, 3)
    return rec


async def drive(
    url: str,
    args: argparse.Namespace,
    kinds: list[str],
    serve_pid: int,
    kills: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    # Each request draws from its own generator seeded by its index (see run()), so a run
    # replays the same requests whatever order they complete in.
    limits = httpx.Limits(
        max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency
    )
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        info = (await c.get("/get_model_info")).json()
        ctx_chars = info["context_length"] * 16
        sem = asyncio.Semaphore(args.concurrency)
        done = 0
        kill_at = {len(kinds) // 3, 2 * len(kinds) // 3}
        killing: list[asyncio.Task[None]] = []

        async def run(i: int, kind: str) -> dict[str, Any]:
            nonlocal done
            async with sem:
                rec = await one(c, i, kind, args, random.Random(args.seed * 100_003 + i), ctx_chars)
            done += 1
            if done in kill_at:
                kill_at.discard(done)
                killing.append(asyncio.create_task(kill_a_worker(c, serve_pid, kills)))
            if done % 100 == 0:
                print(f"  {done}/{len(kinds)} requests done", flush=True)
            return rec

        records = list(await asyncio.gather(*(run(i, k) for i, k in enumerate(kinds))))
        await asyncio.gather(*killing)
        return records


async def kill_a_worker(c: httpx.AsyncClient, serve_pid: int, kills: list[dict[str, Any]]) -> None:
    """SIGKILL worker 0, once it is up (again): the same worker is killed twice in a run."""
    deadline = time.monotonic() + 300
    while True:
        info = (await c.get("/get_server_info")).json()
        victim = next(
            (w for w in info["workers"] if w["worker_id"] == 0 and w["alive"] and w.get("pid")),
            None,
        )
        if victim is not None or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)  # polling the server's state while it restarts the worker
    if victim is None:
        print("  worker 0 did not come back within 300 s: no second kill", flush=True)
        return
    os.kill(victim["pid"], signal.SIGKILL)
    kills.append(
        {
            "worker_id": victim["worker_id"],
            "pid": victim["pid"],
            "inflight": victim["inflight"],
            "at": time.time(),
        }
    )
    print(
        f"  killed worker {victim['worker_id']} (pid {victim['pid']}, {victim['inflight']} in flight)",
        flush=True,
    )


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, Any]:
    """Server info once no request runs and every worker is back and idle."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=60) as c:
        while True:
            info = c.get("/get_server_info").json()
            alive = [w for w in info["workers"] if w["alive"]]
            if (
                info["active"] == 0
                and len(alive) == 2
                and all(
                    w["engine"].get("running") == 0 and w["engine"].get("waiting") == 0
                    for w in alive
                )
            ):
                return info
            if time.monotonic() > deadline:
                return info
            time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="default")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 1000 requests")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument(
        "--disconnect-share",
        type=float,
        default=0.48,
        help="share of the streamed requests that hang up after their first chunk "
        "(0.48 of the 52%% that stream: 25%% of all requests)",
    )
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--max-request-bytes", type=int, default=1 << 20)
    ap.add_argument(
        "--engine-flags", default="--num-threads 1", help="extra engine options for each worker"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n = max(10, round(args.requests * args.scale))
    rng = random.Random(args.seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=n)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M")
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    out = Path(args.out) if args.out else results / f"soak-{stamp}.json"
    print(
        f"soak: {n} requests at concurrency {args.concurrency}; server log in {out.with_suffix('.log')}",
        flush=True,
    )
    srv = Server(args, out.with_suffix(".log"))
    kills: list[dict[str, Any]] = []
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:  # warm-up: one request per worker
            for _ in range(2):
                c.post(
                    "/v1/completions",
                    json={"model": "default", "prompt": "warm up", "max_tokens": 2},
                )
        before = memory(srv.proc.pid)
        t0 = time.monotonic()
        records = asyncio.run(drive(srv.url, args, kinds, srv.proc.pid, kills))
        elapsed = time.monotonic() - t0
        idle = wait_idle(srv.url)
        after = memory(srv.proc.pid)
    finally:
        code = srv.stop()
    outcomes = Counter((r["kind"], r["outcome"]) for r in records)
    kv = [
        {
            "worker_id": w["worker_id"],
            "pid": w["pid"],
            "alive": w["alive"],
            "death": w.get("death"),
            **{
                k: w["engine"].get(k)
                for k in (
                    "num_pages",
                    "pages_free",
                    "pages_evictable",
                    "pages_in_use",
                    "running",
                    "waiting",
                    "invariants",
                )
            },
        }
        for w in idle["workers"]
    ]
    restarts = [
        line.strip() for line in srv.lines if "restarted (pid" in line or "exited after" in line
    ]
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "args": vars(args),
        "requests": n,
        "elapsed_s": round(elapsed, 1),
        "outcomes": {f"{k} {o}": v for (k, o), v in sorted(outcomes.items())},
        "kills": kills,
        "supervisor_log": restarts,
        "kv_at_end": kv,
        "server_idle": {k: idle[k] for k in ("active", "requests", "aborted", "errors")},
        "memory_before": before,
        "memory_after": after,
        "serve_exit_code": code,
        "records": records,
    }
    out.write_text(json.dumps(report, indent=1))
    print(
        f"\n{n} requests in {elapsed:.0f} s ({n / elapsed:.1f}/s), concurrency {args.concurrency}"
    )
    print(f"{'kind':<20}{'outcome':<34}{'count':>6}")
    for (k, o), v in sorted(outcomes.items()):
        print(f"{k:<20}{o:<34}{v:>6}")
    print(
        "\nworker kills:",
        ", ".join(
            f"worker {k['worker_id']} pid {k['pid']} ({k['inflight']} in flight)" for k in kills
        ),
    )
    for line in restarts:
        print("  " + line)
    print("\nKV at the end (idle):")
    for w in kv:
        print(
            f"  worker {w['worker_id']} pid {w['pid']} alive={w['alive']}: pages in use {w['pages_in_use']}, "
            f"free {w['pages_free']}, evictable {w['pages_evictable']} of {w['num_pages']}; "
            f"running {w['running']}, waiting {w['waiting']}; invariants {w['invariants']}"
        )

    def mib(x: int | None) -> str:
        return "-" if x is None else f"{x / 2**20:.0f} MiB"

    print("\nmemory (RSS) before -> after:")
    print(f"  router      {mib(before['router'])} -> {mib(after['router'])}")
    for name in ("tokenizers", "workers"):
        print(
            f"  {name:<11} {', '.join(mib(v) for v in before[name].values())} -> "
            f"{', '.join(mib(v) for v in after[name].values())}"
        )
    print(f"\nserve exit code {code}; JSON: {out}")
    bad = [
        r
        for r in records
        if r["outcome"].startswith(("client_error", "http_5")) and r["outcome"] != "http_503"
    ]
    in_use = sum(w["pages_in_use"] or 0 for w in kv if w["alive"])
    return 1 if in_use or code != 0 else 0 if not bad else 2


if __name__ == "__main__":
    sys.exit(main())
