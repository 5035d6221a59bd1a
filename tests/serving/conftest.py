"""Fixtures for serving tests: a tiny tokenizer, and servers with fake or real workers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tiny_models
import zmq

from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig

HERE = Path(__file__).resolve().parent
# The tests mirror serving/'s folders (wire/, router/, worker/, client/); the helpers they
# share (raw_client, fake_engine, fake_worker) stay here, importable from every subfolder.
sys.path.insert(0, str(HERE))
FAKE_WORKER = [sys.executable, str(HERE / "fake_worker.py")]

# Fast liveness for tests: dead workers and vanished clients are noticed within ~0.2 s.
FAST = dict(
    endpoint="tcp://127.0.0.1:*",
    heartbeat_interval_s=0.1,
    client_probe_interval_s=0.1,
    tokenizer_workers=1,
    worker_timeout_s=20.0,
    worker_wait_s=30.0,
    control_timeout_s=10.0,
)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Just the tiny byte-level BPE tokenizer (with ChatML), no weights: for fake-worker tests."""
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    tiny_models.build_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from radixserve.serving.prompts import load_tokenizer

    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="session")
def alphabet(tokenizer: Any) -> list[int]:
    """Token ids of single lowercase letters: what the fake engine emits."""
    vocab = tokenizer.get_vocab()
    return [vocab[c] for c in "abcdefghijklmnopqrstuvwxyz" if c in vocab]


ServerFactory = Callable[..., LocalServer]


@pytest.fixture
def fast_router() -> dict[str, Any]:
    """RouterConfig fields with test-speed liveness timings."""
    return dict(FAST)


@pytest.fixture
def fake_worker_cmd() -> list[str]:
    """The command that starts a fake-engine worker process."""
    return list(FAKE_WORKER)


@pytest.fixture
def fake_server(
    tokenizer_dir: Path, tokenizer: Any, alphabet: list[int]
) -> Iterator[ServerFactory]:
    """Factory: ``fake_server(num_workers=1, router=dict(...), **fake_engine_kwargs)`` -> started server."""
    servers: list[LocalServer] = []

    def make(
        num_workers: int = 1, router: dict[str, Any] | None = None, **engine: Any
    ) -> LocalServer:
        engine.setdefault("alphabet", alphabet)
        engine.setdefault("vocab_size", len(tokenizer))
        srv = LocalServer(
            tokenizer_dir,
            num_workers=num_workers,
            config=RouterConfig(**{**FAST, **(router or {})}),
            engine_config=engine,
            worker_program=FAKE_WORKER,
            tokenizer=tokenizer,
        )
        servers.append(srv)
        return srv.start(timeout_s=60)

    yield make
    for srv in servers:
        srv.close()
        assert all(p.poll() is not None for p in srv.procs), "a worker process outlived its server"


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    """A ZeroMQ context for a test's own sockets (a foreign peer's), destroyed after it."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
