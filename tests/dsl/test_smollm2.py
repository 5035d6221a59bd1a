"""Programs with checkable answers on the real default model (SmolLM2-135M-Instruct), in process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from frontend_dsl import assistant, gen, gen_int, program, select, system, user
from frontend_dsl.engine_backend import EngineBackend

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def backend(smollm2_dir: Path) -> Iterator[EngineBackend]:
    b = EngineBackend(model=str(smollm2_dir), page_size=16, num_pages=512, max_num_tokens=1024)
    yield b
    b.close()


def test_capital_of_france_generated_and_selected(backend: EngineBackend) -> None:
    @program
    def capital(s):
        s += system("You are a helpful assistant. Answer in one short sentence.")
        s += user("What is the capital of France?")
        s += assistant(gen("answer", max_tokens=16, temperature=0))
        s += user("Which city was that?")
        s += assistant("It was " + select("city", choices=["Paris", "London", "Berlin", "Madrid"]))

    state = capital.run(backend=backend)
    assert state.ok, state.error
    assert "Paris" in state["answer"]
    assert state["city"] == "Paris"
    assert state.usage.cached_tokens > 0  # the select batch and the second turn reuse the first


def test_select_sentiment_classifier(backend: EngineBackend) -> None:
    @program
    def sentiment(s, review):
        s += user(f"Is the following movie review positive or negative?\n\n{review}")
        s += assistant("This review is " + select("label", choices=["positive", "negative"]))

    reviews = {
        "I loved this movie, it was wonderful and moving!": "positive",
        "Terrible. Boring plot and awful acting; I walked out.": "negative",
        "The worst film I have seen this year.": "negative",
        "An absolute masterpiece.": "positive",
    }
    states = sentiment.run_batch([{"review": r} for r in reviews], backend=backend)
    assert [s["label"] for s in states] == list(reviews.values())


def test_integer_answers(backend: EngineBackend) -> None:
    @program
    def arithmetic(s, question):
        s += user(question)
        s += assistant("The answer is " + gen_int("n", temperature=0))

    states = arithmetic.run_batch(
        [{"question": "What is 2+3?"}, {"question": "How many legs does a dog have?"}],
        backend=backend,
    )
    assert [s["n"] for s in states] == [5, 4]
