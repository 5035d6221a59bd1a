"""SGLang-native endpoints with the exact request shapes SGLang's ``RuntimeEndpoint`` sends
(python/sglang/lang/backend/runtime_endpoint.py): generate, generate_stream, select's
prefix-caching and batched prompt-logprob requests, get_model_info, flush_cache, server info."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import hf_hidden_states, hf_model

from radixserve.sampling_params import MAX_HIDDEN_STATE_FLOATS

pytestmark = pytest.mark.slow  # a real server process


# What RuntimeEndpoint.generate puts in sampling_params (SglSamplingParams.to_srt_kwargs).
def srt_params(**over: Any) -> dict[str, Any]:
    params = {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "max_new_tokens": 8,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": [],
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 1 << 30,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
    }
    params.update(over)
    return params


def test_model_info_health_and_flush(server: Any) -> None:
    with server.client() as c:
        info = c.get("/get_model_info").json()
        # The path the model was loaded from (clients load the tokenizer from it), as SGLang answers.
        assert info["model_path"] == info["tokenizer_path"] == str(server.model_dir)
        assert info["served_model_name"] == server.model_dir.name and info["is_generation"] is True
        assert c.get("/health").status_code == 200
        assert c.get("/health_generate").status_code == 200
        r = c.post("/flush_cache")
        assert r.status_code == 200, r.text
        server_info = c.get("/get_server_info").json()
        assert server_info["model_path"] == server.model_dir.name  # the served name
        assert (
            server_info["memory"]["0"]["device"] == "cpu"
            and server_info["memory"]["0"]["pool_bytes"] > 0
        )
        assert c.get("/server_info").json()["workers"][0]["engine"]["num_pages"] == 512


def test_generate_like_runtime_endpoint(server: Any) -> None:
    with server.client() as c:
        data = {
            "text": "Once upon a time",
            "sampling_params": srt_params(max_new_tokens=6, ignore_eos=True),
        }
        obj = c.post("/generate", json=data).json()
        meta = obj["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 6}
        assert (
            meta["completion_tokens"] == 6 == len(obj["output_ids"]) and meta["prompt_tokens"] > 0
        )
        assert "cached_tokens" in meta and isinstance(obj["text"], str)
        again = c.post("/generate", json=data).json()
        assert again["text"] == obj["text"] and again["meta_info"]["cached_tokens"] > 0

        # generate_stream: cumulative text per data line, then [DONE].
        with c.stream("POST", "/generate", json={**data, "stream": True}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        pos, pieces = 0, []
        for line in lines[:-1]:
            chunk = json.loads(line[5:])
            pieces.append(chunk["text"][pos:])
            pos += len(pieces[-1])
        assert "".join(pieces) == obj["text"]
        assert json.loads(lines[-2][5:])["meta_info"]["finish_reason"]["type"] == "length"


def test_input_ids_batch_and_n(server: Any, tokenizer: Any) -> None:
    ids = tokenizer.encode("Once upon a time")
    with server.client() as c:
        single = c.post(
            "/generate", json={"input_ids": ids, "sampling_params": srt_params(max_new_tokens=4)}
        ).json()
        batch = c.post(
            "/generate",
            json={
                "input_ids": [ids, ids[:3]],
                "sampling_params": [srt_params(max_new_tokens=4), srt_params(max_new_tokens=2)],
            },
        ).json()
        assert isinstance(batch, list) and len(batch) == 2
        assert batch[0]["output_ids"] == single["output_ids"] and len(batch[1]["output_ids"]) <= 2
        n = c.post(
            "/generate",
            json={
                "text": "abc",
                "sampling_params": srt_params(n=3, temperature=1.0, sampling_seed=1),
            },
        ).json()
        assert isinstance(n, list) and len(n) == 3


def _hf_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 from transformers, the reference."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_select_style_batched_logprob_request(server: Any, tokenizer: Any) -> None:
    """RuntimeEndpoint.select: cache the prefix with max_new_tokens 0, then one batched request
    of prefix+choice texts with return_logprob, return_text_in_logprobs and logprob_start_len."""
    prefix = (
        "Question: which city is the capital of France, the country with the Eiffel tower? Answer:"
    )
    choices = [" Paris", " London", " a city in Europe"]
    with server.client() as c:
        obj = c.post(
            "/generate", json={"text": prefix, "sampling_params": {"max_new_tokens": 0}}
        ).json()
        assert obj["text"] == "" and obj["meta_info"]["completion_tokens"] == 0
        prompt_len = obj["meta_info"]["prompt_tokens"]
        assert prompt_len == len(tokenizer.encode(prefix))
        start = max(prompt_len - 2, 0)
        data = {
            "text": [prefix + ch for ch in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": start,
            "top_logprobs_num": 2,
        }
        out = c.post("/generate", json=data).json()
    assert isinstance(out, list) and len(out) == len(choices)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(server.model_dir), dtype=torch.float32)
    for ch, r in zip(choices, out):
        ids = tokenizer.encode(prefix + ch)
        inp = r["meta_info"]["input_token_logprobs"]
        assert r["meta_info"]["output_token_logprobs"] == []
        assert [e[1] for e in inp] == ids[
            start:
        ]  # [logprob, token_id, text] from logprob_start_len on
        assert [e[2] for e in inp] == [tokenizer.decode([t]) for t in ids[start:]]
        ref = _hf_logprobs(model, ids)
        for k, (value, _, _) in enumerate(inp):
            assert value == pytest.approx(ref[start + k - 1], abs=2e-3)
        # Each scored position's two likeliest tokens, [logprob, id, text] (SGLang's shape).
        with torch.inference_mode():
            dist = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        for k, top in enumerate(r["meta_info"]["input_top_logprobs"]):
            values, top_ids = dist[start + k - 1].topk(2)
            assert [e[1] for e in top] == top_ids.tolist()
            assert [e[0] for e in top] == pytest.approx(values.tolist(), abs=2e-3)
            assert [e[2] for e in top] == [tokenizer.decode([t]) for t in top_ids.tolist()]
        # What select computes from them (compute_normalized_prompt_logprobs): finite.
        values = [e[0] for e in inp if e[0]]
        assert math.isfinite(sum(values) / len(values))
        # The prefix request cached the prefix; positions whose logprobs are asked are recomputed.
        assert 0 < r["meta_info"]["cached_tokens"] <= start


def test_logprobs_of_generated_tokens(server: Any) -> None:
    with server.client() as c:
        r = c.post(
            "/generate",
            json={
                "text": "hello",
                "sampling_params": srt_params(max_new_tokens=3, ignore_eos=True),
                "return_logprob": True,
                "top_logprobs_num": 2,
                "return_text_in_logprobs": True,
            },
        ).json()
    meta = r["meta_info"]
    assert (
        meta["input_token_logprobs"] == []
    )  # logprob_start_len absent: outputs only (SGLang's default)
    out = meta["output_token_logprobs"]
    assert [e[1] for e in out] == r["output_ids"]
    for entry, top in zip(out, meta["output_top_logprobs"]):
        assert len(top) == 2 and top[0][1] == entry[1]  # greedy: the chosen token is the top one
        assert top[0][0] == pytest.approx(entry[0])


def test_logprobs_of_named_tokens(server: Any, tokenizer: Any) -> None:
    """SGLang's token_ids_logprob, one list per prompt of a batch: at every reported prompt
    position (from logprob_start_len) and output position, [logprob, token_id, text] of each
    named token in the order named, as transformers computes them; streamed, each message
    has its new tokens' only, as for output_token_logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    texts = ["The capital of France is", "Two and two make"]
    named = [tokenizer.encode(" Paris") + tokenizer.encode(" London"), tokenizer.encode(" four")]
    body = {
        "text": texts,
        "sampling_params": srt_params(max_new_tokens=3, ignore_eos=True),
        "return_logprob": True,
        "logprob_start_len": 2,
        "return_text_in_logprobs": True,
        "token_ids_logprob": named,
    }
    with server.client() as c:
        out = c.post("/generate", json=body).json()
        with c.stream(
            "POST",
            "/generate",
            json={**body, "text": texts[0], "stream": True, "token_ids_logprob": named[0]},
        ) as r:
            chunks = [
                json.loads(line[5:]) for line in r.iter_lines() if line and line != "data: [DONE]"
            ]
    model = AutoModelForCausalLM.from_pretrained(str(server.model_dir), dtype=torch.float32)
    for text, ids, r in zip(texts, named, out):
        prompt = tokenizer.encode(text)
        seq = prompt + r["output_ids"]
        with torch.inference_mode():
            dist = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
        meta = r["meta_info"]
        # The distribution that scores each reported position: prompt positions 2.. (each
        # from the row before it), then the three outputs (from the last prompt row on).
        rows = [p - 1 for p in range(2, len(prompt))] + [len(prompt) - 1 + i for i in range(3)]
        got = meta["input_token_ids_logprobs"] + meta["output_token_ids_logprobs"]
        assert len(got) == len(rows) and len(meta["input_token_ids_logprobs"]) == len(prompt) - 2
        for row, entry in zip(rows, got):
            assert [e[1] for e in entry] == ids
            assert [e[2] for e in entry] == [tokenizer.decode([t]) for t in ids]
            assert [e[0] for e in entry] == pytest.approx(
                [dist[row, t].item() for t in ids], abs=2e-3
            )
    streamed = [e for ch in chunks for e in ch["meta_info"]["output_token_ids_logprobs"]]
    assert [[e[1] for e in entry] for entry in streamed] == [named[0]] * 3
    assert [e[0] for entry in streamed for e in entry] == pytest.approx(
        [e[0] for entry in out[0]["meta_info"]["output_token_ids_logprobs"] for e in entry],
        abs=1e-5,
    )


