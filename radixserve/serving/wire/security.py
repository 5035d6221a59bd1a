"""Who may talk to the router: CURVE keys, the ZAP handler, the bind policy, cache namespaces.

ZeroMQ's CURVE mechanism encrypts a connection and authenticates both ends by their
Curve25519 keys: the router's two ROUTER sockets are CURVE servers, and every worker and
client proves it holds a secret key whose public half the router lists as allowed. The
router's context runs a ZAP handler (:class:`ZapHandler`, the ZeroMQ authentication
protocol, RFC 27) that accepts a connection only when its public key is listed for that
socket's domain (``workers`` or ``clients``), and logs every decision with the peer's
address and the key's name. A worker without the right key never completes the
handshake, so it cannot send a hello, let alone receive a prompt.

Keys and key files (``radixserve keys DIR``) are :mod:`~radixserve.serving.wire.curve_keys`'
(:func:`generate_keys`, :func:`load_router_keys`, :func:`load_peer_keys`); their names are
importable from here too.

Local workers prove they are the router's own with no configuration: without operator keys
the router makes a CURVE pair for itself at start-up and mints one key per worker it starts,
handed over through the child's environment (readable only by its user, removed once read),
so a process that merely reaches the worker port cannot join (see :class:`RouterSecurity`).

Bind policy (:func:`check_bind`): ipc and loopback tcp work without operator keys (what
reaches them is this host); a tcp address reachable from other hosts is refused without keys
unless the operator says ``insecure``. Without keys the client socket stays plain, like an
HTTP port without an API key, but its privileged messages (a cache flush) are taken only from
the router's own process.

Tenancy (:func:`cache_namespace`): a request's ``cache_salt`` is hashed into its cache
namespace, so requests share cached KV only within one salt.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from radixserve.serving.wire.curve_keys import (
    DOMAINS,
    KEYS_ENV,
    Domain,
    KeyPair,
    PeerKeys,
    RouterKeys,
    generate_keys,
    load_peer_keys,
    load_router_keys,
    peer_keys_from_env,
)

# The key names stay importable from here (the router, workers, clients and CLI import them so).
__all__ = [
    "DENIAL_LOG_INTERVAL_S",
    "DOMAINS",
    "KEYS_ENV",
    "ZAP_ENDPOINT",
    "Domain",
    "HandshakeWatch",
    "InsecureBindError",
    "KeyPair",
    "Peer",
    "PeerKeys",
    "RouterKeys",
    "RouterSecurity",
    "ZapHandler",
    "cache_namespace",
    "check_bind",
    "generate_keys",
    "is_local_endpoint",
    "load_peer_keys",
    "load_router_keys",
    "log",
    "peer_keys_from_env",
    "peer_of",
    "printable",
]

log = logging.getLogger("radixserve.security")  # joins and refusals; shown at INFO by the CLI

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DENIAL_LOG_INTERVAL_S = 60.0  # a refused peer reconnects every few 100 ms: log it once a minute


class InsecureBindError(ValueError):
    """A listener reachable from other hosts was asked for without keys."""


# ---------------------------------------------------------------------------- ZAP


class ZapHandler:
    """The context's ZAP handler: accepts CURVE peers whose public key is allowed for the
    socket's domain, refuses the rest, and logs each decision with the peer's address."""

    def __init__(self, ctx: zmq.Context, keys: RouterKeys) -> None:
        self.server = keys.server
        self._allowed: dict[str, dict[bytes, str]] = {
            d: dict(keys.allowed.get(d, {})) for d in DOMAINS
        }
        self._lock = threading.Lock()
        self._denials: dict[tuple[str, str, bytes], float] = {}
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)  # fails if the context already has a handler
        self._thread = threading.Thread(target=self._run, name="radixserve-zap", daemon=True)
        self._thread.start()

    def allow(self, domain: Domain, public: bytes, name: str) -> None:
        """Accept ``public`` (Z85) on ``domain`` from now on."""
        with self._lock:
            self._allowed[domain][public] = name

    def revoke(self, domain: Domain, public: bytes) -> None:
        """Refuse ``public`` on ``domain`` from now on (connections made before stay)."""
        with self._lock:
            self._allowed[domain].pop(public, None)

    def close(self) -> None:
        """Stop the handler thread (it closes its socket: the context can then terminate)."""
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(100):
                    request = self._sock.recv_multipart()
                    try:
                        reply = self.decide(request)
                    except Exception:  # a bug refuses one connection; the handler must live on
                        log.exception(
                            "the ZAP handler failed on a request: refusing that connection"
                        )
                        reply = [
                            b"1.0",
                            request[1] if len(request) > 1 else b"",
                            b"500",
                            b"internal error",
                            b"",
                            b"",
                        ]
                    self._sock.send_multipart(reply)
        finally:
            self._sock.close()

    def decide(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one ZAP request (RFC 27 frames)."""
        if len(request) < 6:
            return [
                b"1.0",
                request[1] if len(request) > 1 else b"",
                b"400",
                b"malformed ZAP request",
                b"",
                b"",
            ]
        version, request_id, domain_b, address_b, _identity, mechanism = request[:6]
        domain, address = domain_b.decode(errors="replace"), address_b.decode(errors="replace")
        key = (
            z85.encode(request[6])
            if mechanism == b"CURVE" and len(request) == 7 and len(request[6]) == 32
            else b""
        )
        with self._lock:
            name = self._allowed.get(domain, {}).get(key) if key else None
        role = domain.rstrip("s") or "peer"
        if version != b"1.0":
            return [b"1.0", request_id, b"400", b"unsupported ZAP version", b"", b""]
        if name is None:
            self._log_denial(domain, address, key, role, mechanism)
            return [version, request_id, b"400", b"key not allowed", b"", b""]
        log.info("%s connection from %s accepted (CURVE key %r)", role, address or "?", name)
        return [version, request_id, b"200", b"OK", name.encode(), b""]

    def _log_denial(
        self, domain: str, address: str, key: bytes, role: str, mechanism: bytes
    ) -> None:
        now = time.monotonic()
        last = self._denials.get((domain, address, key))
        if last is not None and now - last < DENIAL_LOG_INTERVAL_S:
            return
        if len(self._denials) > 10_000:
            self._denials.clear()
        self._denials[(domain, address, key)] = now
        what = (
            f"unknown CURVE key {key.decode()}"
            if key
            else f"no CURVE key ({mechanism.decode(errors='replace')})"
        )
        log.warning("%s connection from %s refused: %s", role, address or "?", what)


