"""The router's LoRA adapter loads and unloads (router/lora_ops.py), over a worker pool whose
socket records what it sent: every live worker is asked; the client's answer says whether
they all serve the adapter afterwards; a worker that joins later is sent what changed since
start-up before anything else; a worker that dies or does not answer fails the change."""

from __future__ import annotations

import msgspec
from recording_backend import RecordingBackend

import radixserve.serving.wire.protocol as p
from radixserve.serving.router.dispatch import Dispatcher
from radixserve.serving.router.lora_ops import LoraOps
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool

HELLO = p.WorkerHello(0, 1000, "m", 64, 32, [0], lora_adapters={"sql": "sql@1"})


class _Router:
    """A LoraOps over a WorkerPool, wired as the router wires them; the client's replies kept."""

    def __init__(self) -> None:
        self.backend = RecordingBackend()
        self.replies: list[p.LoraAdapterReply] = []
        self.pool = WorkerPool(
            self.backend,  # type: ignore[arg-type]
            Dispatcher(),
            on_dead=lambda w, reason: self.lora.on_worker_dead(w),
            on_joined=lambda w: self.lora.on_joined(w),
        )
        self.lora = LoraOps(self.pool, 5.0, self._reply)

    def _reply(self, client: bytes, msg: msgspec.Struct) -> bool:
        assert isinstance(msg, p.LoraAdapterReply)
        self.replies.append(msg)
        return True

    def join(self, wid: int) -> WorkerHandle:
        return self.pool.register(f"w{wid}".encode(), msgspec.structs.replace(HELLO, worker_id=wid))

    def answer(self, w: WorkerHandle, token: int, error: str | None, **adapters: str) -> None:
        self.lora.on_reply(w, p.WorkerLoraReply(token=token, error=error, adapters=adapters))


def load(name: str = "chat", path: str = "/a/chat") -> p.LoadLoraAdapter:
    return p.LoadLoraAdapter(request_id="r", name=name, path=path)


def test_a_load_every_worker_answers_is_served_and_replayed_to_joiners() -> None:
    r = _Router()
    w0, w1 = r.join(0), r.join(1)
    r.backend.take()
    r.lora.start(b"c", load())
    sent = r.backend.take()
    assert [m for _, m in sent] == [p.WorkerLoadLora(token=1, name="chat", path="/a/chat")] * 2
    r.answer(w0, 1, None, sql="sql@1", chat="chat@2")
    assert not r.replies and r.pool.lora_adapters() == {"sql": "sql@1"}  # w1 has not yet
    r.answer(w1, 1, None, sql="sql@1", chat="chat@2")
    assert r.replies == [
        p.LoraAdapterReply(request_id="r", ok=True, adapters={"chat": "chat@2", "sql": "sql@1"})
    ]
    # Unloading a start-up adapter too; then a worker (re)starting from its flags joins.
    r.lora.start(b"c", p.UnloadLoraAdapter(request_id="u", name="sql"))
    r.backend.take()
    r.answer(w0, 2, None, chat="chat@2")
    r.answer(w1, 2, None, chat="chat@2")
    assert r.replies[-1].ok and r.replies[-1].adapters == {"chat": "chat@2"}
    w2 = r.join(2)
    assert [m for _, m in r.backend.take()] == [
        p.WorkerLoadLora(token=0, name="chat", path="/a/chat"),
        p.WorkerUnloadLora(token=0, name="sql"),
    ]
    assert r.pool.lora_adapters() == {"chat": "chat@2"}, "counted on before it answers"
    r.answer(w2, 0, "no adapter_config.json", sql="sql@1")  # the replay failed there
    assert r.pool.lora_adapters() == {}


def test_a_worker_refusing_fails_the_load_and_nothing_is_replayed() -> None:
    r = _Router()
    w0, w1 = r.join(0), r.join(1)
    r.lora.start(b"c", load())
    r.answer(w0, 1, None, sql="sql@1", chat="chat@2")
    r.answer(w1, 1, "chat: rank 128 is above 64", sql="sql@1")
    reply = r.replies[-1]
    assert (reply.ok, reply.code) == (False, "invalid_params")
    assert reply.error == "worker 1: chat: rank 128 is above 64"
    assert reply.adapters == {"sql": "sql@1"}
    r.backend.take()
    r.join(2)
    assert r.backend.take() == []


def test_unloading_a_name_no_worker_serves_is_not_found() -> None:
    r = _Router()
    w0 = r.join(0)
    r.lora.start(b"c", p.UnloadLoraAdapter(request_id="u", name="nope"))
    r.answer(w0, 1, "unknown LoRA adapter 'nope'", sql="sql@1")
    assert (r.replies[-1].ok, r.replies[-1].code) == (False, "not_found")


def test_a_worker_dying_or_silent_fails_the_change_and_none_live_is_unavailable() -> None:
    r = _Router()
    w0, w1 = r.join(0), r.join(1)
    r.lora.start(b"c", load())
    r.answer(w0, 1, None, sql="sql@1", chat="chat@2")
    r.pool.mark_dead(w1, "killed")
    assert r.replies[-1].code == "invalid_params"
    assert r.replies[-1].error == "worker 1 died before it answered"
    r.lora.start(b"c", load("other", "/a/other"))
    r.lora.expire(1e12)
    assert r.replies[-1].error == "worker 0 did not answer within 5 s"
    r.pool.mark_dead(w0, "killed")
    r.lora.start(b"c", load())
    assert (r.replies[-1].code, r.replies[-1].error) == ("unavailable", "no live worker")
