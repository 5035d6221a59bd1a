"""Engine test helpers: HF greedy references (memoized), sampling shorthands, step loops.

A plain module (not conftest) so test files import it by a name unique in the suite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import StepOutput
from radixserve.sampling_params import SamplingParams

GREEDY_TOKENS = 10


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids >= 3: no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


_HF_CACHE: dict[tuple[str, tuple[int, ...], int], list[int]] = {}
_HF_MODELS: dict[str, Any] = {}


def hf_model(model_dir: Path) -> Any:
    """transformers' float32 model of ``model_dir``, loaded once per test session."""
    model = _HF_MODELS.get(str(model_dir))
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        _HF_MODELS[str(model_dir)] = model
    return model


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` continuation of ``prompt`` (``n`` tokens, EOS ignored), memoized."""
    key = (str(model_dir), tuple(prompt), n)
    if key not in _HF_CACHE:
        model = hf_model(model_dir)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),  # else a token 0, the pad id, is masked out
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        _HF_CACHE[key] = out[0, len(prompt) :].tolist()
    return _HF_CACHE[key]


def hf_last_hidden(model_dir: Path, prompt: list[int], model: Any = None) -> torch.Tensor:
    """transformers' final-norm output at ``prompt``'s last token (float32): an embedding's
    reference (``model``: another than ``model_dir``'s, e.g. an adapter merged in)."""
    model = hf_model(model_dir) if model is None else model
    with torch.inference_mode():
        return model.model(torch.tensor([prompt])).last_hidden_state[0, -1]


def hf_class_logits(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' ``*ForSequenceClassification`` logits of one unpadded prompt (float32;
    its last non-pad token pooled), the model loaded once per session."""
    key = f"classify:{model_dir}"
    model = _HF_MODELS.get(key)
    if model is None:
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(
            str(model_dir), dtype=torch.float32
        ).eval()
        _HF_MODELS[key] = model
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0]


def hf_hidden_states(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' ``hidden_states[-1]`` over ``ids`` ([len, hidden], float32): the final
    norm's output, the same as ``last_hidden_state``."""
    model = hf_model(model_dir)
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    last = out.hidden_states[-1][0]
    torch.testing.assert_close(last, model.model(torch.tensor([ids])).last_hidden_state[0])
    return last


def check_hidden_states(model_dir: Path, prompt: list[int], outs: list[StepOutput]) -> None:
    """``outs``' hidden states (return_hidden_states: each output's, the positions read
    since the last, none of them yet to be read) put together equal transformers' over
    ``prompt`` and the output less its last token."""
    got: list[list[float]] = []
    output: list[int] = []
    for o in outs:
        output += o.new_token_ids
        got += o.hidden_states or []
        assert len(got) <= len(prompt) + len(output) - 1, "a position not read yet"
    assert outs[-1].finished
    ref = hf_hidden_states(model_dir, prompt + output[:-1])
    assert len(got) == len(prompt) + len(output) - 1
    torch.testing.assert_close(torch.tensor(got), ref, atol=1e-4, rtol=1e-4)


def peft_greedy(base: Path, adapter: Path, prompt: list[int], n: int) -> list[int]:
    """PEFT's greedy continuation of ``prompt`` by the checkpoint at ``base`` with the LoRA
    adapter at ``adapter`` (float32, ``n`` tokens, EOS ignored)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def greedy(n: int = GREEDY_TOKENS, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def run_to_completion(
    engine: Engine, on_step: Callable[[int], None] | None = None, max_steps: int = 10_000
) -> dict[str, list[StepOutput]]:
    """Step until nothing is unfinished, checking the invariants after every step."""
    outs: dict[str, list[StepOutput]] = {}
    for i in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        engine.check_invariants()
        if on_step is not None:
            on_step(i)
    raise AssertionError("engine did not finish")


def tokens_of(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def solo(engine: Engine, prompt: list[int], params: SamplingParams) -> list[StepOutput]:
    """``prompt`` decoded alone from an empty cache (a cached prompt's last row would be
    computed in a one-row step, on another kernel than the whole prompt's)."""
    assert engine.flush_cache()
    rid = engine.add_request(prompt, params)
    return run_to_completion(engine)[rid]


def logprobs_of(outs: list[StepOutput]) -> list[object]:
    return [lp for o in outs for lp in (o.new_logprobs or [])]


def speculative_mixed_batch(
    base: Engine, spec: Engine, prompt: list[int], greedy_params: Callable[[int], SamplingParams]
) -> dict[str, list[StepOutput]]:
    """The speculative tests' mixed batch (a shared driver): ``prompt`` (greedy, 30 tokens)
    prefills alone on ``spec``, then decodes, speculating, while a 70-token prompt (greedy,
    12 tokens) prefills in chunks beside it and a sampled request (temperature 0.8, 12
    tokens) decodes in the same steps; invariants after every step. Checks what holds for
    every drafter: ``a`` has its solo output on ``base`` (tokens and logprobs), ``b`` its
    tokens, ``c`` its length and no more accepted than drafted. Returns the outputs by
    name (``a``, ``b``, ``c``) for the caller's own checks."""
    long_prompt = random_prompts([70], seed=7)[0]
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    want_a = solo(base, prompt, greedy_params(30))
    want_b = solo(base, long_prompt, greedy_params(12))
    assert spec.flush_cache()
    a = spec.add_request(prompt, greedy_params(30))
    got: dict[str, list[StepOutput]] = {}
    for o in spec.step():  # a's prefill alone, as in its solo run
        got.setdefault(o.request_id, []).append(o)
    b = spec.add_request(long_prompt, greedy_params(12))
    c = spec.add_request(random_prompts([5], seed=9)[0], sampled)
    for rid, outs in run_to_completion(spec).items():
        got.setdefault(rid, []).extend(outs)
    assert tokens_of(got[a]) == tokens_of(want_a)
    assert logprobs_of(got[a]) == logprobs_of(want_a)
    assert tokens_of(got[b]) == tokens_of(want_b)
    assert len(tokens_of(got[c])) == 12
    usage_c = got[c][-1].usage
    assert usage_c is not None and usage_c.spec_accepted_tokens <= usage_c.spec_drafted_tokens
    return {"a": got[a], "b": got[b], "c": got[c]}
