"""LoRA adapters in the engine: greedy tokens equal PEFT's adapted transformers model's, for
every adapter and the base model mixed in one batch, and the radix cache shares a prefix
only between requests of the same adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    greedy,
    hf_greedy,
    peft_greedy,
    random_prompts,
    run_to_completion,
    tokens_of,
)
from tiny_models import build_lora_adapter

from radixserve.engine.engine import Engine
from radixserve.model.decoder_stack import DecoderStack

N = 8


@pytest.fixture(scope="module")
def adapters(
    tiny_llama_dir: Path, tiny_lora_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    return {
        "all": tiny_lora_dir,  # every projection, rank 4
        # Attention only, rank 8, with rsLoRA's scaling.
        "attn": build_lora_adapter(
            tiny_llama_dir,
            tmp_path_factory.mktemp("lora") / "attn",
            targets=("q_proj", "v_proj", "o_proj"),
            rank=8,
            alpha=4.0,
            use_rslora=True,
            seed=2,
        ),
    }


def lora_engine(model_dir: Path, adapters: dict[str, Path], **kw: Any) -> Engine:
    specs = [f"{name}={path}" for name, path in adapters.items()]
    return Engine(str(model_dir), num_pages=512, page_size=4, lora_paths=specs, **kw)


def test_mixed_batch_equals_peft(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    prompts = random_prompts([9, 17, 5, 12, 21, 3], seed=4)
    choice: list[str | None] = ["all", None, "attn", "all", "attn", None]
    refs = [
        hf_greedy(tiny_llama_dir, p, N)
        if a is None
        else peft_greedy(tiny_llama_dir, adapters[a], p, N)
        for p, a in zip(prompts, choice)
    ]
    base = [hf_greedy(tiny_llama_dir, p, N) for p in prompts]
    assert all(r != b for r, b, a in zip(refs, base, choice) if a is not None), (
        "adapters change nothing"
    )
    # Small chunks: prompts prefill over several steps beside others' decode rows.
    engine = lora_engine(tiny_llama_dir, adapters, max_num_tokens=10)
    rids = [engine.add_request(p, greedy(N), lora=a) for p, a in zip(prompts, choice)]
    outs = run_to_completion(engine)
    assert [tokens_of(outs[r]) for r in rids] == refs


def test_predicted_outputs_draft_for_adapted_requests_too(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """A prediction drafts for an adapter's request as for the base model's (the answer
    predicted exactly): the deltas' products are the same bits for a verify row as for a
    decode row, so the answers are PEFT's and transformers' and the drafts are accepted."""
    prompt = random_prompts([11], seed=6)[0]
    base_ref = hf_greedy(tiny_llama_dir, prompt, N)
    lora_ref = peft_greedy(tiny_llama_dir, adapters["all"], prompt, N)
    engine = lora_engine(tiny_llama_dir, adapters)
    base = engine.add_request(prompt, greedy(N, prediction=base_ref))
    adapted = engine.add_request(prompt, greedy(N, prediction=lora_ref), lora="all")
    outs = run_to_completion(engine)
    assert tokens_of(outs[base]) == base_ref and tokens_of(outs[adapted]) == lora_ref
    for rid in (base, adapted):
        usage = outs[rid][-1].usage
        assert usage is not None and usage.spec_accepted_tokens == usage.spec_drafted_tokens > 0


def test_cache_shared_within_an_adapter_only(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    prompt = random_prompts([24], seed=5)[0]
    engine = lora_engine(tiny_llama_dir, adapters)

    def cached(lora: str | None) -> int:
        rid = engine.add_request(prompt, greedy(2), lora=lora)
        usage = run_to_completion(engine)[rid][-1].usage
        assert usage is not None
        return usage.cached_tokens

    assert cached(None) == 0
    assert cached("all") == 0  # the base model's pages hold other keys and values
    assert cached("attn") == 0
    assert cached("all") == 20  # its own: every whole page but the last token's
    assert cached(None) == 20
    out = engine.generate([prompt], greedy(N), lora="attn")[0]
    assert out.token_ids == peft_greedy(tiny_llama_dir, adapters["attn"], prompt, N)


def test_unknown_adapter_refused(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    engine = lora_engine(tiny_llama_dir, {"all": adapters["all"]})
    with pytest.raises(ValueError, match="unknown LoRA adapter 'attn'"):
        engine.add_request([5, 6, 7], greedy(2), lora="attn")
    plain = Engine(str(tiny_llama_dir), num_pages=64, page_size=4)
    with pytest.raises(ValueError, match="serves none"):
        plain.add_request([5, 6, 7], greedy(2), lora="all")


def test_int8_weights_in_bfloat16(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    """Over int8 weights in bfloat16 the adapter's deltas add to the quantized layers'
    outputs: its requests answer otherwise than the base model's, and the same alone as
    batched with the base model's and the other adapter's."""
    prompts = random_prompts([10, 14, 6], seed=7)
    engine = lora_engine(tiny_llama_dir, adapters, dtype="bfloat16", quantization="int8")
    alone = [engine.generate([p], greedy(N), lora="all")[0].token_ids for p in prompts]
    base = engine.generate(prompts, greedy(N))
    assert [b.token_ids for b in base] != alone
    engine.flush_cache()
    mixed = engine.generate(prompts * 2, greedy(N), lora=["all"] * 3 + [None, "attn", None])
    assert [m.token_ids for m in mixed[:3]] == alone
    assert [mixed[3].token_ids, mixed[5].token_ids] == [base[0].token_ids, base[2].token_ids]


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("bfloat16", "int8")])
def test_one_call_stack_adds_an_adapters_deltas_as_the_per_layer_path(
    tiny_llama_dir: Path,
    adapters: dict[str, Path],
    dtype: str,
    quantization: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps whose every row is one adapter's run the CPU's one-call decoder stack with the
    adapter's deltas (csrc/decoder_layers.cpp add_lora): the same tokens and logprobs, bit
    for bit, as the per-layer path, which steps mixing adapters take."""
    served = []
    run = DecoderStack.run

    def counted(self: DecoderStack, *args: Any) -> None:
        served.append(len(args) > 4 and args[4] is not None)
        run(self, *args)

    monkeypatch.setattr(DecoderStack, "run", counted)
    prompts = random_prompts([7, 13, 4], seed=8)
    params = greedy(N, logprobs=0)
    engine = lora_engine(tiny_llama_dir, adapters, dtype=dtype, quantization=quantization)
    served.clear()  # the warm-up's base-model forwards
    results = []
    for stack in (True, False):
        engine.model.native_stack = stack
        engine.flush_cache()
        outs = engine.generate(prompts, params, lora="attn")
        results.append([(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs])
    assert results[0] == results[1]
    assert served and all(served), "the stack served the adapter's steps"


def test_closing_a_session_releases_an_adapters_lease(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """An adapter's turn of a session leases its path in the adapter's namespace; closing
    the session, by its id and tenant as clients do, releases that lease."""
    engine = lora_engine(tiny_llama_dir, adapters)
    prompt = random_prompts([17], seed=9)[0]
    engine.add_request(prompt, greedy(2), session_id="agent", lora="all")
    run_to_completion(engine)
    assert engine.stats().leased_pages > 0
    assert engine.close_session("agent") and not engine.close_session("agent")
    assert engine.stats().leased_pages == 0
