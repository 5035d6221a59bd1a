"""The official ``openai`` client against a live ``radixserve serve --http-port`` on loopback."""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # a real server process

SYSTEM = (
    "You are a careful assistant for a radix tree serving engine. You answer briefly, "
    "you cite the page size, and you never forget the shared system prompt. "
) * 2


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models(client: openai.OpenAI, server: Any) -> None:
    """The served model, then its LoRA adapter (whose ``parent`` it is, as vLLM lists them)."""
    models = client.models.list().data
    assert [m.id for m in models] == [server.model_dir.name, "sql"]
    assert models[0].model_extra["parent"] is None
    assert models[1].model_extra["parent"] == server.model_dir.name


def test_chat_completion_and_stream_agree(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "Name a data structure."}]
    out = client.chat.completions.create(
        model="default", messages=msgs, max_tokens=8, temperature=0
    )
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert out.usage is not None and out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=msgs,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the same tokens either way
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_stop_string(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "Count with me."}]
    full = client.chat.completions.create(
        model="default",
        messages=msgs,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = full.choices[0].message.content or ""
    # A stop string taken from the middle of the greedy output: the answer ends before it.
    k = next(
        (
            i
            for i in range(2, len(text) - 1)
            if text[i : i + 2].isascii() and text[i : i + 2].strip()
        ),
        None,
    )
    if k is None:
        pytest.skip(f"no usable stop string in {text!r}")
    stop = text[k : k + 2]
    out = client.chat.completions.create(
        model="default",
        messages=msgs,
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == text[: text.find(stop)]
    assert out.choices[0].model_extra["stop_reason"] == stop  # vLLM's: which stop ended it
    kept = text[: text.find(stop) + len(stop)]
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    out = client.chat.completions.create(
        model="default", messages=msgs, max_tokens=16, temperature=0, stop=[stop], extra_body=extra
    )
    assert out.choices[0].message.content == kept

    def streamed(**kw: Any) -> tuple[str, Any]:
        """The streamed text and the last chunk's choice."""
        chunks = list(
            client.chat.completions.create(
                model="default", messages=msgs, max_tokens=16, temperature=0, stream=True, **kw
            )
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0]

    content, last = streamed(stop=["@@@", stop], extra_body=extra)
    assert content == kept and last.finish_reason == "stop"
    assert last.model_extra["stop_reason"] == stop
    # SGLang's stop_regex and no_stop_trim: streamed, the text ends at the match, kept.
    pattern = re.escape(stop[0]) + "."
    m = re.search(pattern, text)
    assert m is not None
    extra = {"ignore_eos": True, "stop_regex": pattern, "no_stop_trim": True}
    content, last = streamed(extra_body=extra)
    assert content == text[: m.end()] and last.model_extra["stop_reason"] == pattern


def test_stop_reason_of_text_completions(client: openai.OpenAI, server: Any) -> None:
    greedy: dict[str, Any] = dict(model="default", prompt="1, 2, 3,", max_tokens=8, temperature=0)
    full = client.completions.create(**greedy, extra_body={"ignore_eos": True})
    assert full.choices[0].model_extra["stop_reason"] is None  # the length ended it
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    ids = httpx.post(
        server.url + "/generate", json={"text": "1, 2, 3,", "sampling_params": sp}, timeout=60
    ).json()["output_ids"]
    stop_id = ids[2]  # the third greedy token ends the choice, and is named as its reason
    for stream in (False, True):
        out = client.completions.create(
            **greedy, stream=stream, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}
        )
        last = list(out)[-1].choices[0] if stream else out.choices[0]  # type: ignore[arg-type]
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop_id


def test_cached_tokens_on_second_call_with_same_system_prompt(client: openai.OpenAI) -> None:
    def ask(question: str) -> Any:
        return client.chat.completions.create(
            model="default",
            max_tokens=4,
            temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        )

    first, second = ask("What is a page?"), ask("What is a prefix?")
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= first.usage.prompt_tokens // 2, (
        first.usage,
        second.usage,
    )
    assert cached < second.usage.prompt_tokens


