"""A local ``mooncake_master`` for a single-host trial (``radixserve serve``) and for tests.

The master is Mooncake Store's object index; with ``--enable_http_metadata_server`` it is
also the transfer engine's metadata server, so one process is the whole control plane.
Prefill/decode disaggregation does not need it (its transfer engines meet by P2P
handshake); the Mooncake L3 store does. In a cluster the master is a service of its own,
given by address (docs/disaggregation.md); here it listens on loopback only, on free ports.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["LocalMaster", "free_ports", "master_program"]


def master_program() -> Path:
    """The ``mooncake_master`` program of the installed wheel (``ImportError`` without it)."""
    import mooncake

    return Path(mooncake.__file__).parent / "mooncake_master"


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (free when asked; the master binds them next)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until ``port`` accepts a connection (connect retries paced by waiting on the process)."""
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


def _die_with_parent() -> None:
    """In the child, before exec: the kernel kills the master when its parent dies (a
    ``serve`` that ends by ``os._exit`` or a crash leaves no master behind)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LocalMaster:
    """A master (RPC + HTTP metadata) on free loopback ports, its output in ``log``; stopped
    (and reaped) by :meth:`stop`. :attr:`config` holds the store-config fields that point
    at it (``master_server_address``, ``metadata_server``, ``local_hostname``, ``protocol``)."""

    def __init__(
        self, log: Path, timeout_s: float = 30.0, *, die_with_parent: bool = False
    ) -> None:
        rpc, http, metrics = free_ports(3)
        argv = [
            str(master_program()),
            f"--rpc_port={rpc}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics}",
        ]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if die_with_parent else None,
            )
        try:
            _wait_listening(rpc, self.proc, timeout_s)
            _wait_listening(http, self.proc, timeout_s)
        except BaseException:
            self.stop()
            raise
        self.config: dict[str, Any] = {
            "master_server_address": f"127.0.0.1:{rpc}",
            "metadata_server": f"http://127.0.0.1:{http}/metadata",
            "local_hostname": "127.0.0.1",
            "protocol": "tcp",
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def __enter__(self) -> LocalMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
