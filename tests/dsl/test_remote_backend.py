"""The same programs over a real router + two worker processes (tiny Llama): same results, reuse, stickiness."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from frontend_dsl import BackendError, assistant, batch_usage, gen, program, select, system, user
from frontend_dsl.engine_backend import EngineBackend
from frontend_dsl.remote_backend import RemoteBackend
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig

pytestmark = pytest.mark.slow

ENGINE = dict(page_size=4, num_pages=2048, max_num_tokens=1024, max_model_len=1024)
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    # On ipc: the kernel names a client's user there, so this user's programs may flush the
    # cache (a keyless router refuses that to plain tcp clients, whom every user can be).
    sock = tmp_path_factory.mktemp("dsl-remote") / "clients.sock"
    config = RouterConfig(
        endpoint=f"ipc://{sock}", heartbeat_interval_s=0.2, client_probe_interval_s=0.2
    )
    srv = LocalServer(
        tiny_llama_dir, num_workers=2, config=config, engine_config=dict(ENGINE, num_threads=1)
    )
    srv.start(timeout_s=120)
    yield srv
    srv.close()
    assert all(proc.poll() is not None for proc in srv.procs), "a worker outlived the server"


@pytest.fixture(scope="module")
def remote(server: LocalServer) -> Iterator[RemoteBackend]:
    backend = RemoteBackend(server.endpoint, timeout=60)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def local(tiny_llama_dir: Path) -> Iterator[EngineBackend]:
    backend = EngineBackend(model=str(tiny_llama_dir), **ENGINE)
    yield backend
    backend.close()


@program
def assistant_program(s, question):
    s += system("You are a helpful assistant.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=8, stop=["\n"]))
    with s.user():
        s += "Is that right? Answer: "
    s += assistant(select("verdict", choices=["yes", "no", "the capital of France is Paris"]))
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += user(f"Variant {i}") + assistant(gen("variant", max_tokens=5))
    forks.join()


def test_same_program_same_results_on_both_backends(
    remote: RemoteBackend, local: EngineBackend
) -> None:
    there = assistant_program.run("What is the capital of France?", backend=remote, defaults=GREEDY)
    here = assistant_program.run("What is the capital of France?", backend=local, defaults=GREEDY)
    assert there.ok and here.ok, (there.error, here.error)
    assert there.text() == here.text()
    assert there.variables() == here.variables()
    assert there.messages() == here.messages()
    for a, b in zip(
        there.get_meta("verdict")["token_logprobs"], here.get_meta("verdict")["token_logprobs"]
    ):
        assert a == pytest.approx(b, abs=1e-4)
    assert there.usage.calls == here.usage.calls == 6
    assert there.usage.cached_tokens > 0


def test_a_prediction_reaches_the_router_and_changes_nothing(
    remote: RemoteBackend, local: EngineBackend
) -> None:
    """``gen(prediction=...)`` through the router (which encodes the text) and in process:
    the same answer as without one, on both."""

    @program
    def copy(s, prediction):
        s += "Repeat: the quick brown fox jumps over the lazy dog. Again:"
        s += gen("out", max_tokens=10, temperature=0, ignore_eos=True, prediction=prediction)

    plain = copy.run(None, backend=local)
    for backend in (remote, local):
        state = copy.run(plain["out"], backend=backend)
        assert state.ok and state["out"] == plain["out"], state.error


def test_program_calls_stay_on_one_worker_and_batch_reuses_prefix(remote: RemoteBackend) -> None:
    system_prompt = (
        "You are a careful assistant for a prefix caching engine. Answer briefly and exactly. " * 6
    )

    @program
    def two_turns(s, i):
        s += system(system_prompt)
        s += user(f"Question {i}: what is {i} plus {i}?")
        s += assistant(gen("a", max_tokens=3))
        s += user("And times two?")
        s += assistant(gen("b", max_tokens=3))

    assert remote.flush_cache()
    states = two_turns.run_batch(
        [{"i": i} for i in range(32)], backend=remote, concurrency=32, defaults=GREEDY
    )
    assert all(s.ok for s in states), [s.error for s in states if not s.ok][:3]
    for s in states:
        assert s.get_meta("a")["worker_id"] == s.get_meta("b")["worker_id"] is not None
    usage = batch_usage(states)
    first_prompts = sum(
        len(remote.tokenize([s.text().split("<|im_start|>assistant")[0]])[0]) for s in states
    )
    shared = len(remote.tokenize([states[0].text().split("Question")[0]])[0]) // 4 * 4
    # Lower bound of the best possible reuse: every worker computes the shared system prompt
    # once; every second turn reuses its whole first prompt (page-aligned).
    optimum = (
        (32 - 2) * shared + (usage.prompt_tokens - first_prompts) * 0.9
    ) / usage.prompt_tokens
    assert usage.hit_rate >= 0.9 * optimum, (usage, optimum)


def test_streaming_over_the_router(remote: RemoteBackend) -> None:
    @program
    def story(s):
        s += "Once upon a time" + gen("story", max_tokens=12, temperature=0)

    state = story.run(backend=remote, stream=True)
    pieces = list(state.text_iter("story"))
    assert state.wait(30) and state.ok, state.error
    assert len(pieces) > 1 and "".join(pieces) == state["story"]


def test_router_errors_surface_on_the_state(remote: RemoteBackend) -> None:
    @program
    def too_long(s):
        s += "word " * 1500 + gen("x", max_tokens=2)

    state = too_long.run(backend=remote)
    assert isinstance(state.error, BackendError) and "context_length" in str(state.error)


def _leases(remote: RemoteBackend) -> int:
    return sum(int(w.engine.get("leases_active", 0)) for w in remote.stats().workers if w.alive)


def test_a_program_closes_its_session_on_the_router(server: LocalServer) -> None:
    """Over the router: a run's end releases its session's lease on its worker; a run with
    its own program id keeps it until the backend that sent it closes."""

    @program
    def one_call(s):
        s += user("Say something.") + assistant(gen("a", max_tokens=2, temperature=0))

    with RemoteBackend(server.endpoint, timeout=60) as first:
        base = _leases(first)
        assert one_call.run(backend=first).ok
        assert _leases(first) == base
        second = RemoteBackend(server.endpoint, timeout=60)
        assert one_call.run(backend=second, program_id="kept-remote").ok
        assert _leases(first) == base + 1
        second.close()  # its open session goes with it
        assert _leases(first) == base
