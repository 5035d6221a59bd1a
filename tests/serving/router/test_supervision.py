"""Worker supervision: a request that lost its worker before its first token is retried on
another; local workers that die are reaped at once, reported and restarted with back-off."""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client, ServerError
from radixserve.serving.router.supervisor import RestartPolicy, describe_exit
from radixserve.serving.wire import protocol as p

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def _zombie_or_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat"):
            return True  # still in the process table: running, or a zombie nobody reaped
    except FileNotFoundError:
        return False


def _wait(cond, timeout: float = 20.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.timeout(30)
def test_restart_policy_backs_off() -> None:
    pol = RestartPolicy(backoff_s=0.5, backoff_max_s=3.0)
    assert [pol.delay(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert (
        describe_exit(-9) == "killed by SIGKILL (exit code -9)"
        and describe_exit(3) == "exit code 3"
    )


def test_request_without_a_token_is_retried_on_another_worker(fake_server) -> None:
    # 0.5 s per step: a request sent to worker 0 has no token yet when worker 0 is killed.
    srv = fake_server(
        num_workers=2, step_delay=0.5, router=dict(routing="round_robin", restart_workers=False)
    )
    with Client(srv.endpoint, timeout=30) as c:
        rid = c.submit("first goes to worker 0", params=SamplingParams(max_tokens=2), stream=True)
        c.health()  # answered after the request was dispatched and sent (same socket, in order)
        os.kill(srv.procs[0].pid, signal.SIGKILL)
        events = list(c.events(rid))
        final = events[-1]
        assert (
            isinstance(final, p.GenerateFinal)
            and final.worker_id == 1
            and final.usage.completion_tokens == 2
        )
        assert [ev.index for ev in events[:-1]] == list(range(len(events) - 1))  # one clean stream
        # A request whose tokens were already streamed is not replayed: worker_died.
        rid = c.submit("long", params=SamplingParams(max_tokens=1000), stream=True)
        stream = c.events(rid)
        assert isinstance(next(stream), p.GenerateChunk)
        os.kill(srv.procs[1].pid, signal.SIGKILL)
        with pytest.raises(ServerError) as exc:
            list(stream)
        assert exc.value.code == "worker_died"


def test_dead_worker_is_reaped_reported_and_restarted(
    fake_server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="radixserve.serving.supervisor")
    srv = fake_server(num_workers=2, router=dict(restart_backoff_s=0.2))
    first = srv.procs[0].pid
    with Client(srv.endpoint, timeout=30) as c:
        assert c.generate("warm", params=SamplingParams(max_tokens=2)).usage.completion_tokens == 2
        os.kill(first, signal.SIGKILL)
        # Reaped by the router at once (no zombie left), without anyone else waiting on it.
        assert _wait(lambda: not _zombie_or_alive(first), 10), "the killed worker was left a zombie"
        assert any(
            f"pid {first}) exited" in r.message and "SIGKILL" in r.message for r in caplog.records
        )
        # Started again under the same id, with a new process; serving goes on with both.
        assert _wait(lambda: c.health().workers_alive == 2, 30)
        st = c.stats()
        assert [w.worker_id for w in st.workers if w.alive] == [0, 1]
        assert st.workers[0].pid not in (first, None) and len(srv.procs) == 3
        assert srv.supervisor.restarts == 1 and srv.supervisor.exits[0].code == -9
        for i in range(4):
            assert (
                c.generate(
                    f"after {i}", params=SamplingParams(max_tokens=2)
                ).usage.completion_tokens
                == 2
            )


def test_with_no_worker_left_requests_wait_for_the_restart(fake_server) -> None:
    srv = fake_server(num_workers=1, router=dict(restart_backoff_s=0.3))
    with Client(srv.endpoint, timeout=30) as c:
        os.kill(srv.procs[0].pid, signal.SIGKILL)
        assert _wait(lambda: c.health().workers_alive == 0, 10)
        # No live worker, one restarting: the request waits for it instead of failing no_workers.
        final = c.generate("waits", params=SamplingParams(max_tokens=3))
        assert final.usage.completion_tokens == 3 and final.worker_id == 0


def test_restart_off_leaves_a_dead_worker_dead_but_reaped(fake_server) -> None:
    srv = fake_server(num_workers=2, router=dict(restart_workers=False))
    pid = srv.procs[1].pid
    with Client(srv.endpoint, timeout=30) as c:
        os.kill(pid, signal.SIGKILL)
        assert _wait(lambda: not _zombie_or_alive(pid), 10)
        assert _wait(lambda: c.stats().workers[1].death is not None, 10)  # settled
        assert c.health().workers_alive == 1
        st = c.stats()
        assert [w.alive for w in st.workers] == [True, False] and "SIGKILL" in (
            st.workers[1].death or ""
        )
        assert len(srv.procs) == 2 and srv.supervisor.restarts == 0


def test_with_its_only_worker_given_up_a_request_waits_for_it_to_join_again(fake_server) -> None:
    """The only worker stopped (SIGSTOP) past the router's worker timeout is declared dead;
    its process still runs, so a request sent meanwhile waits in the router instead of
    failing ``no_workers``, and is served once the worker is continued and joins again."""
    srv = fake_server(num_workers=1, router=dict(worker_timeout_s=0.5))
    pid = srv.procs[0].pid
    with (
        Client(srv.endpoint, timeout=30) as c,
        Client(srv.endpoint, timeout=30) as probe,
        ThreadPoolExecutor(1) as pool,
    ):
        os.kill(pid, signal.SIGSTOP)
        try:
            assert _wait(lambda: probe.health().workers_alive == 0, 10)  # given up
            sent = pool.submit(c.generate, "waits", params=SamplingParams(max_tokens=3))
            assert _wait(lambda: probe.stats().active == 1 or sent.done(), 10)
            assert not sent.done(), sent.exception()  # waiting, not failed
        finally:
            os.kill(pid, signal.SIGCONT)
        final = sent.result(timeout=30)
    assert final.usage.completion_tokens == 3 and final.worker_id == 0
    assert srv.procs[0].pid == pid  # the same process joined again