def test_n_seed_and_logprobs(client: openai.OpenAI, tokenizer: Any) -> None:
    msgs: Any = [{"role": "user", "content": "Pick a word."}]
    kw: dict[str, Any] = dict(
        model="default",
        messages=msgs,
        max_tokens=5,
        temperature=1.0,
        seed=7,
        n=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [
        c.message.content for c in b.choices
    ]  # seeded
    for c in a.choices:
        assert c.logprobs is not None and c.logprobs.content
        for entry in c.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # Each entry's bytes are the token's exact bytes: joined, they are the text (a character
        # split across tokens shows as U+FFFD in each piece's "token" but joins whole here).
        kept = [e for e in c.logprobs.content if e.token not in tokenizer.all_special_tokens]
        assert (
            b"".join(bytes(e.bytes or []) for e in kept).decode("utf-8", "replace")
            == c.message.content
        )
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) for c in a.choices)


def test_text_completions(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="default",
        prompt="The radix tree",
        max_tokens=6,
        temperature=0,
        logprobs=1,
        echo=False,
    )
    c = out.choices[0]
    assert out.object == "text_completion" and c.logprobs is not None
    assert "".join(c.logprobs.tokens or []) == c.text and len(c.logprobs.token_logprobs or []) == 6
    stream = list(
        client.completions.create(
            model="default", prompt="The radix tree", max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(s.choices[0].text for s in stream if s.choices) == c.text
    batch = client.completions.create(
        model="default", prompt=["a b", "c d"], max_tokens=2, temperature=0, echo=True
    )
    assert [ch.index for ch in batch.choices] == [0, 1]
    assert batch.choices[0].text.startswith("a b") and batch.choices[1].text.startswith("c d")


def test_errors_in_openai_shape(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=msgs)
    assert nf.value.code == "model_not_found" and "no-such-model" in nf.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="default", messages=msgs, max_tokens=-1)
    assert "max_tokens" in bad.value.message and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="default", prompt="token " * 3000, max_tokens=1)
    assert long.value.code == "context_length_exceeded"
    ok = client.chat.completions.create(model="default", messages=msgs, max_tokens=1)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_continuous_usage_stats_count_each_choice_so_far(client: openai.OpenAI) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk of a choice carries its
    usage so far (the prompt, its tokens up to there), the last one its final counts; only
    the totals' chunk has none of the choices. Chat (two choices) and completions alike."""
    msgs: Any = [{"role": "user", "content": "Name a fruit."}]
    opts: Any = {"include_usage": True, "continuous_usage_stats": True}
    common: Any = {"model": "default", "max_tokens": 6, "temperature": 0, "stream": True}
    chat = list(client.chat.completions.create(messages=msgs, n=2, stream_options=opts, **common))
    text = list(client.completions.create(prompt="A radix tree", stream_options=opts, **common))
    for chunks in (chat, text):
        *choice_chunks, totals = chunks
        assert totals.choices == [] and totals.usage is not None
        seen: dict[int, list[Any]] = {}
        for c in choice_chunks:
            (choice,) = c.choices
            assert c.usage is not None
            seen.setdefault(choice.index, []).append(c.usage)
        for usages in seen.values():
            assert len({u.prompt_tokens for u in usages}) == 1 and usages[0].prompt_tokens > 0
            done = [u.completion_tokens for u in usages]
            assert done == sorted(done) and 0 < done[-1] <= 6
            assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
        assert totals.usage.completion_tokens == sum(u[-1].completion_tokens for u in seen.values())
        # One prompt (n choices of it): the totals count it once.
        assert totals.usage.prompt_tokens == next(iter(seen.values()))[0].prompt_tokens
    plain = client.chat.completions.create(
        messages=msgs, stream_options={"include_usage": True}, **common
    )
    assert all(c.usage is None for c in list(plain)[:-1])  # the totals' chunk only


