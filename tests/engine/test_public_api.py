"""The package's public face: ``from radixserve import Engine, SamplingParams`` (loaded
lazily, so ``import radixserve`` stays torch-free) and ``Engine.generate`` taking one
``SamplingParams``, a dict of its fields (as SGLang's ``Engine.generate`` does), or a list."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import radixserve
from radixserve.sampling_params import SamplingParams, per_prompt


def test_import_stays_light_and_names_resolve_lazily() -> None:
    code = (
        "import sys, radixserve; from radixserve import SamplingParams, GenerateOutput, Usage; "
        "assert 'torch' not in sys.modules, 'import radixserve loaded torch'; "
        "from radixserve import Engine, EngineConfig; assert 'torch' in sys.modules; "
        "print(Engine.__module__, EngineConfig.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["radixserve.engine.engine", "radixserve.engine.config"]
    assert {"Engine", "SamplingParams", "EngineConfig", "GenerateOutput"} <= set(radixserve.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        radixserve.Nope  # noqa: B018


def test_per_prompt_shapes() -> None:
    one = SamplingParams(max_tokens=3)
    assert per_prompt(one, 2) == [one, one]
    assert per_prompt(None, 1) == [SamplingParams()]
    assert (
        per_prompt({"max_tokens": 5, "temperature": 0}, 2)
        == [SamplingParams(max_tokens=5, temperature=0.0)] * 2
    )
    # SGLang's names for max/min tokens are accepted in a dict.
    assert per_prompt({"max_new_tokens": 7, "min_new_tokens": 2}, 1) == [
        SamplingParams(max_tokens=7, min_tokens=2)
    ]
    assert per_prompt([one, {"max_tokens": 9}], 2) == [one, SamplingParams(max_tokens=9)]


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"max_tokenz": 1}, "unknown field `max_tokenz`"),
        ({"max_tokens": "8"}, r"Expected `int`, got `str` - at `\$.max_tokens`"),
        ({"max_new_tokens": 1, "max_tokens": 2}, "both 'max_new_tokens' and 'max_tokens'"),
        ("max_tokens=8", "not str"),
        ([{}, {}, {}], "3 sampling params for 2 prompts"),
        ([{}, 5], "not int"),
    ],
)
def test_per_prompt_wrong_shapes_are_clear_errors(bad: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        per_prompt(bad, 2)


def test_engine_generate_takes_a_dict_for_every_prompt(
    make_engine: Callable[..., Any], tiny_llama_dir: Path
) -> None:
    engine = make_engine(tiny_llama_dir)
    prompts = ["The capital of France is", "Once upon a time"]
    by_dict = engine.generate(prompts, {"max_tokens": 4, "temperature": 0, "ignore_eos": True})
    by_obj = engine.generate(
        prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    assert [o.token_ids for o in by_dict] == [o.token_ids for o in by_obj]
    assert all(len(o.token_ids) == 4 for o in by_dict)
    # One prompt with a dict: the dict is that prompt's parameters, not a list of them.
    assert len(engine.generate("Hello", {"max_tokens": 2, "ignore_eos": True})[0].token_ids) == 2
    with pytest.raises(ValueError, match="3 sampling params for 2 prompts"):
        engine.generate(prompts, [{}, {}, {}])
