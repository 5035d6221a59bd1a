"""``Engine.release_memory_occupation`` / ``resume_memory_occupation`` (SGLang's memory
release, vLLM's sleep and wake-up) on a real tiny model: releasing the KV cache gives its
pool's memory back to the OS (the process's resident memory falls by nearly the pool's
size) and leaves it reading as zeros; after the resume the engine answers as transformers
does and its page accounting balances; a running request refuses it, a retracted one does
not. Released weights read as zeros, no step runs and no update applies until they are
resumed; an update then serves the new checkpoint token for token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import greedy, hf_greedy, random_prompts

from radixserve.engine.engine import Engine
from radixserve.model.weight_update import served_tensors

N = 8
# 9,216 pages of 16 tokens at 512 bytes a token (2 layers, 2 KV heads of 16, K and V, float32):
# a 72 MiB pool, so that the drop in resident memory stands out from the allocator's noise.
ENGINE: dict[str, Any] = dict(num_pages=9216, page_size=16, num_threads=1, dtype="float32")
PROMPTS = random_prompts([13, 9], seed=17)


@pytest.fixture(scope="module")
def engine(llamas: tuple[Path, Path]) -> Engine:
    return Engine(str(llamas[0]), **ENGINE)


def _rss() -> int:
    """This process's resident memory, in bytes (``VmRSS``)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _answers(engine: Engine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, greedy(N))]


def test_releasing_the_kv_cache_gives_the_pool_back_and_resuming_answers_as_before(
    engine: Engine, llamas: tuple[Path, Path]
) -> None:
    expected = [hf_greedy(llamas[0], p, N) for p in PROMPTS]
    assert _answers(engine) == expected  # the tree now caches both
    pool = engine.pool
    assert pool.nbytes >= 64 << 20
    for t in pool.page_tensors():
        t.fill_(1.0)  # every page resident, as after long use
    before = _rss()
    freed = engine.release_memory_occupation(["kv_cache"])
    dropped = before - _rss()
    assert freed >= 0.99 * pool.nbytes and dropped >= 0.9 * pool.nbytes, (freed, dropped)
    assert all(not t.any() for t in pool.page_tensors())  # unwritten slots read as zeros
    assert engine.memory.released == ["kv_cache"] and engine.stats().cached_tokens == 0
    engine.check_invariants()
    engine.resume_memory_occupation(["kv_cache"])
    assert engine.memory.released == []
    assert _answers(engine) == expected
    engine.check_invariants()


def test_a_running_request_refuses_the_release_and_a_retracted_one_waits_it_out(
    engine: Engine, llamas: tuple[Path, Path]
) -> None:
    rid = engine.add_request(PROMPTS[0], greedy(N))
    out = list(engine.step()[0].new_token_ids)
    with pytest.raises(ValueError, match="pause with mode 'retract' or 'abort' first"):
        engine.release_memory_occupation()
    with pytest.raises(ValueError, match=r"unknown memory tags \['gpu'\].*kv_cache"):
        engine.release_memory_occupation(["gpu"])
    assert engine.memory.released == []
    assert engine.retract_running() == 1
    for o in engine.take_outputs():
        out += o.new_token_ids
    engine.release_memory_occupation(["kv_cache"])
    engine.check_invariants()
    engine.resume_memory_occupation()
    while engine.has_unfinished():
        out += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert out == hf_greedy(llamas[0], PROMPTS[0], N)
    engine.check_invariants()


def test_released_weights_read_as_zeros_and_an_update_after_the_resume_serves_it(
    llamas: tuple[Path, Path],
) -> None:
    engine = Engine(str(llamas[0]), num_pages=64, page_size=4, num_threads=1, dtype="float32")
    params = [p for p in engine.model.parameters()]
    freed = engine.release_memory_occupation(["weights"])
    assert freed > 0 and all(not p.any() for p in params)
    assert not any(t.is_mkldnn for _, t in served_tensors(engine.model))  # oneDNN's: dropped
    assert engine.memory.released == ["weights"]
    rid = engine.add_request(PROMPTS[0], greedy(N))  # waits: no step runs
    with pytest.raises(RuntimeError, match="the weights are released"):
        engine.step()
    with pytest.raises(ValueError, match="resume them first"):
        engine.update_weights_from_disk(str(llamas[1]))
    engine.resume_memory_occupation(["weights"])
    engine.update_weights_from_disk(str(llamas[1]), "after-sleep")
    waited: list[int] = []
    while engine.has_unfinished():
        waited += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert waited == hf_greedy(llamas[1], PROMPTS[0], N)
    assert _answers(engine) == [hf_greedy(llamas[1], p, N) for p in PROMPTS]
    engine.check_invariants()


@pytest.mark.parametrize(
    "config",
    [dict(dtype="bfloat16"), dict(dtype="bfloat16", quantization="int8")],
    ids=["bf16-native-stack", "bf16-int8"],
)
def test_released_packed_and_quantized_weights_come_back_with_an_update(
    llamas: tuple[Path, Path], config: dict[str, Any]
) -> None:
    """oneDNN's packed copies (dropped, rebuilt on the resume), the one-call stack that
    lists them and int8's quantized copies: the updated engine answers as one started on
    the new weights."""
    a, b = llamas
    small = dict(num_pages=64, page_size=4, num_threads=1, **config)
    engine = Engine(str(a), **small)
    _answers(engine)  # the stack described, the oneDNN kernels built
    assert engine.release_memory_occupation(["weights"]) > 0
    assert not any(t.is_mkldnn for _, t in served_tensors(engine.model))  # dropped
    engine.resume_memory_occupation()
    engine.update_weights_from_disk(str(b))
    assert _answers(engine) == _answers(Engine(str(b), **small))
    engine.check_invariants()
