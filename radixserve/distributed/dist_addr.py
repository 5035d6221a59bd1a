"""The tensor-parallel rendezvous address (``--dist-init-addr HOST:PORT``): parsing and the
wildcard check (no torch here: the engine config validates with it)."""

from __future__ import annotations

__all__ = ["WILDCARDS", "check_dist_addr", "split_addr"]

WILDCARDS = ("0.0.0.0", "::", "", "*")


def split_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` / ``[V6]:PORT`` -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def check_dist_addr(addr: str | None, insecure: bool) -> None:
    """Refuse a wildcard rendezvous address unless ``insecure``: torch.distributed's store and
    collectives are unauthenticated, and a wildcard exposes them on every interface."""
    if addr is None:
        return
    host, _ = split_addr(addr)
    if host in WILDCARDS and not insecure:
        raise ValueError(
            f"--dist-init-addr {addr} listens on every interface; torch.distributed's rendezvous "
            "and collectives are unauthenticated: give this host's address on a private network, "
            "or pass --insecure (see docs/security.md)"
        )