# ---------------------------------------------------------------------------- the router's side


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc/inproc and for tcp on a loopback address (what only this host reaches)."""
    transport, sep, rest = endpoint.partition("://")
    if not sep:
        raise ValueError(f"not a ZeroMQ endpoint: {endpoint!r}")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a host name: reachable from elsewhere
        return False


def check_bind(endpoint: str, *, secured: bool, insecure: bool, what: str) -> None:
    """Refuse to listen on an address other hosts reach without keys, unless ``insecure``."""
    if secured or is_local_endpoint(endpoint):
        return
    if not insecure:
        raise InsecureBindError(
            f"refusing to bind the {what} endpoint {endpoint} without authentication: other hosts can reach it. "
            "Generate keys with 'radixserve keys DIR' and pass --keys DIR/router, or bind 127.0.0.1 / ipc://, "
            "or accept the risk with --insecure"
        )
    log.warning(
        "the %s endpoint %s is reachable from other hosts WITHOUT authentication (--insecure)",
        what,
        endpoint,
    )


class RouterSecurity:
    """The router's sockets' security.

    The worker socket is always a CURVE server. With the operator's ``keys`` it uses their
    server pair and accepts the workers they list; without them it uses a pair made for this
    router alone, so the only workers that can join are those it minted a key for (the ones
    its launcher starts, :meth:`mint`): a process that merely reaches the port (every user of
    a shared host reaches 127.0.0.1) fails the handshake and never sees a prompt. The client
    socket is a CURVE server only with ``keys``; without them it is plain, on an address
    :func:`check_bind` accepts, and its privileged messages (:meth:`trusted_client`) are
    taken only from this process's own clients."""

    def __init__(
        self, ctx: zmq.Context, keys: RouterKeys | None, *, insecure: bool = False
    ) -> None:
        self.keys = keys
        self.insecure = insecure
        # A pair of its own when the operator gave none: the workers' handshake needs one.
        self.zap = ZapHandler(ctx, keys if keys is not None else RouterKeys(KeyPair.new()))
        self.server = self.zap.server  # the operator's pair, or the one made above
        self._minted: dict[tuple[Domain, str], bytes] = {}

    @property
    def enabled(self) -> bool:
        """Whether the operator's keys secure the client socket too."""
        return self.keys is not None

    def curve(self, domain: Domain) -> bool:
        """Whether ``domain``'s socket is a CURVE server (workers: always)."""
        return domain == "workers" or self.keys is not None

    def check(self, endpoint: str, domain: Domain) -> None:
        """Raise :class:`InsecureBindError` if ``endpoint`` may not be bound for ``domain``.
        Only the operator's keys count here: a remote peer can hold no minted key."""
        check_bind(
            endpoint,
            secured=self.keys is not None,
            insecure=self.insecure,
            what="worker" if domain == "workers" else "client",
        )

    def bind(self, sock: zmq.Socket, endpoint: str, domain: Domain) -> None:
        """Bind ``sock`` at ``endpoint``: as a CURVE server where :meth:`curve` says so."""
        self.check(endpoint, domain)
        if self.curve(domain):
            # Only a CURVE socket asks the ZAP handler: on a plain one it would refuse everyone.
            sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
            sock.curve_server = True
            sock.curve_secretkey = self.server.secret
            sock.curve_publickey = self.server.public
        sock.bind(endpoint)

    def mint(self, domain: Domain, name: str) -> PeerKeys | None:
        """A fresh key pair allowed on ``domain`` under ``name`` (for local workers and the
        in-process gateway, which hold no key files); it replaces the key last minted under
        that name, so a restarted worker's predecessor's key stops working. ``None`` for a
        plain socket."""
        if not self.curve(domain):
            return None
        pair = KeyPair.new()
        old = self._minted.get((domain, name))
        if old is not None:
            self.zap.revoke(domain, old)
        self._minted[(domain, name)] = pair.public
        self.zap.allow(domain, pair.public, name)
        return PeerKeys(pair, self.server.public)

    def trusted_client(self, frame: zmq.Frame) -> bool:
        """Whether the client that sent ``frame`` may send privileged messages (a cache flush):
        one in this process (inproc carries no connection metadata), one of this user on an
        ipc endpoint (the kernel names the peer's uid), or, with the operator's keys, any
        client whose listed key the handshake checked. A plain tcp client never is: every
        user of the host reaches 127.0.0.1."""
        try:
            address = str(frame.get("Peer-Address"))
        except zmq.ZMQError:
            return True  # inproc: only this process reaches it
        return self.keys is not None or ipc_peer_uid(address) == os.getuid()

    def close(self) -> None:
        self.zap.close()


