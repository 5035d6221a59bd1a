"""Hypothesis state machine: prefill/decode disaggregation's page accounting on both sides.

Two caches, each with its own pool, allocator and radix cache: a decode side whose
reservations are the scheduler's real :class:`~radixserve.scheduling.prefilled.Reservations`,
and a prefill side that computes prompts in chunks (match, lock, allocate, write). Prompts
are reserved on the decode side, computed on the prefill side, and then either transferred
(the prefill side's KV of the tokens the decode side lacks copied into the reserved pages,
the request admitted and decoding there), or given back (the prefill run aborted or its
transfer failed). Extra rules cancel reservations no prefill took, evict on either side,
finish decoding requests, and kill the prefill side (a fresh cache: everything it held is
gone, the decode side gives back every reservation it was computing).

After every step both caches' full invariants hold with exactly the pages their requests
(and, on the decode side, the reservations) hold privately, the decode side's page-table
rows add up, and every page a decode request holds (and every prefix the decode cache
matches) contains the tokens it stands for: a transfer into the wrong pages, or pages given
back while a request still used them, fails the data checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.memory import KVPool, OutOfPagesError, PageAllocator, RadixCache, TreeNode
from radixserve.sampling_params import SamplingParams
from radixserve.scheduling.plan import PageTableRows
from radixserve.scheduling.prefilled import Reservations
from radixserve.scheduling.request import Request

BASES = [list(range(10, 30)), list(range(10, 18)) + list(range(40, 52)), list(range(70, 90))]
NAMESPACES = st.sampled_from([None, None, "t1"])
ROWS = 3


class Side:
    """One engine's KV: a pool whose slots hold token ids, its allocator and radix cache."""

    def __init__(self, num_pages: int, ps: int) -> None:
        self.ps = ps
        self.alloc = PageAllocator(num_pages)
        self.pool = KVPool(1, num_pages, ps, 1, 1)
        self.flat = self.pool.k_data[0].view(-1)
        self.cache = RadixCache(self.alloc, ps)

    def slots(self, pages: list[int], start: int, n: int) -> torch.Tensor:
        return torch.tensor(
            [pages[i // self.ps] * self.ps + i % self.ps for i in range(start, start + n)],
            dtype=torch.long,
        )

    def write(self, pages: list[int], start: int, tokens: list[int]) -> None:
        self.flat[self.slots(pages, start, len(tokens))] = torch.tensor(tokens, dtype=torch.float32)

    def read(self, pages: list[int], n: int) -> list[int]:
        return [int(x) for x in self.flat[self.slots(pages, 0, n)].tolist()]


@dataclass
class Run:
    """A request holding pages on one side: its written tokens, pages and locked node."""

    rid: str
    prompt: list[int]
    ns: str | None
    tokens: list[int]
    pages: list[int]
    node: TreeNode
    slot: int = -1  # the decode side's page-table row


class DisaggMachine(RuleBasedStateMachine):
    @initialize(ps=st.sampled_from([1, 4]), d_pages=st.integers(6, 30), p_pages=st.integers(6, 30))
    def setup(self, ps: int, d_pages: int, p_pages: int) -> None:
        self.ps, self.p_pages = ps, p_pages
        self.d = Side(d_pages, ps)
        self.rows = PageTableRows(ROWS, 64)
        self.res = Reservations(self.d.cache, self.d.alloc, self.rows, ps)
        self.p = Side(p_pages, ps)
        self.prefills: dict[str, Run] = {}  # prefill side, by the reservation they fill
        self.decoding: dict[str, Run] = {}  # decode side, admitted
        self.next_rid = 0

    # ------------------------------------------------------------ helpers
    def _reserved(self) -> list[str]:
        return sorted(r for r in self._all_rids() if r in self.res)

    def _all_rids(self) -> list[str]:
        return [f"r{i}" for i in range(self.next_rid)]

    def _grow(self, side: Side, run: Run, new: list[int]) -> bool:
        need = -(-(len(run.tokens) + len(new)) // self.ps) - len(run.pages)
        try:
            run.pages += side.alloc.alloc(need)
        except OutOfPagesError:
            return False
        side.write(run.pages, len(run.tokens), new)
        run.tokens += new
        return True

    def _release(self, side: Side, run: Run, cache_it: bool) -> None:
        """A finished run caches its whole pages (or not), unlocks and frees the rest."""
        if cache_it:
            c = side.cache.cache_prefix(run.tokens, run.pages, run.node, run.ns)
            run.pages, run.node = c.pages, c.node
        side.cache.unlock(run.node)
        side.alloc.free(run.pages[run.node.depth // self.ps :])

    # ------------------------------------------------------------ rules
    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(1, 20), ns=NAMESPACES)
    def reserve(self, base: int, cut: int, ns: str | None) -> None:
        prompt = BASES[base][:cut]
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        req = Request(rid, list(prompt), len(prompt), SamplingParams(), 64, namespace=ns)
        free_rows = self.rows.num_free_rows
        got = self.res.reserve(req)
        if got is None:
            return
        assert free_rows > 0 and got.held_len % self.ps == 0
        assert len(got.fill_pages) == -(-len(prompt) // self.ps) - got.held_len // self.ps
        held = req.pages[: got.held_len // self.ps]
        assert self.d.read(held, got.held_len) == prompt[: got.held_len]

    @precondition(lambda self: self._reserved())
    @rule(data=st.data())
    def prefill_start(self, data: st.DataObject) -> None:
        """The prefill side takes a ticket: it matches its own cache and locks the prefix."""
        free = [r for r in self._reserved() if r not in self.prefills]
        if not free:
            return
        rid = data.draw(st.sampled_from(free))
        req = self.res.get(rid).request
        prompt = req.token_ids[: req.prompt_len]
        m = self.p.cache.match_prefix(prompt[:-1], req.namespace)
        self.p.cache.lock(m.node)
        self.prefills[rid] = Run(
            rid, prompt, req.namespace, prompt[: m.matched_len], m.pages, m.node
        )

    @precondition(lambda self: self.prefills)
    @rule(data=st.data(), k=st.integers(1, 8))
    def prefill_chunk(self, data: st.DataObject, k: int) -> None:
        run = self.prefills[data.draw(st.sampled_from(sorted(self.prefills)))]
        self._grow(self.p, run, run.prompt[len(run.tokens) : len(run.tokens) + k])

    @precondition(lambda self: self.prefills)
    @rule(data=st.data(), outcome=st.sampled_from(["write", "write", "abort", "fail"]))
    def prefill_answer(self, data: st.DataObject, outcome: str) -> None:
        """The prefill run ends: a finished prompt's missing pages are written into the
        reservation and it is admitted; an abort or a failed transfer gives it back."""
        rid = data.draw(st.sampled_from(sorted(self.prefills)))
        run = self.prefills[rid]
        done = len(run.tokens) == len(run.prompt)
        if outcome == "write" and not done:
            return
        res = self.res.get(rid)
        if outcome == "write":
            lo, n = res.held_len, len(run.prompt) - res.held_len
            src = run.pages[lo // self.ps :]
            self.d.flat[self.d.slots(res.fill_pages, 0, n)] = self.p.flat[self.p.slots(src, 0, n)]
            req = self.res.admit(rid)
            node = req.lock_node
            assert (
                node is not None
                and req.pages
                == self.d.cache.match_prefix(run.prompt[: res.held_len], run.ns).pages
                + res.fill_pages
            )
            self.decoding[rid] = Run(
                rid, run.prompt, run.ns, list(run.prompt), req.pages, node, req.slot
            )
        else:
            assert self.res.cancel(rid)
        del self.prefills[rid]
        self._release(self.p, run, cache_it=done)

    @precondition(lambda self: self._reserved())
    @rule(data=st.data())
    def cancel_untaken(self, data: st.DataObject) -> None:
        """A reservation no prefill holds ends (client abort, lease out): given back."""
        free = [r for r in self._reserved() if r not in self.prefills]
        if free:
            assert self.res.cancel(data.draw(st.sampled_from(free)))

    @rule()
    def kill_prefill_side(self) -> None:
        """The prefill process dies: its cache is gone, and the decode side gives back every
        reservation it was filling (it will write nothing more)."""
        for rid in list(self.prefills):
            assert self.res.cancel(rid)
        self.prefills.clear()
        self.p = Side(self.p_pages, self.ps)

    @precondition(lambda self: self.decoding)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def decode(self, data: st.DataObject, new: list[int]) -> None:
        self._grow(self.d, self.decoding[data.draw(st.sampled_from(sorted(self.decoding)))], new)

    @precondition(lambda self: self.decoding)
    @rule(data=st.data(), cache_it=st.booleans())
    def decode_finish(self, data: st.DataObject, cache_it: bool) -> None:
        run = self.decoding.pop(data.draw(st.sampled_from(sorted(self.decoding))))
        self._release(self.d, run, cache_it)
        self.rows.release(run.slot)

    @rule(n=st.integers(0, 10), decode_side=st.booleans())
    def evict(self, n: int, decode_side: bool) -> None:
        side = self.d if decode_side else self.p
        evictable = side.cache.num_evictable_pages
        assert side.cache.evict(n) == min(n, evictable)

    # ------------------------------------------------------------ checks
    def _private(self, side: Side, runs: dict[str, Run]) -> list[int]:
        return [pg for r in runs.values() for pg in r.pages[r.node.depth // self.ps :]]

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "d"):
            return
        self.d.cache.check_invariants(self._private(self.d, self.decoding) + self.res.pages())
        self.p.cache.check_invariants(self._private(self.p, self.prefills))
        assert self.rows.num_free_rows == ROWS - len(self.res) - len(self.decoding)

    @invariant()
    def data(self) -> None:
        if not hasattr(self, "d"):
            return
        for run in self.decoding.values():
            assert self.d.read(run.pages, len(run.tokens)) == run.tokens
        for run in self.prefills.values():
            assert self.p.read(run.pages, len(run.tokens)) == run.tokens
        for base in BASES:
            for ns in (None, "t1"):
                m = self.d.cache.match_prefix(base, ns)
                assert self.d.read(m.pages, m.matched_len) == base[: m.matched_len]


TestDisaggAccounting = DisaggMachine.TestCase
TestDisaggAccounting.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
