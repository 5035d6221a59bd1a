"""The DSL's language on the deterministic FakeBackend: fast, model-free, exact."""

from __future__ import annotations

import re
import threading

import pytest

from frontend_dsl import (
    BackendError,
    FakeBackend,
    ProgramError,
    assistant,
    batch_usage,
    gen,
    gen_bool,
    gen_int,
    gen_json,
    gen_str,
    program,
    render_chat_template,
    select,
    system,
    user,
)
from frontend_dsl.fake_backend import CHATML_TEMPLATE
from frontend_dsl.ir import RoleBegin


def test_few_shot_qa_with_stop_strings() -> None:
    shots = [("What is 1+1?", "2"), ("What color is the sky?", "blue")]
    backend = FakeBackend(responder=lambda prompt, params: " Paris\nQ: What is next?\nA: more")

    @program
    def few_shot(s, question):
        for q, a in shots:
            s += f"Q: {q}\nA: {a}\n\n"
        s += f"Q: {question}\nA:" + gen("answer", max_tokens=32, stop=["\n", "Q:"], temperature=0)

    state = few_shot.run("Capital of France?", backend=backend)
    assert state.ok, state.error
    assert state["answer"] == " Paris"
    assert state.text().endswith("Q: Capital of France?\nA: Paris")
    call = backend.calls[0]
    assert call.params.stop == ["\n", "Q:"] and call.params.temperature == 0
    assert state.get_meta("answer")["finish_reason"] == "stop"


