"""``radixserve serve`` / ``radixserve client`` as a user runs them: real processes, clean exits."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# ``python -m radixserve.cli`` would run the registry module twice (as __main__ and as itself).
CLI = [sys.executable, "-c", "import sys; from radixserve.cli import main; sys.exit(main())"]
ENGINE_FLAGS = [
    "--num-pages",
    "128",
    "--page-size",
    "4",
    "--max-num-tokens",
    "128",
    "--num-threads",
    "1",
]


class Serve:
    """A ``radixserve serve`` subprocess whose stdout lines are read without blocking."""

    def __init__(
        self, model: Path, workers: int, extra: tuple[str, ...] = (), session: bool = False
    ) -> None:
        """``session``: in a process group of its own (with its workers and tokenizer
        processes), which a test can signal as one."""
        cmd = [
            *CLI,
            "serve",
            "--model",
            str(model),
            "--workers",
            str(workers),
            "--port",
            "0",
            *ENGINE_FLAGS,
            *extra,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=session,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.transcript: list[str] = []  # every line, read by wait_for or not
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.transcript.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 90.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line matching {pattern!r}; got:\n{''.join(seen)}")

    def kill(self) -> None:
        """Kill serve if it still runs; print what it said (pytest shows it when a test fails)."""
        print("".join(self.transcript))
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _gone(pid: int, timeout: float) -> bool:
    """True once ``pid`` no longer exists (or is a zombie awaiting its reaper)."""
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


def test_serve_client_and_clean_shutdown(tiny_llama_dir: Path) -> None:
    srv = Serve(tiny_llama_dir, workers=2)
    try:
        m = srv.wait_for(r"serving on (tcp://\S+) .*worker pids (\d+) (\d+)")
        endpoint, pids = m.group(1), [int(m.group(2)), int(m.group(3))]
        demo = subprocess.run(
            [*CLI, "client", "--endpoint", endpoint, "Hello", "--max-tokens", "4"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert demo.returncode == 0, demo.stderr
        assert "[length] prompt" in demo.stderr or "[stop] prompt" in demo.stderr
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
        srv.wait_for(r"radixserve: stopped", timeout=5)
        assert all(_gone(pid, 5) for pid in pids), "worker processes outlived serve"
    finally:
        srv.kill()


def test_sigterm_stops_serve_quickly_mid_stream(tiny_llama_dir: Path) -> None:
    """SIGTERM while a request streams (HTTP gateway on too): serve exits 0 within a few
    seconds, the client gets a shutdown error, and serve reaped its worker before exiting."""
    from radixserve.sampling_params import SamplingParams
    from radixserve.serving.client import Client, ServerError
    from radixserve.serving.wire import protocol as p

    # 512 pages of 4 tokens: room for a stream far longer than the test.
    srv = Serve(tiny_llama_dir, workers=1, extra=("--http-port", "0", "--num-pages", "512"))
    try:
        # Start-up says where its time went: the worker's phases, then the total.
        srv.wait_for(r"worker \S+ engine ready in [0-9.]+ s")
        m = srv.wait_for(r"serving on (tcp://\S+) .*worker pids (\d+)\); start-up took [0-9.]+ s")
        endpoint, worker_pid = m.group(1), int(m.group(2))
        with Client(endpoint, timeout=30) as client:
            events = client.stream("Hello", params=SamplingParams(max_tokens=2000, ignore_eos=True))
            assert isinstance(next(events), p.GenerateChunk)
            start = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            try:
                rc = srv.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                raise AssertionError("serve did not exit within 5 s of SIGTERM") from None
            elapsed = time.monotonic() - start
            with pytest.raises(ServerError) as exc:
                for _ in events:
                    pass
            assert exc.value.code == "shutdown"
        assert rc == 0
        srv.wait_for(r"radixserve: stopped", timeout=5)
        # serve waits for its workers before it exits: no orphan, not even a zombie, is left.
        assert not os.path.exists(f"/proc/{worker_pid}"), "the worker outlived serve"
        print(f"serve exited {elapsed:.2f} s after SIGTERM")
    finally:
        srv.kill()


def test_a_server_stopped_and_continued_keeps_its_workers(tiny_llama_dir: Path) -> None:
    """The whole server stopped (SIGSTOP to its process group: a job scheduler's pause, a
    suspended VM), then continued; the request sent at once is served, by the same worker
    process, after each pause:

    - 4 s, past ``--worker-timeout`` (1 s), within the connections' zmq heartbeats: the
      router did not run either, so it excuses the workers' silence instead of declaring
      them dead on its first liveness turn;
    - 12 s, past the heartbeats too: the worker's connection drops and it reconnects under
      the same routing id, which takes over the router's stale connection (ROUTER_HANDOVER)
      instead of being refused until that times out (60 s); the router may give the worker
      up meanwhile, and an idle worker given up speaks up to be asked to join again
      (tests/serving/worker/test_worker_liveness.py). A request that finds no live worker
      in that moment waits for it (its process still runs: WorkerPool.awaited), not 503; one
      that crossed the worker's new hello is sent again under a fresh rid, not refused by its
      engine as a duplicate (tests/serving/router/test_inflight_retry.py)."""
    from radixserve.sampling_params import SamplingParams
    from radixserve.serving.client import Client

    srv = Serve(tiny_llama_dir, workers=1, extra=("--worker-timeout", "1"), session=True)
    try:
        m = srv.wait_for(r"serving on (tcp://\S+) .*worker pids (\d+)\)")
        endpoint, worker_pid = m.group(1), int(m.group(2))
        with Client(endpoint, timeout=30) as client:
            assert client.generate("Hello", params=SamplingParams(max_tokens=2)).worker_id == 0
            os.killpg(srv.proc.pid, signal.SIGSTOP)
            time.sleep(4.0)  # the pause under test: four liveness turns, four worker timeouts
            os.killpg(srv.proc.pid, signal.SIGCONT)
            out = client.generate("Hello again", params=SamplingParams(max_tokens=2))
            assert out.worker_id == 0 and out.finish_reason in ("length", "stop")
            assert "no heartbeat" not in "".join(srv.transcript)
            os.killpg(srv.proc.pid, signal.SIGSTOP)
            time.sleep(12.0)  # the pause under test: past the 10 s zmq heartbeat timeout
            os.killpg(srv.proc.pid, signal.SIGCONT)
            out = client.generate("Hello at last", params=SamplingParams(max_tokens=2))
            assert out.worker_id == 0 and out.finish_reason in ("length", "stop")
        assert os.path.exists(f"/proc/{worker_pid}"), "the worker was replaced"
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
        srv.wait_for(r"radixserve: stopped", timeout=5)
        text = "".join(srv.transcript)
        assert "workers' silence in it excused" in text and "no heartbeat" not in text, text
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGCONT)
        srv.kill()


def test_workers_die_with_a_killed_parent() -> None:
    """SIGKILL the process that owns the workers: they must exit on their own (PR_SET_PDEATHSIG).

    Uses the model-free fake worker, so it costs no model start-up."""
    here = Path(__file__).resolve().parent
    code = (
        "import sys; from radixserve.serving.router.launcher import LocalServer\n"
        "from radixserve.serving.router.router import RouterConfig\n"
        "srv = LocalServer('unused', num_workers=2, tokenizer=object(), "
        f"worker_program=[sys.executable, {str(here / 'fake_worker.py')!r}],"
        " config=RouterConfig(endpoint='tcp://127.0.0.1:*'))\n"
        "srv.wait_ready(60)\n"
        "print('worker pids', *[p.pid for p in srv.procs], flush=True)\n"
        "srv.router.run()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pids = [int(x) for x in re.findall(r"\d+", line)]
        assert len(pids) == 2, line
        os.kill(proc.pid, signal.SIGKILL)  # no chance to shut anything down
        proc.wait(10)
        assert all(_gone(pid, 15) for pid in pids), "a worker survived its parent"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_sglangs_and_vllms_flag_names_carry_over() -> None:
    """A launch command written for SGLang or vLLM sets the same engine fields here."""
    from radixserve.cli import build_parser
    from radixserve.commands.engine_args import engine_config

    sglang = ["--context-length", "512", "--mem-fraction-static", "0.5"]
    sglang += ["--chunked-prefill-size", "64", "--random-seed", "3", "--tp-size", "1"]
    vllm = ["--max-model-len", "512", "--gpu-memory-utilization", "0.5"]
    vllm += ["--max-num-batched-tokens", "64", "--seed", "3", "--max-num-seqs", "8"]
    want = dict(max_model_len=512, memory_utilization=0.5, max_num_tokens=64, seed=3)
    parser = build_parser()
    assert engine_config(parser.parse_args(["serve", *sglang])) == {
        **want,
        "tensor_parallel_size": 1,
    }
    assert engine_config(parser.parse_args(["serve", *vllm])) == {
        **want,
        "max_running_requests": 8,
    }
