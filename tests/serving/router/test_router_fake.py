"""Router + worker loop over real sockets and processes, with a model-free fake engine.

Fast (no weights): they exercise dispatch, streaming, aborts, disconnects, bad frames and
worker death. Outputs are checked against the fake engine's deterministic token rule.
"""

from __future__ import annotations

import time

import pytest
from fake_engine import fake_token
from raw_client import recv_reply

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client, ServerError
from radixserve.serving.wire import protocol as p

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]  # starts server processes


def test_generate_and_stream(fake_server, tokenizer, alphabet) -> None:
    srv = fake_server()
    with Client(srv.endpoint, timeout=20) as c:
        assert c.health().ok
        prompt = tokenizer.encode("Hello, world!")
        out = c.generate(input_ids=prompt, params=SamplingParams(max_tokens=6, temperature=0))
        assert out.token_ids == [fake_token(prompt, k, alphabet) for k in range(6)]
        assert out.finish_reason == "length" and out.usage.completion_tokens == 6
        assert out.text == tokenizer.decode(out.token_ids)
        events = list(c.stream("Hello, world!", params=SamplingParams(max_tokens=6)))
        chunks, final = events[:-1], events[-1]
        assert isinstance(final, p.GenerateFinal) and final.token_ids == out.token_ids
        assert [ch.index for ch in chunks] == list(range(len(chunks)))
        assert [t for ch in chunks for t in ch.token_ids] == final.token_ids
        assert "".join(ch.text for ch in chunks) == final.text