def test_multi_turn_chat_messages_match_the_template() -> None:
    replies = iter(["Hello! How can I help?", "Paris."])
    backend = FakeBackend(responder=lambda prompt, params: next(replies))

    @program
    def chat(s):
        s += system("You are terse.")
        s += user("Hi")
        s += assistant(gen("greeting", max_tokens=16))
        with s.user():
            s += "Capital of "
            s += "France?"
        with s.assistant():
            s += gen("answer", max_tokens=16)

    state = chat.run(backend=backend)
    assert state.ok, state.error
    expected = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]
    assert state.messages() == expected
    assert state.text() == render_chat_template(CHATML_TEMPLATE, expected)
    # Each call's prompt is the text so far, ending in the generation prompt.
    assert backend.calls[1].prompt.endswith(
        "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert backend.calls[1].prompt.startswith(backend.calls[0].prompt)


def test_roles_must_nest_properly() -> None:
    @program
    def bad(s):
        with s.user():
            s += user("nested")

    state = bad.run(backend=FakeBackend())
    assert isinstance(state.error, ValueError) and "still open" in str(state.error)


def _word_scorer(prefs: dict[str, float]):
    return lambda context, token: prefs.get(token.strip(), -5.0)


def test_select_scores_from_the_joint_tokenization_boundary() -> None:
    backend = FakeBackend(scorer=_word_scorer({"yes": -0.5, "no": -2.0}))

    @program
    def yn(s):
        s += "Is the sky blue? Answer: " + select("ans", choices=["yes", "no"])

    state = yn.run(backend=backend)
    assert state.ok, state.error
    assert state["ans"] == "yes"
    meta = state.get_meta("ans")
    # "Answer: " ends in a space that the choice's first token absorbs (" yes"): the scored
    # tokens start at that merged token, one before the end of the tokenized prompt.
    prompt_ids = backend.tokenize(["Is the sky blue? Answer: "])[0]
    assert meta["boundaries"] == [len(prompt_ids) - 1] * 2
    scored = [backend.decode(c.prompt[b:]) for c, b in zip(backend.calls, meta["boundaries"])]
    assert scored == [" yes", " no"]
    assert meta["token_logprobs"] == [[-0.5], [-2.0]]
    assert state.text() == "Is the sky blue? Answer: yes"


def test_select_scores_every_choice_over_the_same_text() -> None:
    """When the prompt's trailing space merges into one choice's first token but not into
    another's, both are scored from the earlier boundary: the same text span."""
    backend = FakeBackend(scorer=_word_scorer({"yes": -0.5, "": -3.0, "!": -0.1}))

    @program
    def yn(s):
        s += "Answer: " + select("ans", choices=["yes", "!"])

    state = yn.run(backend=backend)
    assert state.ok, state.error
    meta = state.get_meta("ans")
    assert len(set(meta["boundaries"])) == 1
    scored = [backend.decode(c.prompt[b:]) for c, b in zip(backend.calls, meta["boundaries"])]
    assert scored == [" yes", " !"]
    # "!" pays for the separate space token (-3.0) it needs: "yes" wins on the mean.
    assert meta["token_logprobs"] == [[-0.5], [-3.0, -0.1]]
    assert state["ans"] == "yes"


def test_select_methods_mean_sum_first_and_callable() -> None:
    # "alpha beta gamma": three tokens at -0.5 (mean -0.5, sum -1.5); "delta": one token at -1.0.
    backend = FakeBackend(
        scorer=_word_scorer({"alpha": -0.5, "beta": -0.5, "gamma": -0.5, "delta": -1.0})
    )
    choices = ["alpha beta gamma", "delta"]

    @program
    def pick(s, method):
        s += "Pick:" + select("x", choices=choices, method=method)

    assert pick.run("mean", backend=backend)["x"] == "alpha beta gamma"
    assert pick.run("sum", backend=backend)["x"] == "delta"
    assert pick.run("first", backend=backend)["x"] == "alpha beta gamma"
    assert pick.run(lambda lps: 1, backend=backend)["x"] == "delta"
    # gen(choices=...) is select.
    state = program(lambda s: s.__iadd__("Pick:" + gen("x", choices=choices))).run(backend=backend)
    assert state["x"] == "alpha beta gamma"


def test_select_warms_the_shared_prefix_then_batches() -> None:
    backend = FakeBackend(scorer=_word_scorer({}), page_size=2)

    @program
    def prog(s):
        s += "A long shared question that spans several pages of tokens:" + select(
            "x", choices=["a", "b", "c"]
        )

    state = prog.run(backend=backend)
    assert state.ok
    usage = state.get_meta("x")["usage"]
    # The first choice computes the prefix; the two others find it cached.
    prefix = len(
        backend.tokenize(["A long shared question that spans several pages of tokens:"])[0]
    )
    assert usage.cached_tokens >= 2 * (prefix // 2 * 2 - 2)


def test_gen_int_and_gen_str() -> None:
    backend = FakeBackend(
        responder=lambda prompt, params: " 42 apples" if prompt.endswith("many? ") else 'Bob", age'
    )

    @program
    def typed(s):
        s += "How many? " + gen_int("n")
        s += '\nName: "' + gen_str("name") + '"'

    state = typed.run(backend=backend)
    assert state.ok, state.error
    assert state["n"] == 42 and isinstance(state["n"], int)
    assert state["name"] == "Bob"
    assert state.text() == 'How many?  42\nName: "Bob"'
    assert "\n" in backend.calls[0].params.stop and backend.calls[0].params.max_tokens == 16

    bad = program(lambda s: s.__iadd__("How many? " + gen_int("n"))).run(
        backend=FakeBackend(responder=lambda p, sp: "lots")
    )
    assert isinstance(bad.error, ValueError) and "not an integer" in str(bad.error)


def test_tool_use_loop_in_python() -> None:
    def responder(prompt: str, params) -> str:
        if prompt.endswith("Action:"):
            return " calc 6*7" if "Observation" not in prompt else " finish"
        return " The answer is 42."

    tools = {"calc": lambda expr: str(eval(expr, {"__builtins__": {}}))}  # noqa: S307 - test tool

    @program
    def agent(s, task):
        s += f"Task: {task}\n"
        for _ in range(4):
            s += "Action:" + gen("action", max_tokens=8, stop="\n")
            name, *arg = s["action"].split()
            if name == "finish":
                break
            s += f"\nObservation: {tools[name](*arg)}\n"
        s += "\nFinal:" + gen("final", max_tokens=16)
        return s["final"]

    state = agent.run("multiply six by seven", backend=backend_for(responder))
    assert state.ok, state.error
    assert "Observation: 42" in state.text()
    assert state.ret_value == " The answer is 42."


def test_a_reused_name_reads_its_new_value() -> None:
    """Reading ``s["x"]`` waits for the queued ``gen("x")`` even when ``x`` already holds a
    value (an agent loop), and a fork's read waits for the fork's own ``gen``."""
    entered, release = threading.Event(), threading.Event()

    def responder(prompt: str, params) -> str:
        if prompt.count("Q") == 2:  # the second call is still running when the program reads x
            entered.set()
            assert release.wait(10)
        return f"a{prompt.count('Q')}-{prompt.count('F')}"

    def releaser() -> None:
        entered.wait(10)
        release.set()

    threading.Thread(target=releaser, daemon=True).start()
    seen: list[object] = []

    @program
    def loop(s):
        for _ in range(2):
            s += "Q" + gen("x", max_tokens=4)
            seen.append(s["x"])
        forks = s.fork(2)
        for f in forks:
            f += "F" + gen("x", max_tokens=4)
        seen.append(forks["x"])

    state = loop.run(backend=backend_for(responder))
    assert state.ok, state.error
    assert seen == ["a1-0", "a2-0", ["a2-1", "a2-1"]]


def backend_for(responder) -> FakeBackend:
    return FakeBackend(responder=responder)


def test_fork_runs_in_parallel_and_join_gathers() -> None:
    barrier = threading.Barrier(3, timeout=10)

    def responder(prompt: str, params) -> str:
        barrier.wait()  # all three forks must be generating at once, or this breaks
        return " idea " + re.findall(r"Idea (\d)", prompt)[-1]

    backend = FakeBackend(responder=responder)

    @program
    def brainstorm(s):
        s += "Topic: caching.\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Idea {i}:" + gen("idea", max_tokens=4)
        assert forks["idea"] == [" idea 0", " idea 1", " idea 2"]
        forks.join()
        s += "Summary."

    state = brainstorm.run(backend=backend)
    assert state.ok, state.error
    assert state["idea"] == [" idea 0", " idea 1", " idea 2"]
    assert state.text() == "Topic: caching.\nSummary."
    assert {c.program_id for c in backend.calls} == {state.program_id}


def test_join_concat_and_fork_errors_reach_the_parent() -> None:
    @program
    def concat(s):
        s += "Base."
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" [{i}]"
        forks.join(mode="concat")

    assert concat.run(backend=FakeBackend()).text() == "Base. [0] [1]"

    @program
    def chat_concat(s):
        s += user("Two drafts?")
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += assistant(f"draft {i}")
        forks.join("concat")

    state = chat_concat.run(backend=FakeBackend())
    assert state.ok, state.error
    expected = [
        {"role": "user", "content": "Two drafts?"},
        {"role": "assistant", "content": "draft 0"},
        {"role": "assistant", "content": "draft 1"},
    ]
    assert state.messages() == expected  # the forks' messages come along with their text
    assert state.text() == render_chat_template(CHATML_TEMPLATE, expected)

    @program
    def open_role(s):
        forks = s.fork(1)
        forks[0] += RoleBegin("assistant")
        forks.join("concat")

    assert "still open" in str(open_role.run(backend=FakeBackend()).error)

    def responder(prompt: str, params) -> str:
        if "bad" in prompt:
            raise RuntimeError("engine exploded")
        return "fine"

    @program
    def failing(s):
        forks = s.fork(2)
        forks[0] += "good" + gen("x")
        forks[1] += "bad" + gen("x")
        forks.join()
        s += "after"

    state = failing.run(backend=FakeBackend(responder=responder))
    assert isinstance(state.error, BackendError) and "engine exploded" in str(state.error)
    with pytest.raises(ProgramError):
        state.raise_for_error()


def test_errors_are_surfaced_on_the_state() -> None:
    backend = FakeBackend(responder=lambda p, sp: (_ for _ in ()).throw(RuntimeError("boom")))

    @program
    def prog(s):
        s += "x" + gen("a")
        s += "never" + gen("b")
        return s["a"]  # raises ProgramError inside the program; the first error is kept

    state = prog.run(backend=backend)
    assert isinstance(state.error, BackendError) and "boom" in str(state.error)
    with pytest.raises(ProgramError) as info:
        state["b"]
    assert info.value.__cause__ is state.error
    assert len(backend.calls) == 1  # the queued second gen was dropped

    def raising(s):
        s += "text"
        raise KeyError("user bug")

    state = program(raising).run(backend=backend)
    assert isinstance(state.error, KeyError)
    assert state.text() == "text"


def test_streaming_text_iter_and_per_variable() -> None:
    backend = FakeBackend(responder=lambda p, sp: "one two three")

    @program
    def story(s):
        s += "Start:" + gen("a", max_tokens=8)
        s += " Then:" + gen("b", max_tokens=2)

    state = story.run(backend=backend, stream=True)
    pieces = list(state.text_iter())
    assert state.wait(timeout=10)
    assert "".join(pieces) == state.text() == "Start:one two three Then:one two"
    assert len(pieces) > 4  # generated text arrives token by token
    assert "".join(state.text_iter("a")) == "one two three"
    assert list(state.text_iter("b")) == ["one", " two"]


def test_run_batch_order_concurrency_progress_and_defaults() -> None:
    active, peak, lock = [0], [0], threading.Lock()
    gate = threading.Event()

    def responder(prompt: str, params) -> str:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        gate.wait(0.05)
        with lock:
            active[0] -= 1
        return " " + re.findall(r"(\d+)", prompt)[-1]

    backend = FakeBackend(responder=responder)

    @program
    def echo(s, n):
        s += f"Echo {n}:" + gen("out", max_tokens=4)

    states = echo.run_batch(
        [{"n": i} for i in range(20)],
        backend=backend,
        concurrency=4,
        progress_bar=True,
        defaults={"temperature": 0.0},
    )
    assert [s["out"] for s in states] == [f" {i}" for i in range(20)]
    assert 1 < peak[0] <= 4
    assert all(c.params.temperature == 0.0 for c in backend.calls)
    assert len({s.program_id for s in states}) == 20
    assert batch_usage(states).calls == 20
    assert echo.run_batch([(5,)], backend=backend)[0]["out"] == " 5"  # args tuples work too


def test_batch_with_long_system_prompt_reuses_it() -> None:
    backend = FakeBackend(responder=lambda p, sp: "ok", page_size=4)
    system_prompt = "You are a careful assistant. " * 40

    @program
    def ask(s, q):
        s += system(system_prompt)
        s += user(f"Question number {q}?")
        s += assistant(gen("a", max_tokens=4))

    states = ask.run_batch([{"q": i} for i in range(32)], backend=backend, concurrency=8)
    usage = batch_usage(states)
    shared = len(backend.tokenize([states[0].text().split("Question")[0]])[0]) // 4 * 4
    optimum = 31 * shared / usage.prompt_tokens
    assert usage.hit_rate >= 0.95 * optimum, (usage, optimum)
    assert all(s.usage.prompt_tokens > 0 for s in states)


def test_invalid_parameters_fail_early() -> None:
    with pytest.raises(ValueError):
        gen("x", temperature=-1)
    with pytest.raises(ValueError):
        select("x", choices=[])
    with pytest.raises(ValueError):
        select("x", choices=["a"], method="median")


def test_run_batch_isolates_failures() -> None:
    @program
    def maybe_fail(s, i):
        s += f"Item {i}:" + gen("x", max_tokens=2)
        if i == 3:
            raise RuntimeError("item 3 is broken")

    states = maybe_fail.run_batch(
        [{"i": i} for i in range(6)], backend=FakeBackend(), concurrency=3
    )
    assert [s.ok for s in states] == [True, True, True, False, True, True]
    assert "item 3 is broken" in str(states[3].error)
    assert all(s["x"] == "ok" for i, s in enumerate(states) if i != 3)


def test_the_dsl_and_its_remote_backend_import_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, frontend_dsl, frontend_dsl.remote_backend; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_run_defaults_are_normalized_and_checked() -> None:
    """Run defaults take the same forms as ``gen``'s arguments, on every backend."""
    backend = FakeBackend(responder=lambda prompt, params: " ok.\n\nmore")

    @program
    def one(s):
        s += "Q:" + gen("a")

    state = one.run(backend=backend, defaults={"stop": "\n\n", "max_new_tokens": 3})
    assert state.ok, state.error
    assert backend.calls[0].params.stop == ["\n\n"] and backend.calls[0].params.max_tokens == 3
    assert state["a"] == " ok."
    with pytest.raises(ValueError, match="unknown sampling parameters"):
        one.run(backend=backend, defaults={"temprature": 0.0})
    with pytest.raises(ValueError, match="invalid sampling parameters"):
        one.run(backend=backend, defaults={"max_tokens": "many"})
    with pytest.raises(ValueError, match="no sampling parameters"):
        gen("x", choices=["a", "b"], temperature=0.7)
    with pytest.raises(TypeError, match="args tuples"):
        one.run_batch(["q1", "q2"], backend=backend)


def test_a_run_default_stop_does_not_cut_typed_constrained_output() -> None:
    backend = FakeBackend(
        responder=lambda prompt, params: '{"score": 0.5}' if params.json_schema else " true"
    )

    @program
    def typed(s):
        s += "J:" + gen_json("j") + " B:" + gen_bool("b")

    state = typed.run(backend=backend, defaults={"stop": ["."]})
    assert state.ok, state.error
    assert state["j"] == {"score": 0.5} and state["b"] is True


def test_a_run_closes_its_session_when_it_ends() -> None:
    """A run's program id is its session: the run's end closes it (after its last call,
    also when it failed); a run given its own ``program_id`` leaves it open."""
    backend = FakeBackend()

    @program
    def two_calls(s, fail=False):
        s += user("hi") + assistant(gen("a", max_tokens=2))
        s += user("again") + assistant(gen("b", max_tokens=2))
        if fail:
            raise ValueError("the program's own error")

    state = two_calls.run(backend=backend)
    assert backend.closed_sessions == [state.program_id]
    assert {c.program_id for c in backend.calls} == {state.program_id}
    failed = two_calls.run(fail=True, backend=backend)
    assert not failed.ok and backend.closed_sessions[-1] == failed.program_id
    kept = two_calls.run(backend=backend, program_id="agent-7")
    assert kept.ok and "agent-7" not in backend.closed_sessions
    states = two_calls.run_batch([{}, {}, {}], backend=backend)
    assert backend.closed_sessions[-3:] and set(backend.closed_sessions[-3:]) == {
        s.program_id for s in states
    }
