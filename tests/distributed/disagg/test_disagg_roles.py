"""A prefill engine and a decode engine (two Engines, two real Mooncake transfer engines on
127.0.0.1 tcp): the decode side computes no prompt token, receives only what it lacks, and
leaks no page when a prefill is aborted or its transfer fails."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from disagg_helpers import disagg_generate, prefill_once, roles
from engine_helpers import greedy, random_prompts, run_to_completion, tokens_of

from radixserve.distributed.disagg.roles import PrefillResult
from radixserve.engine.engine import Engine

pytest.importorskip("mooncake.engine", reason="Mooncake wheel (and libibverbs1) not importable")

N = 5
PS = 4


def _engine(model_dir: Path, mode: str | None, **kw: object) -> Engine:
    return Engine(str(model_dir), page_size=PS, num_pages=64, disaggregation_mode=mode, **kw)


def _idle(engine: Engine) -> None:
    engine.check_invariants()
    assert engine.stats().pages_in_use == 0


def test_prefilled_tokens_equal_colocated_and_held_prefixes_are_not_sent(
    tiny_llama_dir: Path,
) -> None:
    system, q1, q2 = random_prompts([32, 6, 7], seed=47)
    colocated = _engine(tiny_llama_dir, None)
    want = [o.token_ids for o in colocated.generate([system + q1, system + q2], greedy(N))]
    prefill, decode = _engine(tiny_llama_dir, "prefill"), _engine(tiny_llama_dir, "decode")
    try:
        page_bytes = decode.pool.bytes_per_page
        tokens, ticket, result = disagg_generate(prefill, decode, system + q1, N)
        assert tokens == want[0]
        assert ticket.held_len == 0 and len(ticket.fill_pages) == 10  # 38 tokens
        assert result.bytes == 10 * page_bytes
        s = decode.stats()  # no prompt token computed here: one forward token per decode step
        assert s.computed_tokens_total == N - 1 and s.prompt_tokens_total == 38
        # The decode side now holds the system prompt's 8 pages: only the rest moves.
        tokens, ticket, result = disagg_generate(prefill, decode, system + q2, N)
        assert tokens == want[1]
        assert ticket.held_len == 32 and len(ticket.fill_pages) == 2  # 39 tokens
        assert result.bytes == 2 * page_bytes
        assert decode.stats().computed_tokens_total == 2 * (N - 1)
        assert decode.stats().cached_prompt_tokens_total == 32
        # Another tenant's identical prompt finds nothing held on either side.
        tokens, ticket, result = disagg_generate(prefill, decode, system + q2, N, "tenant-b")
        assert tokens == want[1] and ticket.held_len == 0 and result.bytes == 10 * page_bytes
        p, d = roles(prefill, decode)
        assert p.stats().transfer.bytes == 22 * page_bytes
        assert p.stats().moved_tokens == d.stats().moved_tokens == 38 + 7 + 39
        assert d.stats().held_tokens == 32 and d.stats().requests == 3
        assert prefill.stats().cached_prompt_tokens_total == 0 + 32 + 0
        _idle(prefill)
        _idle(decode)
    finally:
        prefill.close()
        decode.close()


def test_an_aborted_prefill_or_a_failed_transfer_leaks_no_page(tiny_llama_dir: Path) -> None:
    (prompt,) = random_prompts([24], seed=48)
    prefill = _engine(tiny_llama_dir, "prefill", max_num_tokens=8)  # 3 chunks
    decode = _engine(tiny_llama_dir, "decode")
    try:
        p, d = roles(prefill, decode)
        # Aborted mid-prefill: nothing is written; the answer gives the reservation back.
        ticket = d.reserve(prompt, greedy(N))
        assert ticket is not None
        rid = p.prefill(prompt, greedy(N), ticket)
        prefill.step()
        decode.check_invariants()  # the reserved pages are counted as held
        prefill.abort(rid)
        run_to_completion(prefill)
        (result,) = p.take_results()
        assert result.first_token is None and result.error == "abort"
        assert d.finish(result) is False
        # The decode side is gone before the transfer: it fails, the prefill side frees.
        ticket = d.reserve(prompt, greedy(N))
        assert ticket is not None
        dead = [msgspec.structs.replace(d, session="127.0.0.1:1") for d in ticket.pools]
        p.prefill(prompt, greedy(N), msgspec.structs.replace(ticket, pools=dead))
        run_to_completion(prefill)
        (result,) = p.take_results()
        assert result.first_token is None and "TransferError" in (result.error or "")
        d.finish(result)
        assert d.stats().cancelled == 2 and p.stats().transfer.failures == 1
        _idle(prefill)
        _idle(decode)
        # Both still serve: a prefilled request after the failures.
        _, result = prefill_once(prefill, decode, prompt, N)
        assert result.first_token is not None
        run_to_completion(decode)
        _idle(decode)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("regex", [None, r"[0-9]{2,5}"])
def test_logprobs_of_a_prefilled_request_equal_colocated(
    tiny_llama_dir: Path, regex: str | None
) -> None:
    """The first token's logprobs come from the prefill side, the rest from the decode side:
    tokens and logprobs (with top alternatives and named tokens') equal a colocated engine's; with a grammar,
    the prefill side samples the first token under its mask and the decode side's grammar
    takes it, so the constrained output is the colocated one too."""
    (prompt,) = random_prompts([21], seed=49)
    params = greedy(N, logprobs=2, regex=regex, logprob_token_ids=[4, 9])
    colocated = _engine(tiny_llama_dir, None)
    rid = colocated.add_request(prompt, params)
    want = run_to_completion(colocated)[rid]
    colocated.close()
    prefill, decode = _engine(tiny_llama_dir, "prefill"), _engine(tiny_llama_dir, "decode")
    try:
        p, d = roles(prefill, decode)
        ticket = d.reserve(prompt, params)
        assert ticket is not None
        p.prefill(prompt, params, ticket)
        run_to_completion(prefill)
        (result,) = p.take_results()
        assert result.first_logprob is not None
        wire = msgspec.msgpack.encode(result)  # the worker's answer travels as msgpack
        assert msgspec.msgpack.decode(wire, type=PrefillResult) == result
        d.finish(result)
        got = run_to_completion(decode)[ticket.request_id]
        assert tokens_of(got) == tokens_of(want)
        lps = [lp for o in got for lp in o.new_logprobs or []]
        ref = [lp for o in want for lp in o.new_logprobs or []]
        assert len(lps) == len(ref) == len(tokens_of(want)) > 1
        for a, b in zip(lps, ref, strict=True):  # same kernels, same rows: to rounding
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 2
            assert a.asked == pytest.approx(b.asked, abs=1e-4) and len(a.asked) == 2
        _idle(prefill)
        _idle(decode)
    finally:
        prefill.close()
        decode.close()
