"""Admission order: LPM by cached prefix, FCFS, and the aging bound against starvation."""

from __future__ import annotations

from radixserve.sampling_params import SamplingParams
from radixserve.scheduling.policy import FCFSPolicy, LPMPolicy, make_policy
from radixserve.scheduling.request import Request


class FakeCache:
    """Cached prefix lengths by first token."""

    def __init__(self, hits: dict[int, int]) -> None:
        self.hits = hits

    def peek_prefix_len(self, tokens, namespace=None) -> int:  # type: ignore[no-untyped-def]
        return min(self.hits.get(tokens[0], 0), len(tokens))


def req(first: int, arrival: int, n: int = 50) -> Request:
    r = Request(f"r{arrival}", [first] * n, n, SamplingParams(), 1000)
    r.arrival_step = arrival
    return r


def test_fcfs_orders_by_arrival() -> None:
    rs = [req(1, 2), req(2, 0), req(3, 1)]
    assert [r.arrival_step for r in FCFSPolicy().order(rs, 0)] == [0, 1, 2]


def test_lpm_prefers_longest_cached_prefix_then_arrival() -> None:
    cache = FakeCache({1: 8, 2: 40, 3: 8})
    rs = [req(1, 0), req(2, 1), req(3, 2), req(4, 3)]
    assert [r.arrival_step for r in LPMPolicy(cache).order(rs, 0)] == [1, 0, 2, 3]


def test_lpm_aging_bound_promotes_bypassed_requests() -> None:
    cache = FakeCache({2: 40})
    cold, hot = req(1, 0), req(2, 1)
    policy = LPMPolicy(cache, max_bypass=3)
    assert policy.order([cold, hot], 0)[0] is hot
    cold.bypassed = 3
    assert policy.order([cold, hot], 0)[0] is cold


def test_lpm_falls_back_to_fcfs_on_long_queues() -> None:
    cache = FakeCache({2: 40})
    rs = [req(1, 0), req(2, 1)]
    assert [r.arrival_step for r in LPMPolicy(cache, max_queue=1).order(rs, 0)] == [0, 1]
    assert isinstance(make_policy("fcfs", cache), FCFSPolicy)
