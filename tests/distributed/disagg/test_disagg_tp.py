"""Prefill and decode engines with tensor parallelism on either side (real Mooncake transfer
engines on 127.0.0.1 tcp, one per rank; a spawned process per rank past the first): equal
sizes move rank r's pool into rank r's, differing sizes slice the KV heads; tokens equal one
colocated engine's, the decode side computes no prompt token, the bytes are the pages' bytes
summed over the ranks, and a write that fails on one rank fails the request with no page
leaked on either side."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from disagg_helpers import colocated_tokens, disagg_generate, roles
from engine_helpers import greedy, random_prompts, run_to_completion

from radixserve.distributed.disagg.roles import PrefillTicket
from radixserve.engine.engine import Engine

pytest.importorskip("mooncake.engine", reason="Mooncake wheel (and libibverbs1) not importable")

N = 5
PS = 4


def _engine(model_dir: Path, mode: str | None, tp: int) -> Engine:
    return Engine(
        str(model_dir),
        page_size=PS,
        num_pages=64,
        disaggregation_mode=mode,
        tensor_parallel_size=tp,
        dist_timeout=30.0,
    )


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> Iterator[dict[str, Engine]]:
    """Prefill and decode engines of TP 1 and TP 2 (tiny Llama: 2 KV heads, one per rank at
    TP 2), and a colocated one; every one closed (its rank processes stopped) at the end."""
    made: dict[str, Engine] = {}
    try:
        for name, mode, tp in [
            ("colocated", None, 1),
            ("p1", "prefill", 1),
            ("d1", "decode", 1),
            ("p2", "prefill", 2),
            ("d2", "decode", 2),
        ]:
            made[name] = _engine(tiny_llama_dir, mode, tp)
        yield made
    finally:
        for engine in made.values():
            engine.close()


def _idle(*engines: Engine) -> None:
    """Every page back on every rank (check_invariants audits the other ranks' page tables)."""
    for engine in engines:
        engine.check_invariants()
        assert engine.stats().pages_in_use == 0


def _rank_page_bytes(ticket: PrefillTicket) -> list[int]:
    """Bytes of one page (every layer, K and V) of each decode rank's pool."""
    return [d.num_layers * sum(d.page_bytes) for d in ticket.pools]


@pytest.mark.slow  # spawned rank processes
def test_equal_tp_moves_each_ranks_slice_and_a_failed_rank_fails_cleanly(
    engines: dict[str, Engine],
) -> None:
    p2, d2 = engines["p2"], engines["d2"]
    (prompt,) = random_prompts([21], seed=51)
    computed = d2.stats().computed_tokens_total
    tokens, ticket, result = disagg_generate(p2, d2, prompt, N)
    assert tokens == colocated_tokens(engines["colocated"], prompt, N)
    assert [d.heads for d in ticket.pools] == [(0, 1), (1, 2)]  # one pool per decode rank
    # Decode steps only: no prompt token computed on the decode side.
    assert d2.stats().computed_tokens_total - computed == N - 1
    # 21 tokens: 6 pages from each rank's pool, its head only; together the whole KV.
    assert result.bytes == 6 * sum(_rank_page_bytes(ticket))
    assert result.bytes == 6 * engines["colocated"].pool.bytes_per_page
    p, d = roles(p2, d2)
    assert p.stats().transfer.bytes == result.bytes and p.stats().transfer.failures == 0
    # Rank 1's peer is gone, rank 0's is there: the request fails, nothing is held anywhere.
    ticket = d.reserve(prompt, greedy(N))
    assert ticket is not None
    gone = msgspec.structs.replace(ticket.pools[1], session="127.0.0.1:1")
    p.prefill(prompt, greedy(N), msgspec.structs.replace(ticket, pools=[ticket.pools[0], gone]))
    run_to_completion(p2)
    (failed,) = p.take_results()
    assert failed.first_token is None and "rank(s) [1]" in (failed.error or "")
    assert d.finish(failed) is False
    assert p.stats().transfer.failures == 1 and d.stats().cancelled == 1
    _idle(p2, d2)


@pytest.mark.slow  # spawned rank processes
@pytest.mark.parametrize("pair", [("p1", "d2"), ("p2", "d1")])
def test_differing_tp_slices_the_heads(engines: dict[str, Engine], pair: tuple[str, str]) -> None:
    """TP 1 -> TP 2: rank 0 writes head 0 into decode rank 0, head 1 into rank 1; TP 2 ->
    TP 1: each prefill rank writes its head into its slot of every token of the one pool."""
    prefill, decode = engines[pair[0]], engines[pair[1]]
    system, q = random_prompts([16, 7], seed=52)
    computed = decode.stats().computed_tokens_total
    tokens, ticket, result = disagg_generate(prefill, decode, system + q, N)
    assert tokens == colocated_tokens(engines["colocated"], system + q, N)
    assert (
        result.bytes
        == 6 * engines["colocated"].pool.bytes_per_page
        == 6 * sum(_rank_page_bytes(ticket))
    )
    # A second prompt on the held system prefix: only its own pages move.
    (q2,) = random_prompts([6], seed=53)
    tokens, ticket, result = disagg_generate(prefill, decode, system + q2, N)
    assert tokens == colocated_tokens(engines["colocated"], system + q2, N)
    assert ticket.held_len == 16 and result.bytes == 2 * sum(_rank_page_bytes(ticket))
    assert decode.stats().computed_tokens_total - computed == 2 * (N - 1)
    _idle(prefill, decode)
