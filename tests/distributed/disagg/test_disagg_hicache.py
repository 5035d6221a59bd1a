"""Disaggregation with the hierarchical cache on either side (L2, L3 page files or a Mooncake
store), with the overlap schedule on and off, and with tensor parallelism on the other side
(real engines, real Mooncake transfer engines on 127.0.0.1 tcp); a TP rank lost during the
transfer.

A prefill engine whose prompt prefix was evicted from L1 to L2 (and on to L3 page files)
loads it back into L1 pages before its transfer reads them; a decode engine that holds part
of the prefix in L1 and the rest in L2 loads the rest back when it reserves, so ``held_len``
counts only pages that are in its L1 and the prefill side sends only the pages past it.
Tokens equal a colocated engine's, the decode side computes no prompt token, the bytes are
the moved pages', and both sides' L1 and L2 accounting is balanced after each scenario.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
from disagg_helpers import colocated_tokens, disagg_generate, roles
from engine_helpers import greedy, random_prompts
from mooncake_helpers import run_master

from radixserve.distributed.disagg.kv_layout import PoolDescriptor
from radixserve.distributed.disagg.rank_transfer import RankLink
from radixserve.distributed.ranks import RankFailure
from radixserve.distributed.step_wire import KVWrite
from radixserve.distributed.topology import TensorParallel
from radixserve.engine.engine import Engine
from radixserve.engine.outputs import EngineStats

pytest.importorskip("mooncake.engine", reason="Mooncake wheel (and libibverbs1) not importable")

N = 5
PS = 4
L1_PAGES = 12  # one 42-token prompt and its output fill L1: it pushes everything else out
L2_PAGES = 10


def _engine(model_dir: Path, mode: str | None, overlap: str, tp: int = 1, **kw: object) -> Engine:
    return Engine(
        str(model_dir),
        page_size=PS,
        disaggregation_mode=mode,
        overlap_schedule=overlap,
        tensor_parallel_size=tp,
        dist_timeout=30.0,
        **{"num_pages": 64, **kw},  # type: ignore[arg-type]
    )


def _hicache(model_dir: Path, mode: str, overlap: str, page_bytes: int, l3: Path | None) -> Engine:
    """An engine whose small L1 is backed by an L2 of ``L2_PAGES`` (and L3 page files in ``l3``)."""
    return _engine(
        model_dir,
        mode,
        overlap,
        num_pages=L1_PAGES,
        enable_hierarchical_cache=True,
        hicache_size=(L2_PAGES + 0.5) * page_bytes / 2**30,
        hicache_storage_dir=None if l3 is None else str(l3),
    )


@pytest.fixture(scope="module")
def engines(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Engine]]:
    """A colocated engine, and per overlap mode a prefill engine with L2 + L3 and a decode
    engine with L2 (tiny Llama); every one closed at the end."""
    made: dict[str, Engine] = {}
    try:
        made["colocated"] = _engine(tiny_llama_dir, None, "off")
        page_bytes = made["colocated"].pool.bytes_per_page
        for overlap in ("off", "on"):
            l3 = tmp_path_factory.mktemp(f"l3_{overlap}")
            made[f"p_{overlap}"] = _hicache(tiny_llama_dir, "prefill", overlap, page_bytes, l3)
            made[f"d_{overlap}"] = _hicache(tiny_llama_dir, "decode", overlap, page_bytes, None)
        for name, engine in made.items():
            if name != "colocated":
                assert engine.cache.hierarchy.host.num_pages == L2_PAGES  # type: ignore[attr-defined]
        yield made
    finally:
        for engine in made.values():
            engine.close()


def _idle(*engines: Engine) -> None:
    """Every L1 page back (free or cached) and L2's slots each free or cached once, on every
    side (check_invariants runs both tiers' checks, and audits TP ranks' page tables)."""
    for engine in engines:
        engine.check_invariants()
        s = engine.stats()
        assert s.pages_in_use == 0 and s.running == s.waiting == 0


def _delta(after: EngineStats, before: EngineStats, field: str) -> int:
    return int(getattr(after, field)) - int(getattr(before, field))


def _page_bytes(engine: Engine) -> int:
    """One page's bytes summed over the decode engine's ranks (every layer, K and V)."""
    d = engine.disagg
    assert d is not None
    return sum(p.num_layers * sum(p.page_bytes) for p in d.transfer.pools)


def _prefill_side_loads_back(colocated: Engine, prefill: Engine, decode: Engine, seed: int) -> None:
    """``prefill`` (L2 + L3) computes a prompt whose system prefix it evicted to L2, then to
    L3: each time the prefix comes back into L1 pages before the transfer reads them, and
    ``decode`` (flushed: it holds nothing) receives every page of the prompt."""
    system, q1, q2, q3 = random_prompts([32, 6, 7, 5], seed=seed)
    fillers = random_prompts([42, 42], seed=seed + 1)  # 12 pages with its output
    page_bytes = _page_bytes(decode)
    tokens, ticket, result = disagg_generate(prefill, decode, system + q1, N)
    assert tokens == colocated_tokens(colocated, system + q1, N)
    assert ticket.held_len == 0 and result.bytes == 10 * page_bytes  # 38 tokens
    for prompt, pushes, tier in [(system + q2, 1, "L2"), (system + q3, 2, "L3")]:
        assert decode.flush_cache()  # the decode side holds nothing: every page moves
        for filler in fillers[:pushes]:  # the system prefix leaves L1 (and L2)
            prefill.generate([filler], greedy(N))
        before, computed = prefill.stats(), decode.stats().computed_tokens_total
        tokens, ticket, result = disagg_generate(prefill, decode, prompt, N)
        after = prefill.stats()
        assert tokens == colocated_tokens(colocated, prompt, N)
        # The prefix's 8 pages were loaded back (from L2, or from L3 through L2), not computed.
        l2 = _delta(after, before, "loaded_host_pages_total")
        l3 = _delta(after, before, "loaded_storage_pages_total")
        assert (l2, l3) == ((8, 0) if tier == "L2" else (0, 8))
        assert _delta(after, before, "cached_prompt_tokens_total") == 32
        # ... and sent with the rest: the decode side held nothing and computed no prompt token.
        n_pages = -(-len(prompt) // PS)
        assert ticket.held_len == 0 and result.bytes == n_pages * page_bytes
        assert decode.stats().computed_tokens_total - computed == N - 1
        _idle(prefill, decode)


def _decode_side_loads_back(colocated: Engine, prefill: Engine, decode: Engine, seed: int) -> None:
    """``decode`` (L2) holds the head of a system prefix in L1 and its tail in L2: reserving
    loads the tail back, the ticket's ``held_len`` covers the whole prefix, and only the
    question's pages move."""
    system, q1, q2 = random_prompts([32, 6, 7], seed=seed)
    (other,) = random_prompts([20], seed=seed + 1)
    assert decode.flush_cache()
    tokens, ticket, _ = disagg_generate(prefill, decode, system + q1, N)
    assert tokens == colocated_tokens(colocated, system + q1, N) and ticket.held_len == 0
    # A colocated request sharing the system prompt's first 16 tokens pushes the rest out of L1.
    decode.generate([system[:16] + other], greedy(N))
    before = decode.stats()
    tokens, ticket, result = disagg_generate(prefill, decode, system + q2, N)
    after = decode.stats()
    assert tokens == colocated_tokens(colocated, system + q2, N)
    loaded = _delta(after, before, "loaded_host_pages_total")
    assert loaded == 2  # the prefix's last 2 pages; its first 6 were still in L1
    assert ticket.held_len == 32 and len(ticket.fill_pages) == 2  # 39 tokens
    assert result.bytes == 2 * _page_bytes(decode)
    assert _delta(after, before, "cached_prompt_tokens_total") == 32
    assert _delta(after, before, "computed_tokens_total") == N - 1  # decode steps only
    _idle(prefill, decode)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_prefill_side_loads_its_prefix_back_from_l2_and_l3_before_the_transfer(
    engines: dict[str, Engine], overlap: str
) -> None:
    _prefill_side_loads_back(
        engines["colocated"], engines[f"p_{overlap}"], engines[f"d_{overlap}"], seed=70
    )


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_decode_side_loads_the_l2_part_of_its_prefix_when_it_reserves(
    engines: dict[str, Engine], overlap: str
) -> None:
    _decode_side_loads_back(
        engines["colocated"], engines[f"p_{overlap}"], engines[f"d_{overlap}"], seed=72
    )


