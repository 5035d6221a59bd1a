"""A real ``mooncake_master`` on 127.0.0.1 for the Mooncake store tests, and a worker process
that runs an Engine against it.

The master runs its built-in HTTP metadata server, so one process is the whole control
plane. Tests skip (saying why) where the Mooncake wheel is not importable: it needs
``libibverbs.so.1`` (Debian: ``apt-get install libibverbs1``) even for tcp.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import pytest


def mooncake_or_skip() -> Path:
    """The ``mooncake_master`` program; skips the test where the wheel does not load."""
    try:
        import mooncake
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        pytest.skip(
            f"the Mooncake wheel is not importable here: {e} "
            "(pip install 'radixserve[mooncake]'; Debian: apt-get install libibverbs1)"
        )
    return Path(mooncake.__file__).parent / "mooncake_master"


class Master(NamedTuple):
    proc: subprocess.Popen[bytes]
    config: dict[str, Any]  # MooncakeStoreConfig fields pointing at this master


@contextmanager
def run_master(log: Path) -> Iterator[Master]:
    """A master (RPC + HTTP metadata) on free loopback ports; stopped (and reaped) on exit
    (radixserve.distributed.mooncake_master.LocalMaster, what `serve` starts)."""
    mooncake_or_skip()
    from radixserve.distributed.mooncake_master import LocalMaster

    with LocalMaster(log) as m:
        yield Master(
            m.proc,
            {
                **m.config,
                "global_segment_size": "32mb",
                "local_buffer_size": "16mb",
                "timeout_s": 2.0,
                "close_timeout_s": 2.0,
            },
        )


def worker_main(conn: Connection, model_dir: str, engine_kw: dict[str, Any]) -> None:
    """A worker process: an Engine with the Mooncake L3; answers ("run", prompt, namespace)
        with (tokens, cached tokens, stats) and ("flush",) with "flushed" (once every write handed
    to the store so far has landed) until ("stop",)."""
    from engine_helpers import greedy, run_to_completion, tokens_of

    from radixserve.engine.engine import Engine

    engine = Engine(model_dir, **engine_kw)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "flush":  # the store's writes are asynchronous: wait until they land
            engine.cache.hierarchy.disk.flush(None)  # type: ignore[attr-defined]
            conn.send("flushed")
            continue
        _, prompt, namespace, n = msg
        rid = engine.add_request(prompt, greedy(n), namespace=namespace)
        outs = run_to_completion(engine)[rid]
        usage = outs[-1].usage
        assert usage is not None
        conn.send((tokens_of(outs), usage.cached_tokens, engine.stats()))
    engine.close()
    conn.send("closed")
