"""``radixserve build-kernels`` builds (or loads the cached) CPU kernels ahead of a server, and
an engine's start-up names that phase for what it did, apart from loading the weights."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-c", "import sys; from radixserve.cli import main; sys.exit(main())"]


@pytest.mark.slow  # compiles the kernels where this machine has not yet (once; cached after)
def test_build_kernels_then_a_process_finds_them_cached() -> None:
    proc = subprocess.run([*CLI, "build-kernels"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"CPU kernels (built|already built, loaded) in [0-9.]+ s: (\S+)", proc.stderr)
    assert m is not None, proc.stderr[-3000:]
    assert Path(m.group(2)).is_file()
    # The next process loads the cached library: phase "load CPU kernels", the ops registered.
    check = (
        "import torch; from radixserve.engine.cpu_kernels import build_cpu_kernels; "
        "r = build_cpu_kernels(); "
        "print(r.phase, r.ok, hasattr(torch.ops.radixserve_cpu, 'paged_attention'))"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() in (["load", "CPU", "kernels", "True", "True"],), out.stdout


def test_build_kernels_is_a_quiet_no_op_with_the_kernels_off() -> None:
    env = {**os.environ, "RADIXSERVE_CPU_KERNELS": "0"}
    proc = subprocess.run(
        [*CLI, "build-kernels"], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0
    assert "CPU kernels off (RADIXSERVE_CPU_KERNELS=0)" in proc.stderr


def test_engine_startup_names_the_kernel_phase(tiny_llama_dir: Path) -> None:
    from radixserve import Engine

    engine = Engine(str(tiny_llama_dir), num_pages=64, page_size=4, max_num_tokens=64)
    try:
        phases = list(engine.startup_seconds)
    finally:
        engine.close()
    kernel = [
        p for p in phases if p in ("build CPU kernels", "load CPU kernels", "CPU kernels off")
    ]
    assert len(kernel) == 1, phases
    assert phases.index("resolve model") < phases.index(kernel[0]) < phases.index("load weights")


@pytest.mark.slow  # a real `radixserve serve` and its worker
@pytest.mark.timeout(300)
def test_serve_startup_log_names_the_phases(tiny_llama_dir: Path) -> None:
    cmd = [*CLI, "serve", "--model", str(tiny_llama_dir), "--workers", "1", "--port", "0"]
    cmd += ["--num-pages", "64", "--page-size", "4", "--max-num-tokens", "64", "--num-threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    ready = None
    try:
        for line in proc.stdout:  # ends when serve exits; the timeout mark bounds a hang
            if "engine ready in" in line:
                ready = line
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert ready is not None, "serve printed no 'engine ready' line"
    # Phases of 50 ms or more are printed; loading the weights never hides a kernel build.
    assert "load weights" in ready, ready
    m = re.search(r"(build|load) CPU kernels [0-9.]+ s", ready)
    if m is not None:
        assert ready.index(m.group(0)) < ready.index("load weights"), ready