def test_streamed_logprobs_chunk_by_chunk(server: Any) -> None:
    """Streamed with logprobs: every message has the cumulative ids and counts and the logprobs
    of its new tokens only; concatenated they equal the unstreamed request's."""
    body = {
        "text": "hello there",
        "sampling_params": srt_params(max_new_tokens=6, ignore_eos=True),
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    with server.client() as c:
        whole = c.post("/generate", json=body).json()
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            chunks = [
                json.loads(line[5:]) for line in r.iter_lines() if line and line != "data: [DONE]"
            ]
    logprobs, tops, seen = [], [], 0
    for ch in chunks:
        meta = ch["meta_info"]
        new = meta["output_token_logprobs"]
        assert [e[1] for e in new] == ch["output_ids"][
            seen:
        ]  # exactly the tokens this message added
        assert (
            meta["completion_tokens"]
            == meta["output_token_logprobs_length"]
            == len(ch["output_ids"])
        )
        assert meta["prompt_tokens"] == whole["meta_info"]["prompt_tokens"]
        seen = len(ch["output_ids"])
        logprobs += new
        tops += meta["output_top_logprobs"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert [e[1] for e in logprobs] == whole["output_ids"] == chunks[-1]["output_ids"]
    assert [e[0] for e in logprobs] == pytest.approx(
        [e[0] for e in whole["meta_info"]["output_token_logprobs"]]
    )
    assert len(tops) == len(logprobs) and all(len(t) == 2 for t in tops)


def test_stop_string_matched_and_kept_with_no_stop_trim(server: Any) -> None:
    with server.client() as c:
        data = {"text": "Once upon a time", "sampling_params": srt_params(ignore_eos=True)}
        first = c.post("/generate", json=data).json()
        text = first["text"]
        stop = next(text[i : i + 2] for i in range(2, len(text)) if text[i : i + 2].strip())
        for trim, expect in ((False, text[: text.find(stop)]), (True, None)):
            sp = srt_params(ignore_eos=True, stop=["@@@", stop], no_stop_trim=trim)
            obj = c.post("/generate", json={**data, "sampling_params": sp}).json()
            assert obj["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
            assert obj["text"] == (expect or text[: text.find(stop) + len(stop)])
        pattern = re.escape(stop[0]) + "."  # a stop pattern: the pattern is what matched
        m = re.search(pattern, text)
        assert m is not None
        for trim, expect in ((False, text[: m.start()]), (True, text[: m.end()])):
            sp = srt_params(ignore_eos=True, stop_regex=pattern, no_stop_trim=trim)
            obj = c.post("/generate", json={**data, "sampling_params": sp}).json()
            assert obj["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
            assert obj["text"] == expect
        r = c.post(
            "/generate",
            json={**data, "sampling_params": srt_params(stop_regex=["(?:(?:a{30}){30}){30}"])},
        )
        assert r.status_code == 400 and "expands to" in r.json()["error"]["message"]
        sp = srt_params(stop_token_ids=[first["output_ids"][1]])  # a stop token: its id
        obj = c.post("/generate", json={**data, "sampling_params": sp}).json()
        assert obj["meta_info"]["finish_reason"] == {
            "type": "stop",
            "matched": first["output_ids"][1],
        }


def test_sglang_bad_requests(server: Any) -> None:
    with server.client() as c:
        for body in (
            {"sampling_params": {"max_new_tokens": 2}},  # no prompt
            {"text": "hi", "sampling_params": {"max_new_tokens": 2, "no_such_param": 1}},
            {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
            {"text": "hi", "sampling_params": {"temperature": "hot"}},
            {"text": "hi", "sampling_params": {"ebnf": "root ::= nowhere"}},
            {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]},
            {"input_ids": [1, 2**64], "sampling_params": {"max_new_tokens": 1}},
            {"text": "hi", "sampling_params": {"max_new_tokens": 2**64}},
            {"text": "hi", "sampling_params": {"json_schema": "[" * 5000 + "]" * 5000}},
            # token_ids_logprob: outside the vocabulary, too many, one list per prompt amiss
            {"text": "hi", "return_logprob": True, "token_ids_logprob": [10**7]},
            {"text": "hi", "return_logprob": True, "token_ids_logprob": list(range(257))},
            {"text": ["a", "b"], "return_logprob": True, "token_ids_logprob": [[1], [2], [3]]},
        ):
            r = c.post("/generate", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["message"]
        assert (
            c.post(
                "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}
            ).status_code
            == 200
        )


def test_get_load_reports_each_workers_requests_and_kv_tokens(server: Any) -> None:
    """SGLang's ``/get_load`` (what sgl-router balances by): a running request shows in its
    worker's entry, and nothing once it ended."""
    from http_helpers import wait_idle

    body = {
        "text": "Count to a thousand.",
        "stream": True,
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
    }
    with server.client() as c:
        wait_idle(c)
        (idle,) = c.get("/get_load").json()
        assert idle == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        with c.stream("POST", "/generate", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            next(lines)  # it runs: its outputs carry its worker's load
            (busy,) = c.get("/get_load").json()
            c.post("/abort_request", json={"abort_all": True})
            list(lines)
        assert busy["num_reqs"] == 1 and busy["num_waiting_reqs"] == 0 and busy["num_tokens"] > 0
        wait_idle(c)


def test_hidden_states_in_meta_info(server: Any, tiny_llama_dir: Path) -> None:
    """return_hidden_states one per prompt: the asking prompt's meta_info.hidden_states is
    SGLang's shape (every prompt position's vectors, then one vector per output token but the
    last) with transformers' values; the other prompt's has none; a stream carries them in its
    final message only; a request that could return too many floats is a 400."""
    ids = [[5, 9, 13, 2, 7, 30], [11, 4, 8]]
    body = {
        "input_ids": ids,
        "sampling_params": srt_params(max_new_tokens=4, ignore_eos=True),
        "return_hidden_states": [True, False],
    }
    with server.client() as c:
        asked, plain = c.post("/generate", json=body).json()
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            chunks = [
                json.loads(line[5:]) for line in r.iter_lines() if line and line != "data: [DONE]"
            ]
        width = hf_model(tiny_llama_dir).config.hidden_size
        big: dict[str, Any] = {"input_ids": ids[0], "return_hidden_states": True}
        # One position more than the bound allows (its prompt's and all but the last output's).
        big["sampling_params"] = {"max_new_tokens": MAX_HIDDEN_STATE_FLOATS // width - 5 + 1}
        refused = c.post("/generate", json=big)
    hidden = asked["meta_info"]["hidden_states"]
    assert len(hidden) == 4 and len(hidden[0]) == len(ids[0])
    assert all(len(v) == width for v in [*hidden[0], *hidden[1:]])
    flat = torch.tensor([*hidden[0], *hidden[1:]])
    ref = hf_hidden_states(tiny_llama_dir, ids[0] + asked["output_ids"][:-1])
    torch.testing.assert_close(flat, ref, atol=1e-4, rtol=1e-4)
    assert "hidden_states" not in plain["meta_info"]
    mine = [ch for ch in chunks if ch.get("index") == 0]
    assert all("hidden_states" not in ch["meta_info"] for ch in mine[:-1])
    again = mine[-1]["meta_info"]["hidden_states"]
    torch.testing.assert_close(torch.tensor([*again[0], *again[1:]]), flat, atol=1e-4, rtol=1e-4)
    assert refused.status_code == 400, refused.text
    assert "return_hidden_states would return" in refused.json()["error"]["message"]


def test_hidden_states_of_an_output_cut_at_a_stop_string(server: Any, tiny_llama_dir: Path) -> None:
    """The router ends the output at a stop string before the worker ends the request: the
    final message still carries every position the kept output was read at."""
    ids = [5, 9, 13, 2, 7, 30]
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": srt_params(max_new_tokens=10, ignore_eos=True),
        "return_logprob": True,
        "return_text_in_logprobs": True,
    }
    with server.client() as c:
        free = c.post("/generate", json=body).json()
        stop = free["meta_info"]["output_token_logprobs"][3][2].strip()
        assert stop and stop not in free["text"][:4]  # a stop the output meets later
        body["sampling_params"]["stop"] = [stop]
        cut = c.post("/generate", json={**body, "return_hidden_states": True}).json()
    assert cut["meta_info"]["finish_reason"]["type"] == "stop"
    assert 0 < len(cut["output_ids"]) < 10
    hidden = cut["meta_info"]["hidden_states"]
    flat = torch.tensor([*hidden[0], *hidden[1:]])
    ref = hf_hidden_states(tiny_llama_dir, ids + cut["output_ids"][:-1])
    assert flat.shape == ref.shape
    torch.testing.assert_close(flat, ref, atol=1e-4, rtol=1e-4)
