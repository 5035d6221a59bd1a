"""Constrained decoding in the engine (tiny random Llama, sampled with temperature > 0).

A random model is the hard case for a grammar: it has no idea what JSON or an IP address
looks like, so every valid output here is the mask's doing, not the model's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from constrained_cases import (
    ARITH_EBNF,
    ARITH_REGEX,
    IPV4_REGEX,
    PERSON_SCHEMA,
    make_tiny_engine,
)

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

PROMPTS = ["hello world", "The capital of France is", "def main():", "1, 2, 3,", "Q: name? A:", "x"]


def sampled(seed: int, **kw: object) -> SamplingParams:
    base: dict[str, object] = dict(temperature=1.0, top_p=0.95, seed=seed, max_tokens=64)
    base.update(kw)
    return SamplingParams(**base)  # type: ignore[arg-type]


def test_ipv4_regex_holds_under_sampling(engine: Engine) -> None:
    n = 24
    outs = engine.generate(
        [PROMPTS[i % len(PROMPTS)] for i in range(n)],
        [sampled(i, regex=IPV4_REGEX, temperature=0.7 + 0.1 * (i % 5)) for i in range(n)],
    )
    for o in outs:
        assert re.fullmatch(IPV4_REGEX, o.text), o.text
        assert o.finish_reason == "stop"
        # EOS (id 2) only where the address may end; a full last octet ends without it.
        assert 2 not in o.token_ids[:-1]
        if len(o.text.rsplit(".", 1)[1]) == 3 or o.text.endswith((".0", ".26")):
            assert o.token_ids[-1] != 2
    assert len({o.text for o in outs}) > n // 2  # sampling really varied


def test_nested_json_schema_validates_under_sampling(engine: Engine) -> None:
    schema = json.dumps(PERSON_SCHEMA)
    n = 16
    outs = engine.generate(
        [PROMPTS[i % len(PROMPTS)] for i in range(n)],
        [sampled(100 + i, json_schema=schema, max_tokens=400, top_p=1.0) for i in range(n)],
    )
    for o in outs:
        assert o.finish_reason == "stop", o.text
        value = json.loads(o.text)  # strict: no raw control characters in strings either
        jsonschema.validate(value, PERSON_SCHEMA)
        assert (
            o.text == json.dumps(value, ensure_ascii=False) or "\\" in o.text
        )  # compact separators


def test_ebnf_grammar_holds_under_sampling(engine: Engine) -> None:
    n = 16
    outs = engine.generate(
        [PROMPTS[i % len(PROMPTS)] for i in range(n)],
        [sampled(200 + i, ebnf=ARITH_EBNF) for i in range(n)],
    )
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(ARITH_REGEX, o.text), o.text
    assert any("(" in o.text for o in outs) and len({o.text for o in outs}) > n // 2
    with pytest.raises(ValueError, match=r'invalid ebnf: .*Rule "nowhere" is not defined'):
        engine.add_request([5, 6], SamplingParams(ebnf="root ::= nowhere"))
    with pytest.raises(ValueError, match="at most one of regex, .* got regex, ebnf"):
        SamplingParams(regex="a", ebnf='root ::= "a"').validate()


def test_choices_and_typed_regexes_parse(engine: Engine) -> None:
    choices = ["positive", "negative", "neutral", 'say "hi"\n']
    typed = {
        "int": r"-?(0|[1-9][0-9]{0,8})",
        "float": r"-?(0|[1-9][0-9]{0,5})\.[0-9]{1,4}",
        "bool": r"(true|false)",
    }
    params = [sampled(i, choices=choices) for i in range(8)]
    params += [sampled(i, regex=rx) for i in range(4) for rx in typed.values()]
    outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    assert {o.text for o in outs[:8]} <= set(choices)
    for o, kind in zip(outs[8:], list(typed) * 4):
        assert o.finish_reason == "stop" and re.fullmatch(typed[kind], o.text), (kind, o.text)
        {"int": int, "float": float, "bool": lambda t: {"true": True, "false": False}[t]}[kind](
            o.text
        )


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(engine: Engine) -> None:
    free = [
        sampled(7, max_tokens=12),
        sampled(8, max_tokens=12, temperature=0.0),
        sampled(9, max_tokens=12, top_k=20),
    ]
    free_prompts = ["the quick brown fox", "def main():", "hello"]
    alone = engine.generate(free_prompts, free)
    constrained = [
        sampled(1, regex=IPV4_REGEX),
        sampled(2, json_schema=json.dumps(PERSON_SCHEMA), max_tokens=400),
        sampled(3, choices=["yes", "no"]),
    ]
    mixed = engine.generate(
        ["x", "y"] + free_prompts[:2] + ["z"] + free_prompts[2:],
        constrained[:2] + free[:2] + constrained[2:] + free[2:],
    )
    together = [mixed[2], mixed[3], mixed[5]]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert re.fullmatch(IPV4_REGEX, mixed[0].text) and mixed[4].text in ("yes", "no")
    jsonschema.validate(json.loads(mixed[1].text), PERSON_SCHEMA)


def test_max_tokens_cuts_a_long_grammar_with_length(engine: Engine) -> None:
    out = engine.generate("abc", sampled(0, regex="[a-z]{40}", max_tokens=5))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert re.fullmatch("[a-z]{1,40}", out.text)
    # An unbounded grammar keeps going until max_tokens; EOS only where the grammar may end.
    outs = engine.generate(
        ["a"] * 6, [sampled(i, regex="[0-9]{3}( [0-9]{3})*", max_tokens=20) for i in range(6)]
    )
    for o in outs:
        assert re.fullmatch("[0-9]{3}( [0-9]{3})*", o.text) or o.finish_reason == "length", o.text
        if o.finish_reason == "stop":
            assert o.token_ids[-1] == 2  # ended by the model's EOS, allowed only at a boundary
    # ignore_eos holds under a grammar too: the end token only where nothing else may follow.
    outs = engine.generate(
        ["a"] * 6,
        [
            sampled(i, regex="[0-9]{3}( [0-9]{3})*", max_tokens=20, ignore_eos=True)
            for i in range(6)
        ],
    )
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("length", 20)] * 6
    assert all(2 not in o.token_ids for o in outs)


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(regex="(unclosed"), "invalid regex"),
        (dict(regex="(?<=a)b"), "invalid regex"),
        (dict(json_schema='{"type": "nope"}'), "invalid json_schema"),
        (dict(json_schema='{"type": "object", "properties": 5}'), "invalid json_schema"),
        (dict(json_schema="{not json"), "not valid JSON"),
        (dict(json_schema="[1, 2]"), "must be a JSON object"),
        (dict(regex="a", choices=["a"]), "at most one"),
        (dict(choices=[]), "at least one"),
    ],
)
def test_invalid_constraint_is_a_clear_error_and_the_engine_keeps_serving(
    engine: Engine, params: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request([5, 6, 7], SamplingParams(**params))  # type: ignore[arg-type]
    assert not engine.has_unfinished()
    out = engine.generate("hello", sampled(0, regex="(yes|no)"))[0]
    assert out.text in ("yes", "no")
    engine.check_invariants()


def test_compilation_is_cached_per_tokenizer_and_constraint(engine: Engine) -> None:
    from radixserve.constrained.grammar import compiler_for

    mc = engine.model_config
    compiler = compiler_for(engine.tokenizer, mc.vocab_size, mc.eos_token_ids)
    before = compiler.stats()
    engine.generate(["a", "b", "c"], [sampled(i, regex="[a-c]{2,3}") for i in range(3)])
    after = compiler.stats()
    assert after.misses - before.misses == 1 and after.hits - before.hits == 2


def test_constrained_answers_reuse_a_shared_prompt(engine: Engine) -> None:
    shared = (
        "You are a JSON generator. Here is a long shared instruction that fills many pages. " * 3
    )
    first = engine.generate(
        shared + "Person 1:", sampled(0, json_schema=json.dumps(PERSON_SCHEMA), max_tokens=400)
    )
    second = engine.generate(
        shared + "Person 2:", sampled(1, json_schema=json.dumps(PERSON_SCHEMA), max_tokens=400)
    )
    prompt_len = second[0].usage.prompt_tokens
    assert second[0].usage.cached_tokens >= prompt_len - 16
    for o in first + second:
        jsonschema.validate(json.loads(o.text), PERSON_SCHEMA)


def test_retraction_keeps_the_grammar_consistent(tiny_llama_dir: Path) -> None:
    # A pool too small for every request's output: decode must retract and recompute.
    engine = make_tiny_engine(
        tiny_llama_dir,
        page_size=4,
        num_pages=72,
        max_num_tokens=64,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
    )
    schema = json.dumps(PERSON_SCHEMA)
    params = [
        sampled(i, json_schema=schema, max_tokens=200) if i % 2 else sampled(i, regex=IPV4_REGEX)
        for i in range(8)
    ]
    outs = engine.generate([f"prompt number {i}" for i in range(8)], params)
    assert engine.stats().retractions_total > 0
    for i, o in enumerate(outs):
        assert o.finish_reason == "stop", o
        if i % 2:
            jsonschema.validate(json.loads(o.text), PERSON_SCHEMA)
        else:
            assert re.fullmatch(IPV4_REGEX, o.text)
    engine.check_invariants()
