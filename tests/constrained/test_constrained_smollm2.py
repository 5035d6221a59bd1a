"""Constrained decoding on the real default model (SmolLM2-135M-Instruct), sampled and greedy."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from constrained_cases import IPV4_REGEX, PERSON_SCHEMA

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def chat(engine: Engine, text: str) -> list[int]:
    ids: Any = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_json_ipv4_and_choices_on_smollm2(smollm2_dir: Path) -> None:
    engine = Engine(str(smollm2_dir), page_size=16, num_pages=256, max_num_tokens=1024, seed=0)
    schema = json.dumps(PERSON_SCHEMA)
    prompts = [
        chat(engine, "Give me a JSON profile of a software engineer called Maria."),
        chat(engine, "Describe a fictional guest user as JSON."),
        chat(engine, "What is the IP address of a home router?"),
        chat(engine, "Write an IPv4 address."),
        chat(
            engine, "Is this review positive or negative? 'I loved this movie, it was wonderful!'"
        ),
        chat(engine, "Tell me a joke."),
    ]
    params = [
        SamplingParams(json_schema=schema, temperature=0.7, seed=1, max_tokens=200),
        SamplingParams(json_schema=schema, temperature=0.7, seed=2, max_tokens=200),
        SamplingParams(regex=IPV4_REGEX, temperature=0.8, seed=3, max_tokens=30),
        SamplingParams(regex=IPV4_REGEX, temperature=0.0, max_tokens=30),
        SamplingParams(choices=["positive", "negative"], temperature=0.0, max_tokens=8),
        SamplingParams(temperature=0.0, max_tokens=12),
    ]
    outs = engine.generate(prompts, params)
    for o in outs[:2]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON_SCHEMA)
    for o in outs[2:4]:
        assert re.fullmatch(IPV4_REGEX, o.text) and o.finish_reason == "stop", o.text
    assert outs[4].text == "positive"
    alone = engine.generate([prompts[5]], [params[5]])[0]
    assert outs[5].token_ids == alone.token_ids  # the unconstrained neighbour is unchanged
    engine.check_invariants()
