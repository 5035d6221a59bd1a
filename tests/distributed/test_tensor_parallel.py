"""One worker over two tensor-parallel ranks (gloo, a spawned rank process): greedy outputs
equal one rank and transformers, cache cold and warm, with chunked prefill and retraction;
every rank holds the same pool and page table; a killed rank ends the engine with an error
that names it, and no process is left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from engine_helpers import (
    check_hidden_states,
    greedy,
    hf_greedy,
    random_prompts,
    run_to_completion,
    tokens_of,
)
from two_nodes import node_one

from radixserve.distributed.ranks import RankFailure
from radixserve.distributed.topology import TensorParallel
from radixserve.engine.engine import Engine

N = 12


def _tp_engine(path: Path, **kw: object) -> Engine:
    return Engine(path, tensor_parallel_size=2, dist_timeout=30.0, **kw)  # type: ignore[arg-type]


def _assert_gone(engine: Engine) -> None:
    assert isinstance(engine.topology, TensorParallel)
    for proc in engine.topology.ranks.procs.values():
        assert not proc.is_alive()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_tp2_greedy_equals_transformers_cold_and_warm(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(fixture)
    system = random_prompts([21], seed=30)[0]
    prompts = [system + q for q in random_prompts([5, 9, 3], seed=31)]
    refs = [hf_greedy(path, p, N) for p in prompts]
    # max_num_tokens 16: the 30-token prompts prefill in chunks.
    engine = _tp_engine(path, page_size=4, num_pages=96, max_num_tokens=16)
    assert isinstance(engine.topology, TensorParallel)
    store = (
        engine.topology.ranks.pc.store_path
    )  # one host: no TCPStore any local process could reach
    assert store is not None and os.stat(os.path.dirname(store)).st_mode & 0o777 == 0o700
    try:
        assert engine.model.local_config.num_kv_heads == 1  # half of the 2 KV heads
        cached = []
        for warm in (False, True):
            rids = [engine.add_request(p, greedy(N)) for p in prompts]
            outs = run_to_completion(engine)  # check_invariants (rank audit) after every step
            assert [tokens_of(outs[r]) for r in rids] == refs, f"warm={warm}"
            cached.append([outs[r][-1].usage.cached_tokens for r in rids])
        # Warm: every prompt's whole pages come from the cache (cold: only the shared system part).
        assert all(c >= 20 for c in cached[1]) and sum(cached[1]) > sum(cached[0])
        s = engine.stats()
        assert s.pages_in_use == 0 and s.pages_free + s.pages_evictable == s.num_pages
    finally:
        engine.close()
    _assert_gone(engine)
    assert not os.path.exists(os.path.dirname(store))


def test_tp2_hidden_states_equal_transformers(tiny_llama_dir: Path) -> None:
    """Rank 0's final-norm output (after the all-reduce) is the whole hidden state: every
    position's equals transformers', beside a request that does not ask."""
    prompts = random_prompts([13, 6], seed=32)
    engine = _tp_engine(tiny_llama_dir, page_size=4, num_pages=64, max_num_tokens=8)
    try:
        asks = engine.add_request(prompts[0], greedy(5, return_hidden_states=True))
        plain = engine.add_request(prompts[1], greedy(5))
        outs = run_to_completion(engine)
        check_hidden_states(tiny_llama_dir, prompts[0], outs[asks])
        assert all(o.hidden_states is None for o in outs[plain])
    finally:
        engine.close()
    _assert_gone(engine)


def test_tp2_weights_updated_on_every_rank_or_none(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Each rank loads its share of the new checkpoint and copies it only once every rank
    could: the answers are then the new weights' (a rank left on the old ones would mix
    them); a checkpoint no rank can take changes none."""
    import tiny_models

    b = tiny_models.build_tiny_llama(tmp_path / "b", seed=52)
    wider = tiny_models.build_tiny_llama(tmp_path / "wider", seed=52, num_layers=3)
    prompt = random_prompts([9], seed=53)[0]
    engine = _tp_engine(tiny_llama_dir, page_size=4, num_pages=64)
    try:
        (out,) = engine.generate([prompt], greedy(N))
        assert out.token_ids == hf_greedy(tiny_llama_dir, prompt, N)
        engine.update_weights_from_disk(str(b), weight_version="v2")
        (out,) = engine.generate([prompt], greedy(N))
        assert out.token_ids == hf_greedy(b, prompt, N) and out.usage.cached_tokens == 0
        with pytest.raises(ValueError, match="num_layers 2 -> 3"):
            engine.update_weights_from_disk(str(wider))
        (again,) = engine.generate([prompt], greedy(N))
        assert again.token_ids == out.token_ids and engine.weight_version == "v2"
        engine.check_invariants()
    finally:
        engine.close()
    _assert_gone(engine)


