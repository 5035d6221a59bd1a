"""Helpers of the HTTP tests: server subprocesses with readable output, and polling the server."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# The API keys of the agent_server fixture: two tenants.
AGENT_KEYS = ("tenant-a-key", "tenant-b-key")
TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"

# A pool of 512 pages of 4 tokens: a 2048-token context, so a long stream can be cut mid-way.
ENGINE_FLAGS = [
    "--num-pages",
    "512",
    "--page-size",
    "4",
    "--max-num-tokens",
    "256",
    "--num-threads",
    "1",
]


@dataclass
class Proc:
    """A subprocess whose merged stdout/stderr lines are collected without blocking."""

    proc: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        """The first line (from now on) matching ``pattern``; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m
            if self.proc.poll() is not None and self.lines.empty():
                break
        raise AssertionError(f"no line matching {pattern!r}; output so far:\n{''.join(self.seen)}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in time (then the test fails)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(
                    f"process {self.proc.pid} ignored SIGTERM for {timeout} s"
                ) from None
        return self.proc.returncode


def start(args: list[str]) -> Proc:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    return Proc(proc)


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@dataclass
class Server:
    """The running server: its HTTP base URL, router endpoint, model directory and output."""

    url: str
    endpoint: str
    model_dir: Path
    out: Proc
    worker_pids: list[int]

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60.0), **kw)


def wait_idle(c: httpx.Client, timeout: float = 30.0) -> dict[str, Any]:
    """Poll /get_server_info until no request runs and no KV page is in use (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        info = c.get("/get_server_info").json()
        engines = [w["engine"] for w in info["workers"] if w["alive"]]
        if info["active"] == 0 and all(
            e["running"] == 0 and e["waiting"] == 0 and e["pages_in_use"] == 0 for e in engines
        ):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {info}")
        time.sleep(0.05)


def serve(model: Path, *extra: str) -> Server:
    out = start(
        ["serve", "--model", str(model), "--workers", "1", "--port", "0", "--http-port", "0"]
        + ["--memory-log-interval", "0", *ENGINE_FLAGS, *extra]
    )
    try:  # a loaded 2-core machine can take minutes to start a server
        url = out.wait_for(r"HTTP on (http://\S+)", timeout=400).group(1)
        m = out.wait_for(r"serving on (tcp://\S+) .*worker pids (\d+)", timeout=60)
    except BaseException:
        out.stop()
        raise
    srv = Server(url, m.group(1), model, out, [int(m.group(2))])
    with srv.client() as c:
        assert c.get("/health").status_code == 200
    return srv


def stop(srv: Server) -> None:
    assert srv.out.stop() == 0, "".join(srv.out.seen)
    assert all(gone(pid) for pid in srv.worker_pids)
