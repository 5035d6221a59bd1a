"""A router with one prefill and one decode worker (``serve --disaggregation prefill:1,decode:1``;
real Mooncake transfer engines on 127.0.0.1 tcp): streamed tokens identical to a colocated
engine, the prompt's KV moved (pages x page bytes) and no prompt token computed on the decode
side, a prefix the decode side holds not moved again; a client abort, a reservation whose
KV never comes (the prefill worker stopped: the lease runs out) and a decode worker killed
mid-stream each end cleanly, with every page back on both sides; a prefill worker of two
tensor-parallel ranks feeds a decode worker of one."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from radixserve.commands.serve import disaggregation_overrides
from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client, ServerError
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig
from radixserve.serving.wire import protocol as p

pytest.importorskip("mooncake.engine", reason="Mooncake wheel (and libibverbs1) not importable")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ENGINE = dict(num_pages=128, page_size=4, max_num_tokens=64, max_running_requests=8)
PROMPT = "The quick brown fox jumps over the lazy dog. Prefix caching"
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LEASE_S = 4.0
ROUTER = dict(
    endpoint="tcp://127.0.0.1:*",
    heartbeat_interval_s=0.1,
    client_probe_interval_s=0.1,
    tokenizer_workers=1,
    restart_workers=False,
    disaggregation=True,
    disaggregation_timeout_s=LEASE_S,
)


def _server(
    model: Path,
    overrides: list[dict[str, Any]],
    engine: dict[str, Any] = ENGINE,
    router: dict[str, Any] = ROUTER,
) -> LocalServer:
    """A router and one worker per entry of ``overrides``, every worker checking the KV
    invariants at each stats request."""
    return LocalServer(
        model,
        num_workers=len(overrides),
        config=RouterConfig(**router),
        engine_config=engine,
        worker_overrides=overrides,
        worker_env={"RADIXSERVE_DEBUG_INVARIANTS": "1"},
    )


def _until(cond: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _engines(c: Client) -> dict[str, dict[str, Any]]:
    """Each live worker's engine stats, by its disaggregation mode."""
    out = {}
    for w in c.stats().workers:
        if w.alive:
            out[w.engine["disaggregation"]["mode"]] = w.engine
    return out


def _balanced(c: Client, modes: tuple[str, ...] = ("prefill", "decode")) -> bool:
    e = _engines(c)
    return all(
        e[m]["pages_in_use"] == 0 and e[m]["invariants"] == "ok" and e[m]["running"] == 0
        for m in modes
    )