def test_tp2_retraction_and_uneven_heads(tmp_path: Path) -> None:
    import tiny_models

    # 9 query heads over 3 KV heads (SmolLM2's shape): rank 0 keeps 2 KV heads, rank 1 one.
    path = tiny_models.build_tiny_llama(
        tmp_path / "q9kv3", num_q_heads=9, num_kv_heads=3, head_dim=16, hidden_size=144
    )
    system = random_prompts([24], seed=20)[0]
    prompts = [system + q for q in random_prompts([6, 10, 3, 14, 8], seed=21)]
    n = 20
    refs = [hf_greedy(path, p, n) for p in prompts]
    engine = _tp_engine(
        path,
        page_size=4,
        num_pages=36,
        max_num_tokens=64,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,  # admit greedily: decode must retract
    )
    try:
        rids = [engine.add_request(p, greedy(n)) for p in prompts]
        outs = run_to_completion(engine)
        assert [tokens_of(outs[r]) for r in rids] == refs
        s = engine.stats()
        assert s.retractions_total > 0
        assert s.pages_in_use == 0 and s.pages_free + s.pages_evictable == s.num_pages
    finally:
        engine.close()
    _assert_gone(engine)


def test_killed_rank_fails_the_engine_naming_it(tiny_llama_dir: Path) -> None:
    engine = _tp_engine(tiny_llama_dir, page_size=4, num_pages=64, max_num_tokens=64)
    try:
        assert isinstance(engine.topology, TensorParallel)
        proc = engine.topology.ranks.procs[1]
        engine.check_health()  # all well: the ping goes round
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)
        engine.add_request(random_prompts([7])[0], greedy(4))
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) exited with code -9"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 10  # the dead rank's sockets closed: no timeout wait
        # The failed step's request ended and gave back its pages before the engine stopped.
        engine.scheduler.check_invariants()
        s = engine.stats()
        assert s.running == s.waiting == 0 and s.pages_in_use == 0
        with pytest.raises(RankFailure, match="rank 1"):
            engine.check_health()
    finally:
        engine.close()
    _assert_gone(engine)


def test_hung_rank_times_out_naming_the_collective(tiny_llama_dir: Path) -> None:
    engine = Engine(
        tiny_llama_dir, tensor_parallel_size=2, dist_timeout=2.0, page_size=4, num_pages=64
    )
    try:
        assert isinstance(engine.topology, TensorParallel)
        proc = engine.topology.ranks.procs[1]
        os.kill(proc.pid, signal.SIGSTOP)  # alive but answering nothing
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="collective failed.*[Tt]imed out"):
            engine.check_health()
        assert time.monotonic() - t0 < 10
    finally:
        engine.close()  # kills the stopped rank: no grace period for a failed group
    _assert_gone(engine)


def test_parallel_flags_and_config_checks() -> None:
    import argparse

    from radixserve.commands.engine_args import add_engine_arguments, engine_config
    from radixserve.engine.config import EngineConfig

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = p.parse_args(
        ["--tp", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.5:29500"]
    )
    cfg = EngineConfig.from_kwargs(**engine_config(args))
    assert (cfg.tensor_parallel_size, cfg.nnodes, cfg.node_rank) == (4, 2, 1)
    assert cfg.dist_init_addr == "10.0.0.5:29500" and not cfg.dist_insecure
    # torch.distributed's rendezvous is unauthenticated: no wildcard without --insecure.
    with pytest.raises(ValueError, match="every interface"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, dist_init_addr="0.0.0.0:29500")
    args = p.parse_args(["--tp", "2", "--dist-init-addr", "0.0.0.0:29500", "--insecure"])
    assert EngineConfig.from_kwargs(**engine_config(args)).dist_insecure
    with pytest.raises(ValueError, match="must divide"):
        EngineConfig.from_kwargs(tensor_parallel_size=3, nnodes=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match="need dist_init_addr"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, nnodes=2)


@pytest.mark.slow
def test_smollm2_tp2_equals_transformers(smollm2_dir: Path) -> None:
    """The default model (9 query heads over 3 KV heads: an uneven split) on two ranks."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = [tok.encode(p) for p in ["The capital of France is", "def fibonacci(n):"]]
    refs = [hf_greedy(smollm2_dir, p, 8) for p in prompts]
    engine = _tp_engine(smollm2_dir, page_size=16, num_pages=64, max_num_tokens=48)
    try:
        assert engine.model.local_config.num_kv_heads == 2  # rank 0: KV heads 0-1
        for _ in ("cold", "warm"):
            outs = engine.generate(prompts, greedy(8))
            engine.check_invariants()
            assert [o.token_ids for o in outs] == refs
        assert outs[0].text.strip().startswith("Paris")
    finally:
        engine.close()
    _assert_gone(engine)


@pytest.mark.slow
def test_another_node_with_other_settings_fails_the_start_up(tiny_llama_dir: Path) -> None:
    """Node 1 (its own command line) asks for another page size: rank 0 says so at once."""
    with node_one(tiny_llama_dir, "--page-size", "8", "--num-threads", "1") as (addr, node1):
        with pytest.raises(RankFailure, match=r"page_size=4 \(rank 0\) vs page_size=8"):
            Engine(
                tiny_llama_dir,
                tensor_parallel_size=2,
                nnodes=2,
                dist_init_addr=addr,
                page_size=4,
                num_pages=64,
                num_threads=1,
            )
        assert node1.wait(timeout=60) == 1  # at once: no local ranks to join (test_stop_ranks)
