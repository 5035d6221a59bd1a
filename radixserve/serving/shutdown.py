"""A server process's life past start-up: what start-up left frozen out of the garbage
collector's scans (:func:`freeze_startup_objects`); its end, with its parent
(:func:`die_with_parent`) and quickly once everything it owns is stopped (:func:`exit_now`).

A process that imported torch and transformers (a worker; the router too, through the
tokenizer) spends 0.2 s idle, and 1-5 s on a loaded 2-core machine, in interpreter
finalization: freeing hundreds of thousands of module objects one by one. Once a server
has reaped its children, closed its sockets and terminated its zmq contexts, nothing is
left that finalization would do for anyone, so its entry points end with :func:`exit_now`.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
from typing import NoReturn


def freeze_startup_objects() -> None:
    """Collect start-up's garbage, then freeze what is left (torch, transformers, the
    tokenizer, the engine: most of the process's objects, alive until it exits) out of the
    garbage collector's scans, so that a full collection never pauses the serving loop to
    walk them. Only for a process that is radixserve's alone (`serve`'s router, a worker, a
    tokenizer process): a program that embeds a router keeps its collector as it set it."""
    gc.collect()
    gc.freeze()


def exit_now(code: int) -> NoReturn:
    """Flush the log handlers and the standard streams, then ``os._exit(code)``.

    Only for a process's entry point, after a clean stop: atexit handlers and object
    finalizers do not run."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to say there
            pass
    os._exit(code)


def die_with_parent() -> None:
    """Linux: have the kernel send SIGTERM when the parent process dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the getppid check in the loop still catches it