def test_prefill_decode_pair_streams_colocated_tokens_and_ends_cleanly(
    tiny_llama_dir: Path,
) -> None:
    from radixserve.engine.engine import Engine

    colocated = Engine(tiny_llama_dir, **ENGINE)
    (want,) = colocated.generate([PROMPT], PARAMS)
    page_bytes = colocated.pool.bytes_per_page
    colocated.close()
    args = argparse.Namespace(disaggregation="prefill:1,decode:1", workers=1)
    overrides = disaggregation_overrides(args)
    assert args.workers == 2 and overrides is not None
    with _server(tiny_llama_dir, overrides) as srv:
        with Client(srv.endpoint, timeout=60) as c:
            events = list(c.stream(PROMPT, params=PARAMS))
            final = events[-1]
            assert isinstance(final, p.GenerateFinal)
            chunks = [e for e in events if isinstance(e, p.GenerateChunk)]
            assert len(chunks) > 1 and final.token_ids == want.token_ids
            assert [t for ch in chunks for t in ch.token_ids] == want.token_ids
            e = _engines(c)
            n_prompt = final.usage.prompt_tokens
            moved = e["prefill"]["disaggregation"]["transfer"]["bytes"]
            assert moved == -(-n_prompt // 4) * page_bytes  # every page of the prompt
            assert e["decode"]["computed_tokens_total"] == PARAMS.max_tokens - 1  # decode only
            # Again: the decode worker holds the prompt's whole pages; only the tail moves.
            again = c.generate(PROMPT, params=PARAMS)
            assert again.token_ids == want.token_ids
            e = _engines(c)
            held = e["decode"]["disaggregation"]["held_tokens"]
            assert held > 0
            moved2 = e["prefill"]["disaggregation"]["transfer"]["bytes"] - moved
            assert moved2 == (-(-n_prompt // 4) - held // 4) * page_bytes
            assert srv.router.split is not None and srv.router.split.stats().prefilled == 2

            # A client that aborts at once: whichever stage the abort meets, no page is left.
            rid = c.submit(PROMPT + " and aborted", stream=True, params=PARAMS)
            c.abort(rid)
            assert _until(lambda: _balanced(c))

            # The prefill worker stops answering: the decode worker's lease runs out, it
            # gives the pages back and the request fails with a timeout.
            pre, dec = srv.procs
            os.kill(pre.pid, signal.SIGSTOP)
            try:
                with pytest.raises(ServerError) as err:
                    c.generate(PROMPT + " with a lease", params=PARAMS)
                assert err.value.code == "timeout", err.value
            finally:
                os.kill(pre.pid, signal.SIGCONT)
            # Resumed, it computes the prompt but writes nothing past the lease.
            assert _until(lambda: _balanced(c))
            assert _engines(c)["prefill"]["disaggregation"]["transfer"]["transfers"] == 2

            # The decode worker dies mid-stream: the client gets a clean error.
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = c.stream(PROMPT, params=long)
            assert isinstance(next(stream), p.GenerateChunk)
            dec.kill()
            with pytest.raises(ServerError) as err:
                list(stream)
            assert err.value.code == "worker_died", err.value
            assert _until(lambda: _balanced(c, ("prefill",)))


@pytest.mark.timeout(600)  # three worker processes start on a shared 2-core machine
def test_a_prefill_worker_killed_mid_prefill_is_retried_on_another(tiny_llama_dir: Path) -> None:
    """Two prefill workers, one decode worker: the prefill worker computing a long prompt
    (chunked, 8 tokens a step) is killed (SIGKILL) while it computes; the router gives the
    decode worker's reservation back and sends the request to the other prefill worker; the
    client gets the colocated tokens, and both survivors end with no page in use."""
    from radixserve.engine.engine import Engine

    engine = {**ENGINE, "num_pages": 512}
    long_prompt = " ".join([PROMPT] * 40)
    colocated = Engine(tiny_llama_dir, **engine)
    (want,) = colocated.generate([long_prompt], PARAMS)
    colocated.close()
    chunked = {"disaggregation_mode": "prefill", "max_num_tokens": 8}
    with _server(
        tiny_llama_dir,
        [chunked, chunked, {"disaggregation_mode": "decode"}],
        engine,
        {**ROUTER, "disaggregation_timeout_s": 120.0},
    ) as srv:
        split = srv.router.split
        assert split is not None
        with Client(srv.endpoint, timeout=120) as c:
            rid = c.submit(long_prompt, stream=True, params=PARAMS)
            pair: Any = None

            def computing() -> bool:  # the pair's prefill went out (the router's own state)
                nonlocal pair
                pairs = list(split._pairs.values())
                pair = pairs[0] if pairs else None
                return pair is not None and pair.stage == "prefill"

            assert _until(computing, timeout=60)
            srv.procs[pair.prefill].kill()
            events = list(c.events(rid))
            final = events[-1]
            assert isinstance(final, p.GenerateFinal), final
            assert final.token_ids == want.token_ids
            s = split.stats()
            assert (s.prefilled, s.failed) == (1, 1)  # the killed try, then the retry
            assert _until(lambda: _balanced(c))  # no page left on the decode side
            assert _engines(c)["decode"]["computed_tokens_total"] == PARAMS.max_tokens - 1


def test_a_tensor_parallel_prefill_worker_feeds_a_one_rank_decode_worker(
    tiny_llama_dir: Path,
) -> None:
    """Prefill worker at TP 2 (each rank one of the 2 KV heads), decode worker at TP 1: each
    prefill rank writes its head into every token of the decode pool's pages; the ticket's
    pool list and the answer cross the router as for one rank."""
    from radixserve.engine.engine import Engine

    colocated = Engine(tiny_llama_dir, **ENGINE)
    (want,) = colocated.generate([PROMPT], PARAMS)
    page_bytes = colocated.pool.bytes_per_page
    colocated.close()
    overrides = [
        {"disaggregation_mode": "prefill", "tensor_parallel_size": 2, "dist_timeout": 30.0},
        {"disaggregation_mode": "decode"},
    ]
    with _server(tiny_llama_dir, overrides) as srv:
        with Client(srv.endpoint, timeout=60) as c:
            final = c.generate(PROMPT, params=PARAMS)
            assert final.token_ids == want.token_ids
            e = _engines(c)
            moved = e["prefill"]["disaggregation"]["transfer"]["bytes"]
            assert moved == -(-final.usage.prompt_tokens // 4) * page_bytes  # both ranks' halves
            assert e["decode"]["computed_tokens_total"] == PARAMS.max_tokens - 1  # decode only
            assert _balanced(c)