@pytest.fixture(scope="module")
def tp_engines(tiny_llama_dir: Path) -> Iterator[dict[str, Engine]]:
    """TP 2 prefill and decode engines (spawned rank processes), overlap schedule on."""
    made: dict[str, Engine] = {}
    try:
        for mode in ("prefill", "decode"):
            made[mode] = _engine(tiny_llama_dir, mode, "on", tp=2)
        yield made
    finally:
        for engine in made.values():
            engine.close()


@pytest.mark.slow  # spawned rank processes
def test_hierarchical_cache_side_with_tp_2_on_the_other_side_and_overlap(
    engines: dict[str, Engine], tp_engines: dict[str, Engine]
) -> None:
    """The hierarchical cache is refused with TP on one engine; here it is on one side and
    TP 2 on the other, every engine with the overlap schedule: L2/L3 prefill into TP 2
    decode (heads sliced per token), TP 2 prefill into an L2 decode."""
    colocated = engines["colocated"]
    _prefill_side_loads_back(colocated, engines["p_on"], tp_engines["decode"], seed=74)
    _decode_side_loads_back(colocated, tp_engines["prefill"], engines["d_on"], seed=76)


class _RankDiesAtTheWrite:
    """The prefill engine's real :class:`RankLink`, whose rank 1 is killed (SIGKILL) as the
    transfer starts: after the forward steps, inside the scheduler's ``on_finish``."""

    def __init__(self, link: RankLink, proc: BaseProcess) -> None:
        self.link, self.proc = link, proc

    def pools(self) -> list[PoolDescriptor]:
        return self.link.pools()

    def write(self, msg: KVWrite, own: Callable[[], int]) -> list[int]:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=10)
        return self.link.write(msg, own)


