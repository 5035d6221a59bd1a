"""SGLang frontend programs against a radixserve HTTP server: ``python sglang_program.py URL``.

Runs in an interpreter that has the ``sglang`` package (its frontend language only; see
test_http_sglang_frontend.py) and prints one JSON object with what the programs produced.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import sglang as sgl


@sgl.function
def qa(s, question):  # type: ignore[no-untyped-def]
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))


@sgl.function
def qa_logprobs(s, question):  # type: ignore[no-untyped-def]
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(
        sgl.gen("answer", max_tokens=8, temperature=0, return_logprob=True, top_logprobs_num=2)
    )


@sgl.function
def at_least(s):  # type: ignore[no-untyped-def]
    s += "Count to three:" + sgl.gen(
        "c", max_tokens=5, min_tokens=5, temperature=0, stop=[" ", "."]
    )


@sgl.function
def pick(s):  # type: ignore[no-untyped-def]
    s += "Question: which city is the capital of France, the country with the Eiffel tower? Answer:"
    s += sgl.select("city", choices=[" Paris", " London", " Berlin"])


@sgl.function
def number(s):  # type: ignore[no-untyped-def]
    s += "A number: " + sgl.gen("n", max_tokens=6, regex="[0-9]+", temperature=0)


@sgl.function
def forked(s):  # type: ignore[no-untyped-def]
    s += "Two continuations of a shared prefix that is long enough to be cached in pages:"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" ({i})" + sgl.gen("x", max_tokens=4, temperature=0)
    s += "".join(f["x"] for f in forks)


async def _metas(state: Any, name: str) -> list[dict[str, Any]]:
    """The meta_info of each streamed piece of ``name`` (only the async iterator returns them)."""
    return [meta async for _, meta in state.text_async_iter(name, return_meta_data=True)]


def main() -> None:
    backend = sgl.RuntimeEndpoint(sys.argv[1], chat_template_name="chatml")
    sgl.set_default_backend(backend)
    out: dict[str, object] = {"model_path": backend.get_model_name()}
    state = qa.run(question="What is a radix tree?")
    out["answer"] = state["answer"]
    out["answer_meta"] = state.get_meta_info("answer")
    streamed = qa.run(question="What is a radix tree?", stream=True)
    out["streamed"] = "".join(streamed.text_iter("answer"))
    # Streaming with logprobs: every chunk's meta_info carries the counts and the logprobs so far.
    streamed_lp = qa_logprobs.run(question="What is a radix tree?", stream=True)
    metas = asyncio.run(_metas(streamed_lp, "answer"))
    out["streamed_lp"] = [
        {
            k: m.get(k)
            for k in (
                "completion_tokens",
                "output_token_logprobs",
                "output_top_logprobs",
                "output_token_logprobs_length",
            )
        }
        for m in metas
    ]
    unstreamed_lp = qa_logprobs.run(question="What is a radix tree?")
    out["unstreamed_lp"] = {
        k: v
        for k, v in (unstreamed_lp.get_meta_info("answer") or {}).items()
        if k in ("completion_tokens", "output_token_logprobs")
    }
    out["at_least"] = at_least.run().get_meta_info("c")["completion_tokens"]
    out["batch"] = [st["answer"] for st in qa.run_batch([{"question": "a?"}, {"question": "b?"}])]
    choice = pick.run()
    out["city"] = choice["city"]
    out["city_meta"] = {
        k: v
        for k, v in (choice.get_meta_info("city") or {}).items()
        if k in ("normalized_prompt_logprobs",)
    }
    out["number"] = number.run()["n"]
    out["forked"] = forked.run().text()
    backend.flush_cache()
    out["server_info_keys"] = sorted(backend.get_server_info())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