def test_echo_with_logprobs_scores_the_prompt(
    client: openai.OpenAI, server: Any, tokenizer: Any
) -> None:
    """What lm-evaluation-harness's ``local-completions`` sends to score a continuation:
    token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``. The prompt comes back with each
    token's logprob and likeliest token, as transformers computes them."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome")
    out = client.completions.create(
        model="default", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    lps = out.choices[0].logprobs
    assert lps is not None and lps.tokens is not None and lps.token_logprobs is not None
    assert len(lps.tokens) == len(ids) + 1  # the prompt's tokens, then the one generated
    assert lps.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lps.token_logprobs[0] is None and (lps.top_logprobs or [])[0] is None
    model = AutoModelForCausalLM.from_pretrained(str(server.model_dir), dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(1, len(ids)):
        assert lps.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-3)
        best = int(ref[i - 1].argmax())
        assert list((lps.top_logprobs or [])[i]) == [tokenizer.decode([best])]  # is_greedy
    assert lps.text_offset is not None and lps.text_offset[len(ids)] == len(
        out.choices[0].text
    ) - len(lps.tokens[-1])
    # max_tokens 0 with echo: the prompt and its logprobs only; a stream of them is a 400.
    only = client.completions.create(
        model="default", prompt=ids, echo=True, logprobs=0, max_tokens=0
    )
    assert only.usage is not None and only.usage.completion_tokens == 0
    assert only.choices[0].text == tokenizer.decode(ids) and only.choices[0].logprobs is not None
    assert only.choices[0].logprobs.token_logprobs == lps.token_logprobs[: len(ids)]
    with pytest.raises(openai.BadRequestError, match="answered whole"):
        client.completions.create(
            model="default", prompt=ids, echo=True, logprobs=1, max_tokens=1, stream=True
        )


def test_vllm_prompt_logprobs_on_completions_and_chat(
    client: openai.OpenAI, server: Any, tokenizer: Any
) -> None:
    """vLLM's ``prompt_logprobs: k``: each prompt token (``null`` for the first) maps token
    ids to their logprob, rank and text: the prompt token's own, then its position's k
    likeliest, as transformers computes them. Completions carry them on each choice, chat
    completions once at the top; the output's ``logprobs`` keep their own k."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome")
    out = client.completions.create(
        model="default",
        prompt=ids,
        max_tokens=2,
        temperature=0,
        logprobs=1,
        extra_body={"prompt_logprobs": 3},
    )
    plps = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    assert all(len(top) == 1 for top in out.choices[0].logprobs.top_logprobs or [])
    model = AutoModelForCausalLM.from_pretrained(str(server.model_dir), dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(1, len(ids)):
        row, entry = ref[i - 1], plps[i]
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(row[ids[i]].item(), abs=2e-3)
        assert own["decoded_token"] == tokenizer.decode([ids[i]])
        assert abs(own["rank"] - 1 - int((row > row[ids[i]]).sum())) <= 1
        best = row.topk(3).indices.tolist()
        assert set(best) <= {int(t) for t in entry} and len(entry) <= 4
        for r, t in enumerate(best, 1):
            assert t == ids[i] or entry[str(t)]["rank"] == r
    msgs: Any = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(
        model="default", messages=msgs, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    chat_lps = chat.model_extra["prompt_logprobs"]
    assert chat_lps[0] is None and all(len(e) == 1 for e in chat_lps[1:])
    assert chat.usage is not None and len(chat_lps) == chat.usage.prompt_tokens
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            client.completions.create(model="default", prompt="x", max_tokens=1, extra_body=bad)
    with pytest.raises(openai.BadRequestError, match="answered whole"):
        client.completions.create(
            model="default", prompt="x", stream=True, extra_body={"prompt_logprobs": 1}
        )


def test_vllm_return_token_ids(client: openai.OpenAI, tokenizer: Any) -> None:
    """vLLM's ``return_token_ids``: the prompt's token ids (a text prompt's encoding; a
    chat's rendered prompt) and each choice's, beside the text, whole or streamed."""
    out = client.completions.create(
        model="default",
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        n=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    for c in out.choices:
        assert c.model_extra["prompt_token_ids"] == tokenizer.encode("The capital of France is")
        assert len(c.model_extra["token_ids"]) == 4
        assert tokenizer.decode(c.model_extra["token_ids"]) == c.text
    msgs: Any = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(
        model="default",
        messages=msgs,
        max_tokens=3,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ids = chat.model_extra["prompt_token_ids"]
    assert chat.usage is not None and len(ids) == chat.usage.prompt_tokens
    assert "Name a color." in tokenizer.decode(ids)
    choice = chat.choices[0]
    assert tokenizer.decode(choice.model_extra["token_ids"]) == choice.message.content
    # Streamed: the prompt's on the first chunk, each chunk's new ones after it.
    extra = {"return_token_ids": True, "ignore_eos": True}
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=msgs,
            max_tokens=3,
            temperature=0,
            stream=True,
            extra_body=extra,
        )
    )
    assert chunks[0].model_extra["prompt_token_ids"] == ids
    streamed = [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids", [])]
    assert streamed == choice.model_extra["token_ids"]
    pieces = list(
        client.completions.create(
            model="default",
            prompt="The capital of France is",
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body=extra,
        )
    )
    first = pieces[0].choices[0].model_extra
    assert first["prompt_token_ids"] == tokenizer.encode("The capital of France is")
    streamed = [t for c in pieces for ch in c.choices for t in ch.model_extra.get("token_ids", [])]
    assert streamed == out.choices[0].model_extra["token_ids"]


def test_vllm_return_tokens_as_token_ids(client: openai.OpenAI) -> None:
    """vLLM's ``return_tokens_as_token_ids``: logprobs name every token ``token_id:<id>``
    (the chosen ones the same ids ``return_token_ids`` gives, the likeliest ones too),
    chat and text completions, whole or streamed; the text's offsets still count the text."""
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True, "ignore_eos": True}
    msgs: Any = [{"role": "user", "content": "Name a color."}]
    kw: Any = dict(model="default", max_tokens=4, temperature=0, extra_body=extra)
    chat = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=2, **kw)
    choice = chat.choices[0]
    content = choice.logprobs.content  # type: ignore[union-attr]
    assert [c.token for c in content] == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    chunks = client.chat.completions.create(
        messages=msgs, logprobs=True, top_logprobs=2, stream=True, **kw
    )
    streamed = [
        c.token
        for ch in chunks
        for x in ch.choices
        for c in ((x.logprobs.content if x.logprobs else None) or [])
    ]
    assert streamed == [c.token for c in content]
    text = client.completions.create(prompt="The capital of France is", logprobs=2, **kw)
    lp, ids = text.choices[0].logprobs, text.choices[0].model_extra["token_ids"]
    assert lp is not None and lp.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs or [] for k in top)
    plain = client.completions.create(
        prompt="The capital of France is", logprobs=2, **{**kw, "extra_body": {"ignore_eos": True}}
    )
    assert plain.choices[0].text == text.choices[0].text
    assert lp.text_offset == plain.choices[0].logprobs.text_offset  # type: ignore[union-attr]
    pieces = client.completions.create(
        prompt="The capital of France is", logprobs=2, stream=True, **kw
    )
    assert [
        t for p in pieces for c in p.choices for t in (c.logprobs.tokens if c.logprobs else [])
    ] == lp.tokens


