"""Node 1 of a two-node tensor-parallel launch, for the tests that run one on loopback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from radixserve.model.parallel import listen_socket


@contextmanager
def node_one(model: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``radixserve worker --tp 2 --nnodes 2 --node-rank 1`` for ``model`` (one rank,
    the other node's ``args`` appended) on a free loopback port; yield the ``dist_init_addr``
    that node 0 must use and the process. The process is killed if it is still running at
    exit (a test that expects it to end waits for it)."""
    sock = listen_socket("127.0.0.1", 0)
    addr = f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    node1 = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "worker", "--model", str(model)]
        + ["--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr]
        + list(args),
        stdin=subprocess.DEVNULL,
    )
    try:
        yield addr, node1
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(timeout=10)
