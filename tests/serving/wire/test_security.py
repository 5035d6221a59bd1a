"""CURVE on the router's ports, the bind policy, join auditing, and cache salts through the router.

The attack of issue 18: a process connects a DEALER to the worker port and says hello as
a worker. Without keys (the control test, on loopback where that is the documented trust
model) it joins and is sent work; with keys it never completes the handshake and receives
nothing, while workers and clients with the right keys are served.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path
from typing import Any

import pytest
import zmq
from foreign_peers import received, say_hello, wait_until
from zmq.utils import z85

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client
from radixserve.serving.router.launcher import stop_processes
from radixserve.serving.router.router import Router, RouterConfig
from radixserve.serving.router.worker_pool import spawn_worker, worker_command
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire.security import (
    InsecureBindError,
    KeyPair,
    PeerKeys,
    RouterKeys,
    ZapHandler,
    cache_namespace,
    check_bind,
    generate_keys,
    is_local_endpoint,
    load_peer_keys,
    load_router_keys,
    printable,
)

# ---------------------------------------------------------------------------- units


def test_local_endpoints() -> None:
    for ep in (
        "ipc:///tmp/x.sock",
        "inproc://a",
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.2:*",
        "tcp://localhost:1",
        "tcp://[::1]:5555",
    ):
        assert is_local_endpoint(ep), ep
    for ep in (
        "tcp://0.0.0.0:5555",
        "tcp://*:5555",
        "tcp://10.1.2.3:5555",
        "tcp://eth0:5555",
        "tcp://[::]:1",
        "ws://127.0.0.1:1",
    ):
        assert not is_local_endpoint(ep), ep
    check_bind("tcp://0.0.0.0:1", secured=True, insecure=False, what="worker")
    check_bind("tcp://0.0.0.0:1", secured=False, insecure=True, what="worker")
    with pytest.raises(InsecureBindError, match="--insecure"):
        check_bind("tcp://0.0.0.0:1", secured=False, insecure=False, what="worker")


def test_generated_key_files(tmp_path: Path) -> None:
    roles = generate_keys(tmp_path / "keys")
    router = load_router_keys(roles["router"])
    worker, client = load_peer_keys(roles["worker"]), load_peer_keys(roles["client"])
    assert worker.server_public == client.server_public == router.server.public
    assert router.allowed["workers"] == {worker.own.public: "worker"}
    assert router.allowed["clients"] == {client.own.public: "client"}
    secrets = sorted(tmp_path.rglob("*.key_secret"))
    assert [s.name for s in secrets] == [
        "client.key_secret",
        "router.key_secret",
        "worker.key_secret",
    ]
    assert all(stat.S_IMODE(s.stat().st_mode) == 0o600 for s in secrets)
    assert not list(
        roles["router"].glob("*.key")
    )  # the router's public key lives with its peers only
    with pytest.raises(FileExistsError):
        generate_keys(tmp_path / "keys")
    generate_keys(tmp_path / "keys", force=True)
    assert load_router_keys(roles["router"]).server.public != router.server.public


def test_cache_namespace_hides_the_salt() -> None:
    assert cache_namespace(None, None) is None and cache_namespace("ns", None) == "ns"
    a = cache_namespace(None, "tenant-secret")
    assert a is not None and "tenant-secret" not in a
    assert a == cache_namespace(None, "tenant-secret") != cache_namespace(None, "other")
    assert cache_namespace("ns", "tenant-secret") not in (a, "ns")


def test_zap_decisions(zctx: zmq.Context) -> None:
    worker = KeyPair.new()
    zap = ZapHandler(
        zctx, RouterKeys(KeyPair.new(), {"workers": {worker.public: "gpu-1"}, "clients": {}})
    )
    try:
        raw = z85.decode(worker.public)
        assert zap.decide([b"1.0", b"7", b"workers", b"10.0.0.1", b"", b"CURVE", raw]) == [
            b"1.0",
            b"7",
            b"200",
            b"OK",
            b"gpu-1",
            b"",
        ]
        refused = [
            [
                b"1.0",
                b"8",
                b"clients",
                b"10.0.0.1",
                b"",
                b"CURVE",
                raw,
            ],  # a worker key on the client port
            [
                b"1.0",
                b"9",
                b"workers",
                b"10.0.0.1",
                b"",
                b"CURVE",
                z85.decode(KeyPair.new().public),
            ],
            [b"1.0", b"10", b"workers", b"10.0.0.1", b"", b"NULL"],
            [b"1.0", b"11", b"workers", b"10.0.0.1", b"", b"CURVE", b"short"],
            [b"2.0", b"12", b"workers", b"10.0.0.1", b"", b"CURVE", raw],
            [b"1.0"],
        ]
        for request in refused:
            assert zap.decide(request)[2] == b"400", request
    finally:
        zap.close()


def test_peer_chosen_names_cannot_forge_log_lines() -> None:
    assert printable(b"w0-123-ab12") == "w0-123-ab12"
    assert printable(b"w0\nINFO worker 9 joined") == b"w0\nINFO worker 9 joined".hex()
    assert printable("é".encode()) == "é".encode().hex()


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:*", "tcp://*:*"])
def test_router_refuses_a_public_bind_without_keys(
    tokenizer: Any, endpoint: str, tmp_path: Path
) -> None:
    def refused(config: RouterConfig) -> bool:
        try:
            router = Router(tokenizer, config)
        except InsecureBindError:
            return True
        router.close()  # bound after all: close it, or its context would hang the test's exit
        return False

    for field in ("endpoint", "worker_endpoint"):
        assert refused(RouterConfig(**{"endpoint": "tcp://127.0.0.1:*", field: endpoint}))
    insecure = Router(
        tokenizer,
        RouterConfig(endpoint="tcp://127.0.0.1:*", worker_endpoint=endpoint, insecure=True),
    )
    insecure.close()
    roles = generate_keys(tmp_path / "keys")
    keyed = Router(
        tokenizer,
        RouterConfig(
            endpoint=endpoint, worker_endpoint=endpoint, keys=load_router_keys(roles["router"])
        ),
    )
    assert keyed.security.enabled
    keyed.close()


# ---------------------------------------------------------------------------- over real sockets


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    return generate_keys(tmp_path / "keys")


SECRET = "the secret prompt of a user"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_fake_worker_without_the_key_cannot_join(
    fake_server: Any,
    tokenizer: Any,
    keys: dict[str, Path],
    zctx: zmq.Context,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.security")
    router_keys = load_router_keys(keys["router"])
    srv = fake_server(num_workers=1, router=dict(keys=router_keys, routing="round_robin"))
    no_key = zctx.socket(zmq.DEALER)
    wrong_key = zctx.socket(zmq.DEALER)
    PeerKeys(KeyPair.new(), router_keys.server.public).apply(
        wrong_key
    )  # knows the router, not allowed
    client_as_worker = zctx.socket(zmq.DEALER)
    load_peer_keys(keys["client"]).apply(client_as_worker)  # a client key is no worker key
    fakes = [no_key, wrong_key, client_as_worker]
    say_hello(srv, tokenizer, fakes)

    def refused() -> list[str]:
        return [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]

    assert wait_until(lambda: len(refused()) >= 2), (
        refused()
    )  # both keyed fakes got to the ZAP check
    assert any(
        "worker connection from 127.0.0.1 refused: unknown CURVE key" in m for m in refused()
    ), refused()
    with Client(srv.endpoint, timeout=20, curve=load_peer_keys(keys["client"])) as c:
        outs = [c.generate(SECRET, params=SamplingParams(max_tokens=2)) for _ in range(4)]
        assert c.health().workers_alive == 1
    assert {o.worker_id for o in outs} == {0} and all(o.usage.completion_tokens == 2 for o in outs)
    assert received(fakes, 0.5) == []  # five ping intervals: not even a ping
    assert [w.hello.pid for w in srv.router.live_workers] == [srv.procs[0].pid]
    joins = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert len(joins) == 1 and "address 127.0.0.1, key local-worker-0" in joins[0], joins


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_clients_need_the_client_key(fake_server: Any, keys: dict[str, Path]) -> None:
    srv = fake_server(num_workers=1, router=dict(keys=load_router_keys(keys["router"])))
    with Client(srv.endpoint, timeout=20, curve=load_peer_keys(keys["client"])) as c:
        out = c.generate("hello", params=SamplingParams(max_tokens=3))
        assert out.usage.completion_tokens == 3
    for curve in (
        None,
        load_peer_keys(keys["worker"]),
    ):  # no key; a worker's key on the client port
        with Client(srv.endpoint, timeout=1.0, curve=curve) as c, pytest.raises(TimeoutError):
            c.health()
    from frontend_dsl.remote_backend import RemoteBackend  # the DSL's client takes the same keys

    backend = RemoteBackend(srv.endpoint, timeout=20, curve=load_peer_keys(keys["client"]))
    try:
        assert backend.health().ok and backend.tokenize(["hello"])[0]
    finally:
        backend.close()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_remote_worker_with_the_key_joins_and_serves(
    fake_server: Any,
    fake_worker_cmd: list[str],
    tokenizer_dir: Path,
    tokenizer: Any,
    alphabet: list[int],
    keys: dict[str, Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.security")
    srv = fake_server(num_workers=0, router=dict(keys=load_router_keys(keys["router"])))
    cmd = worker_command(
        srv.router.worker_endpoint,
        7,
        tokenizer_dir,
        {"alphabet": alphabet, "vocab_size": len(tokenizer)},
        program=fake_worker_cmd,
    ) + ["--keys", str(keys["worker"])]
    proc = spawn_worker(cmd)
    try:
        assert wait_until(lambda: len(srv.router.live_workers) == 1, 30), (
            "the keyed remote worker did not join"
        )
        with Client(srv.endpoint, timeout=20, curve=load_peer_keys(keys["client"])) as c:
            assert c.generate("hi there", params=SamplingParams(max_tokens=2)).worker_id == 7
        joins = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
        assert any(
            f"pid {proc.pid}" in m and "key worker" in m and "127.0.0.1" in m for m in joins
        ), joins
    finally:
        srv.close()
        stop_processes([proc])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_cache_salt_separates_caches_and_routing(fake_server: Any, tokenizer: Any) -> None:
    """Same salt: cached and routed to the worker that holds the prefix; another salt: neither."""
    srv = fake_server(num_workers=2)
    prompt = tokenizer.encode("A long shared system prompt for the salted tenants. " * 3)
    params = SamplingParams(max_tokens=1)
    with Client(srv.endpoint, timeout=20) as c:
        first = c.generate(input_ids=prompt, params=params, cache_salt="tenant-a")
        again = c.generate(input_ids=prompt, params=params, cache_salt="tenant-a")
        assert again.worker_id == first.worker_id and again.usage.cached_tokens > 0
        other = c.generate(input_ids=prompt, params=params, cache_salt="tenant-b")
        # Tenant b matches nothing in the router's tries: it goes to the emptier worker, uncached.
        assert other.worker_id != first.worker_id and other.usage.cached_tokens == 0
        # The router's tries hold the salted prefixes under their tenants' sentinels only.
        assert all(t.match(prompt) == 0 for t in srv.router.dispatcher.tries.values())
        assert (
            c.generate(input_ids=prompt, params=params).usage.cached_tokens == 0
        )  # no salt: shared cache
        with pytest.raises(Exception, match="cache_salt"):
            c.generate(
                input_ids=prompt, params=params, cache_salt="x" * (p.MAX_CACHE_SALT_CHARS + 1)
            )