def test_vllm_allowed_token_ids(client: openai.OpenAI, tokenizer: Any) -> None:
    """vLLM's ``allowed_token_ids``: every output token is one of them, sampled or greedy."""
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    for temperature in (0.0, 1.0):
        out = client.completions.create(
            model="default",
            prompt="Is the sky blue?",
            max_tokens=5,
            temperature=temperature,
            seed=1,
            extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
        )
        ids = out.choices[0].model_extra["token_ids"]
        assert len(ids) == 5 and set(ids) <= set(allowed)


def test_vllm_truncate_prompt_tokens(client: openai.OpenAI, tokenizer: Any, server: Any) -> None:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens only; -1 keeps what the
    context holds, so a prompt longer than the context is answered instead of refused."""
    prompt = "one two three four five six seven eight nine ten"
    ids = tokenizer.encode(prompt)
    out = client.completions.create(
        model="default",
        prompt=prompt,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True},
    )
    assert out.choices[0].model_extra["prompt_token_ids"] == ids[-5:]
    assert out.usage is not None and out.usage.prompt_tokens == 5
    context = client.models.list().data[0].model_extra.get("max_model_len")
    assert isinstance(context, int)
    long = [ids[1]] * (context + 10)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt=long, max_tokens=1)
    kept = client.completions.create(
        model="default", prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": -1}
    )
    assert kept.usage is not None and kept.usage.prompt_tokens == context - 1
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(
            model="default", prompt=prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": 0}
        )


def test_vllm_bad_words(client: openai.OpenAI, tokenizer: Any) -> None:
    """vLLM's ``bad_words``: a word the greedy answer spelled is not spelled again."""
    from radixserve.bad_words import encode_words

    kw: dict[str, Any] = dict(model="default", prompt="Once upon a time", max_tokens=8)
    extra = {"return_token_ids": True, "ignore_eos": True}
    first = client.completions.create(**kw, temperature=0, extra_body=extra)
    ids = first.choices[0].model_extra["token_ids"]
    word = next((w for w in (tokenizer.decode([t]).strip() for t in ids) if w), None)
    if word is None:
        pytest.skip("the greedy answer is blank")
    again = client.completions.create(
        **kw, temperature=0, extra_body={**extra, "bad_words": [word]}
    )
    out = again.choices[0].model_extra["token_ids"]
    for seq in encode_words(tokenizer, [word]):
        assert all(out[i : i + len(seq)] != seq for i in range(len(out))), (word, out)
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        client.completions.create(**kw, extra_body={"bad_words": ["x"] * 65})


