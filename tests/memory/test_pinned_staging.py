"""Host-pool copies through pinned staging (radixserve.memory.pinned_staging), on the CPU.

On CUDA the page copier stages every host copy through pinned buffers with non-blocking
copies and events, and defers a demotion's scatter into the L2 slots until something reads
or reuses L2. The same code runs here with ``PageCopier(staged=True)`` (events complete at
once): pages round-trip bit for bit, a demotion is pending until L2 is read, eviction lands
it before spilling, and a staging buffer is not handed out while its copy is in flight.
"""

from __future__ import annotations

import torch

from radixserve.memory import KVPool
from radixserve.memory.host_pool import HostKVCache, PageCopier
from radixserve.memory.page_hash import PrefixHasher
from radixserve.memory.pinned_staging import PinnedStaging

LAYERS, PS, HEADS, DIM = 2, 4, 2, 8


class _InFlight:
    """An event of a copy that has not completed yet (until ``done``)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _l1(pages: int = 8) -> KVPool:
    pool = KVPool(LAYERS, pages, PS, HEADS, DIM)
    g = torch.Generator().manual_seed(0)
    for t in pool.k_data + pool.v_data:
        t.copy_(torch.randn(t.shape, generator=g))
    return pool


def test_demotion_is_deferred_until_l2_is_read_and_round_trips() -> None:
    l1 = _l1()
    before = [t.clone() for t in l1.page_tensors()]
    copier = PageCopier(l1.device, staged=True)
    spilled: dict[object, list[torch.Tensor]] = {}
    host = HostKVCache(l1, 2, copier)
    host.spill = lambda key, slot: spilled.update(
        {key: [t[:, slot].clone() for t in host.pool.page_tensors()]}
    )
    keys = PrefixHasher("m", PS).keys(list(range(4 * PS)))
    assert host.store([5, 2], keys[:2]) == 2
    assert len(copier.pending) == 1  # the host scatter waits: nothing read L2 yet
    assert all(not t.any() for t in host.pool.page_tensors())
    host.load(keys[:2], [0, 1])  # reading L2 lands the demotion first
    assert not copier.pending
    for b, t in zip(before, l1.page_tensors()):
        assert torch.equal(t[:, 0], b[:, 5]) and torch.equal(t[:, 1], b[:, 2])
    # L2 is full: a third page evicts the least recently used one (spilled with its bytes);
    # a fourth lands the third's deferred scatter before evicting and spilling again.
    host.store([7], keys[2:3])
    assert keys[0] in spilled and len(copier.pending) == 1
    host.store([3], keys[3:4])
    assert keys[1] in spilled and keys[2] in host and keys[3] in host
    assert all(torch.equal(s, b[:, 5]) for s, b in zip(spilled[keys[0]], before))
    assert all(torch.equal(s, b[:, 2]) for s, b in zip(spilled[keys[1]], before))
    copier.finish()
    slot = host.slot(keys[2])
    assert all(torch.equal(t[:, slot], b[:, 7]) for t, b in zip(host.pool.page_tensors(), before))
    host.check_invariants()


def test_a_staging_buffer_is_not_reused_while_its_copy_is_in_flight() -> None:
    staging = PinnedStaging(pin=False)
    a = staging.take((2, 3), torch.float32)
    event = _InFlight()
    staging.release(a, event)
    b = staging.take((2, 3), torch.float32)
    assert b.data_ptr() != a.data_ptr() and staging.allocated == 2
    event.done = True
    staging.release(b, _InFlight())
    c = staging.take((3,), torch.float32)  # a's buffer again (its copy has completed)
    assert c.data_ptr() == a.data_ptr() and staging.allocated == 2
