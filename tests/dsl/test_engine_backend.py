"""The DSL suite over the in-process engine (tiny random Llama): structure, select maths, reuse."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from frontend_dsl import (
    BackendError,
    assistant,
    batch_usage,
    gen,
    gen_int,
    gen_json,
    program,
    select,
    system,
    user,
)
from frontend_dsl.engine_backend import EngineBackend
from radixserve.sampling_params import SamplingParams

PAGE = 4
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def backend(tiny_llama_dir: Path) -> Iterator[EngineBackend]:
    b = EngineBackend(
        model=str(tiny_llama_dir),
        page_size=PAGE,
        num_pages=2048,
        max_num_tokens=1024,
        max_model_len=1024,
    )
    yield b
    b.close()


@pytest.fixture(autouse=True)
def _clean_engine(backend: EngineBackend) -> Iterator[None]:
    yield
    backend.call(lambda engine: engine.check_invariants())


def test_few_shot_qa_with_stop_strings_matches_offline_generate(backend: EngineBackend) -> None:
    shots = "Q: What is one plus one?\nA: two\n\nQ: What color is the sky?\nA: blue\n\n"

    @program
    def few_shot(s, question):
        s += shots + f"Q: {question}\nA:"
        s += gen("answer", max_tokens=24, stop=["\n", "Q:", "e"], temperature=0)

    state = few_shot.run("What is the capital of France?", backend=backend)
    assert state.ok, state.error
    answer = state["answer"]
    assert not any(stop in answer for stop in ("\n", "Q:", "e"))
    prompt = shots + "Q: What is the capital of France?\nA:"
    params = SamplingParams(max_tokens=24, stop=["\n", "Q:", "e"], temperature=0)
    offline = backend.call(lambda engine: engine.generate(prompt, params))
    assert answer == offline[0].text
    assert state.text() == prompt + answer


def test_stop_regex_matches_offline_generate(backend: EngineBackend) -> None:
    """``gen(stop_regex=...)`` ends the variable where the pattern first matches (cut off),
    as the engine's own ``generate`` does, and the state's text goes on from there."""

    @program
    def story(s):
        s += "Once upon a time"
        s += gen("tale", max_tokens=24, stop_regex=r"[,.]", temperature=0)

    state = story.run(backend=backend)
    assert state.ok, state.error
    params = SamplingParams(max_tokens=24, stop_regex=[r"[,.]"], temperature=0)
    offline = backend.call(lambda engine: engine.generate("Once upon a time", params))
    assert state["tale"] == offline[0].text and not set(state["tale"]) & {",", "."}
    assert state.text() == "Once upon a time" + state["tale"]


def test_prediction_drafts_and_changes_nothing(backend: EngineBackend) -> None:
    """``gen(prediction=...)`` (OpenAI's predicted outputs): the engine drafts from the text
    and keeps what it verifies; the answer is the one without a prediction."""

    @program
    def copy(s, prediction):
        s += "List three colors: red, green, blue. Again:"
        s += gen("out", max_tokens=12, temperature=0, ignore_eos=True, prediction=prediction)

    plain = copy.run(None, backend=backend)
    assert plain.ok, plain.error
    before = backend.call(lambda engine: engine.stats())
    drafted = copy.run(plain["out"], backend=backend)
    after = backend.call(lambda engine: engine.stats())
    assert drafted.ok and drafted["out"] == plain["out"]
    assert after.spec_accepted_tokens_total - before.spec_accepted_tokens_total > 0


def test_multi_turn_chat_text_is_the_chat_template_of_messages(backend: EngineBackend) -> None:
    @program
    def chat(s):
        s += system("You are a helpful assistant.")
        s += user("Hello, how are you today?")
        s += assistant(gen("first", max_tokens=6))
        with s.user():
            s += "What is the capital of France?"
        with s.assistant():
            s += gen("second", max_tokens=6)

    state = chat.run(backend=backend, defaults=GREEDY)
    assert state.ok, state.error
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["first"] and messages[4]["content"] == state["second"]
    assert state.text() == backend.tokenizer.apply_chat_template(messages, tokenize=False)
    # The second call's prompt extends the first one: it hit the cache.
    assert state.usage.calls == 2 and state.usage.cached_tokens >= PAGE


def _hf_choice_logprobs(
    model_dir: Path, prompt: str, choices: list[str], tokenizer
) -> list[list[float]]:
    """Token logprobs of each choice, from transformers' own model (not the engine), all
    scored from the first position where any choice's tokens leave the prompt's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    prompt_ids = tokenizer.encode(prompt)
    joint = [tokenizer.encode(prompt + choice) for choice in choices]

    def agree(ids: list[int]) -> int:
        n = 0
        while n < min(len(ids), len(prompt_ids)) and ids[n] == prompt_ids[n]:
            n += 1
        return n

    start = min(agree(ids) for ids in joint)
    out = []
    for ids in joint:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        lps = torch.log_softmax(logits, dim=-1)
        out.append([lps[pos - 1, ids[pos]].item() for pos in range(start, len(ids))])
    return out


def test_select_picks_highest_mean_logprob_checked_with_transformers(
    backend: EngineBackend, tiny_llama_dir: Path
) -> None:
    choices = ["Paris", "London", "the capital of France is Paris", "blue"]
    prompt_tail = "Q: What is the capital of France?\nA: "  # trailing space: the boundary case

    @program
    def quiz(s):
        s += system("You answer questions.")
        s += prompt_tail + select("ans", choices=choices)

    state = quiz.run(backend=backend)
    assert state.ok, state.error
    meta = state.get_meta("ans")
    prompt = state.text()[: -len(state["ans"])]
    expected = _hf_choice_logprobs(tiny_llama_dir, prompt, choices, backend.tokenizer)
    for got, want in zip(meta["token_logprobs"], expected):
        assert got == pytest.approx(want, abs=2e-3)
    means = [sum(lp) / len(lp) for lp in expected]
    assert state["ans"] == choices[max(range(len(choices)), key=means.__getitem__)]
    # The prompt's trailing space merges into " Par" but stays a token of its own before "L"
    # of "London": every choice is scored from the earlier boundary, one token before the
    # end of the tokenized prompt, so "London" pays for its separate space token too.
    n_prompt = len(backend.tokenize([prompt])[0])
    assert meta["boundaries"] == [n_prompt - 1] * len(choices)
    assert len(meta["token_logprobs"][1]) == len(backend.tokenize([prompt + "London"])[0]) - (
        n_prompt - 1
    )
    # Batched choices reuse the cached prefix.
    assert meta["usage"].cached_tokens >= (len(choices) - 1) * PAGE


def test_integer_and_json_generation_are_constrained(backend: EngineBackend) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
        "required": ["ok", "color"],
        "additionalProperties": False,
    }

    @program
    def typed(s, i):
        s += user(f"How many apples are in basket {i}?")
        s += assistant("There are " + gen_int("n", max_tokens=6))
        s += user("Answer as JSON.")
        s += assistant(gen_json("j", schema, max_tokens=40))

    # A random model still yields an integer and schema-valid JSON: the engine's grammar
    # constraint allows nothing else.
    states = typed.run_batch(
        [{"i": i} for i in range(4)], backend=backend, defaults={"temperature": 0.8, "seed": 1}
    )
    for state in states:
        assert state.ok, state.error
        assert isinstance(state["n"], int)
        assert state["j"].keys() == {"ok", "color"} and state["j"]["color"] in ("red", "blue")