def _wait_stats(client: Client, pred, timeout: float = 10.0) -> p.StatsReply:
    """Poll the router's stats until ``pred(stats)`` holds (bounded)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        st = client.stats()
        if pred(st) or time.monotonic() > deadline:
            return st


def _idle(st: p.StatsReply) -> bool:
    return st.active == 0 and all(
        w.inflight == 0
        and w.prefill_tokens == 0
        and w.engine.get("pages_in_use") == 0
        and w.engine.get("running") == 0
        for w in st.workers
        if w.alive
    )


def test_concurrent_clients_with_shared_prefixes(fake_server, tokenizer, alphabet) -> None:
    import asyncio

    from radixserve.serving.client import AsyncClient

    srv = fake_server(num_workers=2, step_delay=0.002)
    systems = ["You are a helpful assistant. " * 3, "Answer in French, please. " * 3]
    prompts = [systems[i % 2] + f"Question number {i}?" for i in range(24)]

    async def one(
        client: AsyncClient, text: str, stream: bool
    ) -> tuple[str, p.GenerateFinal, list[int]]:
        streamed: list[int] = []
        final = None
        async for ev in client.stream(text, params=SamplingParams(max_tokens=5), stream=stream):
            if isinstance(ev, p.GenerateChunk):
                streamed.extend(ev.token_ids)
            else:
                final = ev
        assert final is not None
        return text, final, streamed

    async def main() -> list[tuple[str, p.GenerateFinal, list[int]]]:
        # Two over loopback TCP, two over the router's inproc endpoint (as `serve`'s gateway).
        clients = [AsyncClient(srv.endpoint, timeout=20) for _ in range(2)] + [
            AsyncClient(srv.router.inproc_endpoint, timeout=20, context=srv.router.context)
            for _ in range(2)
        ]
        try:
            for s in systems:  # warm each shared prefix once, then hit it concurrently
                await clients[0].generate(s, params=SamplingParams(max_tokens=1))
            return await asyncio.gather(
                *(one(clients[i % 4], t, i % 3 == 0) for i, t in enumerate(prompts))
            )
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(main())
    for text, final, streamed in results:
        ids = tokenizer.encode(text)
        assert final.token_ids == [fake_token(ids, k, alphabet) for k in range(5)]
        assert final.usage.prompt_tokens == len(ids)
        if streamed:
            assert streamed == final.token_ids
    with Client(srv.endpoint, timeout=20) as c:
        st = _wait_stats(c, _idle)
        assert _idle(st), st
        assert st.requests == 26 and st.errors == 0
        # Cache-aware: each system prompt stays on one worker, so most prompt tokens hit.
        assert sum(w.cached_tokens for w in st.workers) > 0.5 * sum(
            w.prompt_tokens for w in st.workers
        )
        assert all(w.engine["invariants"] == "ok" for w in st.workers)


def test_abort_mid_stream_frees_kv(fake_server) -> None:
    srv = fake_server(step_delay=0.01)
    with Client(srv.endpoint, timeout=20) as c:
        got = []
        for ev in c.stream(
            "Count to a thousand", params=SamplingParams(max_tokens=10_000, ignore_eos=True)
        ):
            got.append(ev)
            if len(got) == 3:
                break  # leaving the loop aborts the request
        assert all(isinstance(ev, p.GenerateChunk) for ev in got)
        st = _wait_stats(c, _idle)
        assert _idle(st) and st.aborted == 1
        # Explicit abort of a submitted request: the final says "abort" with the partial output.
        rid = c.submit("Count again", params=SamplingParams(max_tokens=10_000), stream=True)
        events = c.events(rid)
        first = next(events)
        assert isinstance(first, p.GenerateChunk)
        c._send(p.Abort(request_id=rid))
        rest = list(events)
        assert isinstance(rest[-1], p.GenerateFinal) and rest[-1].finish_reason == "abort"
        assert _idle(_wait_stats(c, _idle))
        # The server keeps serving.
        assert (
            c.generate("still there?", params=SamplingParams(max_tokens=2)).usage.completion_tokens
            == 2
        )


def test_disconnected_client_is_aborted(fake_server) -> None:
    import subprocess
    import sys

    srv = fake_server(step_delay=0.01)
    code = (
        "import sys\n"
        "from radixserve.serving.client import Client\n"
        "from radixserve.sampling_params import SamplingParams\n"
        f"c = Client({srv.endpoint!r})\n"
        "for i, ev in enumerate(c.stream('talk forever', params=SamplingParams(max_tokens=100000))):\n"
        "    if i == 2: print('streaming', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "streaming"
        with Client(srv.endpoint, timeout=20) as c:
            assert c.stats().active == 1
            proc.kill()  # no abort sent: the router must notice the client is gone
            proc.wait(10)
            st = _wait_stats(c, _idle)
            assert _idle(st) and st.aborted == 1, st
    finally:
        proc.kill()
        proc.wait(10)


def test_bad_frames_get_errors_and_server_keeps_serving(fake_server) -> None:
    import msgspec
    import zmq

    srv = fake_server()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(srv.endpoint)
    good = {"type": "generate", "request_id": "x", "text": "hi", "params": {"max_tokens": 2}}
    cases = [
        ([b"\xc1\xc1"], "malformed"),
        ([b"a", b"b"], "malformed"),
        ([msgspec.msgpack.encode({"type": "frobnicate", "request_id": "u"})], "unknown_type"),
        ([msgspec.msgpack.encode({**good, "version": 42})], "version_mismatch"),
        ([msgspec.msgpack.encode({**good, "surprise": 1})], "invalid_message"),
        (
            [msgspec.msgpack.encode({**good, "params": {"max_tokens": 2, "temprature": 0.5}})],
            "invalid_message",
        ),
        ([msgspec.msgpack.encode({**good, "params": {"max_tokens": -3}})], "invalid_params"),
        (
            [msgspec.msgpack.encode({**good, "params": {"stop_token_ids": [10**9]}})],
            "invalid_params",
        ),
        ([msgspec.msgpack.encode({**good, "text": None, "input_ids": [10**9]})], "invalid_params"),
        (
            [msgspec.msgpack.encode({**good, "text": None, "messages": [{"role": "user"}]})],
            "invalid_message",
        ),
    ]
    try:
        for frames, code in cases:
            sock.send_multipart(frames)
            reply = recv_reply(sock)
            assert isinstance(reply, p.Error) and reply.code == code, (frames, reply)
        sock.send(msgspec.msgpack.encode(good))
        reply = recv_reply(sock)
        assert isinstance(reply, p.GenerateFinal) and reply.usage.completion_tokens == 2
    finally:
        sock.close()


def test_prompt_longer_than_context(fake_server) -> None:
    srv = fake_server(context_length=32)
    with Client(srv.endpoint, timeout=20) as c:
        with pytest.raises(ServerError) as exc:
            c.generate(input_ids=list(range(3, 43)))
        assert exc.value.code == "context_length" and "40 tokens" in exc.value.message
        assert (
            c.generate(
                input_ids=list(range(3, 13)), params=SamplingParams(max_tokens=2)
            ).finish_reason
            == "length"
        )


def test_a_request_ended_by_its_own_parameters_is_invalid_params(fake_server) -> None:
    """A worker that ends a request for the request's own doing (a grammar too costly to
    follow) makes it the client's ``invalid_params`` error, not ``internal``; the worker
    goes on serving."""
    srv = fake_server()
    with Client(srv.endpoint, timeout=20) as c:
        with pytest.raises(ServerError) as exc:
            c.generate(input_ids=[3, 4, 5], params=SamplingParams(max_tokens=8, ebnf="root ::= x"))
        assert exc.value.code == "invalid_params" and "too costly" in exc.value.message
        assert c.generate(input_ids=[3, 4, 5], params=SamplingParams(max_tokens=2)).text


def test_killed_worker_fails_its_requests_others_continue(fake_server) -> None:
    srv = fake_server(
        num_workers=2, step_delay=0.01, router=dict(routing="round_robin", restart_workers=False)
    )
    with Client(srv.endpoint, timeout=20) as c:
        rids = [
            c.submit(f"long job {i}", params=SamplingParams(max_tokens=100_000), stream=True)
            for i in range(2)
        ]
        streams = {rid: c.events(rid) for rid in rids}  # keep them: a dropped iterator aborts
        for rid in rids:
            assert isinstance(next(streams[rid]), p.GenerateChunk)
        st = c.stats()
        assert [w.inflight for w in st.workers] == [1, 1]
        victim = srv.procs[0]
        victim.kill()
        victim.wait(10)
        errors, finals = [], []
        for rid in rids:
            try:
                for ev in streams[rid]:
                    if isinstance(ev, p.GenerateChunk) and ev.index > 5:
                        c.abort(rid)
                        finals.append(rid)
                        break
            except ServerError as e:
                errors.append(e)
        assert (
            len(errors) == 1 and errors[0].code == "worker_died" and "worker 0" in errors[0].message
        )
        assert len(finals) == 1
        assert c.health().workers_alive == 1
        for i in range(4):  # new work goes to the survivor
            assert c.generate(f"after {i}", params=SamplingParams(max_tokens=2)).worker_id == 1
        st = c.stats()
        assert [w.alive for w in st.workers] == [False, True]


def test_shared_prefix_lands_on_one_worker_and_hits(fake_server) -> None:
    srv = fake_server(num_workers=2)
    system = "You are a helpful assistant. The quick brown fox jumps over the lazy dog. " * 2
    with Client(srv.endpoint, timeout=20) as c:
        outs = [
            c.generate(system + f"Question {i}", params=SamplingParams(max_tokens=2))
            for i in range(6)
        ]
        assert len({o.worker_id for o in outs}) == 1
        assert outs[0].usage.cached_tokens == 0
        assert all(o.usage.cached_tokens >= 0.8 * len(system) // 4 for o in outs[1:])
        other = c.generate(
            "Something entirely different, unrelated to before", params=SamplingParams(max_tokens=2)
        )
        assert (
            other.worker_id != outs[0].worker_id
        )  # a fresh prefix goes to the idle, emptier worker
        st = c.stats()
        w = st.workers[outs[0].worker_id]
        assert w.requests == 6 and w.hit_rate > 0.5


def test_stop_string_aborts_in_worker(fake_server, tokenizer, alphabet) -> None:
    srv = fake_server(step_delay=0.002)
    prompt = tokenizer.encode("Stop me")
    expected = [fake_token(prompt, k, alphabet) for k in range(50)]
    stop = tokenizer.decode(expected[5:7])
    with Client(srv.endpoint, timeout=20) as c:
        out = c.generate(input_ids=prompt, params=SamplingParams(max_tokens=50, stop=[stop]))
        assert out.finish_reason == "stop"
        full = tokenizer.decode(expected)
        assert out.text == full[: full.index(stop)]
        assert _idle(_wait_stats(c, _idle))


def test_stop_regex_ends_the_text_and_a_backtracking_one_fails(
    fake_server, tokenizer, alphabet
) -> None:
    """The router cuts the text at a stop pattern's first match and stops the worker; a
    pattern that backtracks past its CPU budget fails its request (a 400) and frees its KV,
    and the router serves the next request."""
    import re

    srv = fake_server(step_delay=0.002)
    prompt = tokenizer.encode("Stop me")
    full = tokenizer.decode([fake_token(prompt, k, alphabet) for k in range(50)])
    pattern = "[x-z]{2}a"
    m = re.search(pattern, full)
    assert m is not None
    with Client(srv.endpoint, timeout=20) as c:
        out = c.generate(
            input_ids=prompt, params=SamplingParams(max_tokens=50, stop_regex=[pattern])
        )
        assert out.finish_reason == "stop" and out.matched_stop == pattern
        assert out.text == full[: m.start()] and len(out.token_ids) < 50
        with pytest.raises(ServerError) as exc:  # letters only: 2^n ways to fail at each start
            c.generate(
                input_ids=prompt,
                params=SamplingParams(max_tokens=50, stop_regex=["(?:[a-z]|[a-z])*[0-9]"]),
            )
        assert exc.value.code == "invalid_params" and "stop_regex" in exc.value.message
        assert _idle(_wait_stats(c, _idle))
        assert c.generate(input_ids=prompt, params=SamplingParams(max_tokens=2)).text


def test_sessions_model_info_tokenize_flush_duplicates(fake_server, tokenizer) -> None:
    srv = fake_server(num_workers=2, context_length=128)
    with Client(srv.endpoint, timeout=20) as c:
        info = c.model_info()
        assert (
            info.context_length == 128
            and info.num_workers == 2
            and "im_start" in (info.chat_template or "")
        )
        assert info.special_tokens.get("eos_token") == "<|im_end|>"
        assert c.tokenize(["hello world", "x"]) == [
            tokenizer.encode("hello world"),
            tokenizer.encode("x"),
        ]
        w = {
            c.generate(
                f"session call {i} " + "z" * i,
                session_id="prog-1",
                params=SamplingParams(max_tokens=1),
            ).worker_id
            for i in range(5)
        }
        assert len(w) == 1
        chat = c.generate(
            messages=[{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=1)
        )
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
        # A flush is taken from the server's own process only (test_local_join.py).
        with Client(srv.router.inproc_endpoint, timeout=20, context=srv.router.context) as own:
            assert own.flush_cache() is True
        st = c.stats()
        assert all(w.engine["pages_evictable"] == 0 for w in st.workers)
        rid = c.submit("dup", params=SamplingParams(max_tokens=3), request_id="same")
        c._send(p.GenerateRequest(request_id="same", text="dup"))
        with pytest.raises(ServerError) as exc:
            c.result(rid)
        assert exc.value.code == "duplicate_request"
        # Reusing an id still in flight on this client is refused before anything is sent:
        # a second waiter would orphan the first request.
        first = c.submit("long", params=SamplingParams(max_tokens=50), request_id="again")
        with pytest.raises(ValueError, match="already in flight"):
            c.submit("dup", params=SamplingParams(max_tokens=1), request_id="again")
        assert c.result(first).finish_reason == "length"


def test_hung_worker_is_declared_dead_by_heartbeat(fake_server) -> None:
    import os
    import signal

    srv = fake_server(
        num_workers=2, step_delay=0.01, router=dict(routing="round_robin", worker_timeout_s=1.0)
    )
    with Client(srv.endpoint, timeout=20) as c:
        rid = c.submit("hang on", params=SamplingParams(max_tokens=100_000), stream=True)
        stream = c.events(rid)
        assert isinstance(next(stream), p.GenerateChunk)
        victim = srv.procs[0]  # round robin: the first request went to worker 0
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ServerError) as exc:
                for _ in stream:
                    pass
            assert exc.value.code == "worker_died" and "no heartbeat" in exc.value.message
            assert (
                c.generate("served elsewhere", params=SamplingParams(max_tokens=1)).worker_id == 1
            )
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        # Once it runs again, the worker finds the router silent toward it and joins again:
        # a long step costs its requests, not the worker.
        deadline = time.monotonic() + 20
        while c.health().workers_alive < 2:
            assert time.monotonic() < deadline, "the resumed worker did not join again"
            time.sleep(0.1)  # polling the router's view; nothing to wait on from outside
        served = {
            c.generate(f"both again {i}", params=SamplingParams(max_tokens=1)).worker_id
            for i in range(4)
        }
        assert served == {0, 1}
    assert victim.poll() is None  # the same process, still watched by the router


def test_remote_worker_joins_by_endpoint_over_ipc(
    tokenizer_dir, tokenizer, alphabet, tmp_path, fast_router, fake_worker_cmd
) -> None:
    import json
    import os
    import subprocess

    from radixserve.serving.router.launcher import LocalServer, stop_processes
    from radixserve.serving.router.router import RouterConfig

    cfg = RouterConfig(
        **{
            **fast_router,
            "endpoint": f"ipc://{tmp_path}/clients.sock",
            "worker_endpoint": f"ipc://{tmp_path}/workers.sock",
        }
    )
    srv = LocalServer(tokenizer_dir, num_workers=0, config=cfg, tokenizer=tokenizer).start()
    engine = json.dumps({"alphabet": alphabet, "vocab_size": len(tokenizer)})
    # A worker the server did not start needs a key the router lists: here one minted for it
    # (a library user's way; `radixserve worker --keys` is the command line's).
    keys = srv.router.security.mint("workers", "remote-worker")
    remote = subprocess.Popen(
        [*fake_worker_cmd, "--connect", srv.router.worker_endpoint, "--engine-config", engine],
        env={**os.environ, **keys.to_env()},
    )
    try:
        with Client(srv.endpoint, timeout=20) as c:
            # Sent before the worker joined: it waits for one.
            out = c.generate("joined later", params=SamplingParams(max_tokens=3))
            assert out.usage.completion_tokens == 3 and out.worker_id == 0
            assert c.health().workers_alive == 1
    finally:
        srv.close()  # tells the remote worker to shut down too
        stop_processes([remote], grace_s=10)
    assert remote.returncode == 0


def test_keepalives_keep_a_long_unstreamed_request_alive(fake_server) -> None:
    import asyncio

    from radixserve.serving.client import AsyncClient

    srv = fake_server(
        step_delay=0.03
    )  # 20 tokens take ~0.6 s, the clients time out after 0.3 s of silence
    params = SamplingParams(max_tokens=20)
    with Client(srv.endpoint, timeout=0.3) as c:
        assert c.generate("slow", params=params).usage.completion_tokens == 20

    async def run() -> int:
        async with AsyncClient(srv.endpoint, timeout=0.3) as ac:
            return (await ac.generate("slow", params=params)).usage.completion_tokens

    assert asyncio.run(run()) == 20


def test_sigterm_stops_a_worker_cleanly(fake_server) -> None:
    import signal

    srv = fake_server(num_workers=2)
    with Client(srv.endpoint, timeout=20) as c:
        srv.procs[1].send_signal(signal.SIGTERM)
        assert srv.procs[1].wait(10) == 0  # a clean exit, not a signal death
        st = _wait_stats(c, lambda s: s.workers[1].death is not None)  # settled
        assert [w.alive for w in st.workers] == [True, False]
        assert "goodbye" in (st.workers[1].death or "")
        assert c.generate("still served", params=SamplingParams(max_tokens=1)).worker_id == 0


def test_close_interrupts_a_long_engine_step(fake_server) -> None:
    """Stopping the server must not wait for a long engine step: the worker gets SIGTERM,
    abandons the step, says goodbye and exits 0; the client in flight gets a shutdown error."""
    import time

    srv = fake_server(stall_after_steps=1, stall_s=120.0)  # the 2nd step outlasts any timeout here
    with Client(srv.endpoint, timeout=20) as c:
        events = c.stream("stall", params=SamplingParams(max_tokens=5))
        assert isinstance(next(events), p.GenerateChunk)  # step 1 done: the worker is into step 2
        start = time.monotonic()
        srv.close()
        elapsed = time.monotonic() - start
        with pytest.raises(ServerError) as exc:
            for _ in events:
                pass
        assert exc.value.code == "shutdown"
    assert elapsed < 5.0, f"close() took {elapsed:.1f} s"
    assert srv.procs[0].returncode == 0  # a clean exit through the signal handler, not a kill


TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}>"


@pytest.mark.parametrize("trusted", [False, True])
def test_a_requests_own_chat_template_where_the_router_trusts_them(
    fake_server, trusted: bool
) -> None:
    """vLLM's per-request ``chat_template``: refused (invalid_params) unless the router takes
    them; where it does, the prompt is the request's template rendered, in the tokenizer
    processes as on the loop, for a generation and a token count alike. chat_template_kwargs
    cannot bring one in by the back door."""
    from radixserve.serving.wire.limits import RequestLimits

    srv = fake_server(router=dict(limits=RequestLimits(request_chat_templates=trusted)))
    chat = [p.ChatMessage(role="user", content="hi there")]
    with Client(srv.endpoint, timeout=30) as c:
        if not trusted:
            with pytest.raises(ServerError) as exc:
                c.generate(messages=chat, chat_template=TEMPLATE)
            assert exc.value.code == "invalid_params" and "trust-request" in exc.value.message
            with pytest.raises(ServerError, match="trust-request"):
                c.tokenize_chat(chat, chat_template=TEMPLATE)
            return
        want = c.tokenize(["[user] hi there\n>"], add_special_tokens=False)[0]
        assert c.tokenize_chat(chat, chat_template=TEMPLATE) == want
        out = c.generate(messages=chat, chat_template=TEMPLATE, params=SamplingParams(max_tokens=2))
        assert out.usage.prompt_tokens == len(want)
        with pytest.raises(ServerError, match="chat_template_kwargs may not set chat_template"):
            c.generate(messages=chat, chat_template_kwargs='{"chat_template": "x"}')
        with pytest.raises(ServerError, match="chat messages only"):
            c.generate("plain text", chat_template=TEMPLATE)