def test_sglang_return_hidden_states(client: openai.OpenAI, server: Any, tokenizer: Any) -> None:
    """SGLang's ``return_hidden_states`` on the OpenAI routes: each choice's final-norm output
    at the position that gave its last token (transformers' over the prompt and the output
    but its last token), whole or in a chunk of its own after the choice's last; [] for a
    one-token choice, as SGLang gives; refused with beam search."""
    import torch
    from engine_helpers import hf_hidden_states

    prompt = "The capital of France is"
    extra = {"return_hidden_states": True, "return_token_ids": True, "ignore_eos": True}
    kw: Any = dict(model="default", temperature=0, extra_body=extra)
    out = client.completions.create(prompt=prompt, max_tokens=4, n=2, **kw)
    first = out.choices[0].model_extra  # greedy: both choices the same
    read = first["prompt_token_ids"] + first["token_ids"][:-1]
    ref = hf_hidden_states(server.model_dir, read)[-1]
    for c in out.choices:
        torch.testing.assert_close(
            torch.tensor(c.model_extra["hidden_states"]), ref, atol=1e-4, rtol=1e-4
        )
    pieces = list(client.completions.create(prompt=prompt, max_tokens=4, stream=True, **kw))
    carried = [
        ch.model_extra["hidden_states"]
        for c in pieces
        for ch in c.choices
        if ch.model_extra.get("hidden_states") is not None
    ]
    assert len(carried) == 1 and pieces[-1].choices[0].model_extra["hidden_states"] == carried[0]
    torch.testing.assert_close(torch.tensor(carried[0]), ref, atol=1e-4, rtol=1e-4)
    msgs: Any = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(messages=msgs, max_tokens=3, **kw)
    choice = chat.choices[0]
    rendered, answer = chat.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    ref = hf_hidden_states(server.model_dir, rendered + answer[:-1])[-1]
    torch.testing.assert_close(
        torch.tensor(choice.model_extra["hidden_states"]), ref, atol=1e-4, rtol=1e-4
    )
    chunks = list(client.chat.completions.create(messages=msgs, max_tokens=3, stream=True, **kw))
    last = chunks[-1].choices[0]
    assert chunks[-2].choices[0].finish_reason is not None and last.finish_reason is None
    assert last.delta.model_extra["hidden_states"] == choice.model_extra["hidden_states"]
    one = client.chat.completions.create(messages=msgs, max_tokens=1, **kw)
    assert one.choices[0].model_extra["hidden_states"] == []
    with pytest.raises(
        openai.BadRequestError, match="return_hidden_states is not supported with beam search"
    ):
        client.chat.completions.create(
            messages=msgs,
            max_tokens=2,
            **{**kw, "extra_body": {**extra, "use_beam_search": True}},
        )