def test_tool_use_loop_reuses_its_growing_prefix(backend: EngineBackend) -> None:
    tools = {"len": lambda text: str(len(text)), "upper": lambda text: text.upper()}

    @program
    def agent(s, task):
        s += system("You can call tools: len, upper.")
        s += user(task)
        observations = []
        for step, tool in enumerate(["upper", "len", "upper"]):
            with s.assistant():
                s += f"Call {tool}:" + gen(f"arg{step}", max_tokens=5, stop="\n")
            result = tools[tool](s[f"arg{step}"])
            observations.append(result)
            s += user(f"Result: {result}")
        s += assistant(gen("final", max_tokens=5))
        return observations

    state = agent.run("Shout the word fox, then count it.", backend=backend, defaults=GREEDY)
    assert state.ok, state.error
    assert len(state.ret_value) == 3 and state.ret_value[1].isdigit()
    assert state.usage.calls == 4
    # Every call after the first finds the previous call's prompt in the cache.
    first_prompt = len(backend.tokenize([state.text().split("Call upper:")[0]])[0])
    assert state.usage.cached_tokens >= 3 * (first_prompt // PAGE * PAGE)


def test_fork_join_shares_prefix_and_gathers(backend: EngineBackend) -> None:
    @program
    def parallel(s):
        s += system("Brainstorm.")
        s += user("Name three uses of a radix tree in serving language models, please.")
        forks = s.fork(3)
        for f in forks:
            f += assistant(gen("idea", max_tokens=6, temperature=0))
        forks.join()

    state = parallel.run(backend=backend)
    assert state.ok, state.error
    ideas = state["idea"]
    assert len(ideas) == 3 and ideas[0] == ideas[1] == ideas[2]  # greedy, same prompt
    # Two of the three forks reuse the shared prefix (the engine defers them behind the first).
    assert state.usage.calls == 3 and state.usage.cached_tokens >= 2 * PAGE


def test_streaming_matches_final_text(backend: EngineBackend) -> None:
    @program
    def story(s):
        s += "Once upon a time" + gen("story", max_tokens=12, temperature=0)
        s += "\nThe end:" + gen("end", max_tokens=4, temperature=0)

    state = story.run(backend=backend, stream=True)
    pieces = list(state.text_iter())
    assert state.wait(10) and state.ok, state.error
    assert "".join(pieces) == state.text()
    assert "".join(state.text_iter("story")) == state["story"]


def test_run_batch_long_system_prompt_hits_near_optimum(backend: EngineBackend) -> None:
    system_prompt = (
        "You are a careful assistant for a prefix caching engine. Answer briefly and exactly. " * 6
    )

    @program
    def ask(s, i):
        s += system(system_prompt)
        s += user(f"Question {i}: what is {i} plus {i}?")
        s += assistant(gen("a", max_tokens=4))

    assert backend.flush_cache()
    states = ask.run_batch(
        [{"i": i} for i in range(32)], backend=backend, concurrency=32, defaults=GREEDY
    )
    assert all(s.ok for s in states), [s.error for s in states if not s.ok]
    usage = batch_usage(states)
    shared = len(backend.tokenize([states[0].text().split("Question")[0]])[0]) // PAGE * PAGE
    optimum = 31 * shared / usage.prompt_tokens
    assert usage.hit_rate >= 0.9 * optimum, (usage.hit_rate, optimum)
    assert usage.calls == 32 and all(s.usage.calls == 1 for s in states)


def test_engine_errors_surface_on_the_state(backend: EngineBackend) -> None:
    @program
    def too_long(s):
        s += "word " * 1500 + gen("x", max_tokens=2)

    state = too_long.run(backend=backend)
    assert isinstance(state.error, BackendError) and "too long" in str(state.error)


def test_closing_a_stream_aborts_the_request(backend: EngineBackend) -> None:
    stream = backend.generate(
        "Once upon a time", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    )
    chunks = iter(stream)
    next(chunks)
    stream.close()
    for _ in range(1000):  # each call runs between two engine steps; the abort lands within one
        if not backend.call(lambda engine: engine.has_unfinished()):
            break
    assert not backend.call(lambda engine: engine.has_unfinished())
    assert backend.stats().aborted_total >= 1


def test_a_closed_backend_refuses_work_instead_of_hanging(backend: EngineBackend) -> None:
    """Calls racing with close() either run or fail: none is queued behind the close."""
    import threading

    other = EngineBackend(engine=backend.engine)  # a second driver on the shared (idle) engine
    results: list[str] = []

    def caller() -> None:
        for _ in range(200):
            try:
                other.call(lambda engine: engine.has_unfinished())
                results.append("ran")
            except BackendError:
                results.append("refused")
                return

    t = threading.Thread(target=caller)
    t.start()
    other.close()
    t.join(timeout=30)
    assert not t.is_alive(), "a call queued behind close() was never answered"
    with pytest.raises(BackendError, match="closed"):
        other.generate("x", SamplingParams(max_tokens=1))


def test_a_program_leases_its_context_between_calls_and_releases_it_at_its_end(
    backend: EngineBackend,
) -> None:
    """The program id is the engine session: its first call's path is leased while the
    program runs, and the run's end releases it; a run with its own id keeps its lease
    until ``close_session`` ends it."""
    base = backend.stats()
    seen: list[int] = []

    @program
    def two_calls(s):
        s += system("You keep notes.") + user("first")
        s += assistant(gen("a", max_tokens=2, temperature=0))
        s["a"]  # the first call has finished: its turn is leased
        seen.append(backend.stats().leases_active)
        s += user("second") + assistant(gen("b", max_tokens=2, temperature=0))

    state = two_calls.run(backend=backend)
    assert state.ok, state.error
    stats = backend.stats()
    assert seen == [base.leases_active + 1]
    assert stats.leases_granted_total == base.leases_granted_total + 2
    assert (
        stats.leases_active == base.leases_active and stats.lease_hits_total > base.lease_hits_total
    )

    assert two_calls.run(backend=backend, program_id="kept-1").ok
    assert backend.stats().leases_active == base.leases_active + 1
    assert backend.close_session("kept-1") and not backend.close_session("kept-1")
    assert backend.stats().leases_active == base.leases_active
