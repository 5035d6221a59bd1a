"""CURVE key pairs and the key files that hold them (``radixserve keys DIR``).

Layout written by :func:`generate_keys`, in pyzmq's certificate format::

    DIR/router/router.key_secret      the router's key pair        -> radixserve serve --keys DIR/router
    DIR/router/workers/NAME.key       public keys of allowed workers
    DIR/router/clients/NAME.key       public keys of allowed clients
    DIR/worker/worker.key_secret      a worker's key pair          -> radixserve worker --keys DIR/worker
    DIR/worker/router.key             the router's public key
    DIR/client/client.key_secret      a client's key pair          -> radixserve client/gateway --keys DIR/client
    DIR/client/router.key

A local worker gets a pair minted for it instead, handed over through its environment
(:meth:`PeerKeys.to_env`, :func:`peer_keys_from_env`). How the router uses the keys (the
ZAP handler, the bind policy) is :mod:`~radixserve.serving.wire.security`'s.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import zmq
import zmq.auth

Domain = Literal["workers", "clients"]
DOMAINS: tuple[Domain, ...] = ("workers", "clients")
KEYS_ENV = "RADIXSERVE_CURVE_KEYS"  # a local worker's minted keys (JSON), set by its launcher


@dataclass(frozen=True)
class KeyPair:
    """A Curve25519 key pair, both halves Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes = field(repr=False)

    @staticmethod
    def new() -> KeyPair:
        public, secret = zmq.curve_keypair()
        return KeyPair(public, secret)


@dataclass(frozen=True)
class PeerKeys:
    """What a worker or a client needs to reach a CURVE router: its own pair and the
    router's public key."""

    own: KeyPair
    server_public: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the router (call before ``connect``)."""
        sock.curve_secretkey = self.own.secret
        sock.curve_publickey = self.own.public
        sock.curve_serverkey = self.server_public

    def to_env(self) -> dict[str, str]:
        """The environment that hands these keys to a child process (:func:`peer_keys_from_env`):
        like its command line, only its user can read it, but unlike it ``ps`` does not show it."""
        keys = {
            "public": self.own.public.decode(),
            "secret": self.own.secret.decode(),
            "server": self.server_public.decode(),
        }
        return {KEYS_ENV: json.dumps(keys)}


def peer_keys_from_env() -> PeerKeys | None:
    """Keys handed over by :meth:`PeerKeys.to_env` (removed from the environment once read)."""
    raw = os.environ.pop(KEYS_ENV, None)
    if not raw:
        return None
    keys = json.loads(raw)
    return PeerKeys(
        KeyPair(keys["public"].encode(), keys["secret"].encode()), keys["server"].encode()
    )


@dataclass(frozen=True)
class RouterKeys:
    """The router's key pair and, per domain, the allowed public keys (key -> name)."""

    server: KeyPair
    allowed: dict[str, dict[bytes, str]] = field(default_factory=dict)


def _load_pair(path: Path) -> KeyPair:
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key")
    return KeyPair(public, secret)


def _load_public(path: Path) -> bytes:
    public, _ = zmq.auth.load_certificate(path)
    return public


def _one(directory: Path, pattern: str) -> Path:
    found = sorted(directory.glob(pattern))
    if len(found) != 1:
        raise ValueError(
            f"expected exactly one {pattern} in {directory}, found {[f.name for f in found] or 'none'}"
        )
    return found[0]


def load_router_keys(directory: str | Path) -> RouterKeys:
    """The router side of a key directory (``DIR/router`` as written by :func:`generate_keys`)."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"no key directory {d}")
    allowed: dict[str, dict[bytes, str]] = {
        dom: {_load_public(f): f.stem for f in sorted((d / dom).glob("*.key"))} for dom in DOMAINS
    }
    if not allowed["workers"] and not allowed["clients"]:
        raise ValueError(
            f"{d} lists no allowed keys (expected {d}/workers/*.key and {d}/clients/*.key)"
        )
    return RouterKeys(_load_pair(d / "router.key_secret"), allowed)


def load_peer_keys(directory: str | Path) -> PeerKeys:
    """A worker's or client's side of a key directory: one ``*.key_secret`` and ``router.key``."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"no key directory {d}")
    return PeerKeys(_load_pair(_one(d, "*.key_secret")), _load_public(d / "router.key"))


def _write_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """``name.key`` and ``name.key_secret`` in ``directory`` (the secret readable by its owner only)."""
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def generate_keys(directory: str | Path, *, force: bool = False) -> dict[str, Path]:
    """Write a fresh set of key files under ``directory`` (layout in the module doc);
    returns the three role directories. Refuses to overwrite existing keys unless ``force``."""
    root = Path(directory)
    roles = {role: root / role for role in ("router", "worker", "client")}
    if any(d.exists() for d in roles.values()):
        if not force:
            raise FileExistsError(f"{root} already holds keys (use --force to replace them)")
        for d in roles.values():
            shutil.rmtree(d, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    router_pub, _ = _write_pair(roles["router"], "router")
    for role, domain in (("worker", "workers"), ("client", "clients")):
        pub, _ = _write_pair(roles[role], role)
        (roles["router"] / domain).mkdir()
        pub.rename(roles["router"] / domain / pub.name)  # the router keeps the public half
        shutil.copyfile(router_pub, roles[role] / "router.key")
    router_pub.unlink()  # the peers hold copies; the router's own pair is in router.key_secret
    return roles