class HandshakeWatch:
    """Logs connections that fail a CURVE socket's handshake before its ZAP handler sees them
    (a peer with no key at all: a mechanism mismatch), which ZAP cannot log.

    Reads the socket's monitor on the owner's thread (:attr:`socket` goes in its poller,
    :meth:`on_events` when it is readable). The peer's address comes from the accepted
    connection's descriptor, read when its event is handled: a connection already closed
    by then is named by the listening endpoint only."""

    EVENTS = (
        zmq.EVENT_ACCEPTED
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )

    def __init__(self, sock: zmq.Socket, role: str) -> None:
        self.role = role
        self.socket: zmq.Socket = sock.get_monitor_socket(self.EVENTS)
        self._watched = sock
        self._last_peer: str | None = None
        self._logged: dict[str, float] = {}

    def on_events(self) -> None:
        """Handle every queued monitor event."""
        from zmq.utils.monitor import parse_monitor_message

        while self.socket.poll(0):
            event = parse_monitor_message(self.socket.recv_multipart())
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._last_peer = _peer_address(int(event["value"]))
            else:
                # Closed before its address could be read (the owner's loop was busy): named
                # by the endpoint it reached, which says nothing of where it came from.
                where = self._last_peer or (
                    f"a peer of {event['endpoint'].decode()} (gone before its address was read)"
                )
                self._log(where, int(event["value"]))

    def _log(self, where: str, code: int) -> None:
        now = time.monotonic()
        if now - self._logged.get(where, -DENIAL_LOG_INTERVAL_S) < DENIAL_LOG_INTERVAL_S:
            return
        if len(self._logged) > 10_000:
            self._logged.clear()
        self._logged[where] = now
        # Before ZAP: the peer did not complete a CURVE handshake (it offered another
        # mechanism, or left once it saw CURVE: then the value is an errno).
        detail = (
            "it offered another mechanism"
            if code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
            else f"code {code:#x}"
        )
        why = f"no CURVE key (no CURVE handshake: {detail})"
        log.warning("%s connection from %s refused: %s", self.role, where, why)

    def close(self) -> None:
        self._watched.disable_monitor()
        self.socket.close(linger=0)


def ipc_peer_uid(address: str) -> int | None:
    """The uid in an ipc connection's ``Peer-Address`` (``localhost:UID:GID:PID``, from the
    kernel's SO_PEERCRED), or ``None`` for any other address."""
    parts = address.split(":")
    if len(parts) != 4 or parts[0] != "localhost" or not parts[1].isdigit():
        return None
    return int(parts[1])


def _peer_address(fd: int) -> str | None:
    """The remote address of an accepted connection's descriptor, or ``None`` once closed."""
    import socket

    try:
        with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as sock:
            peer = sock.getpeername()
    except OSError:
        return None
    return str(peer[0]) if isinstance(peer, tuple) else None


def printable(raw: bytes) -> str:
    """A peer-chosen name for a log line: as text if plain printable ASCII, else hex (no log injection)."""
    text = raw.decode("ascii", "replace")
    return text if raw.isascii() and text.isprintable() else raw.hex()


@dataclass(frozen=True)
class Peer:
    """Where a message came from: the connection's address and its CURVE key's name."""

    address: str
    key: str | None


def peer_of(frame: zmq.Frame) -> Peer:
    """The peer of a received frame (from its ZeroMQ metadata)."""

    def prop(name: str) -> str | None:
        try:
            value = frame.get(name)
            return str(value) if value else None
        except zmq.ZMQError:  # not set on this connection (no ZAP handler, ipc)
            return None

    return Peer(prop("Peer-Address") or "local", prop("User-Id"))


# ---------------------------------------------------------------------------- tenancy


def cache_namespace(namespace: str | None, cache_salt: str | None) -> str | None:
    """The radix-cache namespace of a request: its ``namespace`` split further by a digest
    of its ``cache_salt`` (the salt itself never leaves the router)."""
    if cache_salt is None:
        return namespace
    digest = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{namespace or ''}#salt:{digest}"
