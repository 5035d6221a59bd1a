"""Unit tests of the wire protocol: round trips and every kind of bad frame."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.serving.wire import protocol as p


def _frame(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


def test_round_trip_every_client_message() -> None:
    msgs = [
        p.GenerateRequest(
            request_id="r1",
            text="hi",
            params=SamplingParams(max_tokens=4, temperature=0),
            stream=True,
        ),
        p.GenerateRequest(request_id="r2", input_ids=[1, 2, 3], session_id="s", namespace="ns"),
        p.GenerateRequest(request_id="r3", messages=[p.ChatMessage(role="user", content="hello")]),
        p.Abort(request_id="r1"),
        p.Health(request_id="h"),
        p.ModelInfoRequest(request_id="m"),
        p.FlushCache(request_id="f"),
        p.StatsRequest(request_id="s"),
        p.DetokenizeRequest(request_id="d", token_ids=[1, 2], skip_special_tokens=True),
    ]
    for msg in msgs:
        assert p.decode_client(p.encode(msg)) == msg


def test_round_trip_server_and_worker_messages() -> None:
    lp = [p.TokenLogprob(5, -0.25, [(5, -0.25), (7, -2.0)])]
    server = [
        p.GenerateChunk(request_id="r", index=0, text="a", token_ids=[5], logprobs=lp),
        p.GenerateFinal(
            request_id="r",
            finish_reason="stop",
            text="a",
            token_ids=[5],
            usage=p.Usage(3, 1, 1),
            timings=p.Timings(0.0, 0.1, 0.2),
            prompt_logprobs=[None, -1.5],
            prompt_top_logprobs=[[], [(4, -0.5), (9, -1.5)]],
            prompt_token_ids=[1, 9],
            matched_stop="\n\n",
        ),
        p.DetokenizeReply(request_id="d", text="hi"),
        p.Error(code="context_length", message="too long", request_id="r"),
        p.KeepAlive(),
    ]
    for msg in server:
        assert p.decode_server(p.encode(msg)) == msg
    to_worker = [
        p.WorkerAdd(requests=[p.WorkerRequest(rid="1", input_ids=[1], params=SamplingParams())]),
        p.WorkerAbort(rids=["1"]),
        p.WorkerPing(),
        p.WorkerStatsRequest(token=3),
        p.WorkerShutdown(),
        p.WorkerRejoin(),
    ]
    for msg in to_worker:
        assert p.decode_to_worker(p.encode(msg)) == msg
    from_worker = [
        p.WorkerHello(
            worker_id=0, pid=1, model="m", context_length=64, vocab_size=10, eos_token_ids=[2]
        ),
        p.WorkerOutputs(
            outputs=[
                p.StepOutput(
                    request_id="1",
                    new_token_ids=[3],
                    new_logprobs=lp,
                    prompt_logprobs=[None],
                    prompt_top_logprobs=[[]],
                    finished=True,
                    finish_reason="length",
                    usage=p.Usage(1, 0, 1),
                )
            ],
            load=p.WorkerLoad(running=1),
        ),
        p.WorkerStatsReply(token=3, load=p.WorkerLoad(), engine={"hits": 3, "rate": 0.5}),
    ]
    for msg in from_worker:
        assert p.decode_from_worker(p.encode(msg)) == msg


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"\xc1", "malformed"),
        (b"not msgpack at all", "malformed"),
        (msgspec.msgpack.encode([1, 2, 3]), "malformed"),
        (_frame(type="launch_missiles", request_id="x"), "unknown_type"),
        (_frame(type=["generate"], request_id="x"), "unknown_type"),  # an unhashable tag
        (_frame(type={"generate": 1}, request_id="x"), "unknown_type"),
        (_frame(request_id="x", text="a"), "invalid_message"),
        (_frame(type="generate", request_id="x", text="a", version=999), "version_mismatch"),
        (_frame(type="generate", request_id="x", text="a", extra=1), "invalid_message"),
        (
            _frame(type="generate", request_id="x", text="a", params={"max_tokens": 4, "bogus": 1}),
            "invalid_message",
        ),
        (_frame(type="generate", request_id="x", text=5), "invalid_message"),
        (
            _frame(type="generate", request_id="x", text="a", params={"temperature": -1.0}),
            "invalid_params",
        ),
        (
            _frame(type="generate", request_id="x", text="a", params={"top_p": 0.0}),
            "invalid_params",
        ),
        (_frame(type="generate", request_id="x"), "invalid_params"),
        (_frame(type="generate", request_id="x", text="a", input_ids=[1]), "invalid_params"),
        (_frame(type="generate", request_id="x", input_ids=[]), "invalid_params"),
        (_frame(type="generate", request_id="x", input_ids=[-1]), "invalid_params"),
        (_frame(type="generate", request_id="", text="a"), "invalid_params"),
    ],
)
def test_bad_frames_become_errors(frame: bytes, code: str) -> None:
    err = p.decode_client(frame)
    assert isinstance(err, p.Error), err
    assert err.code == code, err
    assert err.message


def test_error_keeps_request_id_when_known() -> None:
    err = p.decode_client(_frame(type="generate", request_id="abc", text="a", bogus=True))
    assert isinstance(err, p.Error) and err.request_id == "abc"
    assert "bogus" in err.message


def test_request_id_of_reads_any_frame() -> None:
    assert p.request_id_of(_frame(type="generate", request_id="abc", text=5)) == "abc"
    assert p.request_id_of(_frame(type="generate", request_id=7)) is None
    assert p.request_id_of(b"\xc1") is None


def test_nested_schema_is_invalid_params() -> None:
    err = p.decode_client(
        _frame(
            type="generate",
            request_id="x",
            text="a",
            params={"json_schema": "[" * 5000 + "]" * 5000},
        )
    )
    assert isinstance(err, p.Error) and err.code == "invalid_params" and err.request_id == "x"


def test_vocab_check() -> None:
    req = p.GenerateRequest(request_id="r", input_ids=[1, 99])
    assert p.validate_generate(req, vocab_size=100) is None
    err = p.validate_generate(req, vocab_size=50)
    assert err is not None and err.code == "invalid_params"


def test_protocol_and_client_import_without_torch() -> None:
    code = (
        "import sys, radixserve.serving, radixserve.serving.wire.protocol, radixserve.serving.client;"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
