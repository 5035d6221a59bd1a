"""Serving the gateway app with uvicorn: in the foreground (``radixserve gateway``) or from
a background thread next to the router (``radixserve serve --http-port``).

The listening socket is bound (and listening) before uvicorn starts, so the real port is
known at once (``port=0`` picks a free one) and early clients wait in the backlog.

The loop is uvloop's where it is installed (a dependency on Linux and macOS) and uvicorn
parses HTTP with httptools: with one SSE event per token per stream, the pure-Python event
loop and parser were a large share of the gateway's CPU, which on a small CPU host runs on
the cores the model computes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from radixserve.serving.http.app import create_app
from radixserve.serving.http.gateway import GatewayConfig


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when ``host`` has a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed, else asyncio's default."""
    if importlib.util.find_spec("uvloop") is None:  # e.g. on Windows
        return asyncio.new_event_loop()
    import uvloop

    return uvloop.new_event_loop()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: it would re-raise SIGTERM after a graceful
    shutdown (exit status -15); the owner installs handlers that call :meth:`HTTPGateway.stop`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(frozen=True)
class TLSFiles:
    """The server's TLS key and certificate chain, PEM files (vLLM's ``--ssl-keyfile`` and
    ``--ssl-certfile``): the gateway then speaks HTTPS only."""

    keyfile: str
    certfile: str


class HTTPGateway:
    """The HTTP gateway for the router at ``config.router``, on ``host:port``."""

    def __init__(
        self,
        config: GatewayConfig,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        tokenizer: Any = None,
        log_level: str = "warning",
        access_log: bool = False,
        tls: TLSFiles | None = None,
    ) -> None:
        self.config = config
        self.app = create_app(config, tokenizer)
        self.sock = bind(host, port)
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        self.tls = tls
        self.server = _Server(
            uvicorn.Config(
                self.app,
                log_level=log_level.lower(),
                access_log=access_log,
                lifespan="on",
                timeout_graceful_shutdown=5,
                timeout_keep_alive=30,
                ssl_keyfile=None if tls is None else tls.keyfile,
                ssl_certfile=None if tls is None else tls.certfile,
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'http' if self.tls is None else 'https'}://{host}:{self.port}"

    def run(self) -> None:
        """Serve in this thread until :meth:`stop` (e.g. from a signal handler)."""
        try:
            with asyncio.Runner(loop_factory=new_event_loop) as runner:
                runner.run(self.server.serve(sockets=[self.sock]))
        finally:
            self.sock.close()

    def start(self, timeout_s: float = 30.0) -> HTTPGateway:
        """Serve from a daemon thread; return once uvicorn has started."""
        self._thread = threading.Thread(target=self.run, name="radixserve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:  # start-up of our own server, not test synchronization
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP gateway failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP gateway did not start within {timeout_s:.0f} s")
            time.sleep(0.01)
        return self

    def request_stop(self, *_: object) -> None:
        """Ask uvicorn to exit (open streams get a short grace period); safe in a signal handler."""
        self.server.should_exit = True

    def stop(self) -> None:
        """:meth:`request_stop`, then join the serving thread (when :meth:`start` made one)."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(15.0)
            self._thread = None
