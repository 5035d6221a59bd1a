"""A 1 prefill + 1 decode pair in two processes (real Mooncake transfer engines, tcp on
127.0.0.1): tokens identical to one colocated engine, zero prompt tokens computed on the
decode side, bytes = pages x page bytes; a decode process killed before the transfer leaves
the prefill side with no page in use."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import greedy, random_prompts

pytest.importorskip("mooncake.engine", reason="Mooncake wheel (and libibverbs1) not importable")

N = 5


def _serve(conn: Connection, model_dir: str, mode: str) -> None:
    """An engine in ``mode``; answers (method, *args) of its role until ("stop",)."""
    from engine_helpers import run_to_completion, tokens_of

    from radixserve.engine.engine import Engine

    engine = Engine(model_dir, page_size=4, num_pages=64, disaggregation_mode=mode)
    role: Any = engine.disagg
    conn.send("ready")
    while (msg := conn.recv())[0] != "stop":
        if msg[0] == "reserve":
            conn.send(role.reserve(msg[1], greedy(N)))
        elif msg[0] == "prefill":
            role.prefill(msg[1], greedy(N), msg[2])
            run_to_completion(engine)
            (result,) = role.take_results()
            conn.send((result, engine.stats()))
        elif msg[0] == "finish":
            role.finish(msg[1])
            outs = run_to_completion(engine)[msg[1].request_id]
            conn.send((tokens_of(outs), engine.stats()))
    engine.close()


class _Side:
    def __init__(self, model_dir: Path, mode: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, str(model_dir), mode))
        self.proc.start()

    def ask(self, *msg: Any) -> Any:
        self.conn.send(msg)
        assert self.conn.poll(300), f"no answer to {msg[0]}"
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop",))
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@pytest.mark.slow  # two spawned engine processes
def test_a_prefill_decode_pair_matches_colocated_and_survives_a_dead_decoder(
    tiny_llama_dir: Path,
) -> None:
    from radixserve.engine.engine import Engine

    p1, p2 = random_prompts([21, 13], seed=49)
    prefill, decode = _Side(tiny_llama_dir, "prefill"), _Side(tiny_llama_dir, "decode")
    try:
        assert prefill.conn.poll(300) and prefill.conn.recv() == "ready"
        assert decode.conn.poll(300) and decode.conn.recv() == "ready"
        ticket = decode.ask("reserve", p1)
        result, _ = prefill.ask("prefill", p1, ticket)
        tokens, stats = decode.ask("finish", result)
        assert stats.computed_tokens_total == N - 1  # decode steps only: no prompt token
        # The decode process dies with a reservation out: the transfer fails, and the
        # prefill side gives every page back.
        ticket2 = decode.ask("reserve", p2)
        decode.proc.kill()
        decode.proc.join(30)
        failed, pstats = prefill.ask("prefill", p2, ticket2)
        assert failed.first_token is None and "TransferError" in failed.error
        assert pstats.pages_in_use == 0 and pstats.running == 0
    finally:
        prefill.stop()
        decode.stop()
    colocated = Engine(str(tiny_llama_dir), page_size=4, num_pages=64)
    (want,) = colocated.generate([p1], greedy(N))
    assert tokens == want.token_ids
    pool = colocated.pool
    assert result.bytes == 6 * pool.bytes_per_page  # 21 tokens: 6 pages, every layer, K and V
