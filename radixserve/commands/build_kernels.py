"""``radixserve build-kernels``: compile the C++ CPU kernels now, not in a server's start-up.

The kernels compile once per machine and source version (g++, tens of seconds on a small
CPU) and are cached; a server that finds them cached starts in seconds. ``radixserve
fetch-model`` runs the same step after fetching the model (``--skip-kernels`` leaves it to
the first start). It runs as a command of its own, after ``pip install``, rather than
inside pip's isolated build environment, which would install a second torch to build against.
"""

from __future__ import annotations

import argparse
import sys
import time

from radixserve.cli import register


def build_with_progress(quiet: bool = False) -> bool:
    """Build or load the kernels, saying so on stderr; False where the torch paths will serve."""
    from radixserve.engine.cpu_kernels import build_cpu_kernels, is_built

    def say(msg: str) -> None:
        if not quiet:
            print(f"radixserve: {msg}", file=sys.stderr, flush=True)

    if not is_built():
        say("building the CPU kernels (g++ -O3 -march=native, once per machine and version) ...")
    start = time.perf_counter()
    result = build_cpu_kernels()
    took = time.perf_counter() - start
    if result.phase == "CPU kernels off":
        say("CPU kernels off (RADIXSERVE_CPU_KERNELS=0): the torch paths serve")
    elif not result.ok:
        say("CPU kernels unavailable (see the warning above): the torch paths serve")
    else:
        done = "built" if result.phase == "build CPU kernels" else "already built, loaded"
        say(f"CPU kernels {done} in {took:.1f} s: {result.directory}")
    return result.ok


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress output")


@register(
    "build-kernels",
    help="compile the C++ CPU kernels once (cached), so that a server's start-up does not",
    arguments=_arguments,
)
def build_kernels(args: argparse.Namespace) -> int:
    # Exit 0 even where they cannot be built: the torch paths serve, as at start-up.
    build_with_progress(args.quiet)
    return 0
