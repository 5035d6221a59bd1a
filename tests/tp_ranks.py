"""Two tensor-parallel ranks spawned for a test, and their results collected from a queue."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import pytest
import torch.multiprocessing as mp

from radixserve.model.parallel import listen_socket


def run_two_ranks(
    target: Callable[..., None],
    args: tuple[Any, ...],
    results: int,
    meanwhile: Callable[[], Any] | None = None,
) -> tuple[list[tuple[str, Any]], Any]:
    """Spawn ``target(rank, port, *args, out)`` for ranks 0 and 1 on a free loopback port, run
    ``meanwhile()`` here while they work, then take ``results`` ``(name, value)`` pairs from
    their queue. Returns (the pairs, what ``meanwhile`` returned). Fails the test when the
    ranks give no result or exit non-zero; kills any rank still alive at the end."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    sock = listen_socket("127.0.0.1", 0)  # held by the parent: no race for the port
    port = sock.getsockname()[1]
    sock.close()
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        here = meanwhile() if meanwhile is not None else None
        got = [out.get(timeout=180) for _ in range(results)]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    except queue.Empty:
        pytest.fail(f"ranks gave no result; exit codes {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return got, here
