"""Where and when a benchmark ran: the fields every committed result carries (date, commit,
CPU with the flags that change the kernels' paths), written once for the scripts."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

# CPU flags that pick different kernel paths (AMX tiles, bf16 dot products, VNNI for int8).
KERNEL_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")


def machine() -> dict[str, Any]:
    """The CPU this ran on: model name, cores, the flags that change the kernels' paths."""
    name, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": name,
        "cores": os.cpu_count(),
        "flags": sorted(f for f in KERNEL_FLAGS if f in flags),
    }


def commit() -> str:
    """The checkout's short commit, with ``+dirty`` when tracked files differ from it."""
    repo = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def header(benchmark: str) -> dict[str, Any]:
    """The fields a result JSON starts with: name, UTC date, commit, machine."""
    return {
        "benchmark": benchmark,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
    }
