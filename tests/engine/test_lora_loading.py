"""LoRA adapters loaded and unloaded while an engine serves (SGLang's and vLLM's
``/load_lora_adapter``): a loaded adapter's tokens equal PEFT's; one unloaded mid-request
finishes that request with its own weights and refuses the next; a name loaded again with
other weights never answers from the old weights' cache; the KV accounting balances."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import greedy, hf_greedy, peft_greedy, random_prompts, run_to_completion
from engine_helpers import tokens_of as tokens

from radixserve.engine.engine import Engine

N = 8


def serving_engine(model_dir: Path, **kw: object) -> Engine:
    return Engine(str(model_dir), num_pages=256, page_size=4, enable_lora=True, **kw)  # type: ignore[arg-type]


def test_adapters_loaded_while_serving_answer_as_peft(
    tiny_llama_dir: Path, tiny_lora_dir: Path, tiny_attn_lora_dir: Path
) -> None:
    """An engine started with no adapter serves the base model, then each adapter loaded
    into it, mixed in one batch, as PEFT computes them."""
    prompts = random_prompts([9, 14, 6], seed=11)
    engine = serving_engine(tiny_llama_dir)
    assert engine.lora_adapters == {}
    assert engine.generate(prompts[:1], greedy(N))[0].token_ids == hf_greedy(
        tiny_llama_dir, prompts[0], N
    )
    key = engine.load_lora_adapter("all", str(tiny_lora_dir))
    assert engine.load_lora_adapter("all", str(tiny_lora_dir)) == key  # the same files: a no-op
    engine.load_lora_adapter("attn", str(tiny_attn_lora_dir))
    assert list(engine.lora_adapters) == ["all", "attn"]
    choice: list[str | None] = ["all", None, "attn"]
    rids = [engine.add_request(p, greedy(N), lora=a) for p, a in zip(prompts, choice)]
    outs = run_to_completion(engine)
    assert [tokens(outs[r]) for r in rids] == [
        peft_greedy(tiny_llama_dir, tiny_lora_dir, prompts[0], N),
        hf_greedy(tiny_llama_dir, prompts[1], N),
        peft_greedy(tiny_llama_dir, tiny_attn_lora_dir, prompts[2], N),
    ]
    with pytest.raises(ValueError, match="already loaded .* with other weights"):
        engine.load_lora_adapter("all", str(tiny_attn_lora_dir))
    engine.check_invariants()


def test_unloading_drains_the_running_requests(tiny_llama_dir: Path, tiny_lora_dir: Path) -> None:
    """An adapter unloaded while its request decodes: the next request naming it is
    refused, the running one finishes with the adapter's weights, and the weights are freed
    after it."""
    prompt = random_prompts([10], seed=12)[0]
    engine = serving_engine(tiny_llama_dir)
    engine.load_lora_adapter("all", str(tiny_lora_dir))
    rid = engine.add_request(prompt, greedy(N), lora="all")
    outs = [*engine.step(), *engine.step()]  # prefilled, decoding
    assert not any(o.finished for o in outs)
    engine.unload_lora_adapter("all")
    assert engine.lora_adapters == {}
    with pytest.raises(ValueError, match="unknown LoRA adapter 'all'"):
        engine.add_request(prompt, greedy(N), lora="all")
    lora = engine.model.lora
    assert lora is not None and lora.draining
    rest = run_to_completion(engine)[rid]
    got = [t for o in outs if o.request_id == rid for t in o.new_token_ids] + tokens(rest)
    assert got == peft_greedy(tiny_llama_dir, tiny_lora_dir, prompt, N)
    assert not lora.draining
    with pytest.raises(ValueError, match="unknown LoRA adapter 'all'"):
        engine.unload_lora_adapter("all")
    engine.check_invariants()


def test_a_name_loaded_again_with_other_weights_misses_the_old_cache(
    tiny_llama_dir: Path, tiny_lora_dir: Path, tiny_attn_lora_dir: Path
) -> None:
    """The cache key carries the files' digest: a prompt cached under ``x`` by the first
    weights is a miss for ``x`` loaded again from other files, whose answer is theirs."""
    prompt = random_prompts([24], seed=13)[0]
    engine = serving_engine(tiny_llama_dir)

    def cached_and_tokens() -> tuple[int, list[int]]:
        rid = engine.add_request(prompt, greedy(N), lora="x")
        out = run_to_completion(engine)[rid]
        usage = out[-1].usage
        assert usage is not None
        return usage.cached_tokens, tokens(out)

    first = engine.load_lora_adapter("x", str(tiny_lora_dir))
    assert cached_and_tokens()[0] == 0
    assert cached_and_tokens()[0] == 20  # its own pages: every whole one but the last token's
    engine.unload_lora_adapter("x")
    assert engine.load_lora_adapter("x", str(tiny_attn_lora_dir)) != first
    assert cached_and_tokens() == (0, peft_greedy(tiny_llama_dir, tiny_attn_lora_dir, prompt, N))
    engine.check_invariants()


def test_loading_is_bounded_and_checked(
    tiny_llama_dir: Path, tiny_lora_dir: Path, tiny_attn_lora_dir: Path, tmp_path: Path
) -> None:
    """``max_loaded_loras`` bounds the adapters served at once; a bad name or path is a
    ``ValueError`` that leaves what is served as it was; an engine without LoRA enabled
    refuses loads."""
    engine = serving_engine(tiny_llama_dir, max_loaded_loras=1)
    engine.load_lora_adapter("a", str(tiny_lora_dir))
    with pytest.raises(ValueError, match="max-loaded-loras"):
        engine.load_lora_adapter("b", str(tiny_attn_lora_dir))
    for name, path, why in [
        ("base:a", str(tiny_lora_dir), "name has no whitespace"),
        ("", str(tiny_lora_dir), "1 to 128 characters"),
        ("a" * 129, str(tiny_lora_dir), "1 to 128 characters"),
    ]:
        with pytest.raises(ValueError, match=why):
            engine.load_lora_adapter(name, path)
    engine.unload_lora_adapter("a")
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        engine.load_lora_adapter("b", str(tmp_path))
    # A worker reads the files off its loop, then serves them: the room is checked again.
    read = engine.read_lora_adapter("c", str(tiny_lora_dir))
    assert engine.lora_adapters == {}
    engine.load_lora_adapter("b", str(tiny_attn_lora_dir))
    with pytest.raises(ValueError, match="max-loaded-loras"):
        engine.add_lora_adapter(read)
    assert list(engine.lora_adapters) == ["b"]
    plain = Engine(str(tiny_llama_dir), num_pages=64, page_size=4)
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.load_lora_adapter("a", str(tiny_lora_dir))


def test_random_loads_unloads_and_requests_keep_every_answer(
    tiny_llama_dir: Path, tiny_lora_dir: Path, tiny_attn_lora_dir: Path
) -> None:
    """Seeded random interleavings of loads (a name with either adapter's files), unloads,
    requests naming whatever is served, and steps: every request answers as PEFT's model of
    the files its adapter had when it was added (slots are never handed to another adapter
    while a request holds them), refusals are exactly the loads of a name served with other
    files, and the KV accounting balances throughout."""
    import random

    files = {"A": tiny_lora_dir, "B": tiny_attn_lora_dir}
    prompts = random_prompts([6, 9, 11], seed=14)
    refs = {
        (i, f): peft_greedy(tiny_llama_dir, files[f], p, 4)
        if f
        else hf_greedy(tiny_llama_dir, p, 4)
        for i, p in enumerate(prompts)
        for f in (None, "A", "B")
    }
    engine = serving_engine(tiny_llama_dir, max_loaded_loras=2)
    rng = random.Random(3)
    served: dict[str, str] = {}  # name -> files
    expected: dict[str, tuple[int, str | None]] = {}  # request id -> (prompt, files)
    got: dict[str, list[int]] = {}

    def step() -> None:
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)

    for _ in range(150):
        op = rng.choice(["add", "add", "step", "step", "load", "unload"])
        name = rng.choice(["x", "y"])
        if op == "add":
            lora = rng.choice([None, *served])
            i = rng.randrange(len(prompts))
            rid = engine.add_request(prompts[i], greedy(4), lora=lora)
            expected[rid] = (i, None if lora is None else served[lora])
        elif op == "step":
            step()
        elif op == "load":
            f = rng.choice(["A", "B"])
            clash = name in served and served[name] != f
            full = name not in served and len(served) == 2
            if clash or full:
                with pytest.raises(ValueError):
                    engine.load_lora_adapter(name, str(files[f]))
            else:
                engine.load_lora_adapter(name, str(files[f]))
                served[name] = f
        elif name in served:
            engine.unload_lora_adapter(name)
            del served[name]
        engine.check_invariants()
    while engine.has_unfinished():
        step()
    assert {rid: got[rid] for rid in expected} == {rid: refs[k] for rid, k in expected.items()}
    lora = engine.model.lora
    assert lora is not None and not lora.draining and set(lora.cache_keys) == set(served)
