"""Request limits and invalid text, checked before any tokenizing: units, then over ZeroMQ
against a router with fake workers."""

from __future__ import annotations

import json

import msgspec
import pytest
import zmq
from raw_client import recv_reply

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client, ServerError
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire.limits import RequestLimits, invalid_utf8_path, surrogate_path

LONE = (
    b"\xed\xb2\x80"  # U+DC80 as (CESU-style) UTF-8 bytes: what a lone surrogate becomes on the wire
)


def test_surrogate_path_names_the_field() -> None:
    body = json.loads(
        '{"model": "m", "messages": [{"role": "user", "content": "ok"},'
        ' {"role": "user", "content": "bad \\udc80"}], "stop": ["\\ud83d\\ude00"]}'
    )
    assert surrogate_path(body) == "messages[1].content"
    assert surrogate_path(json.loads('{"stop": ["a", "\\ud83d\\ude00", "\\ud800x"]}')) == "stop[2]"
    assert (
        surrogate_path(json.loads('{"text": "fine \\ud83d\\ude00"}')) is None
    )  # a valid pair is one character
    assert surrogate_path("\udc80") == "body"


def test_invalid_utf8_path_walks_msgpack() -> None:
    frame = msgspec.msgpack.encode(
        {
            "type": "generate",
            "request_id": "r",
            "text": "X",
            "params": {"stop": ["ok", "Y"], "max_tokens": 3, "temperature": 0.5},
        }
    )
    assert invalid_utf8_path(frame) is None
    assert invalid_utf8_path(frame.replace(b"\xa1X", b"\xa3" + LONE)) == "text"
    assert invalid_utf8_path(frame.replace(b"\xa1Y", b"\xa3" + LONE)) == "params.stop[1]"
    assert invalid_utf8_path(b"\xc1") is None  # not msgpack: the strict decoder explains that


def test_request_limits_arithmetic() -> None:
    lim = RequestLimits(max_request_bytes=100, max_batch_size=4, chars_per_token=8)
    assert lim.request_bytes_error(100) is None and "101 bytes" in (
        lim.request_bytes_error(101) or ""
    )
    assert lim.batch_error(4) is None and lim.batch_error(5) is not None
    assert lim.max_prompt_chars(None) is None and lim.max_prompt_chars(32) == 256
    assert lim.prompt_chars_error(256, 32) is None and "257 characters" in (
        lim.prompt_chars_error(257, 32) or ""
    )
    off = RequestLimits(max_request_bytes=0, max_batch_size=0, chars_per_token=0)
    assert off.request_bytes_error(1 << 40) is None and off.batch_error(1 << 20) is None
    assert off.prompt_chars_error(1 << 30, 32) is None


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_router_refuses_oversize_invalid_and_overlong_before_tokenizing(fake_server) -> None:
    limits = RequestLimits(max_request_bytes=64 << 10, chars_per_token=4)
    srv = fake_server(context_length=64, router=dict(limits=limits))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(srv.endpoint)
    good = {
        "type": "generate",
        "request_id": "g",
        "text": "hi",
        "params": {"max_tokens": 2, "stop": ["zz"]},
    }
    try:
        sock.send(msgspec.msgpack.encode({**good, "request_id": "big", "text": "x" * (100 << 10)}))
        reply = recv_reply(sock)
        assert (
            isinstance(reply, p.Error)
            and reply.code == "request_too_large"
            and reply.request_id == "big"
        )
        frame = msgspec.msgpack.encode({**good, "request_id": "s1", "text": "X"}).replace(
            b"\xa1X", b"\xa3" + LONE
        )
        sock.send(frame)
        reply = recv_reply(sock)
        assert (
            isinstance(reply, p.Error)
            and reply.code == "invalid_params"
            and reply.request_id == "s1"
        )
        assert reply.message.startswith("text: not valid Unicode"), reply.message
        frame = msgspec.msgpack.encode({**good, "request_id": "s2", "params": {"stop": ["Q"]}})
        sock.send(frame.replace(b"\xa1Q", b"\xa3" + LONE))
        reply = recv_reply(sock)
        assert isinstance(reply, p.Error) and reply.message.startswith("params.stop[0]:"), reply
        sock.send(msgspec.msgpack.encode(good))
        reply = recv_reply(sock)
        assert isinstance(reply, p.GenerateFinal) and reply.usage.completion_tokens == 2
    finally:
        sock.close()
    with Client(srv.endpoint, timeout=20) as c:
        # 64 tokens x 4 characters: 257 characters are refused by their length alone.
        with pytest.raises(ServerError) as exc:
            c.generate("y" * 257)
        assert exc.value.code == "context_length" and "257 characters" in exc.value.message
        with pytest.raises(ServerError) as exc:
            c.generate(messages=[{"role": "user", "content": "y" * 300}])
        assert exc.value.code == "context_length" and "characters" in exc.value.message
        with pytest.raises(ServerError) as exc:
            c.tokenize(["ok", "y" * 300])
        assert exc.value.code == "context_length"
        assert (
            c.generate("y" * 20, params=SamplingParams(max_tokens=2)).usage.completion_tokens == 2
        )
        assert c.health().workers_alive == 1
