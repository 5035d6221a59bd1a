"""The hidden states (return_hidden_states) of the requests in flight are bounded at the
router, which holds each one's until its final message: a request that would take the sum
past ``HIDDEN_FLOATS_IN_FLIGHT`` fails with ``overloaded`` (a 503 over HTTP) and takes
nothing (one past the engine's own bound goes on, to the engine's 400); what a request
reserved is given back when it ends, however it ends, and kept over a retry."""

from __future__ import annotations

import subprocess

import msgspec
from test_inflight_retry import HELLO, _Router

import radixserve.serving.wire.protocol as p
from radixserve.sampling_params import MAX_HIDDEN_STATE_FLOATS, SamplingParams
from radixserve.serving.router.inflight import HIDDEN_FLOATS_IN_FLIGHT

HIDDEN = 1024
# Three prompt tokens and this many outputs read as many positions as one request may.
FULL = SamplingParams(max_tokens=MAX_HIDDEN_STATE_FLOATS // HIDDEN - 2, return_hidden_states=True)


def test_hidden_states_in_flight_are_bounded_and_given_back(
    worker_proc: subprocess.Popen[bytes],
) -> None:
    r = _Router()
    r.pool.expect_local(0, worker_proc)  # awaited while it runs: a retry waits for it
    r.pool.register(b"w0", msgspec.structs.replace(HELLO, hidden_size=HIDDEN))
    assert HIDDEN_FLOATS_IN_FLIGHT == 2 * MAX_HIDDEN_STATE_FLOATS
    first, second = r.submit("a", FULL), r.submit("b", FULL)
    assert r.inflight.hidden_floats == 2 * MAX_HIDDEN_STATE_FLOATS
    r.submit("c", FULL)  # one too many: fails, takes nothing
    (refused,) = r.to_client
    assert isinstance(refused, p.Error) and refused.code == "overloaded"
    assert (
        "hidden states" in refused.message
        and r.inflight.hidden_floats == 2 * MAX_HIDDEN_STATE_FLOATS
    )
    huge = msgspec.structs.replace(FULL, max_tokens=FULL.max_tokens + 1)
    r.submit("h", huge)  # over the engine's own bound: its worker refuses it (a 400), not here
    assert len(r.to_client) == 1 and r.inflight.hidden_floats == 2 * MAX_HIDDEN_STATE_FLOATS
    plain = r.submit("d")  # asks for none: not bounded
    assert r.inflight.get(plain.rid) is plain
    r.pool.register(b"w0", msgspec.structs.replace(HELLO, hidden_size=HIDDEN))  # a retry
    r.pool.flush_adds()
    assert second.retries == 1 and r.inflight.hidden_floats == 2 * MAX_HIDDEN_STATE_FLOATS
    r.inflight.finish(first, "length")
    assert r.inflight.hidden_floats == MAX_HIDDEN_STATE_FLOATS
    r.inflight.abort(b"client", "b")
    assert r.inflight.hidden_floats == 0
    again = r.submit("e", FULL)
    assert r.inflight.get(again.rid) is again and again.hidden_floats == MAX_HIDDEN_STATE_FLOATS
