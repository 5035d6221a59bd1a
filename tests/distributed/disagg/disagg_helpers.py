"""One prefilled request between a decode and a prefill engine, the messages carried by hand
(what the router does between two workers)."""

from __future__ import annotations

from engine_helpers import greedy, run_to_completion, tokens_of

from radixserve.distributed.disagg.roles import (
    DecodeRole,
    PrefillResult,
    PrefillRole,
    PrefillTicket,
)
from radixserve.engine.engine import Engine


def roles(prefill: Engine, decode: Engine) -> tuple[PrefillRole, DecodeRole]:
    p, d = prefill.disagg, decode.disagg
    assert isinstance(p, PrefillRole) and isinstance(d, DecodeRole)
    return p, d


def prefill_once(
    prefill: Engine, decode: Engine, prompt: list[int], n: int, namespace: str | None = None
) -> tuple[PrefillTicket, PrefillResult]:
    """Reserve on ``decode``, compute on ``prefill`` (pages written), answer ``decode``."""
    p, d = roles(prefill, decode)
    ticket = d.reserve(prompt, greedy(n), namespace=namespace)
    assert ticket is not None
    p.prefill(prompt, greedy(n), ticket, namespace)
    run_to_completion(prefill)
    (result,) = p.take_results()
    d.finish(result)
    return ticket, result


def disagg_generate(
    prefill: Engine, decode: Engine, prompt: list[int], n: int, namespace: str | None = None
) -> tuple[list[int], PrefillTicket, PrefillResult]:
    """The tokens ``decode`` streams for ``prompt`` once ``prefill`` computed it."""
    ticket, result = prefill_once(prefill, decode, prompt, n, namespace)
    outs = run_to_completion(decode)[ticket.request_id]
    return tokens_of(outs), ticket, result


def colocated_tokens(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """The greedy tokens a colocated ``engine`` gives ``prompt``: what a pair must stream."""
    (out,) = engine.generate([prompt], greedy(n))
    return out.token_ids
