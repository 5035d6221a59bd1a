"""A server started with no flags lets in only its own processes.

Every user of a shared host reaches 127.0.0.1, so a router without operator keys still makes
its workers prove they are its children (a CURVE key minted per worker it starts), takes a
cache flush only from its own process, and its tokenizer pool takes hellos and answers only
from the processes it spawned. Each test plays the local attacker against a real server.
"""

from __future__ import annotations

import logging
import re
import signal
from typing import Any

import pytest
import zmq
from foreign_peers import received, say_hello, wait_until
from zmq.utils import z85

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client, ServerError
from radixserve.serving.router.tokenizer_pool import Encoded, PoolReady, _encoder
from radixserve.serving.wire.security import KeyPair, PeerKeys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

SECRET = "the secret prompt of a user"


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]


def test_a_foreign_worker_cannot_join_a_keyless_server(
    fake_server: Any, tokenizer: Any, zctx: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.security")
    srv = fake_server(num_workers=1, router=dict(routing="round_robin"))
    assert srv.router.worker_endpoint.startswith("tcp://127.0.0.1:")
    plain = zctx.socket(zmq.DEALER)  # what the attack used: no key at all
    # One that knows the router's public key (not a secret) but holds no minted key.
    guessing = zctx.socket(zmq.DEALER)
    PeerKeys(KeyPair.new(), srv.router.security.server.public).apply(guessing)
    fakes = [plain, guessing]
    say_hello(srv, tokenizer, fakes)
    assert wait_until(lambda: len(_refusals(caplog)) >= 2), _refusals(caplog)
    # The keyless one is named by its address, or, when it closed before the router read
    # its connection's event (a busy loop), by the endpoint it reached.
    keyless = re.compile(
        r"worker connection from (127\.0\.0\.1|a peer of tcp://127\.0\.0\.1:\d+ \(.*\)) "
        r"refused: no CURVE key"
    )
    assert any(keyless.search(m) for m in _refusals(caplog)), _refusals(caplog)
    assert any(
        "worker connection from 127.0.0.1 refused: unknown CURVE key" in m
        for m in _refusals(caplog)
    )
    with Client(srv.endpoint, timeout=20) as c:  # the client port stays open on loopback
        outs = [c.generate(SECRET, params=SamplingParams(max_tokens=2)) for _ in range(4)]
    assert {o.worker_id for o in outs} == {0}
    assert received(fakes, 0.5) == []  # five ping intervals: not a ping, not a prompt
    assert [w.hello.pid for w in srv.router.live_workers] == [srv.procs[0].pid]
    joins = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert len(joins) == 1 and "key local-worker-0" in joins[0], joins


def _zap_request(public: bytes) -> list[bytes]:
    """A ZAP request (RFC 27) for a CURVE worker connection with ``public`` (Z85)."""
    return [b"1.0", b"1", b"workers", b"127.0.0.1", b"", b"CURVE", z85.decode(public)]


def test_a_restarted_worker_rejoins_and_its_predecessors_key_is_revoked(
    fake_server: Any,
) -> None:
    srv = fake_server(num_workers=1, router=dict(restart_backoff_s=0.1))
    zap = srv.router.security.zap
    first = srv.procs[0]
    old_key = srv.router.security._minted[("workers", "local-worker-0")]
    assert zap.decide(_zap_request(old_key))[2] == b"200"
    first.send_signal(signal.SIGKILL)
    assert wait_until(
        lambda: (
            [w.hello.pid for w in srv.router.live_workers] == [srv.procs[-1].pid]
            and srv.procs[-1] is not first
        ),
        30,
    ), "the restarted worker did not rejoin"
    new_key = srv.router.security._minted[("workers", "local-worker-0")]
    assert new_key != old_key
    assert zap.decide(_zap_request(old_key))[2] == b"400"  # the dead worker's key is void
    assert zap.decide(_zap_request(new_key))[2] == b"200"
    with Client(srv.endpoint, timeout=20) as c:
        assert c.generate("after the restart", params=SamplingParams(max_tokens=2)).worker_id == 0


def test_a_cache_flush_or_a_memory_release_needs_a_client_of_the_servers_own(
    fake_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.security")
    srv = fake_server(num_workers=1)
    with Client(srv.endpoint, timeout=20) as c:
        c.generate("warm the cache", params=SamplingParams(max_tokens=2))
        with pytest.raises(ServerError) as refused:
            c.flush_cache()
        assert refused.value.code == "forbidden"
        for release in (c.release_memory_occupation, c.resume_memory_occupation):
            with pytest.raises(ServerError) as refused:
                release(["kv_cache"])
            assert refused.value.code == "forbidden"
        assert c.stats().workers[0].engine["pages_evictable"] > 0  # nothing was flushed
        assert c.health().ok  # the connection goes on serving
    assert any("cache flush from client" in m for m in _refusals(caplog))
    assert any("memory release from client" in m for m in _refusals(caplog))
    # The HTTP gateway of `serve` is such a client: in the router's process, over inproc.
    with Client(srv.router.inproc_endpoint, timeout=20, context=srv.router.context) as own:
        assert own.flush_cache()
        assert own.stats().workers[0].engine["pages_evictable"] == 0
        asked = own.release_memory_occupation()  # the fake engine keeps its memory
        assert (asked.ok, asked.released) == (False, [])
        assert asked.error == "worker 0: this worker's engine cannot release its memory"


def test_the_tokenizer_pool_takes_only_its_own_processes(
    fake_server: Any, tokenizer: Any, zctx: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="radixserve.serving.tokenizer_pool")
    srv = fake_server(num_workers=1, router=dict(tokenizer_workers=1))
    pool = srv.router.tokenizers
    assert pool is not None and pool.ready
    (real_pid,) = pool.pids
    foreign = zctx.socket(zmq.DEALER)
    foreign.setsockopt(zmq.LINGER, 0)
    foreign.connect(pool.endpoint)
    # Claims the real process's pid; then answers the next jobs with forged token ids.
    foreign.send(_encoder.encode(PoolReady(real_pid, "guessed")))
    assert wait_until(lambda: any("tokenizer-pool hello" in m for m in _refusals(caplog)))
    for job in range(4):
        foreign.send(_encoder.encode(Encoded(job, [[7, 7, 7]])))
    with Client(srv.endpoint, timeout=20) as c:
        outs = [c.generate(SECRET, params=SamplingParams(max_tokens=2)) for _ in range(3)]
    real = len(tokenizer.encode(SECRET))
    assert [o.usage.prompt_tokens for o in outs] == [real] * 3
    assert received([foreign], 0.3) == []  # never sent a job, so never a prompt


def test_a_client_of_the_same_user_on_ipc_may_flush(
    tokenizer_dir: Any,
    tokenizer: Any,
    alphabet: list[int],
    fast_router: dict[str, Any],
    fake_worker_cmd: list[str],
    tmp_path: Any,
) -> None:
    """On ipc the kernel names the peer's uid (SO_PEERCRED): the server's own user is trusted
    there, as the socket file's permissions already decide who reaches it."""
    from radixserve.serving.router.launcher import LocalServer
    from radixserve.serving.router.router import RouterConfig
    from radixserve.serving.wire.security import ipc_peer_uid

    assert ipc_peer_uid("localhost:1000:1000:4242") == 1000
    assert ipc_peer_uid("127.0.0.1") is None and ipc_peer_uid("localhost:x:0:1") is None
    cfg = RouterConfig(**{**fast_router, "endpoint": f"ipc://{tmp_path}/clients.sock"})
    with (
        LocalServer(
            tokenizer_dir,
            num_workers=1,
            config=cfg,
            engine_config={"alphabet": alphabet, "vocab_size": len(tokenizer)},
            worker_program=fake_worker_cmd,
            tokenizer=tokenizer,
        ) as srv,
        Client(srv.endpoint, timeout=20) as c,
    ):
        c.generate("cache me", params=SamplingParams(max_tokens=2))
        assert c.flush_cache()
