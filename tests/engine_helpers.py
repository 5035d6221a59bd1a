"""Engine test helpers: HF greedy references (memoized), sampling shorthands, step loops.

A plain module (not conftest) so test files import it by a name unique in the suite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

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
_HF_MODELS: dict[str, object] = {}


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` continuation of ``prompt`` (``n`` tokens, EOS ignored), memoized."""
    key = (str(model_dir), tuple(prompt), n)
    if key not in _HF_CACHE:
        from transformers import AutoModelForCausalLM

        model = _HF_MODELS.get(str(model_dir))
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
            _HF_MODELS[str(model_dir)] = model
        with torch.inference_mode():
            out = model.generate(  # type: ignore[attr-defined]
                torch.tensor([prompt]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        _HF_CACHE[key] = out[0, len(prompt) :].tolist()
    return _HF_CACHE[key]


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
