"""Prompts are encoded in tokenizer processes, off the router's loop: a huge prompt delays
only itself, can be aborted while it is encoded, and a tokenizer process that dies fails
only its own jobs and is started again."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client, ServerError
from radixserve.serving.router.tokenizer_pool import TokenizerPool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HUGE = "hello world " * 100_000  # 1.2 MB: about 2 s of BPE for the tiny tokenizer, 500k tokens


def test_huge_prompt_delays_only_itself(fake_server) -> None:
    srv = fake_server(num_workers=2, context_length=100_000, router=dict(tokenizer_workers=2))
    order: list[str] = []
    errors: dict[str, ServerError] = {}

    def huge() -> None:
        with Client(srv.endpoint, timeout=60) as c:
            try:
                c.generate(HUGE, params=SamplingParams(max_tokens=2))
            except ServerError as exc:
                errors["huge"] = exc
            order.append("huge")

    with Client(srv.endpoint, timeout=60) as c:
        t = threading.Thread(target=huge)
        t.start()
        # Once the router holds the huge request (it is counted), a small one from another
        # client is encoded by the other tokenizer process and served meanwhile.
        deadline = time.monotonic() + 30
        while c.stats().requests < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(3):
            assert (
                c.generate(
                    f"small {i}", params=SamplingParams(max_tokens=2)
                ).usage.completion_tokens
                == 2
            )
            order.append("small")
        t.join(60)
    assert order[:3] == ["small"] * 3 and order[3] == "huge", order
    # Over the context once encoded: the exact (token) check still applies.
    assert errors["huge"].code == "context_length" and "tokens" in errors["huge"].message
    assert [p.poll() for p in srv.procs] == [None, None]


def test_abort_while_encoding(fake_server) -> None:
    srv = fake_server(num_workers=1, context_length=100_000)
    with Client(srv.endpoint, timeout=60) as c:
        rid = c.submit(HUGE, params=SamplingParams(max_tokens=2), stream=True)
        c.abort(rid)
        st = c.stats()
        assert st.active == 0 and st.aborted == 1
        # The one tokenizer process finishes the huge job before this one: its result is dropped.
        assert c.generate("next", params=SamplingParams(max_tokens=2)).usage.completion_tokens == 2
        st = c.stats()
        assert (
            st.requests == 2 and st.workers[0].requests == 1
        )  # the aborted one never reached a worker


def test_dead_tokenizer_process_fails_its_job_and_is_restarted(fake_server) -> None:
    srv = fake_server(num_workers=1, context_length=100_000)
    pool: Any = srv.router.tokenizers
    victim = pool.pids[0]
    with Client(srv.endpoint, timeout=60) as c:
        rid = c.submit(HUGE, params=SamplingParams(max_tokens=2))
        deadline = time.monotonic() + 30
        while c.stats().requests < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(ServerError) as exc:
            list(c.events(rid))
        assert exc.value.code == "internal" and "tokenizer process died" in exc.value.message
        # A new process takes over; text prompts are served again.
        assert c.generate("after", params=SamplingParams(max_tokens=2)).usage.completion_tokens == 2
        assert c.tokenize(["ab"]) == [list(c.tokenize(["ab"])[0])]
    assert victim not in pool.pids


@pytest.mark.parametrize("pickles", [True, False], ids=["pickled", "directory"])
def test_the_processes_encode_as_the_router_does(
    tokenizer: Any, zctx: zmq.Context, pickles: bool
) -> None:
    """The processes get the router's tokenizer pickled (faster to load than through
    transformers' AutoTokenizer), or, when it does not pickle, load its directory: either way
    a chat and a text encode to the ids the router's own codec gives."""
    from radixserve.serving.prompts import PromptCodec
    from radixserve.serving.wire import protocol as p

    tok = copy.deepcopy(tokenizer)
    if not pickles:
        tok.init_kwargs["unpicklable"] = threading.Lock()
    pool = TokenizerPool(tok, 1, zctx)
    got: list[tuple[list[list[int]] | None, str | None]] = []
    try:
        chat = [p.ChatMessage(role="user", content="Hello there.")]
        pool.submit(lambda ids, err: got.append((ids, err)), messages=chat)
        pool.submit(lambda ids, err: got.append((ids, err)), text="a radix tree")
        deadline = time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < deadline:
            if pool.socket.poll(100):
                pool.on_frames(pool.socket.recv_multipart())
            pool.check()
        # What the process was told to load: its command line's next-to-last argument, read
        # once it has answered (just after the spawn it may not have exec'd its program yet).
        (pid,) = pool.pids
        source = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-3].decode()
        assert source.endswith(".pickle") == pickles
    finally:
        pool.close()
    codec = PromptCodec(tokenizer)
    want = [
        codec.encode(p.GenerateRequest(request_id="-", messages=chat)),
        codec.encode(p.GenerateRequest(request_id="-", text="a radix tree")),
    ]
    assert got == [([ids], None) for ids in want]


