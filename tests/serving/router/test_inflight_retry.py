"""A request retried after its worker was declared dead goes out under a fresh rid, and the
old run, wherever it may still be, is stopped without touching the retry.

The case that found it (tests/serving/test_serve_cli.py, the whole server paused past its
zmq heartbeats, failed once in CI; the crossing below is read from the code, not seen in a
log): the worker reconnected and said hello; the router, which had
given it up and heard from it, had also asked it to join again (WorkerRejoin). A request sent
after the first hello reached the worker after that ask, and so after its second hello. The
router took the second hello as a worker that lost its work and sent the request again; the
worker still had it, and its engine refused the repeat as a duplicate id (or the abort of a
rejoin could have ended the retry). The ask now names the join it gave up on, and a worker
that has said hello since ignores it (the last test here, and
tests/serving/worker/test_worker_liveness.py); the retry under a fresh rid stays for a
worker that really lost its work."""

from __future__ import annotations

import subprocess

import pytest
from recording_backend import RecordingBackend

import radixserve.serving.wire.protocol as p
from radixserve.sampling_params import SamplingParams
from radixserve.serving.router.dispatch import Dispatcher
from radixserve.serving.router.inflight import InFlight
from radixserve.serving.router.requests import RouterRequest
from radixserve.serving.router.worker_pool import WorkerPool

HELLO = p.WorkerHello(0, 1000, "m", 64, 32, [0])


class _Router:
    """An InFlight over a WorkerPool wired as the router wires them, one client's messages kept."""

    def __init__(self) -> None:
        self.backend = RecordingBackend()
        dispatcher = Dispatcher()
        self.to_client: list[object] = []
        self.pool = WorkerPool(
            self.backend,  # type: ignore[arg-type]
            dispatcher,
            on_dead=lambda w, reason: self.inflight.fail_worker_requests(w, reason),
            on_joined=lambda w: self.inflight.dispatch_waiting(),
        )
        self.inflight = InFlight(
            self.pool,
            dispatcher,
            send=lambda client, msg: self.to_client.append(msg) is None,
            reply_error=lambda client, err: self.to_client.append(err),
            worker_wait_s=30.0,
        )

    def submit(self, client_rid: str, params: SamplingParams | None = None) -> RouterRequest:
        st = RouterRequest(
            rid=self.inflight.new_rid(),
            client=b"client",
            client_rid=client_rid,
            prompt_ids=[1, 2, 3],
            params=params or SamplingParams(max_tokens=2),
            stream=False,
            session_id=None,
            namespace=None,
            detok=None,
            arrival=0.0,
        )
        self.inflight.track(st)
        self.inflight.dispatch(st)
        self.pool.flush_adds()
        return st


@pytest.fixture
def router(worker_proc: subprocess.Popen[bytes]) -> _Router:
    """The router with worker 0 (a running process) joined."""
    r = _Router()
    r.pool.expect_local(0, worker_proc)
    r.pool.register(b"w0", HELLO)
    return r


def _adds(sent: list[tuple[bytes, object]]) -> list[str]:
    return [r.rid for _, m in sent if isinstance(m, p.WorkerAdd) for r in m.requests]


def test_a_worker_saying_hello_again_gets_the_retry_under_a_fresh_rid(
    router: _Router,
) -> None:
    r = router
    st = r.submit("c1")
    first = st.rid
    assert _adds(r.backend.take()) == [first]

    r.pool.register(b"w0", HELLO)  # the same process, reconnected: hello again
    r.pool.flush_adds()
    sent = r.backend.take()
    # The old run is aborted first, on the same connection, then the retry goes out anew.
    assert sent[0] == (b"w0", p.WorkerAbort(rids=[first]))
    assert _adds(sent) == [st.rid] and st.rid != first and st.retries == 1
    assert r.inflight.get(first) is None and r.inflight.get(st.rid) is st
    assert r.inflight.has(b"client", "c1")

    # The old run's last word (the abort of the worker's rejoin) ends nothing.
    w = r.pool.workers[0]
    r.inflight.on_output(w, p.StepOutput(first, [], finished=True, finish_reason="abort"))
    assert r.to_client == [] and r.inflight.get(st.rid) is st
    assert st.rid in w.inflight


def test_outputs_of_an_orphan_run_are_answered_with_an_abort(
    router: _Router,
) -> None:
    """Should the old request reach the worker after all (after the abort, on a connection the
    worker read later), each output of it gets an abort back, and the retry is untouched."""
    r = router
    st = r.submit("c1")
    first = st.rid
    r.pool.register(b"w0", HELLO)
    r.pool.flush_adds()
    r.backend.take()
    w = r.pool.workers[0]
    r.inflight.on_output(w, p.StepOutput(first, [7], finished=False))
    assert r.backend.take() == [(b"w0", p.WorkerAbort(rids=[first]))]
    assert r.to_client == [] and r.inflight.get(st.rid) is st


def test_a_stop_string_abort_is_not_sent_twice(router: _Router) -> None:
    """An output of a request the router ended itself (its abort already sent; the worker
    still holds it) needs no second abort: only runs the worker was never asked for do."""
    r, w = router, router.pool.workers[0]
    st = r.submit("c1")
    r.backend.take()
    r.inflight.abort(b"client", "c1")
    assert r.backend.take() == [(b"w0", p.WorkerAbort(rids=[st.rid]))]
    r.inflight.on_output(w, p.StepOutput(st.rid, [7], finished=False))
    assert r.backend.take() == []


def test_a_request_retried_once_fails_the_second_time(
    router: _Router,
) -> None:
    r = router
    st = r.submit("c1")
    r.pool.register(b"w0", HELLO)  # retried once
    r.pool.register(b"w0", HELLO)  # lost again: no more tries
    assert r.inflight.get(st.rid) is None
    (err,) = r.to_client
    assert isinstance(err, p.Error) and err.code == "worker_died" and err.request_id == "c1"


def test_a_dead_worker_is_asked_to_rejoin_from_the_hello_given_up(router: _Router) -> None:
    """The router's ask names the join it gave up on, so that a worker which has said hello
    since can tell the ask is stale (tests/serving/worker/test_worker_liveness.py: it then
    ignores it) instead of aborting what the router sent after its new hello."""
    import msgspec
    import zmq

    from radixserve.serving.router.from_workers import WorkerSide

    r = router
    r.pool.register(b"w1", msgspec.structs.replace(HELLO, worker_id=1, join=3))
    w = r.pool.workers[1]
    r.pool.mark_dead(w, "silent")
    side = WorkerSide(r.pool, r.pool.dispatcher, r.inflight, None, None, None, None, None)  # type: ignore[arg-type]
    beat = p.encode(p.WorkerHeartbeat(load=p.WorkerLoad()))
    side.on_frames([zmq.Frame(b"w1"), zmq.Frame(beat)])
    side.on_frames([zmq.Frame(b"w1"), zmq.Frame(beat)])  # asked once only
    assert r.backend.take() == [(b"w1", p.WorkerRejoin(join=3))]


def test_a_retry_drops_the_hidden_states_of_the_old_run(router: _Router) -> None:
    """Hidden states (return_hidden_states) come in as they are computed and are appended: a
    retry, which computes them all again, starts from none."""
    r = router
    st = r.submit("c1")
    r.backend.take()
    st.extras.hidden_states = [[0.5, 0.25]]  # as an output of the old run left them
    r.pool.register(b"w0", HELLO)  # reconnected: the request is retried
    r.pool.flush_adds()
    assert st.retries == 1 and st.extras.hidden_states is None
