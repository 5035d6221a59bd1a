"""gpu_check's serve_http phase: one ``radixserve serve`` process, 64 concurrent chats over HTTP.

The server runs on a tiny random checkpoint built on the spot (its tokenizer has a chat
template), so the phase needs no model on disk; every chat shares one system prompt, so the
radix cache serves all but the first prefill of it. Chats go out from threads with the
standard library's HTTP client (no client package on the GPU machine). The server is stopped
with SIGTERM whatever happens, and its exit code is part of the result.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpu_check_phases import Ctx


class _Server:
    """``radixserve serve`` with its merged output read by a thread (lines kept for errors)."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m
            if self.proc.poll() is not None and self.lines.empty():
                break
        raise RuntimeError(f"server: no line {pattern!r}:\n{''.join(self.seen)[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return -9
        return self.proc.returncode


def _chat(url: str, system: str, user: str, max_tokens: int) -> tuple[float, int]:
    """One chat completion: its latency and completion tokens."""
    body = {
        "model": "default",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    return time.perf_counter() - t0, int(out["usage"]["completion_tokens"])


def phase_serve_http(ctx: Ctx) -> dict[str, Any]:
    import tiny_models

    model = tiny_models.build_tiny_llama(ctx.workdir / "serve_llama", head_dim=64)
    chats, max_tokens = (8, 4) if ctx.dry else (64, 32)
    args = ["serve", "--model", str(model), "--workers", "1", "--port", "0", "--http-port", "0"]
    args += ["--device", ctx.device, "--max-running-requests", str(chats)]
    if ctx.dry:
        args += ["--num-threads", "1", "--num-pages", "512"]
    server = _Server(args)
    try:
        url = server.wait_for(r"HTTP on (http://\S+)", timeout=min(180.0, ctx.time_left())).group(1)
        system = "You are a concise assistant. " * (6 if ctx.dry else 60)
        _chat(url, system, "warm up", 2)  # the first prefill of the shared prompt
        t0 = time.perf_counter()
        with ThreadPoolExecutor(chats) as pool:
            done = list(
                pool.map(lambda i: _chat(url, system, f"question {i}", max_tokens), range(chats))
            )
        wall = time.perf_counter() - t0
    finally:
        code = server.stop()
    lat = sorted(t for t, _ in done)
    tokens = sum(n for _, n in done)
    return {
        "chats": chats,
        "max_tokens": max_tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "latency_p50_s": lat[len(lat) // 2],
        "latency_max_s": lat[-1],
        "server_exit": code,
    }
