"""The DSL's constrained gens over the in-process engine (tiny Llama, sampled): regex, JSON
schema, grammar, and the typed gens (int, float, bool) whose values always parse."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from constrained_cases import ARITH_EBNF, ARITH_REGEX, IPV4_REGEX, PERSON_SCHEMA

from frontend_dsl import FakeBackend, gen, gen_bool, gen_float, gen_int, gen_json, program
from frontend_dsl.engine_backend import EngineBackend


@pytest.fixture(scope="module")
def backend(tiny_llama_dir: Path) -> Iterator[EngineBackend]:
    b = EngineBackend(
        model=str(tiny_llama_dir),
        page_size=4,
        num_pages=2048,
        max_num_tokens=1024,
        max_model_len=1024,
    )
    yield b
    b.close()
    b.engine.check_invariants()


@program
def profile(s, who):  # type: ignore[no-untyped-def]
    s += f"Profile of {who}.\nIP: " + gen("ip", regex=IPV4_REGEX, max_tokens=40)
    s += "\nJSON: " + gen("person", json_schema=PERSON_SCHEMA, max_tokens=400)
    s += "\nSum: " + gen("sum", ebnf=ARITH_EBNF, max_tokens=64)
    s += (
        "\nAge: "
        + gen_int("age")
        + "\nHeight: "
        + gen_float("height")
        + "\nAdmin: "
        + gen_bool("admin")
    )
    s += "\nAgain: " + gen_json(
        "again",
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        max_tokens=40,
    )


def test_typed_and_constrained_gens_parse_under_sampling(backend: EngineBackend) -> None:
    who = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald"]
    states = profile.run_batch(
        [{"who": w} for w in who], backend=backend, defaults={"temperature": 1.0, "top_p": 0.95}
    )
    for st in states:
        assert st.ok, st.error
        assert re.fullmatch(IPV4_REGEX, st["ip"])
        jsonschema.validate(json.loads(st["person"]), PERSON_SCHEMA)
        assert re.fullmatch(ARITH_REGEX, st["sum"]), st["sum"]
        assert (
            isinstance(st["age"], int)
            and isinstance(st["height"], float)
            and isinstance(st["admin"], bool)
        )
        assert isinstance(st["again"], dict) and isinstance(st["again"]["ok"], bool)
        assert re.search(
            rf"\nAdmin: +{str(st['admin']).lower()}\nAgain: ", st.text()
        )  # the parsed value is kept
    assert len({(st["ip"], st["age"]) for st in states}) > 1


def test_typed_gens_parse_without_a_grammar_backend() -> None:
    # A backend that ignores regex still gets stop sequences and a parse.
    answers = {"Height: ": " 1.75 m", "Admin: ": " True, really"}
    backend = FakeBackend(
        responder=lambda prompt, params: next(v for k, v in answers.items() if prompt.endswith(k))
    )

    @program
    def typed(s):  # type: ignore[no-untyped-def]
        s += "Height: " + gen_float("h", constrained=False)
        s += "\nAdmin: " + gen_bool("a", constrained=False)

    st = typed.run(backend=backend)
    assert st.ok, st.error
    assert st["h"] == 1.75 and st["a"] is True
    assert backend.calls[0].params.regex is None and "," in backend.calls[0].params.stop