@pytest.mark.slow  # spawned rank processes
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_rank_lost_during_the_transfer_fails_the_step_with_no_page_leaked(
    tiny_llama_dir: Path, engines: dict[str, Engine], overlap: str
) -> None:
    """RankFailure raised inside ``on_finish`` goes through the step loop's error path: the
    request ends with the error and every page is back before the engine stops; no answer
    goes out, so the decode side keeps its reservation until it learns the prefill engine
    is gone, then gives it back."""
    decode = engines[f"d_{overlap}"]
    prefill = _engine(tiny_llama_dir, "prefill", overlap, tp=2)
    try:
        p, d = roles(prefill, decode)
        assert isinstance(prefill.topology, TensorParallel) and p.transfer.link is not None
        p.transfer.link = _RankDiesAtTheWrite(p.transfer.link, prefill.topology.ranks.procs[1])
        prompt, other = random_prompts([21, 9], seed=78)
        ticket = d.reserve(prompt, greedy(N))
        assert ticket is not None
        p.prefill(prompt, greedy(N), ticket)
        # A request that goes on decoding: with overlap its next step is in flight when the
        # transfer fails, and it must end (pages back) with the engine too.
        prefill.add_request(other, greedy(N))
        with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) exited with code -9"):
            while prefill.has_unfinished():
                prefill.step()
        assert p.take_results() == []  # no answer: a write may still have been landing
        prefill.scheduler.check_invariants()
        s = prefill.stats()
        assert s.running == s.waiting == 0 and s.pages_in_use == 0
        assert d.cancel(ticket.request_id)  # what the router does once the process is gone
        _idle(decode)
    finally:
        prefill.close()


def test_a_shared_mooncake_store_l3_serves_the_decode_sides_prefix(
    tiny_llama_dir: Path, engines: dict[str, Engine], tmp_path: Path
) -> None:
    """Both sides with the Mooncake store as L3 (one local master): P's pages are written
    through to the store as its tree takes them; with both sides' L1 and L2 dropped, P loads
    the system prefix from L3 to compute the question, and D loads it from L3 when it
    reserves, so it receives only the question's pages."""
    system, q1, q2 = random_prompts([32, 6, 7], seed=80)
    with run_master(tmp_path / "master.log") as master:
        kw = {
            "num_pages": L1_PAGES,
            "hicache_storage_backend": "mooncake",
            "hicache_storage_backend_extra_config": json.dumps(master.config),
        }
        prefill = _engine(
            tiny_llama_dir, "prefill", "on", **kw, hicache_storage_dir=str(tmp_path / "p")
        )
        decode = _engine(
            tiny_llama_dir, "decode", "on", **kw, hicache_storage_dir=str(tmp_path / "d")
        )
        try:
            tokens, ticket, _ = disagg_generate(prefill, decode, system + q1, N)
            assert tokens == colocated_tokens(engines["colocated"], system + q1, N)
            assert ticket.held_len == 0
            for engine in (prefill, decode):  # the writes are asynchronous: until they land
                engine.cache.hierarchy.disk.flush(None)  # type: ignore[attr-defined]
            assert decode.flush_cache() and prefill.flush_cache()  # L1, L2 gone; L3 stays
            before, p_before = decode.stats(), prefill.stats()
            tokens, ticket, result = disagg_generate(prefill, decode, system + q2, N)
            after = decode.stats()
            assert _delta(prefill.stats(), p_before, "loaded_storage_pages_total") == 8
            assert tokens == colocated_tokens(engines["colocated"], system + q2, N)
            assert _delta(after, before, "loaded_storage_pages_total") == 8
            assert ticket.held_len == 32 and result.bytes == 2 * _page_bytes(decode)
            assert _delta(after, before, "computed_tokens_total") == N - 1
            _idle(prefill, decode)
        finally:
            prefill.close()
            decode.close()