@pytest.mark.parametrize("pooled", [1, 0], ids=["pool", "on-the-loop"])
def test_a_chat_is_tokenized_as_it_is_generated(fake_server, tokenizer: Any, pooled: int) -> None:
    """``tokenize_chat`` gives the ids a ``messages`` prompt is generated from (the router's
    codec, with tools and template variables), in the pool and on the router's loop alike;
    texts and messages together, or a chat the template cannot render, are refused."""
    from radixserve.serving.prompts import PromptCodec
    from radixserve.serving.wire import protocol as p

    srv = fake_server(num_workers=1, router=dict(tokenizer_workers=pooled))
    chat = [
        p.ChatMessage(role="system", content="Be brief."),
        p.ChatMessage(role="user", content="Hello there."),
    ]
    want = PromptCodec(tokenizer).encode(
        p.GenerateRequest(request_id="-", messages=chat, chat_template_kwargs='{"x": 1}')
    )
    with Client(srv.endpoint, timeout=60) as c:
        assert c.tokenize_chat(chat, chat_template_kwargs='{"x": 1}') == want
        shorter = c.tokenize_chat(chat, add_generation_prompt=False)
        assert len(shorter) < len(want) and want[: len(shorter)] == shorter
        reply = [*chat, p.ChatMessage(role="assistant", content="Hi! I am")]
        opened = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in reply],
            tokenize=False,
            continue_final_message=True,
        )
        assert opened.endswith("Hi! I am")  # the reply left open, for the model to go on
        prefilled = c.tokenize_chat(reply, add_generation_prompt=False, continue_final_message=True)
        assert prefilled == tokenizer.encode(opened, add_special_tokens=False)
        final = c.generate(
            messages=chat, chat_template_kwargs='{"x": 1}', params=SamplingParams(max_tokens=1)
        ).usage
        assert final.prompt_tokens == len(want)
        for bad in (
            p.TokenizeRequest(request_id="x", texts=["a"], messages=chat),
            p.TokenizeRequest(request_id="y", messages=[]),
            p.TokenizeRequest(request_id="z", messages=chat, continue_final_message=True),
        ):
            with pytest.raises(ServerError) as exc:
                c._call(bad, 30)
            assert exc.value.code == "invalid_params"
        with pytest.raises(ServerError) as exc:
            c.tokenize_chat([p.ChatMessage(role="user", content="a")], chat_template_kwargs="[1]")
        assert exc.value.code == "invalid_params"


@pytest.mark.parametrize("pooled", [1, 0], ids=["pool", "on-the-loop"])
def test_a_prediction_is_encoded_with_its_prompt(fake_server, tokenizer: Any, pooled: int) -> None:
    """A text prediction reaches the worker as the ids of its text (no special tokens: the
    output would hold none), whatever the prompt is, in the pool and on the router's loop
    (the fake model answers with its prediction); given twice, or too long, it is refused."""
    from radixserve.serving.wire import protocol as p

    srv = fake_server(num_workers=1, router=dict(tokenizer_workers=pooled))
    text = "def f(x):\n    return x + 1\n"
    want = tokenizer.encode(text, add_special_tokens=False)
    chat = [p.ChatMessage(role="user", content="Add one.")]
    params = SamplingParams(max_tokens=len(want))
    with Client(srv.endpoint, timeout=60) as c:
        for prompt in ({"text": "Edit this."}, {"input_ids": [5, 6, 7]}, {"messages": chat}):
            final = c.generate(**prompt, prediction=text, params=params)  # type: ignore[arg-type]
            assert final.token_ids == want and final.text == text
        twice = SamplingParams(max_tokens=4, prediction=[5])
        with pytest.raises(ServerError) as exc:
            c.generate("Edit this.", prediction=text, params=twice)
        assert exc.value.code == "invalid_params" and "not both" in exc.value.message
        for long, says in (("a" * 10**6, "characters"), ("a " * 300, "tokens")):
            with pytest.raises(ServerError) as exc:
                c.generate("Edit this.", prediction=long, params=params)
            assert exc.value.code == "context_length"
            assert "the prediction has" in exc.value.message and says in exc.value.message
