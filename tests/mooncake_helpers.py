"""A real ``mooncake_master`` on 127.0.0.1 for the Mooncake store tests, and a worker process
that runs an Engine against it.

The master runs its built-in HTTP metadata server, so one process is the whole control
plane. Tests skip (saying why) where the Mooncake wheel is not importable: it needs
``libibverbs.so.1`` (Debian: ``apt-get install libibverbs1``) even for tcp.
"""

from __future__ import annotations

import socket
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


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Until ``port`` accepts a connection (connect retries are the wait: no sleeps)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            try:  # paces the retries, and notices the master dying meanwhile
                proc.wait(0.05)
            except subprocess.TimeoutExpired:
                pass
    raise RuntimeError(f"mooncake_master did not listen on {port}")


class Master(NamedTuple):
    proc: subprocess.Popen[bytes]
    config: dict[str, Any]  # MooncakeStoreConfig fields pointing at this master


@contextmanager
def run_master(log: Path) -> Iterator[Master]:
    """A master (RPC + HTTP metadata) on free loopback ports; stopped (and reaped) on exit."""
    exe = mooncake_or_skip()
    rpc, http, metrics = _free_ports(3)
    argv = [
        str(exe),
        f"--rpc_port={rpc}",
        "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={metrics}",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_listening(rpc, proc)
        _wait_listening(http, proc)
        yield Master(
            proc,
            {
                "master_server_address": f"127.0.0.1:{rpc}",
                "metadata_server": f"http://127.0.0.1:{http}/metadata",
                "local_hostname": "127.0.0.1",
                "protocol": "tcp",
                "global_segment_size": "32mb",
                "local_buffer_size": "16mb",
                "timeout_s": 2.0,
                "close_timeout_s": 2.0,
            },
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


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
