"""Stopping a node's rank processes: a node whose only rank is its own process has none to
join, and must not wait (``multiprocessing.connection.wait`` on no objects sleeps the whole
timeout: node 1 of a two-node launch used to linger 30 s after its rank loop ended)."""

from __future__ import annotations

import subprocess
import sys

CODE = "from radixserve.distributed.ranks import stop_ranks; stop_ranks({}, timeout=3600.0)"


def test_no_processes_to_stop_returns_at_once() -> None:
    # A hang check, not a timing: without the fix the child sleeps the full hour and the
    # 120 s limit kills it (TimeoutExpired fails the test).
    subprocess.run([sys.executable, "-c", CODE], check=True, timeout=120)
